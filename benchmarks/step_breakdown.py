"""Where a step's time goes, method by method, on two GPUs: host time, device time, communication kernels.

The GPU network lab's model, data and methods (``benchmarks/gpu_network_lab.py``), one ``torchrun`` job of two
processes. For every method, in rounds whose order rotates:

- ``step_ms``: the median wall time of ``--steps`` steps after the lab's warm-up, each between two device
  synchronisations (as the lab times them). ``--window K`` takes them ``K`` at a time back to back between two
  synchronisations, a step's time the window's over ``K``: a method that leaves work in flight into the next step
  (``low_precision_decentralized``'s exchange) overlaps it there, as it does in training, where nothing
  synchronises the whole device between steps; with one step per window, the step pays for that work's end;
- ``host_ms``: the median time until the step's Python call returns, before the synchronisation: a step whose
  host time nears its wall time waits on the host, not on the device;
- from ``torch.profiler`` over ``--profiled`` further steps, per step: ``kernel_ms`` (the summed duration of every
  kernel but NCCL's), ``nccl_ms`` (NCCL's kernels), ``launches`` (kernel and CUDA graph launch calls), and the five
  kernels of the longest summed duration. ``--profiled 0`` profiles nothing: a profiled method may leave the methods
  after it slower, so timings meant for comparison run without.

``--interleave steps`` builds every method at once and takes their steps in turn (each step index runs every method
once, the order rotated from index to index), instead of one method after the other: a host-bound step follows the
CPU's pace, which drifts over a job, and timed one after the other, methods meet different stretches of it. Each
round then has ``--steps`` steps of every method. It needs the memory of every method's model and state together
(a few GB each for the lab's model), and cannot time ``async``, whose averaging thread would send while the others
are timed.

A method name may carry ``@<MiB>`` to build its wrapper with that bucket size (``ddp@10``,
``gradient_allreduce@25``), ``low_rank_rK`` may end in ``_bucketwise`` (``whole_step=False``), and ``bytegrad``,
``qadam`` and ``low_rank_rK`` in ``_onenode``: their own default ``hierarchical=True``, which on one node leaves only
the full-precision level (the lab runs them flat, to time their compression). Any method may end in ``_eager``:
its wrapper is built with ``BAGUA_CUDA_GRAPHS=0``, so that it runs every bucket's job eagerly where it would
replay it as a CUDA graph (``bytegrad_eager`` against ``bytegrad``). ``--src``
puts another checkout's ``src`` first on the path, to compare two versions of the engine in one device call.
``--trace DIR`` writes rank 0's profiled steps of the first round as Chrome traces, and ``--analyze DIR`` reads
such traces back (on any machine): how long each step's compute stream and NCCL kernels were busy, how long the host
waited for the device, and how long the forward and backward passes took on the host::

    python benchmarks/step_breakdown.py --methods ddp ddp@10 gradient_allreduce bytegrad --rounds 3
    python benchmarks/step_breakdown.py --sockets ...      # NCCL over TCP on lo, unshaped
    python benchmarks/step_breakdown.py --methods ddp bytegrad --rounds 1 --trace traces
    python benchmarks/step_breakdown.py --analyze traces --out step_breakdown_trace

Writes ``benchmarks/results/<--out>.json`` and ``.md`` (default ``step_breakdown_nvlink`` or
``step_breakdown_sockets``). ``--cpu`` runs a tiny model on two Gloo processes (a smoke test; its figures mean
nothing).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu_network_lab import (
    METHODS,
    WARMUP_STEPS,
    Batches,
    Wrapped,
    corpus,
    is_launch,
    join_job,
    machine,
    split_bucket,
    synchronize,
    timed_window,
)
from lab.harness import SOCKETS_ENV, rotated

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
# The engine's switch (lightning_bagua.engine._cuda_graphs), spelled out: --src may load an engine without it.
CUDA_GRAPHS_VARIABLE = "BAGUA_CUDA_GRAPHS"


def split_variant(method: str) -> tuple[str, float | None, dict[str, Any], dict[str, str]]:
    """``"ddp@10"`` -> ``("ddp", 10.0, {}, {})``; ``"low_rank_r4_bucketwise"`` -> ``("low_rank_r4", None, {...}, {})``.

    The last element holds the environment variables the method's wrapper is built under (``_eager``: no graphs).
    """
    name, bucket_cap_mb = split_bucket(method)
    environment: dict[str, str] = {}
    if name.endswith("_eager"):
        name = name.removesuffix("_eager")
        environment[CUDA_GRAPHS_VARIABLE] = "0"  # read when the wrapper builds its executor
    keywords: dict[str, Any] = {}
    if name.endswith("_bucketwise"):
        name = name.removesuffix("_bucketwise")
        keywords["whole_step"] = False
    if name.endswith("_onenode"):  # the algorithm's own default, hierarchical=True: on one node, full precision
        name = name.removesuffix("_onenode")
        keywords["hierarchical"] = True
    if name not in METHODS:
        raise SystemExit(f"Unknown method {method!r}: use one of {', '.join(METHODS)}, optionally with @<MiB>.")
    return name, bucket_cap_mb, keywords, environment


def profile_steps(
    wrapped: Wrapped,
    batches: Batches,
    args: argparse.Namespace,
    step: int,
    device: torch.device,
    trace: Path | None = None,
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for offset in range(args.profiled):
            wrapped.step(batches.for_step(args.seed, step + offset), device)
        synchronize(device)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
    launches = 0
    kernel_us: dict[str, float] = defaultdict(float)
    for event in profiler.key_averages():
        if is_launch(event.key):
            launches += event.count
        # Annotated ranges (a module's forward, an optimizer step, "nccl:all_reduce") show on the device too: skip them.
        if str(getattr(event, "device_type", "")).endswith("CUDA") and not getattr(event, "is_user_annotation", False):
            kernel_us[event.key] += getattr(event, "self_device_time_total", 0.0) or event.self_cuda_time_total
    per_step = args.profiled
    nccl = sum(us for name, us in kernel_us.items() if "nccl" in name.lower())
    other = sum(us for name, us in kernel_us.items() if "nccl" not in name.lower())
    top = sorted(kernel_us.items(), key=lambda item: -item[1])[:5]
    return {
        "kernel_ms": other / per_step / 1e3,
        "nccl_ms": nccl / per_step / 1e3,
        "launches": launches / per_step,
        "top_kernels_ms": {name[:90]: us / per_step / 1e3 for name, us in top},
    }


def build(method: str, args: argparse.Namespace, device: torch.device) -> Wrapped:
    """``method``'s model, optimizer and wrapper, its variant's bucket size, keywords and environment applied."""
    name, bucket_cap_mb, keywords, environment = split_variant(method)
    with mock.patch.dict(os.environ, environment):
        return Wrapped(name, args, device, bucket_cap_mb=bucket_cap_mb, keywords=keywords)


def row_of(walls: list[float], hosts: list[float]) -> dict[str, Any]:
    """A round's row from its timed steps, with no profile (``profile_steps`` fills those keys in)."""
    return {
        "step_ms": statistics.median(walls) * 1e3,
        "host_ms": statistics.median(hosts) * 1e3,
        "kernel_ms": math.nan,
        "nccl_ms": math.nan,
        "launches": math.nan,
        "top_kernels_ms": {},
    }


