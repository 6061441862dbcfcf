"""Lightning's own checkpoint checks give under every Bagua algorithm what they give under ``ddp``.

Ported from Lightning's ``test_model_checkpoint_no_extraneous_invocations`` and ``test_top_k_ddp`` (Trainer) and
``test_save_filter`` (Fabric): ``ddp_parity_script.py`` runs every case in one torchrun job of two processes.
"""

import json
from pathlib import Path

import pytest

from tests.distributed import run_torchrun
from tests.strategies.scripts.ddp_parity_script import CASES, EPOCHS

SCRIPT = Path(__file__).parent / "scripts" / "ddp_parity_script.py"


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("parity")
    run_torchrun(SCRIPT, "--out", str(out), nproc=2, timeout=400)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoints_call_torch_save_on_rank_zero_only_once_each(seen, case):
    # The per-rank entries reach rank 0 as bytes and tensors, not through torch.save's pickling.
    assert [seen[rank][case]["saves"] for rank in range(2)] == [EPOCHS, 0]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_a_mocked_torch_save_breaks_nothing(seen, case):
    # Two epochs, save_top_k=2 on a logged metric: two saves, on rank 0 only.
    assert [seen[rank][case]["mocked_saves"] for rank in range(2)] == [2, 0]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_a_filter_that_keeps_nothing_writes_what_ddp_writes(seen, case):
    assert seen[0][case]["fabric_saved"] == seen[0]["ddp"]["fabric_saved"] == {"foo": "1"}
