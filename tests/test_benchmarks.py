"""The benchmark suite's own plumbing: tiny convergence, time-to-accuracy and lab runs, and the targets check."""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run(*command: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=300, check=False)


def test_convergence_tiny_and_targets_report(tmp_path: Path) -> None:
    # Two methods, one seed, five steps on digits: two Lightning jobs of two processes each.
    out = tmp_path / "results"
    command = ["--tasks", "digits", "--methods", "ddp", "gradient_allreduce", "--seeds", "1", "--steps", "5"]
    completed = run(str(BENCHMARKS / "convergence.py"), *command, "--out", str(out))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "convergence_cpu.json").read_text())
    assert {"command", "settings", "machine", "date", "summary", "runs", "failures"} <= set(report)
    assert report["failures"] == []
    assert [(r["method"], r["steps"]) for r in report["runs"]] == [("ddp", 5), ("gradient_allreduce", 5)]
    for row in report["summary"]:
        assert {"mean", "std", "min", "max", "n"} <= set(row["accuracy_pct"])
        assert row["baseline"] == "ddp"
        assert "accuracy_delta_pts" in row
    table = (out / "convergence_cpu.md").read_text()
    assert "| digits | gradient_allreduce | ddp |" in table
    assert "python benchmarks/convergence.py" in table

    # The targets check reads the tiny convergence results and the committed network lab; nothing else is there.
    shutil.copy(RESULTS / "network_lab_cpu.json", out)
    completed = run(str(BENCHMARKS / "suite.py"), "--report-only", "--results", str(out), "--out", str(out))
    assert completed.returncode == 0, completed.stderr[-3000:]
    targets = json.loads((out / "targets.json").read_text())
    assert targets["command"] == "python benchmarks/suite.py --report-only"
    by_name = {t["target"]: t for t in targets["targets"]}
    assert all(t["status"] in {"pass", "miss", "not run"} for t in targets["targets"])
    assert by_name["NVLink: gradient_allreduce step vs DDP"]["status"] == "not run"
    assert by_name["Accuracy within 1 point of ddp: gradient_allreduce on digits"]["measured"] is not None
    assert by_name["Bytes per step within 10% of the theoretical count: bytegrad"]["status"] == "pass"
    assert "| target | bar | measured | status | detail | source |" in (out / "targets.md").read_text()

    # With the GPU network lab's committed results beside them, the two-GPU targets are read from those.
    for path in RESULTS.glob("gpu_network_lab_*.json"):
        shutil.copy(path, out)
    completed = run(str(BENCHMARKS / "suite.py"), "--report-only", "--results", str(out), "--out", str(out))
    assert completed.returncode == 0, completed.stderr[-3000:]
    by_name = {t["target"]: t for t in json.loads((out / "targets.json").read_text())["targets"]}
    # Further NVLink runs pool with the first: the step is the median over all their rounds.
    lab_module = gpu_report()
    merged = lab_module.load_results(RESULTS)
    lab = merged["nvlink"]["methods"]
    nvlink = by_name["NVLink: gradient_allreduce step vs DDP"]
    expected = lab["gradient_allreduce"]["step_s"]["nvlink"]["median"] / lab["ddp"]["step_s"]["nvlink"]["median"]
    assert nvlink["measured"] == pytest.approx(expected)
    assert nvlink["status"] == ("pass" if expected <= 1.10 else "miss")
    for name in (
        "10gbit: low_rank_r4 step vs PowerSGD hook r4 (batched)",
        "CUDA launches per step: low_rank_r8 vs PowerSGD hook r8",
        "1gbit: time to the target loss, best low_rank vs the best other method",
    ):
        assert by_name[name]["status"] in {"pass", "miss"}, by_name[name]
    # Where no low_rank curve reached the target, the target is missed, and the detail says so.
    time_to_target = by_name["1gbit: time to the target loss, best low_rank vs the best other method"]
    if not any(lab_module.steps_to_target(merged, m) for m in merged["nvlink"]["methods"] if m.startswith("low_rank")):
        assert time_to_target["status"] == "miss"
        assert "no low_rank curve" in time_to_target["detail"]

    def targets_now() -> dict[str, dict[str, Any]]:
        completed = run(str(BENCHMARKS / "suite.py"), "--report-only", "--results", str(out), "--out", str(out))
        assert completed.returncode == 0, completed.stderr[-3000:]
        return {t["target"]: t for t in json.loads((out / "targets.json").read_text())["targets"]}

    # An interleaved job run after the lab's NVLink runs, unprofiled on the lab's model, times the engine as it is:
    # its ratio counts for the methods it timed beside DDP. A profiled one (step_breakdown.py's, before) does not.
    settings = merged["nvlink"]["settings"]
    for name, profiled, ratio in (("step_breakdown_profiled", 3, 2.0), ("step_breakdown_timed", 0, 0.9)):
        job = {
            "date": "2999-01-01T00:00:00+00:00",
            "engine_src": "src",
            "rounds": 2,
            "command": f"python benchmarks/gpu_network_lab.py --interleave steps --out {name}",
            # The lab's interleaved mode records no profile; step_breakdown.py's files record --profiled.
            "settings": ({"profiled": profiled} if profiled else {"interleave": "steps", "regime": "nvlink"})
            | {"cpu": False}
            | {key: settings[key] for key in ("batch", "context", "lr")},
            "methods": {"ddp": {"step_ms": {"median": 50.0}}, "low_rank_r8": {"step_ms": {"median": 50.0 * ratio}}},
        }
        (out / f"{name}.json").write_text(json.dumps(job))
    by_name = targets_now()
    low_rank_nvlink = by_name["NVLink: low_rank_r8 step vs DDP"]
    assert low_rank_nvlink["source"] == "step_breakdown_timed.json"
    assert low_rank_nvlink["measured"] == pytest.approx(0.9)
    assert low_rank_nvlink["status"] == "pass"
    # Two repeats of the timed job (same settings and methods, other names): the target is the median ratio of three.
    timed = json.loads((out / "step_breakdown_timed.json").read_text())
    for name, ratio in (("step_breakdown_timed_2", 1.2), ("step_breakdown_timed_3", 1.15)):
        repeat = {**timed, "command": f"python benchmarks/gpu_network_lab.py --interleave steps --out {name}"}
        repeat["methods"] = {**timed["methods"], "low_rank_r8": {"step_ms": {"median": 50.0 * ratio}}}
        (out / f"{name}.json").write_text(json.dumps(repeat))
    by_name = targets_now()
    low_rank_nvlink = by_name["NVLink: low_rank_r8 step vs DDP"]
    assert low_rank_nvlink["measured"] == pytest.approx(1.15)
    assert low_rank_nvlink["status"] == "miss"
    assert "the median ratio of 3 runs of this job" in low_rank_nvlink["detail"]
    assert "`step_breakdown_timed_2` 1.200x" in low_rank_nvlink["detail"]
    # A newer job timing steps four at a time is another setting: it is the source, alone, and says so.
    windowed = {**timed, "date": "2999-01-02T00:00:00+00:00", "settings": {**timed["settings"], "window": 4}}
    windowed["methods"] = {**timed["methods"], "low_rank_r8": {"step_ms": {"median": 50.0 * 0.95}}}
    (out / "step_breakdown_windowed.json").write_text(json.dumps(windowed))
    by_name = targets_now()
    low_rank_nvlink = by_name["NVLink: low_rank_r8 step vs DDP"]
    assert low_rank_nvlink["source"] == "step_breakdown_windowed.json"
    assert low_rank_nvlink["measured"] == pytest.approx(0.95)
    assert "the median ratio" not in low_rank_nvlink["detail"]
    assert "steps timed 4 at a time" in low_rank_nvlink["detail"]
    assert by_name["NVLink: gradient_allreduce step vs DDP"]["measured"] == pytest.approx(expected)


