"""What ``low_precision_decentralized``'s round costs after each optimizer step, on one GPU (or the CPU).

The GPU lab's model (``harness.DecoderLM``: 16 layers, width 768, 114M float32 weights) on one device, in a
process group of one. Two measurements:

1. **Flat copies.** The time of copying the parameters into one flat tensor with ``torch.cat`` (how the round
   gathered the weights before the engine laid the parameters out in its buffer) and with
   ``torch._foreach_copy_`` into views of it (how a round that copies gathers them now), of copying a flat tensor
   back into the parameters with ``torch._foreach_copy_``, and of one copy between two flat tensors of the same
   size (what writing back costs where the parameters live in the buffer).
2. **The optimizer step, round included.** AdamW's step under ``ddp`` (no round), and under
   ``low_precision_decentralized`` (flat) in three variants: ``aliased``, as the engine runs it (the parameters
   laid out in the round's buffer, the decoded code added to ``w`` in one pass); ``two_pass_add``, the same but
   decoding into a temporary and adding that (as the codec did on CUDA before its one-pass kernel); ``copied``,
   also with the weights copied in and out (``alias=False``, as the engine still runs parameters that a fused
   optimizer holds in its own flat buffer). The round runs in the step's
   post-hook, so the step's time less DDP's is the round's. Alone on its ring the rank still forms the
   difference, compresses it, decodes its own code and writes the weights back; it exchanges nothing and has no
   neighbour's code to decode (a ring of two adds one decode-add).

Times are device time between two CUDA events (on the CPU, wall time). The variants' steps interleave, the order
rotated from step to step; a figure is the median over ``--rounds`` rounds of each round's median over
``--steps`` steps, with the rounds' min and max::

    python benchmarks/weight_round_cost.py            # one GPU
    python benchmarks/weight_round_cost.py --cpu      # a tiny model on the CPU: a smoke test, figures mean nothing

Writes ``benchmarks/results/weight_round_cost_{gpu,cpu}.json`` and ``.md`` (``--out`` names another stem).
"""

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from lab.harness import rotated
from lab.models import DecoderLM
from lightning_bagua.engine.algorithms.weights import views_like
from lightning_bagua.engine.codec import MinMaxUInt8Codec

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("ddp", "aliased", "two_pass_add", "copied")
COPIES = ("torch.cat", "torch._foreach_copy_ in", "torch._foreach_copy_ out", "flat copy")


class Clock:
    """Device time between two CUDA events, or wall time on the CPU, in ms."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time(self, work: Callable[[], Any]) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            work()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(args.seed)
    shape = (256, 64, 2, 4) if args.cpu else (256, 768, 16, 12)
    return DecoderLM(*shape, args.context).to(device)


def time_copies(args: argparse.Namespace, device: torch.device, clock: Clock) -> dict[str, list[float]]:
    """Each flat copy's per-round medians (ms)."""
    parameters = list(build_model(args, device).parameters())
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in parameters])
    other = flat.clone()
    pieces = views_like(flat, parameters)
    work = {
        "torch.cat": lambda: torch.cat([parameter.detach().reshape(-1) for parameter in parameters], out=flat),
        "torch._foreach_copy_ in": lambda: torch._foreach_copy_(pieces, [p.detach() for p in parameters]),
        "torch._foreach_copy_ out": lambda: torch._foreach_copy_([p.detach() for p in parameters], pieces),
        "flat copy": lambda: other.copy_(flat),
    }
    medians: dict[str, list[float]] = {name: [] for name in COPIES}
    with torch.no_grad():
        for _ in range(3):
            for run in work.values():
                run()
        for _ in range(args.rounds):
            times: dict[str, list[float]] = {name: [] for name in COPIES}
            for step in range(args.steps):
                for name in rotated(list(COPIES), step):
                    times[name].append(clock.time(work[name]))
            for name in COPIES:
                medians[name].append(statistics.median(times[name]))
    return medians


class TwoPassAdd(MinMaxUInt8Codec):
    """The codec without its one-pass ``decode_add`` kernel: ``decompress_add`` decodes, then adds."""

    def _kernels(self, device: torch.device) -> Any:
        kernels = super()._kernels(device)
        if kernels is None or not hasattr(kernels, "decode_add"):
            return kernels
        return SimpleNamespace(**{name: getattr(kernels, name) for name in ("compress", "decode")})


