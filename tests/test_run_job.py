"""The test helper that runs jobs: a job that hangs fails the test with the Python stacks of what it left running."""

import sys

import pytest

from tests.distributed import run_job

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
