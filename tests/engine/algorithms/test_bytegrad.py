"""bytegrad on real Gloo processes: every bucket checked against an independent simulation of the spec's math."""

import pytest
import torch
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms import bytegrad
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.test_data_parallel import STEPS, batch_for, make_model, make_optimizer, train_reference

EPS = 1e-7


def reference_quantise(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The spec's MinMaxUInt8 round trip of one chunk, in float64; also returns one quantisation level."""
    values = values.double()
    lo, hi = values.min().item(), values.max().item()
    scale = 255.0 / (hi - lo + EPS)
    upper = round(hi * scale)  # Python's round is half-to-even too
    lower = upper - 255
    codes = torch.clamp(torch.round(values * scale), max=upper) - lower
    return (codes + lower) / scale, (hi - lo) / 255.0


def simulate_scatter_gather(inputs: list[torch.Tensor], average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-6 of the spec for n ranks' buffers; returns the result and a per-element error allowance."""
    n, numel = len(inputs), inputs[0].numel()
    chunk = -(-numel // n)
    padded = [torch.cat([g.double(), g[-1:].double().expand(chunk * n - numel)]) for g in inputs]
    result, allowance = [], []
    for r in range(n):
        decoded = [reference_quantise(g[r * chunk : (r + 1) * chunk]) for g in padded]
        reduced = sum(d for d, _ in decoded)
        level_in = sum(level for _, level in decoded)
        if average:
            reduced, level_in = reduced / n, level_in / n
        final, level_out = reference_quantise(reduced)
        result.append(final)
        # One level of the final quantisation, plus one level per input where float32 and float64 round a tie
        # differently; a little more for float32 arithmetic.
        allowance.append(torch.full((chunk,), 1.01 * (level_out + level_in) + 1e-6, dtype=torch.float64))
    return torch.cat(result)[:numel], torch.cat(allowance)[:numel]


def train_with_bytegrad(rank: int, world_size: int, kwargs: dict, ranks_per_node: int | None) -> dict:
    recorded = []
    original = bytegrad.reduce_bucket

    def spy(state, buffer):
        before = buffer.detach().clone()
        after = original(state, buffer)
        recorded.append((before, after.detach().clone()))
        return after

    bytegrad.reduce_bucket = spy
    model = make_model()
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], Algorithm.init("bytegrad", **kwargs), ranks_per_node=ranks_per_node, bucket_cap_mb=0.004
    )
    bytes_per_step, buckets_per_step = [], []
    for step in range(STEPS):
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        ddp.communication_counter.reset()
        first_bucket = len(recorded)
        nn.functional.mse_loss(ddp(inputs), targets).backward()  # returns once every bucket is reduced
        optimizer.step()
        bytes_per_step.append(ddp.communication_counter.bytes_by_op)
        buckets_per_step.append([before.numel() for before, _ in recorded[first_bucket:]])
    ddp.close()
    bytegrad.reduce_bucket = original
    return {"state": model.state_dict(), "buckets": recorded, "bytes": bytes_per_step, "sizes": buckets_per_step}


def expected_bytes(bucket_sizes: list[int], n: int) -> dict[str, int]:
    codec = bytegrad.MinMaxUInt8Codec()
    all_to_all = all_gather = 0
    for numel in bucket_sizes:
        chunk = -(-numel // n)
        all_to_all += n * codec.row_bytes(chunk * n, n)
        all_gather += codec.row_bytes(chunk, 1)
    return {"all_to_all": all_to_all, "all_gather": all_gather}


@pytest.mark.parametrize(("world_size", "average"), [(2, True), (4, True), (2, False)])
def test_flat_bytegrad_matches_the_spec_bucket_by_bucket(world_size, average):
    results = run_processes(train_with_bytegrad, world_size, {"hierarchical": False, "average": average}, None)
    assert_flat_buckets_match(results, average)


def assert_flat_buckets_match(results: list[dict], average: bool) -> None:
    """Every bucket of every rank against the simulation, and every step's bytes against the theoretical count."""
    assert_ranks_identical(results)
    num_buckets = len(results[0]["buckets"])
    assert num_buckets > STEPS, "expected several buckets per step"
    for index in range(num_buckets):
        inputs = [result["buckets"][index][0] for result in results]
        expected, allowance = simulate_scatter_gather(inputs, average)
        for rank, result in enumerate(results):
            error = (result["buckets"][index][1].double() - expected).abs()
            assert (error <= allowance).all(), f"bucket {index}, rank {rank}: {(error - allowance).max().item()}"
        # Every rank decodes the same gathered bytes.
        for result in results[1:]:
            assert torch.equal(result["buckets"][index][1], results[0]["buckets"][index][1])
    # Bytes per step equal the theoretical count for the buckets that step reduced.
    for step, (counted, sizes) in enumerate(zip(results[0]["bytes"], results[0]["sizes"], strict=True)):
        assert counted == expected_bytes(sizes, len(results)), f"step {step}"


def test_bytegrad_trains_close_to_full_precision():
    results = run_processes(train_with_bytegrad, 2, {"hierarchical": False}, None)
    reference = train_reference(2)
    # Four steps of 8-bit gradients stay within a few quantisation levels of full precision.
    torch.testing.assert_close(results[0]["state"], reference, rtol=0.05, atol=0.01)


def test_hierarchical_bytegrad_on_two_nodes_of_two():
    results = run_processes(train_with_bytegrad, 4, {"hierarchical": True}, 2)
    assert_hierarchical_buckets_match(results, 2)


def assert_hierarchical_buckets_match(results: list[dict], ranks_per_node: int) -> None:
    """Node means at full precision, then the compressed scatter-gather among the leaders; bytes step by step."""
    assert_ranks_identical(results)
    num_nodes = len(results) // ranks_per_node
    for index in range(len(results[0]["buckets"])):
        inputs = [result["buckets"][index][0] for result in results]
        node_means = [
            sum(inputs[i : i + ranks_per_node]) / ranks_per_node for i in range(0, len(inputs), ranks_per_node)
        ]
        expected, allowance = simulate_scatter_gather(node_means, average=True)
        for rank, result in enumerate(results):
            error = (result["buckets"][index][1].double() - expected).abs()
            assert (error <= allowance + 1e-6).all(), f"bucket {index}, rank {rank}"
    for rank, result in enumerate(results):
        for step, (counted, sizes) in enumerate(zip(result["bytes"], result["sizes"], strict=True)):
            # Every rank reduces to and hears back from its leader at fp32; only leaders talk between nodes.
            expected_step = {"reduce": 4 * sum(sizes), "broadcast": 4 * sum(sizes)}
            if rank % ranks_per_node == 0:
                expected_step |= expected_bytes(sizes, num_nodes)
            assert counted == expected_step, f"rank {rank}, step {step}"


def test_hierarchical_bytegrad_on_one_node_is_full_precision():
    results = run_processes(train_with_bytegrad, 2, {"hierarchical": True}, None)
    assert_ranks_identical(results)
    assert all(set(step) == {"all_reduce"} for step in results[0]["bytes"])
    torch.testing.assert_close(results[0]["state"], train_reference(2), rtol=1e-5, atol=1e-6)


def test_hierarchical_bytegrad_with_one_rank_per_node_compresses_between_the_nodes():
    """Every rank leads its own node, so the whole exchange is the compressed inter-node level."""
    results = run_processes(train_with_bytegrad, 2, {"hierarchical": True}, 1)
    assert_ranks_identical(results)
    for index in range(len(results[0]["buckets"])):
        expected, allowance = simulate_scatter_gather([result["buckets"][index][0] for result in results], True)
        error = (results[0]["buckets"][index][1].double() - expected).abs()
        assert (error <= allowance).all(), f"bucket {index}"
    for step, (counted, sizes) in enumerate(zip(results[0]["bytes"], results[0]["sizes"], strict=True)):
        assert counted == expected_bytes(sizes, 2), f"step {step}"
