"""Step time of a ~124M-parameter transformer LM under Lightning: DDP and its hooks against every Bagua algorithm.

The model is a GPT-2-small-shaped decoder (12 layers, width 768, 12 heads, tied 50304-token embeddings, 1024-token
context) trained in bf16-mixed precision on random tokens, with a large per-GPU batch (``--batch``, 64 sequences by
default: activations then take most of the memory a step uses, as in real pre-training; the peak is recorded).
For each network regime and method, a fresh ``torchrun`` job trains ``--warmup + --steps`` steps under
``lightning.Trainer``; a callback times every step between CUDA synchronisations. Recorded per method: the median
step time, tokens per second over all ranks, the payload bytes per step each rank hands to collectives, and the
peak GPU memory.

Methods: ``single`` (one GPU, no communication: the limit), ``ddp`` (Lightning's ``strategy="ddp"``),
``ddp_fp16`` (DDP with torch's ``fp16_compress_hook``), ``ddp_powersgd`` (DDP with torch's PowerSGD hook, rank 1,
after ten uncompressed steps) and every algorithm of ``BaguaStrategy`` with its defaults, except that bytegrad
and qadam run flat (``hierarchical=False``: on one node their hierarchical default would not compress); qadam and
async are timed after their warm-up.

Regimes: ``nvlink`` (NCCL's defaults) and ``sockets`` (NCCL forced onto TCP over loopback:
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo``, a commodity interconnect).

On a machine with two GPUs::

    python benchmarks/lm_step_time.py                           # both regimes, every method
    python benchmarks/lm_step_time.py --regimes sockets --methods ddp bytegrad
    python benchmarks/lm_step_time.py --devices 1 --regimes nvlink --methods ddp bytegrad   # one GPU: host cost

Every method runs ``--repeats`` jobs (5 by default), interleaved: each round runs every method once, in an order
rotated from round to round. Recorded per method: the median of the jobs' median step times, the min and max of
them and their spread ``(max - min) / median``; a ratio between two methods means something only where it is
larger than both spreads.

It writes ``benchmarks/results/lm_step_time_gpu.json`` and ``lm_step_time_gpu.md`` (``--out`` names them).
``benchmarks/results/lm_step_time_gpu_1xh200_auto_diloco`` is its one-GPU run of ``auto`` and ``diloco`` beside
DDP (the command is in the file). ``--cpu`` runs a tiny model on two Gloo processes instead (a smoke test of the
script; its figures mean nothing) and writes ``lm_step_time_cpu.*``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import SOCKETS_ENV, rotated
from lab.models import DecoderLM
from lab.results import new_report, write_report

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
DDP_METHODS = ("ddp", "ddp_fp16", "ddp_powersgd")


def all_methods() -> list[str]:
    from lightning_bagua.engine import available_algorithms

    return ["single", *DDP_METHODS, *available_algorithms()]


# ------------------------------------------------------------------------------------------------ one job


def job(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset

    from lightning_bagua import BaguaStrategy, QAdamOptimizer

    shape = {"vocab": 512, "width": 64, "depth": 2, "heads": 4, "context": 64} if args.cpu else {}
    vocab, width = shape.get("vocab", 50304), shape.get("width", 768)
    depth, heads, context = shape.get("depth", 12), shape.get("heads", 12), shape.get("context", 1024)
    warmup = args.warmup

    class RandomTokens(Dataset):
        def __len__(self) -> int:
            return 1 << 30

        def __getitem__(self, index: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(index)
            return torch.randint(vocab, (context + 1,), generator=generator)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = DecoderLM(vocab, width, depth, heads, context)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(batch[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if args.method == "qadam":
                return QAdamOptimizer(self.parameters(), lr=1e-4, warmup_steps=warmup)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.bytes: list[int] = []
            self._start = 0.0
            self._bytes_start = 0

        def _sync(self) -> None:
            if torch.cuda.is_available() and not args.cpu:
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            self._sync()
            counter = getattr(trainer.strategy, "communication_counter", None)
            self._bytes_start = counter.bytes_sent if counter is not None else 0
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            self._sync()
            self.times.append(time.perf_counter() - self._start)
            counter = getattr(trainer.strategy, "communication_counter", None)
            self.bytes.append(counter.bytes_sent - self._bytes_start if counter is not None else 0)

    if args.method == "single":
        strategy: Any = "auto"
        devices = 1
    elif args.method in DDP_METHODS:
        from lightning.pytorch.strategies import DDPStrategy
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: dict[str, Any] = {}
        if args.method == "ddp_fp16":
            hooks = {"ddp_comm_hook": default_hooks.fp16_compress_hook}
        elif args.method == "ddp_powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
            hooks = {"ddp_comm_state": state, "ddp_comm_hook": powerSGD_hook.powerSGD_hook}
        strategy = DDPStrategy(gradient_as_bucket_view=True, **hooks)
        devices = args.devices
    else:
        keywords: dict[str, Any] = {"warmup_steps": warmup} if args.method == "async" else {}
        if args.method in ("bytegrad", "qadam", "low_rank"):
            # Both GPUs sit on one node, where hierarchical (their default) leaves only the full-precision
            # intra-node level; flat, they compress between the two GPUs, as between two single-GPU machines.
            # (low_rank on one node with hierarchical=True never compresses at all.)
            keywords["hierarchical"] = False
        strategy = BaguaStrategy(algorithm=args.method, **keywords)
        devices = args.devices
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu" if args.cpu else "gpu",
        devices=devices,
        strategy=strategy,
        precision="32-true" if args.cpu else "bf16-mixed",
        max_steps=warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        use_distributed_sampler=False,  # random tokens: every rank draws its own batch
    )
    module = Module()
    parameters = sum(p.numel() for p in module.parameters())
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=args.batch, num_workers=2, persistent_workers=True))
    if trainer.global_rank != 0:
        return
    timed = timer.times[warmup:]
    median = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and not args.cpu else None
    parameter_bytes = parameters * 4  # fp32 master weights and gradients under bf16-mixed
    counted = statistics.median(timer.bytes[warmup:])
    payload = {"ddp": parameter_bytes, "ddp_fp16": parameter_bytes // 2}.get(args.method, counted or None)
    result = {
        "method": args.method,
        "parameters": parameters,
        "median_step_s": median,
        "tokens_per_s": devices * args.batch * context / median,
        "bytes_per_step": None if args.method == "single" else payload,
        "peak_memory_bytes": peak,
        "steps_timed": len(timed),
    }
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ the suite


def run_job(args: argparse.Namespace, regime: str, method: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    if regime == "sockets":
        env.update(SOCKETS_ENV)
    command = [str(Path(__file__).resolve()), "--job", "--method", method, "--batch", str(args.batch)]
    command += ["--devices", str(args.devices)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), *(["--cpu"] if args.cpu else [])]
    # Lightning's own launcher starts the second process, as a user's `python train.py` would.
    completed = subprocess.run(
        [sys.executable, *command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"{regime}/{method} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
    return {"regime": regime, **json.loads(lines[-1][len("RESULT ") :])}


def summarise(regime: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's repeats: the median of the jobs' median step times, their spread, and every job's row."""
    medians = [row["median_step_s"] for row in rows]
    median = statistics.median(medians)
    return {
        **rows[0],
        "regime": regime,
        "median_step_s": median,
        "min_step_s": min(medians),
        "max_step_s": max(medians),
        "spread": (max(medians) - min(medians)) / median,
        "tokens_per_s": rows[0]["tokens_per_s"] * rows[0]["median_step_s"] / median,
        "peak_memory_bytes": max((row["peak_memory_bytes"] or 0) for row in rows) or None,
        "repeats": rows,
    }


