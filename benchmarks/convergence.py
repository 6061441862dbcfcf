"""Convergence: every Bagua algorithm against Lightning's DDP, same hyper-parameters, same seeds, two CPU processes.

Each run is a fresh Lightning job of two Gloo processes on this machine (``Trainer(accelerator="cpu", devices=2)``,
``deterministic=True``, one torch thread per process). Within a task every method trains the same model from the
same initial weights (``seed_everything(seed)``) on the same shuffled data with the same optimizer settings; only the
communication differs. After training, both ranks score their own model on their half of the held-out data and the
metrics are averaged over the ranks (for the decentralized algorithms and async the ranks' models may differ).

Methods:

- ``ddp``: Lightning's ``strategy="ddp"`` with SGD (momentum): the baseline of every SGD algorithm;
- ``ddp_adam``: ``strategy="ddp"`` with torch's Adam: the baseline of ``qadam``;
- ``gradient_allreduce``, ``bytegrad``, ``decentralized``, ``low_precision_decentralized``, ``async``: the
  ``BaguaStrategy`` algorithm with the same SGD settings as ``ddp``;
- ``qadam``: ``lightning_bagua.QAdamOptimizer`` with Adam's learning rate and a warm-up of a fifth of the steps.

On one node, ``hierarchical`` would reduce bytegrad, qadam and both decentralized algorithms to a full-precision
average inside the node, so they run flat (``hierarchical=False``): what is measured is the algorithm itself.

Tasks:

- ``digits``: the example's task (``examples/train.py``: scikit-learn's 8x8 digits, its two-layer perceptron and
  its split); reported: test accuracy and loss.
- ``charlm``: next-byte prediction on real text available offline, the Python standard library's own source (the
  ``*.py`` files at the top of the standard library directory, sorted by name; the last tenth of the bytes is held
  out), with a small causal convolutional network over 128-byte windows; reported: held-out next-byte accuracy,
  loss (nats per byte) and perplexity.

Run it::

    python benchmarks/convergence.py                # both tasks, every method, 3 seeds (about 20 min on 2 cores)
    python benchmarks/convergence.py --quick        # fewer steps, one seed: a look in a few minutes

It writes ``benchmarks/results/convergence_cpu.json`` (machine, versions, settings, the command, every run),
``convergence_cpu.md`` (mean and spread over the seeds, and the difference to the method's DDP baseline) and, with
matplotlib (``pip install -r requirements/benchmarks.txt``), ``convergence_cpu.png``.
"""

import argparse
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

# The example is a script, not a package: its folder goes on the path so its model and data are reused, not copied.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train import DigitsClassifier, load_data

log = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
TASKS = ("digits", "charlm")
METHODS = (
    "ddp",
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "async",
    "ddp_adam",
    "qadam",
)
BASELINE = {method: "ddp_adam" if method in {"qadam", "ddp_adam"} else "ddp" for method in METHODS}
ADAM_METHODS = frozenset({"ddp_adam", "qadam"})
FLAT = {"bytegrad", "qadam", "decentralized", "low_precision_decentralized"}  # run with hierarchical=False
# Variables a surrounding launcher may have set: inherited, they would make a job join that launcher's job.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME")  # fmt: skip

# Per task: SGD learning rate and momentum, Adam learning rate, batch per process, training steps (full, quick).
SETTINGS: dict[str, dict[str, Any]] = {
    "digits": {"sgd_lr": 0.05, "momentum": 0.9, "adam_lr": 3e-3, "batch": 32, "steps": 230, "quick_steps": 60},
    "charlm": {"sgd_lr": 0.1, "momentum": 0.9, "adam_lr": 3e-3, "batch": 16, "steps": 400, "quick_steps": 80},
}
CONTEXT = 128  # bytes per language-model window
TEXT_BYTES = 1_200_000  # bytes of standard-library source read for charlm


# ------------------------------------------------------------------------------------------------ the tasks


