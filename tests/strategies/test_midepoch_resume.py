"""Exact resume from a checkpoint taken in the middle of an epoch, with the user's own plain shuffled DataLoader.

``midepoch_script.py`` is the user's script of issue 34: checkpoints every few steps, ``ckpt_path="last"``. A job
whose rank 1 SIGKILLs itself mid-epoch is launched again, unchanged, and must end with the weights of an
undisturbed job, bit for bit (every algorithm here is deterministic on CPU with Gloo), having loaded exactly the
samples the undisturbed job loaded after the checkpoint and none of those before it. Lightning's own DDP, which
restarts the epoch's data from its first batch, is the control: it must not match, or the test could not fail.
"""

import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed import run_torchrun, torchrun
from tests.strategies.scripts.midepoch_script import (
    BATCH,
    BATCHES_PER_EPOCH,
    CASES,
    CHECKPOINT_EVERY,
    EPOCHS,
    KILL_AT_STEP,
)

SCRIPT = Path(__file__).parent / "scripts" / "midepoch_script.py"
WORLD_SIZE = 2
BAGUA_CASES = ["gradient_allreduce", "bytegrad", "low_rank", "gradient_allreduce_workers"]
# The last checkpoint before the kill, and where in its epoch it was taken.
RESUMED_STEP = KILL_AT_STEP // CHECKPOINT_EVERY * CHECKPOINT_EVERY
RESUMED_EPOCH, RESUMED_BATCH = divmod(RESUMED_STEP, BATCHES_PER_EPOCH)


def _launch(out: Path, cases: list[str], *args: str) -> subprocess.CompletedProcess:
    return torchrun(SCRIPT, "--out", str(out), "--cases", ",".join(cases), *args, nproc=WORLD_SIZE, timeout=150)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("undisturbed")
    run_torchrun(SCRIPT, "--out", str(out), "--cases", ",".join([*BAGUA_CASES, "ddp"]), nproc=WORLD_SIZE, timeout=200)
    return out


def _killed_and_restarted(out: Path, case: str) -> subprocess.CompletedProcess:
    killed = _launch(out, [case], "--kill-at-step", str(KILL_AT_STEP))
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert (out / case / "killed").exists(), "rank 1 was never killed"
    assert not (out / case / "rank0.pt").exists(), "the killed job finished"
    # Launched again as a restarting launcher would: the same command line.
    restarted = _launch(out, [case], "--kill-at-step", str(KILL_AT_STEP))
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-6000:]
    return restarted


def _result(out: Path, case: str, rank: int) -> dict:
    return torch.load(out / case / f"rank{rank}.pt", weights_only=False)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", BAGUA_CASES)
def test_a_job_killed_mid_epoch_resumes_to_the_undisturbed_weights(undisturbed, tmp_path, case):
    assert RESUMED_BATCH > 0, "the last checkpoint must be mid-epoch"
    restarted = _killed_and_restarted(tmp_path, case)
    output = restarted.stdout + restarted.stderr
    assert "last.ckpt" in output
    assert f"BaguaStrategy resumes epoch {RESUMED_EPOCH} at batch {RESUMED_BATCH}" in output
    for rank in range(WORLD_SIZE):
        expected, actual = _result(undisturbed, case, rank), _result(tmp_path, case, rank)
        assert actual["global_step"] == expected["global_step"] == EPOCHS * BATCHES_PER_EPOCH
        torch.testing.assert_close(actual["state"], expected["state"], rtol=0, atol=0)
        assert actual["trained"][RESUMED_EPOCH] == expected["trained"][RESUMED_EPOCH][RESUMED_BATCH * BATCH :]
        for epoch in range(RESUMED_EPOCH + 1, EPOCHS):
            assert actual["trained"][epoch] == expected["trained"][epoch]
        if CASES[case][2] == 0:
            # The skipped batches were never loaded: the sampler skips them, the loader does not iterate over them.
            assert actual["loaded"][RESUMED_EPOCH] == expected["loaded"][RESUMED_EPOCH][RESUMED_BATCH * BATCH :]


@pytest.mark.timeout(400)
def test_lightnings_ddp_restarts_the_epoch_and_does_not_match(undisturbed, tmp_path):
    # The same job under Lightning's DDP replays the epoch's first batches: without the strategy's resume, the test
    # above would fail.
    _killed_and_restarted(tmp_path, "ddp")
    expected, actual = _result(undisturbed, "ddp", 0), _result(tmp_path, "ddp", 0)
    # It trains on the epoch's remaining number of batches, taken from its start.
    remaining = (BATCHES_PER_EPOCH - RESUMED_BATCH) * BATCH
    assert actual["loaded"][RESUMED_EPOCH] == expected["loaded"][RESUMED_EPOCH][:remaining]
    difference = max((actual["state"][key] - expected["state"][key]).abs().max().item() for key in expected["state"])
    assert difference > 1e-4


FABRIC_SCRIPT = Path(__file__).parent / "scripts" / "fabric_midepoch_script.py"


def _launch_fabric(out: Path, *args: str) -> subprocess.CompletedProcess:
    return torchrun(FABRIC_SCRIPT, "--out", str(out), *args, nproc=WORLD_SIZE, timeout=150)


@pytest.mark.timeout(400)
def test_a_fabric_loop_killed_mid_epoch_resumes_to_the_undisturbed_weights(tmp_path):
    case = "gradient_allreduce"
    undisturbed = _launch_fabric(tmp_path / "undisturbed")
    assert undisturbed.returncode == 0, undisturbed.stdout[-3000:] + undisturbed.stderr[-6000:]
    killed = _launch_fabric(tmp_path / "restarted", "--kill-at-step", str(KILL_AT_STEP))
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert (tmp_path / "restarted" / case / "killed").exists(), "rank 1 was never killed"
    restarted = _launch_fabric(tmp_path / "restarted", "--kill-at-step", str(KILL_AT_STEP))
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-6000:]
    for rank in range(WORLD_SIZE):
        expected, actual = _result(tmp_path / "undisturbed", case, rank), _result(tmp_path / "restarted", case, rank)
        torch.testing.assert_close(actual["state"], expected["state"], rtol=0, atol=0)
        assert sorted(actual["loaded"]) == list(range(RESUMED_EPOCH, EPOCHS))
        assert actual["loaded"][RESUMED_EPOCH] == expected["loaded"][RESUMED_EPOCH][RESUMED_BATCH * BATCH :]
        for epoch in range(RESUMED_EPOCH + 1, EPOCHS):
            assert actual["loaded"][epoch] == expected["loaded"][epoch]
