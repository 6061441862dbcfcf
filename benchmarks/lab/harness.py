"""How the benchmarks run: round order, ports, local process groups, NCCL over sockets, namespaces and links.

- :func:`interleaved`: every method once per round, each round rotated by one (:func:`rotated`).
- :func:`free_port`, :func:`spawn_ranks`: a process group of ``world_size`` local processes, one result back.
- :data:`SOCKETS_ENV`: NCCL over TCP sockets on the loopback, as between machines.
- :func:`lab_hosts`: network namespaces joined by links that ``tc`` shapes to a rate (:func:`shape`), as hosts on
  a network; it needs root and iproute2 (:func:`require_lab_tools`).
- :func:`check_links`: single messages timed over those links (:func:`probe` at each end), :func:`links_table`.
- :func:`result_lines`, :func:`headline`: what a worker printed, and the line of an error that names the cause.
"""

import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# NCCL over TCP sockets on the loopback, as between machines (the GPU lab's ``sockets`` regime).
SOCKETS_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}
FRAME_BYTES = 1514  # an Ethernet frame at an MTU of 1500, with its header
BURST_US = 100.0  # a link's token bucket in microseconds of its time (link_burst_bytes)


# ------------------------------------------------------------------------------------------------ the order


def rotated(items: Sequence[T], index: int) -> list[T]:
    """Round ``index``'s order of ``items``: the list started ``index`` places later (wrapping round)."""
    shift = index % len(items)
    return [*items[shift:], *items[:shift]]


def interleaved(methods: list[str], rounds: int) -> list[tuple[int, str]]:
    """The measuring order: every method once per round, each round starting one method later than the last.

    Rotating the order keeps a method from always following the same neighbour (a slow one that heats the
    machine, or one whose sockets are still draining).
    """
    return [(index, method) for index in range(rounds) for method in rotated(methods, index)]


# ------------------------------------------------------------------------------------------------ local jobs


def free_port() -> int:
    """Return a TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 1800) -> Any:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` spawned processes; return rank 0's return value.

    Each process finds ``MASTER_ADDR`` and ``MASTER_PORT`` set to a free local port, so ``worker`` only calls
    ``init_process_group(backend, rank=rank, world_size=world_size)``. A rank that fails fails the call.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_run_rank, args=(worker, rank, world_size, port, queue, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        result = queue.get(timeout=timeout_s)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
    if failed or isinstance(result, BaseException):
        raise RuntimeError(f"ranks {failed} of {world_size} failed: {result!r}")
    return result


def _run_rank(
    worker: Callable[..., Any], rank: int, world_size: int, port: int, queue: Any, args: tuple[Any, ...]
) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        result = worker(rank, world_size, *args)
    except BaseException as error:
        queue.put(RuntimeError(f"rank {rank}: {type(error).__name__}: {error}"))
        raise
    if rank == 0:
        queue.put(result)


def result_lines(output: str, tag: str) -> list[dict[str, Any]]:
    """The JSON objects a worker printed as ``TAG {...}`` lines."""
    return [json.loads(line[len(tag) + 1 :]) for line in output.splitlines() if line.startswith(tag + " ")]


def headline(error: str) -> str:
    """The line of an error report that names the cause: the first that mentions an error, else the last."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    causes = [line for line in lines if "rror" in line or "enforce fail" in line]
    return (causes or lines or [""])[0][:300]


