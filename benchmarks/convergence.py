"""Convergence: every Bagua algorithm against Lightning's DDP, same hyper-parameters, same seeds, two CPU processes.

Each run is a fresh Lightning job of two Gloo processes (deterministic, one torch thread each); within a task every
method trains the same model from the same weights on the same data with the same optimizer settings
(:mod:`lab.tasks`), so only the communication differs, and the held-out metrics are averaged over the ranks. By
name it also runs DDP with torch's hooks (``ddp_fp16``, ``ddp_powersgd_r<k>``, registered on CPU by
:class:`CPUCommHookDDPStrategy`), ``low_rank_r<k>``, ``auto``, ``diloco_h<H>`` and ``torchft_diloco_h<H>``. On one
node ``hierarchical`` would only average inside the node, so the algorithms run flat. ``--eval-every k`` keeps
every run's learning curve. ``--timed`` gives the time to DDP's loss: the steps to it, from the learning curves (the
target is the DDP baseline's held-out loss at ``--target-at`` of its run, two thirds by default; DDP with Adam for
``qadam``), x the step time of ``network_lab.py`` on the same networks at the same global batch on layouts 2x1 and
2x2 (``:flat`` and ``:hierarchical`` in 2x2). A run's first steps count as timed, the rest at the median step. The
overhead of a method is its step less the no-communication step (``single``), for ``low_rank_r<k>`` also against
``ddp_powersgd_r<k>``'s. Run the lab as root, on a quiet machine::

    python benchmarks/convergence.py                  # both tasks, every method, 3 seeds (about 20 min, 2 cores)
    python benchmarks/convergence.py --quick          # fewer steps, one seed: a look in a few minutes
    python benchmarks/convergence.py --timed          # every task, method, rate and layout (40-45 min, 2 cores)
    python benchmarks/convergence.py --timed --quick  # short runs, one seed, 100mbit only, 3 rounds (about 10 min)
    python benchmarks/convergence.py --timed --no-lab # the learning curves only (no root needed)
    python benchmarks/convergence.py --render benchmarks/results/time_to_accuracy_cpu.json   # rescore, tables

It writes ``benchmarks/results/convergence_cpu.{json,md,png}``; with ``--timed``, ``time_to_accuracy_cpu.*``.
"""

import argparse
import functools
import json
import logging
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import bits_per_second, can_shape_links, headline
from lab.jobs import job_env
from lab.methods import TORCHFT_NOTE, diloco_keywords, engine_algorithm, layout_variants, split_rank, torchft_settings
from lab.models import CONTEXT, task_loss, task_model
from lab.render import markdown_table, pyplot, ratio
from lab.results import machine, spread, write_report
from lab.tasks import (
    ADAM_METHODS,
    ALL_TASKS,
    METHODS,
    SETTINGS,
    TASKS,
    accepted_methods,
    available_methods,
    baseline_of,
    compression_warmup,
    is_accepted,
    is_hook_method,
    low_rank_available,
    standard_library_text,
    task_data,
)

log = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
HOOK_TIMEOUT_S = 180  # the collective timeout of the hook methods' process group
# Run with hierarchical=False: on one node the hierarchical form only averages inside the node at full precision.
# diloco too: hierarchical on one node would all-reduce gradients every step, training one replica.
FLAT = {"bytegrad", "qadam", "decentralized", "low_precision_decentralized", "diloco"}

TIMED_STEM = "time_to_accuracy_cpu"
LAYOUTS = ("2x1", "2x2")
RATES = ("100mbit", "1gbit", "unshaped")
# Held-out evaluations every k steps in the full timed run; the quick run, a fifth as long, evaluates twice as often.
EVAL_EVERY = {"digits": 10, "charlm": 20, "bytemlp": 20}
# The longest healthy lab collective takes a few seconds; torch's PowerSGD hook can hang on Gloo with several
# buckets instead of aborting, and this bounds the time such a failure costs.
LAB_COLLECTIVE_TIMEOUT_S = 120
# The target is DDP's held-out loss two thirds into its run, as in the GPU lab (its step 200 of 300): late enough
# that every method has left the steep start, early enough that DDP is still improving.
TARGET_AT = 2 / 3
# What --timed leaves open, full and quick.
FULL: dict[str, Any] = {"rounds": 5, "lab_steps": 3, "lab_warmup": 3, "rates": RATES}
QUICK: dict[str, Any] = {"rounds": 3, "lab_steps": 2, "lab_warmup": 3, "rates": ("100mbit",)}


# ------------------------------------------------------------------------------------------------ one job


def bagua_algorithm(method: str, steps: int) -> tuple[str, dict[str, Any]]:
    """The engine algorithm name and keywords of a Bagua method, as the convergence runs set them."""
    from lightning_bagua.engine.algorithms.base import algorithm_class

    name, keywords = engine_algorithm(method, compression_warmup(steps))
    if name in FLAT or ("rank" in keywords and "hierarchical" in algorithm_class(name).keywords()):
        keywords["hierarchical"] = False
    return name, keywords


