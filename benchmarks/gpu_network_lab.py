"""GPU network lab: every method on two GPUs of one host, over NVLink and over shaped TCP sockets, side by side.

The model is a GPT-style byte-level decoder (16 layers, width 768, 12 heads, 512-token context: 114M parameters)
trained in bf16 autocast with AdamW (QAdam for ``qadam``) on the Python standard library's source, the text every
machine has offline (as the CPU lab's ``charlm`` task). Each GPU takes 16 sequences of 512 tokens a step. The
learning rate follows the usual GPT schedule (``--schedule cosine``): a linear warm-up over ``--lr-warmup`` steps,
then a cosine decay to a tenth of ``--lr`` at ``--train-steps``. Without the warm-up, runs of this model at this
rate stall on a plateau near step 75 or not, seed by seed and method by method: the lab files of 2026-11-27 and
earlier (``--schedule constant``) show it, DDP's and ``gradient_allreduce``'s final losses 4% apart where the math
is the same, which hid any 1% difference between methods.

Two regimes, one ``torchrun`` job each, every method trained in that one job (one process group, no Lightning
start-up per method: the engine is used from plain PyTorch, as the strategy uses it):

* ``nvlink``: NCCL's defaults. In the first round each method trains ``--train-steps`` steps from the same seed
  and is evaluated on a held-out slice every ``--eval-every`` steps: its validation curve gives its steps to the
  target loss, and its steps after the warm-up its NVLink step time. Later rounds only time ``--timing-steps``
  steps after the warm-up.
* ``sockets``: NCCL over TCP on ``lo`` (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket
  NCCL_SOCKET_IFNAME=lo``). Each method walks through the rates in one process: unshaped, then ``lo`` shaped by
  ``tc``'s ``tbf`` to each of ``--rates`` (``tc qdisc replace`` between phases, run by rank 0 between two
  barriers; the first step after a change is not timed). ``tbf`` on ``lo`` shapes both directions together, so
  a rate is the two GPUs' total, as on a half-duplex link. The full-precision methods that cost what DDP costs
  (``gradient_allreduce``, ``decentralized``) skip the slowest rate, where a step takes seconds.
  ``--window K`` takes a phase's timed steps ``K`` at a time, back to back between two device synchronisations (as
  training runs them), a step's time the window's over ``K``: work a method leaves in flight into the next step
  overlaps it there. The report marks such a run.
  The first steps of each method (its own warm-up, and PowerSGD's ``start_powerSGD_iter``) run unshaped and
  untimed. Two steps of each method are profiled after the unshaped phase: CUDA kernel launches per step.

Rounds interleave the methods (each round runs every method once, in an order rotated from round to round); a
method's figure is the median over rounds of its per-round median step, with the rounds' min and max.

Peers: ``ddp``; ``ddp_fp16`` (torch's ``fp16_compress_hook``); ``ddp_powersgd_rK`` (torch's PowerSGD hook at rank
K with ``batch_tensors_with_same_shape=True``, its fastest setting, after 10 uncompressed steps). Ours: every
algorithm, with ``bytegrad``, ``qadam``, ``low_precision_decentralized`` and ``low_rank`` flat
(``hierarchical=False``: on one node their default would not compress; the GPU lab files of 2026-11-27 and
earlier ran ``low_precision_decentralized`` with its default), ``low_rank_rK`` at rank K.

On a machine with two GPUs (the device's ``tc`` comes from ``shared/tools`` when the image has none)::

    python benchmarks/gpu_network_lab.py --regime nvlink --rounds 3
    python benchmarks/gpu_network_lab.py --regime sockets --rounds 3
    python benchmarks/gpu_network_lab.py --report     # the table, time to target and chart from both files

Each regime writes ``benchmarks/results/gpu_network_lab_<regime>.json``; ``--report`` writes
``gpu_network_lab.md`` and ``gpu_network_lab.png``. A sockets run of some methods apart, written with
``--out gpu_network_lab_sockets_NAME``, is added to the report (its rows replace the main run's), with its
command. A further NVLink run, written with ``--out gpu_network_lab_nvlink_NAME`` (another ``--seed``, more
rounds), pools with the first instead: each method's step is the median over both runs' rounds, its curve the
mean of the seeds' curves, and its final loss is shown with the seeds' range; runs of other settings or keywords
are refused. ``--cpu`` runs a tiny model on two Gloo processes, unshaped
(a smoke test of the script; its figures mean nothing).

A method may be named with a bucket size, ``METHOD@MiB`` (``bytegrad@100``): it runs with DDP's reducer capped at
that size instead of its wrapper's default, side by side with the others. Such a run compares bucket sizes: it
must be written under a name of its own (``--out gpu_bucket_cap_NAME``), never pooled into the report, and writes
``NAME.md`` with each variant's steps against the same method at its default bucket size (``--compare STEM``
writes it again from the JSON)::

    python benchmarks/gpu_network_lab.py --regime sockets --rounds 2 --rates 10 1 \
        --methods ddp bytegrad bytegrad@100 --out gpu_bucket_cap_sockets
"""