def test_time_to_accuracy_tiny_curves_with_cpu_hooks(tmp_path: Path) -> None:
    # DDP and DDP + torch's PowerSGD hook on digits, six steps scored every three: two Lightning jobs, no lab.
    out = tmp_path / "results"
    command = ["--tasks", "digits", "--methods", "ddp", "ddp_powersgd_r1", "--steps", "6", "--eval-every", "3"]
    completed = run(
        str(BENCHMARKS / "convergence.py"), "--timed", *command, "--seeds", "1", "--no-lab", "--out", str(out)
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "time_to_accuracy_cpu.json").read_text())
    assert {"command", "settings", "machine", "date", "curves", "combined", "runs"} <= set(report)
    assert report["curve_failures"] == []
    runs = {r["method"]: r for r in report["runs"]}
    assert [p["step"] for p in runs["ddp"]["curve"]] == [3, 6]
    # Lightning registers DDP hooks on CUDA only: the benchmark's strategy registered it on CPU, and it compressed.
    hook = runs["ddp_powersgd_r1"]["hook"]
    assert hook["name"] == "powerSGD_hook"
    assert hook["calls"] >= 6
    assert hook["powersgd_iter"] > hook["powersgd_start_iter"]
    assert "hook" not in runs["ddp"]
    ddp = report["curves"]["digits/ddp"]
    # The target is DDP's held-out loss at the evaluation nearest two thirds of its run: step 3 of 6.
    assert ddp["target_loss"] == runs["ddp"]["curve"][0]["loss"]
    assert ddp["steps_to_target"] == 3
    rows = {r["method"]: r for r in report["combined"]}
    assert set(rows) == {"ddp", "ddp_powersgd_r1"}
    assert rows["ddp_powersgd_r1"]["status"] in {"reached", "not reached"}
    assert "python benchmarks/convergence.py --timed" in (out / "time_to_accuracy_cpu.md").read_text()


def benchmark_module(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_report() -> Any:
    """``benchmarks/lab/gpu_report.py``, what reads the GPU lab's results, imported as the scripts import it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import lab.gpu_report

    return lab.gpu_report


def network_lab() -> Any:
    """``benchmarks/network_lab.py`` as a module."""
    return benchmark_module("network_lab")


def skip_without_lab_tools() -> None:
    """Skip the rest of a test where the lab cannot create namespaces and shape links (root, ``ip``, ``tc``)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("the rest needs root, iproute2 and tc (network namespaces and shaping)")


def test_network_lab_interleaves_rounds_with_spread(tmp_path: Path) -> None:
    lab_module = network_lab()
    # Round-robin, each round starting one method later.
    order = lab_module.interleaved(["a", "b", "c"], 4)
    assert [method for _, method in order] == list("abcbcacababc")
    assert [index for index, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    # low_rank at rank 16 is accepted by name (flat or hierarchical), without joining the default list, and so is
    # torch's PowerSGD at that rank, to compare it with.
    accepted = set(lab_module.known_methods())
    assert {"low_rank_r16", "low_rank_alt_r16", "low_rank_r16:hierarchical", "ddp_powersgd_r16"} <= accepted
    assert "low_rank_r16" not in lab_module.all_methods()
    assert "ddp_powersgd_r16" not in lab_module.all_methods()
    assert "low_rank_r32" not in lab_module.known_methods()
    # diloco by sync period: any diloco_h<H> resolves to sync_every=H.
    assert {"diloco", "diloco_h10", "diloco_h20:hierarchical"} <= accepted
    assert lab_module.engine_algorithm("diloco_h7", 2) == ("diloco", {"sync_every": 7})
    skip_without_lab_tools()
    out = tmp_path / "results"
    lab = [str(BENCHMARKS / "network_lab.py"), "--task", "digits", "--rates", "unshaped", "--rounds", "2"]
    methods = ["single", "ddp", "ddp_powersgd_r4", "async"]
    completed = run(*lab, "--steps", "1", "--methods", *methods, "--out", str(out))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "network_lab_cpu_digits.json").read_text())
    assert report["failures"] == []
    assert {"python", "torch", "lightning", "platform", "cpu_count"} <= set(report["machine"])
    assert [row["method"] for row in report["results"]] == methods
    for row in report["results"]:
        assert len(row["rounds_step_s"]) == 2
        assert row["min_step_s"] <= row["median_step_s"] <= row["max_step_s"]
        # The untimed first steps are kept per round (the default --warmup is 3), each a positive time.
        assert [len(first) for first in row["start_steps_s"]] == [3, 3]
        assert all(seconds > 0 for first in row["start_steps_s"] for seconds in first)
    # async is counted per averaging round (closing adds one): the whole fp32 model and the int32 stop code.
    averaged = report["results"][-1]
    assert averaged["averaging_rounds"] >= 1
    assert averaged["bytes_per_round"] == averaged["parameter_bytes"] + 4
    assert report["results"][1]["averaging_rounds"] is None
    assert "over 2 interleaved rounds [min, max]" in (out / "network_lab_cpu_digits.md").read_text()


