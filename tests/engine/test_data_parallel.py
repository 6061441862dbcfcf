"""BaguaDistributedDataParallel with gradient_allreduce on real Gloo processes, against single-process references."""

import contextlib
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, GradientAllReduceAlgorithm
from lightning_bagua.engine.data_parallel import default_bucket_cap_mb
from tests.distributed import assert_ranks_identical, run_processes

STEPS = 4
BATCH = 8
FEATURES = 16
# fp32 sums taken in another order (ring all-reduce vs one big batch) differ by a few ulps per step.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    # Two linears of different sizes and a small bucket cap give several buckets, so ordering across buckets
    # and overlap with backward are exercised.
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_distributed(rank: int, world_size: int, algorithm_kwargs: dict, ranks_per_node: int | None) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(
        model,
        optimizers=[optimizer],
        algorithm=GradientAllReduceAlgorithm(**algorithm_kwargs),
        ranks_per_node=ranks_per_node,
        bucket_cap_mb=0.004,
    )
    buckets = None
    for step in range(STEPS):
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        buckets = buckets or ddp._get_ddp_logging_data().get("num_buckets_reduced")
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "bytes_by_op": ddp.communication_counter.bytes_by_op,
        "calls": ddp.communication_counter.calls,
        "hierarchical": ddp.communication_groups.is_hierarchical,
        "buckets": buckets,
    }
    ddp.close()
    return result


def train_reference(world_size: int, average: bool = True) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        batches = [batch_for(rank, step) for rank in range(world_size)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        # The mean over the concatenated batch is the average of the ranks' means; the sum is n times it.
        (loss if average else loss * world_size).backward()
        optimizer.step()
    return model.state_dict()


def param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in make_model().parameters())


@pytest.mark.parametrize("world_size", [2, 4])
def test_flat_matches_single_process_on_concatenated_batches(world_size):
    results = run_processes(train_distributed, world_size, {}, None)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], train_reference(world_size), **TOLERANCE)
    for result in results:
        # Evidence that the engine's own hook did the communicating: every gradient byte, every step, through it.
        assert result["bytes_by_op"] == {"all_reduce": STEPS * param_bytes()}
        # DDP's first step runs as one bucket; after it rebuilds buckets, the small cap gives several per step.
        assert result["calls"]["all_reduce"] > STEPS, "expected several buckets per step"


def test_sum_instead_of_average_proves_the_algorithm_ran():
    # Stock DDP always averages; a sum can only come from our hook.
    results = run_processes(train_distributed, 2, {"average": False}, None)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], train_reference(2, average=False), **TOLERANCE)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(results[0]["state"], train_reference(2, average=True), **TOLERANCE)


def test_hierarchical_two_nodes_of_two_matches_flat_and_reference():
    hierarchical = run_processes(train_distributed, 4, {"hierarchical": True}, 2)
    flat = run_processes(train_distributed, 4, {"hierarchical": False}, 2)
    assert_ranks_identical(hierarchical)
    torch.testing.assert_close(hierarchical[0]["state"], flat[0]["state"], **TOLERANCE)
    torch.testing.assert_close(hierarchical[0]["state"], train_reference(4), **TOLERANCE)
    total = STEPS * param_bytes()
    for rank, result in enumerate(hierarchical):
        assert result["hierarchical"]
        # Every rank takes part in the intra-node reduce and broadcast; only leaders (0 and 2) go between nodes.
        expected = {"reduce": total, "broadcast": total}
        if rank % 2 == 0:
            expected["all_reduce"] = total
        assert result["bytes_by_op"] == expected, f"rank {rank}"


def test_hierarchical_reads_local_world_size_from_the_environment():
    results = run_processes(train_distributed, 4, {"hierarchical": True}, None, env={"LOCAL_WORLD_SIZE": "2"})
    assert all(result["hierarchical"] for result in results)
    torch.testing.assert_close(results[0]["state"], train_reference(4), **TOLERANCE)


def test_hierarchical_on_one_node_degenerates_to_flat():
    results = run_processes(train_distributed, 2, {"hierarchical": True}, None)
    assert not any(result["hierarchical"] for result in results)
    assert results[0]["bytes_by_op"] == {"all_reduce": STEPS * param_bytes()}
    torch.testing.assert_close(results[0]["state"], train_reference(2), **TOLERANCE)


def accumulate_with_no_sync(rank: int, world_size: int, accumulate: int) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(model, optimizers=[optimizer])
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulate):
            inputs, targets = batch_for(rank, step * accumulate + micro)
            # DDP decides at forward time whether the backward communicates, so no_sync covers both.
            context = ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with context:
                (nn.functional.mse_loss(ddp(inputs), targets) / accumulate).backward()
        optimizer.step()
    result = {"state": model.state_dict(), "calls": ddp.communication_counter.calls}
    ddp.close()
    return result


def test_no_sync_accumulates_locally_and_communicates_once_per_step():
    accumulate = 3
    results = run_processes(accumulate_with_no_sync, 2, accumulate)
    assert_ranks_identical(results)
    assert results[0]["calls"] == {"all_reduce": STEPS}  # one bucket, only on the last micro-batch

    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulate):
            batches = [batch_for(rank, step * accumulate + micro) for rank in range(2)]
            inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            (nn.functional.mse_loss(model(inputs), targets) / accumulate).backward()
        optimizer.step()
    torch.testing.assert_close(results[0]["state"], model.state_dict(), **TOLERANCE)