import argparse
import json
import math
import os
import platform
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
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from lab.harness import SOCKETS_ENV, rotated
from lab.models import DecoderLM
from lab.render import pyplot

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
PEERS = ("ddp", "ddp_fp16", "ddp_powersgd_r1", "ddp_powersgd_r4", "ddp_powersgd_r8")
OURS = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "qadam",
    "async",
    "low_rank_r4",
    "low_rank_r8",
    "low_rank_r16",
    "low_rank_r32",
)
METHODS = PEERS + OURS
# Methods whose step waits on every gradient at full precision, as DDP's: not run at the slowest rate (seconds a step).
FULL_PRECISION = ("gradient_allreduce", "decentralized")
BUCKET_RUNS = "gpu_bucket_cap_"  # the stems of runs that compare bucket sizes (METHOD@MiB), kept out of the report
WARMUP_STEPS = 12  # untimed, unshaped: low_rank's 10 full-precision steps, PowerSGD's 10, qadam's warm-up
TIMED_STEPS = {"fast": 8, "slow": 3}  # per rate; "slow" at rates under 5 Gbit/s
EVAL_BATCHES = 8  # held-out batches per evaluation
LR_FLOOR = 0.1  # the cosine schedule's last learning rate, as a fraction of the peak
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
        self,
        method: str,
        args: argparse.Namespace,
        device: torch.device,
        bucket_cap_mb: float | None = None,
        keywords: dict[str, Any] | None = None,
    ) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel
        from lightning_bagua.engine.algorithms.qadam import QAdamOptimizer

        torch.manual_seed(args.seed)
        shape = {"width": 64, "depth": 2, "heads": 4} if args.cpu else {}
        self.module = DecoderLM(
            shape.get("vocab", 256),
            shape.get("width", 768),
            shape.get("depth", 16),
            shape.get("heads", 12),
            args.context,
        ).to(device)
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
            bucket = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
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
            name, algorithm_keywords = algorithm_of(method)
            self.bagua = BaguaDistributedDataParallel(
                self.module,
                [self.optimizer],
                Algorithm.init(name, **{**algorithm_keywords, **(keywords or {})}),
                device_ids=device_ids,
                bucket_cap_mb=bucket_cap_mb,
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
    """The learning rate at each step, as a fraction of ``args.lr``: ``--schedule``'s warm-up and cosine decay.

    ``step_breakdown.py`` builds the lab's methods to time their steps only, with no schedule of its own: constant.
    """
    schedule, warmup = getattr(args, "schedule", "constant"), getattr(args, "lr_warmup", 0)
    total = max(getattr(args, "train_steps", 1), warmup + 1)

    def factor(step: int) -> float:
        if schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / (total - warmup))
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# What the rows of files written before the rows recorded their keywords ran, where it differs from algorithm_of.
UNRECORDED_KEYWORDS: dict[str, dict[str, Any]] = {"low_precision_decentralized": {}}