def test_network_lab_reports_what_autos_measuring_cost_of_the_run_it_was_told() -> None:
    lab_module = network_lab()
    auto = {
        "rate": "1gbit", "method": "auto", "rounds_step_s": [0.010, 0.020],
        "auto_picks": ["bytegrad(hierarchical=False)", "gradient_allreduce"],
        "auto_trial_steps": [20, 30], "auto_trial_s": [0.4, 0.9],
    }  # fmt: skip
    report = {"settings": {"rounds": 2, "run_steps": 1000}, "results": [{"rate": "1gbit", "method": "ddp"}, auto]}
    lines = lab_module.auto_measuring_lines(report)
    assert "a share of the 1000 steps it was told (--run-steps) at that step." in lines[1]
    # Round 1: 0.4 s less 20 steps of 10 ms is 0.2 s, 2.0% of 1,000 steps of 10 ms; round 2: 0.3 s, 1.5%.
    assert lines[-1].splitlines()[-1] == (
        "| 1gbit | bytegrad(hierarchical=False) x1, gradient_allreduce x1 | 25 | 0.65 | 0.25 [0.2, 0.3]"
        " | 1.8% [1.5%, 2.0%] |"
    )
    report["settings"]["run_steps"] = None
    assert lab_module.auto_measuring_lines(report)[-1].splitlines()[-1].endswith("| 0.25 [0.2, 0.3] | - |")
    assert lab_module.auto_measuring_lines({"settings": {}, "results": [{"rate": "1gbit"}]}) == []


def test_time_to_accuracy_counts_every_methods_first_steps_alike() -> None:
    time_to_target = benchmark_module("convergence").time_to_target
    lab = {"median_step_s": 0.01, "start_steps_s": [[0.05, 0.02, 0.01], [0.07, 0.03, 0.01]]}
    # Per round: the first steps as timed, then the median step; the median over the rounds.
    assert math.isclose(time_to_target(lab, 10), statistics.median([0.08 + 7 * 0.01, 0.11 + 7 * 0.01]))
    # A target reached within the first steps costs those steps alone.
    assert math.isclose(time_to_target(lab, 2), statistics.median([0.07, 0.10]))
    # Steps to a loss target are interpolated: half a step more costs half a median step.
    assert math.isclose(time_to_target(lab, 2.5), statistics.median([0.075, 0.105]))
    # auto's first steps are its trials and its pick's warm-up: the same rule.
    auto = {"median_step_s": 0.01, "start_steps_s": [[0.2] * 12], "auto_trial_s": [2.0], "auto_trial_steps": [10]}
    assert math.isclose(time_to_target(auto, 100), 12 * 0.2 + 88 * 0.01)
    # A file of a run older than the lab's record of first steps: every step at the median.
    assert math.isclose(time_to_target({"median_step_s": 0.01}, 100), 1.0)


def test_time_to_accuracy_targets_ddps_loss_two_thirds_in_and_interpolates() -> None:
    tta = benchmark_module("convergence")
    curve = [{"step": 10, "loss": 1.0}, {"step": 20, "loss": 0.6}, {"step": 30, "loss": 0.5}]
    assert tta.target_loss(curve, 2 / 3) == 0.6  # step 20 is nearest 2/3 of 30
    assert tta.first_reaching(curve, 0.6) == 20.0
    assert math.isclose(tta.first_reaching(curve, 0.8), 15.0)  # halfway from 1.0 to 0.6
    assert tta.first_reaching(curve, 1.5) == 10.0
    assert tta.first_reaching(curve, 0.4) is None
    # The first crossing counts, from the evaluation just before it, whatever came earlier.
    bumpy = [{"step": 10, "loss": 0.5}, {"step": 20, "loss": 0.6}, {"step": 30, "loss": 0.3}]
    assert math.isclose(tta.first_reaching(bumpy, 0.4), 20 + 10 * 2 / 3)


def test_network_lab_links_send_no_faster_than_their_rate(tmp_path: Path) -> None:
    lab_module = network_lab()
    from lab import harness  # the lab's folder is on the path now

    # 100 us of the link, and never less than two full frames.
    assert harness.link_burst_bytes("100mbit") == 2 * 1514
    assert harness.link_burst_bytes("1gbit") == 12_500
    assert harness.link_burst_bytes("10gbit", burst_us=10_000) == 12_500_000
    with pytest.raises(SystemExit):
        lab_module.parse_args(["--burst-us", "0"])
    skip_without_lab_tools()
    out = tmp_path / "results"
    completed = run(str(BENCHMARKS / "network_lab.py"), "--check-links", "--rates", "100mbit", "--out", str(out))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "network_lab_links.json").read_text())
    rows = {row["size"]: row for row in report["results"]}
    assert set(rows) == set(harness.PROBE_SIZES)
    # Once a message outgrows the bucket, the link's rate bounds its time from below: a 10 ms bucket, as the lab
    # had before, lets 64 kB through in a fraction of the 5 ms it needs, and fails this.
    for size in (64_000, 256_000):
        assert rows[size]["min_s"] >= 0.9 * rows[size]["rate_bound_s"], rows[size]
    assert "100mbit, bucket 100 us" in (out / "network_lab_links.md").read_text()


def test_lm_step_time_smoke_on_cpu(tmp_path: Path) -> None:
    # The tiny CPU model: two rounds of DDP under Lightning, each a job of two Gloo processes.
    lm = [str(BENCHMARKS / "lm_step_time.py"), "--cpu", "--regimes", "nvlink", "--methods", "ddp"]
    lm += ["--steps", "2", "--warmup", "1", "--repeats", "2", "--results-dir", str(tmp_path), "--out", "lm"]
    completed = run(*lm)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "lm.json").read_text())
    assert report["rounds"] == 2
    assert [len(row["repeats"]) for row in report["results"]] == [2]
    assert report["results"][0]["median_step_s"] > 0
    # What reproduces the figures, without where they were written.
    assert report["command"].startswith("python benchmarks/lm_step_time.py --cpu")
    assert "--results-dir" not in report["command"]
    assert "| ddp |" in (tmp_path / "lm.md").read_text()


