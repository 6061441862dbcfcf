"""low_rank on CUDA with NCCL (Triton codec where it imports), against the same simulation as on CPU."""

import pytest
import torch
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel, LowRankAlgorithm
from lightning_bagua.engine.communication import CommunicationCounter
from tests.distributed import run_processes
from tests.engine.algorithms.test_low_rank import (
    RANK,
    STEPS,
    assert_buckets_match,
    assert_each_bucket_matches_from_its_state,
    assert_exact_and_rank_r,
    train_with_low_rank,
)
from tests.engine.test_cuda_graphs_gpu import assert_equal_step_by_step
from tests.engine.test_data_parallel import batch_for, make_model, make_optimizer

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


GRAPHED_STEPS = 6


def train_whole_step(rank: int, world_size: int) -> dict:
    """Whole-step ``low_rank`` on GPU ``rank``: each step's reduced gradients, what it sent and its graphs."""
    device = torch.device("cuda", rank)
    counter = CommunicationCounter()
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    algorithm = LowRankAlgorithm(rank=RANK, warmup_steps=0, hierarchical=False, whole_step=True)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], algorithm, device_ids=[rank], bucket_cap_mb=0.001, communication_counter=counter
    )
    gradients, sent = [], []
    for step in range(GRAPHED_STEPS):
        inputs, targets = (t.to(device) for t in batch_for(rank, step))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        gradients.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        sent.append(counter.totals())
        optimizer.step()
    state = ddp._bagua_impl.state
    result = {
        "gradients": gradients,
        "totals": sent,
        "errors": {name: error.detach().cpu().clone() for name, error in state.memory.errors.items()},
        "graphs": state.plans.step.graphs.captured,
    }
    ddp.close()
    return result


@pytest.mark.gpu(count=2)
def test_whole_step_replayed_as_cuda_graphs_matches_it_run_eagerly_bit_for_bit():
    """Both halves of the step replayed from graphs give the eager run's gradients and errors exactly."""
    graphed = run_processes(train_whole_step, 2, backend="nccl")
    eager = run_processes(train_whole_step, 2, env={"BAGUA_CUDA_GRAPHS": "0"}, backend="nccl")
    # The rebuilt buckets' plan runs its halves eagerly twice, then captures both.
    assert graphed[0]["graphs"] == 2
    assert eager[0]["graphs"] == 0
    assert_equal_step_by_step(graphed, eager, "gradients")
    for rank in range(2):
        assert graphed[rank]["totals"] == eager[rank]["totals"]
        for name, error in graphed[rank]["errors"].items():
            torch.testing.assert_close(error, eager[rank]["errors"][name], rtol=0, atol=0)
    # The ranks' batches differ: equal gradients on both say the replays exchanged the factors.
    for first, second in zip(graphed[0]["gradients"][-1], graphed[1]["gradients"][-1], strict=True):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
