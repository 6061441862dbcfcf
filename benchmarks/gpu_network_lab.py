"""GPU network lab: every method on two GPUs of one host, over NVLink and over shaped TCP sockets, side by side.

A GPT-style byte-level decoder (16 layers, width 768, 114M parameters, bf16 autocast, 16 sequences of 512 tokens
per GPU) trains on the Python standard library's source, every method in one ``torchrun`` job per regime (the
engine driven from plain PyTorch, as the strategy drives it); rounds interleave the methods, in an order rotated
from round to round. ``nvlink``: NCCL's defaults; the first round trains ``--train-steps`` steps (warm-up, then
cosine decay) and evaluates every ``--eval-every``, for the time to a target loss. ``sockets``: NCCL over TCP on
``lo``, unshaped, then shaped by ``tc``'s ``tbf`` to each of ``--rates``. ``docs/source/performance.md``
documents the options (``--window``, ``--interleave steps``, ``METHOD@MiB``, pooled and supplementary runs).

On a machine with two GPUs (``--cpu``: a tiny model on two Gloo processes, a smoke test)::

    python benchmarks/gpu_network_lab.py --regime nvlink --rounds 3     # gpu_network_lab_nvlink.json
    python benchmarks/gpu_network_lab.py --regime sockets --rounds 3    # gpu_network_lab_sockets.json
    python benchmarks/gpu_network_lab.py --report                       # gpu_network_lab.md and .png
    python benchmarks/gpu_network_lab.py --regime sockets --rates 10 1 --methods ddp bytegrad bytegrad@100 \
        --out gpu_bucket_cap_sockets                                    # bucket sizes, beside the report
    python benchmarks/gpu_network_lab.py --interleave steps --rounds 3 --timing-steps 20 \
        --methods ddp ddp_fp16 bytegrad low_rank_r8 --out step_breakdown_nvlink_interleaved
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from lab.gpu_report import (
    BUCKET_RUNS,
    LR_FLOOR,
    METHODS,
    OURS,
    PEERS,
    WARMUP_STEPS,
    algorithm_of,
    interleaved_table,
    median_range,
    report,
    split_bucket,
    write_bucket_comparison,
)
from lab.harness import SOCKETS_ENV, rotated
from lab.jobs import job_env, torchrun
from lab.models import DecoderLM
from lab.render import markdown_table
from lab.results import machine

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
# Methods whose step waits on every gradient at full precision, as DDP's: not run at the slowest rate (seconds a step).
FULL_PRECISION = ("gradient_allreduce", "decentralized")
TIMED_STEPS = {"fast": 8, "slow": 3}  # per rate; "slow" at rates under 5 Gbit/s
EVAL_BATCHES = 8  # held-out batches per evaluation
LR_WARMUP = 30  # the cosine schedule's steps of linear warm-up, by default


# ------------------------------------------------------------------------------------------------ data and model


def corpus() -> bytes:
    """The standard library's Python source, file by file in sorted order: the same bytes on every rank."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in stdlib.rglob("*.py") if "site-packages" not in path.parts)
    return b"\n".join(path.read_bytes() for path in files)


class Batches:
    """Random windows of the training text, a fixed generator per rank; the last 2% of the text is held out."""

    def __init__(self, text: torch.Tensor, rank: int, batch: int, context: int, device: torch.device) -> None:
        split = int(len(text) * 0.98)
        self.train, self.held_out = text[:split], text[split:]
        self.rank, self.batch, self.context, self.device = rank, batch, context, device

    def for_step(self, seed: int, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + self.rank)
        starts = torch.randint(len(self.train) - self.context - 1, (self.batch,), generator=generator)
        return torch.stack([self.train[s : s + self.context + 1] for s in starts.tolist()]).to(self.device)

    def validation(self, count: int) -> list[torch.Tensor]:
        stride = (len(self.held_out) - self.context - 1) // (count * self.batch)
        windows = [self.held_out[i * stride : i * stride + self.context + 1] for i in range(count * self.batch)]
        stacked = torch.stack(windows).long()
        return [chunk.to(self.device) for chunk in stacked.split(self.batch)]