def test_engine_overhead_times_each_variant_on_cpu(tmp_path: Path) -> None:
    tiny = ["--cpu", "--width", "32", "--depth", "2", "--batch", "8", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    ratios = {"engine": "ratio_bagua_to_ddp", "telemetry": "ratio_on_to_off", "autotune": "ratio_autotuned_to_default"}
    stems = {"engine": "engine_overhead", "telemetry": "telemetry_overhead", "autotune": "autotune_sockets"}
    for variant, ratio in ratios.items():
        command = [str(BENCHMARKS / "engine_overhead.py"), "--variant", variant, *tiny, "--results-dir", str(tmp_path)]
        completed = run(*command)
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
        report = json.loads((tmp_path / f"{stems[variant]}_cpu.json").read_text())
        assert ratio in report, report
        assert all(row["median_ms"] > 0 for row in report["rows"])
        assert report["settings"]["devices"] == 2
    assert "decision" in report["rounds"][0]  # the autotuner's choice, per round


def test_low_rank_host_cost_times_every_setting_of_both_forms(tmp_path: Path) -> None:
    command = ["--tasks", "digits", "--ranks", "2", "--rounds", "2", "--steps", "1", "--warmup", "1"]
    completed = run(str(BENCHMARKS / "low_rank_host_cost.py"), *command, "--out", str(tmp_path))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "low_rank_host_cost_cpu.json").read_text())
    timed = {(row["form"], row["setting"]) for row in report["results"]}
    settings = ("qr_torch", "qr_native")
    assert timed == {(form, setting) for form in ("two-sided", "alternate") for setting in settings}
    assert all(len(row["rounds_s"]) == 2 and row["min_s"] > 0 for row in report["results"])
    assert "python benchmarks/low_rank_host_cost.py" in (tmp_path / "low_rank_host_cost_cpu.md").read_text()


def test_gpu_network_lab_smoke_on_cpu_and_its_report(tmp_path: Path) -> None:
    # The lab's plumbing on two Gloo processes (a tiny model, no shaping): both regimes, then the report.
    out = tmp_path / "results"
    methods = ["--methods", "ddp", "low_rank_r4", "--rounds", "1", "--results-dir", str(out), "--cpu"]
    nvlink = ["--regime", "nvlink", "--train-steps", "16", "--eval-every", "8"]
    for regime in (nvlink, ["--regime", "sockets", "--window", "2"]):
        completed = run(str(BENCHMARKS / "gpu_network_lab.py"), *regime, *methods, "--rates", "1")
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    refused = run(str(BENCHMARKS / "gpu_network_lab.py"), *nvlink, *methods, "--window", "2")
    assert refused.returncode != 0
    assert "--window 2: give a positive number of steps, and only with --regime sockets" in refused.stderr
    nvlink = json.loads((out / "gpu_network_lab_nvlink_cpu.json").read_text())
    assert set(nvlink["methods"]) == {"ddp", "low_rank_r4"}
    assert [point["step"] for point in nvlink["methods"]["ddp"]["curve"]] == [8, 16]
    sockets = json.loads((out / "gpu_network_lab_sockets_cpu.json").read_text())
    assert set(sockets["methods"]["low_rank_r4"]["step_s"]) == {"unshaped", "1gbit"}
    assert {"median", "min", "max"} == set(sockets["methods"]["ddp"]["step_s"]["1gbit"])
    # Each row of ours records the keywords it ran with, which the targets check compares with the lab's.
    assert sockets["methods"]["low_rank_r4"]["rounds"][0]["algorithm_keywords"] == {"rank": 4, "hierarchical": False}
    table = (out / "gpu_network_lab_cpu.md").read_text()
    assert "python benchmarks/gpu_network_lab.py --regime sockets --rounds 1 --methods ddp low_rank_r4" in table
    assert sockets["command"].endswith("--rates 1 --window 2")
    assert "| low_rank_r4 |" in table
    assert "steps to target" in table


def test_gpu_network_lab_compares_bucket_sizes_side_by_side_and_keeps_them_out_of_the_report(tmp_path: Path) -> None:
    out = tmp_path / "results"
    methods = ["--methods", "ddp", "bytegrad", "bytegrad@0.01", "--rounds", "1", "--results-dir", str(out), "--cpu"]
    refused = run(str(BENCHMARKS / "gpu_network_lab.py"), "--regime", "sockets", *methods, "--rates", "1")
    assert refused.returncode != 0
    assert "--out gpu_bucket_cap_NAME" in refused.stderr
    assert not out.exists()
    unknown = run(str(BENCHMARKS / "gpu_network_lab.py"), "--methods", "bytegrad@none", "--out", "gpu_bucket_cap_x")
    assert unknown.returncode != 0
    assert "'bytegrad@none'" in unknown.stderr
    assert "positive number of MiB" in unknown.stderr

    stem = "gpu_bucket_cap_smoke"
    completed = run(
        str(BENCHMARKS / "gpu_network_lab.py"), "--regime", "sockets", *methods, "--rates", "1", "--out", stem
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    run_file = json.loads((out / f"{stem}.json").read_text())
    assert set(run_file["methods"]) == {"ddp", "bytegrad", "bytegrad@0.01"}
    assert run_file["methods"]["bytegrad@0.01"]["rounds"][0]["bucket_cap_mb"] == 0.01
    assert "bucket_cap_mb" not in run_file["methods"]["bytegrad"]["rounds"][0]
    assert not (out / "gpu_network_lab_cpu.md").exists()  # not the lab's report
    table = (out / f"{stem}.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| bytegrad@0.01 |"))
    variant = run_file["methods"]["bytegrad@0.01"]["step_s"]["1gbit"]["median"]
    base = run_file["methods"]["bytegrad"]["step_s"]["1gbit"]["median"]
    assert f"({variant / base:.2f}x)" in row
    assert "--out gpu_bucket_cap_smoke" in table


