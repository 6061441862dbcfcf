"""CPU network lab: Gloo ranks on network-namespace hosts joined by rate-limited links.

Each host is a network namespace with an address of its own in 127.81.0.0/16 (routed over its link with
``route_localnet``). Two hosts are joined by a veth pair; more hosts each have a veth to a bridge in a switch
namespace. ``tc`` shapes both ends of every link with a token bucket, so every collective that leaves a host
crosses a link of the chosen rate, as between machines; ranks of one host talk inside its namespace, unshaped,
as the GPUs of one machine would. For each rate, every method trains the same model for the same steps on every
rank, and the median step time (after a warm-up) and the payload bytes per step are recorded:

- ``single``: one process, no communication (the no-communication limit, run outside the namespaces);
- ``ddp``: torch's DistributedDataParallel, the engine under Lightning's ``strategy="ddp"``;
- ``ddp_fp16``: DDP with torch's ``fp16_compress_hook``;
- ``ddp_powersgd``: DDP with torch's PowerSGD hook (rank 1, after two uncompressed steps);
- every algorithm of :mod:`lightning_bagua.engine` under ``BaguaDistributedDataParallel``, with its defaults;
  with several ranks per host, each algorithm that takes ``hierarchical`` runs twice instead, as
  ``name:flat`` and ``name:hierarchical`` (reduce inside the host, communicate between hosts' leaders only).

Run it as root (namespaces and ``tc`` need it)::

    python benchmarks/network_lab.py                         # 100 Mbit/s, 1 Gbit/s, 10 Gbit/s and unshaped
    python benchmarks/network_lab.py --rates 1gbit --steps 5 --methods ddp bytegrad   # a quick look
    python benchmarks/network_lab.py --ranks-per-host 2 --rates 1gbit 100mbit          # 4 ranks, 2 nodes x 2
    python benchmarks/network_lab.py --hosts 4 --methods ddp decentralized             # 4 ranks, 4 nodes x 1
    python benchmarks/network_lab.py --no-local-world-size --rates 100mbit --methods ddp bytegrad

The ranks rendezvous through ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) and get
``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun sets them; with ``--no-local-world-size`` they do not, as
under a plain ``env://`` launcher, and the engine derives the node layout from the hosts the ranks run on.

It writes ``benchmarks/results/network_lab_cpu.json`` (settings, machine, versions, every measurement) and
``network_lab_cpu.md`` (the table: step time and its ratio to DDP's), and ``network_lab_cpu.png`` when
matplotlib is installed (``pip install -r requirements/benchmarks.txt``). Other layouts than 2 hosts x 1 rank
write ``network_lab_cpu_<hosts>x<ranks per host>.*`` instead, so the two-rank results are never overwritten, and
runs without ``LOCAL_WORLD_SIZE`` add ``_hosts`` to the name.
"""

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
DDP_METHODS = ("ddp", "ddp_fp16", "ddp_powersgd")
RATES = ("100mbit", "1gbit", "10gbit", "unshaped")


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def all_methods(ranks_per_host: int = 1) -> list[str]:
    """Every method; with several ranks per host, hierarchical-capable algorithms as ``:flat`` and ``:hierarchical``."""
    from lightning_bagua.engine import available_algorithms
    from lightning_bagua.engine.algorithms.base import algorithm_class

    methods = ["single", *DDP_METHODS]
    for name in available_algorithms():
        # With one rank per host every rank is its node's leader, and both variants would move the same bytes.
        if ranks_per_host > 1 and "hierarchical" in algorithm_class(name).keywords():
            methods += [f"{name}:flat", f"{name}:hierarchical"]
        else:
            methods.append(name)
    return methods


def layout_name(hosts: int, ranks_per_host: int, from_hosts: bool = False) -> str:
    """The result files' stem: the two-rank lab keeps its original name."""
    stem = "network_lab_cpu" if (hosts, ranks_per_host) == (2, 1) else f"network_lab_cpu_{hosts}x{ranks_per_host}"
    return f"{stem}_hosts" if from_hosts else stem


# ------------------------------------------------------------------------------------------------ one rank


