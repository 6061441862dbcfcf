import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_bagua.data import cache as cache_module
from lightning_bagua.data.cache import CachedDataset, CacheLoader


def _require_redis_server() -> None:
    # GitHub Actions sets CI=true and installs redis-server (Makefile setup): there a missing server is a failure.
    missing = []
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("the `redis` package (pip install redis)")
    if shutil.which("redis-server") is None:
        missing.append("redis-server (apt-get install redis-server)")
    if missing:
        message = "needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


needs_redis = pytest.mark.usefixtures("_redis_available")


@pytest.fixture
def _redis_available() -> None:
    _require_redis_server()


@pytest.fixture(autouse=True)
def _isolated_job(tmp_path, monkeypatch):
    # Each test is its own "job": its own automatic cache directory, under tmp_path.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("MASTER_PORT", f"job{os.getpid()}{time.monotonic_ns()}")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once its state is Z.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


class CountingDataset(Dataset):
    """An "expensive" dataset that appends a line to a file per computed sample (works across processes)."""

    def __init__(self, n: int, log_file: Path) -> None:
        self.n = n
        self.log_file = str(log_file)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        with open(self.log_file, "a") as f:
            f.write(f"{index} {os.getpid()}\n")
        generator = torch.Generator().manual_seed(index)
        return {"x": torch.randn(4, generator=generator), "index": index}

    def calls(self) -> list[int]:
        if not os.path.exists(self.log_file):
            return []
        return [int(line.split()[0]) for line in Path(self.log_file).read_text().splitlines()]

    def pids(self) -> set[int]:
        return {int(line.split()[1]) for line in Path(self.log_file).read_text().splitlines()}


def _backend_kwargs(backend: str, tmp_path: Path) -> dict:
    if backend == "embedded":
        return {"path": tmp_path / "cache.sqlite"}
    _require_redis_server()
    return {"port": _free_port()}


