"""A key-value cache for expensive samples: :class:`CacheLoader` and the dataset wrapper :class:`CachedDataset`.

The first read of a sample computes it (decoding, augmentation-free preprocessing, ...) and stores its pickled bytes;
every later read, in any process that uses the same store, is served from the cache. Two backends exist:

``"embedded"``
    An SQLite file in WAL mode (readers never wait for the writer), shared by every process of a node that opens the
    same file: the ``DataLoader`` workers and the ranks of a job. The file is ``kwargs["path"]`` when given (it then
    outlives the job, so a later run starts warm), otherwise ``<tmp>/lightning_bagua_cache/<job>/<dataset_name>.sqlite``
    where ``<job>`` comes from ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID`` or ``MASTER_PORT`` (the process id when none
    is set) and ``<tmp>`` is :func:`tempfile.gettempdir`; an automatic file is removed at exit by local rank 0.

``"redis"`` (the default, as in Bagua; needs ``pip install redis``)
    With ``hosts=[{"host": ..., "port": ...}, ...]``, keys are sharded over those servers by the CRC-32 of the key, a
    hash that every process computes alike. Without ``hosts``, local rank 0 of each node (``LOCAL_RANK``, default 0)
    starts a ``redis-server`` bound to 127.0.0.1 on ``kwargs["port"]`` (a free port when not given), with
    ``capacity_per_node`` bytes of memory (least recently used keys are evicted beyond it), and announces the port in a
    ready file next to the embedded backend's file; the other local ranks wait for it (``timeout`` seconds, default
    60). That server is stopped by :meth:`CacheLoader.close` or at exit. Each node then caches the samples its own
    ranks read; pass ``hosts`` to share one cache between nodes.

Writes are buffered: a process keeps up to ``writer_buffer_size`` new samples and writes them in one transaction
(one pipeline per Redis server), which costs much less than a write per sample. The buffer is also written by
:meth:`CacheLoader.flush`, :meth:`CacheLoader.close`, :meth:`CacheLoader.num_keys`, and when the process exits
(``DataLoader`` workers included), so a sample computed by one worker is a cache hit for the others at the latest
once that worker's buffer is full or the worker ends, e.g. in the next epoch.
"""

import contextlib
import json
import logging
import multiprocessing.util
import os
import pickle
import shutil
import socket
import sqlite3
import subprocess
import tempfile
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

__all__ = ["CacheLoader", "CachedDataset"]

log = logging.getLogger(__name__)

BACKENDS = ("embedded", "redis")
_DEFAULT_CAPACITY = 100 * 1024**3
# Connections inherited over fork(): SQLite forbids using or closing them in the child (closing could checkpoint or
# delete the parent's WAL), so they are kept here, untouched, for the child's lifetime.
_INHERITED_CONNECTIONS: list[Any] = []


def _job_directory() -> Path:
    # Ranks and workers of one job must agree on this directory without communicating, and jobs must not share it.
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or os.environ.get("MASTER_PORT")
    if not job:
        job = f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / "lightning_bagua_cache" / job


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _file_stem(dataset_name: str) -> str:
    # Dataset names become file names: keep them portable.
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in dataset_name)
    return cleaned or "default"


class _Store(ABC):
    """The byte-level store behind a :class:`CacheLoader`; reopens its connections in a new process."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """Return the bytes under ``key``, or ``None``."""

    @abstractmethod
    def put_many(self, items: dict[str, bytes]) -> None:
        """Store all ``items`` (keys already present may be overwritten with equal values)."""

    @abstractmethod
    def num_keys(self) -> int:
        """Return the number of keys in the store."""

    @abstractmethod
    def close(self) -> None:
        """Release this process's connections (and whatever the store owns)."""