def wrap(method: str, model: nn.Module, warmup: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Return the wrapped model, its optimizer and the engine's communication counter (``None`` for DDP)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, QAdamOptimizer

    if method.partition(":")[0] == "qadam":
        # Measured after its warm-up, in the compressed phase that the algorithm is chosen for.
        optimizer: torch.optim.Optimizer = QAdamOptimizer(model.parameters(), lr=1e-4, warmup_steps=warmup)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if method == "single":
        return model, optimizer, None
    if method in DDP_METHODS:
        ddp = DistributedDataParallel(model, bucket_cap_mb=10)
        if method == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "ddp_powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, optimizer, None
    name, _, variant = method.partition(":")
    keywords = {"hierarchical": variant == "hierarchical"} if variant else {}
    wrapped = BaguaDistributedDataParallel(model, optimizers=[optimizer], algorithm=Algorithm.init(name, **keywords))
    return wrapped, optimizer, wrapped.communication_counter


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.method != "single":
        os.environ.update(
            {"MASTER_ADDR": args.master, "MASTER_PORT": str(args.port), "RANK": str(args.rank)}
            | {"WORLD_SIZE": str(args.world_size)}
        )
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    model = make_model(args.width, args.depth)
    wrapped, optimizer, counter = wrap(args.method, model, args.warmup)
    generator = torch.Generator().manual_seed(args.rank)
    inputs = torch.randn(args.batch, args.width, generator=generator)
    targets = torch.randn(args.batch, 1, generator=generator)
    times: list[float] = []
    bytes_before = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            bytes_before = counter.bytes_sent if counter is not None else 0
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(wrapped(inputs), targets)
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if counter is not None:
        bytes_per_step: float | None = (counter.bytes_sent - bytes_before) / args.steps
    elif args.method == "ddp":
        bytes_per_step = parameter_bytes
    elif args.method == "ddp_fp16":
        bytes_per_step = parameter_bytes / 2
    else:
        bytes_per_step = None  # PowerSGD's payload depends on the layer shapes; not counted here
    # The node layout the engine used (from LOCAL_WORLD_SIZE, or found from the hosts without it).
    groups = getattr(wrapped, "communication_groups", None)
    layout = None if groups is None else [groups.layout.num_nodes, groups.layout.ranks_per_node, groups.layout.source]
    if args.method != "single":
        if hasattr(wrapped, "close"):
            wrapped.close()
        dist.destroy_process_group()
    result = {
        "rank": args.rank,
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "bytes_per_step": bytes_per_step,
        "parameter_bytes": parameter_bytes,
        "engine_layout": layout,
    }
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ the lab


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def shape(namespace: str, interface: str, rate: str) -> None:
    """Limit what ``interface`` (in ``namespace``) sends to ``rate``; ``unshaped`` leaves it alone."""
    if rate == "unshaped":
        return
    # A token bucket of 10 ms at the rate (at least 64 KiB) lets TCP fill the link without bursting past it.
    burst = max(64 * 1024, _bits_per_second(rate) // 8 // 100)
    run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
        "rate", rate, "burst", str(burst), "latency", "100ms")  # fmt: skip


@contextmanager
def lab_hosts(rate: str, count: int) -> Iterator[list[tuple[str, str, str]]]:
    """Create ``count`` namespaces joined by links shaped to ``rate``; yield (namespace, interface, address).

    Two hosts share one veth pair. More hosts each get a veth pair to a bridge in a switch namespace, both ends
    shaped: a host's uplink and its downlink are each a link of the rate, as with a port of a switch.
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
                shape(switch, port, rate)
        for namespace, interface, address in hosts:
            run("ip", "link", "set", interface, "netns", namespace)
            for scope in ("all", interface):
                run("ip", "netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.conf.{scope}.route_localnet=1")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            run("ip", "-n", namespace, "link", "set", interface, "up")
            shape(namespace, interface, rate)
        yield hosts
    finally:
        for namespace in namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def _bits_per_second(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"Unknown rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit, or 'unshaped'.")


def worker_command(args: argparse.Namespace, method: str, rank: int, master: str, port: int) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method, "--rank", str(rank)]
    command += ["--master", master, "--port", str(port), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    return [*command, "--timeout", str(args.timeout), "--world-size", str(args.hosts * args.ranks_per_host)]


def parse_results(outputs: list[str], method: str) -> list[dict[str, Any]]:
    results = []
    for output in outputs:
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"{method}: a worker printed no result:\n{output[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def measure(args: argparse.Namespace, rate: str, method: str, hosts: list[tuple[str, str, str]]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    if method == "single":
        command = worker_command(args, method, 0, "127.0.0.1", 0)
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
        ranks = parse_results([completed.stdout + completed.stderr], method)
    else:
        port = random.randrange(20000, 60000)
        processes = []
        for rank in range(len(hosts) * args.ranks_per_host):
            # Consecutive ranks share a host, as a launcher numbers them: hierarchical algorithms see the hosts.
            namespace, interface, _ = hosts[rank // args.ranks_per_host]
            local = {"LOCAL_WORLD_SIZE": str(args.ranks_per_host), "LOCAL_RANK": str(rank % args.ranks_per_host)}
            if args.no_local_world_size:
                local = {}  # a plain env:// launcher: the engine finds the hosts itself
            command = ["ip", "netns", "exec", namespace, *worker_command(args, method, rank, hosts[0][2], port)]
            launch_env = {k: v for k, v in env.items() if k not in {"LOCAL_WORLD_SIZE", "LOCAL_RANK"}}
            processes.append(
                subprocess.Popen(
                    command,
                    env={**launch_env, "GLOO_SOCKET_IFNAME": interface, **local},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        try:
            outputs = [process.communicate(timeout=args.timeout)[0] for process in processes]
        finally:
            for process in processes:
                process.kill()
        ranks = parse_results(outputs, method)
    slowest = max(ranks, key=lambda r: r["median_s"])
    return {
        "rate": rate,
        "method": method,
        "median_step_s": slowest["median_s"],  # the slower rank sets the pace of synchronous training
        "per_rank_median_s": [r["median_s"] for r in ranks],
        "bytes_per_step": ranks[0]["bytes_per_step"],
        "parameter_bytes": ranks[0]["parameter_bytes"],
        # [nodes, ranks per node, where that came from] as the engine saw it; None outside the engine.
        "engine_layout": ranks[0].get("engine_layout"),
    }


def describe(hosts: int, ranks_per_host: int, from_hosts: bool = False) -> str:
    without = ", no LOCAL_WORLD_SIZE (the engine reads the layout from the hosts)" if from_hosts else ""
    if (hosts, ranks_per_host) == (2, 1):
        return f"two Gloo ranks over a shaped veth link{without}"
    link = "a shaped veth link" if hosts == 2 else "shaped links to a bridge"
    return f"{hosts * ranks_per_host} Gloo ranks, {hosts} hosts x {ranks_per_host}, over {link}{without}"


def markdown(results: list[dict[str, Any]], rates: list[str], methods: list[str], report: dict[str, Any]) -> str:
    by_key = {(r["rate"], r["method"]): r for r in results}
    hosts, ranks_per_host = report["settings"]["hosts"], report["settings"]["ranks_per_host"]
    from_hosts = report["settings"].get("no_local_world_size", False)
    lines = [
        f"Median step time in ms (ratio to DDP's at the same rate), {describe(hosts, ranks_per_host, from_hosts)}.",
        f"Written by `{report['command']}`;"
        f" the numbers are in `{layout_name(hosts, ranks_per_host, from_hosts)}.json`.",
        "",
        "| method | " + " | ".join(rates) + " | payload MB/step |",
        "|---|" + "---|" * len(rates) + "---|",
    ]
    for method in methods:
        cells = []
        for rate in rates:
            row, ddp = by_key.get((rate, method)), by_key.get((rate, "ddp"))
            if row is None:
                cells.append("")
                continue
            ratio = f" ({row['median_step_s'] / ddp['median_step_s']:.2f}x)" if ddp else ""
            cells.append(f"{row['median_step_s'] * 1e3:.1f}{ratio}")
        payload = next((by_key[(rate, method)]["bytes_per_step"] for rate in rates if (rate, method) in by_key), None)
        cells.append("" if payload is None else f"{payload / 1e6:.2f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(results: list[dict[str, Any]], rates: list[str], methods: list[str], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(1, len(methods))
    by_key = {(r["rate"], r["method"]): r for r in results}
    # tab20 keeps up to 20 methods apart (the default cycle repeats after 10, as with the :flat/:hierarchical pairs).
    colours = plt.get_cmap("tab20").colors
    for i, method in enumerate(methods):
        values = [by_key[(rate, method)]["median_step_s"] * 1e3 if (rate, method) in by_key else 0.0 for rate in rates]
        colour = colours[i % len(colours)]
        axis.bar([x + i * width for x in range(len(rates))], values, width, label=method, color=colour)
    axis.set_xticks([x + 0.4 - width / 2 for x in range(len(rates))], rates)
    axis.set_yscale("log")
    axis.set_ylabel("median step time (ms, log scale)")
    axis.set_title(f"{title[0].upper()}{title[1:]} (benchmarks/network_lab.py)")
    # Below the plot, where it hides no bar.
    axis.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def orchestrate(args: argparse.Namespace) -> None:
    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        raise SystemExit("network_lab.py needs root, iproute2 and tc (network namespaces and shaping).")
    if args.hosts < 2 or args.ranks_per_host < 1:
        raise SystemExit("The lab needs at least two hosts and one rank per host.")
    known = all_methods(args.ranks_per_host)
    methods = args.methods or known
    unknown = sorted(set(methods) - set(known))
    if unknown:
        raise SystemExit(f"Unknown methods {unknown}; choose from {known}.")
    for rate in args.rates:
        if rate != "unshaped":
            _bits_per_second(rate)
    results = []
    for rate in args.rates:
        with lab_hosts(rate, args.hosts) as hosts:
            for method in methods:
                if method == "single" and results and any(r["method"] == "single" for r in results):
                    single = next(r for r in results if r["method"] == "single")
                    results.append({**single, "rate": rate})  # no link involved: measured once
                    continue
                row = measure(args, rate, method, hosts)
                results.append(row)
                print(f"{rate:>9} {method:>28}: {row['median_step_s'] * 1e3:9.1f} ms", flush=True)
    report = {
        "benchmark": (
            f"{describe(args.hosts, args.ranks_per_host, args.no_local_world_size)}, one network namespace per host,"
            " tc-shaped"
        ),
        "command": "python benchmarks/network_lab.py " + " ".join(sys.argv[1:]),
        "settings": {
            k: v for k, v in vars(args).items() if k not in {"worker", "rank", "master", "port", "method", "world_size"}
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            # Other work on the machine slows the unshaped and 10 Gbit/s runs most: recorded, not hidden.
            "load_average_1_5_15": os.getloadavg(),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "results": results,
    }
    table = markdown(results, args.rates, methods, report)
    if args.no_save:
        print(table)
        return
    RESULTS.mkdir(exist_ok=True)
    stem = layout_name(args.hosts, args.ranks_per_host, args.no_local_world_size)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(table)
    title = describe(args.hosts, args.ranks_per_host, args.no_local_world_size)
    chart(results, args.rates, methods, RESULTS / f"{stem}.png", title)
    print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="tc rates (100mbit, 1gbit, ...) or unshaped")
    parser.add_argument("--methods", nargs="+", default=None, help="default: all")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024, help="hidden width (1024 and depth 2: 2.1M parameters)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=600, help="seconds a run (and a collective) may take")
    parser.add_argument("--hosts", type=int, default=2, help="network namespaces (more than 2: joined by a bridge)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks per host: LOCAL_WORLD_SIZE, unshaped")
    parser.add_argument(
        "--no-local-world-size",
        action="store_true",
        help="launch as a plain env:// launcher does, without LOCAL_WORLD_SIZE: the engine finds the hosts itself",
    )
    parser.add_argument("--no-save", action="store_true", help="print the table, write nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        orchestrate(arguments)