# ------------------------------------------------------------------------------------------------ links


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def bits_per_second(rate: str) -> int:
    """``"100mbit"`` -> ``100_000_000``, as ``tc`` reads a rate."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"Unknown rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit, or 'unshaped'.")


def link_burst_bytes(rate: str, burst_us: float = BURST_US) -> int:
    """The token bucket of a link of ``rate``: ``burst_us`` of the link's time, and at least two full frames.

    A real link never sends faster than its rate, but after an idle spell ``tbf`` lets a full bucket out at the
    veth's speed. A step's messages come after such a spell (the compute between steps), so the bucket decides how
    long a message smaller than it takes: a bucket of ``burst_us`` bounds that gain to ``burst_us`` per message (two
    frames, where they take longer), and lets TCP keep a 1 Gbit/s link busy. ``python benchmarks/network_lab.py
    --check-links`` measures it.
    """
    return max(2 * FRAME_BYTES, int(bits_per_second(rate) * burst_us / 8e6))


def shape(namespace: str, interface: str, rate: str, burst_us: float = BURST_US) -> None:
    """Limit what ``interface`` (in ``namespace``) sends to ``rate``; ``unshaped`` leaves it alone."""
    if rate == "unshaped":
        return
    burst = link_burst_bytes(rate, burst_us)
    run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
        "rate", rate, "burst", str(burst), "latency", "100ms")  # fmt: skip


LAB_TOOLS = "root, iproute2 and tc (network namespaces and shaping)"


def can_shape_links() -> bool:
    """Whether this process may create namespaces and shape links (:func:`lab_hosts`): root, ``ip`` and ``tc``."""
    return os.geteuid() == 0 and shutil.which("tc") is not None and shutil.which("ip") is not None


def require_lab_tools(script: str) -> None:
    """Stop with a message unless this process may create namespaces and shape links (:func:`can_shape_links`).

    Args:
        script: the script that needs them, named in the message.
    """
    if not can_shape_links():
        raise SystemExit(f"{script} needs {LAB_TOOLS}.")


@contextmanager
def lab_hosts(rate: str, count: int, burst_us: float = BURST_US) -> Iterator[list[tuple[str, str, str]]]:
    """Create ``count`` namespaces joined by links shaped to ``rate``; yield (namespace, interface, address).

    Each host has an address of its own in 127.81.0.0/16, routed over its link with ``route_localnet``. Two hosts
    share one veth pair. More hosts each get a veth pair to a bridge in a switch namespace, both ends shaped: a
    host's uplink and its downlink are each a link of the rate, as with a port of a switch.
    """
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    subnet = random.randrange(1, 250)
    hosts = [(f"lbl{tag}h{i}", f"lbl{tag}v{i}", f"127.81.{subnet}.{i + 1}") for i in range(count)]
    switch = f"lbl{tag}sw"
    namespaces = [namespace for namespace, _, _ in hosts] + ([switch] if count > 2 else [])
    try:
        for namespace in namespaces:
            run("ip", "netns", "add", namespace)
        if count == 2:
            run("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        else:
            run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", switch, "link", "set", "br0", "up")
            for index, (_, interface, _) in enumerate(hosts):
                port = f"lbl{tag}p{index}"
                run("ip", "link", "add", interface, "type", "veth", "peer", "name", port)
                run("ip", "link", "set", port, "netns", switch)
                run("ip", "-n", switch, "link", "set", port, "master", "br0")
                run("ip", "-n", switch, "link", "set", port, "up")
                shape(switch, port, rate, burst_us)
        for namespace, interface, address in hosts:
            run("ip", "link", "set", interface, "netns", namespace)
            for scope in ("all", interface):
                run("ip", "netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.conf.{scope}.route_localnet=1")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            run("ip", "-n", namespace, "link", "set", interface, "up")
            shape(namespace, interface, rate, burst_us)
        yield hosts
    finally:
        for namespace in namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


# ------------------------------------------------------------------------------------------------ the link check

PROBE_SIZES = (4_000, 16_000, 64_000, 256_000, 1_000_000, 4_000_000)  # bytes of one message
PROBE_REPEATS = 7
PROBE_IDLE_S = 0.05  # the pause before each message, as the compute between two steps
# Each end of the link check runs in its host's namespace: a fresh interpreter that imports this module.
PROBE_CODE = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r});"
              " from lab.harness import probe; probe(sys.argv[1], sys.argv[2], int(sys.argv[3]))")  # fmt: skip


def probe(role: str, address: str, port: int) -> None:
    """Run one end of the link check; the client prints ``PROBE`` lines, one per message size.

    The client sends each message of ``PROBE_SIZES`` ``PROBE_REPEATS`` times, each after ``PROBE_IDLE_S`` idle,
    and times it from its first byte to the server's one-byte reply, which comes once the whole message is in.

    Args:
        role: ``"server"`` (listens at ``address``) or ``"client"`` (connects to it).
        address: the server's address.
        port: the server's port.
    """
    if role == "server":
        with socket.create_server((address, port)) as server:
            connection, _ = server.accept()
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for size in PROBE_SIZES:
                    for _ in range(PROBE_REPEATS):
                        received = 0
                        while received < size:
                            chunk = connection.recv(1 << 20)
                            if not chunk:  # the client is gone: an empty read would repeat forever
                                raise ConnectionError(f"the link check's client left after {received} of {size} bytes")
                            received += len(chunk)
                        connection.sendall(b"k")
        return
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((address, port), timeout=30)
            break
        except OSError:  # the server is not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in PROBE_SIZES:
            message, times = bytes(size), []
            for _ in range(PROBE_REPEATS):
                time.sleep(PROBE_IDLE_S)
                start = time.perf_counter()
                connection.sendall(message)
                connection.recv(1)
                times.append(time.perf_counter() - start)
            print("PROBE " + json.dumps({"size": size, "times_s": times}), flush=True)


def _probe_times(rate: str, burst_us: float) -> str:
    """Run both ends of the link check over a fresh link between two hosts; return the client's output."""
    with lab_hosts(rate, 2, burst_us) as hosts:
        port = random.randrange(20000, 60000)
        ends = {role: ["ip", "netns", "exec", namespace, sys.executable, "-c", PROBE_CODE, role, hosts[1][2], str(port)]
                for role, (namespace, _, _) in zip(("client", "server"), hosts, strict=True)}  # fmt: skip
        server = subprocess.Popen(ends["server"])
        try:
            return subprocess.run(ends["client"], capture_output=True, text=True, check=True, timeout=600).stdout
        finally:
            if server.poll() is None:
                server.kill()  # the client failed: nothing more will come
            server.wait()