def release(wrapped: Wrapped, device: torch.device) -> None:
    wrapped.close()
    del wrapped
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_method(
    method: str, args: argparse.Namespace, batches: Batches, device: torch.device, trace: Path | None = None
) -> dict[str, Any]:
    wrapped = build(method, args, device)
    for step in range(WARMUP_STEPS):
        timed_window(wrapped, [batches.for_step(args.seed, step)], device)
    walls, hosts = [], []
    for first in range(WARMUP_STEPS, WARMUP_STEPS + args.steps, args.window):
        window = [batches.for_step(args.seed, step) for step in range(first, first + args.window)]
        wall, host = timed_window(wrapped, window, device)
        walls.append(wall)
        hosts.append(host)
    row = row_of(walls, hosts)
    if args.profiled:
        row.update(profile_steps(wrapped, batches, args, WARMUP_STEPS + args.steps, device, trace))
    release(wrapped, device)
    return row


def run_interleaved(args: argparse.Namespace, batches: Batches, device: torch.device, rank: int) -> None:
    """``--interleave steps``: every method built at once, their steps taken in turn; written after every round.

    Each timed window of steps (``--window``, one step by default) runs every method once, in an order rotated from
    window to window, so that a slow stretch of the machine (a host-bound step follows the CPU's pace) falls on every
    method alike instead of on the methods timed during it. The warm-up steps run in turn too. Profiles, when asked
    for, follow the last round.
    """
    wrappers = {method: build(method, args, device) for method in args.methods}
    for step in range(WARMUP_STEPS):
        for method in rotated(args.methods, step):
            wrappers[method].step(batches.for_step(args.seed, step), device)
    synchronize(device)
    rows: dict[str, list[dict[str, Any]]] = {}
    step = WARMUP_STEPS
    for round_index in range(args.rounds):
        times: dict[str, tuple[list[float], list[float]]] = {method: ([], []) for method in args.methods}
        for _ in range(args.steps // args.window):
            window = [batches.for_step(args.seed, index) for index in range(step, step + args.window)]
            for method in rotated(args.methods, step // args.window):
                wall, host = timed_window(wrappers[method], window, device)
                times[method][0].append(wall)
                times[method][1].append(host)
            step += args.window
        for method, (walls, hosts) in times.items():
            rows.setdefault(method, []).append(row_of(walls, hosts))
        if rank == 0:
            steps = ", ".join(f"{method} {rows[method][-1]['step_ms']:.1f}" for method in args.methods)
            print(f"round {round_index} (ms): {steps}", flush=True)
            write(args, rows, round_index + 1)
    for method in args.methods:
        if args.profiled:
            rows[method][-1].update(profile_steps(wrappers[method], batches, args, step, device))
        release(wrappers.pop(method), device)
    if rank == 0 and args.profiled:
        write(args, rows, args.rounds)  # the last round's rows again, now with their profiles


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    device, rank = join_job(args.cpu)
    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    batches = Batches(text, rank, 4 if args.cpu else args.batch, args.context, device)
    if args.interleave == "steps":
        run_interleaved(args, batches, device, rank)
        dist.destroy_process_group()
        return
    rows: dict[str, list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        for method in rotated(args.methods, round_index):
            trace = None
            if args.trace and rank == 0 and round_index == 0:
                trace = Path(args.trace) / f"{method.replace('@', '_b')}.json.gz"
            row = run_method(method, args, batches, device, trace)
            rows.setdefault(method, []).append(row)
            if rank == 0:
                print(
                    f"round {round_index} {method:>30}: step {row['step_ms']:.1f} ms, host {row['host_ms']:.1f} ms,"
                    f" kernels {row['kernel_ms']:.1f} ms, nccl {row['nccl_ms']:.1f} ms, {row['launches']:.0f} launches",
                    flush=True,
                )
        if rank == 0:
            write(args, rows, round_index + 1)
    dist.destroy_process_group()


def write(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], rounds: int) -> None:
    summary: dict[str, Any] = {}
    for method, method_rows in rows.items():
        entry: dict[str, Any] = {}
        for key in ("step_ms", "host_ms", "kernel_ms", "nccl_ms", "launches"):
            # Over the rounds that have the figure (``--interleave steps`` profiles after its last round only).
            values = [row[key] for row in method_rows if not math.isnan(row[key])] or [math.nan]
            entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        entry["top_kernels_ms"] = method_rows[-1]["top_kernels_ms"]
        summary[method] = entry
    stem = args.out or f"step_breakdown_{'sockets' if args.sockets else 'nvlink'}{'_cpu' if args.cpu else ''}"
    command = f"python benchmarks/step_breakdown.py --methods {' '.join(args.methods)} --rounds {args.rounds}"
    command += f" --steps {args.steps}" if args.steps != 20 else ""
    command += f" --profiled {args.profiled}" if args.profiled != 3 else ""
    command += f" --window {args.window}" if args.window != 1 else ""
    command += " --sockets" if args.sockets else ""
    command += " --interleave steps" if args.interleave == "steps" else ""
    command += f" --src {args.src}" if args.src else ""
    command += f" --out {args.out}" if args.out else ""
    report = {
        "benchmark": "where a step's time goes, per method, on two GPUs",
        "command": command,
        "rounds": rounds,
        "settings": {k: v for k, v in vars(args).items() if k not in {"worker", "results_dir", "out", "src", "trace"}},
        "engine_src": args.src or "src",
        "machine": machine(args),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "methods": summary,
    }
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    methods = report["methods"]
    base = methods.get("ddp", {}).get("step_ms", {}).get("median")
    lines = [
        f"Written by `{report['command']}` ({report['machine']['device']}, {report['rounds']} rounds, engine from"
        f" `{report['engine_src']}`). Medians over rounds [min, max]; per step.",
        "",
        "| method | step ms (x ddp) [min, max] | host ms | kernels ms | NCCL kernels ms | launches |",
        "|---|---|---|---|---|---|",
    ]
    for method, entry in methods.items():
        step = entry["step_ms"]
        ratio = f" ({step['median'] / base:.2f}x)" if base else ""
        profiled = [_figure(entry[key]["median"], digits) for key, digits in (("kernel_ms", 1), ("nccl_ms", 1),
                                                                               ("launches", 0))]  # fmt: skip
        lines.append(
            f"| {method} | {step['median']:.1f}{ratio} [{step['min']:.1f}, {step['max']:.1f}]"
            f" | {entry['host_ms']['median']:.1f} | {' | '.join(profiled)} |"
        )
    if report.get("caveat"):
        lines += ["", report["caveat"]]
    if not any(entry["top_kernels_ms"] for entry in methods.values()):
        return "\n".join([*lines, "", "No kernel figures: not profiled (`--profiled 0`), or no CUDA device."]) + "\n"
    lines += ["", "The longest kernels per step (ms), last round:", ""]
    for method, entry in methods.items():
        kernels = "; ".join(f"`{name}` {ms:.2f}" for name, ms in entry["top_kernels_ms"].items())
        lines.append(f"- {method}: {kernels}")
    return "\n".join(lines) + "\n"


def _figure(value: float, digits: int) -> str:
    """A table cell: ``value`` to ``digits`` places, or "-" where nothing was profiled (NaN)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def analyze_trace(path: Path, steps: int) -> dict[str, float]:
    """Per-step figures from one Chrome trace of ``steps`` profiled steps (see the module docstring)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        events = [event for event in json.load(file)["traceEvents"] if event.get("ph") == "X"]
    kernels = [event for event in events if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy: dict[Any, float] = defaultdict(float)
    nccl = 0.0
    for event in kernels:
        if "nccl" in event["name"].lower():
            nccl += event["dur"]
        else:
            busy[event["tid"]] += event["dur"]
    forwards = [
        e for e in events if e["name"].endswith("DistributedDataParallel.forward") and e.get("cat") == "user_annotation"
    ]
    steps_of = [e for e in events if e["name"].startswith("Optimizer.step") and e.get("cat") == "user_annotation"]
    forwards.sort(key=lambda event: event["ts"])
    steps_of.sort(key=lambda event: event["ts"])
    backward = [step["ts"] - (f["ts"] + f["dur"]) for f, step in zip(forwards, steps_of, strict=False)]
    waits = sum(
        e["dur"]
        for e in events
        if e.get("cat") == "cuda_runtime" and e["name"] in ("cudaDeviceSynchronize", "cudaStreamSynchronize")
    )
    hooks = [
        e["dur"] for e in events if e["name"].endswith("torch::autograd::AccumulateGrad") and e.get("cat") == "cpu_op"
    ]
    return {
        "compute_stream_busy_ms": max(busy.values(), default=0.0) / steps / 1e3,
        "nccl_busy_ms": nccl / steps / 1e3,
        "host_waits_for_device_ms": waits / steps / 1e3,
        "forward_host_ms": sum(f["dur"] for f in forwards) / max(len(forwards), 1) / 1e3,
        "backward_host_ms": sum(backward) / max(len(backward), 1) / 1e3,
        "gradient_ready_hooks_ms": sum(hooks) / steps / 1e3,
    }


def analyze(args: argparse.Namespace) -> None:
    folder = Path(args.analyze)
    rows = {path.name.split(".")[0]: analyze_trace(path, args.profiled) for path in sorted(folder.glob("*.json*"))}
    if not rows:
        raise SystemExit(f"No traces in {folder}: write some with --trace first.")
    stem = args.out or "step_breakdown_trace"
    command = f"python benchmarks/step_breakdown.py --analyze {args.analyze} --profiled {args.profiled} --out {stem}"
    out = Path(args.results_dir)
    report = {"benchmark": "profiled steps, per method, from Chrome traces", "command": command, "methods": rows}
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    keys = list(next(iter(rows.values())))
    lines = [
        f"Written by `{command}`, from traces of rank 0 under `torch.profiler` (which slows the host: compare the"
        " methods with each other, not with unprofiled step times). Per step, in ms:",
        "",
        "| method | " + " | ".join(key.removesuffix("_ms").replace("_", " ") for key in keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    lines += [f"| {method} | " + " | ".join(f"{row[key]:.1f}" for key in keys) + " |" for method, row in rows.items()]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["ddp", "gradient_allreduce"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method and round")
    parser.add_argument("--profiled", type=int, default=3, help="profiled steps per method and round")
    parser.add_argument(
        "--window",
        type=int,
        default=1,
        help="timed steps taken back to back between two device synchronisations; a step's time is the window's"
        " over this (divides --steps)",
    )
    parser.add_argument("--sockets", action="store_true", help="NCCL over TCP on lo (unshaped)")
    parser.add_argument(
        "--interleave",
        choices=["methods", "steps"],
        default="methods",
        help="methods: one method at a time, rounds rotated; steps: every method built at once, steps in turn",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--trace", default=None, help="write rank 0's profiled steps of round 0 here (chrome)")
    parser.add_argument("--analyze", default=None, help="summarise the traces in this folder, run nothing")
    parser.add_argument("--src", default=None, help="another checkout's src directory, first on the path")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for method in args.methods:
        split_variant(method)
    if args.window < 1 or args.steps % args.window:
        parser.error(f"--window {args.window} must be a positive divisor of --steps {args.steps}")
    if args.interleave == "steps" and any(split_variant(method)[0] == "async" for method in args.methods):
        # async averages on a thread of its own between the steps: built beside the others, it would send while they
        # are timed.
        parser.error("--interleave steps cannot time async: time it with --interleave methods (the default)")
    if args.interleave == "steps" and args.trace:
        parser.error("--trace writes the traces of round 0, one method at a time: use --interleave methods")
    return args


def launch(args: argparse.Namespace) -> None:
    paths = [args.src, str(ROOT / "src"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    if args.sockets and not args.cpu:
        env.update(SOCKETS_ENV)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [__file__, "--worker", *sys.argv[1:]]
    subprocess.run(command, env=env, check=True, cwd=ROOT)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.analyze:
        analyze(arguments)
    elif arguments.worker:
        worker(arguments)
    else:
        launch(arguments)