def recorded_keywords(method: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The algorithm keywords a results row of ``method`` ran with (rows of older files did not record them)."""
    rounds = entry.get("rounds") or [entry]
    if "algorithm_keywords" in rounds[0]:
        return rounds[0]["algorithm_keywords"]
    return UNRECORDED_KEYWORDS.get(method, algorithm_of(method)[1])


def split_bucket(method: str) -> tuple[str, float | None]:
    """``"bytegrad@100"`` -> ``("bytegrad", 100.0)``; ``"bytegrad"`` -> ``("bytegrad", None)`` (the default size)."""
    name, _, bucket = method.partition("@")
    return name, float(bucket) if bucket else None


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


def algorithm_of(method: str) -> tuple[str, dict[str, Any]]:
    """The algorithm name and keywords a method of ours runs."""
    if method.startswith("low_rank_r"):
        return "low_rank", {"rank": int(method.rsplit("_r", 1)[1]), "hierarchical": False}
    if method in ("bytegrad", "qadam", "low_precision_decentralized"):
        return method, {"hierarchical": False}
    if method == "async":
        return method, {"warmup_steps": WARMUP_STEPS - 2}
    return method, {}


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
    """Shape ``lo`` to ``rate_gbit`` (``None``: unshaped): a token bucket of 100 us of the link, two frames at least."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
    if rate_gbit is None:
        return
    rate = rate_gbit * 1e9
    burst = max(int(rate / 8 * 100e-6), 2 * 65536)
    limit = max(int(rate / 8 * 0.05), 8 << 20)
    command = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_gbit}gbit"]
    subprocess.run([*command, "burst", str(burst), "limit", str(limit)], check=True)


def is_launch(key: str) -> bool:
    """Whether a profiler event is a launch the host makes: a kernel's, or a CUDA graph's (one for all its kernels)."""
    return "LaunchKernel" in key or "GraphLaunch" in key


def count_launches(wrapped: Wrapped, batches: Batches, seed: int, step: int, device: torch.device) -> dict[str, float]:
    """Launches per step (host API calls, a graph's replay counted once) and kernels run on the device, over two
    profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for offset in range(2):
            wrapped.step(batches.for_step(seed, step + offset), device)
        synchronize(device)
    launches = kernels = 0
    for event in profiler.key_averages():
        if is_launch(event.key):
            launches += event.count
        if getattr(event, "device_type", None) is not None and str(event.device_type).endswith("CUDA"):
            kernels += event.count
    return {"launches_per_step": launches / 2, "device_events_per_step": kernels / 2}


def run_method(
    method: str, args: argparse.Namespace, batches: Batches, device: torch.device, first_round: bool
) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
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
                dist.barrier()
                if rank == 0:
                    shape_link(rate)
                dist.barrier()
            timed(1)  # the first step after a change fills queues and windows
            count = TIMED_STEPS["slow" if rate and rate < 5 else "fast"]
            row["step_s"][label] = statistics.median(timed(count, args.window))
            if label == "unshaped" and first_round:
                row.update(count_launches(wrapped, batches, args.seed, step, device))
                step += 2
        if not args.cpu:
            dist.barrier()
            if rank == 0:
                shape_link(None)
            dist.barrier()
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
    import torch.distributed as dist

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
    import torch.distributed as dist

    device, rank = join_job(args.cpu)
    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    batch = 4 if args.cpu else args.batch
    context = args.context
    batches = Batches(text, rank, batch, context, device)
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


def schedule_of(settings: dict[str, Any]) -> str:
    """The learning-rate schedule an NVLink run trained with, in words (runs before ``--schedule``: constant)."""
    if settings.get("schedule", "constant") == "constant":
        return f"{settings['lr']:g}, constant"
    return (
        f"{settings['lr']:g} after a linear warm-up of {settings['lr_warmup']} steps, then a cosine decay to"
        f" {LR_FLOOR:g} of it at step {settings['train_steps']}"
    )


def write_regime(path: Path, args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], rounds: int) -> None:
    summary = {}
    for method, method_rows in rows.items():
        labels = list(method_rows[0]["step_s"])
        entry: dict[str, Any] = {"step_s": {}, "rounds": method_rows}
        for label in labels:
            values = [row["step_s"][label] for row in method_rows if label in row["step_s"]]
            entry["step_s"][label] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for key in ("launches_per_step", "device_events_per_step", "parameters"):
            if key in method_rows[0]:
                entry[key] = method_rows[0][key]
        if "curve" in method_rows[0]:
            entry["curve"] = method_rows[0]["curve"]
        summary[method] = entry
    report = {
        "benchmark": f"GPU network lab, regime {args.regime}",
        "command": f"python benchmarks/gpu_network_lab.py --regime {args.regime} --rounds {args.rounds}"
        + (f" --methods {' '.join(args.methods)}" if args.methods else "")
        + (f" --rates {' '.join(f'{r:g}' for r in args.rates)}" if args.regime == "sockets" else "")
        + (f" --seed {args.seed}" if args.seed else "")
        + (f" --window {args.window}" if args.window != 1 else "")
        + (f" --schedule {args.schedule}" if args.schedule != "cosine" else "")
        + (f" --lr-warmup {args.lr_warmup}" if args.schedule == "cosine" and args.lr_warmup != LR_WARMUP else ""),
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k not in {"worker", "results_dir", "report", "regime", "rounds", "out"}
        },
        "rounds": rounds,
        "machine": machine(args),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "methods": summary,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def bucket_comparison(run: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a run of bucket sizes: each method's median step per link in ms, with the rounds'
    range, and for a ``METHOD@MiB`` its ratio to ``METHOD`` at its default bucket size in the same run."""
    methods = run["methods"]
    links = list(dict.fromkeys(label for entry in methods.values() for label in entry["step_s"]))
    rows = []
    for method, entry in methods.items():
        base = methods.get(split_bucket(method)[0]) if "@" in method else None
        cells = []
        for label in links:
            figure = entry["step_s"].get(label)
            if figure is None:
                cells.append("")
                continue
            ratio = ""
            if base is not None and label in base["step_s"]:
                ratio = f" ({figure['median'] / base['step_s'][label]['median']:.2f}x)"
            cells.append(_step_cell(figure, ratio))
        rows.append([method, *cells])
    return ["method", *(f"{link} ms" for link in links)], rows