class _SqliteStore(_Store):
    def __init__(self, path: str | os.PathLike | None, dataset_name: str, timeout: float) -> None:
        self.auto_path = path is None
        self.path = Path(path) if path is not None else _job_directory() / f"{_file_stem(dataset_name)}.sqlite"
        self.timeout = timeout
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.auto_path and _local_rank() == 0:
            multiprocessing.util.Finalize(None, _remove_sqlite_files, args=(str(self.path), self._pid), exitpriority=0)
        self._connect()  # creates the table once, here, instead of racing in the workers

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid != os.getpid():
            _INHERITED_CONNECTIONS.append(self._conn)
            self._conn = None
        if self._conn is None:
            self._pid = os.getpid()
            # isolation_level=None: transactions are explicit, so a batch of writes is exactly one transaction.
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # a cache may lose its last writes on power loss
            conn.execute("CREATE TABLE IF NOT EXISTS cache (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
            self._conn = conn
        return self._conn

    def get(self, key: str) -> bytes | None:
        row = self._connect().execute("SELECT value FROM cache WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def put_many(self, items: dict[str, bytes]) -> None:
        conn = self._connect()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT OR IGNORE INTO cache (key, value) VALUES (?, ?)", items.items())
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def num_keys(self) -> int:
        return int(self._connect().execute("SELECT COUNT(*) FROM cache").fetchone()[0])

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_conn": None}


def _remove_sqlite_files(path: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return
    for suffix in ("", "-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)
    _remove_if_empty(Path(path).parent)


def _remove_if_empty(directory: Path) -> None:
    # The job directory goes with its last file; another dataset's files keep it.
    with contextlib.suppress(OSError):
        directory.rmdir()


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as err:
        raise ImportError(
            "The 'redis' cache backend needs the `redis` Python package: `pip install redis` (or use "
            "backend='embedded', which needs no server)."
        ) from err
    return redis


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_redis(host: str, port: int, timeout: float, process: "subprocess.Popen | None" = None) -> Any:
    redis = _import_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    deadline = time.monotonic() + timeout
    # The probe makes one attempt per call: this loop, not redis-py's backoff, decides how long to wait.
    probe = redis.Redis(
        host=host, port=port, socket_connect_timeout=1.0, socket_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )
    while True:
        try:
            probe.ping()
            probe.close()
            return redis.Redis(host=host, port=port, socket_connect_timeout=timeout)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            # A listener that is not (yet) a Redis server may accept and never answer: that is a timeout.
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"redis-server on {host}:{port} exited with code {process.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis server {host}:{port} was not reachable within {timeout:g} s") from None
            time.sleep(0.05)


class _RedisServer:
    """A ``redis-server`` child process owned by the process that started it."""

    def __init__(self, port: int, capacity: int, timeout: float, log_path: Path, ready_path: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "The 'redis' cache backend without `hosts` starts a `redis-server`, which is not on PATH: install it "
                "(`apt-get install redis-server`), pass `hosts=[...]`, or use backend='embedded'."
            )
        self.port = port
        self.owner_pid = os.getpid()
        self.log_path = log_path
        self.ready_path = ready_path
        # No persistence (it is a cache) and LRU eviction at the capacity, so a full cache keeps working.
        args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", str(capacity), "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"]
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop(); the server writes to it meanwhile)
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.pid = self.process.pid
        try:
            _wait_for_redis("127.0.0.1", port, timeout, self.process)
        except (RuntimeError, TimeoutError) as err:
            # The server's own words (a port in use, a bad option) are the useful part: keep them in the error.
            tail = log_path.read_text(errors="replace")[-2000:]
            self.stop()
            raise type(err)(f"{err}; its log ends with:\n{tail}") from None
        except BaseException:
            self.stop()
            raise
        multiprocessing.util.Finalize(self, self.stop, exitpriority=0)
        log.info("Started redis-server (pid %d) on 127.0.0.1:%d", self.pid, port)

    def stop(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        _stop_process(self.process, self.owner_pid)
        self._log.close()
        self.ready_path.unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)
        _remove_if_empty(self.log_path.parent)


def _stop_process(process: subprocess.Popen, owner_pid: int) -> None:
    # Forked children inherit the Popen object; only the process that started the server may stop it.
    if os.getpid() != owner_pid or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class _RedisStore(_Store):
    def __init__(
        self,
        hosts: Sequence[dict[str, Any]] | None,
        dataset_name: str,
        port: int | None,
        capacity_per_node: int,
        timeout: float,
    ) -> None:
        _import_redis()
        self.timeout = timeout
        self.server: _RedisServer | None = None
        if hosts:
            self.hosts = [(str(h["host"]), int(h["port"])) for h in hosts]
        else:
            self.hosts = [("127.0.0.1", self._local_server(dataset_name, port, capacity_per_node))]
        self._clients: list[Any] = []
        self._pid = -1
        self._connect()

    def _local_server(self, dataset_name: str, port: int | None, capacity: int) -> int:
        directory = _job_directory()
        directory.mkdir(parents=True, exist_ok=True)
        ready = directory / f"redis-{_file_stem(dataset_name)}.json"
        if _local_rank() == 0:
            ready.unlink(missing_ok=True)  # a file left by an earlier job must not be mistaken for this one's
            log_path = directory / f"redis-{_file_stem(dataset_name)}.log"
            self.server = _RedisServer(port or _free_port(), capacity, self.timeout, log_path, ready)
            tmp = ready.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"port": self.server.port, "pid": self.server.pid}))
            os.replace(tmp, ready)  # atomic: readers never see a partial file
            return self.server.port
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                announced = int(json.loads(ready.read_text())["port"])
                # A stale file may name a server that is gone; keep waiting for local rank 0's until the deadline.
                _wait_for_redis("127.0.0.1", announced, min(1.0, max(deadline - time.monotonic(), 0.01)))
                return announced
            except (FileNotFoundError, ValueError, KeyError, TimeoutError):
                if time.monotonic() > deadline:
                    where = f"127.0.0.1:{port}" if port else f"the port announced in {ready}"
                    raise TimeoutError(
                        f"Local rank 0's redis-server on {where} was not reachable within {self.timeout:g} s"
                    ) from None
                time.sleep(0.05)

    def _connect(self) -> list[Any]:
        # redis-py clients must not cross fork(); every process makes its own.
        if self._pid != os.getpid():
            self._clients = [_wait_for_redis(host, port, self.timeout) for host, port in self.hosts]
            self._pid = os.getpid()
        return self._clients

    def _shard(self, key: str) -> int:
        # CRC-32 rather than hash(): str hashes are salted per process, so processes would disagree on the shard.
        return zlib.crc32(key.encode()) % len(self.hosts)

    def get(self, key: str) -> bytes | None:
        value = self._connect()[self._shard(key)].get(key)
        return None if value is None else bytes(value)

    def put_many(self, items: dict[str, bytes]) -> None:
        clients = self._connect()
        pipelines: dict[int, Any] = {}
        for key, value in items.items():
            shard = self._shard(key)
            if shard not in pipelines:
                pipelines[shard] = clients[shard].pipeline(transaction=False)
            pipelines[shard].set(key, value)
        for pipeline in pipelines.values():
            pipeline.execute()

    def num_keys(self) -> int:
        return sum(int(client.dbsize()) for client in self._connect())

    def close(self) -> None:
        if self._pid == os.getpid():
            for client in self._clients:
                client.close()
        self._clients, self._pid = [], -1
        if self.server is not None and self.server.owner_pid == os.getpid():
            self.server.stop()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled copy (a spawned DataLoader worker) connects to the same servers but owns none of them.
        return {**self.__dict__, "_clients": [], "_pid": -1, "server": None}


