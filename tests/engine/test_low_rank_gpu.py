"""low_rank on CUDA with NCCL (Triton codec where it imports), against the same simulation as on CPU."""

import pytest

from tests.distributed import run_processes
from tests.engine.test_low_rank import (
    RANK,
    STEPS,
    assert_buckets_match,
    assert_each_bucket_matches_from_its_state,
    assert_exact_and_rank_r,
    train_with_low_rank,
)

KWARGS = {"rank": RANK, "warmup_steps": 0, "hierarchical": False}


# On CUDA ``whole_step`` defaults to True: both paths are checked.
PATHS = pytest.mark.parametrize("whole_step", [None, False], ids=["whole_step_default", "per_bucket"])


@pytest.mark.gpu
@PATHS
def test_low_rank_on_one_gpu_matches_the_simulation(whole_step):
    """World size 1: the factors still go through the codec and the (one-row) all-gather."""
    kwargs = {**KWARGS, "whole_step": whole_step}
    results = run_processes(train_with_low_rank, 1, kwargs, None, "cuda", backend="nccl")
    assert_buckets_match(results, [[0]], average=True)
    assert results[0]["phases"] == [{"compressed": 1.0}] * STEPS


@pytest.mark.gpu(count=2)
@PATHS
def test_low_rank_on_two_gpus_matches_the_simulation(whole_step):
    """Each step from the ranks' own state: two ranks' factor sums round unlike the simulation's on CUDA."""
    kwargs = {**KWARGS, "whole_step": whole_step}
    results = run_processes(train_with_low_rank, 2, kwargs, None, "cuda", backend="nccl")
    assert_each_bucket_matches_from_its_state(results, average=True)
    assert_exact_and_rank_r(results, average=True)


@pytest.mark.gpu
def test_alternating_low_rank_on_one_gpu_matches_the_simulation():
    """One factor per step, P and Q in turn; the kept factors are checked on the device's results too."""
    results = run_processes(train_with_low_rank, 1, {**KWARGS, "alternate": True}, None, "cuda", backend="nccl")
    assert_buckets_match(results, [[0]], average=True, alternate=True)


@pytest.mark.gpu(count=2)
def test_whole_step_low_rank_on_two_gpus_as_two_nodes():
    """Two levels with one GPU per node: each rank leads its node; the intra-node reduce and broadcast are trivial."""
    kwargs = {**KWARGS, "hierarchical": True, "whole_step": True}
    results = run_processes(train_with_low_rank, 2, kwargs, 1, "cuda", backend="nccl")
    assert_each_bucket_matches_from_its_state(results, average=True)
    assert_exact_and_rank_r(results, average=True)