def write_bucket_comparison(path: Path) -> str:
    """Write ``path``'s run of bucket sizes as a table beside it (``.md``, see :func:`bucket_comparison`)."""
    run = json.loads(path.read_text())
    header, rows = bucket_comparison(run)
    lines = [
        f"Written by `{run['command']} --out {path.stem}` ({run['machine']['device']}, {run['rounds']} rounds,"
        f" {run['date'][:16]}). Median step per link in ms (ratio to the same method at its wrapper's default"
        " bucket size in this run) [rounds' min, max].",
        "",
        *_markdown(header, rows),
    ]
    text = "\n".join(lines) + "\n"
    path.with_suffix(".md").write_text(text)
    return text


def machine(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_bagua.__about__ import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "devices": 2,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "lightning_bagua": __version__,
    }


# ------------------------------------------------------------------------------------------------ the report


def load_results(results_dir: Path, cpu: bool = False) -> dict[str, Any]:
    """The regimes' results files, with the sockets supplements (``--out gpu_network_lab_sockets_NAME``) merged in."""
    suffix = "_cpu" if cpu else ""
    loaded: dict[str, Any] = {}
    for regime in ("nvlink", "sockets"):
        path = results_dir / f"gpu_network_lab_{regime}{suffix}.json"
        if path.exists():
            loaded[regime] = json.loads(path.read_text())
    # A later run of some methods alone adds them, or replaces their rows; its command is listed. Later by date,
    # whatever the run's name.
    paths = results_dir.glob(f"gpu_network_lab_sockets{suffix}_*.json") if "sockets" in loaded else ()
    runs = {path: json.loads(path.read_text()) for path in paths}
    supplements = sorted(runs, key=lambda path: (runs[path]["date"], path.name))
    if "sockets" in loaded:
        main = loaded["sockets"]
        # Each run's own rows, so that a ratio can read the peer timed in the same run (sockets_beside).
        main["runs"] = {f"gpu_network_lab_sockets{suffix}": dict(main["methods"])}
        if supplements:
            main["sources"] = {f"gpu_network_lab_sockets{suffix}": (main["date"], list(main["methods"]))}
            main["windows"] = {f"gpu_network_lab_sockets{suffix}": main.get("settings", {}).get("window", 1)}
    for path in supplements:
        extra = runs[path]
        loaded["sockets"]["runs"][path.stem] = dict(extra["methods"])
        loaded["sockets"]["methods"].update(extra["methods"])
        loaded["sockets"]["command"] += f"`, then `{extra['command']} --out {path.stem}"
        loaded["sockets"]["sources"][path.stem] = (extra["date"], list(extra["methods"]))
        loaded["sockets"]["windows"][path.stem] = extra.get("settings", {}).get("window", 1)
        for _, methods in list(loaded["sockets"]["sources"].values())[:-1]:
            methods[:] = [method for method in methods if method not in extra["methods"]]
    # Further NVLink runs (``--out gpu_network_lab_nvlink_NAME``: other seeds, more rounds) pool with the first.
    if "nvlink" in loaded:
        tag_rounds(loaded["nvlink"], f"gpu_network_lab_nvlink{suffix}")
    for path in sorted(results_dir.glob(f"gpu_network_lab_nvlink{suffix}_*.json")) if "nvlink" in loaded else []:
        pool_nvlink_run(loaded["nvlink"], tag_rounds(json.loads(path.read_text()), path.stem), path.stem)
    if not loaded:
        raise SystemExit(f"No results in {results_dir}: run the regimes first.")
    return loaded


