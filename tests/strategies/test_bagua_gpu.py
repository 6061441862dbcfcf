"""BaguaStrategy on two GPUs with NCCL (run on the device machine; skipped elsewhere)."""

import pytest
import torch

from tests.distributed import assert_ranks_identical
from tests.strategies.test_bagua import (
    ALGORITHMS,
    MAX_STEPS,
    load_ranks,
    param_bytes,
    reference_state,
    run_script,
)

pytestmark = pytest.mark.gpu(count=2)


@pytest.mark.parametrize("strategy", ["instance", "name"])
def test_fit_fp32_on_two_gpus(tmp_path, strategy):
    run_script(tmp_path, "--accelerator", "gpu", "--devices", "2", "--strategy", strategy)
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2), rtol=1e-4, atol=1e-5)
    assert results[0]["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}
    assert results[0]["seen"]["fit_model"] == "BaguaDistributedDataParallel"


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fit_mixed_precision_on_two_gpus_matches_lightning_ddp(tmp_path, precision):
    run_script(tmp_path / "bagua", "--accelerator", "gpu", "--devices", "2", "--precision", precision)
    run_script(
        tmp_path / "ddp", "--accelerator", "gpu", "--devices", "2", "--precision", precision, "--strategy", "ddp"
    )
    results = load_ranks(tmp_path / "bagua", 2)
    assert_ranks_identical(results)
    assert results[0]["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}
    # The same precision plugin, the same gradient scaling and the same mean: only who communicates differs.
    ddp = load_ranks(tmp_path / "ddp", 1)[0]
    torch.testing.assert_close(results[0]["state"], ddp["state"], rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_on_two_gpus(tmp_path):
    run_script(tmp_path, "--accelerator", "gpu", "--devices", "2", "--sync-batchnorm")
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    # SyncBatchNorm's running statistics come from both ranks' batches, so they agree too.
    assert any("running_mean" in name for name in results[0]["state"])


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_each_algorithm_on_two_gpus_in_bf16_mixed(tmp_path, algorithm):
    kwargs, ops, _ = ALGORITHMS[algorithm]
    run_script(
        tmp_path,
        *("--accelerator", "gpu", "--devices", "2", "--precision", "bf16-mixed"),
        *("--algorithm", algorithm, "--kwargs", kwargs),
    )
    results = load_ranks(tmp_path, 2)
    assert set(results[0]["bytes_by_op"]) == ops
    for result in results:
        assert all(torch.isfinite(tensor).all() for tensor in result["state"].values())
        assert result["train_loss"] < 1.0
