"""Elastic membership: ``torchrun --nnodes=1:2`` on two network namespaces loses a node and gets it back.

Each namespace is a node with an address of its own (``tests/test_multinode.py``'s ``two_hosts``); node A hosts the
c10d rendezvous. ``elastic_script.py`` trains each algorithm in turn; for each, the test waits for an epoch on two
nodes, kills node B's whole launcher, waits for the job to go on alone from the last checkpoint, starts B again, and
waits for the job to grow back. Every wait has a deadline, and every process is killed at the end.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import _process_tree
from tests.strategies.scripts.elastic_script import ALGORITHMS
from tests.strategies.test_bagua import python_path
from tests.test_launch import LAUNCH_VARIABLES
from tests.test_multinode import ROOT, on_host, two_hosts

SCRIPT = Path(__file__).parent / "strategies" / "scripts" / "elastic_script.py"
RENDEZVOUS_PORT = 29571
WAIT_S = 120


def _launch(namespace: str, interface: str, address: str, master: str, out: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update({"PYTHONPATH": python_path(), "GLOO_SOCKET_IFNAME": interface})
    # torch's agents share one TCP store across rendezvous rounds by default, and a node that led an earlier round
    # then never publishes the new round's address: a node that joins later waits for it for good.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    command = on_host(namespace, sys.executable, "-m", "torch.distributed.run")
    command += ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "8", "--monitor-interval", "0.5"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{RENDEZVOUS_PORT}", "--rdzv-id", "elastic"]
    command += ["--rdzv-conf", "join_timeout=60,last_call_timeout=2,close_timeout=10", "--local-addr", address]
    command += [str(SCRIPT), "--out", str(out)]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_epoch(
    out: Path, logs: list[Path], algorithm: str, world_size: int, after: float, checkpointed: bool = False
) -> dict:
    """Wait for an epoch of ``algorithm`` on ``world_size`` processes ended after ``after``; fail at the deadline."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for event in _events(out):
            if (
                event["kind"] == "epoch"
                and event["algorithm"] == algorithm
                and event["world_size"] == world_size
                and event["time"] > after
                and (not checkpointed or (out / algorithm / "last.ckpt").exists())
            ):
                return event
        time.sleep(0.2)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    pytest.fail(
        f"No {algorithm} epoch on {world_size} processes within {WAIT_S} s. Events: {_events(out)[-10:]}\n{tails}"
    )


def _kill(process: subprocess.Popen) -> None:
    # The whole tree, as a node's power cut would: torch's agent starts its workers in sessions of their own.
    for pid in _process_tree(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.timeout(900)
def test_the_job_shrinks_when_a_node_dies_and_grows_back_when_it_returns(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    logs = [tmp_path / "node_a.log", tmp_path / "node_b.log"]
    with two_hosts() as hosts:
        master = hosts[0][2]
        node_a = _launch(*hosts[0], master, out, logs[0])
        time.sleep(2)  # A joins first, so that it takes rank 0 (and hosts the workers' store)
        node_b = _launch(*hosts[1], master, out, logs[1])
        try:
            for algorithm in ALGORITHMS:
                # After a checkpoint of this algorithm exists: the job must go on from it, not from the start.
                both = _wait_for_epoch(out, logs, algorithm, world_size=2, after=0.0, checkpointed=True)
                _kill(node_b)
                alone = _wait_for_epoch(out, logs, algorithm, world_size=1, after=both["time"])
                node_b = _launch(*hosts[1], master, out, logs[1])
                _wait_for_epoch(out, logs, algorithm, world_size=2, after=alone["time"])
                (out / algorithm / "stop").touch()
            for process in (node_a, node_b):
                process.wait(timeout=WAIT_S)
        finally:
            for process in (node_a, node_b):
                _kill(process)
    output = logs[0].read_text()
    assert node_a.returncode == 0, output[-6000:]
    assert node_b.returncode == 0, logs[1].read_text()[-6000:]
    for algorithm in ALGORITHMS:
        # A message at each change, and each resume starts from the epoch after the last checkpoint.
        assert f"for the {algorithm!r} algorithm" in output
        starts = [e for e in _events(out) if e["kind"] == "start" and e["algorithm"] == algorithm]
        assert [e["world_size"] for e in starts][:3] == [2, 1, 2]
        assert all(later["epoch"] > 0 for later in starts[1:])
        # No torn checkpoint: every file the job wrote loads.
        for checkpoint in (out / algorithm).glob("*.ckpt"):
            torch.load(checkpoint, weights_only=False)
    assert "Resizing 'model' from 2 to 1 processes" in output
    assert "Resizing 'model' from 1 to 2 processes" in output