# What must agree between NVLink runs for their rounds and curves to pool (the seed may differ).
POOLED_SETTINGS = (
    "batch",
    "context",
    "lr",
    "schedule",
    "lr_warmup",
    "train_steps",
    "eval_every",
    "timing_steps",
    "cpu",
)


def tag_rounds(run: dict[str, Any], stem: str) -> dict[str, Any]:
    """Mark each round row of an NVLink run with the run it came from (``"run"``: its file's stem); return ``run``."""
    for entry in run["methods"].values():
        for row in entry.get("rounds", []):
            row.setdefault("run", stem)
    return run


def nvlink_beside(loaded: dict[str, Any], method: str, base: str = "ddp") -> tuple[dict[str, float], ...] | None:
    """``method``'s and ``base``'s NVLink steps over the runs that timed both, side by side; ``None`` if none did.

    Pooled runs may time some methods alone (``--methods``): a ratio to DDP then reads only the runs that timed
    DDP too, so that both sides met the same machine in the same job.

    Returns:
        The two methods' ``{"median", "min", "max"}`` over their rounds of those runs, and ``{"runs": count}``.
    """
    methods = loaded.get("nvlink", {}).get("methods", {})
    rows = {name: methods.get(name, {}).get("rounds", []) for name in (method, base)}
    shared = {row.get("run") for row in rows[method]} & {row.get("run") for row in rows[base]}
    if not shared:
        return None
    figures = []
    for name in (method, base):
        values = [row["step_s"]["nvlink"] for row in rows[name] if row.get("run") in shared]
        figures.append({"median": statistics.median(values), "min": min(values), "max": max(values)})
    return figures[0], figures[1], {"runs": len(shared)}


def sockets_beside(loaded: dict[str, Any], method: str, label: str, base: str = "ddp") -> dict[str, float] | None:
    """``base``'s step at a sockets link in the run that ``method``'s row comes from; ``None`` if it did not time it.

    The sockets rows come from several runs (each row from the latest run of its method): a ratio reads the peer
    timed beside the method in that run, not the peer's own latest row, so that both met the same machine.
    """
    sockets = loaded.get("sockets", {})
    entry = sockets.get("methods", {}).get(method)
    if entry is None:
        return None
    for run in reversed(sockets.get("runs", {}).values()):  # the latest run that holds the method's row
        if run.get(method) is entry:
            return run.get(base, {}).get("step_s", {}).get(label)
    return None


