"""Resume a 2-process checkpoint on 1, 3 and 4 processes, for ``ddp`` and every algorithm.

``resize_script.py`` fits every case on 2 processes (one torchrun job), then resumes every case on each new size
(one job per size). A synchronous algorithm's resumed run ends where a run at the new size from the same weights
and optimizer state ends; the others start from the state their documented rule gives.
"""

from pathlib import Path

import pytest
import torch

from lightning_bagua.strategies._core.checkpoint import average_state_dicts
from tests.distributed import run_torchrun
from tests.strategies.scripts.resize_script import BATCHES_PER_EPOCH, CASES, EPOCHS, SYNCHRONOUS

SCRIPT = Path(__file__).parent / "scripts" / "resize_script.py"
SIZES = (1, 3, 4)
SAVED = 2
# The same math from the same state; only the order of a few float sums may differ: the resumed run's first bucket
# is the saved layout, the reference's torch's own, so a value sits elsewhere in the buffer that Gloo's ring cuts
# into chunks, and three or four ranks' values are added in another order.
CLOSE = {"rtol": 1e-5, "atol": 1e-6}
# bytegrad rounds each gradient to 8-bit codes: a last-bit difference in the 3- and 4-rank sums (seen: 3e-8) can move
# a value across a code boundary, one code step of the gradient's range, which the next steps carry on.
CODEC = {"rtol": 0, "atol": 5e-3}
EXACT = {"rtol": 0, "atol": 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resize")
    run_torchrun(SCRIPT, "--out", str(out), "--phase", "save", nproc=SAVED, timeout=240)
    for size in SIZES:
        run_torchrun(SCRIPT, "--out", str(out), "--phase", "resume", nproc=size, timeout=400)
    return out


def _resumed(out: Path, size: int) -> list[dict]:
    return [torch.load(out / f"resumed_{size}_rank{rank}.pt", weights_only=False) for rank in range(size)]


def _checkpoint(out: Path, case: str) -> dict:
    return torch.load(out / case / "last.ckpt", weights_only=False)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_case_resumes_on_another_number_of_processes_and_finishes(runs, case, size):
    for result in _resumed(runs, size):
        assert result[case]["global_step"] == EPOCHS * BATCHES_PER_EPOCH


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", SYNCHRONOUS)
def test_a_resized_synchronous_run_ends_where_a_run_at_the_new_size_from_the_same_state_ends(runs, case, size):
    for rank, result in enumerate(_resumed(runs, size)):
        tolerance = CODEC if case == "bytegrad" else CLOSE
        torch.testing.assert_close(
            result[case]["final"], result[case]["reference_final"], **tolerance, msg=f"rank {rank}"
        )


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", ["decentralized", "low_precision_decentralized", "async"])
def test_differing_replicas_resume_from_their_average(runs, case, size):
    saved = _checkpoint(runs, case)["bagua"]["modules"]["model"]
    rank_weights = [rank["state_dict"] for rank in saved["ranks"]]
    assert any(not torch.equal(rank_weights[0][key], rank_weights[1][key]) for key in rank_weights[0])
    average = average_state_dicts(rank_weights)
    states = [state["state"] for state in saved["algorithm_states"]]
    for result in _resumed(runs, size):
        torch.testing.assert_close(result[case]["weights"], average, **EXACT)
        resumed = result[case]["algorithm_state"]["state"]
        if case == "decentralized":
            assert resumed == states[0]
        elif case == "low_precision_decentralized":
            assert resumed["forward_passes"] == states[0]["forward_passes"]
        else:
            assert resumed == {key: max(state[key] for state in states) for key in ("forward_passes", "rounds")}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
def test_diloco_keeps_its_outer_weights_and_resumes_its_replicas_from_their_average(runs, size):
    saved = _checkpoint(runs, "diloco")["bagua"]["modules"]["model"]
    rank_weights = [rank["state_dict"] for rank in saved["ranks"]]
    assert any(not torch.equal(rank_weights[0][key], rank_weights[1][key]) for key in rank_weights[0])
    states = [state["state"] for state in saved["algorithm_states"]]
    torch.testing.assert_close(states[0]["outer"], states[1]["outer"], **EXACT)  # θ_outer is shared
    for result in _resumed(runs, size):
        torch.testing.assert_close(result["diloco"]["weights"], average_state_dicts(rank_weights), **EXACT)
        resumed = result["diloco"]["algorithm_state"]["state"]
        assert resumed["steps"] == states[0]["steps"]
        torch.testing.assert_close(resumed["outer"], states[0]["outer"], **EXACT)
        torch.testing.assert_close(resumed["outer_optimizers"], states[0]["outer_optimizers"], **EXACT)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
def test_auto_decides_again_on_another_number_of_processes(runs, size):
    saved = [state["state"] for state in _checkpoint(runs, "auto")["bagua"]["modules"]["model"]["algorithm_states"]]
    assert saved[0]["decision"]["label"] == "low_rank(rank=16, hierarchical=False)"
    assert saved[0]["layout"] == [1, 2]
    for result in _resumed(runs, size):
        # The saved pick is dropped where the layout changed: auto starts measuring again (four steps are too few to
        # finish on several ranks), and one process runs gradient_allreduce at once.
        start = result["auto"]["algorithm_state"]["state"]
        assert start["layout"] == [1, size]
        pick = result["auto"]["auto_pick"]
        if size == 1:
            assert pick is not None
            assert pick["algorithm"] == "gradient_allreduce"
            assert pick["layout"] == [1, 1]
        else:
            assert start["decision"] is None
            assert pick is None or pick["layout"] == [1, size]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
def test_low_rank_keeps_its_factors_and_the_sum_of_its_residuals(runs, size):
    saved = [state["state"] for state in _checkpoint(runs, "low_rank")["bagua"]["modules"]["model"]["algorithm_states"]]
    assert saved[0]["errors"]  # past the warm-up: there is a residual to keep
    resumed = [result["low_rank"]["algorithm_state"]["state"] for result in _resumed(runs, size)]
    for name in saved[0]["errors"]:
        total = sum(state["errors"][name] for state in saved)
        torch.testing.assert_close(sum(state["errors"][name] for state in resumed), total, **CLOSE)
    for state in resumed:
        assert state["steps"] == saved[0]["steps"]
        torch.testing.assert_close(state["factors"], saved[0]["factors"], **EXACT)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("size", SIZES)
def test_fabric_load_resizes_by_the_same_rules(runs, size):
    entry = torch.load(runs / "fabric_decentralized.ckpt", weights_only=False)["bagua_algorithm_state"]
    rank_weights = [rank["state_dict"] for rank in entry["modules"]["model"]["ranks"]]
    assert any(not torch.equal(rank_weights[0][key], rank_weights[1][key]) for key in rank_weights[0])
    entry = torch.load(runs / "fabric_low_rank.ckpt", weights_only=False)["bagua_algorithm_state"]
    saved = [state["state"] for state in entry["modules"]["model"]["algorithm_states"]]
    assert saved[0]["errors"]
    results = _resumed(runs, size)
    for result in results:
        torch.testing.assert_close(
            result["fabric_decentralized"]["weights"], average_state_dicts(rank_weights), **EXACT
        )
    resumed = [result["fabric_low_rank"]["algorithm_state"]["state"] for result in results]
    for name in saved[0]["errors"]:
        total = sum(state["errors"][name] for state in saved)
        torch.testing.assert_close(sum(state["errors"][name] for state in resumed), total, **CLOSE)
