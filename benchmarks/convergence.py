"""Convergence: every Bagua algorithm against Lightning's DDP, same hyper-parameters, same seeds, two CPU processes.

Each run is a fresh Lightning job of two Gloo processes (deterministic, one torch thread each); within a task every
method trains the same model from the same weights on the same data with the same optimizer settings
(:mod:`lab.tasks`), so only the communication differs, and the held-out metrics are averaged over the ranks. By
name it also runs DDP with torch's hooks (``ddp_fp16``, ``ddp_powersgd_r<k>``, registered on CPU by
:class:`CPUCommHookDDPStrategy`), ``low_rank_r<k>``, ``auto``, ``diloco_h<H>`` and ``torchft_diloco_h<H>``. On one
node ``hierarchical`` would only average inside the node, so the algorithms run flat. ``--eval-every k`` keeps
every run's learning curve (``time_to_accuracy.py`` runs it so). Run it::

    python benchmarks/convergence.py                # both tasks, every method, 3 seeds (about 20 min on 2 cores)
    python benchmarks/convergence.py --quick        # fewer steps, one seed: a look in a few minutes

It writes ``benchmarks/results/convergence_cpu.{json,md,png}``.
"""

import argparse
import functools
import json
import logging
import math
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
from lab.jobs import job_env
from lab.methods import TORCHFT_NOTE, engine_algorithm, split_rank, torchft_settings
from lab.models import CONTEXT, task_loss, task_model
from lab.render import markdown_table, pyplot
from lab.results import machine, spread, write_report
from lab.tasks import (
    ADAM_METHODS,
    ALL_TASKS,
    METHODS,
    SETTINGS,
    TASKS,
    accepted_methods,
    baseline_of,
    compression_warmup,
    is_accepted,
    is_hook_method,
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


# ------------------------------------------------------------------------------------------------ the methods


def bagua_algorithm(method: str, steps: int) -> tuple[str, dict[str, Any]]:
    """The engine algorithm name and keywords of a Bagua method, as the convergence runs set them."""
    from lightning_bagua.engine.algorithms.base import algorithm_class

    name, keywords = engine_algorithm(method, compression_warmup(steps))
    if name in FLAT or ("rank" in keywords and "hierarchical" in algorithm_class(name).keywords()):
        keywords["hierarchical"] = False
    return name, keywords


# ------------------------------------------------------------------------------------------------ the tasks


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


# ------------------------------------------------------------------------------------------------ one job


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
    """The table of the summary, with the command that wrote it."""
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
    """Accuracy per method and task, mean with min-max whiskers, and the baseline's mean as a line."""
    plt = pyplot()
    if plt is None:
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
                    run = run_job(task, method, seed, steps[task], args.timeout, args.eval_every)
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
        "eval_every": args.eval_every,
        "per_task": {task: SETTINGS[task] for task in args.tasks},
        "processes": 2,
        "backend": "gloo",
        "torch_threads_per_process": 1,
        "charlm": {"context_bytes": CONTEXT, "text": standard_library_text()[1] if "charlm" in args.tasks else None},
        "flat_algorithms": sorted(FLAT & set(args.methods)),
        "qadam_warmup_steps": {task: max(1, s // 5) for task, s in steps.items()},
        "compression_warmup_steps": {task: compression_warmup(s) for task, s in steps.items()},
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
    write_report(out, "convergence_cpu", report, table)
    chart(report, out / "convergence_cpu.png")
    print(table)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=ALL_TASKS)
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), help="the methods (diloco_h<H>, torchft_diloco_h<H> at any H)"
    )
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
    parser.add_argument("--eval-every", type=int, default=0, help="also score the held-out set every k steps: curves")
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    if args.quick and "--seeds" not in arguments:
        args.seeds = 1
    if args.steps is None and args.job:
        parser.error("--job needs --steps")
    unknown = [method for method in args.methods if not is_accepted(method)]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {accepted_methods()} (diloco_h<H> at any H too)")
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
