"""The engine over NCCL on two GPUs (run on the device machine; skipped elsewhere)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel, CommunicationCounter
from lightning_bagua.engine.communication import (
    CommunicationGroups,
    NodeLayout,
    OrderedExecutor,
    all_reduce_hierarchically,
)
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.test_data_parallel import STEPS, batch_for, make_model, make_optimizer, param_bytes, train_reference

pytestmark = pytest.mark.gpu(count=2)


def train_on_gpu(rank: int, world_size: int) -> dict:
    device = torch.device("cuda", rank)
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(model, [optimizer], "gradient_allreduce", device_ids=[rank], bucket_cap_mb=0.004)
    for step in range(STEPS):
        inputs, targets = (t.to(device) for t in batch_for(rank, step))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
    result = {
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "bytes_by_op": ddp.communication_counter.bytes_by_op,
    }
    ddp.close()
    return result


def test_nccl_matches_single_process_reference():
    results = run_processes(train_on_gpu, 2, backend="nccl")
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], train_reference(2), rtol=1e-4, atol=1e-5)
    assert results[0]["bytes_by_op"] == {"all_reduce": STEPS * param_bytes()}


def two_level_on_gpu(rank: int, world_size: int) -> list[float]:
    # Two GPUs make one node of two ranks; the leaders' group then holds rank 0 alone. That still runs every
    # step of the two-level path (reduce, inter-node all-reduce, broadcast) on NCCL through the inline executor.
    intra = dist.new_group([0, 1])
    leaders = dist.new_group([0])
    groups = CommunicationGroups(
        NodeLayout(2, 2), rank, [0, 1], flat=intra, intra_node=intra, inter_node=leaders if rank == 0 else None
    )
    executor = OrderedExecutor(torch.device("cuda", rank))
    assert executor.runs_inline
    counter = CommunicationCounter()
    tensor = torch.full((1000,), float(rank + 1), device=f"cuda:{rank}")
    future = executor.submit(
        lambda: all_reduce_hierarchically(
            tensor, groups, counter, lambda t: dist.all_reduce(t, group=groups.inter_node)
        )
    )
    return future.wait().cpu().unique().tolist()


def test_two_level_path_on_nccl():
    assert run_processes(two_level_on_gpu, 2, backend="nccl") == [[3.0], [3.0]]
