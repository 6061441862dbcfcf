"""The benchmark suite's own plumbing: a tiny convergence run and the targets check, on a temporary folder."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    assert by_name["NVLink: gradient_allreduce step time vs Lightning DDP"]["status"] == "not run"
    assert by_name["Accuracy within 1 point of ddp: gradient_allreduce on digits"]["measured"] is not None
    assert by_name["Bytes per step within 10% of the theoretical count: bytegrad"]["status"] == "pass"
    assert "| target | bar | measured | status | detail | source |" in (out / "targets.md").read_text()