def loss_of(model: nn.Module, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    tokens = tokens.long()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


# ------------------------------------------------------------------------------------------------ methods


class Wrapped:
    """One method's model, optimizer and wrapper."""

    def __init__(
        self, method: str, args: argparse.Namespace, device: torch.device, bucket_cap_mb: float | None
    ) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel
        from lightning_bagua.engine.algorithms.qadam import QAdamOptimizer

        torch.manual_seed(args.seed)
        width, depth, heads = (64, 2, 4) if args.cpu else (768, 16, 12)
        self.module = DecoderLM(256, width, depth, heads, args.context).to(device)
        self.parameters = sum(p.numel() for p in self.module.parameters())
        if method == "qadam":
            self.optimizer: torch.optim.Optimizer = QAdamOptimizer(
                self.module.parameters(), lr=args.lr, warmup_steps=WARMUP_STEPS - 2
            )
        else:
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=args.lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(args))
        self.bagua: Any = None
        device_ids = [device.index] if device.type == "cuda" else None
        if method in PEERS:
            bucket = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}  # else DDP's own default
            ddp = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True, **bucket)
            if method == "ddp_fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif method.startswith("ddp_powersgd_r"):
                state = powerSGD_hook.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=int(method.rsplit("_r", 1)[1]),
                    start_powerSGD_iter=10,
                    batch_tensors_with_same_shape=True,
                )
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            self.model: nn.Module = ddp
        else:
            name, keywords = algorithm_of(method)
            algorithm = Algorithm.init(name, **keywords)
            self.bagua = BaguaDistributedDataParallel(
                self.module, [self.optimizer], algorithm, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb
            )
            self.bagua.bagua_algorithm_impl.start()
            self.model = self.bagua

    def step(self, tokens: torch.Tensor, device: torch.device) -> None:
        """One training step; nothing is read back to the host (the caller synchronises around it)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_of(self.model, tokens, device).backward()
        self.optimizer.step()
        self.scheduler.step()

    def close(self) -> None:
        if self.bagua is not None:
            self.bagua.bagua_algorithm_impl.stop()
            self.bagua.close()


def lr_factor(args: argparse.Namespace) -> Callable[[int], float]:
    """The learning rate at each step, as a fraction of ``args.lr``: ``--schedule``'s warm-up and cosine decay."""
    warmup = args.lr_warmup
    total = max(args.train_steps, warmup + 1)

    def factor(step: int) -> float:
        if args.schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / (total - warmup))
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def method_choice(method: str) -> str:
    """``--methods``' type: one of :data:`METHODS`, optionally with ``@MiB``."""
    try:
        name, size = split_bucket(method)
    except ValueError:
        name, size = method.partition("@")[0], 0.0
    if name not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if size is not None and not size > 0:
        raise argparse.ArgumentTypeError(f"{method!r}: the bucket size after '@' must be a positive number of MiB")
    return method


# ------------------------------------------------------------------------------------------------ the job


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_window(wrapped: Wrapped, window: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """Steps back to back between two device synchronisations, one per batch of ``window``: the wall time and the
    time until the last call returned, each over the number of steps (s)."""
    synchronize(device)
    start = time.perf_counter()
    for tokens in window:
        wrapped.step(tokens, device)
    returned = time.perf_counter()
    synchronize(device)
    return (time.perf_counter() - start) / len(window), (returned - start) / len(window)


def shape_link(rate_gbit: float | None) -> None:
    """Shape ``lo`` to ``rate_gbit`` (``None``: unshaped), rank 0 between two barriers of the job: a token bucket of
    100 us of the link, two 64 KiB frames at least."""
    dist.barrier()
    if dist.get_rank() == 0:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
    if dist.get_rank() == 0 and rate_gbit is not None:
        rate = rate_gbit * 1e9
        burst = max(int(rate / 8 * 100e-6), 2 * 65536)
        limit = max(int(rate / 8 * 0.05), 8 << 20)
        command = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_gbit}gbit"]
        subprocess.run([*command, "burst", str(burst), "limit", str(limit)], check=True)
    dist.barrier()


