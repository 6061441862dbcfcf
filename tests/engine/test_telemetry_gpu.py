"""Telemetry and autotuning over NCCL on two GPUs (run on the device machine; skipped elsewhere)."""

import pytest
import torch
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel, BucketAutotuner
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.test_data_parallel import batch_for, make_model, make_optimizer, param_bytes

pytestmark = pytest.mark.gpu(count=2)

STEPS = 6


def train_measured(rank: int, world_size: int) -> dict:
    device = torch.device("cuda", rank)
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], "gradient_allreduce", device_ids=[rank], bucket_cap_mb=0.004, telemetry=True
    )
    # Tuning over two sizes, one warm-up and one timed step each: done after 4 steps, with the real clock.
    tuner = BucketAutotuner(bucket_sizes_mb=(0.016,), warmup_steps=1, measured_steps=1)
    records = []
    for step in range(STEPS):
        ddp = tuner.step(ddp)
        inputs, targets = (t.to(device) for t in batch_for(rank, step))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        records.append(ddp.telemetry.end_step())
    result = {
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "records": records,
        "decision": tuner.decision,
    }
    ddp.close()
    return result


def test_telemetry_and_autotune_on_nccl():
    results = run_processes(train_measured, 2, backend="nccl")
    assert_ranks_identical(results)
    assert results[0]["decision"] is not None
    assert results[0]["decision"] == results[1]["decision"]
    for result in results:
        for record in result["records"]:
            assert record["bytes_sent"] == param_bytes()
            assert record["bytes_received"] == param_bytes()
            assert record["compression_ratio"] == 1.0
            # Read from CUDA events: a finite, non-negative device time.
            assert 0.0 <= record["communication_wait_s"] < 60.0