def pool_nvlink_run(main: dict[str, Any], extra: dict[str, Any], stem: str) -> None:
    """Add a further NVLink run's rounds and loss curve to ``main``'s, method by method.

    Each method's step is then the median over every run's rounds, and its ``curve`` the mean of the runs' curves
    (``curves`` keeps each, for the spread over seeds). The runs must share their model, data and schedule, and each
    method its keywords; a run that differs is refused, naming what differs.
    """
    differing = [key for key in POOLED_SETTINGS if main["settings"].get(key) != extra["settings"].get(key)]
    if differing:
        raise SystemExit(f"{stem} cannot pool with the NVLink run: its settings differ in {', '.join(differing)}.")
    for method, entry in extra["methods"].items():
        base = main["methods"].get(method)
        if base is None:
            main["methods"][method] = entry
            continue
        if recorded_keywords(method, base) != recorded_keywords(method, entry):
            raise SystemExit(
                f"{stem} ran {method} with {recorded_keywords(method, entry)}, the NVLink run with"
                f" {recorded_keywords(method, base)}:"
                " pool only runs of the same keywords."
            )
        base["rounds"] = base["rounds"] + entry["rounds"]
        values = [row["step_s"]["nvlink"] for row in base["rounds"]]
        base["step_s"]["nvlink"] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        curves = base.get("curves") or ([base["curve"]] if "curve" in base else [])
        curves += [entry["curve"]] if "curve" in entry else []
        if curves:
            base["curves"] = curves
            base["curve"] = [
                {"step": points[0]["step"], "val_loss": statistics.fmean(point["val_loss"] for point in points)}
                for points in zip(*curves, strict=True)
            ]
    main["rounds"] += extra["rounds"]
    main["command"] += f"`, then `{extra['command']} --out {stem}"


def links(loaded: dict[str, Any]) -> list[str]:
    """The links measured, in order: ``nvlink``, then the sockets' rates as walked."""
    labels: list[str] = []
    for regime, data in loaded.items():
        for entry in data["methods"].values():
            for label in entry["step_s"]:
                name = label if regime == "sockets" else "nvlink"
                if name not in labels:
                    labels.append(name)
    return labels


def step_of(loaded: dict[str, Any], method: str, label: str) -> dict[str, float] | None:
    """A method's step time at a link (median, min, max over rounds), ``None`` where not measured."""
    data = loaded.get("nvlink" if label == "nvlink" else "sockets")
    entry = None if data is None else data["methods"].get(method)
    return None if entry is None else entry["step_s"].get(label)


