"""Host time of one ``low_rank`` bucket on a CPU: the native codec kernels against the torch reference, same gradients.

``low_rank``'s step on a small model is mostly host work between two collectives. This times ``low_rank_reduce_``
on the whole gradient of a convergence task's network as one bucket, in one process (a Gloo group of one, so the
collectives cost next to nothing), with the factors coded by torch ops (``qr_torch``) and by the native kernels
(``qr_native``, what ``low_rank`` runs on a CPU), both forms (two-sided and ``alternate=True``). The settings are
interleaved over ``--rounds`` rounds of ``--steps`` timed calls after ``--warmup`` untimed ones; the table gives the
median of the rounds' medians [min, max]. DDP's hooks beside ``low_rank`` are timed by the network lab::

    python benchmarks/low_rank_host_cost.py            # writes benchmarks/results/low_rank_host_cost_cpu.{json,md}
"""

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from lab.harness import free_port, rotated
from lab.models import task_model
from lab.render import markdown_table
from lab.results import command_line, machine, spread, write_report
from lightning_bagua.engine.algorithms.low_rank import hook
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import CommunicationCounter

RESULTS = Path(__file__).parent / "results"
SETTINGS = ("qr_torch", "qr_native")
TASKS = ("digits", "charlm", "bytemlp")


def make_state(parameters: list[torch.nn.Parameter], rank: int, alternate: bool, setting: str) -> Any:
    """A ``LowRankState`` for one flat participant, compressing from the first call, coded as ``setting`` says."""
    backend = "native" if setting.endswith("native") else "torch"
    return hook.LowRankState(
        groups=None,  # type: ignore[arg-type]  # low_rank_reduce_ takes its group as an argument
        counter=CommunicationCounter(),
        executor=None,  # type: ignore[arg-type]
        rank=rank,
        warmup_steps=0,
        alternate=alternate,
        hierarchical=False,
        names={id(parameter): f"p{index}" for index, parameter in enumerate(parameters)},
        codec=MinMaxUInt8Codec(backend=backend),
    )


def timer(task: str, rank: int, alternate: bool, setting: str) -> Callable[[int], list[float]]:
    """A function that times ``n`` calls of ``low_rank_reduce_`` on the task's whole gradient as one bucket."""
    parameters = list(task_model(task).parameters())[::-1]  # the reducer's bucket order: last layers first
    state = make_state(parameters, rank, alternate, setting)
    slots = state.plan(parameters, 4)
    gradient = torch.randn(
        sum(parameter.numel() for parameter in parameters), generator=torch.Generator().manual_seed(0)
    )

    def run(calls: int) -> list[float]:
        times = []
        for _ in range(calls):
            bucket = gradient.clone()
            start = time.perf_counter()
            hook.low_rank_reduce_(bucket, slots, None, 1, state)
            times.append(time.perf_counter() - start)
        return times

    return run


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for task in args.tasks:
        for rank in args.ranks:
            for alternate in (False, True):
                timers = {setting: timer(task, rank, alternate, setting) for setting in SETTINGS}
                for run in timers.values():
                    run(args.warmup)
                rounds: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
                for index in range(args.rounds):
                    # Each round starts one setting later, so that no setting always runs first.
                    for setting in rotated(SETTINGS, index):
                        rounds[setting].append(statistics.median(timers[setting](args.steps)))
                for setting in SETTINGS:
                    values = rounds[setting]
                    form = "alternate" if alternate else "two-sided"
                    figures = {f"{k}_s": v for k, v in spread(values).items() if k in ("median", "min", "max")}
                    results.append({"task": task, "rank": rank, "form": form, "setting": setting, **figures,
                                    "rounds_s": values})  # fmt: skip
                print(f"{task} r{rank} {'alternate' if alternate else 'two-sided'}: done", flush=True)
    return results


def markdown(report: dict[str, Any]) -> str:
    keyed = {(r["task"], r["rank"], r["form"], r["setting"]): r for r in report["results"]}
    rows = []
    for task, rank, form in dict.fromkeys((r["task"], r["rank"], r["form"]) for r in report["results"]):
        base = keyed[(task, rank, form, SETTINGS[0])]["median_s"]
        timed = [keyed[(task, rank, form, setting)] for setting in SETTINGS]
        rows.append([task, str(rank), form, *(f"{r['median_s'] * 1e3:.2f} [{r['min_s'] * 1e3:.2f},"
                     f" {r['max_s'] * 1e3:.2f}] ({r['median_s'] / base:.2f}x)" for r in timed)])  # fmt: skip
    return "\n".join([
        "Host time of one `low_rank` bucket (the whole gradient of the task's network), one process, one thread:"
        " median over rounds of each round's median call, in ms [min, max], and the ratio to the torch reference"
        " (`qr_torch`).",
        f"Written by `{report['command']}`; the numbers are in `low_rank_host_cost_cpu.json`.",
        "",
        markdown_table(["task", "rank", "form", *SETTINGS], rows),
    ])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16], help="factor ranks (default: 8 16)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: 7)")
    parser.add_argument("--steps", type=int, default=30, help="timed calls per setting and round (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per setting first (default: 5)")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default: benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write nothing")
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    args.argv = arguments
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        results = measure(args)
    finally:
        dist.destroy_process_group()
    command = command_line(["benchmarks/low_rank_host_cost.py", *args.argv])
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report = {"benchmark": "low_rank_host_cost", "command": command, "date": date, "machine": machine()}
    report |= {"settings": {k: v for k, v in vars(args).items() if k not in {"argv", "out"}}, "results": results}
    table = markdown(report)
    print(table)
    if not args.no_save:
        write_report(Path(args.out), "low_rank_host_cost_cpu", report, table)


if __name__ == "__main__":
    main()
