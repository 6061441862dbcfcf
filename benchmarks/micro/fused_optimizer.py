"""Optimizer step time: fuse_optimizer's fuse_step against torch's for-loop, foreach and fused implementations.

The model is many small tensors (by default 2000 of 500 to 1500 elements), where per-tensor overhead dominates.
Every variant steps the same parameters with the same gradients, which stay in place between steps (as with
``zero_grad(set_to_none=False)``); one extra variant gives ``fuse_step`` new gradient tensors before every step (as
after ``zero_grad(set_to_none=True)`` and a backward), so that its copies into the flat buffer are timed too:

    python benchmarks/micro/fused_optimizer.py            # CPU, one thread
    python benchmarks/micro/fused_optimizer.py --gpu      # one CUDA GPU

Prints a table and writes ``benchmarks/results/fused_optimizer_{cpu,gpu}.json``: the median step time over
``--steps`` steps after ``--warmup`` steps (taken in ``--rounds`` rounds that alternate the variants, so drift hits
all alike), per optimizer and variant, with the machine and versions.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_bagua.optim.fused import fuse_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.render import markdown_table
from lab.results import RESULTS, new_report, write_report

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "Adam": (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-2}),
    "SGD(momentum)": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9, "nesterov": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9}),
}
VARIANTS = {
    "for_loop": "step() with foreach=False: torch's per-tensor Python loop",
    "foreach": "step() with foreach=True: multi-tensor kernels",
    "torch_fused": "step() with fused=True: torch's fused kernel",
    "fuse_step": "fuse_optimizer(check_flatten=True), fuse_step(); gradients already in the flat buffer",
    "fuse_step_no_check": "fuse_optimizer(check_flatten=False), fuse_step()",
    "fuse_step_new_grads": "fuse_step() after new gradient tensors replaced the buffer views (copied in)",
    "fuse_step+torch_fused": "fuse_optimizer over an optimizer with fused=True",
}
# Classes with a fused=True implementation in torch (on CPU and CUDA).
HAS_FUSED = {torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad}


def make_tensors(args: argparse.Namespace, device: torch.device) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(args.min_numel, args.max_numel + 1, (args.tensors,), generator=generator).tolist()
    params = [torch.nn.Parameter(torch.randn(size, generator=generator).to(device)) for size in sizes]
    grads = [torch.randn(size, generator=generator).to(device) for size in sizes]
    return params, grads


def variants(cls: type[torch.optim.Optimizer]) -> list[str]:
    """The variants ``cls`` has: those of torch's fused kernel only where torch has one."""
    return [name for name in VARIANTS if cls in HAS_FUSED or "torch_fused" not in name]


def build(
    name: str, cls: type[torch.optim.Optimizer], kwargs: dict, args: argparse.Namespace, device: torch.device
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Return (prepare, step) for one variant: prepare runs untimed before each timed step."""
    params, grads = make_tensors(args, device)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    options = {"foreach": name == "foreach"}
    if name in ("torch_fused", "fuse_step+torch_fused"):
        options = {"fused": True}
    optimizer = cls(params, **kwargs, **options)
    if not name.startswith("fuse_step"):
        return (lambda: None), optimizer.step
    fuse_optimizer(optimizer, check_flatten=name != "fuse_step_no_check")
    if name != "fuse_step_new_grads":
        return (lambda: None), optimizer.fuse_step
    pool = [g.clone() for g in grads]

    def new_grads() -> None:
        for p, g in zip(params, pool, strict=True):
            p.grad = g  # a tensor outside the buffer, as a backward after zero_grad(set_to_none=True) leaves

    return new_grads, optimizer.fuse_step


def time_variant(
    prepare: Callable[[], None], step: Callable[[], None], args: argparse.Namespace, device: torch.device
) -> list[float]:
    times = []
    for index in range(args.warmup + args.steps):
        prepare()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="run on CUDA device 0 instead of the CPU")
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--min-numel", type=int, default=500)
    parser.add_argument("--max-numel", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/fused_optimizer_*.json)")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if args.gpu else torch.device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.optimizers.split(",")
    times: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for _ in range(args.rounds):
        for name in names:
            cls, kwargs = OPTIMIZERS[name]
            for variant in variants(cls):
                prepare, step = build(variant, cls, kwargs, args, device)
                times[name].setdefault(variant, []).extend(time_variant(prepare, step, args, device))

    rows = []
    for name, by_variant in times.items():
        base = statistics.median(by_variant["for_loop"])
        for variant, values in by_variant.items():
            deciles = statistics.quantiles(values, n=10)
            rows.append(
                {
                    "optimizer": name,
                    "variant": variant,
                    "median_ms": statistics.median(values) * 1e3,
                    "p10_ms": deciles[0] * 1e3,
                    "p90_ms": deciles[-1] * 1e3,
                    "speedup_vs_for_loop": base / statistics.median(values),
                }
            )
    header = ["optimizer", "variant", "median ms", "p10", "p90", "x for-loop"]
    cells = [[row["optimizer"], row["variant"], *(f"{row[key]:.3f}" for key in ("median_ms", "p10_ms", "p90_ms")),
              f"{row['speedup_vs_for_loop']:.2f}"] for row in rows]  # fmt: skip
    print(markdown_table(header, cells), end="")

    params, _ = make_tensors(args, torch.device("cpu"))
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    settings.update(tensors=len(params), elements=sum(p.numel() for p in params))
    benchmark = "median optimizer step time: for-loop vs foreach vs torch fused vs fuse_optimizer's fuse_step"
    command = "python benchmarks/micro/fused_optimizer.py" + (" --gpu" if args.gpu else "")
    report = new_report(benchmark, settings, rows, device=device, command=command)
    report["variants"] = VARIANTS
    out = Path(args.out) if args.out else RESULTS / f"fused_optimizer_{'gpu' if args.gpu else 'cpu'}.json"
    print(f"wrote {write_report(out.parent, out.stem, report)}")


if __name__ == "__main__":
    main()