def count_launches(wrapped: Wrapped, batches: Batches, seed: int, step: int, device: torch.device) -> dict[str, float]:
    """Launches per step over two profiled steps: the host's kernel launches, a CUDA graph's replay counted once."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for offset in range(2):
            wrapped.step(batches.for_step(seed, step + offset), device)
        synchronize(device)
    events = profiler.key_averages()
    launches = sum(event.count for event in events if "LaunchKernel" in event.key or "GraphLaunch" in event.key)
    return {"launches_per_step": launches / 2}


def run_method(
    method: str, args: argparse.Namespace, batches: Batches, device: torch.device, first_round: bool
) -> dict[str, Any]:
    method, bucket_cap_mb = split_bucket(method)
    wrapped = Wrapped(method, args, device, bucket_cap_mb=bucket_cap_mb)
    row: dict[str, Any] = {"method": method, "parameters": wrapped.parameters}
    if bucket_cap_mb is not None:
        row["bucket_cap_mb"] = bucket_cap_mb
    if method in OURS:
        row["algorithm_keywords"] = algorithm_of(method)[1]
    step = 0

    def timed(count: int, window: int = 1) -> list[float]:
        """Time ``count`` steps, ``window`` at a time back to back between two device synchronisations; return each
        window's time per step."""
        nonlocal step
        times = []
        for first in range(0, count, window):
            batch = [batches.for_step(args.seed, step + offset) for offset in range(min(window, count - first))]
            times.append(timed_window(wrapped, batch, device)[0])
            step += len(batch)
        return times

    if args.regime == "nvlink" and not first_round:
        row["step_s"] = {"nvlink": statistics.median(timed(WARMUP_STEPS + args.timing_steps)[WARMUP_STEPS:])}
    elif args.regime == "nvlink":
        curve = []
        times: list[float] = []
        for chunk_start in range(0, args.train_steps, args.eval_every):
            times += timed(min(args.eval_every, args.train_steps - chunk_start))
            curve.append({"step": step, "val_loss": evaluate(wrapped, batches, device)})
        row["step_s"] = {"nvlink": statistics.median(times[WARMUP_STEPS:])}
        row["curve"] = curve
    else:
        timed(WARMUP_STEPS)
        phases = [("unshaped", None), *((f"{rate:g}gbit", rate) for rate in args.rates)]
        row["step_s"] = {}
        for label, rate in phases:
            if rate is not None and rate < 5 and method in FULL_PRECISION:
                continue
            if not args.cpu:
                shape_link(rate)
            timed(1)  # the first step after a change fills queues and windows
            count = TIMED_STEPS["slow" if rate and rate < 5 else "fast"]
            row["step_s"][label] = statistics.median(timed(count, args.window))
            if label == "unshaped" and first_round:
                row.update(count_launches(wrapped, batches, args.seed, step, device))
                step += 2
        if not args.cpu:
            shape_link(None)
    wrapped.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def evaluate(wrapped: Wrapped, batches: Batches, device: torch.device) -> float:
    """Mean loss of this rank's replica on the held-out windows (rank 0's figure is recorded)."""
    wrapped.module.eval()
    with torch.no_grad():
        losses = [loss_of(wrapped.module, tokens, device) for tokens in batches.validation(EVAL_BATCHES)]
    wrapped.module.train()
    return float(torch.stack(losses).mean())


