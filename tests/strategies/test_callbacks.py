"""Lightning's own callbacks that read, copy, average or save the weights work with every algorithm, unchanged.

``callbacks_script.py`` fits every (callback set, algorithm) case in one torchrun job, then resumes the cases that
save in new processes. Resumed runs of the deterministic algorithms (all but ``async``, whose rounds land whenever
its background thread gets to them) end bit for bit where the uninterrupted runs end: ``rtol=0, atol=0``.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed import run_torchrun
from tests.strategies.scripts.callbacks_script import (
    ALGORITHMS,
    BATCHES_PER_EPOCH,
    CALLBACK_SETS,
    CASES,
    EPOCHS,
    RESUME_FROM,
    lightning_has_ema,
)

SCRIPT = Path(__file__).parent / "scripts" / "callbacks_script.py"
EXACT = {"rtol": 0, "atol": 0}
WORLD_SIZE = 2
# Ranks keep their own weights: they must differ at the end, or the run did not really train decentralized.
DIFFERENT_RANKS = ("decentralized", "low_precision_decentralized", "diloco")
# The engine operations that show each algorithm ran (Lightning gates DDP communication hooks to CUDA; the
# engine registers its own, and its counter records what they sent).
ALGORITHM_OPS = {
    "gradient_allreduce": "all_reduce",
    "bytegrad": "all_reduce",  # one node: bytegrad's hierarchical default reduces inside it at full precision
    "decentralized": "all_reduce",
    "low_precision_decentralized": "send",
    "low_rank": "all_gather",
    "qadam": "all_reduce",
    "async": "all_reduce",
    "diloco": "all_gather",
}


def _run_phase(out: Path, phase: str) -> None:
    run_torchrun(SCRIPT, "--out", str(out), "--phase", phase, nproc=WORLD_SIZE, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("callbacks")
    _run_phase(out, "full")
    _run_phase(out, "resume")
    return out


def _load(out: Path, case: str, phase: str, rank: int) -> dict:
    return torch.load(out / case / f"{phase}_rank{rank}.pt", weights_only=False)


def _ranks(out: Path, case: str, phase: str = "full") -> list[dict]:
    return [_load(out, case, phase, rank) for rank in range(WORLD_SIZE)]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", CASES)
def test_fits_and_the_algorithm_really_ran(runs, case):
    callback_set, algorithm = case.split("-")
    results = _ranks(runs, case)
    for result in results:
        # SWA adds one forward-only epoch (one more optimizer step) to recompute the batch-norm statistics.
        extra = 1 if callback_set == "swa" else 0
        assert result["global_step"] == EPOCHS * BATCHES_PER_EPOCH + extra
        assert result["bytes_by_op"].get(ALGORITHM_OPS[algorithm], 0) > 0, result["bytes_by_op"]
        assert result["algorithm_state"]["algorithm"] == algorithm
    states = [result["state"] for result in results]
    differ = any(not torch.equal(states[0][key], states[1][key]) for key in states[0])
    assert differ == (algorithm in DIFFERENT_RANKS)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_swa_set_saved_every_step_and_every_epoch_and_reported_the_lr(runs, algorithm):
    case = f"swa-{algorithm}"
    result = _load(runs, case, "full", 0)
    steps = EPOCHS * BATCHES_PER_EPOCH + 1
    assert result["step_checkpoints"] == sorted(f"step={step}.ckpt" for step in range(1, steps + 1))
    # Every epoch's checkpoint, the forward-only batch-norm epoch's included (where an exchange was in flight).
    assert sorted(path.name for path in (runs / case / "full").glob("epoch=*.ckpt")) == [
        f"epoch={epoch}.ckpt" for epoch in range(EPOCHS + 1)
    ]
    assert len(result["lrs"]) == 1
    assert next(iter(result["lrs"].values())) > 0


@pytest.mark.timeout(500)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pruning_zeroed_weights(runs, algorithm):
    for result in _ranks(runs, f"pruning-{algorithm}"):
        weights = [value for key, value in result["state"].items() if key.endswith("weight")]
        assert weights
        assert all((weight == 0).any() for weight in weights)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("callback_set", list(RESUME_FROM))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_resumed_run_ends_where_the_uninterrupted_run_ends(runs, callback_set, algorithm):
    case = f"{callback_set}-{algorithm}"
    full, resumed = _ranks(runs, case), _ranks(runs, case, "resume")
    for rank in range(WORLD_SIZE):
        assert resumed[rank]["global_step"] == full[rank]["global_step"]
        if algorithm == "async":
            continue  # not deterministic: checked below for what it guarantees
        torch.testing.assert_close(resumed[rank]["state"], full[rank]["state"], **EXACT)
        assert resumed[rank]["algorithm_state"]["algorithm"] == full[rank]["algorithm_state"]["algorithm"]
        torch.testing.assert_close(
            resumed[rank]["algorithm_state"]["state"], full[rank]["algorithm_state"]["state"], **EXACT
        )
    if algorithm == "async":
        # Fitting ends with an abort, a plain average: every rank holds the same weights.
        torch.testing.assert_close(resumed[0]["state"], resumed[1]["state"], **EXACT)


def test_the_matrix_covers_every_algorithm_and_callback_set():
    from lightning_bagua.engine import available_algorithms

    # auto runs one of these (tests/engine/algorithms/test_auto.py checks that it runs exactly its pick).
    assert sorted(ALGORITHMS) == [name for name in available_algorithms() if name != "auto"]
    assert set(CALLBACK_SETS) == ({"swa", "ema", "pruning"} if lightning_has_ema() else {"swa", "pruning"})