def check_links(rates: Sequence[str], bursts_us: Sequence[float], command: str) -> dict[str, Any]:
    """Time single messages over a link of every rate and token bucket; return the report.

    Args:
        rates: ``tc`` rates, or ``unshaped`` (which has no bucket).
        bursts_us: the buckets to try at each shaped rate, in microseconds of the link's time.
        command: the command that reproduces the report.

    Returns:
        The report: a row per (rate, bucket, message size), with the median, least and greatest time.
    """
    # Imported here: this module is also imported as ``benchmarks.lab.harness``, where ``lab`` is no package.
    from lab.results import stamp

    require_lab_tools("The link check")
    rows = []
    for rate in rates:
        for burst_us in bursts_us if rate != "unshaped" else [None]:
            output = _probe_times(rate, burst_us or BURST_US)
            for line in result_lines(output, "PROBE"):
                times = line["times_s"]
                rows.append({
                    "rate": rate,
                    "burst_us": burst_us,
                    "burst_bytes": None if burst_us is None else link_burst_bytes(rate, burst_us),
                    "size": line["size"],
                    "median_s": statistics.median(times),
                    "min_s": min(times),
                    "max_s": max(times),
                    "rate_bound_s": None if rate == "unshaped" else line["size"] * 8 / bits_per_second(rate),
                })  # fmt: skip
    settings = {"rates": list(rates), "bursts_us": list(bursts_us), "sizes": list(PROBE_SIZES),
                "repeats": PROBE_REPEATS, "idle_s": PROBE_IDLE_S}  # fmt: skip
    benchmark = "link check: one message at a time over the lab's shaped link between two hosts"
    return {"benchmark": benchmark, **stamp(command), "settings": settings, "results": rows}


def links_table(report: dict[str, Any]) -> str:
    """Return the link check as markdown: a column per (rate, bucket), a row per message size.

    Args:
        report: what :func:`check_links` returned.

    Returns:
        The table with the sentences that say what it shows and what wrote it.
    """
    from lab.render import markdown_table

    columns = list(dict.fromkeys((row["rate"], row["burst_us"]) for row in report["results"]))
    by_key = {(row["rate"], row["burst_us"], row["size"]): row for row in report["results"]}
    settings = report["settings"]
    rows = []
    for size in settings["sizes"]:
        cells = [f"{size / 1e3:g} kB"]
        for rate, burst in columns:
            row = by_key[(rate, burst, size)]
            cell = f"{row['median_s'] * 1e3:.2f} [{row['min_s'] * 1e3:.2f}, {row['max_s'] * 1e3:.2f}]"
            bound = row["rate_bound_s"]
            cells.append(cell if bound is None else f"{cell} (size / rate {bound * 1e3:.2f})")
        rows.append(cells)
    header = ["message", *(rate if burst is None else f"{rate}, bucket {burst:g} us" for rate, burst in columns)]
    return "\n".join([
        "Time of one message from its first byte sent to the receiver's one-byte reply, after"
        f" {settings['idle_s'] * 1e3:g} ms idle: median of {settings['repeats']} [min, max] in ms; `size / rate` is"
        " the least time the link's rate allows for the message's bytes alone. The bucket is `tbf`'s, in"
        " microseconds of the link's time (`link_burst_bytes`).",
        f"Written by `{report['command']}`; the numbers are in `network_lab_links.json`.",
        "",
        markdown_table(header, rows),
    ])  # fmt: skip
