"""The engine's own overhead: its wrapper against torch's DDP, telemetry on against off, autotuned buckets.

One model (a stack of wide linear layers), one process per GPU (NCCL) or per CPU rank (Gloo, ``--cpu``, one compute
thread each), the settings of each variant alternated in ``--rounds`` rounds so that clock drift and the
neighbours' load hit them alike; each setting's figure is its median step (the slower rank's) over ``--steps``
steps after ``--warmup`` steps, with the p10 and p90 of them:

- ``--variant engine``: ``BaguaDistributedDataParallel`` with ``gradient_allreduce`` against torch's DDP, the same
  model and buckets: the only difference is who communicates;
- ``--variant telemetry``: the wrapper with ``telemetry=False`` and ``telemetry=True`` (``gradient_allreduce`` and
  flat ``bytegrad``), each step closing its record, as a user reading it every step does;
- ``--variant autotune``: ``gradient_allreduce`` at the default 10 MiB buckets against the same run after a
  :class:`~lightning_bagua.engine.BucketAutotuner` chose its setting; on GPUs NCCL goes over TCP sockets on the
  loopback (``lab.harness.SOCKETS_ENV``), as between hosts, where the bucket size matters most.

Run it::

    python benchmarks/engine_overhead.py --devices 2                        # engine, GPUs
    python benchmarks/engine_overhead.py --cpu --devices 2                  # engine, CPU
    python benchmarks/engine_overhead.py --variant telemetry --cpu --devices 2
    python benchmarks/engine_overhead.py --variant autotune                 # 2 GPUs, NCCL over sockets

It writes ``benchmarks/results/{engine_overhead,telemetry_overhead,autotune_sockets}_{cpu,gpu}.json`` (by variant).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import SOCKETS_ENV, spawn_ranks
from lab.results import RESULTS, new_report, write_report

STEMS = {"engine": "engine_overhead", "telemetry": "telemetry_overhead", "autotune": "autotune_sockets"}
# Per variant: width, depth, batch, bucket MiB, warm-up steps, timed steps, rounds (on CPU: at most CPU_SHAPE's).
DEFAULTS = {
    "engine": (4096, 8, 2048, 25.0, 10, 50, 3),
    "telemetry": (4096, 8, 2048, 10.0, 5, 40, 3),
    "autotune": (4096, 6, 1024, 10.0, 3, 20, 2),
}
CPU_SHAPE = {"engine": (512, 4, 256), "telemetry": (512, 4, 256), "autotune": (256, 3, 64)}
TELEMETRY_ALGORITHMS = {"gradient_allreduce": {}, "bytegrad": {"hierarchical": False}}
SETTINGS = {  # what each variant times, alternated in every round
    "engine": ["torch_ddp", "bagua_gradient_allreduce"],
    "telemetry": [f"{algorithm}/telemetry_{state}" for algorithm in TELEMETRY_ALGORITHMS for state in ("off", "on")],
    "autotune": ["default", "autotuned"],
}
SIZES = ("width", "depth", "batch", "bucket_mb", "warmup", "steps", "rounds")  # DEFAULTS' order


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    hidden = (layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.GELU()))
    return nn.Sequential(*hidden, nn.Linear(width, 1))


def train_step(wrapped: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=False)
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=inputs.device.type == "cuda"):
        loss = wrapped(inputs).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    telemetry = getattr(wrapped, "telemetry", None)
    if telemetry is not None:
        telemetry.end_step()


def time_steps(wrapped: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, args: Any) -> list[float]:
    """Each timed step's seconds, between two device synchronisations, the slowest rank's."""
    times = []
    for step in range(args.warmup + args.steps):
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(wrapped, optimizer, inputs)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=inputs.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def build(setting: str, model: nn.Module, optimizer: torch.optim.Optimizer, args: Any, rank: int) -> nn.Module:
    """The wrapper a setting names: ``torch_ddp``, ``bagua_gradient_allreduce``, ``ALGORITHM/telemetry_on|off``,
    ``default`` or ``autotuned``."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel

    common: dict[str, Any] = {"device_ids": None if args.cpu else [rank], "bucket_cap_mb": args.bucket_mb}
    if setting == "torch_ddp":
        return DistributedDataParallel(model, gradient_as_bucket_view=True, **common)
    if setting == "bagua_gradient_allreduce":
        return BaguaDistributedDataParallel(model, [optimizer], "gradient_allreduce", gradient_as_bucket_view=True,
                                            **common)  # fmt: skip
    algorithm, _, telemetry = setting.partition("/")
    if telemetry:
        return BaguaDistributedDataParallel(
            model,
            [optimizer],
            Algorithm.init(algorithm, **TELEMETRY_ALGORITHMS[algorithm]),
            telemetry=telemetry == "telemetry_on",
            **common,
        )
    return BaguaDistributedDataParallel(model, [optimizer], "gradient_allreduce", **common)


