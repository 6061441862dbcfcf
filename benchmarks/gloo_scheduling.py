"""Latency of small Gloo exchanges between busy ranks, with the engine's groups under each scheduling policy.

Two Gloo processes on this host (``--world-size``) repeat: a spell of compute on one thread (``--compute-ms`` of
small matrix products, as a training step's), then one communication of ``--kib`` KiB per rank, timed. The
communication runs on a group that the engine creates (:meth:`CommunicationGroups.create`), either as torch starts
its threads (``default``) or with them under ``SCHED_BATCH`` (``sched_batch``, what the engine does on Linux; see
:func:`~lightning_bagua.engine.communication.batch_schedule`). Three communications:

* ``exchange``: the engine's point-to-point all-gather (:func:`all_gather_into`: receives posted first);
* ``all_gather``: Gloo's all-gather;
* ``all_reduce``: Gloo's all-reduce (what DDP runs).

Policies and communications are interleaved over ``--rounds`` rounds, each on a fresh group, each round starting
one setting later; a round keeps the median and the 90th percentile of its ``--steps`` timed calls (after
``--warmup`` untimed ones), the slowest rank's. The table gives the median over rounds with [min, max]. It times
the communication only, so it compares the two policies and not the algorithms; the step times of every method
beside DDP, its fp16 hook and its PowerSGD hook are in ``time_to_accuracy_cpu.md`` and the network lab::

    python benchmarks/gloo_scheduling.py               # writes benchmarks/results/gloo_scheduling_cpu.{json,md}
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing

sys.path.insert(0, str(Path(__file__).parent))

from lab.harness import free_port, interleaved
from lab.results import machine, write_report
from lightning_bagua.engine.communication import GLOO_SCHED_BATCH_VARIABLE, CommunicationGroups, all_gather_into

RESULTS = Path(__file__).parent / "results"
POLICIES = ("default", "sched_batch")
COMMUNICATIONS = ("exchange", "all_gather", "all_reduce")


def busy(milliseconds: float, matrix: torch.Tensor) -> None:
    """Multiply ``matrix`` by itself until ``milliseconds`` have passed: compute that holds a core."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < milliseconds:
        torch.mm(matrix, matrix)


def time_setting(args: argparse.Namespace, policy: str, communication: str) -> list[float]:
    """Time ``args.steps`` calls of ``communication`` on a fresh engine group under ``policy``, in ms."""
    os.environ[GLOO_SCHED_BATCH_VARIABLE] = "1" if policy == "sched_batch" else "0"
    groups = CommunicationGroups.create(None, 1, hierarchical=False)
    world_size = groups.world_size
    mine = torch.randn(args.kib * 256)
    gathered = torch.empty(world_size, mine.numel())
    matrix = torch.randn(64, 64)
    times = []
    for step in range(args.warmup + args.steps):
        busy(args.compute_ms, matrix)
        start = time.perf_counter()
        if communication == "exchange":
            all_gather_into(gathered, mine, groups.flat)
        elif communication == "all_gather":
            dist.all_gather_into_tensor(gathered.view(-1), mine, group=groups.flat)
        else:
            dist.all_reduce(mine, group=groups.flat)
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    groups.close()
    return times


def worker(rank: int, args: argparse.Namespace, port: int, schedule: list[tuple[int, str, str]], out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, timeout=datetime.timedelta(seconds=120))
    for round_index, policy, communication in schedule:
        times = sorted(time_setting(args, policy, communication))
        median = statistics.median(times)
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        out.put({"rank": rank, "round": round_index, "policy": policy, "communication": communication,
                 "median_ms": median, "p90_ms": p90})  # fmt: skip
        dist.barrier()
    dist.destroy_process_group()


def interleaved_schedule(rounds: int) -> list[tuple[int, str, str]]:
    """Every (policy, communication) once per round, each round starting one setting later (the lab's order)."""
    settings = [f"{policy}:{communication}" for communication in COMMUNICATIONS for policy in POLICIES]
    return [(round_index, *setting.split(":")) for round_index, setting in interleaved(settings, rounds)]


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: over rounds, the slowest rank's median and 90th percentile, as median [min, max]."""
    summary = []
    for communication in COMMUNICATIONS:
        for policy in POLICIES:
            entry: dict[str, Any] = {"communication": communication, "policy": policy}
            for figure in ("median_ms", "p90_ms"):
                per_round: dict[int, float] = {}
                for row in rows:
                    if row["policy"] == policy and row["communication"] == communication:
                        per_round[row["round"]] = max(per_round.get(row["round"], 0.0), row[figure])
                values = list(per_round.values())
                entry[figure] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            summary.append(entry)
    return summary


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"Time of one communication of {settings['kib']} KiB per rank between {settings['world_size']} Gloo"
        f" processes on one host, after {settings['compute_ms']} ms of compute on each; the engine's group with"
        " torch's thread scheduling (`default`) or under `SCHED_BATCH` (`sched_batch`, the engine's default on"
        f" Linux). Median over {settings['rounds']} interleaved rounds [min, max] of each round's median and 90th"
        f" percentile of {settings['steps']} calls (the slowest rank's).",
        f"Written by `{report['command']}`; every round is in `gloo_scheduling_cpu.json`.",
        "",
        "| communication | policy | median ms | 90th percentile ms |",
        "|---|---|---|---|",
    ]
    for entry in report["summary"]:
        cells = [f"{e['median']:.3f} [{e['min']:.3f}, {e['max']:.3f}]" for e in (entry["median_ms"], entry["p90_ms"])]
        lines.append(f"| {entry['communication']} | {entry['policy']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=1.0, help="compute before each call (default: 1 ms)")
    parser.add_argument("--kib", type=int, default=8, help="KiB each rank sends (default: 8)")
    parser.add_argument("--steps", type=int, default=200, help="timed calls per setting and round")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls before them")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default: benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write nothing")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.steps < 1 or args.rounds < 1 or args.kib < 1 or args.compute_ms < 0:
        parser.error("--world-size must be at least 2, --steps, --rounds and --kib at least 1, --compute-ms >= 0")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not hasattr(os, "SCHED_BATCH"):
        raise SystemExit("SCHED_BATCH is a Linux scheduling policy; this benchmark needs Linux.")
    schedule = interleaved_schedule(args.rounds)
    port = free_port()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    started = time.perf_counter()
    processes = [
        context.Process(target=worker, args=(rank, args, port, schedule, out)) for rank in range(args.world_size)
    ]
    for process in processes:
        process.start()
    rows = [out.get(timeout=600) for _ in range(len(schedule) * args.world_size)]
    for process in processes:
        process.join(timeout=60)
        if process.exitcode != 0:
            raise SystemExit(f"a worker exited with {process.exitcode}")
    settings = {key: getattr(args, key) for key in ("world_size", "compute_ms", "kib", "steps", "warmup", "rounds")}
    report = {
        "benchmark": "gloo_scheduling",
        "command": " ".join(["python benchmarks/gloo_scheduling.py", *args.argv]),
        "settings": settings,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "total_wall_s": time.perf_counter() - started,
        "summary": summarise(rows),
        "rounds": rows,
    }
    table = markdown(report)
    if not args.no_save:
        write_report(Path(args.out), "gloo_scheduling_cpu", report, table)
    print(table)


if __name__ == "__main__":
    main()