def lab_run(seed: int, steps: dict[str, list[float]], finals: dict[str, float], **settings: Any) -> dict[str, Any]:
    """A GPU lab NVLink results file in miniature: per method, each round's step and one curve of two points."""
    methods = {}
    for method, rounds in steps.items():
        curve = [{"step": 8, "val_loss": 3.0}, {"step": 16, "val_loss": finals[method]}]
        methods[method] = {
            "step_s": {"nvlink": {"median": sorted(rounds)[len(rounds) // 2], "min": min(rounds), "max": max(rounds)}},
            "rounds": [{"method": method, "step_s": {"nvlink": value}} for value in rounds],
            "curve": curve,
        }
    base = {"batch": 16, "context": 512, "lr": 3e-4, "train_steps": 16, "eval_every": 8, "timing_steps": 40}
    return {
        "command": f"python benchmarks/gpu_network_lab.py --regime nvlink --rounds 1 --seed {seed}",
        "settings": {**base, "cpu": False, "seed": seed, **settings},
        "rounds": len(next(iter(steps.values()))),
        "machine": {"device": "H200"},
        "date": "2026-11-27T00:00:00+00:00",
        "methods": methods,
    }


def test_gpu_network_lab_pools_further_nvlink_runs_and_refuses_unlike_ones(tmp_path: Path) -> None:
    lab = gpu_report()
    first = lab_run(0, {"ddp": [0.050], "bytegrad": [0.060]}, {"ddp": 2.5, "bytegrad": 2.4})
    second = lab_run(1, {"ddp": [0.040, 0.045], "bytegrad": [0.050, 0.052]}, {"ddp": 2.7, "bytegrad": 2.6})
    (tmp_path / "gpu_network_lab_nvlink.json").write_text(json.dumps(first))
    (tmp_path / "gpu_network_lab_nvlink_seed1.json").write_text(json.dumps(second))
    loaded = lab.load_results(tmp_path)
    ddp = loaded["nvlink"]["methods"]["ddp"]
    # The median over all three rounds, and the mean curve of the two seeds, which the report shows with its spread.
    assert ddp["step_s"]["nvlink"] == {"median": 0.045, "min": 0.040, "max": 0.050}
    assert ddp["curve"][-1]["val_loss"] == pytest.approx(2.6)
    assert lab.steps_to_target(loaded, "bytegrad") == 16
    rows = {row[0]: row for row in lab.time_to_target_table(loaded)[1]}
    assert rows["bytegrad"][-1] == "2.5000 (0.962x) [2.4000, 2.6000] over 2 seeds"
    assert "--seed 1 --out gpu_network_lab_nvlink_seed1" in loaded["nvlink"]["command"]

    faster = {**second, "settings": {**second["settings"], "lr": 1e-3}}
    (tmp_path / "gpu_network_lab_nvlink_seed1.json").write_text(json.dumps(faster))
    with pytest.raises(SystemExit, match="settings differ in lr"):
        lab.load_results(tmp_path)
    # A run of the constant rate (the files before ``--schedule`` recorded none) does not pool with a cosine one.
    cosine = {**second, "settings": {**second["settings"], "schedule": "cosine", "lr_warmup": 4}}
    (tmp_path / "gpu_network_lab_nvlink_seed1.json").write_text(json.dumps(cosine))
    with pytest.raises(SystemExit, match="settings differ in schedule"):
        lab.load_results(tmp_path)
    other = lab_run(1, {"bytegrad": [0.05]}, {"bytegrad": 2.6})
    other["methods"]["bytegrad"]["rounds"][0]["algorithm_keywords"] = {"hierarchical": True}
    (tmp_path / "gpu_network_lab_nvlink_seed1.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="pool only runs of the same keywords"):
        lab.load_results(tmp_path)


def test_gpu_network_lab_compares_with_ddp_only_over_the_runs_that_timed_both(tmp_path: Path) -> None:
    lab = gpu_report()
    first = lab_run(0, {"ddp": [0.050], "bytegrad": [0.060]}, {"ddp": 2.5, "bytegrad": 2.4})
    # A run of some methods alone: bytegrad again (much faster, on a quieter machine), and low_rank_r16 only there.
    alone = lab_run(0, {"bytegrad": [0.030], "low_rank_r16": [0.055]}, {"bytegrad": 2.4, "low_rank_r16": 2.45})
    (tmp_path / "gpu_network_lab_nvlink.json").write_text(json.dumps(first))
    (tmp_path / "gpu_network_lab_nvlink_alone.json").write_text(json.dumps(alone))
    loaded = lab.load_results(tmp_path)
    # The pooled column takes every round; the ratio to DDP only the run that timed both.
    assert loaded["nvlink"]["methods"]["bytegrad"]["step_s"]["nvlink"]["median"] == pytest.approx(0.045)
    bytegrad, ddp, runs = lab.nvlink_beside(loaded, "bytegrad")
    assert (bytegrad["median"], ddp["median"], runs["runs"]) == (0.060, 0.050, 1)
    assert lab.nvlink_beside(loaded, "low_rank_r16") is None
    rows = {row[0]: row for row in lab.step_table(loaded)[1]}
    assert "(no DDP in its runs)" in rows["low_rank_r16"][1]
    # The table's ratio is the side-by-side one too, not the pooled medians' (0.045 / 0.050).
    assert rows["bytegrad"][1].startswith("45.0 (1.20x)")


def test_gpu_network_lab_sockets_rows_come_from_the_latest_run_by_date_not_by_name(tmp_path: Path) -> None:
    lab = gpu_report()

    def sockets_run(date: str, steps: dict[str, float]) -> dict[str, Any]:
        methods = {
            method: {"step_s": {"unshaped": {"median": value, "min": value, "max": value}}}
            for method, value in steps.items()
        }
        return {"command": "python benchmarks/gpu_network_lab.py --regime sockets", "date": date, "methods": methods}

    (tmp_path / "gpu_network_lab_sockets.json").write_text(json.dumps(sockets_run("2026-11-27T00:00", {"ddp": 0.2})))
    # "a_newer" sorts first by name but ran last: its bytegrad row is the one the report shows.
    newer = sockets_run("2026-11-28T12:00", {"bytegrad": 0.08, "ddp": 0.19})
    older = sockets_run("2026-11-28T06:00", {"bytegrad": 0.1, "low_rank_r8": 0.07})
    (tmp_path / "gpu_network_lab_sockets_a_newer.json").write_text(json.dumps(newer))
    (tmp_path / "gpu_network_lab_sockets_z_older.json").write_text(json.dumps(older))
    loaded = lab.load_results(tmp_path)
    sockets = loaded["sockets"]
    medians = {method: entry["step_s"]["unshaped"]["median"] for method, entry in sockets["methods"].items()}
    assert medians == {"ddp": 0.19, "bytegrad": 0.08, "low_rank_r8": 0.07}
    sources = sockets["sources"]
    assert list(sources) == [
        "gpu_network_lab_sockets",
        "gpu_network_lab_sockets_z_older",
        "gpu_network_lab_sockets_a_newer",
    ]
    assert sources["gpu_network_lab_sockets_z_older"][1] == ["low_rank_r8"]
    assert sources["gpu_network_lab_sockets"][1] == []
    # A ratio reads DDP as timed in the method's own run: bytegrad's beside 0.19, none for low_rank_r8's run.
    assert lab.sockets_beside(loaded, "bytegrad", "unshaped")["median"] == 0.19
    assert lab.sockets_beside(loaded, "low_rank_r8", "unshaped") is None
    assert lab.source_lines(sockets)[2] == "- `gpu_network_lab_sockets_a_newer` (2026-11-28T12:00): bytegrad, ddp"
    # A run that timed its steps in windows says so.
    (tmp_path / "gpu_network_lab_sockets_a_newer.json").write_text(json.dumps({**newer, "settings": {"window": 4}}))
    windowed = lab.source_lines(lab.load_results(tmp_path)["sockets"])[2]
    assert windowed.endswith("(2026-11-28T12:00; steps timed 4 at a time, back to back): bytegrad, ddp")
    main = {**sockets_run("2026-11-27T00:00", {"ddp": 0.2}), "settings": {"window": 2}}
    (tmp_path / "gpu_network_lab_sockets.json").write_text(json.dumps(main))
    assert "; steps timed 2 at a time" in lab.source_lines(lab.load_results(tmp_path)["sockets"])[0]
    rows = {row[0]: row for row in lab.step_table(loaded)[1]}
    assert rows["bytegrad"][1].startswith("80.0 (0.42x)")
    assert "(no DDP in its run)" in rows["low_rank_r8"][1]


def test_gpu_network_lab_learning_rate_warms_up_linearly_then_decays_to_its_floor() -> None:
    lab = benchmark_module("gpu_network_lab")
    args = argparse.Namespace(schedule="cosine", lr_warmup=10, train_steps=110)
    factor = lab.lr_factor(args)
    assert [factor(step) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(10) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(lab.LR_FLOOR + (1 - lab.LR_FLOOR) / 2)
    assert factor(110) == pytest.approx(lab.LR_FLOOR)
    assert factor(500) == pytest.approx(lab.LR_FLOOR)  # timing rounds may step past the schedule
    assert lab.lr_factor(argparse.Namespace(schedule="constant", lr_warmup=10, train_steps=110))(0) == 1.0
    described = gpu_report().schedule_of({"lr": 3e-4, "schedule": "cosine", "lr_warmup": 30, "train_steps": 300})
    assert described == "0.0003 after a linear warm-up of 30 steps, then a cosine decay to 0.1 of it at step 300"


def test_time_to_accuracy_bars_count_auto_against_its_run_and_diloco_against_its_floor() -> None:
    benchmark_module("gpu_network_lab")  # puts benchmarks/ on the path
    tta = benchmark_module("convergence")
    where = {"task": "charlm", "layout": "2x1", "rate": "100mbit"}

    def row(method: str, step_s: float, steps: int, **extra: Any) -> dict[str, Any]:
        return {**where, "method": method, "median_step_s": step_s, "steps_to_target": steps,
                "time_to_target_s": step_s * steps, "status": "reached", **extra}  # fmt: skip

    auto = row("auto", 0.030, 100, auto_pick="low_rank(rank=16, hierarchical=False)", auto_trial_steps=10)
    auto |= {"auto_trial_s": 0.7, "time_to_target_s": 0.7 + 90 * 0.030}
    report = {
        "settings": {"steps": {"charlm": 400}},
        "lab": [{**where, "method": "single", "median_step_s": 0.020}],
        "curves": {},
        "combined": [
            row("ddp", 0.060, 100),
            row("low_rank_r16", 0.030, 100),
            row("bytegrad", 0.025, 100),
            auto,
            row("diloco_h20", 0.022, 80, final_acc_pct=52.0),
            row("diloco_h20_f2_d5", 0.021, 90, final_acc_pct=52.0),
            row("torchft_diloco_h20", 0.011, 80),
            row("torchft_diloco_h20_f2_d5", 0.030, 90),
        ],
    }
    lines = tta.bars_markdown(report)
    (auto_line,) = [line for line in lines if line.startswith("| charlm | 2x1 | 100mbit | low_rank")]
    # 0.4 s of measuring beyond the pick's 10 steps, over the told run of 400 steps at 30 ms: 3.3%.
    # bytegrad is the fastest fixed method; against its pick run as a fixed method, auto pays its measuring only.
    assert auto_line.endswith("| 3.4 s | bytegrad 2.5 s | 1.36x | 0.57x | 1.13x | 3.3% |"), auto_line
    (diloco_line,) = [line for line in lines if "| diloco_h20 |" in line]
    # Free communication would still take 80 steps of 20 ms: 0.53x low_rank's 3 s and 0.27x DDP's 6 s.
    assert "| 1.10x | 0.53x, 0.27x |" in diloco_line, diloco_line
    # Each form is judged against torchft's at its own schedule, though the plain one is the faster peer here.
    assert "| 0.29x | 2.00x | 1.10x |" in diloco_line, diloco_line
    (streaming_line,) = [line for line in lines if "| diloco_h20_f2_d5 |" in line]
    assert "| 0.32x | 0.70x | 1.05x |" in streaming_line, streaming_line
    # The docs include the auto table's summary, between its markers, rather than retyping its figures.
    summary = lines[lines.index("<!-- auto-summary -->") + 1]
    assert lines[lines.index("<!-- auto-summary -->") + 2] == "<!-- /auto-summary -->"
    assert summary == (
        "In this run auto reached the target in 1 of 1 cells. Its time to the target, its measuring counted, was"
        " under DDP's in 1 (from 0.57x to 0.57x of it); within 1.10x of the fastest fixed method's in 0 (0 of the 1"
        " at 100 Mbit/s and faster) and within 1.25x in 0, at worst 1.36x (charlm, 2x1, 100mbit). Its pick was the"
        " cell's fastest fixed method in 0. Measuring cost 3.3% to 3.3% of the run; beyond it, auto's time came to"
        " 1.13x to 1.13x its pick's run as a fixed method in the same cell."
    )
    # Where the lab kept the rounds, a cell beyond 1.10x says whether the fastest method's own slowest round was
    # as far off: bytegrad's two rounds took 2.5 s and 3.5 s, 1.40x its median, and auto's 1.36x lies within.
    report["lab"].append({**where, "method": "bytegrad", "start_steps_s": [[], []], "rounds_step_s": [0.025, 0.035]})
    summary = tta.bars_markdown(report)[lines.index("<!-- auto-summary -->") + 1]
    assert " Of the 1 beyond 1.10x, 1 lay within the fastest method's own slowest round (which reached 1.40x to" in (
        summary
    )
    # A fastest method outside auto's candidates is named as such.
    report["combined"].append(row("low_rank_r8", 0.020, 100))
    summary = tta.bars_markdown(report)[lines.index("<!-- auto-summary -->") + 1]
    assert "Its pick was the cell's fastest fixed method in 0, and in 1 the fastest was low_rank_r8, which auto" in (
        summary
    )


def test_suite_times_only_low_rank_ranks_that_keep_ddps_final_loss() -> None:
    gpu_report()  # puts benchmarks/ on the path, as the suite's own run does
    suite = benchmark_module("suite")

    def curve(*losses: float) -> list[dict[str, float]]:
        return [{"step": 10 * (i + 1), "val_loss": loss} for i, loss in enumerate(losses)]

    nvlink = {
        "ddp": {"curve": curve(3.0, 2.5, 2.0), "step_s": {"nvlink": {"median": 0.05}}},
        "ddp_powersgd_r8": {"curve": curve(3.0, 2.5, 2.1), "step_s": {}},
        "low_rank_r8": {"curve": curve(3.0, 2.4, 2.1), "step_s": {}},  # fastest, but 5% above DDP's final loss
        "low_rank_r32": {"curve": curve(3.0, 2.5, 2.01), "step_s": {}},
    }
    sockets = {
        "ddp": {"step_s": {"10gbit": {"median": 1.0}}},
        "ddp_powersgd_r8": {"step_s": {"10gbit": {"median": 0.2}}},
        "low_rank_r8": {"step_s": {"10gbit": {"median": 0.05}}},
    }
    loaded = {"nvlink": {"methods": nvlink}, "sockets": {"methods": sockets}}
    found: list[dict[str, Any]] = []
    suite._final_loss_and_time_targets(loaded, nvlink, found, "cmd")
    by_rate = {t["target"].split(":")[0]: t for t in found}
    # low_rank_r32 keeps the loss but was never timed at 10 Gbit/s; low_rank_r8's lead does not count.
    assert by_rate["10gbit"]["status"] == "not run"
    assert "low_rank_r32" in by_rate["10gbit"]["detail"]

    sockets["low_rank_r32"] = {"step_s": {"10gbit": {"median": 0.1}}}
    found.clear()
    suite._final_loss_and_time_targets(loaded, nvlink, found, "cmd")
    target = next(t for t in found if t["target"].startswith("10gbit"))
    # r32 reaches the target (2.5) at step 20 at 0.1 s a step, PowerSGD at step 20 at 0.2 s.
    assert target["status"] == "pass"
    assert target["measured"] == pytest.approx(0.5)

    nvlink["low_rank_r32"]["curve"] = curve(3.0, 2.5, 2.05)
    found.clear()
    suite._final_loss_and_time_targets(loaded, nvlink, found, "cmd")
    assert {t["status"] for t in found} == {"miss"}


def test_gpu_network_lab_interleaves_steps_of_methods_built_together(tmp_path: Path) -> None:
    out = tmp_path / "results"
    lab = [str(BENCHMARKS / "gpu_network_lab.py"), "--interleave", "steps", "--cpu", "--results-dir", str(out)]
    methods = ["--methods", "ddp", "qadam@1", "--rounds", "2", "--timing-steps", "2", "--out", "s"]
    completed = run(*lab, *methods)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "s.json").read_text())
    assert report["command"].endswith("--rounds 2 --timing-steps 2 --methods ddp qadam@1 --out s")
    assert report["rounds"] == 2
    for method in ("ddp", "qadam@1"):
        assert report["methods"][method]["step_ms"]["median"] > 0
        assert len(report["methods"][method]["rounds"]) == 2
    assert "| qadam@1 |" in (out / "s.md").read_text()
    # Each round printed every method's step, both methods built before the first.
    rounds = [line for line in completed.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2
    assert all("ddp" in line and "qadam@1" in line for line in rounds)
    refused = run(*lab, "--methods", "ddp", "async", "--out", "s")
    assert refused.returncode != 0
    assert "--interleave steps cannot time async" in refused.stderr
    unnamed = run(*lab, "--methods", "ddp")
    assert unnamed.returncode != 0
    assert "give it --out NAME" in unnamed.stderr
    # Two steps back to back per window, with low_precision_decentralized's exchange left in flight between them.
    methods = ["--methods", "ddp", "low_precision_decentralized", "--rounds", "1", "--timing-steps", "2"]
    completed = run(*lab, *methods, "--window", "2", "--out", "w")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    windowed = json.loads((out / "w.json").read_text())
    assert "--window 2" in windowed["command"]
    assert windowed["settings"]["window"] == 2
    assert windowed["methods"]["low_precision_decentralized"]["step_ms"]["median"] > 0
    uneven = run(*lab, "--methods", "ddp", "--timing-steps", "5", "--window", "2", "--out", "u")
    assert uneven.returncode != 0
    assert "--window 2 must be a positive divisor of --timing-steps 5" in uneven.stderr


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "diloco"])
def test_chaos_kills_a_rank_and_counts_an_exact_finish(tmp_path: Path, algorithm: str) -> None:
    # One algorithm on two processes, one kill inside a training step: the undisturbed job, then the killed job,
    # which torchrun restarts and which resumes from last.ckpt to the undisturbed weights, bit for bit (diloco's
    # replicas differ, but its schedule, outer state and merges in flight resume exactly).
    command = ["chaos", "--kills", "1", "--algorithms", algorithm, "--layouts", "2", "--kinds", "mid_step"]
    out = tmp_path / "results"
    completed = run(str(BENCHMARKS / "robustness.py"), *command, "--out", str(out), "--cache", str(tmp_path / "cache"))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "chaos_cpu.json").read_text())
    assert report["command"].startswith("python benchmarks/robustness.py chaos --kills 1")
    [row] = report["rows"]
    assert (row["algorithm"], row["layout"], row["runs"], row["kills"]) == (algorithm, "2", 1, 1)
    assert row["kills_by_kind"] == {"mid_step": 1}
    assert row["kills_missed_aim"] == 0
    assert row["restarts"] == 1
    assert (row["exact"], row["not_exact"], row["torn_checkpoints"], row["hangs"]) == (1, 0, 0, 0)
    [job] = report["runs"]
    assert job["comparison"] == "bit-identical"
    assert job["checkpoints"] >= 1
    assert f"| {algorithm} | 2 | 1 | 1 | 1 |" in (out / "chaos_cpu.md").read_text()
    assert list((tmp_path / "cache").glob(f"{algorithm}-2-cpu-0-*.pt"))


