"""A user's algorithm (``examples/custom_algorithm.py``: local SGD, whose ranks hold different weights between
averages) trains, checkpoints and resumes exactly under the Trainer and Fabric on 2 CPU processes.

The strategies know it only through the algorithm interface: its ``ranks_hold_different_weights`` makes every
rank's weights and optimizer state part of the checkpoint, so each rank resumes its own.
"""

from pathlib import Path

import pytest
import torch

from lightning_bagua.strategies._core.checkpoint import FABRIC_CHECKPOINT_KEY
from tests.distributed import run_torchrun
from tests.strategies.scripts.user_algorithm_script import CHECKPOINT_STEP, PERIOD, STEPS

SCRIPT = Path(__file__).parent / "scripts" / "user_algorithm_script.py"
EXACT = {"rtol": 0, "atol": 0}


def _run(out: Path, framework: str, phase: str) -> None:
    run_torchrun(SCRIPT, "--out", str(out), "--framework", framework, "--phase", phase, timeout=200)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_a_user_algorithm_resumes_each_rank_exactly(tmp_path, framework):
    _run(tmp_path, framework, "full")
    _run(tmp_path, framework, "resume")
    full = [torch.load(tmp_path / f"{framework}_full_rank{rank}.pt", weights_only=False) for rank in range(2)]
    resumed = [torch.load(tmp_path / f"{framework}_resume_rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank in range(2):
        torch.testing.assert_close(resumed[rank]["state"], full[rank]["state"], **EXACT, msg=f"rank {rank}")
    # The algorithm really ran: it all-reduced the weights (and nothing else) at every PERIOD-th step.
    weights_bytes = sum(value.numel() * value.element_size() for value in full[0]["state"].values())
    assert full[0]["bytes_by_op"] == {"all_reduce": STEPS // PERIOD * weights_bytes}
    # After the last average (step 8) the ranks trained one more step on their own data: different weights.
    assert any(not torch.equal(full[0]["state"][key], full[1]["state"][key]) for key in full[0]["state"])

    name = f"trainer-step={CHECKPOINT_STEP}.ckpt" if framework == "trainer" else "fabric.ckpt"
    # The Trainer's entry is under "bagua"; Fabric's under the documented reserved key.
    key = "bagua" if framework == "trainer" else FABRIC_CHECKPOINT_KEY
    entry = torch.load(tmp_path / name, weights_only=False)[key]
    module = entry["modules"]["model"]
    assert entry["version"] == 2
    assert module["algorithm"] == "local_sgd"
    assert [state["state"] for state in module["algorithm_states"]] == [{"steps": CHECKPOINT_STEP}] * 2
    # Saved between two averages: each rank's own weights are in the checkpoint, and they differ.
    rank_weights = [rank["state_dict"] for rank in module["ranks"]]
    assert any(not torch.equal(rank_weights[0][key], rank_weights[1][key]) for key in rank_weights[0])
