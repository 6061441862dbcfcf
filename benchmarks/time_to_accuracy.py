"""Time to DDP's loss: how long each method takes to reach DDP's held-out loss, per link rate and layout.

Time to target = steps to target x step time, each measured by its own lab: ``convergence.py --eval-every k`` gives
every method's learning curve on two Gloo processes (the target is the DDP baseline's held-out loss at ``--target-at``
of its run, two thirds by default; DDP with Adam for ``qadam``), and ``network_lab.py`` times the same networks at the
same global batch on layouts 2x1 and 2x2 (``:flat`` and ``:hierarchical`` in 2x2). A run's first steps count as timed,
the rest at the median step. The overhead of a method is its step less the no-communication step (``single``), for
``low_rank_r<k>`` also against ``ddp_powersgd_r<k>``'s. Run it as root, on a quiet machine::

    python benchmarks/time_to_accuracy.py            # every task, method, rate and layout (40-45 min, 2 quiet cores)
    python benchmarks/time_to_accuracy.py --quick    # short runs, one seed, 100mbit only, 3 rounds (about 10 min)
    python benchmarks/time_to_accuracy.py --no-lab   # the learning curves only (no root needed)
    python benchmarks/time_to_accuracy.py --render benchmarks/results/time_to_accuracy_cpu.json   # rescore, tables

It writes ``benchmarks/results/time_to_accuracy_cpu.{json,md,png}``.
"""

import argparse
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import bits_per_second, can_shape_links, headline
from lab.methods import layout_variants, split_rank
from lab.render import markdown_table, pyplot, ratio
from lab.results import machine, write_report
from lab.tasks import (
    ALL_TASKS,
    SETTINGS,
    accepted_methods,
    available_methods,
    baseline_of,
    compression_warmup,
    is_accepted,
    low_rank_available,
)

log = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results"
STEM = "time_to_accuracy_cpu"
TASKS = ("digits", "charlm", "bytemlp")
LAYOUTS = ("2x1", "2x2")
RATES = ("100mbit", "1gbit", "unshaped")
# Held-out evaluations every k steps in the full run; the quick run, a fifth as long, evaluates twice as often.
EVAL_EVERY = {"digits": 10, "charlm": 20, "bytemlp": 20}
# The longest healthy lab collective takes a few seconds; torch's PowerSGD hook can hang on Gloo with several
# buckets instead of aborting, and this bounds the time such a failure costs.
LAB_COLLECTIVE_TIMEOUT_S = 120
# One seed keeps the full run near 40 minutes on two cores; --seeds 2 adds about a quarter of an hour.
# The target is DDP's held-out loss two thirds into its run, as in the GPU lab (its step 200 of 300): late enough
# that every method has left the steep start, early enough that DDP is still improving.
TARGET_AT = 2 / 3
FULL: dict[str, Any] = {"seeds": 1, "rounds": 5, "lab_steps": 3, "lab_warmup": 3, "rates": RATES}
QUICK: dict[str, Any] = {"seeds": 1, "rounds": 3, "lab_steps": 2, "lab_warmup": 3, "rates": ("100mbit",)}


def lab_methods(methods: list[str], ranks_per_host: int) -> list[str]:
    """The lab's names for ``methods``: ``single`` first; with several ranks per host, hierarchical variants."""
    return ["single", *(variant for method in methods for variant in layout_variants(method, ranks_per_host))]


def curve_of(lab_method: str) -> str:
    """The convergence method whose learning curve a lab method uses (``bytegrad:hierarchical`` -> ``bytegrad``)."""
    return lab_method.partition(":")[0]


# ------------------------------------------------------------------------------------------------ the curves


