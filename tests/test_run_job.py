"""The test helpers that run jobs and processes: what hangs or dies fails the test soon, saying what happened."""

import os
import sys
import time

import pytest

from tests.distributed import run_job, run_processes

CHILD = "import time\\ndef waiting_child():\\n    time.sleep(600)\\nwaiting_child()"
HANGING = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "{CHILD}"])
def waiting_parent():
    time.sleep(600)
waiting_parent()
"""


def test_a_hanging_job_fails_with_the_stacks_of_every_process_it_left():
    with pytest.raises(AssertionError) as raised:
        run_job([sys.executable, "-c", HANGING], timeout=3)
    message = str(raised.value)
    assert "timed out after 3 s; the launcher was still running" in message
    assert "waiting_parent" in message
    assert "waiting_child" in message
    assert message.count(sys.executable) >= 2  # the process listing: parent and child


def test_a_job_that_ends_returns_its_output_and_exit_status():
    completed = run_job(
        [sys.executable, "-c", "import os, sys; print(os.environ['MARK']); sys.exit(3)"], 30, {"MARK": "x"}
    )
    assert (completed.returncode, completed.stdout) == (3, "x\n")


def _rank_one_dies(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no traceback, no result: as a rank killed by the OOM killer or a segfault
    return rank


def test_a_rank_that_dies_without_a_word_fails_the_call_at_once_naming_it():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 exited with code 3 before reporting"):
        run_processes(_rank_one_dies, 2, timeout=120)
    assert time.monotonic() - started < 60  # not the timeout


def _environ(rank: int, world_size: int) -> dict[str, str | None]:
    return {"parent": os.environ.get("BAGUA_TEST_PARENT"), "given": os.environ.get("BAGUA_TEST_GIVEN")}


def test_processes_see_the_tests_environment_and_what_it_passes(monkeypatch):
    # The processes fork from a server started earlier: the environment must still be the test's at the call.
    run_processes(_environ, 1)
    monkeypatch.setenv("BAGUA_TEST_PARENT", "set after the server started")
    (seen,) = run_processes(_environ, 1, env={"BAGUA_TEST_GIVEN": "passed"})
    assert seen == {"parent": "set after the server started", "given": "passed"}
