"""Step time of a ~124M-parameter transformer LM under Lightning: DDP and its hooks against every Bagua algorithm.

A GPT-2-small-shaped decoder (12 layers, width 768, 1024-token context) trains in bf16-mixed on random tokens,
``--batch`` sequences per GPU, one fresh job per method and regime (``nvlink``: NCCL's defaults; ``sockets``: NCCL
over TCP on ``lo``), ``--repeats`` jobs per method interleaved in rotated order. A callback times each step between
CUDA synchronisations; recorded per method: the median of the jobs' median steps, their min and max, tokens per
second, the bytes handed to collectives per step and the peak GPU memory. Methods: ``single`` (one GPU, the floor),
``ddp``, ``ddp_fp16``, ``ddp_powersgd`` (rank 1) and every algorithm (``bytegrad``, ``qadam``, ``low_rank`` flat).

    python benchmarks/lm_step_time.py                           # two GPUs, both regimes, every method
    python benchmarks/lm_step_time.py --devices 1 --regimes nvlink --methods single ddp auto diloco

It writes ``benchmarks/results/lm_step_time_gpu.json`` and ``.md`` (``--out`` names them; ``--cpu``: a tiny model
on two Gloo processes, a smoke test, ``lm_step_time_cpu.*``).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import SOCKETS_ENV, result_lines, rotated
from lab.jobs import job_env
from lab.models import DecoderLM
from lab.render import markdown_table
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
        """Each step's seconds between two CUDA synchronisations, and the bytes it handed to collectives."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.bytes: list[int] = []
            self._start = (0.0, 0)

        def _now(self, trainer: pl.Trainer) -> tuple[float, int]:
            if torch.cuda.is_available() and not args.cpu:
                torch.cuda.synchronize()
            counter = getattr(trainer.strategy, "communication_counter", None)
            return time.perf_counter(), 0 if counter is None else counter.bytes_sent

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            self._start = self._now(trainer)

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            now, sent = self._now(trainer)
            self.times.append(now - self._start[0])
            self.bytes.append(sent - self._start[1])

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
    env = job_env([ROOT / "src"], **(SOCKETS_ENV if regime == "sockets" else {}))
    flags = {"method": method, "batch": args.batch, "devices": args.devices, "steps": args.steps, "warmup": args.warmup}
    command = [sys.executable, str(Path(__file__).resolve()), "--job", *(f"--{k}={v}" for k, v in flags.items())]
    # Lightning's own launcher starts the second process, as a user's `python train.py` would.
    command += ["--cpu"] if args.cpu else []
    completed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    found = result_lines(completed.stdout, "RESULT")
    if completed.returncode != 0 or not found:
        raise RuntimeError(f"{regime}/{method} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
    return {"regime": regime, **found[-1]}


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


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a run: per method and regime the median step (x DDP's) and the repeats' range, and the
    peak memory; the docs' table of the run too."""
    results = report["results"]
    regimes = list(dict.fromkeys(row["regime"] for row in results))
    by_key = {(row["regime"], row["method"]): row for row in results}
    rows = []
    for method in dict.fromkeys(row["method"] for row in results):
        cells = [method]
        for regime in regimes:
            row, ddp = by_key.get((regime, method)), by_key.get((regime, "ddp"))
            if row is None:
                cells.append("-")
                continue
            ratio = f" ({row['median_step_s'] / ddp['median_step_s']:.2f}x)" if ddp else ""
            low, high = row["min_step_s"] * 1e3, row["max_step_s"] * 1e3
            cells.append(f"{row['median_step_s'] * 1e3:.1f} ms{ratio}, {low:.1f}-{high:.1f}")
        peak = next(row for row in results if row["method"] == method)["peak_memory_bytes"]
        rows.append([*cells, "-" if peak is None else f"{peak / 2**30:.1f} GiB"])
    repeats = report["settings"]["repeats"]
    return ["method", *(f"{regime}: median of {repeats} (x DDP), min-max" for regime in regimes), "peak memory"], rows


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
    text = f"Written by `{command}`; every figure is in the JSON file of the same name.\n\n"
    text += markdown_table(*table(report))
    write_report(Path(args.results_dir), stem, report, text)
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", nargs="+", default=["nvlink", "sockets"], choices=["nvlink", "sockets"])
    parser.add_argument("--methods", nargs="+", help="default: all")
    parser.add_argument("--batch", type=int, default=64, help="sequences of 1024 tokens per GPU per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps (also qadam's and async's warm-up)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one job may take")
    parser.add_argument("--repeats", type=int, default=5, help="jobs per method, interleaved with the other methods")
    parser.add_argument("--devices", type=int, default=2, help="GPUs (or Gloo processes) per job; 'single' uses 1")
    parser.add_argument("--cpu", action="store_true", help="a tiny model on two Gloo processes (smoke test)")
    parser.add_argument("--out", help="results file name without suffix (default: lm_step_time_gpu)")
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