def run_curves(args: argparse.Namespace, steps: dict[str, int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train every (task, seed, method) with held-out evaluations; return the runs and the failures.

    Each task is one ``convergence.py --eval-every`` run, as a user would start it.
    """
    runs, failures = [], []
    for task in args.tasks:
        argv = ["--tasks", task, "--methods", *args.methods, "--seeds", str(args.seeds), "--steps", str(steps[task]),
                "--eval-every", str(args.eval_every[task]), "--timeout", str(args.timeout)]  # fmt: skip
        report = run_benchmark("convergence.py", argv)
        runs += report["runs"]
        failures += report["failures"]
    return runs, failures


def run_benchmark(script: str, argv: list[str]) -> dict[str, Any]:
    """Run ``benchmarks/<script> argv`` into a scratch folder and return the one results file it wrote."""
    log.info("python benchmarks/%s %s", script, " ".join(argv))
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(Path(__file__).resolve().parent / script), *argv, "--out", out]
        subprocess.run(command, check=True)
        (path,) = Path(out).glob("*.json")
        return dict(json.loads(path.read_text()))


def mean_curve(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Accuracy (percent) and loss at every evaluated step, averaged over the runs (seeds) that have that step."""
    by_step: dict[int, list[dict[str, float]]] = {}
    for run in runs:
        for point in run["curve"]:
            by_step.setdefault(int(point["step"]), []).append(point)
    return [
        {
            "step": step,
            "acc_pct": 100 * statistics.fmean(p["acc"] for p in points),
            "loss": statistics.fmean(p["loss"] for p in points),
            "seeds": len(points),
        }
        for step, points in sorted(by_step.items())
    ]


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
        targets = {}
        for baseline in ("ddp", "ddp_adam"):
            chosen = [r for r in of_task if r["method"] == baseline]
            if chosen:
                targets[baseline] = target_loss(mean_curve(chosen), target_at)
        for method in dict.fromkeys(r["method"] for r in of_task):
            chosen = [r for r in of_task if r["method"] == method]
            baseline = baseline_of(method)
            curve = mean_curve(chosen)
            entry: dict[str, Any] = {
                "task": task,
                "method": method,
                "baseline": baseline,
                "final_acc_pct": statistics.fmean(100 * r["test_acc"] for r in chosen),
                "final_loss": statistics.fmean(r["test_loss"] for r in chosen),
                "seeds": [r["seed"] for r in chosen],
                "curve": curve,
                "target_loss": None,
                "steps_to_target": None,
                "steps_to_target_per_seed": {},
            }
            if baseline in targets:
                entry["target_loss"] = targets[baseline]
                entry["steps_to_target"] = first_reaching(curve, targets[baseline])
                entry["steps_to_target_per_seed"] = {
                    str(r["seed"]): first_reaching(mean_curve([r]), targets[baseline]) for r in chosen
                }
            found[f"{task}/{method}"] = entry
    return found


# ------------------------------------------------------------------------------------------------ the lab


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
            command = "python benchmarks/network_lab.py " + " ".join(argv)
            report = run_benchmark("network_lab.py", argv)
            commands.append(command)
            rows += [{"task": task, "layout": layout, "batch_per_rank": batch, **row} for row in report["results"]]
            failures += [{"task": task, "layout": layout, **failure} for failure in report["failures"]]
    return rows, failures, commands


# ------------------------------------------------------------------------------------------------ the table


def combine(
    curves: dict[str, dict[str, Any]],
    lab_rows: list[dict[str, Any]],
    lab_failures: list[dict[str, Any]],
    curve_failures: list[dict[str, Any]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One row per (task, layout, rate, method): steps to target, step time and its spread, time, overhead."""
    by_key = {(r["task"], r["layout"], r["rate"], r["method"]): r for r in lab_rows}
    lab_failed = {(f["task"], f["layout"], f["rate"], f["method"]): f["error"] for f in lab_failures}
    curve_failed = {(f["task"], f["method"]): f["error"] for f in curve_failures}
    combined = []
    for task in args.tasks:
        for layout in args.layouts:
            ranks_per_host = int(layout.split("x")[1])
            for rate in args.rates if args.lab else [None]:
                single = by_key.get((task, layout, rate, "single"))
                for method in lab_methods(args.methods, ranks_per_host)[1:]:
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
                reference = next(
                    (r for r in of_layout if r["rate"] == row["rate"] and r["method"] == f"ddp_powersgd_r{rank}"), None
                )
                if rank is not None and reference is not None and "overhead_s" in row and "overhead_s" in reference:
                    row["powersgd_reference"] = reference["method"]
                    row["overhead_vs_powersgd"] = (
                        row["overhead_s"] / reference["overhead_s"] if reference["overhead_s"] > 0 else None
                    )
    return combined


def time_to_target(lab: dict[str, Any], steps: float) -> float:
    """Seconds a run of ``steps`` steps takes: its first steps as they were timed, the rest at the median step.

    Every method alike: the first steps (``--lab-warmup`` of them, and for auto its measuring steps and its pick's
    warm-up) cost what they cost in the lab's run, which for any method is more than its steady step. The median over
    the rounds; a results file without first steps (older runs) counts every step at the median.
    """
    median = lab["median_step_s"]
    if "start_steps_s" not in lab and lab.get("auto_trial_s"):  # auto in an older run: its measuring steps alone
        trials = statistics.median(lab["auto_trial_steps"])
        return float(statistics.median(lab["auto_trial_s"]) + max(steps - trials, 0) * median)
    rounds = lab.get("start_steps_s") or [[]]
    timed = [min(len(first), int(steps)) for first in rounds]
    costs = [sum(first[:n]) + (steps - n) * median for first, n in zip(rounds, timed, strict=True)]
    return float(statistics.median(costs))


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


def markdown(report: dict[str, Any]) -> str:
    """The tables: per task and layout, time to target per rate, then the communication overhead per rate."""
    settings = report["settings"]
    evaluations = ", ".join(f"{task} {every}" for task, every in settings["eval_every"].items())
    if any("start_steps_s" in row for row in report["lab"]):
        rule = "its first steps as the lab timed them (auto's measuring steps too) plus the rest x median step time"
        first_steps = " Every method's first steps (warm-up, auto's trials) count at the time they took."
    else:  # a run older than the lab's record of first steps
        rule, first_steps = (
            "steps to target x median step time",
            " Warm-up steps are counted at the compressed step's time.",
        )
    lines = [
        f"Time to target = {rule}. Target: the baseline's held-out loss (DDP with SGD; DDP with Adam for qadam),"
        f" mean over {settings['seeds']} seed(s), at the evaluation nearest {settings['target_at']:.2f} of its run."
        f" Steps: where the method's held-out loss, averaged over the seeds, first reaches it, linear between"
        f" evaluations (every {evaluations} steps), on two Gloo processes. Step time: the"
        f" CPU network lab, methods interleaved over {settings['rounds']} rounds, median [min, max] of the rounds."
        " Overhead: step time less the no-communication step (`single`) of the same rounds; for low_rank also as a"
        f" ratio to DDP + PowerSGD at the same rank.{first_steps}",
        f"Written by `{report['command']}`; every curve and measurement is in `{STEM}.json`.",
    ]
    rows = report["combined"]
    for task in settings["tasks"]:
        targets = sorted({(r["curve_method"], r.get("target_loss")) for r in rows if r["task"] == task})
        target_text = ", ".join(
            f"{baseline}'s loss {target:.4g}"
            for baseline, target in sorted(
                {(baseline_of(m), t) for m, t in targets if t is not None}, key=lambda item: item[0]
            )
        )
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


def bars_markdown(report: dict[str, Any]) -> list[str]:
    """The checks of auto and diloco against the methods a user would pick instead, per task, layout and rate.

    auto: its time to target (measuring included) over the best fixed method's and over DDP's, and its measuring
    cost beyond the pick's own steps as a share of the task's run (the length it is told). diloco: its time over
    the fastest ``low_rank``'s, DDP's and torchft's DiLoCo's; its step (averaged over whole sync periods) over the
    no-communication step; its final held-out loss over DDP's.
    """
    rows = report["combined"]
    singles = {
        (r["task"], r["layout"], r["rate"]): r["median_step_s"] for r in report["lab"] if r["method"] == "single"
    }
    auto_rows, diloco_rows = [], []
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
            auto_rows.append(
                f"| {' | '.join(map(str, where))} | {row['auto_pick']} | {row['auto_trial_steps']:g} steps,"
                f" {row['auto_trial_s']:.2g} s | {shown} | {best_text} |"
                f" {ratio(time_s, best and best['time_to_target_s'])} | {ratio(time_s, ddp_s)} | {share:.1%} |"
            )
        else:
            low_rank = _fastest(cell, lambda method: method.startswith("low_rank_"))
            torchft = _fastest(cell, lambda method: method.startswith("torchft_"))
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
            " cell; measuring share: its cost beyond the pick's own steps over the time of the task's run ("
            + ", ".join(f"{task} {steps} steps" for task, steps in report["settings"]["steps"].items())
            + "), the run length auto is told.",
            "",
            "| task | layout | rate | pick | measuring | time to target | best fixed | vs best | vs ddp | share |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *auto_rows,
        ]  # fmt: skip
    if diloco_rows:
        lines += [
            "", "### diloco against low_rank, DDP and torchft's DiLoCo", "",
            "Time to target over the fastest low_rank's (named), DDP's and torchft's DiLoCo's at the same H; step:"
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


def chart(report: dict[str, Any], path: Path) -> bool:
    """Learning curves with the target (top row) and time to target per rate (one row per layout), per task."""
    plt = pyplot()
    if plt is None:
        return False
    settings = report["settings"]
    tasks, layouts = settings["tasks"], settings["layouts"] if settings["lab"] else []
    figure, axes = plt.subplots(1 + len(layouts), len(tasks), figsize=(6 * len(tasks), 4 * (1 + len(layouts))),
                                squeeze=False)  # fmt: skip
    colour_map = plt.get_cmap("tab20")
    methods = settings["methods"]
    for column, task in enumerate(tasks):
        axis = axes[0][column]
        for index, method in enumerate(methods):
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
    figure.suptitle("Time to DDP's loss on CPU (benchmarks/time_to_accuracy.py)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


# ------------------------------------------------------------------------------------------------ the run


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the curves, then the lab, combine them and write the report; return it."""
    if args.lab and not can_shape_links():
        raise SystemExit("The lab needs root, iproute2 and tc; run as root, or pass --no-lab for the curves only.")
    started = time.perf_counter()
    defaults = {task: SETTINGS[task]["quick_steps" if args.quick else "steps"] for task in args.tasks}
    steps = dict.fromkeys(args.tasks, args.steps) if args.steps is not None else defaults
    runs, curve_failures = run_curves(args, steps)
    curves = steps_to_target(runs, args.target_at)
    lab_rows, lab_failures, lab_commands = run_lab(args, steps) if args.lab else ([], [], [])
    settings = {
        "tasks": args.tasks,
        "methods": args.methods,
        "low_rank_available": low_rank_available(),
        "layouts": args.layouts,
        "rates": args.rates,
        "lab": args.lab,
        "seeds": args.seeds,
        "quick": args.quick,
        "steps": steps,
        "eval_every": args.eval_every,
        "target_at": args.target_at,
        "rounds": args.rounds,
        "lab_steps": args.lab_steps,
        "lab_warmup": args.lab_warmup,
        "per_task": {task: SETTINGS[task] for task in args.tasks},
        "compression_warmup_steps": {task: compression_warmup(s) for task, s in steps.items()},
        "qadam_warmup_steps": {task: max(1, s // 5) for task, s in steps.items()},
        "curve_processes": 2,
        "lab_commands": lab_commands,
    }
    report = {
        "benchmark": "time to DDP's loss: steps to it (two Gloo processes) x step time (CPU network lab)",
        "command": "python benchmarks/time_to_accuracy.py" + "".join(f" {a}" for a in args.argv),
        "settings": settings,
        "machine": machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_wall_s": time.perf_counter() - started,
        "curves": curves,
        "combined": combine(curves, lab_rows, lab_failures, curve_failures, args),
        "lab": lab_rows,
        "runs": runs,
        "curve_failures": curve_failures,
        "lab_failures": lab_failures,
    }
    table = markdown(report)
    out = Path(args.out)
    write_report(out, STEM, report, table)
    chart(report, out / f"{STEM}.png")
    print(table)
    return report


def rescore(report: dict[str, Any]) -> dict[str, Any]:
    """The report with its steps and times to target recomputed from its stored runs, under this module's rule.

    The learning curves and the lab's steps are measurements; the target and the steps to it are a rule applied to
    them, so an older file is rescored rather than run again. Its ``target_at`` is kept where it has one.
    """
    settings = report["settings"]
    settings.pop("margin_pts", None)
    settings.setdefault("target_at", TARGET_AT)
    args = argparse.Namespace(
        tasks=settings["tasks"], layouts=settings["layouts"], rates=settings["rates"], lab=settings["lab"],
        methods=settings["methods"],
    )  # fmt: skip
    report["curves"] = steps_to_target(report["runs"], settings["target_at"])
    failures = report["lab_failures"], report["curve_failures"]
    report["combined"] = combine(report["curves"], report["lab"], *failures, args)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=ALL_TASKS)
    parser.add_argument("--methods", nargs="+", default=None, help="convergence methods (default: every one)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="hosts x ranks per host")
    parser.add_argument("--rates", nargs="+", default=None, help=f"tc rates or unshaped (default: {' '.join(RATES)})")
    parser.add_argument("--seeds", type=int, default=None, help=f"seeds 0 .. n-1 (default: {FULL['seeds']})")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved lab rounds (default: {FULL['rounds']})")
    parser.add_argument(
        "--target-at",
        type=float,
        default=TARGET_AT,
        help=f"target: DDP's held-out loss at this share of the run (default {TARGET_AT:.2f})",
    )
    parser.add_argument("--quick", action="store_true", help="short runs, one seed, 100mbit, 3 rounds")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every task (default: per task)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: per task)")
    parser.add_argument("--lab-steps", type=int, default=None, help="timed lab steps per method and round")
    parser.add_argument("--lab-warmup", type=int, default=None, help="untimed lab steps before them (more than 2)")
    parser.add_argument("--no-lab", dest="lab", action="store_false", help="learning curves only (no root needed)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one training run may take")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default: benchmarks/results)")
    parser.add_argument("--render", default=None, help="write the tables and chart of this results file; run nothing")
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    if args.render is not None:
        return args
    for key, value in (QUICK if args.quick else FULL).items():  # what the command line leaves open
        if getattr(args, key) is None:
            setattr(args, key, list(value) if key == "rates" else value)
    args.methods = available_methods() if args.methods is None else args.methods
    known = accepted_methods()
    unknown = [m for m in args.methods if not is_accepted(m)]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {known}")
    baselines = {baseline_of(m) for m in args.methods}
    if not baselines <= set(args.methods):
        parser.error(f"the targets need the baselines {sorted(baselines)} among --methods; add them")
    for rate in args.rates:
        if rate != "unshaped":
            bits_per_second(rate)
    if args.seeds < 1 or args.rounds < 1:
        parser.error(f"--seeds and --rounds must be at least 1, got {args.seeds} and {args.rounds}")
    if not 0 < args.target_at <= 1:
        parser.error(f"--target-at must be a share of the run in (0, 1], got {args.target_at}")
    every = {task: EVAL_EVERY[task] // (2 if args.quick else 1) for task in args.tasks}
    args.eval_every = every if args.eval_every is None else dict.fromkeys(args.tasks, args.eval_every)
    args.argv = arguments
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.render is not None:
        results = Path(args.render)
        report = rescore(json.loads(results.read_text()))
        write_report(results.parent, results.stem, report, markdown(report))
        chart(report, results.parent / f"{results.stem}.png")
        return
    orchestrate(args)


if __name__ == "__main__":
    main()