def join_job(cpu: bool) -> tuple[torch.device, int]:
    """Join the torchrun job's default group (Gloo with ``cpu``, else NCCL on the local GPU): its device and rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return device, dist.get_rank()


def worker(args: argparse.Namespace) -> None:
    device, rank = join_job(args.cpu)
    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    batches = Batches(text, rank, 4 if args.cpu else args.batch, args.context, device)
    if args.interleave == "steps":
        run_interleaved(args, batches, device, rank)
        dist.destroy_process_group()
        return
    methods = args.methods or list(METHODS)
    stem = args.out or f"gpu_network_lab_{args.regime}{'_cpu' if args.cpu else ''}"
    out = Path(args.results_dir) / f"{stem}.json"
    rows: dict[str, list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        # Rotated by the seed too: runs of one round each (one per seed) then pool in interleaved orders.
        for method in rotated(methods, round_index + args.seed):
            started = time.perf_counter()
            row = run_method(method, args, batches, device, first_round=round_index == 0)
            rows.setdefault(method, []).append(row)
            if rank == 0:
                steps = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row["step_s"].items())
                took = time.perf_counter() - started
                print(f"round {round_index} {method:>28}: {steps} ({took:.0f} s)", flush=True)
                # After every method: a job cut short (a device call's time limit) keeps what it measured.
                write_regime(out, args, rows, round_index + 1)
    dist.destroy_process_group()


def run_interleaved(args: argparse.Namespace, batches: Batches, device: torch.device, rank: int) -> None:
    """``--interleave steps``: every method built at once, their steps taken in turn; written after every round."""
    methods = args.methods or [method for method in METHODS if method != "async"]
    wrappers = {}
    for method in methods:
        name, bucket_cap_mb = split_bucket(method)
        wrappers[method] = Wrapped(name, args, device, bucket_cap_mb=bucket_cap_mb)
    for step in range(WARMUP_STEPS):
        for method in rotated(methods, step):
            wrappers[method].step(batches.for_step(args.seed, step), device)
    synchronize(device)
    rows: dict[str, list[dict[str, float]]] = {}
    step = WARMUP_STEPS
    for round_index in range(args.rounds):
        times: dict[str, tuple[list[float], list[float]]] = {method: ([], []) for method in methods}
        for _ in range(args.timing_steps // args.window):
            window = [batches.for_step(args.seed, index) for index in range(step, step + args.window)]
            for method in rotated(methods, step // args.window):
                wall, host = timed_window(wrappers[method], window, device)
                times[method][0].append(wall)
                times[method][1].append(host)
            step += args.window
        for method, (walls, hosts) in times.items():
            rows.setdefault(method, []).append(
                {"step_ms": statistics.median(walls) * 1e3, "host_ms": statistics.median(hosts) * 1e3}
            )
        if rank == 0:
            steps = ", ".join(f"{method} {rows[method][-1]['step_ms']:.1f}" for method in methods)
            print(f"round {round_index} (ms): {steps}", flush=True)
            write_interleaved(args, rows, round_index + 1)
    for wrapped in wrappers.values():
        wrapped.close()


def write_run(args: argparse.Namespace, path: Path, benchmark: str, command: str, rounds: int, methods: dict) -> dict:
    """Write a run's JSON (what ran, where, its settings and each method's figures) to ``path``; return it."""
    # A regime's command names its regime and rounds; an interleaved run's settings keep them.
    hidden = {"worker", "results_dir", "report", "out"} | ({"regime", "rounds"} if "--regime" in command else set())
    run = {
        "benchmark": benchmark,
        "command": command,
        "settings": {k: v for k, v in vars(args).items() if k not in hidden},
        "rounds": rounds,
        "machine": machine(None if args.cpu else torch.device("cuda", 0)),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "methods": methods,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1) + "\n")
    return run


def write_interleaved(args: argparse.Namespace, rows: dict[str, list[dict[str, float]]], rounds: int) -> None:
    """An interleaved run's medians over rounds, with each round's row, as ``<--out>.json`` and its table (``.md``)."""
    summary = {
        method: {
            "rounds": method_rows,
            **{key: median_range([row[key] for row in method_rows]) for key in ("step_ms", "host_ms")},
        }
        for method, method_rows in rows.items()
    }
    command = f"python benchmarks/gpu_network_lab.py --interleave steps --rounds {args.rounds}"
    command += f" --timing-steps {args.timing_steps}" + (f" --window {args.window}" if args.window != 1 else "")
    command += (f" --methods {' '.join(args.methods)}" if args.methods else "") + f" --out {args.out}"
    out = Path(args.results_dir) / f"{args.out}.json"
    run = write_run(
        args, out, "NVLink steps of every method, built together and timed in turn", command, rounds, summary
    )
    device = run["machine"]["device"]
    heading = f"Written by `{command}` ({device}, {rounds} rounds). Medians over rounds [min, max]; per step.\n\n"
    out.with_suffix(".md").write_text(heading + markdown_table(*interleaved_table(run)))


def write_regime(path: Path, args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], rounds: int) -> None:
    """A regime's run: each method's figures over rounds (median, min, max per link), its curve, its launches."""
    summary = {}
    for method, method_rows in rows.items():
        first = method_rows[0]
        summary[method] = {
            "step_s": {
                label: median_range([row["step_s"][label] for row in method_rows if label in row["step_s"]])
                for label in first["step_s"]
            },
            "rounds": method_rows,
            **{key: first[key] for key in ("launches_per_step", "parameters", "curve") if key in first},
        }
    command = (
        f"python benchmarks/gpu_network_lab.py --regime {args.regime} --rounds {args.rounds}"
        + (f" --methods {' '.join(args.methods)}" if args.methods else "")
        + (f" --rates {' '.join(f'{r:g}' for r in args.rates)}" if args.regime == "sockets" else "")
        + (f" --seed {args.seed}" if args.seed else "")
        + (f" --window {args.window}" if args.window != 1 else "")
        + (f" --schedule {args.schedule}" if args.schedule != "cosine" else "")
        + (f" --lr-warmup {args.lr_warmup}" if args.schedule == "cosine" and args.lr_warmup != LR_WARMUP else "")
    )
    write_run(args, path, f"GPU network lab, regime {args.regime}", command, rounds, summary)


# ------------------------------------------------------------------------------------------------ entry


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=["nvlink", "sockets"], default="nvlink")
    parser.add_argument("--methods", nargs="+", type=method_choice, help="default: all; METHOD@MiB: a bucket size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", nargs="+", type=float, default=[25.0, 10.0, 1.0], help="Gbit/s, fastest first")
    parser.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-4, help="the peak learning rate")
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    parser.add_argument("--lr-warmup", type=int, default=LR_WARMUP, help="cosine: steps of linear warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=300, help="nvlink: steps each method trains")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--timing-steps", type=int, default=40, help="nvlink: timed steps of a later round")
    parser.add_argument("--window", type=int, default=1, help="timed steps back to back between synchronisations")
    parser.add_argument("--interleave", choices=["methods", "steps"], default="methods", help="steps: in turn")
    parser.add_argument("--cpu", action="store_true", help="a tiny model on two Gloo processes (smoke test)")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--out", default=None, help="results file name without suffix (default: by regime)")
    parser.add_argument("--report", action="store_true", help="write the table and chart from the regimes' files")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interleave == "steps":
        if args.regime != "nvlink" or not args.out or args.out.startswith("gpu_network_lab"):
            parser.error("--interleave steps times NVLink steps apart from the lab's runs: give it --out NAME")
        if any(split_bucket(method)[0] == "async" for method in args.methods or ()):
            # async's averaging thread would send while the others are timed.
            parser.error("--interleave steps cannot time async: time it in the lab's own rounds")
        if args.window < 1 or args.timing_steps % args.window:
            parser.error(f"--window {args.window} must be a positive divisor of --timing-steps {args.timing_steps}")
        return args
    if args.window < 1 or (args.window > 1 and args.regime != "sockets"):
        parser.error(
            f"--window {args.window}: give a positive number of steps, and only with --regime sockets (the NVLink"
            " runs time their steps one by one, and pool across runs)"
        )
    if any("@" in method for method in args.methods or ()) and not (args.out or "").startswith(BUCKET_RUNS):
        raise SystemExit(
            f"--methods {' '.join(args.methods)}: a run with bucket sizes (METHOD@MiB) compares them and must not pool"
            f" into the lab's report: give it --out {BUCKET_RUNS}NAME."
        )
    return args


def launch(args: argparse.Namespace) -> None:
    env = job_env([ROOT / "src"], **(SOCKETS_ENV if args.regime == "sockets" and not args.cpu else {}))
    command = [*torchrun("--standalone", "--nproc-per-node", "2"), __file__, "--worker", *sys.argv[1:]]
    subprocess.run(command, env=env, check=True, cwd=ROOT)
    if args.interleave == "steps":
        print((Path(args.results_dir) / f"{args.out}.md").read_text())
    elif (args.out or "").startswith(BUCKET_RUNS):
        print(write_bucket_comparison(Path(args.results_dir) / f"{args.out}.json"))
    else:
        print(report(Path(args.results_dir), args.cpu))


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.report:
        print(report(Path(arguments.results_dir), arguments.cpu))
    elif arguments.worker:
        worker(arguments)
    else:
        launch(arguments)
