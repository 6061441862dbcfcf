"""The benchmark suite in one command, and the check of every performance target against the measured results.

It runs the benchmark scripts one after the other, each a subprocess writing its own ``benchmarks/results/*.json``
(``--cpu``: the CPU network lab, which needs root and ``tc``, convergence, the codec, the engine overhead and the
fused optimizer on CPU; ``--gpu``: the GPU network lab with its report and interleaved NVLink jobs, the codec and the
engine overhead on two GPUs), then checks every target of the performance bar against those files: ``targets.json``,
``.md`` and ``.png`` give each target's figure, pass, miss or "not run" and why. Byte targets compare the payload
the engine's ``CommunicationCounter`` counted in the network lab with what the algorithm's definition implies (a byte
counted once per collective that takes it as input, ``lab/traffic.py``'s ``payload_bytes``), beside the wire
bytes of its ``wire_bytes``. Run it::

    python benchmarks/suite.py --cpu                 # the CPU suite, then the targets check
    python benchmarks/suite.py --gpu                 # on a machine with two GPUs
    python benchmarks/suite.py --report-only         # the targets check from the committed results
    python benchmarks/suite.py --readme              # the README's figures and chart (lab/gpu_report.py)
"""

import argparse
import json
import logging
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
ROOT = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
from lab import gpu_report, traffic  # noqa: E402
from lab.harness import LAB_TOOLS, can_shape_links  # noqa: E402
from lab.render import markdown_table, pyplot  # noqa: E402
from lab.results import write_report as write_results  # noqa: E402

TOLERANCE = 0.10  # bytes per step: measured within 10 % of the count the algorithm implies


LOW_RANKS = (4, 8, 16, 32)  # the lab's low_rank_rK methods
# A method's mean final validation loss against DDP's, at the same steps and seeds.
FINAL_LOSS_BAR = gpu_report.FINAL_LOSS_BAR
# What the suite's interleaved NVLink job times beside the peers: ours but async (whose thread would send
# while the others are timed), each named by its lab method.
INTERLEAVED = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam",
               *(f"low_rank_r{rank}" for rank in LOW_RANKS))  # fmt: skip
# The peers a user would pick instead, at their fastest settings, timed in the same jobs as ours.
PEER_METHODS = ("ddp", "ddp_fp16", "ddp_powersgd_r8")
# The bucket-size comparison: these methods beside themselves at DDP's 25 MiB, the engine's CUDA default before it
# became 100 MiB (each @25 row's ratio is to the same method at today's default), and DDP at 100 MiB beside its own.
BUCKET_CAP = ("gradient_allreduce", "bytegrad", "qadam", "low_precision_decentralized", "low_rank_r16")
BUCKET_CAP_METHODS = (*PEER_METHODS, "ddp@100", *(name for method in BUCKET_CAP for name in (method, f"{method}@25")))


def cpu_steps(quick: bool) -> list[tuple[str, list[str], str | None]]:
    """(name, command, reason it cannot run here or None) of every CPU benchmark."""
    lab = ["network_lab.py", *(["--rates", "100mbit", "--steps", "5"] if quick else [])]
    codec = ["micro/codec_throughput.py", "--cpu", "--threads", "1", *(["--sizes-mb", "4", "16"] if quick else [])]
    rounds = ["--rounds", "1"] if quick else []
    return [
        ("network_lab", lab, None if can_shape_links() else f"needs {LAB_TOOLS}"),
        ("convergence", ["convergence.py", *(["--quick"] if quick else [])], None),
        ("codec_throughput", codec, None),
        ("engine_overhead", ["engine_overhead.py", "--variant", "engine", "--cpu", *rounds], None),
        ("fused_optimizer", ["micro/fused_optimizer.py", *rounds], None),
    ]