class Variant:
    """One variant's model, AdamW and wrapper; :meth:`step` times the optimizer step (ms)."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel
        from lightning_bagua.engine.algorithms import low_precision_decentralized, weights

        self.module = build_model(args, device)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        device_ids = [device.index] if device.type == "cuda" else None
        self.model: nn.Module
        if name == "ddp":
            self.model = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True)
            return
        algorithm = Algorithm.init("low_precision_decentralized", hierarchical=False)
        grouping = weights.group_by_dtype

        def copied(parameters: Any, needs_receive_buffer: bool = False, alias: bool = False) -> Any:
            return grouping(parameters, needs_receive_buffer, alias=False)

        patch = mock.patch.object(low_precision_decentralized, "group_by_dtype", copied)
        with patch if name == "copied" else contextlib.nullcontext():
            self.model = BaguaDistributedDataParallel(self.module, [self.optimizer], algorithm, device_ids=device_ids)
        if name != "aliased":
            self.model.bagua_algorithm_impl.state.codec = TwoPassAdd()
        self.model.bagua_algorithm_impl.start()

    def step(self, tokens: torch.Tensor, clock: Clock) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        tokens = tokens.long()
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.device.type == "cuda"):
            logits = self.model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        return clock.time(self.optimizer.step)


def time_steps(args: argparse.Namespace, device: torch.device, clock: Clock) -> dict[str, list[float]]:
    """Each variant's per-round median optimizer step (ms), the variants' steps interleaved."""
    variants = {name: Variant(name, args, device) for name in VARIANTS}
    generator = torch.Generator().manual_seed(args.seed)

    def batch() -> torch.Tensor:
        return torch.randint(256, (args.batch, args.context + 1), generator=generator).to(device)

    for step in range(args.warmup):
        for name in rotated(list(VARIANTS), step):
            variants[name].step(batch(), clock)
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for step in range(args.steps):
            tokens = batch()
            for name in rotated(list(VARIANTS), step):
                times[name].append(variants[name].step(tokens, clock))
        for name in VARIANTS:
            medians[name].append(statistics.median(times[name]))
    for name, variant in variants.items():
        impl = getattr(variant.model, "bagua_algorithm_impl", None)
        if impl is not None:  # which layout the round really ran on
            medians[f"{name}:aliased"] = [float(all(weights.aliased for weights in impl.state.weights))]
            variant.model.close()
    return medians


def summary(medians: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(medians), "min_ms": min(medians), "max_ms": max(medians)}


def report(result: dict[str, Any], out: Path) -> str:
    copies, steps = result["copies"], result["optimizer_step"]
    device = result["machine"]["device"]
    flat = copies["flat copy"]["median_ms"]
    ddp = steps["ddp"]["median_ms"]
    lines = [
        f"Written by `{result['command']}` ({device}, {result['parameters']:,} float32 weights, one process;"
        f" medians over {result['settings']['rounds']} rounds of {result['settings']['steps']} steps [min, max]).",
        "",
        "Flat copies of every weight:",
        "",
        "| copy | ms [min, max] | x one flat copy |",
        "|---|---|---|",
    ]
    for name, row in copies.items():
        spread = f"{row['median_ms']:.3f} [{row['min_ms']:.3f}, {row['max_ms']:.3f}]"
        lines.append(f"| {name} | {spread} | {row['median_ms'] / flat:.1f}x |")
    lines += [
        "",
        "AdamW's step, with `low_precision_decentralized`'s round (a ring of one) in its post-hook:",
        "",
        "| variant | step ms [min, max] | round ms (step less DDP's) |",
        "|---|---|---|",
    ]
    for name, row in steps.items():
        extra = "" if name == "ddp" else f"{row['median_ms'] - ddp:.3f}"
        lines.append(f"| {name} | {row['median_ms']:.3f} [{row['min_ms']:.3f}, {row['max_ms']:.3f}] | {extra} |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--out", default=None, help="results stem (default weight_round_cost_gpu or _cpu)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu for the smoke test")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.cpu:
        args.context = min(args.context, 64)
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:  # a free port: a process group of one still listens on one
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    try:
        clock = Clock(device)
        copies = time_copies(args, device, clock)
        steps = time_steps(args, device, clock)
    finally:
        dist.destroy_process_group()
    stem = args.out or f"weight_round_cost_{'cpu' if args.cpu else 'gpu'}"
    command = "python benchmarks/weight_round_cost.py " + " ".join(sys.argv[1:])
    result = {
        "benchmark": "flat copies of the weights, and the optimizer step with low_precision_decentralized's round",
        "command": command.strip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "settings": {key: getattr(args, key) for key in ("rounds", "steps", "warmup", "batch", "context", "seed")},
        "parameters": sum(p.numel() for p in build_model(args, torch.device("cpu")).parameters()),
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "copies": {name: summary(values) for name, values in copies.items()},
        "optimizer_step": {name: summary(steps[name]) for name in VARIANTS},
        "aliased": {name: bool(steps[f"{name}:aliased"][0]) for name in VARIANTS if name != "ddp"},
        "rounds": {"copies": copies, "optimizer_step": {name: steps[name] for name in VARIANTS}},
    }
    out = Path(args.results_dir) / stem
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(report(result, out))


if __name__ == "__main__":
    main()