def autotune(wrapped: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> tuple[nn.Module, dict]:
    """Run a :class:`BucketAutotuner`'s tuning steps from ``wrapped``; the wrapper it chose, and what it measured."""
    from lightning_bagua.engine import BucketAutotuner

    tuner = BucketAutotuner()
    started, steps = time.perf_counter(), 0
    while True:
        wrapped = tuner.step(wrapped)
        if tuner.finished:
            break
        train_step(wrapped, optimizer, inputs)
        steps += 1
    assert tuner.decision is not None
    return wrapped, {
        "decision": {"bucket_cap_mb": tuner.decision.bucket_cap_mb, "hierarchical": tuner.decision.hierarchical},
        "candidates_ms": {f"{s.bucket_cap_mb:g}": t * 1000 for s, t in tuner.measurements},
        "tuning_steps": steps,
        "tuning_wall_s": time.perf_counter() - started,
    }


def worker(rank: int, world_size: int, args: Any) -> dict[str, Any]:
    if args.cpu:
        # One compute thread per rank: several ranks' thread pools on few cores make every timing noise.
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        if args.variant == "autotune":
            os.environ.update(SOCKETS_ENV)  # before NCCL's first communicator
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=rank, world_size=world_size)
    inputs = torch.randn(args.batch, args.width, device=device)
    times: dict[str, list[float]] = {}
    extra: dict[str, Any] = {"rounds": [], "sample_record_rank0": {}}
    for _ in range(args.rounds):
        tuned: dict[str, Any] = {}
        for setting in SETTINGS[args.variant]:
            model = make_model(args.width, args.depth).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
            wrapped = build(setting, model, optimizer, args, rank)
            if setting == "autotuned":
                wrapped, tuned = autotune(wrapped, optimizer, inputs)
            measured = time_steps(wrapped, optimizer, inputs, args)
            times.setdefault(setting, []).extend(measured)
            tuned[f"{setting}_median_ms"] = statistics.median(measured) * 1000
            if getattr(wrapped, "telemetry", None) is not None:
                extra["sample_record_rank0"][setting.partition("/")[0]] = wrapped.telemetry.last_step
            if hasattr(wrapped, "close"):
                wrapped.close()
            del wrapped, model, optimizer
        extra["rounds"].append(tuned)
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times, **extra}


def summary(variant: str, measured: dict[str, Any]) -> dict[str, Any]:
    """The variant's figures: median step per setting (ms), their p10 and p90, and the ratio the variant is about."""
    times = measured["times"]
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    deciles = {name: statistics.quantiles(values, n=10) for name, values in times.items()}
    found: dict[str, Any] = {
        "median_step_ms": medians,
        "spread": {name: {"p10_ms": q[0] * 1000, "p90_ms": q[-1] * 1000} for name, q in deciles.items()},
    }
    if variant == "engine":
        found["ratio_bagua_to_ddp"] = medians["bagua_gradient_allreduce"] / medians["torch_ddp"]
    elif variant == "telemetry":
        found["ratio_on_to_off"] = {
            a: medians[f"{a}/telemetry_on"] / medians[f"{a}/telemetry_off"] for a in TELEMETRY_ALGORITHMS
        }
        found["sample_record_rank0"] = measured["sample_record_rank0"]
    else:
        found["rounds"] = measured["rounds"]
        found["ratio_autotuned_to_default"] = medians["autotuned"] / medians["default"]
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(STEMS), default="engine")
    parser.add_argument("--devices", type=int, default=2, help="ranks: GPUs, or CPU processes with --cpu")
    parser.add_argument("--cpu", action="store_true", help="Gloo on CPU, a smaller model")
    for name in SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=float if name == "bucket_mb" else int, default=None)
    parser.add_argument("--results-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    for name, default in zip(SIZES, DEFAULTS[args.variant], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.cpu:
        for name, limit in zip(SIZES, CPU_SHAPE[args.variant], strict=False):
            setattr(args, name, min(getattr(args, name), limit))
    elif torch.cuda.device_count() < args.devices:
        raise SystemExit(f"--devices {args.devices} needs as many GPUs, found {torch.cuda.device_count()}; or --cpu.")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = spawn_ranks(worker, args.devices, args)
    found = summary(args.variant, measured)
    settings = {k: v for k, v in vars(args).items() if k != "results_dir"}
    flags = (["--variant", args.variant] if args.variant != "engine" else []) + (["--cpu"] if args.cpu else [])
    command = " ".join(["python benchmarks/engine_overhead.py", *flags, "--devices", str(args.devices)])
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    rows = [{"setting": name, "median_ms": ms, **found["spread"][name]} for name, ms in found["median_step_ms"].items()]
    report = new_report(STEMS[args.variant], settings, rows, device=None if args.cpu else "cuda:0", command=command)
    report |= {"parameters": sum(p.numel() for p in make_model(args.width, args.depth).parameters()), "device": device}
    report |= found
    path = write_report(Path(args.results_dir), f"{STEMS[args.variant]}_{'cpu' if args.cpu else 'gpu'}", report)
    print(f"{report['parameters'] / 1e6:.1f}M parameters on {device} x{args.devices}")
    for row in rows:
        print(f"{row['setting']:36s} {row['median_ms']:8.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
