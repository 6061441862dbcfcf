"""Bucket jobs replayed as CUDA graphs over NCCL on two GPUs (run on the device machine; skipped elsewhere)."""

import pytest
import torch
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms.bytegrad import ByteGradAlgorithm
from lightning_bagua.engine.communication import CommunicationCounter
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.test_data_parallel import batch_for, make_model, make_optimizer

pytestmark = pytest.mark.gpu(count=2)

STEPS = 6


def train_bytegrad(rank: int, world_size: int) -> dict:
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    counter = CommunicationCounter()
    ddp = BaguaDistributedDataParallel(
        model,
        [optimizer],
        ByteGradAlgorithm(hierarchical=False),
        device_ids=[rank],
        bucket_cap_mb=0.004,
        communication_counter=counter,
    )
    gradients, sent = [], []
    for step in range(STEPS):
        inputs, targets = (t.to(device) for t in batch_for(rank, step))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        gradients.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        sent.append(counter.totals())
        optimizer.step()
    result = {
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "gradients": gradients,
        "totals": sent,
        "graphs": ddp._bagua_executor.graphs.captured,
    }
    ddp.close()
    return result


def test_bytegrad_replayed_as_cuda_graphs_matches_it_run_eagerly_bit_for_bit():
    """Compression and NCCL replayed from graphs give the eager run's gradients exactly, and count the same."""
    graphed = run_processes(train_bytegrad, 2, backend="nccl")
    eager = run_processes(train_bytegrad, 2, env={"BAGUA_CUDA_GRAPHS": "0"}, backend="nccl")
    assert_ranks_identical(graphed)
    # Several buckets, each captured after its two eager calls (the buckets of the first step, before DDP's
    # reducer rebuilt them, ran once and were not); the eager run captured nothing.
    assert graphed[0]["graphs"] > 1
    assert eager[0]["graphs"] == 0
    for rank in range(2):
        for step in range(STEPS):
            for got, want in zip(graphed[rank]["gradients"][step], eager[rank]["gradients"][step], strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert graphed[rank]["totals"] == eager[rank]["totals"]
    # Unreduced gradients would differ between the ranks, whose batches differ; replays that did nothing would too.
    for step in range(STEPS):
        for first, second in zip(graphed[0]["gradients"][step], graphed[1]["gradients"][step], strict=True):
            torch.testing.assert_close(first, second, rtol=0, atol=0)