def test_chaos_layouts_and_comparisons() -> None:
    lab = benchmark_module("robustness")
    layout = lab.Layout.parse("2x2")
    assert (layout.nodes, layout.per_node, layout.world_size) == (2, 2, 4)
    assert lab.Layout.parse("4").nodes == 1
    import torch

    def final(value: float, loss: float = 1.0) -> dict[str, Any]:
        return {"state": {"w": torch.tensor([value])}, "loss": loss, "global_step": 36}

    reference = [[final(1.0), final(1.0)]]
    assert lab.compare("gradient_allreduce", [final(1.0), final(1.0)], reference) == (True, "bit-identical")
    # One ulp off is off for a synchronous algorithm, within the tolerance of a decentralized one.
    off = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))
    assert not lab.compare("gradient_allreduce", [final(off), final(1.0)], reference)[0]
    assert lab.compare("decentralized", [final(off), final(1.0)], reference)[0]
    assert not lab.compare("decentralized", [final(1.001), final(1.0)], reference)[0]
    # async: within the seeds' spread of the final loss, widened by that spread on either side.
    seeds = [[final(1.0, 1.0)], [final(1.0, 1.2)]]
    assert lab.compare("async", [final(0.0, 0.85)], seeds)[0]
    assert not lab.compare("async", [final(0.0, 1.5)], seeds)[0]


