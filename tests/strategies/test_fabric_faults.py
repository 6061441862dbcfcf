"""Dead workers under Fabric: a rank killed with SIGKILL ends the job within 60 s, with a message naming it.

Under Fabric's own launcher the job is ``benchmarks/robustness.py``'s dead-rank runner with the Fabric job; without a
launcher the two ranks are plain processes, so only the strategy's own failure handling can name the dead one.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmarks.robustness import EXIT_DEADLINE_S, KILLED_RANK, run_job

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "fabric_fault_script.py"
KILL_AT_STEP = 6
_STRATEGY_NOTE = re.compile(rf"Failed rank\(s\): {KILLED_RANK} ")


@pytest.mark.timeout(240)
def test_a_killed_rank_ends_a_fabric_job_under_fabrics_launcher(tmp_path):
    result = run_job(
        "lightning", tmp_path, timeout_s=180, script=SCRIPT, training_args=("--kill-at-step", str(KILL_AT_STEP))
    )
    assert result.death_to_exit_s is not None, f"rank {KILLED_RANK} never died:\n{result.output[-4000:]}"
    assert result.returncode != 0, result.output[-4000:]
    assert not result.leftover_pids, f"processes outlived the launcher: {result.leftover_pids}"
    # A bound on hanging, not a speed figure.
    assert result.death_to_exit_s < EXIT_DEADLINE_S, result.output[-4000:]
    # Fabric's child-process observer, or the strategy's note when rank 0's collective fails first.
    observer = re.compile(rf"\[rank: {KILLED_RANK}\] Child process with PID \d+ terminated with code -9")
    assert observer.search(result.output) or _STRATEGY_NOTE.search(result.output), result.output[-6000:]
    assert not (tmp_path / "out").exists(), "a rank finished although its peer died"


def run_without_a_launcher(tmp_path: Path, algorithm: str, *script_args: str) -> tuple[int, int, float, str]:
    """Run the two ranks as plain processes; return the survivor's and the killed rank's exit codes, the time the
    survivor exited and its output."""
    port = free_port()
    outputs, processes = [], []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
        }
        command = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--devices", "2",
                   "--algorithm", algorithm, "--kill-rank", str(KILLED_RANK), *script_args]  # fmt: skip
        outputs.append(open(tmp_path / f"rank{rank}.log", "w"))  # noqa: SIM115 - closed below
        processes.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=outputs[-1], stderr=subprocess.STDOUT))
    try:
        survivor = processes[0]
        returncode = survivor.wait(timeout=180)
        exited = time.time()
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for output in outputs:
            output.close()
    return returncode, processes[1].returncode, exited, (tmp_path / "rank0.log").read_text(errors="replace")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "async"])
def test_without_a_launcher_the_surviving_rank_names_the_dead_one(tmp_path, algorithm):
    marker = tmp_path / "death.json"
    returncode, killed_returncode, exited, log = run_without_a_launcher(
        tmp_path, algorithm, "--kill-at-step", str(KILL_AT_STEP), "--kill-marker", str(marker)
    )
    assert marker.exists(), f"rank {KILLED_RANK} never died:\n{log[-4000:]}"
    assert killed_returncode == -9
    assert returncode != 0, log[-4000:]
    assert exited - json.loads(marker.read_text())["time"] < EXIT_DEADLINE_S, log[-4000:]
    # Printed with the traceback (the note) and logged by the strategy: the rank that went silent is named.
    assert _STRATEGY_NOTE.search(log), log[-6000:]
    if algorithm == "async" and (tmp_path / "out").exists():
        # async's loop never waits for a peer: on a busy machine the survivor can finish its steps before its
        # averaging thread learns of the death, which then surfaces as the script exits (the next test's case).
        assert "Async model averaging failed in its background thread" in log, log[-6000:]
    else:
        assert not (tmp_path / "out").exists(), "a rank finished although its peer died"


@pytest.mark.timeout(240)
def test_a_death_that_async_averaging_sees_only_at_exit_still_fails_the_survivor(tmp_path):
    """The rank dies after the survivor's loop; the survivor's script ends normally, and closing the engines at exit
    finds the dead peer. Python ignores an exception raised at exit (the process would exit with 0): the strategy
    reports it with the note naming the dead rank and ends the process with 1."""
    marker = tmp_path / "death.json"
    returncode, killed_returncode, exited, log = run_without_a_launcher(
        tmp_path, "async", "--kill-at-step", "12", "--kill-marker", str(marker),
        "--loop-done-marker", str(tmp_path / "loop_done.json"),
    )  # fmt: skip
    assert marker.exists(), f"rank {KILLED_RANK} never died:\n{log[-4000:]}"
    assert killed_returncode == -9
    assert (tmp_path / "out" / "rank0.pt").exists(), "the survivor's loop did not finish"
    assert returncode == 1, log[-4000:]
    assert exited - json.loads(marker.read_text())["time"] < EXIT_DEADLINE_S, log[-4000:]
    assert "Async model averaging failed in its background thread" in log, log[-6000:]
    assert _STRATEGY_NOTE.search(log), log[-6000:]
    assert "Exception ignored in atexit callback" not in log, log[-6000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rank", [0, 1])
def test_an_uncaught_error_on_one_rank_ends_a_fabric_job_naming_it(tmp_path, rank):
    # The other rank waits for this one in the backward's all-reduce; Fabric sees no exception until it ends the script.
    result = run_job(
        "lightning",
        tmp_path,
        kill=False,
        script=SCRIPT,
        training_args=("--kill-at-step", str(KILL_AT_STEP), "--kill-rank", str(rank), "--raise-instead",
                       "--kill-marker", str(tmp_path / "death.json")),
        timeout_s=180,
    )  # fmt: skip
    assert result.death_to_exit_s is not None, f"rank {rank} never raised:\n{result.output[-4000:]}"
    assert result.returncode != 0, result.output[-4000:]
    assert not result.leftover_pids, f"processes outlived the launcher: {result.leftover_pids}"
    assert result.death_to_exit_s < EXIT_DEADLINE_S, result.output[-4000:]
    assert f"ValueError: rank {rank} failed alone at step {KILL_AT_STEP}" in result.output, result.output[-6000:]
    # An uncaught error is nothing to decide on: no rank claims to have raised alone.
    assert "raised alone" not in result.output, result.output[-6000:]
    assert not (tmp_path / "out").exists(), "a rank finished although its peer failed"