def markdown(results: list[dict[str, Any]], regimes: list[str], methods: list[str], command: str) -> str:
    by_key = {(r["regime"], r["method"]): r for r in results}
    lines = [
        "Median over the repeats of each job's median step time in ms (ratio to Lightning DDP's in the same",
        f"regime), then the repeats' spread (max - min) / median. Written by `{command}`;",
        "every figure is in the JSON file of the same name.",
        "",
        "| method | " + " | ".join(f"{regime} ms (x DDP)" for regime in regimes) + " | MB/step | peak GiB |",
        "|---|" + "---|" * len(regimes) + "---|---|",
    ]
    for method in methods:
        cells = []
        for regime in regimes:
            row, ddp = by_key.get((regime, method)), by_key.get((regime, "ddp"))
            if row is None:
                cells.append("")
            else:
                ratio = f" ({row['median_step_s'] / ddp['median_step_s']:.2f}x)" if ddp else ""
                cells.append(f"{row['median_step_s'] * 1e3:.1f}{ratio}, spread {row['spread'] * 100:.0f}%")
        any_row = next((by_key[(regime, method)] for regime in regimes if (regime, method) in by_key), None)
        payload = None if any_row is None else any_row["bytes_per_step"]
        peak = None if any_row is None else any_row["peak_memory_bytes"]
        cells.append("" if payload is None else f"{payload / 1e6:.1f}")
        cells.append("" if peak is None else f"{peak / 2**30:.1f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def suite(args: argparse.Namespace) -> None:
    methods = args.methods or all_methods()
    unknown = sorted(set(methods) - set(all_methods()))
    if unknown:
        raise SystemExit(f"Unknown methods {unknown}; choose from {all_methods()}.")
    if not args.cpu and not 1 <= args.devices <= torch.cuda.device_count():
        raise SystemExit(
            f"--devices {args.devices} needs as many GPUs, found {torch.cuda.device_count()}; --cpu for a smoke test."
        )
    stem = args.out or f"lm_step_time_{'cpu' if args.cpu else 'gpu'}"
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    # Interleaved: every repeat runs each method once (in a rotated order), so that a drift of the machine
    # (clocks, temperature, other load) spreads over all methods instead of biasing the ones run last.
    for repeat in range(args.repeats):
        for regime in args.regimes:
            for method in rotated(methods, repeat):
                if method == "single" and regime != args.regimes[0]:
                    continue  # one GPU communicates with nobody: the same in every regime
                row = run_job(args, regime, method)
                runs.setdefault((regime, method), []).append(row)
                print(f"#{repeat} {regime:>7} {method:>28}: {row['median_step_s'] * 1e3:9.1f} ms", flush=True)
        # Written after every round, so that a run cut short (a device's time limit) keeps its whole rounds.
        table = write(args, methods, runs, stem, rounds=repeat + 1)
    print(table)


def write(
    args: argparse.Namespace,
    methods: list[str],
    runs: dict[tuple[str, str], list[dict[str, Any]]],
    stem: str,
    rounds: int,
) -> str:
    results = []
    for regime in args.regimes:
        for method in methods:
            rows = runs.get((regime, method)) or runs[(args.regimes[0], method)]
            results.append(summarise(regime, rows))
    # The command that reproduces the figures: where they were written is left out.
    argv = sys.argv[1:]
    kept = [a for i, a in enumerate(argv) if a != "--results-dir" and (i == 0 or argv[i - 1] != "--results-dir")]
    command = " ".join(["python benchmarks/lm_step_time.py", *kept])
    settings = {k: v for k, v in vars(args).items() if k not in {"job", "method", "results_dir"}}
    report = new_report(
        "transformer LM step time under Lightning: DDP, DDP hooks and every Bagua algorithm",
        settings,
        results,
        peers=[m for m in methods if m in ("single", *DDP_METHODS)],
        device=None if args.cpu else torch.device("cuda", 0),
        command=command,
    )
    report |= {"rounds": rounds, "results": report.pop("rows")}
    table = markdown(results, args.regimes, methods, command)
    write_report(Path(args.results_dir), stem, report, table)
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", nargs="+", default=["nvlink", "sockets"], choices=["nvlink", "sockets"])
    parser.add_argument("--methods", nargs="+", default=None, help="default: all")
    parser.add_argument("--batch", type=int, default=64, help="sequences of 1024 tokens per GPU per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps (also qadam's and async's warm-up)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one job may take")
    parser.add_argument("--repeats", type=int, default=5, help="jobs per method, interleaved with the other methods")
    parser.add_argument("--devices", type=int, default=2, help="GPUs (or Gloo processes) per job; 'single' uses 1")
    parser.add_argument("--cpu", action="store_true", help="a tiny model on two Gloo processes (smoke test)")
    parser.add_argument("--out", default=None, help="results file name without suffix (default: lm_step_time_gpu)")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where the results files go")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.job:
        job(arguments)
    else:
        suite(arguments)