def step_table(loaded: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Median step per method and link, with its ratio to DDP's and the rounds' range, and launches per step."""
    labels = links(loaded)
    rows = []
    for method in (m for m in METHODS if any(m in data["methods"] for data in loaded.values())):
        cells = [method]
        for label in labels:
            value = step_of(loaded, method, label)
            if value is None:
                cells.append("")
                continue
            if method == "ddp":
                ratio = " (1.00x)"
            elif label == "nvlink":
                # Side by side: over the pooled runs that timed DDP too (the same as the pooled medians' ratio when
                # every run timed both).
                beside = nvlink_beside(loaded, method)
                ratio = (
                    " (no DDP in its runs)"
                    if beside is None
                    else f" ({beside[0]['median'] / beside[1]['median']:.2f}x)"
                )
            else:
                beside_ddp = sockets_beside(loaded, method, label)
                ratio = (
                    " (no DDP in its run)"
                    if beside_ddp is None
                    else f" ({value['median'] / beside_ddp['median']:.2f}x)"
                )
            cells.append(_step_cell(value, ratio))
        launches = loaded.get("sockets", {}).get("methods", {}).get(method, {}).get("launches_per_step")
        cells.append("" if launches is None else f"{launches:.0f}")
        rows.append(cells)
    return ["method", *(f"{label} ms (x DDP) [min, max]" for label in labels), "launches / step"], rows


def target_of(loaded: dict[str, Any]) -> tuple[float, int, float]:
    """The target validation loss (DDP's at two thirds of its run), the step it was reached, DDP's final loss."""
    curve = loaded["nvlink"]["methods"]["ddp"]["curve"]
    point = curve[max(0, math.ceil(len(curve) * 2 / 3) - 1)]
    return point["val_loss"], point["step"], curve[-1]["val_loss"]


def steps_to_target(loaded: dict[str, Any], method: str) -> int | None:
    """The step of a method's first evaluation at or under the target loss; ``None`` if it never got there."""
    target, _, _ = target_of(loaded)
    curve = loaded["nvlink"]["methods"][method].get("curve", [])
    return next((point["step"] for point in curve if point["val_loss"] <= target), None)


def seed_spread(entry: dict[str, Any]) -> tuple[int, str]:
    """How many seeds a method's NVLink curve averages, and their final losses' range (``""`` for a single seed).

    Args:
        entry: the method's entry of the NVLink results; pooled runs keep each seed's curve in ``curves``.

    Returns:
        The number of seeds, and ``"[min, max]"`` of their final validation losses when there is more than one.
    """
    finals = [curve[-1]["val_loss"] for curve in entry.get("curves", [])]
    if len(finals) < 2:
        return 1, ""
    return len(finals), f"[{min(finals):.4f}, {max(finals):.4f}]"


def time_to_target_table(loaded: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Steps to the target times the median step at each link, and the final loss against DDP's."""
    labels = links(loaded)
    _, _, final_ddp = target_of(loaded)
    rows = []
    for method, entry in loaded["nvlink"]["methods"].items():
        curve = entry.get("curve", [])
        reached = steps_to_target(loaded, method)
        cells = [method, "not reached" if reached is None else str(reached)]
        for label in labels:
            value = step_of(loaded, method, label)
            if method == "async" and label != "nvlink":
                # Its averaging runs beside the steps at the link's pace: NVLink's curve is not the shaped link's.
                cells.append("n/a")
                continue
            cells.append("" if value is None or reached is None else f"{reached * value['median']:.1f}")
        final = curve[-1]["val_loss"] if curve else math.nan
        seeds, spread = seed_spread(entry)
        cells.append(f"{final:.4f} ({final / final_ddp:.3f}x)" + (f" {spread} over {seeds} seeds" if spread else ""))
        rows.append(cells)
    return ["method", "steps to target", *(f"{label} s" for label in labels), "final loss (x DDP)"], rows


def source_lines(sockets: dict[str, Any]) -> list[str]:
    """The report's list of the sockets runs: each run's date, its timing where it took its steps more than one at a
    time between synchronisations, and the rows it gives."""
    lines = []
    for stem, (date, methods) in sockets["sources"].items():
        window = sockets["windows"][stem]
        timing = f"; steps timed {window} at a time, back to back" if window > 1 else ""
        lines.append(f"- `{stem}` ({date[:16]}{timing}): {', '.join(methods)}")
    return lines


def report(results_dir: Path, cpu: bool) -> str:
    """Write ``gpu_network_lab.md`` and its chart from the regimes' results; return the markdown."""
    loaded = load_results(results_dir, cpu)
    commands = " and ".join(f"`{data['command']}`" for data in loaded.values())
    machines = ", ".join(
        # Pooled runs may time some methods only: the most rounds any method's figures pool.
        f"{name}: {data['machine']['device']}, up to"
        f" {max((len(entry.get('rounds', [])) for entry in data['methods'].values()), default=data['rounds'])}"
        " rounds a method"
        for name, data in loaded.items()
    )
    lines = [
        f"Written by `python benchmarks/gpu_network_lab.py --report` from the runs of {commands} ({machines}).",
        "",
        "Median step in ms over the rounds (ratio to DDP's median at the same link; over NVLink, both medians over the"
        " pooled runs that timed DDP too) [min, max over rounds]:",
        "",
        *_markdown(*step_table(loaded)),
    ]
    sources = loaded.get("sockets", {}).get("sources", {})
    if sources:
        lines += [
            "",
            "The sockets columns (unshaped and shaped) come from these runs, each row from the last run of it:",
            "",
        ]
        lines += source_lines(loaded["sockets"])
    if "nvlink" in loaded and "ddp" in loaded["nvlink"]["methods"]:
        target, at_step, final_ddp = target_of(loaded)
        lines += [
            "",
            f"Time to the target validation loss {target:.4f} (DDP's at step {at_step}): the first evaluation at or",
            "under it, times the method's median step at each link, in seconds; and each method's final validation",
            f"loss against DDP's ({final_ddp:.4f}) at the same steps and seed. `async` averages beside the steps at",
            "the link's pace, so its NVLink curve says nothing of a shaped link (n/a).",
            f"Learning rate: {schedule_of(loaded['nvlink']['settings'])}.",
            "",
            *_markdown(*time_to_target_table(loaded)),
        ]
    text = "\n".join(lines) + "\n"
    suffix = "_cpu" if cpu else ""
    (results_dir / f"gpu_network_lab{suffix}.md").write_text(text)
    chart(loaded, results_dir / f"gpu_network_lab{suffix}.png")
    return text


def _step_cell(figure: dict[str, float], ratio: str = "") -> str:
    """A step figure in ms: ``"median (ratio) [min, max]"`` (``ratio`` as given, with its leading space)."""
    return f"{figure['median'] * 1e3:.1f}{ratio} [{figure['min'] * 1e3:.1f}, {figure['max'] * 1e3:.1f}]"


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def chart(loaded: dict[str, Any], path: Path) -> None:
    """Bar charts of the median step per method, one panel per link, with the rounds' range."""
    plt = pyplot()
    if plt is None:
        return
    labels = links(loaded)
    methods = [m for m in METHODS if any(m in data["methods"] for data in loaded.values())]
    figure, axes = plt.subplots(1, len(labels), figsize=(4 * len(labels), 5), squeeze=False)
    for axis, label in zip(axes[0], labels, strict=True):
        steps = {m: step for m in methods if (step := step_of(loaded, m, label)) is not None}
        names = list(steps)
        values = [steps[m]["median"] * 1e3 for m in names]
        below = [value - steps[m]["min"] * 1e3 for m, value in zip(names, values, strict=True)]
        above = [steps[m]["max"] * 1e3 - value for m, value in zip(names, values, strict=True)]
        axis.barh(names, values, xerr=[below, above])
        axis.invert_yaxis()
        axis.set_xscale("log")
        axis.set_xlabel("median step (ms, log)")
        axis.set_title(label)
    figure.suptitle("114M-parameter LM on two GPUs, bf16 (benchmarks/gpu_network_lab.py)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------ entry


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=["nvlink", "sockets"], default="nvlink")
    parser.add_argument(
        "--methods", nargs="+", default=None, type=method_choice, help="default: all; METHOD@MiB: another bucket size"
    )
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
    parser.add_argument("--timing-steps", type=int, default=40, help="nvlink: timed steps of later rounds")
    parser.add_argument(
        "--window",
        type=int,
        default=1,
        help="sockets: timed steps taken this many at a time, back to back between two device synchronisations",
    )
    parser.add_argument("--cpu", action="store_true", help="a tiny model on two Gloo processes (smoke test)")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--out", default=None, help="results file name without suffix (default: by regime)")
    parser.add_argument("--report", action="store_true", help="write the table and chart from the regimes' files")
    parser.add_argument("--compare", default=None, metavar="STEM", help="write STEM.md from a bucket-size run's JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    if args.regime == "sockets" and not args.cpu:
        env.update(SOCKETS_ENV)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [__file__, "--worker"]
    command += [arg for arg in sys.argv[1:] if arg != "--worker"]
    subprocess.run(command, env=env, check=True, cwd=ROOT)
    if (args.out or "").startswith(BUCKET_RUNS):
        print(write_bucket_comparison(Path(args.results_dir) / f"{args.out}.json"))
    else:
        print(report(Path(args.results_dir), args.cpu))


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.compare:
        print(write_bucket_comparison(Path(arguments.results_dir) / f"{arguments.compare}.json"))
    elif arguments.report:
        print(report(Path(arguments.results_dir), arguments.cpu))
    elif arguments.worker:
        worker(arguments)
    else:
        launch(arguments)