def gpu_steps(quick: bool) -> list[tuple[str, list[str], str | None]]:
    """(name, command, reason it cannot run here or None) of every GPU benchmark."""
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    reason = None if gpus >= 2 else f"needs two GPUs, found {gpus}"
    rounds = ["--rounds", "1" if quick else "3"]
    # The stems the NVLink step targets and the Performance page read (newer_nvlink_jobs).
    steps_in_turn = ["gpu_network_lab.py", "--interleave", "steps", "--timing-steps", "20", *rounds, "--methods"]
    interleaved = [*steps_in_turn, *PEER_METHODS, *INTERLEAVED, "--out", "step_breakdown_nvlink_interleaved"]
    bucket_cap_nvlink = [*steps_in_turn, *BUCKET_CAP_METHODS, "--out", "step_breakdown_bucket_cap_interleaved"]
    bucket_cap_sockets = ["gpu_network_lab.py", "--regime", "sockets", "--rates", "10", "1", "--methods"]
    bucket_cap_sockets += [*BUCKET_CAP_METHODS, *rounds, "--out", "gpu_bucket_cap_sockets"]
    nvlink = ["gpu_network_lab.py", "--regime", "nvlink"]
    seeds = []
    for seed in () if quick else (1, 2):
        name = f"gpu_network_lab_nvlink_seed{seed}"
        seeds.append((name, [*nvlink, "--rounds", "1", "--seed", str(seed), "--out", name], reason))
    return [
        ("gpu_network_lab_nvlink", [*nvlink, *rounds], reason),
        # Two more seeds, one round each, pooled with the first by the report: the final losses' spread over seeds.
        *seeds,
        ("gpu_network_lab_sockets", ["gpu_network_lab.py", "--regime", "sockets", *rounds], reason),
        ("gpu_network_lab_report", ["gpu_network_lab.py", "--report"], reason),
        # After the lab: the NVLink step targets read this job, every method (but async) timed step by step in turn.
        ("step_breakdown_interleaved", interleaved, reason),
        ("step_breakdown_bucket_cap", bucket_cap_nvlink, reason),
        ("gpu_bucket_cap_sockets", bucket_cap_sockets, reason),
        ("codec_throughput", ["micro/codec_throughput.py"], None if gpus >= 1 else "needs a GPU"),
        ("autotune_sockets", ["engine_overhead.py", "--variant", "autotune"], reason),
        ("engine_overhead", ["engine_overhead.py", "--variant", "engine"], reason),
    ]


def run_steps(steps: list[tuple[str, list[str], str | None]], timeout: int) -> list[dict[str, Any]]:
    """Run each benchmark as a subprocess; return what happened to each."""
    done: list[dict[str, Any]] = []
    for name, command, reason in steps:
        full = [sys.executable, str(BENCHMARKS / command[0]), *command[1:]]
        shown = "python benchmarks/" + " ".join(command)
        if reason is not None:
            log.warning("skipped %s: %s", shown, reason)
            done.append({"name": name, "command": shown, "status": "skipped", "reason": reason})
            continue
        log.info("running %s", shown)
        start = time.perf_counter()
        try:
            completed = subprocess.run(full, cwd=ROOT, timeout=timeout, check=False)
            status = "ok" if completed.returncode == 0 else f"failed (exit {completed.returncode})"
        except subprocess.TimeoutExpired:
            status = f"failed (over {timeout} s)"
        done.append({"name": name, "command": shown, "status": status, "wall_s": time.perf_counter() - start})
    return done


# ------------------------------------------------------------------------------------------------ the targets


def _load(results: Path, name: str) -> dict[str, Any] | None:
    """Return the results file ``results/<name>.json``, or ``None`` where it is missing."""
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _target(
    target: str, source: str, bar: str, figure: float | None, passed: bool | None, detail: str, **extra: Any
) -> dict[str, Any]:
    # No figure and no verdict: not measured. No figure but a verdict: measured, with nothing to show as a ratio (a
    # method that never reached a target misses it).
    status = "not run" if figure is None and passed is None else ("pass" if passed else "miss")
    # command: what wrote the source file (None when the file or the measurement is missing).
    return {"target": target, "source": source, "command": extra.pop("command", None), "bar": bar,
            "measured": figure, "status": status, "detail": detail, **extra}  # fmt: skip