class _Writer:
    """Buffers a process's new entries; separate from CacheLoader so the exit hook does not keep the loader alive."""

    def __init__(self, store: _Store, size: int) -> None:
        self.store = store
        self.size = size
        self.buffer: dict[str, bytes] = {}
        self.pid = os.getpid()

    def add(self, key: str, value: bytes) -> None:
        self.buffer[key] = value
        if len(self.buffer) >= self.size:
            self.flush()

    def flush(self) -> None:
        if self.buffer and self.pid == os.getpid():
            items, self.buffer = self.buffer, {}
            self.store.put_many(items)


class CacheLoader:
    """Caches values by key in a store shared between processes; see the module documentation for the backends.

    Args:
        backend: ``"redis"`` or ``"embedded"``.
        dataset_name: prefixed to every key (``f"{dataset_name}_{key}"``), so data sets can share a store; it also
            names the embedded backend's file and the Redis ready file.
        writer_buffer_size: how many new entries a process buffers before writing them in one batch.
        **kwargs: backend options. ``embedded``: ``path`` (the SQLite file), ``timeout`` (seconds to wait for a lock,
            default 60). ``redis``: ``hosts`` (a list of ``{"host": ..., "port": ...}``), ``port`` and
            ``capacity_per_node`` (bytes, default 100 GiB) of the server started without ``hosts``, ``timeout``
            (seconds to wait for a server, default 60).

    Raises:
        ValueError: for an unknown ``backend``, a ``writer_buffer_size`` below 1, or unknown ``kwargs``.
        TypeError: for a ``writer_buffer_size`` that is not an int.
        ImportError: for ``backend="redis"`` without the ``redis`` package.
        FileNotFoundError: for ``backend="redis"`` without ``hosts`` when ``redis-server`` is not on ``PATH``.
        TimeoutError: when a Redis server is not reachable within ``timeout``.
    """

    def __init__(
        self, backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 20, **kwargs: Any
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"Unknown cache backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
        if isinstance(writer_buffer_size, bool) or not isinstance(writer_buffer_size, int):
            raise TypeError(
                f"writer_buffer_size must be an int, got {writer_buffer_size!r} ({type(writer_buffer_size).__name__})"
            )
        if writer_buffer_size < 1:
            raise ValueError(f"writer_buffer_size must be at least 1, got {writer_buffer_size}")
        allowed = {"embedded": {"path", "timeout"}, "redis": {"hosts", "port", "capacity_per_node", "timeout"}}
        unknown = set(kwargs) - allowed[backend]
        if unknown:
            raise ValueError(f"Unknown options for the {backend!r} backend: {sorted(unknown)}")
        self.backend = backend
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        timeout = float(kwargs.get("timeout", 60.0))
        self.store: _Store
        if backend == "embedded":
            self.store = _SqliteStore(kwargs.get("path"), dataset_name, timeout)
        else:
            capacity = int(kwargs.get("capacity_per_node", _DEFAULT_CAPACITY))
            self.store = _RedisStore(kwargs.get("hosts"), dataset_name, kwargs.get("port"), capacity, timeout)
        self._writer: _Writer | None = None
        self._closed = False

    def _process_writer(self) -> _Writer:
        # Each process (a forked or spawned DataLoader worker included) has its own buffer and its own exit hook:
        # fork clears multiprocessing's exit hooks in the child, and an inherited buffer belongs to the parent.
        if self._writer is None or self._writer.pid != os.getpid():
            self._writer = _Writer(self.store, self.writer_buffer_size)
            multiprocessing.util.Finalize(self, self._writer.flush, exitpriority=10)
        return self._writer

    def get(self, key: Any, load_fn: Callable[[Any], Any]) -> Any:
        """Return the value cached under ``f"{dataset_name}_{key}"``, computing and caching it on a miss.

        Args:
            key: the key (formatted with ``str``), e.g. a sample index.
            load_fn: called as ``load_fn(key)`` on a miss; its result must be picklable.

        Returns:
            The cached value (a fresh unpickled copy), or ``load_fn(key)`` itself on a miss.
        """
        if self._closed:
            raise RuntimeError("This CacheLoader is closed")
        full_key = f"{self.dataset_name}_{key}"
        writer = self._process_writer()
        data = writer.buffer.get(full_key)
        if data is None:
            data = self.store.get(full_key)
        if data is not None:
            # Unpickling runs code from the store: only point `hosts` or `path` at stores this job controls.
            return pickle.loads(data)
        value = load_fn(key)
        writer.add(full_key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        return value

    def flush(self) -> None:
        """Write this process's buffered entries to the store now."""
        if self._writer is not None:
            self._writer.flush()

    def num_keys(self) -> int:
        """Return the number of keys in the store (of every data set sharing it), after writing this process's buffer.

        Returns:
            The key count (summed over the shards for Redis).
        """
        self.flush()
        return self.store.num_keys()

    def close(self) -> None:
        """Write the buffer, close the connections, and stop the ``redis-server`` this process started, if any."""
        if self._closed:
            return
        self.flush()
        self.store.close()
        self._closed = True

    def __enter__(self) -> "CacheLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}


class CachedDataset(Dataset):
    """Serves ``dataset[index]`` through a :class:`CacheLoader` under the key ``f"{dataset_name}_{index}"``.

    Use it around a data set whose samples are expensive to produce and identical every epoch (random augmentation
    belongs after the cache). Every ``DataLoader`` worker of the node shares the cache.

    Args:
        dataset: a map-style dataset with ``len()``.
        backend: ``"redis"`` or ``"embedded"``.
        dataset_name: the key prefix; give data sets that share a store different names.
        writer_buffer_size: how many new samples a process buffers before writing them in one batch.
        **kwargs: backend options, see :class:`CacheLoader`.
    """

    def __init__(
        self,
        dataset: Any,
        backend: str = "redis",
        dataset_name: str = "",
        writer_buffer_size: int = 20,
        **kwargs: Any,
    ) -> None:
        self.dataset = dataset
        self.cache_loader = CacheLoader(
            backend=backend, dataset_name=dataset_name, writer_buffer_size=writer_buffer_size, **kwargs
        )

    def _load(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitem__(self, index: int) -> Any:
        return self.cache_loader.get(index, self._load)

    def __len__(self) -> int:
        return len(self.dataset)

    def close(self) -> None:
        """Close the cache loader (see :meth:`CacheLoader.close`)."""
        self.cache_loader.close()