def make_optimizer(method: str, parameters: Any, settings: dict[str, Any], steps: int) -> torch.optim.Optimizer:
    """Return the optimizer every method of a family shares: SGD with momentum, Adam, or QAdam for ``qadam``."""
    if method == "qadam":
        from lightning_bagua import QAdamOptimizer

        return QAdamOptimizer(parameters, lr=settings["adam_lr"], warmup_steps=max(1, steps // 5))
    if method in ADAM_METHODS:
        return torch.optim.Adam(parameters, lr=settings["adam_lr"])
    return torch.optim.SGD(parameters, lr=settings["sgd_lr"], momentum=settings["momentum"])


def build_task(task: str, method: str, settings: dict[str, Any], steps: int) -> tuple[Any, Dataset, Dataset]:
    """Return the LightningModule, the training set and the held-out set of ``task`` for ``method``.

    Every module scores the held-out set in ``test_step`` (after training) and in ``validation_step`` (the
    learning curve of ``--eval-every``), with the same metrics: ``*_acc`` and ``*_loss`` averaged over the ranks.
    """

    class Scored(LightningModule):
        def __init__(self, network: nn.Module) -> None:
            super().__init__()
            self.network = network

        def forward(self, x: Tensor) -> Tensor:
            return self.network(x)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            return task_loss(self(x), y)

        def score(self, batch: tuple[Tensor, Tensor], prefix: str) -> None:
            x, y = batch
            logits = self(x).flatten(0, -2)
            count = y.numel()
            self.log(f"{prefix}_loss", F.cross_entropy(logits, y.flatten()), sync_dist=True, batch_size=count)
            accuracy = (logits.argmax(dim=1) == y.flatten()).float().mean()
            self.log(f"{prefix}_acc", accuracy, sync_dist=True, batch_size=count)

        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.score(batch, "val")

        def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.score(batch, "test")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(method, self.parameters(), settings, steps)

    train_set, held_out = task_data(task)
    return Scored(task_model(task)), train_set, held_out


class CPUCommHookDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with a communication hook that also runs on CPU, counting its calls.

    ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only on CUDA devices and trains plain DDP on CPU without a
    word; this one registers it itself on other devices, and counts its calls and elements so a run proves it ran.
    """

    def __init__(self, ddp_comm_state: Any, ddp_comm_hook: Callable[..., Any], **kwargs: Any) -> None:
        self.hook_calls = {"calls": 0, "elements": 0}
        counted = _counted(ddp_comm_hook, self.hook_calls)
        super().__init__(ddp_comm_state=ddp_comm_state, ddp_comm_hook=counted, **kwargs)
        self.comm_state = ddp_comm_state
        self.comm_hook = counted

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.root_device.type != "cuda":
            assert isinstance(self.model, DistributedDataParallel)
            self.model.register_comm_hook(self.comm_state, self.comm_hook)


def _counted(hook: Callable[..., Any], counter: dict[str, int]) -> Callable[..., Any]:
    # functools.wraps keeps the hook's name and signature, which DDP checks and logs.
    @functools.wraps(hook)
    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        counter["calls"] += 1
        counter["elements"] += bucket.buffer().numel()
        return hook(state, bucket)

    return counted


def hook_strategy(method: str, steps: int) -> CPUCommHookDDPStrategy:
    """DDP with torch's ``fp16_compress_hook`` or PowerSGD hook (``ddp_powersgd_r<k>``), as a Lightning user sets it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    # A failed collective of torch's PowerSGD hook on Gloo may hang rather than abort: it ends within minutes.
    timeout = timedelta(seconds=HOOK_TIMEOUT_S)
    if method == "ddp_fp16":
        return CPUCommHookDDPStrategy(None, default_hooks.fp16_compress_hook, timeout=timeout)
    _, rank = split_rank(method)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=compression_warmup(steps)
    )
    return CPUCommHookDDPStrategy(state, powerSGD_hook.powerSGD_hook, timeout=timeout)


class CurveRecorder(Callback):
    """Keeps the held-out metrics of every validation run, with the training step they were taken at."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = trainer.callback_metrics
        self.points.append(
            {"step": trainer.global_step, "acc": float(metrics["val_acc"]), "loss": float(metrics["val_loss"])}
        )


def job(args: argparse.Namespace) -> None:
    """Train and test one (task, method, seed) on two processes; rank 0 writes the metrics to ``--result-file``.

    With ``--eval-every k`` the held-out set is also scored every k steps, and the curve is part of the result.
    """
    from lightning.pytorch import seed_everything

    from lightning_bagua import BaguaStrategy

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*recommended to use `Trainer\\(devices=1.*")
    settings = SETTINGS[args.task]
    seed_everything(args.seed, workers=True)
    module, train_set, test_set = build_task(args.task, args.method, settings, args.steps)
    callbacks: list[Any] = []
    peer_settings = torchft_settings(args.method)
    if peer_settings is not None:  # torchft's DiLoCo: DDP whose all-reduce the peer's callback switches off
        from lab import torchft_peer

        torchft_peer.require_torchft()  # before any process starts
        strategy: Any = "ddp"
        callbacks.append(torchft_peer.lightning_callback(**peer_settings))
    elif args.method in {"ddp", "ddp_adam"}:
        strategy = "ddp"
    elif is_hook_method(args.method):
        strategy = hook_strategy(args.method, args.steps)
    else:
        algorithm, keywords = bagua_algorithm(args.method, args.steps)
        strategy = BaguaStrategy(algorithm=algorithm, **keywords)
    curve = CurveRecorder()
    evaluate = {"val_check_interval": args.eval_every, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0}
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
        callbacks=[curve, *callbacks],
        **(evaluate if args.eval_every else {"limit_val_batches": 0}),
    )
    train_loader = DataLoader(train_set, batch_size=settings["batch"], shuffle=True)
    held_out = DataLoader(test_set, batch_size=64)
    start = time.perf_counter()
    trainer.fit(module, train_loader, held_out if args.eval_every else None)
    train_s = time.perf_counter() - start
    (metrics,) = trainer.test(module, held_out, verbose=False)
    if trainer.is_global_zero:
        result: dict[str, Any] = {
            "test_loss": float(metrics["test_loss"]),
            "test_acc": float(metrics["test_acc"]),
            "train_s": train_s,
            "steps": trainer.global_step,
        }
        if args.eval_every:
            points = [p for p in curve.points if p["step"] < trainer.global_step]
            # The last point is the final test: the same held-out set, scored once after the last step.
            final = {"step": trainer.global_step, "acc": result["test_acc"], "loss": result["test_loss"]}
            result["curve"] = [*points, final]
        if peer_settings is not None:
            (peer,) = (callback.peer for callback in callbacks)
            sent = peer.communication_counter.bytes_sent
            result["torchft"] = {**peer_settings, "syncs": peer.syncs, "bytes_sent": sent}
            result["note"] = TORCHFT_NOTE
        decision = getattr(trainer.strategy, "auto_decision", None)
        if decision is not None:  # auto: its pick and the figures behind it; its measuring steps are in the curve
            result["auto"] = decision.to_dict()
        if isinstance(strategy, CPUCommHookDDPStrategy):
            result["hook"] = {"name": strategy.comm_hook.__name__, **strategy.hook_calls}
            if strategy.comm_state is not None:
                result["hook"]["powersgd_iter"] = strategy.comm_state.iter
                result["hook"]["powersgd_start_iter"] = strategy.comm_state.start_powerSGD_iter
        Path(args.result_file).write_text(json.dumps(result))
    # Lightning leaves the default group alive; left to interpreter shutdown, Gloo's threads can abort a `ddp` job.
    # The engine's destroy, as torch's own can deadlock freeing the group on torch 2.2 to 2.7.
    if torch.distributed.is_initialized():
        from lightning_bagua.engine._torch_compat import destroy_process_group

        destroy_process_group(dist.GroupMember.WORLD)


def run_job(task: str, method: str, seed: int, steps: int, timeout: int, eval_every: int = 0) -> dict[str, Any]:
    """Start one job (Lightning starts its second process) and return its metrics, with its wall time.

    A DDP hook method whose hook never ran (no calls, or PowerSGD never past its uncompressed start) fails here.
    """
    env = job_env([ROOT / "src"])  # without a surrounding launcher's variables: the job would join its job
    with tempfile.TemporaryDirectory() as directory:
        result_file = Path(directory) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--job", "--task", task, "--method", method]
        command += ["--seed", str(seed), "--steps", str(steps), "--result-file", str(result_file)]
        command += ["--eval-every", str(eval_every)]
        start = time.perf_counter()
        completed = subprocess.run(
            command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        wall_s = time.perf_counter() - start
        if completed.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"{task}/{method}/seed {seed} failed:\n{(completed.stdout + completed.stderr)[-4000:]}")
        result = json.loads(result_file.read_text())
    hook = result.get("hook")
    if is_hook_method(method) and (hook is None or hook["calls"] == 0):
        raise RuntimeError(f"{task}/{method}/seed {seed}: the DDP communication hook never ran ({hook})")
    if hook is not None and "powersgd_iter" in hook and hook["powersgd_iter"] <= hook["powersgd_start_iter"]:
        raise RuntimeError(f"{task}/{method}/seed {seed}: PowerSGD never left its uncompressed start ({hook})")
    return {"task": task, "method": method, "seed": seed, **result, "wall_s": wall_s}


# ------------------------------------------------------------------------------------------------ the report


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and method: accuracy and loss over the seeds, and the accuracy difference to the baseline's mean."""
    summary = []
    for task in dict.fromkeys(r["task"] for r in runs):
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
            baseline = baseline_of(method)
            row: dict[str, Any] = {"task": task, "method": method, "baseline": baseline, **stats[method]}
            if baseline in stats:
                base = stats[baseline]
                row["accuracy_delta_pts"] = row["accuracy_pct"]["mean"] - base["accuracy_pct"]["mean"]
                row["loss_delta"] = row["loss"]["mean"] - base["loss"]["mean"]
            if task == "charlm":
                row["perplexity_of_mean_loss"] = math.exp(row["loss"]["mean"])
            summary.append(row)
    return summary


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The summary as a table, a row per task and method; the documentation's ``convergence`` table is this one."""
    rows = []
    for row in report["summary"]:
        acc, loss = row["accuracy_pct"], row["loss"]
        delta = f"{row['accuracy_delta_pts']:+.2f}" if "accuracy_delta_pts" in row else "-"
        loss_delta = f"{row['loss_delta']:+.4f}" if "loss_delta" in row else "-"
        accuracy = f"{acc['mean']:.2f} ± {acc['std']:.2f} [{acc['min']:.2f}, {acc['max']:.2f}]"
        loss_text = f"{loss['mean']:.4f} ± {loss['std']:.4f}"
        rows.append(
            [row["task"], row["method"], row["baseline"], accuracy, delta, loss_text, loss_delta, str(acc["n"])]
        )
    header = ["task", "method", "baseline", "accuracy %", "Δ accuracy (points)", "loss", "Δ loss", "seeds"]
    return header, rows


def markdown(report: dict[str, Any]) -> str:
    """Return the tables of a report with the command that wrote it: the summary, or a ``--timed`` run's times."""
    if "curves" in report:
        return timed_markdown(report)
    lines = [
        "Held-out accuracy and loss after training, mean ± standard deviation [min, max] over the seeds; Δ is the",
        "difference of the means to the method's DDP baseline (qadam: DDP with Adam). Two Gloo processes on CPU.",
        f"Written by `{report['command']}`; every run is in `convergence_cpu.json`.",
        "",
        markdown_table(*table(report)),
    ]
    if any(row["task"] == "charlm" for row in report["summary"]):
        lines += ["charlm loss is in nats per byte; its perplexity is exp(loss).\n"]
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> bool:
    """Draw a report's chart to ``path``: accuracy per method, or a ``--timed`` report's curves and times.

    Args:
        report: a convergence or a ``--timed`` report.
        path: the PNG to write.

    Returns:
        Whether it was drawn (not without matplotlib).
    """
    plt = pyplot()
    if plt is None:
        return False
    figure = (timed_figure if "curves" in report else accuracy_figure)(report, plt)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def accuracy_figure(report: dict[str, Any], plt: Any) -> Any:
    """Accuracy per method and task, mean with min-max whiskers, and the baseline's mean as a line."""
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
    return figure


# ------------------------------------------------------------------------------------------------ time to target


def lab_methods(methods: list[str], ranks_per_host: int) -> list[str]:
    """The lab's names for ``methods``: ``single`` first; with several ranks per host, hierarchical variants."""
    return ["single", *(variant for method in methods for variant in layout_variants(method, ranks_per_host))]


def curve_of(lab_method: str) -> str:
    """The convergence method whose learning curve a lab method uses (``bytegrad:hierarchical`` -> ``bytegrad``)."""
    return lab_method.partition(":")[0]


def mean_curve(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Accuracy (percent) and loss at every evaluated step, averaged over the runs (seeds) that have that step."""
    by_step: dict[int, list[dict[str, float]]] = {}
    for run in runs:
        for point in run["curve"]:
            by_step.setdefault(int(point["step"]), []).append(point)
    return [{"step": step, "acc_pct": 100 * statistics.fmean(p["acc"] for p in points),
             "loss": statistics.fmean(p["loss"] for p in points), "seeds": len(points)}
            for step, points in sorted(by_step.items())]  # fmt: skip


def first_reaching(curve: list[dict[str, float]], target_loss: float) -> float | None:
    """The step at which the held-out loss first reaches ``target_loss``, linear between evaluations; ``None`` if never.

    Interpolated, so that a method a hair behind DDP at one evaluation does not count a whole evaluation interval
    more: the held-out loss moves smoothly, where the accuracy of a few hundred held-out samples moves in steps.
    """
    previous = None
    for point in curve:
        if point["loss"] <= target_loss:
            if previous is None:
                return float(point["step"])
            share = (previous["loss"] - target_loss) / (previous["loss"] - point["loss"])
            return float(previous["step"] + share * (point["step"] - previous["step"]))
        previous = point
    return None


def target_loss(curve: list[dict[str, float]], target_at: float) -> float:
    """The baseline's held-out loss at the evaluation nearest ``target_at`` of its run: what every method must reach."""
    last = curve[-1]["step"]
    return min(curve, key=lambda point: (abs(point["step"] - target_at * last), point["step"]))["loss"]


def steps_to_target(runs: list[dict[str, Any]], target_at: float) -> dict[str, dict[str, Any]]:
    """Per (task, method): the target loss, the mean curve, steps to it (mean curve and per seed), final accuracy."""
    found: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(r["task"] for r in runs):
        of_task = [r for r in runs if r["task"] == task]
        for method in dict.fromkeys(r["method"] for r in of_task):
            chosen = [r for r in of_task if r["method"] == method]
            baseline = baseline_of(method)
            of_baseline = [r for r in of_task if r["method"] == baseline]
            target = target_loss(mean_curve(of_baseline), target_at) if of_baseline else None
            curve = mean_curve(chosen)
            found[f"{task}/{method}"] = {
                "task": task,
                "method": method,
                "baseline": baseline,
                "final_acc_pct": statistics.fmean(100 * r["test_acc"] for r in chosen),
                "final_loss": statistics.fmean(r["test_loss"] for r in chosen),
                "seeds": [r["seed"] for r in chosen],
                "curve": curve,
                "target_loss": target,
                "steps_to_target": None if target is None else first_reaching(curve, target),
                "steps_to_target_per_seed": {
                    str(r["seed"]): first_reaching(mean_curve([r]), target) for r in chosen if target is not None
                },
            }
    return found


def run_lab(
    args: argparse.Namespace, run_steps: dict[str, int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Time every task's network with every method at every rate and layout; return rows, failures, commands.

    auto is told each task's run length (``run_steps``), as the Trainer tells it in the task's curve run.
    """
    rows, failures, commands = [], [], []
    for layout in args.layouts:
        hosts, ranks_per_host = (int(part) for part in layout.split("x"))
        world = hosts * ranks_per_host
        methods = lab_methods(args.methods, ranks_per_host)
        for task in args.tasks:
            # The two-process curves' global batch, split over this layout's ranks.
            batch = max(1, SETTINGS[task]["batch"] * 2 // world)
            argv = ["--task", task, "--batch", str(batch), "--hosts", str(hosts), "--ranks-per-host",
                    str(ranks_per_host), "--steps", str(args.lab_steps), "--warmup", str(args.lab_warmup),
                    "--rounds", str(args.rounds), "--timeout", str(LAB_COLLECTIVE_TIMEOUT_S), "--rates", *args.rates,
                    "--run-steps", str(run_steps[task]), "--methods", *methods]  # fmt: skip
            commands.append("python benchmarks/network_lab.py " + " ".join(argv))
            log.info(commands[-1])
            with tempfile.TemporaryDirectory() as out:
                script = str(Path(__file__).resolve().parent / "network_lab.py")
                subprocess.run([sys.executable, script, *argv, "--out", out], check=True)
                (path,) = Path(out).glob("*.json")
                report = json.loads(path.read_text())
            rows += [{"task": task, "layout": layout, "batch_per_rank": batch, **row} for row in report["results"]]
            failures += [{"task": task, "layout": layout, **failure} for failure in report["failures"]]
    return rows, failures, commands


def combine(
    curves: dict[str, dict[str, Any]],
    lab_rows: list[dict[str, Any]],
    lab_failures: list[dict[str, Any]],
    curve_failures: list[dict[str, Any]],
    settings: dict[str, Any],
) -> list[dict[str, Any]]:
    """One row per (task, layout, rate, method) of ``settings``: steps to target, step time and spread, overhead."""
    by_key = {(r["task"], r["layout"], r["rate"], r["method"]): r for r in lab_rows}
    lab_failed = {(f["task"], f["layout"], f["rate"], f["method"]): f["error"] for f in lab_failures}
    curve_failed = {(f["task"], f["method"]): f["error"] for f in curve_failures}
    combined = []
    for task in settings["tasks"]:
        for layout in settings["layouts"]:
            ranks_per_host = int(layout.split("x")[1])
            for rate in settings["rates"] if settings["lab"] else [None]:
                single = by_key.get((task, layout, rate, "single"))
                for method in lab_methods(settings["methods"], ranks_per_host)[1:]:
                    curve = curves.get(f"{task}/{curve_of(method)}")
                    lab = by_key.get((task, layout, rate, method))
                    row: dict[str, Any] = {"task": task, "layout": layout, "rate": rate, "method": method}
                    row["curve_method"] = curve_of(method)
                    if curve is None:
                        error = curve_failed.get((task, curve_of(method)), "no learning curve")
                        row |= {"status": "failed (training)", "error": error[-500:], "steps_to_target": None}
                    else:
                        reached = curve["steps_to_target"] is not None
                        row |= {
                            "status": "reached" if reached else "not reached",
                            "steps_to_target": curve["steps_to_target"],
                            "target_loss": curve["target_loss"],
                            "final_acc_pct": curve["final_acc_pct"],
                        }
                    if lab is not None:
                        row |= {k: lab[k] for k in ("median_step_s", "min_step_s", "max_step_s", "q1_step_s",
                                                     "q3_step_s", "bytes_per_step")}  # fmt: skip
                        if lab.get("auto_picks"):
                            row |= auto_cell(lab, curves, task)
                        if row["steps_to_target"] is not None:
                            row["time_to_target_s"] = time_to_target(lab, row["steps_to_target"])
                        if single is not None:
                            row["overhead_s"] = lab["median_step_s"] - single["median_step_s"]
                    elif rate is not None:
                        error = lab_failed.get((task, layout, rate, method), "not measured")
                        row["lab_error"] = error[-500:]
                        if row["status"] == "reached":
                            row["status"] = "failed (step time)"
                    combined.append(row)
            # Overhead against DDP's PowerSGD hook at the same rank, rate and layout.
            of_layout = [r for r in combined if r["task"] == task and r["layout"] == layout]
            for row in of_layout:
                _, rank = split_rank(row["curve_method"])
                name = f"ddp_powersgd_r{rank}"
                reference = next((r for r in of_layout if r["rate"] == row["rate"] and r["method"] == name), None)
                if rank is not None and reference is not None and "overhead_s" in row and "overhead_s" in reference:
                    row["powersgd_reference"] = reference["method"]
                    base = reference["overhead_s"]
                    row["overhead_vs_powersgd"] = row["overhead_s"] / base if base > 0 else None
    return combined


def time_to_target(lab: dict[str, Any], steps: float) -> float:
    """Seconds a run of ``steps`` steps takes: its first steps as they were timed, the rest at the median step.

    Every method alike: the first steps (``--lab-warmup`` of them, and for auto its measuring steps and its pick's
    warm-up) cost what they cost in the lab's run, which for any method is more than its steady step. The median over
    the rounds; a results file without first steps (older runs) counts every step at the median.
    """
    median = lab["median_step_s"]
    rounds = lab.get("start_steps_s") or [[]]
    timed = [min(len(first), int(steps)) for first in rounds]
    costs = [sum(first[:n]) + (steps - n) * median for first, n in zip(rounds, timed, strict=True)]
    return float(statistics.median(costs))


def round_times_to_target(lab: dict[str, Any], steps: float) -> list[float]:
    """Each round's seconds for ``steps`` steps: its first steps as timed, the rest at that round's median step.

    Empty where the lab row holds no rounds (older results files).
    """
    rounds, medians = lab.get("start_steps_s") or [], lab.get("rounds_step_s") or []
    return [
        sum(first[: min(len(first), int(steps))]) + (steps - min(len(first), int(steps))) * median
        for first, median in zip(rounds, medians, strict=False)
    ]


def auto_curve_method(label: str) -> str:
    """The convergence method running what auto picked: ``low_rank(rank=16, hierarchical=False)``: ``low_rank_r16``."""
    name = label.partition("(")[0]
    rank = re.search(r"rank=(\d+)", label)
    return f"{name}_r{rank.group(1)}" if rank else name


def auto_cell(lab: dict[str, Any], curves: dict[str, dict[str, Any]], task: str) -> dict[str, Any]:
    """auto's pick in a lab cell (the rounds' most frequent), its measuring cost, and the curve of the pick.

    The steps to target are the picked method's own curve where it was run, else auto's own run's (which measured
    and picked on the unshaped two-process host): the cell's pick is what runs on the cell's link.
    """
    pick = statistics.mode(lab["auto_picks"])
    cell: dict[str, Any] = {
        "auto_pick": pick,
        "auto_picks": lab["auto_picks"],
        "auto_trial_steps": statistics.median(lab["auto_trial_steps"]),
        "auto_trial_s": statistics.median(lab["auto_trial_s"]),
        "auto_decision": lab["auto_decisions"][lab["auto_picks"].index(pick)],
    }
    picked = curves.get(f"{task}/{auto_curve_method(pick)}")
    if picked is not None:
        cell |= {
            "curve_method": auto_curve_method(pick),
            "status": "reached" if picked["steps_to_target"] is not None else "not reached",
            "steps_to_target": picked["steps_to_target"],
            "final_acc_pct": picked["final_acc_pct"],
        }
    return cell


def _time_cell(row: dict[str, Any]) -> str:
    step = ""
    if "median_step_s" in row:
        step = f"{row['median_step_s'] * 1e3:.1f} ms [{row['min_step_s'] * 1e3:.1f}, {row['max_step_s'] * 1e3:.1f}]"
    if "time_to_target_s" in row:
        return f"{row['time_to_target_s']:.3g} s ({step})"
    # Not reached, or failed: the step time is still shown where it was measured.
    return f"{row['status']} ({step})" if step else row["status"]


def _overhead_cell(row: dict[str, Any]) -> str:
    if "overhead_s" not in row:
        return "-"
    cell = f"{row['overhead_s'] * 1e3:.1f} ms"
    if row.get("overhead_vs_powersgd") is not None:
        cell += f" ({row['overhead_vs_powersgd']:.2f}x {row['powersgd_reference']})"
    return cell


def timed_markdown(report: dict[str, Any]) -> str:
    """The tables: per task and layout, time to target per rate, then the communication overhead per rate."""
    settings = report["settings"]
    evaluations = ", ".join(f"{task} {every}" for task, every in settings["eval_every"].items())
    if any("start_steps_s" in row for row in report["lab"]):
        rule = "its first steps as the lab timed them (auto's measuring steps too) plus the rest x median step time"
        first_steps = " Every method's first steps (warm-up, auto's trials) count at the time they took."
    else:  # a run older than the lab's record of first steps
        rule = "steps to target x median step time"
        first_steps = " Warm-up steps are counted at the compressed step's time."
    lines = [
        f"Time to target = {rule}. Target: the baseline's held-out loss (DDP with SGD; DDP with Adam for qadam),"
        f" mean over {settings['seeds']} seed(s), at the evaluation nearest {settings['target_at']:.2f} of its run."
        f" Steps: where the method's held-out loss, averaged over the seeds, first reaches it, linear between"
        f" evaluations (every {evaluations} steps), on two Gloo processes. Step time: the"
        f" CPU network lab, methods interleaved over {settings['rounds']} rounds, median [min, max] of the rounds."
        " Overhead: step time less the no-communication step (`single`) of the same rounds; for low_rank also as a"
        f" ratio to DDP + PowerSGD at the same rank.{first_steps}",
        f"Written by `{report['command']}`; every curve and measurement is in `{TIMED_STEM}.json`.",
    ]
    rows = report["combined"]
    for task in settings["tasks"]:
        scored = [r for r in rows if r["task"] == task and r.get("target_loss") is not None]
        targets = sorted({(baseline_of(r["curve_method"]), r["target_loss"]) for r in scored})
        target_text = ", ".join(f"{base}'s loss {loss:.4g}" for base, loss in targets)
        for layout in settings["layouts"]:
            chosen = [r for r in rows if r["task"] == task and r["layout"] == layout]
            rates = list(dict.fromkeys(r["rate"] for r in chosen))
            methods = list(dict.fromkeys(r["method"] for r in chosen))
            by_key = {(r["rate"], r["method"]): r for r in chosen}
            lines += ["", f"### {task}, {layout} (hosts x ranks per host); target {target_text or '-'}", ""]
            times = []
            for method in methods:
                first = by_key[(rates[0], method)]
                final = f"{first['final_acc_pct']:.2f}" if "final_acc_pct" in first else "-"
                reached = first["steps_to_target"]
                steps = f"{reached:.0f}" if reached is not None else first["status"]
                times.append([method, final, steps, *(_time_cell(by_key[(rate, method)]) for rate in rates)])
            lines += [
                markdown_table(["method", "final accuracy %", "steps to target", *map(str, rates)], times).rstrip()
            ]
            if rates and rates[0] is not None:
                overheads = [
                    [method, *(_overhead_cell(by_key[(rate, method)]) for rate in rates)] for method in methods
                ]
                lines += ["", f"Communication overhead per step, {task}, {layout}:", ""]
                lines.append(markdown_table(["method", *map(str, rates)], overheads).rstrip())
    lines += bars_markdown(report)
    failures = report["curve_failures"] + report["lab_failures"]
    if failures:
        lines += ["", "Failures (shown in the tables, not left out):", ""]
        for failure in failures:
            where = "/".join(str(failure[k]) for k in ("task", "layout", "rate", "method", "seed") if k in failure)
            lines.append(f"- {where}: {headline(failure['error'])}")
    return "\n".join(lines) + "\n"


# Not among the fixed methods auto is judged against: itself, the local-SGD methods, and async, whose replicas
# average in the background (auto leaves out by design every method whose weights are not DDP's).
_NOT_FIXED = ("auto", "diloco_", "torchft_", "async")


def _final_loss(report: dict[str, Any], task: str, method: str) -> float | None:
    curve = report["curves"].get(f"{task}/{curve_of(method)}")
    return curve["curve"][-1]["loss"] if curve and curve.get("curve") else None


def _fastest(rows: list[dict[str, Any]], keep: Any) -> dict[str, Any] | None:
    """The row of ``rows`` that ``keep`` accepts with the shortest time to target, if any reached it."""
    return min((r for r in rows if keep(r["method"]) and "time_to_target_s" in r), key=lambda r: r["time_to_target_s"],
               default=None)  # fmt: skip


def _schedule(method: str) -> dict[str, Any]:
    """A diloco or torchft lab method's keywords less the precision it sends in: its H, fragments, delay, outer step."""
    keywords = diloco_keywords(method.split(":")[0].removeprefix("torchft_")) or {}
    return {name: value for name, value in keywords.items() if name != "quantization"}


def _same_schedule_peer(method: str) -> Any:
    """A test of lab method names: torchft's DiLoCo at ``method``'s schedule (``diloco_h20_f2_d5:flat``:
    ``torchft_diloco_h20_f2_d5``), whatever precision ``method`` sends in."""
    schedule = _schedule(method)
    return lambda other: other.startswith("torchft_") and _schedule(other) == schedule


def _fixed_names(pick: str) -> set[str]:
    """The lab's names of the fixed method auto's pick is: ``bytegrad(hierarchical=True)``: ``bytegrad:hierarchical``
    (two ranks per host) or ``bytegrad`` (one); ``gradient_allreduce``: ``gradient_allreduce[:flat]``."""
    name = auto_curve_method(pick)
    return {name, f"{name}:{'hierarchical' if 'hierarchical=True' in pick else 'flat'}"}


def bars_markdown(report: dict[str, Any]) -> list[str]:
    """The checks of auto and diloco against the methods a user would pick instead, per task, layout and rate.

    auto: its time to target (measuring included) over the best fixed method's and over DDP's, and its measuring
    cost beyond the pick's own steps as a share of the task's run (the length it is told). diloco: its time over
    the fastest ``low_rank``'s, DDP's, and torchft's DiLoCo's at the same schedule; its step (averaged over whole
    sync periods) over the no-communication step; its final held-out loss over DDP's.
    """
    rows = report["combined"]
    singles = {
        (r["task"], r["layout"], r["rate"]): r["median_step_s"] for r in report["lab"] if r["method"] == "single"
    }
    labs = {(r["task"], r["layout"], r["rate"], r["method"]): r for r in report["lab"]}
    auto_rows, diloco_rows = [], []
    auto_cells: list[dict[str, Any]] = []
    for row in rows:
        if "median_step_s" not in row or not row["method"].startswith(("auto", "diloco_")):
            continue
        where = (row["task"], row["layout"], row["rate"])
        cell = [r for r in rows if (r["task"], r["layout"], r["rate"]) == where]
        time_s = row.get("time_to_target_s")
        ddp = _fastest(cell, lambda method: method == "ddp")
        ddp_s = ddp["time_to_target_s"] if ddp else None
        shown = f"{time_s:.3g} s" if time_s is not None else row["status"]
        if row["method"] == "auto":
            best = _fastest(cell, lambda method: not method.startswith(_NOT_FIXED))
            extra = row["auto_trial_s"] - row["auto_trial_steps"] * row["median_step_s"]
            share = extra / (report["settings"]["steps"][row["task"]] * row["median_step_s"])
            best_text = f"{best['method']} {best['time_to_target_s']:.3g} s" if best else "-"
            # The pick run as a fixed method in the same cell: what auto costs beyond knowing the answer.
            pick_names = _fixed_names(row["auto_pick"])
            pick = _fastest(cell, pick_names.__contains__)
            auto_rows.append(
                f"| {' | '.join(map(str, where))} | {row['auto_pick']} | {row['auto_trial_steps']:g} steps,"
                f" {row['auto_trial_s']:.2g} s | {shown} | {best_text} |"
                f" {ratio(time_s, best and best['time_to_target_s'])} | {ratio(time_s, ddp_s)} |"
                f" {ratio(time_s, pick and pick['time_to_target_s'])} | {share:.1%} |"
            )
            if time_s is not None and best and ddp_s and pick:
                # The fastest method's own time over the rounds: how far from its median noise alone reaches.
                best_rounds = round_times_to_target(labs.get((*where, best["method"]), {}), best["steps_to_target"])
                auto_cells.append({
                    "where": where, "vs_best": time_s / best["time_to_target_s"], "vs_ddp": time_s / ddp_s,
                    "vs_pick": time_s / pick["time_to_target_s"], "share": share, "best": best["method"],
                    "pick_is_best": best["method"] in pick_names,
                    "best_rounds_max": max(best_rounds) / best["time_to_target_s"] if best_rounds else None,
                })  # fmt: skip
        else:
            low_rank = _fastest(cell, lambda method: method.startswith("low_rank_"))
            torchft = _fastest(cell, _same_schedule_peer(row["method"]))
            low_rank_text = ratio(time_s, low_rank and low_rank["time_to_target_s"])
            if low_rank:
                low_rank_text += f" ({low_rank['method']})"
            loss, ddp_loss = _final_loss(report, row["task"], row["method"]), _final_loss(report, row["task"], "ddp")
            ddp_acc = report["curves"].get(f"{row['task']}/ddp", {}).get("final_acc_pct")
            acc = f"{row['final_acc_pct'] - ddp_acc:+.2f}" if ddp_acc is not None and "final_acc_pct" in row else "-"
            # What its steps to target would take with free communication: no method that needs them can do better.
            single = singles.get(where)
            floor_s = single * row["steps_to_target"] if single and row.get("steps_to_target") else None
            floor = f"{ratio(floor_s, low_rank and low_rank['time_to_target_s'])}, {ratio(floor_s, ddp_s)}"
            diloco_rows.append(
                f"| {' | '.join(map(str, where))} | {row['method']} | {shown} | {low_rank_text} |"
                f" {ratio(time_s, ddp_s)} | {ratio(time_s, torchft and torchft['time_to_target_s'])} |"
                f" {ratio(row['median_step_s'], single)} | {floor} | {ratio(loss, ddp_loss)} | {acc} |"
            )
    lines: list[str] = []
    if auto_rows:
        lines += [
            "", "### auto against the fixed methods", "",
            "Time to target with its measuring steps counted; best fixed: the fastest other per-step method of the"
            " cell; vs pick: over the time of the picked algorithm run as a fixed method in the same cell, so that"
            " the rest is measuring and the two runs' spread; measuring share: its cost beyond the pick's own steps"
            " over the time of the task's run ("
            + ", ".join(f"{task} {steps} steps" for task, steps in report["settings"]["steps"].items())
            + "), the run length auto is told.",
            "",
            "| task | layout | rate | pick | measuring | time to target | best fixed | vs best | vs ddp | vs pick"
            " | share |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *auto_rows,
        ]  # fmt: skip
        if auto_cells:
            lines += ["", "<!-- auto-summary -->", _auto_summary(auto_cells, len(auto_rows)), "<!-- /auto-summary -->"]
    if diloco_rows:
        lines += [
            "", "### diloco against low_rank, DDP and torchft's DiLoCo", "",
            "Time to target over the fastest low_rank's (named), DDP's, and torchft's DiLoCo's at the same H,"
            " fragments and delay (full precision: the peer sends nothing else); step:"
            " the median step over whole sync periods over the no-communication step; loss: the final held-out loss"
            " over DDP's at the same steps; accuracy: the final held-out accuracy less DDP's, in points. Floor: the"
            " no-communication step times diloco's steps to target, over the fastest low_rank's and DDP's times:"
            " what those steps would take over a free link, so a ratio below it is out of reach of any method that"
            " needs as many steps.",
            "",
            "| task | layout | rate | method | time to target | vs low_rank | vs ddp | vs torchft | step vs single"
            " | floor vs low_rank, ddp | loss vs ddp | accuracy vs ddp |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *diloco_rows,
        ]  # fmt: skip
    return lines


def _auto_summary(cells: list[dict[str, Any]], rows: int) -> str:
    """The auto table in one paragraph, for the docs to include: how often auto was under DDP and near the fastest
    fixed method, whether it picked that method, and what its measuring cost."""
    from lightning_bagua.engine.algorithms.auto import AutoAlgorithm, describe_algorithm

    # The candidates auto considers by default, by the lab's names for them as fixed methods.
    considered = {auto_curve_method(describe_algorithm(c)) for c in AutoAlgorithm().candidates_for(1, 2)}
    fast = [cell for cell in cells if cell["where"][2] == "unshaped" or bits_per_second(cell["where"][2]) >= 10**8]
    worst = max(cells, key=lambda cell: cell["vs_best"])
    missed: dict[str, int] = {}
    for cell in cells:
        method = cell["best"].split(":")[0]
        if not cell["pick_is_best"] and method not in considered:
            missed[method] = missed.get(method, 0) + 1
    picked = sum(cell["pick_is_best"] for cell in cells)
    beyond = [cell for cell in cells if cell["vs_best"] > 1.10 and cell["best_rounds_max"] is not None]

    def spread_of(chosen: list[dict[str, Any]], key: str, form: str, unit: str = "") -> str:
        values = [cell[key] for cell in chosen]
        return f"{min(values):{form}}{unit} to {max(values):{form}}{unit}"

    def spread(key: str, form: str, unit: str = "") -> str:
        return spread_of(cells, key, form, unit)

    under = sum(cell["vs_ddp"] < 1 for cell in cells)
    text = (
        f"In this run auto reached the target in {len(cells)} of {rows} cells. Its time to the target, its measuring"
        f" counted, was under DDP's in {under} (from {spread('vs_ddp', '.2f', 'x')} of it); within 1.10x of the"
        f" fastest fixed method's in {sum(cell['vs_best'] <= 1.10 for cell in cells)}"
        f" ({sum(cell['vs_best'] <= 1.10 for cell in fast)} of the {len(fast)} at 100 Mbit/s and faster) and within"
        f" 1.25x in {sum(cell['vs_best'] <= 1.25 for cell in cells)}, at worst {worst['vs_best']:.2f}x"
        f" ({', '.join(worst['where'])})."
    )
    if beyond:
        inside = [cell for cell in beyond if cell["vs_best"] <= cell["best_rounds_max"]]
        text += (
            f" Of the {len(beyond)} beyond 1.10x, {len(inside)} lay within the fastest method's own slowest round"
            f" (which reached {spread_of(beyond, 'best_rounds_max', '.2f', 'x')} its median): there the gap is the"
            " size of the lab's round-to-round noise."
        )
    text += f" Its pick was the cell's fastest fixed method in {picked}"
    if missed:
        text += (
            ", and in "
            + " and ".join(
                f"{count} the fastest was {method}"
                for method, count in sorted(missed.items(), key=lambda item: -item[1])
            )
            + ", which auto does not consider"
        )
    return text + (
        f". Measuring cost {spread('share', '.1%')} of the run; beyond it, auto's time came to"
        f" {spread('vs_pick', '.2f', 'x')} its pick's run as a fixed method in the same cell."
    )


def timed_figure(report: dict[str, Any], plt: Any) -> Any:
    """Learning curves with the target (top row) and time to target per rate (one row per layout), per task."""
    settings = report["settings"]
    tasks, layouts = settings["tasks"], settings["layouts"] if settings["lab"] else []
    figure, axes = plt.subplots(1 + len(layouts), len(tasks), figsize=(6 * len(tasks), 4 * (1 + len(layouts))),
                                squeeze=False)  # fmt: skip
    colour_map = plt.get_cmap("tab20")
    for column, task in enumerate(tasks):
        axis = axes[0][column]
        for index, method in enumerate(settings["methods"]):
            entry = report["curves"].get(f"{task}/{method}")
            if entry is None:
                continue
            style = "--" if method.startswith("ddp") else "-"
            axis.plot([p["step"] for p in entry["curve"]], [p["loss"] for p in entry["curve"]], style,
                      color=colour_map(index % 20), label=method, linewidth=1.2)  # fmt: skip
        for baseline, style in (("ddp", ":"), ("ddp_adam", "-.")):
            entry = report["curves"].get(f"{task}/{baseline}")
            if entry is not None and entry["target_loss"] is not None:
                axis.axhline(entry["target_loss"], color="black", linestyle=style, linewidth=0.8,
                             label=f"target ({baseline})")  # fmt: skip
        axis.set_title(f"{task}: held-out loss, mean over seeds", fontsize=10)
        axis.set_xlabel("step")
        axis.set_ylabel("loss (log scale)")
        axis.set_yscale("log")
        if column == 0:
            axis.legend(fontsize=6, ncol=2)
        for row_index, layout in enumerate(layouts, start=1):
            axis = axes[row_index][column]
            chosen = [r for r in report["combined"] if r["task"] == task and r["layout"] == layout]
            rates = list(dict.fromkeys(r["rate"] for r in chosen))
            names = list(dict.fromkeys(r["method"] for r in chosen))
            width = 0.8 / max(1, len(rates))
            for rate_index, rate in enumerate(rates):
                xs = [i + rate_index * width for i in range(len(names))]
                by_method = {r["method"]: r for r in chosen if r["rate"] == rate}
                values = [by_method[m].get("time_to_target_s", 0.0) for m in names]
                axis.bar(xs, values, width, label=str(rate), color=colour_map((2 * rate_index) % 20))
                for x, method in zip(xs, names, strict=True):
                    if "time_to_target_s" not in by_method[method]:
                        # x in data, y in axes fraction: the mark sits at the bottom whatever the scale.
                        axis.text(x, 0.02, "x", ha="center", fontsize=8, color="red",
                                  transform=axis.get_xaxis_transform())  # fmt: skip
            axis.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=60, ha="right",
                            fontsize=6)  # fmt: skip
            if any("time_to_target_s" in r for r in chosen):
                axis.set_yscale("log")  # the rates differ by orders of magnitude
            axis.set_ylabel("time to target (s, log scale)")
            axis.set_title(f"{task}, {layout}: time to target (red x: not reached or failed)", fontsize=9)
            axis.legend(fontsize=7)
    figure.suptitle("Time to DDP's loss on CPU (benchmarks/convergence.py --timed)", fontsize=11)
    return figure


# ------------------------------------------------------------------------------------------------ the run


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    """Train every (task, seed, method), with ``--timed`` time them in the lab; write the report and return it."""
    if args.timed and args.lab and not can_shape_links():
        raise SystemExit("The lab needs root, iproute2 and tc; run as root, or pass --no-lab for the curves only.")
    started = time.perf_counter()
    steps = {task: SETTINGS[task]["quick_steps" if args.quick else "steps"] for task in args.tasks}
    if args.steps is not None:
        steps = dict.fromkeys(args.tasks, args.steps)
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for task in args.tasks:
        for seed in range(args.seeds):
            for method in args.methods:
                try:
                    run = run_job(task, method, seed, steps[task], args.timeout, args.every[task])
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    log.error("%s %s seed %d failed: %s", task, method, seed, error)
                    failures.append({"task": task, "method": method, "seed": seed, "error": str(error)[-2000:]})
                    continue
                runs.append(run)
                log.info("%s %-28s seed %d: accuracy %.2f %% loss %.4f (%.0f s)", task, method, seed,
                         100 * run["test_acc"], run["test_loss"], run["wall_s"])  # fmt: skip
    shared = {"per_task": {task: SETTINGS[task] for task in args.tasks},
              "compression_warmup_steps": {task: compression_warmup(s) for task, s in steps.items()},
              "qadam_warmup_steps": {task: max(1, s // 5) for task, s in steps.items()}}  # fmt: skip
    if args.timed:
        curves = steps_to_target(runs, args.target_at)
        lab_rows, lab_failures, lab_commands = run_lab(args, steps) if args.lab else ([], [], [])
        settings = {"tasks": args.tasks, "methods": args.methods, "low_rank_available": low_rank_available(),
                    "layouts": args.layouts, "rates": args.rates, "lab": args.lab, "seeds": args.seeds,
                    "quick": args.quick, "steps": steps, "eval_every": args.every, "target_at": args.target_at,
                    "rounds": args.rounds, "lab_steps": args.lab_steps, "lab_warmup": args.lab_warmup, **shared,
                    "curve_processes": 2, "lab_commands": lab_commands}  # fmt: skip
        stem = TIMED_STEM
        benchmark = "time to DDP's loss: steps to it (two Gloo processes) x step time (CPU network lab)"
        results = {"curves": curves, "combined": combine(curves, lab_rows, lab_failures, failures, settings),
                   "lab": lab_rows, "runs": runs, "curve_failures": failures, "lab_failures": lab_failures}  # fmt: skip
    else:
        settings = {"tasks": args.tasks, "methods": args.methods, "seeds": list(range(args.seeds)),
                    "quick": args.quick, "steps": steps, "eval_every": args.eval_every or 0, **shared, "processes": 2,
                    "backend": "gloo", "torch_threads_per_process": 1,
                    "charlm": {"context_bytes": CONTEXT,
                               "text": standard_library_text()[1] if "charlm" in args.tasks else None},
                    "flat_algorithms": sorted(FLAT & set(args.methods))}  # fmt: skip
        stem = "convergence_cpu"
        benchmark = "convergence of every algorithm against Lightning DDP, two Gloo processes on CPU"
        results = {"summary": summarise(runs), "runs": runs, "failures": failures}
    report = {
        "benchmark": benchmark,
        "command": "python benchmarks/convergence.py" + "".join(f" {a}" for a in args.argv),
        "settings": settings,
        "machine": machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_wall_s": time.perf_counter() - started,
        **results,
    }
    text = markdown(report)
    if not args.no_save:
        write_report(Path(args.out), stem, report, text)
        chart(report, Path(args.out) / f"{stem}.png")
    print(text)
    return report


def render(path: Path) -> None:
    """Write the tables and chart of the results file ``path`` beside it; rescore a ``--timed`` one first.

    The learning curves and the lab's steps are measurements; the target and the steps to it are a rule applied to
    them, so a ``--timed`` file is rescored under this module's rule rather than run again.

    Args:
        path: a ``convergence_cpu.json`` or ``time_to_accuracy_cpu.json``.
    """
    report = json.loads(path.read_text())
    if "curves" in report:
        report["curves"] = steps_to_target(report["runs"], report["settings"]["target_at"])
        failures = report["lab_failures"], report["curve_failures"]
        report["combined"] = combine(report["curves"], report["lab"], *failures, report["settings"])
    write_report(path.parent, path.stem, report, markdown(report))
    chart(report, path.with_suffix(".png"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line, filling what it leaves open by the mode (``--timed``) and ``--quick``.

    Args:
        argv: the arguments; ``sys.argv[1:]`` by default.

    Returns:
        The arguments, with ``every`` (evaluation interval per task) and ``argv`` (the arguments as given).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timed", action="store_true", help="steps to DDP's loss x the lab's step time, per link")
    parser.add_argument("--render", help="rescore this results file and write its tables; run nothing")
    parser.add_argument("--tasks", nargs="+", choices=ALL_TASKS, help="default: digits charlm; timed: all")
    parser.add_argument("--methods", nargs="+", help="diloco_h<H>, torchft_diloco_h<H> at any H too")
    parser.add_argument("--seeds", type=int, help="seeds 0 .. n-1 (default: 3; quick or timed: 1)")
    parser.add_argument("--quick", action="store_true", help="short runs, one seed; timed: 100mbit, 3 rounds")
    parser.add_argument("--steps", type=int, help="training steps of every task (default: per task)")
    parser.add_argument("--eval-every", type=int, help="score the held-out set every k steps: curves")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one training run may take")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default: benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="print the tables, write nothing")
    timed = parser.add_argument_group("--timed")
    timed.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="hosts x ranks per host")
    timed.add_argument("--rates", nargs="+", help=f"tc rates or unshaped (default: {' '.join(RATES)})")
    timed.add_argument("--rounds", type=int, help=f"interleaved lab rounds (default: {FULL['rounds']})")
    target_help = f"target: DDP's held-out loss at this share of the run (default {TARGET_AT:.2f})"
    timed.add_argument("--target-at", type=float, default=TARGET_AT, help=target_help)
    timed.add_argument("--lab-steps", type=int, help="timed lab steps per method and round")
    timed.add_argument("--lab-warmup", type=int, help="untimed lab steps before them (more than 2)")
    timed.add_argument("--no-lab", dest="lab", action="store_false", help="learning curves only (no root needed)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="digits", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    args.argv = arguments
    if args.job and args.steps is None:
        parser.error("--job needs --steps")
    if args.job or args.render is not None:
        return args
    for key, value in (QUICK if args.quick else FULL).items():  # what the command line leaves open
        if getattr(args, key) is None:
            setattr(args, key, list(value) if key == "rates" else value)
    if args.seeds is None:  # one seed keeps a full timed run near 40 minutes on two cores; a second adds 15
        args.seeds = 1 if args.quick or args.timed else 3
    args.tasks = args.tasks or list(ALL_TASKS if args.timed else TASKS)
    args.methods = args.methods or (available_methods() if args.timed else list(METHODS))
    unknown = [m for m in args.methods if not is_accepted(m)]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {accepted_methods()} (diloco_h<H> at any H too)")
    baselines = {baseline_of(m) for m in args.methods}
    if args.timed and not baselines <= set(args.methods):
        parser.error(f"the targets need the baselines {sorted(baselines)} among --methods; add them")
    for rate in args.rates:
        if rate != "unshaped":
            bits_per_second(rate)
    if args.seeds < 1 or args.rounds < 1:
        parser.error(f"--seeds and --rounds must be at least 1, got {args.seeds} and {args.rounds}")
    if not 0 < args.target_at <= 1:
        parser.error(f"--target-at must be a share of the run in (0, 1], got {args.target_at}")
    every = {task: EVAL_EVERY[task] // (2 if args.quick else 1) if args.timed else 0 for task in args.tasks}
    args.every = every if args.eval_every is None else dict.fromkeys(args.tasks, args.eval_every)
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, one job of it (``--job``), or re-render a results file (``--render``)."""
    args = parse_args(argv)
    if args.job:
        job(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.render is not None:
        render(Path(args.render))
        return
    orchestrate(args)


if __name__ == "__main__":
    main()