def make_optimizer(method: str, parameters: Any, settings: dict[str, Any], steps: int) -> torch.optim.Optimizer:
    """Return the optimizer every method of a family shares: SGD with momentum, Adam, or QAdam for ``qadam``."""
    if method == "qadam":
        from lightning_bagua import QAdamOptimizer

        return QAdamOptimizer(parameters, lr=settings["adam_lr"], warmup_steps=max(1, steps // 5))
    if method in ADAM_METHODS:
        return torch.optim.Adam(parameters, lr=settings["adam_lr"])
    return torch.optim.SGD(parameters, lr=settings["sgd_lr"], momentum=settings["momentum"])


def standard_library_text() -> tuple[bytes, dict[str, Any]]:
    """Return the first ``TEXT_BYTES`` of the standard library's top-level ``*.py`` files and a description."""
    directory = Path(sysconfig.get_paths()["stdlib"])
    chunks, total, used = [], 0, 0
    for path in sorted(directory.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        used += 1
        if total >= TEXT_BYTES:
            break
    text = b"".join(chunks)[:TEXT_BYTES]
    return text, {"directory": str(directory), "files": used, "bytes": len(text)}


class ByteWindows(Dataset):
    """Non-overlapping windows of ``CONTEXT + 1`` bytes: inputs are the first ``CONTEXT``, targets shifted by one."""

    def __init__(self, data: bytes) -> None:
        self.data = torch.tensor(list(data), dtype=torch.long)
        self.count = (len(data) - 1) // CONTEXT

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        window = self.data[index * CONTEXT : index * CONTEXT + CONTEXT + 1]
        return window[:-1], window[1:]


class CausalConvLM(nn.Module):
    """Byte embeddings, residual causal convolutions with growing dilation, and a linear read-out over 256 bytes."""

    def __init__(self, width: int = 64, dilations: tuple[int, ...] = (1, 2, 4, 8, 16), kernel: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.kernel = kernel
        self.dilations = dilations
        self.convs = nn.ModuleList(nn.Conv1d(width, width, kernel, dilation=d) for d in dilations)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in dilations)
        self.out = nn.Linear(width, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)  # (batch, time, width)
        for conv, norm, dilation in zip(self.convs, self.norms, self.dilations, strict=True):
            # Pad on the left only, so position t sees bytes <= t.
            h = F.pad(norm(x).transpose(1, 2), ((self.kernel - 1) * dilation, 0))
            x = x + F.gelu(conv(h)).transpose(1, 2)
        return self.out(x)  # (batch, time, 256)


def build_task(task: str, method: str, settings: dict[str, Any], steps: int) -> tuple[Any, Dataset, Dataset]:
    """Return the LightningModule, the training set and the held-out set of ``task`` for ``method``."""
    from lightning.pytorch import LightningModule

    if task == "digits":

        class Digits(DigitsClassifier):
            def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
                super().test_step(batch, batch_idx)
                x, y = batch
                self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True, batch_size=len(y))

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return make_optimizer(method, self.parameters(), settings, steps)

        train_set, test_set = load_data()
        return Digits(lr=settings["adam_lr"]), train_set, test_set

    class CharLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CausalConvLM()

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            x, y = batch
            logits = self.model(x).flatten(0, 1)
            count = y.numel()
            self.log("test_loss", F.cross_entropy(logits, y.flatten()), sync_dist=True, batch_size=count)
            accuracy = (logits.argmax(dim=1) == y.flatten()).float().mean()
            self.log("test_acc", accuracy, sync_dist=True, batch_size=count)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(method, self.parameters(), settings, steps)

    text, _ = standard_library_text()
    split = len(text) * 9 // 10
    return CharLM(), ByteWindows(text[:split]), ByteWindows(text[split:])


# ------------------------------------------------------------------------------------------------ one job


def job(args: argparse.Namespace) -> None:
    """Train and test one (task, method, seed) on two processes; rank 0 writes the metrics to ``--result-file``."""
    from lightning.pytorch import Trainer, seed_everything

    from lightning_bagua import BaguaStrategy

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*recommended to use `Trainer\\(devices=1.*")
    settings = SETTINGS[args.task]
    seed_everything(args.seed, workers=True)
    module, train_set, test_set = build_task(args.task, args.method, settings, args.steps)
    if args.method in {"ddp", "ddp_adam"}:
        strategy: Any = "ddp"
    else:
        algorithm = "qadam" if args.method == "qadam" else args.method
        keywords: dict[str, Any] = {"hierarchical": False} if args.method in FLAT else {}
        strategy = BaguaStrategy(algorithm=algorithm, **keywords)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    start = time.perf_counter()
    trainer.fit(module, DataLoader(train_set, batch_size=settings["batch"], shuffle=True))
    train_s = time.perf_counter() - start
    (metrics,) = trainer.test(module, DataLoader(test_set, batch_size=64), verbose=False)
    if trainer.is_global_zero:
        result = {
            "test_loss": float(metrics["test_loss"]),
            "test_acc": float(metrics["test_acc"]),
            "train_s": train_s,
            "steps": trainer.global_step,
        }
        Path(args.result_file).write_text(json.dumps(result))
    # Lightning leaves the default process group alive after a run. A `ddp` job never meets BaguaStrategy's at-exit
    # handler that destroys it, so its processes exited with Gloo's threads still running and could abort in
    # interpreter shutdown ("terminate called without an active exception"). Every job ends it here, while whole.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_job(task: str, method: str, seed: int, steps: int, timeout: int) -> dict[str, Any]:
    """Start one job (Lightning starts its second process) and return its metrics, with its wall time."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as directory:
        result_file = Path(directory) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--job", "--task", task, "--method", method]
        command += ["--seed", str(seed), "--steps", str(steps), "--result-file", str(result_file)]
        start = time.perf_counter()
        completed = subprocess.run(
            command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        wall_s = time.perf_counter() - start
        if completed.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"{task}/{method}/seed {seed} failed:\n{(completed.stdout + completed.stderr)[-4000:]}")
        result = json.loads(result_file.read_text())
    return {"task": task, "method": method, "seed": seed, **result, "wall_s": wall_s}


# ------------------------------------------------------------------------------------------------ the report


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), minimum and maximum."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and method: accuracy and loss over the seeds, and the accuracy difference to the baseline's mean."""
    summary = []
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    for task in tasks:
        methods = list(dict.fromkeys(r["method"] for r in runs if r["task"] == task))
        stats: dict[str, dict[str, Any]] = {}
        for method in methods:
            chosen = [r for r in runs if r["task"] == task and r["method"] == method]
            stats[method] = {
                "accuracy_pct": spread([100 * r["test_acc"] for r in chosen]),
                "loss": spread([r["test_loss"] for r in chosen]),
                "seeds": [r["seed"] for r in chosen],
            }
        for method in methods:
            baseline = BASELINE.get(method, "ddp")
            row: dict[str, Any] = {"task": task, "method": method, "baseline": baseline, **stats[method]}
            if baseline in stats:
                base = stats[baseline]
                row["accuracy_delta_pts"] = row["accuracy_pct"]["mean"] - base["accuracy_pct"]["mean"]
                row["loss_delta"] = row["loss"]["mean"] - base["loss"]["mean"]
            if task == "charlm":
                row["perplexity_of_mean_loss"] = math.exp(row["loss"]["mean"])
            summary.append(row)
    return summary


def markdown(report: dict[str, Any]) -> str:
    """The table of the summary, with the command that wrote it."""
    lines = [
        "Held-out accuracy and loss after training, mean ± standard deviation [min, max] over the seeds; Δ is the",
        "difference of the means to the method's DDP baseline (qadam: DDP with Adam). Two Gloo processes on CPU.",
        f"Written by `{report['command']}`; every run is in `convergence_cpu.json`.",
        "",
        "| task | method | baseline | accuracy % | Δ accuracy (points) | loss | Δ loss | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        acc, loss = row["accuracy_pct"], row["loss"]
        delta = f"{row['accuracy_delta_pts']:+.2f}" if "accuracy_delta_pts" in row else "-"
        loss_delta = f"{row['loss_delta']:+.4f}" if "loss_delta" in row else "-"
        lines.append(
            f"| {row['task']} | {row['method']} | {row['baseline']} "
            f"| {acc['mean']:.2f} ± {acc['std']:.2f} [{acc['min']:.2f}, {acc['max']:.2f}] | {delta} "
            f"| {loss['mean']:.4f} ± {loss['std']:.4f} | {loss_delta} | {acc['n']} |"
        )
    if any(row["task"] == "charlm" for row in report["summary"]):
        lines += ["", "charlm loss is in nats per byte; its perplexity is exp(loss)."]
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> bool:
    """Accuracy per method and task, mean with min-max whiskers, and the baseline's mean as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart")
        return False
    tasks = list(dict.fromkeys(row["task"] for row in report["summary"]))
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=True):
        rows = [row for row in report["summary"] if row["task"] == task]
        means = [row["accuracy_pct"]["mean"] for row in rows]
        errors = [
            [m - row["accuracy_pct"]["min"] for m, row in zip(means, rows, strict=True)],
            [row["accuracy_pct"]["max"] - m for m, row in zip(means, rows, strict=True)],
        ]
        colours = ["tab:grey" if row["method"].startswith("ddp") else "tab:blue" for row in rows]
        axis.bar(range(len(rows)), means, yerr=errors, color=colours, capsize=3)
        for baseline, style in (("ddp", "--"), ("ddp_adam", ":")):
            base = next((row for row in rows if row["method"] == baseline), None)
            if base is not None:
                axis.axhline(base["accuracy_pct"]["mean"], color="black", linestyle=style, linewidth=0.8,
                             label=f"{baseline} mean")  # fmt: skip
        axis.set_xticks(range(len(rows)), [row["method"] for row in rows], rotation=35, ha="right", fontsize=8)
        low = min(row["accuracy_pct"]["min"] for row in rows)
        high = max(row["accuracy_pct"]["max"] for row in rows)
        axis.set_ylim(max(0.0, low - 0.2 * (high - low + 1)), min(100.0, high + 0.2 * (high - low + 1)))
        axis.set_ylabel("held-out accuracy (%)")
        axis.set_title(f"{task}: mean over seeds, min-max whiskers", fontsize=10)
        axis.legend(fontsize=8)
    figure.suptitle("Convergence against DDP, two CPU processes (benchmarks/convergence.py)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def machine() -> dict[str, Any]:
    """Python, torch, Lightning and the platform, with the load when the report was written."""
    import lightning

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": os.getloadavg(),
    }


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (task, method, seed) one after the other and write the report; return it."""
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    steps = {task: SETTINGS[task]["quick_steps" if args.quick else "steps"] for task in args.tasks}
    if args.steps is not None:
        steps = dict.fromkeys(args.tasks, args.steps)
    started = time.perf_counter()
    for task in args.tasks:
        for seed in range(args.seeds):
            for method in args.methods:
                try:
                    run = run_job(task, method, seed, steps[task], args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    log.error("%s %s seed %d failed: %s", task, method, seed, error)
                    failures.append({"task": task, "method": method, "seed": seed, "error": str(error)[-2000:]})
                    continue
                runs.append(run)
                log.info("%s %-28s seed %d: accuracy %.2f %% loss %.4f (%.0f s)", task, method, seed,
                         100 * run["test_acc"], run["test_loss"], run["wall_s"])  # fmt: skip
    settings: dict[str, Any] = {
        "tasks": args.tasks,
        "methods": args.methods,
        "seeds": list(range(args.seeds)),
        "quick": args.quick,
        "steps": steps,
        "per_task": {task: SETTINGS[task] for task in args.tasks},
        "processes": 2,
        "backend": "gloo",
        "torch_threads_per_process": 1,
        "charlm": {"context_bytes": CONTEXT, "text": standard_library_text()[1] if "charlm" in args.tasks else None},
        "flat_algorithms": sorted(FLAT & set(args.methods)),
        "qadam_warmup_steps": {task: max(1, s // 5) for task, s in steps.items()},
    }
    report = {
        "benchmark": "convergence of every algorithm against Lightning DDP, two Gloo processes on CPU",
        "command": "python benchmarks/convergence.py" + "".join(f" {a}" for a in args.argv),
        "settings": settings,
        "machine": machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_wall_s": time.perf_counter() - started,
        "summary": summarise(runs),
        "runs": runs,
        "failures": failures,
    }
    table = markdown(report)
    if args.no_save:
        print(table)
        return report
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "convergence_cpu.md").write_text(table)
    chart(report, out / "convergence_cpu.png")
    print(table)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. n-1 (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="each task's short run and one seed")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every task (default: per task)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default: benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write nothing")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="digits", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    if args.quick and "--seeds" not in arguments:
        args.seeds = 1
    if args.steps is None and args.job:
        parser.error("--job needs --steps")
    args.argv = arguments
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.job:
        job(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    orchestrate(args)


if __name__ == "__main__":
    main()
