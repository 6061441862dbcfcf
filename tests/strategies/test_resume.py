"""Exact resume: a run checkpointed after one epoch and resumed in new processes ends where an uninterrupted run ends.

``resume_script.py`` runs every case in one torchrun job per phase (the uninterrupted fit, which also writes the
checkpoints, then the resumed fit in new processes). Every algorithm here is deterministic on CPU with Gloo (two
ranks sum in a fixed order, the 8-bit codec rounds deterministically), so weights and algorithm states must match
bit for bit: ``rtol=0, atol=0``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_bagua.strategies.bagua import _average_state_dicts, _read_rank_state
from tests.distributed import free_port
from tests.strategies.resume_script import BATCHES_PER_EPOCH, CASES, EPOCHS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("resume_script.py")
EXACT = {"rtol": 0, "atol": 0}
WORLD_SIZE = 2


def _run_phase(out: Path, phase: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE),
        "--master-port", str(free_port()), str(SCRIPT), "--out", str(out), "--phase", phase,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    _run_phase(out, "full")
    _run_phase(out, "resume")
    return out


def _load(out: Path, case: str, phase: str, rank: int) -> dict:
    return torch.load(out / case / f"{phase}_rank{rank}.pt", weights_only=False)


@pytest.mark.timeout(320)
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_ends_where_the_uninterrupted_run_ends(runs, case):
    for rank in range(WORLD_SIZE):
        full, resumed = _load(runs, case, "full", rank), _load(runs, case, "resume", rank)
        assert full["global_step"] == resumed["global_step"] == EPOCHS * BATCHES_PER_EPOCH
        torch.testing.assert_close(resumed["state"], full["state"], **EXACT)
        assert resumed["algorithm_state"]["algorithm"] == full["algorithm_state"]["algorithm"] == CASES[case][0]
        torch.testing.assert_close(resumed["algorithm_state"]["state"], full["algorithm_state"]["state"], **EXACT)


@pytest.mark.timeout(320)
def test_decentralized_ranks_differ_so_each_resumes_its_own_weights(runs):
    # Otherwise the test above could pass with every rank resuming rank 0's weights.
    for case in ("decentralized_all", "decentralized_shift_one", "low_precision_decentralized"):
        states = [_load(runs, case, "full", rank)["state"] for rank in range(WORLD_SIZE)]
        assert any(not torch.equal(states[0][key], states[1][key]) for key in states[0]), case


@pytest.mark.timeout(320)
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_contents(runs, case):
    algorithm, _, _, averaged = CASES[case]
    checkpoint = torch.load(runs / case / "epoch=0.ckpt", weights_only=False)
    saved = checkpoint["bagua"]
    assert saved["algorithm"] == algorithm
    assert saved["world_size"] == WORLD_SIZE
    assert len(saved["algorithm_states"]) == WORLD_SIZE
    per_rank = algorithm in ("decentralized", "low_precision_decentralized")
    if not per_rank:
        assert saved["ranks"] is None
        assert saved["averaged"] is False
        return
    assert len(saved["ranks"]) == WORLD_SIZE
    rank_states = [rank["state_dict"] for rank in saved["ranks"]]
    expected = _average_state_dicts(rank_states) if averaged else rank_states[0]
    torch.testing.assert_close(checkpoint["state_dict"], expected, **EXACT)
    assert saved["averaged"] is averaged
    if averaged:
        mean = (rank_states[0]["net.0.weight"] + rank_states[1]["net.0.weight"]) / 2
        torch.testing.assert_close(checkpoint["state_dict"]["net.0.weight"], mean, **EXACT)
        # trainer.validate(ckpt_path=...) on every rank evaluates that average, not the rank's own weights.
        for rank in range(WORLD_SIZE):
            validated = _load(runs, case, "resume", rank)["validated_state"]
            torch.testing.assert_close(validated, checkpoint["state_dict"], **EXACT)
    if algorithm == "low_precision_decentralized":
        for rank_state in saved["algorithm_states"]:
            assert {"w", "left", "right"} == set(rank_state["state"]["copies"][0])


def _saved(algorithm: str = "decentralized", world_size: int = 2) -> dict:
    return {
        "version": 1,
        "algorithm": algorithm,
        "world_size": world_size,
        "algorithm_states": [{"algorithm": algorithm, "state": {}}] * world_size,
        "ranks": None,
        "averaged": False,
    }


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("saved", "message"),
    [
        (_saved(world_size=4), "holds the algorithm state of 4 processes, but this run has 2. Resume with 4"),
        (_saved(algorithm="bytegrad"), "written while training with the 'bytegrad' algorithm, but this strategy"),
        ({**_saved(), "version": 7}, "has version 7; this release reads version 1"),
    ],
)
def test_a_checkpoint_that_cannot_resume_this_run_is_refused(saved, message):
    with pytest.raises(ValueError, match=message):
        _read_rank_state(saved, "decentralized", 2, 0)