def train_with_ignored_parameter(rank: int, world_size: int, attribute: str) -> dict:
    model = make_model()
    setattr(model, attribute, ["4.bias"])
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(model, optimizers=[optimizer])
    inputs, targets = batch_for(rank, 0)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    result = {name: p.grad.clone() for name, p in model.named_parameters()}
    ddp.close()
    return result


@pytest.mark.parametrize("attribute", ["_bagua_params_and_buffers_to_ignore", "_ddp_params_and_buffers_to_ignore"])
def test_ignored_parameters_keep_local_gradients(attribute):
    results = run_processes(train_with_ignored_parameter, 2, attribute)
    # Synchronised parameters agree; the ignored bias keeps each rank's own gradient.
    torch.testing.assert_close(results[0]["0.weight"], results[1]["0.weight"], rtol=0, atol=0)
    assert not torch.allclose(results[0]["4.bias"], results[1]["4.bias"])


def wrap_and_report(rank: int, world_size: int) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(model, [optimizer], "gradient_allreduce", bagua_module_name="net")
    result = {
        "algorithm": repr(ddp.bagua_algorithm),
        "optimizers": ddp.bagua_optimizers == [optimizer],
        "name": ddp.bagua_module_name,
        "require_sync": ddp.require_backward_grad_sync,
        "module_is_model": ddp.module is model,
    }
    ddp.close()
    ddp.close()  # idempotent
    return result


def test_bagua_attributes_users_relied_on():
    result = run_processes(wrap_and_report, 2)[0]
    assert result == {
        "algorithm": "GradientAllReduceAlgorithm(hierarchical=False, average=True)",
        "optimizers": True,
        "name": "net",
        "require_sync": True,
        "module_is_model": True,
    }


@pytest.mark.parametrize(
    ("device", "variable", "expected"),
    [
        (torch.device("cpu"), None, 10.0),
        (None, None, 10.0),
        (torch.device("cuda", 0), None, 100.0),  # only the device's type is read: no GPU needed
        (torch.device("cuda", 0), "4194304", 4.0),
        (torch.device("cpu"), "4194304", 4.0),
    ],
)
def test_default_bucket_size_is_100_mib_on_cuda_and_baguas_elsewhere_unless_the_launcher_sets_it(
    monkeypatch, device, variable, expected
):
    if variable is None:
        monkeypatch.delenv("BAGUA_DEFAULT_BUCKET_SIZE", raising=False)
    else:
        monkeypatch.setenv("BAGUA_DEFAULT_BUCKET_SIZE", variable)
    assert default_bucket_cap_mb(device) == expected


def test_a_cpu_wrapper_without_a_bucket_size_reduces_in_10_mib_buckets(monkeypatch):
    monkeypatch.delenv("BAGUA_DEFAULT_BUCKET_SIZE", raising=False)
    result = run_processes(report_default_bucket, 2)[0]
    assert result == {"bucket_cap_mb": 10.0, "reducer_bucket_bytes": 10 * 1024**2}


def report_default_bucket(rank: int, world_size: int) -> dict:
    ddp = BaguaDistributedDataParallel(make_model())
    result = {"bucket_cap_mb": ddp.bucket_cap_mb, "reducer_bucket_bytes": ddp.bucket_bytes_cap}
    ddp.close()
    return result


def backward_without_a_peer(rank: int, world_size: int, algorithm: str, hierarchical: bool, marks: Path) -> dict:
    from datetime import timedelta

    model = make_model()
    ddp = BaguaDistributedDataParallel(
        model,
        algorithm=Algorithm.init(algorithm, hierarchical=hierarchical),
        ranks_per_node=2 if hierarchical else None,
        timeout=timedelta(seconds=3),
    )
    inputs, targets = batch_for(rank, 0)
    outcome = {"raised": None}
    if rank != world_size - 1:  # the last rank never joins the backward's collectives
        start = time.monotonic()
        try:
            nn.functional.mse_loss(ddp(inputs), targets).backward()
        except RuntimeError as error:
            outcome = {"raised": str(error), "seconds": time.monotonic() - start}
        (marks / str(rank)).touch()
    else:
        # Alive but silent until every other rank has failed (a rank that exited would fail them differently).
        deadline = time.monotonic() + 60
        while len(list(marks.iterdir())) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    ddp.close()
    return outcome


@pytest.mark.parametrize(
    ("algorithm", "world_size", "hierarchical"),
    [
        ("gradient_allreduce", 2, False),
        ("gradient_allreduce", 4, True),
        # On CPU bytegrad exchanges point to point (receives posted first): those waits time out too.
        ("bytegrad", 2, False),
        ("bytegrad", 4, False),
    ],
)
def test_a_missing_peer_fails_the_backward_within_the_timeout(tmp_path, algorithm, world_size, hierarchical):
    results = run_processes(backward_without_a_peer, world_size, algorithm, hierarchical, tmp_path)
    # Hierarchical: rank 2 waits on rank 3 inside its node, rank 0 on rank 2 among leaders, rank 1 on rank 0.
    for rank, outcome in enumerate(results[:-1]):
        assert outcome["raised"] is not None, f"rank {rank}: the backward should fail, not hang"
        assert outcome["seconds"] < 30, f"rank {rank}"