BACKENDS = ["embedded", "redis"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_and_num_keys(backend, tmp_path):
    loader = CacheLoader(backend, dataset_name="ds", writer_buffer_size=3, **_backend_kwargs(backend, tmp_path))
    try:
        calls = []

        def load(key):
            calls.append(key)
            return {"key": key, "t": torch.arange(3) * key}

        first = loader.get(5, load)
        assert calls == [5]
        again = loader.get(5, load)  # from this process's write buffer
        assert calls == [5]
        assert again["key"] == 5
        assert torch.equal(again["t"], first["t"])
        assert loader.store.get("ds_5") is None  # buffered, not yet written
        loader.get(6, load)
        loader.get(7, load)  # third new entry: the buffer is written
        assert loader.store.get("ds_5") is not None
        assert loader.num_keys() == 3
        loader.get(8, load)
        assert loader.num_keys() == 4  # num_keys writes the buffer first
        for key in (5, 6, 7, 8):
            assert torch.equal(loader.get(key, load)["t"], torch.arange(3) * key)
        assert calls == [5, 6, 7, 8]
        assert loader.get("a", lambda key: key * 2) == "aa"
        assert loader.get("a", load) == "aa"
    finally:
        loader.close()


def test_embedded_shared_between_loaders_and_persistent_path(tmp_path):
    path = tmp_path / "shared.sqlite"
    with CacheLoader("embedded", dataset_name="a", writer_buffer_size=1, path=path) as one:
        one.get(1, lambda key: "one")
        other = CacheLoader("embedded", dataset_name="a", path=path)
        assert other.get(1, lambda key: pytest.fail("must be a hit")) == "one"
        other_name = CacheLoader("embedded", dataset_name="b", path=path)
        assert other_name.get(1, lambda key: "b") == "b"  # the prefix separates data sets
        other.close()
        other_name.close()
    # An explicit path outlives the loader: a later run starts warm.
    with CacheLoader("embedded", dataset_name="a", path=path) as later:
        assert later.get(1, lambda key: pytest.fail("must be a hit")) == "one"
        assert later.num_keys() == 2


def test_embedded_automatic_path_is_per_job(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "12345")
    loader = CacheLoader("embedded", dataset_name="my data/set")
    loader.get(0, lambda key: 0)
    loader.close()
    expected = tmp_path / "tmp" / "lightning_bagua_cache" / "12345" / "my_data_set.sqlite"
    assert Path(loader.store.path) == expected
    assert expected.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_dataset_serves_identical_samples_once(backend, tmp_path):
    base = CountingDataset(10, tmp_path / "calls.txt")
    dataset = CachedDataset(base, backend=backend, dataset_name="count", **_backend_kwargs(backend, tmp_path))
    try:
        assert len(dataset) == 10
        for _ in range(3):
            for i in range(10):
                sample = dataset[i]
                expected = torch.randn(4, generator=torch.Generator().manual_seed(i))
                assert sample["index"] == i
                assert torch.equal(sample["x"], expected)
        assert sorted(base.calls()) == list(range(10))
        assert dataset.cache_loader.num_keys() == 10
    finally:
        dataset.close()


@pytest.mark.parametrize(
    ("backend", "context"), [("embedded", "fork"), ("redis", "fork"), ("embedded", "spawn"), ("redis", "spawn")]
)
def test_dataloader_workers_share_the_cache(backend, context, tmp_path):
    n = 24
    base = CountingDataset(n, tmp_path / "calls.txt")
    # A buffer larger than a worker's share: entries reach the store only when the worker exits.
    dataset = CachedDataset(
        base, backend=backend, dataset_name="dl", writer_buffer_size=100, **_backend_kwargs(backend, tmp_path)
    )
    try:
        seen = []
        for epoch in range(2):
            loader = DataLoader(
                dataset,
                batch_size=4,
                shuffle=True,
                num_workers=2,
                multiprocessing_context=context,
                generator=torch.Generator().manual_seed(epoch),
            )
            epoch_samples = {}
            for batch in loader:
                for index, x in zip(batch["index"].tolist(), batch["x"], strict=True):
                    epoch_samples[index] = x
            seen.append(epoch_samples)
            if epoch == 0:
                # Each index was computed exactly once, by one of the workers; both workers did some.
                assert sorted(base.calls()) == list(range(n))
                assert len(base.pids() - {os.getpid()}) == 2
                assert dataset.cache_loader.num_keys() == n
        # The second epoch (new workers, another order) is served entirely from the cache.
        assert sorted(base.calls()) == list(range(n))
        assert seen[0].keys() == seen[1].keys() == set(range(n))
        for index in range(n):
            assert torch.equal(seen[0][index], seen[1][index])
        # The main process sees the workers' entries too.
        assert dataset[3]["index"] == 3
        assert sorted(base.calls()) == list(range(n))
    finally:
        dataset.close()


@needs_redis
def test_redis_server_started_and_stopped_by_the_library(tmp_path, monkeypatch):
    port = _free_port()
    loader = CacheLoader("redis", dataset_name="srv", port=port)
    server = loader.store.server
    assert server is not None
    pid = server.pid
    assert _alive(pid)
    ready = cache_module._job_directory() / "redis-srv.json"
    assert ready.exists()
    loader.get(1, lambda key: "v")
    # Another local rank of the node finds the server through the ready file and starts none.
    monkeypatch.setenv("LOCAL_RANK", "1")
    follower = CacheLoader("redis", dataset_name="srv", timeout=5)
    assert follower.store.server is None
    assert follower.store.hosts == [("127.0.0.1", port)]
    assert follower.num_keys() == 0  # loader's entry is still in its buffer
    loader.flush()
    assert follower.get(1, lambda key: pytest.fail("must be a hit")) == "v"
    follower.close()
    assert _alive(pid)  # a follower does not own the server
    loader.close()
    assert not _alive(pid)
    assert not ready.exists()
    loader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        loader.get(1, lambda key: key)


@needs_redis
def test_redis_server_stopped_at_exit(tmp_path):
    script = (
        "import sys\n"
        "from lightning_bagua.data.cache import CacheLoader\n"
        "loader = CacheLoader('redis', dataset_name='exit')\n"
        "loader.get(1, lambda key: key)\n"
        "print(loader.store.server.pid, flush=True)\n"
    )
    env = {**os.environ, "MASTER_PORT": f"exit{time.monotonic_ns()}", "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.split()[-1])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    # The automatic embedded file of a job is removed at exit as well.
    script = "from lightning_bagua.data.cache import CacheLoader\nprint(CacheLoader('embedded').store.path)\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).exists()


@pytest.fixture
def two_redis_servers(_redis_available, tmp_path):
    processes, ports = [], []
    try:
        for _ in range(2):
            port = _free_port()
            processes.append(
                subprocess.Popen(
                    ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", str(tmp_path)],
                    stdout=subprocess.DEVNULL,
                )
            )
            ports.append(port)
        yield ports
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def test_redis_sharding_over_two_servers(two_redis_servers):
    import redis

    hosts = [{"host": "127.0.0.1", "port": port} for port in two_redis_servers]
    loader = CacheLoader("redis", dataset_name="shard", writer_buffer_size=7, hosts=hosts, timeout=10)
    assert loader.store.server is None  # hosts given: no server of its own
    for i in range(50):
        assert loader.get(i, lambda key: key * key) == i * i
    assert loader.num_keys() == 50
    clients = [redis.Redis(host="127.0.0.1", port=port) for port in two_redis_servers]
    sizes = [client.dbsize() for client in clients]
    assert sum(sizes) == 50
    assert min(sizes) > 0
    # Each key lives on the server its CRC-32 names, so every process agrees on where to look.
    for i in range(50):
        key = f"shard_{i}"
        owner = zlib.crc32(key.encode()) % 2
        assert clients[owner].exists(key)
        assert not clients[1 - owner].exists(key)
    other = CacheLoader("redis", dataset_name="shard", hosts=hosts)
    assert [other.get(i, lambda key: pytest.fail("must be a hit")) for i in range(50)] == [i * i for i in range(50)]
    other.close()
    loader.close()
    for client in clients:
        client.close()


def test_unknown_backend_and_options():
    with pytest.raises(ValueError, match=r"'embedded', 'redis'"):
        CacheLoader("memcached")
    with pytest.raises(ValueError, match="writer_buffer_size"):
        CacheLoader("embedded", writer_buffer_size=0)
    with pytest.raises(ValueError, match="hosts"):
        CacheLoader("embedded", hosts=[])


def test_redis_package_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match="pip install redis"):
        CacheLoader("redis")


@needs_redis
def test_redis_server_binary_missing(monkeypatch):
    monkeypatch.setattr(cache_module.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="apt-get install redis-server"):
        CacheLoader("redis")


@needs_redis
def test_redis_unreachable(monkeypatch):
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        CacheLoader("redis", hosts=[{"host": "127.0.0.1", "port": port}], timeout=0.5)
    assert time.monotonic() - start < 5
    # A non-zero local rank whose local rank 0 never announces a server.
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(TimeoutError, match="Local rank 0"):
        CacheLoader("redis", dataset_name="nobody", timeout=0.5)


@needs_redis
def test_redis_server_failing_to_start(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"redis-server on 127.0.0.1:{port} exited"):
            CacheLoader("redis", dataset_name="busy", port=port, timeout=10)
    # Nothing of the failed server is left behind.
    assert not cache_module._job_directory().exists()
