"""Exact resume: a run checkpointed after one epoch and resumed in new processes ends where an uninterrupted run ends.

``resume_script.py`` runs every case in one torchrun job per phase (the uninterrupted fit, which also writes the
checkpoints, then the resumed fit in new processes). Every algorithm here is deterministic on CPU with Gloo (two
ranks sum in a fixed order, the 8-bit codec rounds deterministically), so weights and algorithm states must match
bit for bit: ``rtol=0, atol=0``.
"""

from pathlib import Path

import pytest
import torch

from lightning_bagua.strategies._core.checkpoint import average_state_dicts, module_entries, rank_resume
from tests.distributed import run_torchrun
from tests.strategies.scripts.resume_script import BATCHES_PER_EPOCH, CASES, EPOCHS

SCRIPT = Path(__file__).parent / "scripts" / "resume_script.py"
EXACT = {"rtol": 0, "atol": 0}
WORLD_SIZE = 2


def _run_phase(out: Path, phase: str) -> None:
    run_torchrun(SCRIPT, "--out", str(out), "--phase", phase, nproc=WORLD_SIZE, timeout=150)


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
        torch.testing.assert_close(resumed["next_draws"], full["next_draws"], **EXACT)


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
    assert checkpoint["bagua"]["version"] == 2
    assert checkpoint["bagua"]["world_size"] == WORLD_SIZE
    saved = checkpoint["bagua"]["modules"]["model"]
    assert saved["algorithm"] == algorithm
    assert len(saved["algorithm_states"]) == WORLD_SIZE
    per_rank = algorithm in ("decentralized", "low_precision_decentralized")
    if not per_rank:
        assert saved["ranks"] is None
        assert saved["averaged"] is False
        return
    assert len(saved["ranks"]) == WORLD_SIZE
    rank_states = [rank["state_dict"] for rank in saved["ranks"]]
    expected = average_state_dicts(rank_states) if averaged else rank_states[0]
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


def _version_1(algorithm: str = "decentralized", world_size: int = 2, per_rank: bool = True) -> dict:
    """A Trainer checkpoint's "bagua" entry as releases before checkpoint version 2 wrote it."""
    ranks = [{"state_dict": {"w": torch.full((1,), float(r))}, "optimizer_states": [r]} for r in range(world_size)]
    return {
        "version": 1,
        "algorithm": algorithm,
        "world_size": world_size,
        "algorithm_states": [{"algorithm": algorithm, "state": {"rank": r}} for r in range(world_size)],
        "ranks": ranks if per_rank else None,
        "averaged": False,
    }


def _resume(saved: dict, algorithm: str = "decentralized", world_size: int = 2, rank: int = 0):
    _, modules = module_entries({"bagua": saved}, "model")
    return rank_resume(modules["model"], "model", algorithm, world_size, rank)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("saved", "message"),
    [
        (_version_1(algorithm="bytegrad"), "training 'model' with the 'bytegrad' algorithm, but this strategy"),
        ({**_version_1(), "version": 7}, "has version 7; this release reads versions 1 and 2"),
    ],
)
def test_a_checkpoint_that_cannot_resume_this_run_is_refused(saved, message):
    with pytest.raises(ValueError, match=message):
        _resume(saved)


@pytest.mark.timeout(10)
def test_a_version_1_checkpoint_resumes_each_rank_from_its_own_part():
    for rank in range(2):
        resume = _resume(_version_1(), rank=rank)
        assert resume.algorithm_state == {"algorithm": "decentralized", "state": {"rank": rank}}
        torch.testing.assert_close(resume.state_dict["w"], torch.full((1,), float(rank)), **EXACT)
        assert resume.optimizer_states == [rank]


@pytest.mark.timeout(10)
def test_per_rank_weights_resume_on_another_number_of_processes_from_their_average():
    # Four ranks saved weights 0..3 and optimizer states [0]..[3]; two resume, each from their mean.
    for rank in range(2):
        resume = _resume(_version_1(world_size=4), rank=rank)
        torch.testing.assert_close(resume.state_dict["w"], torch.full((1,), 1.5), **EXACT)
        assert resume.optimizer_states == [0]  # not a tensor: rank 0's
        assert resume.resized_from == _version_1(world_size=4)["algorithm_states"]


@pytest.mark.timeout(10)
def test_a_stateless_checkpoint_resumes_on_another_number_of_processes():
    # Nothing per rank to lose: every rank takes rank 0's entry (its bucket layout names parameters only).
    saved = _version_1(algorithm="gradient_allreduce", world_size=4, per_rank=False)
    for state in saved["algorithm_states"]:
        state["state"] = {}
    resume = _resume(saved, algorithm="gradient_allreduce", rank=1)
    assert resume.algorithm_state == saved["algorithm_states"][0]
    assert resume.state_dict is None


@pytest.mark.timeout(10)
def test_fabric_checkpoints_before_version_2_still_load():
    legacy = {"model": [{"algorithm": "bytegrad", "state": {}, "bucket_layout": [["w"]]}] * 2}
    checkpoint = {"model": {}, "bagua_algorithm_state": legacy}
    world_size, modules = module_entries(checkpoint, "model")
    assert "bagua_algorithm_state" not in checkpoint  # taken out, so that Fabric does not hand it back
    assert world_size == 2
    assert modules["model"] == {
        "algorithm": "bytegrad",
        "algorithm_states": legacy["model"],
        "ranks": None,
        "averaged": False,
    }


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key", ["bagua_algorithm_state", "bagua"])
def test_fabric_version_2_entries_load_under_the_documented_key_and_the_earlier_one(key):
    # The Fabric strategy writes its entry under "bagua_algorithm_state"; earlier 0.2.0 builds wrote it under "bagua".
    module = {"algorithm": "decentralized", "algorithm_states": [{"state": {"rounds": 1}}] * 2, "ranks": None}
    entry = {"version": 2, "world_size": 2, "modules": {"model": {**module, "averaged": False}}}
    checkpoint = {"model": {}, key: entry}
    world_size, modules = module_entries(checkpoint, "model")
    assert "bagua_algorithm_state" not in checkpoint
    assert world_size == 2
    assert modules["model"]["algorithm_states"] == module["algorithm_states"]