def gpu_targets(results: Path) -> list[dict[str, Any]]:
    """The two-GPU targets, from the GPU network lab (``gpu_network_lab_*.json``, merged as its report merges them).

    Every step ratio compares rows of one regime's results; the PowerSGD and launch targets compare ``low_rank`` at
    rank K with torch's batched PowerSGD hook at the same rank.
    """
    command = "python benchmarks/gpu_network_lab.py --report, from the runs gpu_network_lab.md names"

    try:
        loaded = gpu_report.load_results(results)
    except SystemExit:
        loaded = {}
    found = []

    jobs = newer_nvlink_jobs(results, loaded.get("nvlink"))

    def step_ratio(target: str, label: str, method: str, base: str, bar: float) -> None:
        job = next((job for job in jobs if {method, base} <= set(job["methods"])), None) if label == "nvlink" else None
        if job is not None:
            value, ref = job["methods"][method]["step_ms"], job["methods"][base]["step_ms"]
            detail = (
                f"{value['median']:.1f} ms vs {ref['median']:.1f} ms (medians over {job['rounds']} rounds; this job"
                f" ran after the lab's NVLink runs)"
            )
            if (window := job["settings"].get("window", 1)) > 1:
                detail += f"; steps timed {window} at a time, back to back between two device synchronisations"
            # Repeats of the job (the same settings and methods, under other names) count alike: the median ratio.
            repeats = [other for other in jobs if other["settings"] == job["settings"]]
            ratios = [_job_ratio(other, method, base) for other in repeats]
            ratio = statistics.median(ratios)
            if len(repeats) > 1:
                each = ", ".join(f"`{other['stem']}` {run:.3f}x" for other, run in zip(repeats, ratios, strict=True))
                detail += f"; the median ratio of {len(repeats)} runs of this job: {each}"
            found.append(_target(target, f"{job['stem']}.json", f"<= {bar:.2f}x", ratio, ratio <= bar, detail,
                                 command=job["command"]))  # fmt: skip
            return
        data = loaded.get("nvlink" if label == "nvlink" else "sockets")
        source = f"gpu_network_lab_{'nvlink' if label == 'nvlink' else 'sockets'}.json"
        rows = {} if data is None else data["methods"]
        value = rows.get(method, {}).get("step_s", {}).get(label)
        ref = rows.get(base, {}).get("step_s", {}).get(label)
        if value is None or ref is None:
            missing = f"no {label} step of {method if value is None else base} in the GPU network lab's results"
            found.append(_target(target, source, f"<= {bar:.2f}x", None, None, missing))
            return
        ran = gpu_report.recorded_keywords(method, rows[method]) if method in gpu_report.OURS else None
        if ran is not None and ran != (now := gpu_report.algorithm_of(method)[1]):
            stale = f"{method} ran with {ran or 'its defaults'}, but the lab now runs it with {now}: run the lab again"
            found.append(_target(target, source, f"<= {bar:.2f}x", None, None, stale))
            return
        over = "rounds"
        if label != "nvlink":
            # The sockets rows come from several runs: the peer's step timed in the method's own run.
            ref = gpu_report.sockets_beside(loaded, method, label, base)
            if ref is None:
                alone = f"no sockets run timed {method} beside {base} at {label}"
                found.append(_target(target, source, f"<= {bar:.2f}x", None, None, alone))
                return
            over = "rounds, both from the run of the method's row"
        if label == "nvlink":
            # Pooled NVLink runs may have timed the method without DDP: only the runs that timed both count.
            beside = gpu_report.nvlink_beside(loaded, method, base)
            if beside is None:
                alone = f"no NVLink run timed {method} beside {base} (the lab's runs that timed it ran it alone)"
                found.append(_target(target, source, f"<= {bar:.2f}x", None, None, alone))
                return
            value, ref, runs = beside
            over = f"rounds of the {runs['runs']} runs that timed both"
        ratio = value["median"] / ref["median"]
        detail = f"{value['median'] * 1e3:.1f} ms vs {ref['median'] * 1e3:.1f} ms (medians over {over})"
        found.append(_target(target, source, f"<= {bar:.2f}x", ratio, ratio <= bar, detail, command=command))

    for method in gpu_report.OURS:
        step_ratio(f"NVLink: {method} step vs DDP", "nvlink", method, "ddp", 1.10)
    for method in ("bytegrad", "low_rank_r4", "low_rank_r8"):
        step_ratio(f"Unshaped sockets: {method} step vs DDP", "unshaped", method, "ddp", 0.50)
    for rate in ("10gbit", "1gbit"):
        for rank in (4, 8):
            target = f"{rate}: low_rank_r{rank} step vs PowerSGD hook r{rank} (batched)"
            step_ratio(target, rate, f"low_rank_r{rank}", f"ddp_powersgd_r{rank}", 0.70)
    sockets = loaded.get("sockets", {}).get("methods", {})
    for rank in (4, 8):
        target = f"CUDA launches per step: low_rank_r{rank} vs PowerSGD hook r{rank}"
        ours, theirs = (
            sockets.get(m, {}).get("launches_per_step") for m in (f"low_rank_r{rank}", f"ddp_powersgd_r{rank}")
        )
        if ours is None or theirs is None:
            found.append(_target(target, "gpu_network_lab_sockets.json", "< 1x", None, None, "not profiled"))
        else:
            found.append(_target(target, "gpu_network_lab_sockets.json", "< 1x", ours / theirs, ours < theirs,
                                 f"{ours:.0f} vs {theirs:.0f}", command=command))  # fmt: skip
    nvlink = loaded.get("nvlink", {}).get("methods", {})
    bar = f"<= {FINAL_LOSS_BAR:.2f}x"
    for rank in LOW_RANKS:
        method = f"low_rank_r{rank}"
        target = f"Final validation loss: {method} vs DDP (same steps and seeds)"
        ratio = gpu_report.final_loss_ratio(loaded, method) if "ddp" in nvlink else math.inf
        if math.isinf(ratio):
            found.append(_target(target, "gpu_network_lab_nvlink.json", bar, None, None, "no curves"))
            continue
        _, _, final_ddp = gpu_report.target_of(loaded)
        spreads = f"{_seed_spread(nvlink, method)}; DDP {_seed_spread(nvlink, 'ddp')}"
        detail = f"{nvlink[method]['curve'][-1]['val_loss']:.4f} vs {final_ddp:.4f}, {spreads}"
        found.append(_target(target, "gpu_network_lab_nvlink.json", bar, ratio, ratio <= FINAL_LOSS_BAR, detail,
                             command=command))  # fmt: skip
    _final_loss_and_time_targets(loaded, nvlink, found, command)
    for rate in ("10gbit", "1gbit"):
        times = {m: t for m in nvlink if (t := gpu_report.time_to_target(loaded, m, rate)) is not None}
        target = f"{rate}: time to the target loss, best low_rank vs the best other method"
        ours = {m: t for m, t in times.items() if m.startswith("low_rank")}
        others = {m: t for m, t in times.items() if not m.startswith("low_rank")}
        ran = [m for m in nvlink if m.startswith("low_rank") and nvlink[m].get("curve")]
        if ran and not ours and others:
            rival = min(others, key=others.__getitem__)
            detail = (f"no low_rank curve ({', '.join(ran)}) reached the target loss; {rival} did, in"
                      f" {others[rival]:.1f} s ({_seed_spread(nvlink, rival)})")  # fmt: skip
            found.append(_target(target, "gpu_network_lab_nvlink.json", "<= 1x", None, False, detail, command=command))
            continue
        if not ours or not others:
            found.append(_target(target, "gpu_network_lab_nvlink.json", "<= 1x", None, None, "no curves or steps"))
            continue
        found.append(_fastest_to_target(target, ours, others, command))
    return found