def test_chaos_counts_a_torn_checkpoint_and_a_last_link_to_nothing(tmp_path: Path) -> None:
    import torch

    lab = benchmark_module("robustness")
    torch.save({"step": 5}, tmp_path / "epoch=0-step=5.ckpt")
    (tmp_path / "epoch=0-step=10.ckpt").write_bytes(b"half a checkpoint")
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=15.ckpt")  # removed before the link moved
    (tmp_path / "last-v1.ckpt").symlink_to("epoch=0-step=5.ckpt")
    count, torn = lab.load_checkpoints(tmp_path)
    assert count == 4
    assert [entry.split(":")[0] for entry in torn] == ["epoch=0-step=10.ckpt", "last.ckpt"]
    assert "a link to epoch=0-step=15.ckpt, which is gone" in torn[1]


def test_chaos_merges_reports_of_jobs_run_side_by_side(tmp_path: Path) -> None:
    lab = benchmark_module("robustness")

    def report(algorithm: str, exact: bool) -> Path:
        kill = lab.Kill(kind="mid_step", rank=1, pid=7, landed=True, detail="step 5")
        run = lab.Run(algorithm=algorithm, layout="2", kind="mid_step", index=0, kills=[kill], exact=exact)
        record = {
            "command": f"python benchmarks/robustness.py chaos --algorithms {algorithm}",
            "device": "cuda",
            "name": algorithm,
            "date": "2026-11-27T00:00:00+00:00",
            "machine": {"platform": "p", "cpu_count": 16, "torch": "2.11", "python": "3.12"},
            "settings": {"kills_per_configuration": 1},
            "runs": [dataclasses.asdict(run)],
        }
        path = tmp_path / f"{algorithm}.json"
        path.write_text(json.dumps(record))
        return path

    parts = [report("bytegrad", True), report("low_rank", False)]
    assert lab.main(["chaos", "--merge", *map(str, parts), "--out", str(tmp_path / "out"), "--name", "chaos_cuda"]) == 1
    merged = json.loads((tmp_path / "out" / "chaos_cuda.json").read_text())
    assert [row["algorithm"] for row in merged["rows"]] == ["bytegrad", "low_rank"]
    assert [row["exact"] for row in merged["rows"]] == [1, 0]
    assert "--algorithms bytegrad ; python benchmarks/robustness.py chaos --algorithms low_rank" in merged["command"]
    assert [(part["name"], part["algorithms"]) for part in merged["merged_from"]] == [
        ("bytegrad", ["bytegrad"]),
        ("low_rank", ["low_rank"]),
    ]
    table = (tmp_path / "out" / "chaos_cuda.md").read_text()
    assert "| **all** |  | **2** | **2** | **2** |" in table
    assert "low_rank 2 run 0 (mid_step)" in table


def test_suite_gpu_jobs_are_accepted_by_their_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A job the suite would start on the GPUs, hours into its run, must not fail on its own arguments.
    suite = benchmark_module("suite")
    module = benchmark_module("gpu_network_lab")
    checked = set()
    steps = {name: command for name, command, _ in suite.gpu_steps(quick=False)}
    for name, command in steps.items():
        if command[0] != "gpu_network_lab.py":
            continue
        monkeypatch.setattr(sys, "argv", command)
        module.parse_args()
        checked.add(name)
    assert {"step_breakdown_bucket_cap", "gpu_bucket_cap_sockets", "step_breakdown_interleaved"} <= checked
    # The sockets comparison: each @25 row has its method at today's default beside it, and DDP both ways.
    sockets = steps["gpu_bucket_cap_sockets"]
    methods = sockets[sockets.index("--methods") + 1 : sockets.index("--rounds")]
    assert {"ddp", "ddp@100", "ddp_fp16", "ddp_powersgd_r8"} <= set(methods)
    for job in ("step_breakdown_interleaved", "step_breakdown_bucket_cap"):  # the peers beside ours, same job
        assert set(suite.PEER_METHODS) <= set(steps[job])
    assert all(method.removesuffix("@25") in methods for method in methods)