def _final_loss_and_time_targets(
    loaded: dict[str, Any], nvlink: dict[str, Any], found: list[dict[str, Any]], command: str
) -> None:
    """The issue's bar for one setting: a ``low_rank`` rank whose final loss is within 1% of DDP's, timed to the target.

    Of the lab's ranks whose mean final loss is within 1% of DDP's, the fastest to the target loss at the rate must
    beat every other method there. A rank that keeps the loss but has no step at the rate leaves the target not run.
    """
    if "ddp" not in nvlink:
        return
    keeping = [
        method
        for method in (f"low_rank_r{rank}" for rank in LOW_RANKS)
        if gpu_report.final_loss_ratio(loaded, method) <= FINAL_LOSS_BAR
    ]
    for rate in ("10gbit", "1gbit"):
        target = f"{rate}: time to the target loss, low_rank at a rank within 1% of DDP's final loss vs the rest"
        if not keeping:
            found.append(_target(target, "gpu_network_lab_nvlink.json", "<= 1x", None, False,
                                 "no low_rank rank's final loss is within 1% of DDP's"))  # fmt: skip
            continue
        ours = {m: t for m in keeping if (t := gpu_report.time_to_target(loaded, m, rate)) is not None}
        others = {
            m: t
            for m in nvlink
            if not m.startswith("low_rank") and (t := gpu_report.time_to_target(loaded, m, rate)) is not None
        }
        if not ours or not others:
            untimed = ", ".join(m for m in keeping if m not in ours)
            detail = (
                f"{untimed} keep DDP's final loss within 1% but have no {rate} step in the lab's sockets runs"
                if not ours
                else f"no other method reached the target loss with a {rate} step"
            )
            found.append(_target(target, "gpu_network_lab_sockets.json", "<= 1x", None, None, detail))
            continue
        found.append(_fastest_to_target(target, ours, others, command))


def _fastest_to_target(target: str, ours: dict[str, float], others: dict[str, float], command: str) -> dict[str, Any]:
    """The target comparing the fastest of ``ours`` to the target loss with the fastest of ``others`` (seconds)."""
    best, rival = min(ours, key=ours.__getitem__), min(others, key=others.__getitem__)
    ratio = ours[best] / others[rival]
    detail = f"{best} {ours[best]:.1f} s vs {rival} {others[rival]:.1f} s (steps to target x median step)"
    return _target(target, "gpu_network_lab_nvlink.json", "<= 1x", ratio, ratio <= 1, detail, command=command)


def newer_nvlink_jobs(results: Path, lab: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Interleaved NVLink jobs (``step_breakdown_*.json``) run after the lab's last NVLink run, newest first.

    A job counts when it ran the lab's model and batch over NVLink from this checkout's engine, unprofiled (a profiler
    slows the methods timed after it): ``gpu_network_lab.py --interleave steps`` (the committed ones were written by
    ``step_breakdown.py``, its predecessor, with the same settings). For a method it timed beside DDP, such a job
    reflects the engine as it is now, where the lab's NVLink column pools rounds of every run since its first.

    Args:
        results: the results folder.
        lab: the lab's merged NVLink results, or ``None`` where there are none (then every such job counts).

    Returns:
        The jobs' results, each with ``stem`` added (its file name without suffix).
    """
    lab_dates = [json.loads(path.read_text())["date"] for path in results.glob("gpu_network_lab_nvlink*.json")]
    after = max(lab_dates, default="")
    settings = {} if lab is None else lab["settings"]
    jobs = []
    for path in results.glob("step_breakdown_*.json"):
        job = json.loads(path.read_text())
        ran = job.get("settings", {})
        same_model = all(ran.get(key) == settings.get(key, ran.get(key)) for key in ("batch", "context", "lr"))
        timed = not ran.get("profiled", 0) and not ran.get("sockets") and not ran.get("cpu")
        if job.get("date", "") > after and job.get("engine_src", "src") == "src" and timed and same_model:
            jobs.append({**job, "stem": path.stem})
    return sorted(jobs, key=lambda job: job["date"], reverse=True)


def _job_ratio(job: dict[str, Any], method: str, base: str) -> float:
    """An interleaved NVLink job's median step of ``method`` over its median step of ``base``."""
    return job["methods"][method]["step_ms"]["median"] / job["methods"][base]["step_ms"]["median"]


def _seed_spread(methods: dict[str, Any], method: str) -> str:
    """How many seeds a method's NVLink curve averages, with their final losses' range when more than one."""
    seeds, spread = gpu_report.seed_spread(methods[method])
    return f"mean of {seeds} seeds {spread}" if spread else "one seed"


def lab_targets(results: Path) -> list[dict[str, Any]]:
    """Throughput targets of the CPU network lab at 100 Mbit/s (``network_lab_cpu.json``)."""
    data = _load(results, "network_lab_cpu")
    names = ("CPU lab 100 Mbit/s: bytegrad throughput vs DDP", "CPU lab 100 Mbit/s: bytegrad vs DDP + fp16 hook")
    by_key = {} if data is None else {(r["rate"], r["method"]): r for r in data["results"]}
    found = []
    for name, base, bar in zip(names, ("ddp", "ddp_fp16"), (3.0, 1.0), strict=True):
        row, ref = by_key.get(("100mbit", "bytegrad")), by_key.get(("100mbit", base))
        if data is None or row is None or ref is None:
            reason = "network_lab_cpu.json has no 100mbit measurement of bytegrad and " + base
            found.append(_target(name, "network_lab_cpu.json", f">= {bar:g}x", None, None, reason))
            continue
        speedup = ref["median_step_s"] / row["median_step_s"]  # same batch: throughput ratio = step-time ratio
        detail = f"{row['median_step_s'] * 1e3:.0f} ms vs {ref['median_step_s'] * 1e3:.0f} ms"
        passed = speedup >= bar if bar > 1 else speedup > bar
        found.append(_target(name, "network_lab_cpu.json", f">= {bar:g}x" if bar > 1 else "> 1x", speedup, passed,
                             detail, command=data["command"]))  # fmt: skip
    return found


def byte_targets(results: Path) -> list[dict[str, Any]]:
    """Measured payload per step in the network lab against the count the algorithm implies."""
    data = _load(results, "network_lab_cpu") or {"results": []}
    found = []
    for algorithm in (*traffic.ALGORITHMS, "async"):
        name = f"Bytes per step within 10% of the theoretical count: {algorithm}"
        rows = [r for r in data["results"] if r["method"] == algorithm]
        if not rows or rows[0]["bytes_per_step"] is None:
            found.append(_target(name, "network_lab_cpu.json", "within 10%", None, None, "no measurement"))
            continue
        measured, parameters = rows[0]["bytes_per_step"], rows[0]["parameter_bytes"] // 4
        if algorithm == "async":
            found.append(_async_round_target(data, rows[0], parameters))
            continue
        expected = traffic.payload_bytes(algorithm, parameters, 2)
        wire = traffic.wire_bytes(algorithm, parameters, 2)
        ratio = measured / expected
        detail = (f"{measured:.0f} B counted vs {expected:.0f} B implied ({parameters} fp32 parameters, 2 ranks);"
                  f" traffic.wire_bytes: {wire:.0f} B leave the rank")  # fmt: skip
        numbers = {"wire_bytes": wire, "expected_payload_bytes": expected, "measured_payload_bytes": measured}
        passed = abs(ratio - 1) <= TOLERANCE
        found.append(_target(name, "network_lab_cpu.json", "within 10%", ratio, passed, detail,
                             command=data["command"], **numbers))  # fmt: skip
    return found


def _async_round_target(data: dict[str, Any], row: dict[str, Any], parameters: int) -> dict[str, Any]:
    """async averages on a timer, not per step: its payload is counted per averaging round.

    A round all-reduces the whole model (``4 P`` bytes for ``P`` fp32 parameters) after the ranks agree on whether
    to go on, an all-reduce of one int32 (4 bytes); the round that closing adds replaces the last agreement's.
    """
    name = "Bytes per averaging round within 10% of the theoretical count: async"
    measured, rounds = row.get("bytes_per_round"), row.get("averaging_rounds")
    if measured is None:
        detail = "no per-round count: network_lab_cpu.json predates the lab's averaging-round count, or no round ran"
        return _target(name, "network_lab_cpu.json", "within 10%", None, None, detail)
    expected = 4.0 * parameters + 4
    detail = (f"{measured:.0f} B counted per round vs {expected:.0f} B implied ({parameters} fp32 parameters,"
              f" {rounds} rounds on rank 0 at {row['rate']})")  # fmt: skip
    numbers = {"expected_payload_bytes": expected, "measured_payload_bytes": measured, "averaging_rounds": rounds}
    passed = abs(measured / expected - 1) <= TOLERANCE
    return _target(name, "network_lab_cpu.json", "within 10%", measured / expected, passed, detail,
                   command=data["command"], **numbers)  # fmt: skip


def accuracy_targets(results: Path) -> list[dict[str, Any]]:
    """Held-out accuracy within 1 point of the DDP baseline's (qadam: DDP with Adam), from ``convergence_cpu.json``."""
    data = _load(results, "convergence_cpu")
    if data is None:
        reason = "convergence_cpu.json is missing: the convergence benchmark has not been run"
        return [_target("Accuracy within 1 point of DDP", "convergence_cpu.json", ">= DDP - 1 point", None, None,
                        reason)]  # fmt: skip
    found = []
    for row in data["summary"]:
        if row["method"] == row["baseline"] or "accuracy_delta_pts" not in row:
            continue
        name = f"Accuracy within 1 point of {row['baseline']}: {row['method']} on {row['task']}"
        acc = row["accuracy_pct"]
        detail = f"{acc['mean']:.2f} % (± {acc['std']:.2f}, {acc['n']} seeds) vs {row['baseline']}"
        delta = row["accuracy_delta_pts"]
        found.append(_target(name, "convergence_cpu.json", ">= -1.00 points", delta, delta >= -1.0, detail,
                             command=data["command"]))  # fmt: skip
    return found


CHECKS: tuple[Callable[[Path], list[dict[str, Any]]], ...] = (gpu_targets, lab_targets, byte_targets,
                                                               accuracy_targets)  # fmt: skip


def check_targets(results: Path) -> list[dict[str, Any]]:
    """Every target, in the order of the performance bar."""
    return [row for check in CHECKS for row in check(results)]


def markdown(report: dict[str, Any]) -> str:
    """The targets table."""
    counts = {s: sum(t["status"] == s for t in report["targets"]) for s in ("pass", "miss", "not run")}
    rows = [
        [t["target"], t["bar"], "-" if t["measured"] is None else _figure(t), t["status"], t["detail"],
         f"`{t['source']}`" + (f" (`{t['command']}`)" if t["command"] else "")]
        for t in report["targets"]
    ]  # fmt: skip
    return "\n".join(
        [
            f"Performance targets: {counts['pass']} pass, {counts['miss']} miss, {counts['not run']} not run.",
            f"Written by `{report['command']}` from the JSON files in `benchmarks/results/` (see `targets.json`).",
            "Step-time and byte figures are ratios (x); accuracy figures are points against the baseline's mean.",
            "",
            markdown_table(["target", "bar", "measured", "status", "detail", "source"], rows),
        ]
    )


def _figure(t: dict[str, Any]) -> str:
    """Return a target's figure as the table shows it: points against the baseline, else a ratio."""
    return f"{t['measured']:+.2f}" if "points" in t["bar"] else f"{t['measured']:.3f}x"


def chart(report: dict[str, Any], path: Path) -> bool:
    """Each measured target as its figure over its bar (pass when the bar is on the right side of 1)."""
    plt = pyplot()
    if plt is None:
        return False
    measured = [t for t in report["targets"] if t["measured"] is not None and "points" not in t["bar"]]
    accuracy = [t for t in report["targets"] if t["measured"] is not None and "points" in t["bar"]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 0.35 * max(len(measured), len(accuracy), 4) + 1.5))
    colour = {"pass": "tab:green", "miss": "tab:red"}
    panels = ((left, measured, [t["target"] for t in measured], "measured ratio (x); the bar is in the table"),
              (right, accuracy, [t["target"].split(": ", 1)[1] for t in accuracy],
               "accuracy - baseline accuracy (points); the bar is -1"))  # fmt: skip
    for axis, targets, labels, xlabel in panels:
        axis.barh(range(len(targets)), [t["measured"] for t in targets], color=[colour[t["status"]] for t in targets])
        axis.set_yticks(range(len(targets)), labels, fontsize=7)
        axis.set_xlabel(xlabel)
        axis.invert_yaxis()
    left.axvline(1.0, color="black", linewidth=0.8)
    right.axvline(-1.0, color="black", linestyle="--", linewidth=0.8)
    right.axvline(0.0, color="black", linewidth=0.8)
    deltas = [t["measured"] for t in accuracy] or [0.0]
    right.set_xlim(min(-1.25, min(deltas) - 0.25), max(0.5, max(deltas) + 0.25))
    figure.suptitle("Performance targets: green pass, red miss (benchmarks/suite.py)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(results: Path, out: Path, command: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Check the targets against the JSON files in ``results``; write targets.json, .md and .png into ``out``."""
    report = {
        "benchmark": "every performance target against the measured results",
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "results_read": sorted(p.name for p in results.glob("*.json") if p.stem != "targets"),
        "suite_runs": runs,
        "targets": check_targets(results),
    }
    table = markdown(report)
    write_results(out, "targets", report, table)
    chart(report, out / "targets.png")
    print(table)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the suite's options (``argv``, else this process's) and add the command that reproduces them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU benchmarks")
    parser.add_argument("--gpu", action="store_true", help="run the two-GPU benchmarks")
    parser.add_argument("--report-only", action="store_true", help="run nothing: rebuild the targets check")
    parser.add_argument("--quick", action="store_true", help="shorter runs where a script offers them")
    parser.add_argument("--readme", action="store_true", help="rewrite the README's figures and chart (last)")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds one benchmark may take")
    parser.add_argument("--results", default=str(RESULTS), help="where the results JSON files are read")
    parser.add_argument("--out", default=str(RESULTS), help="where targets.json, .md and .png are written")
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    if not (args.cpu or args.gpu or args.report_only or args.readme):
        parser.error("choose --cpu, --gpu, --report-only or --readme")
    # The command as it reproduces the results (the folders are left out: they default to benchmarks/results).
    flags = {"--cpu": args.cpu, "--gpu": args.gpu, "--report-only": args.report_only, "--quick": args.quick}
    args.command = " ".join(["python benchmarks/suite.py", *(flag for flag, on in flags.items() if on)])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the chosen benchmarks, then check the targets and write the README's figures as asked; return the report."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    runs: list[dict[str, Any]] = []
    if args.cpu or args.gpu:
        steps = (cpu_steps(args.quick) if args.cpu else []) + (gpu_steps(args.quick) if args.gpu else [])
        runs = run_steps(steps, args.timeout)
    report: dict[str, Any] = {}
    if args.cpu or args.gpu or args.report_only:
        report = write_report(Path(args.results), Path(args.out), args.command, runs)
    if args.readme:
        gpu_report.write_readme(Path(args.results))
    return report


if __name__ == "__main__":
    main()
