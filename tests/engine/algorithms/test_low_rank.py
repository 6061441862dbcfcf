"""low_rank on real Gloo processes: every bucket checked against an independent simulation of the hook's math."""

import contextlib
import io
import math
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, LowRankAlgorithm
from lightning_bagua.engine._executor import OrderedExecutor
from lightning_bagua.engine.algorithms.low_rank import _factors, hook
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import CommunicationCounter
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.test_data_parallel import STEPS, batch_for, make_model, make_optimizer, train_reference

RANK = 2
# make_model()'s parameters by name: (rows, cols) of the gradient reshaped to first dimension x the rest. With
# r = 2, the two larger weights factor; the 1 x 32 weight (rank 1 already) and the biases travel exactly.
SHAPES = {
    "0.weight": (64, 16),
    "0.bias": (1, 64),
    "2.weight": (32, 64),
    "2.bias": (1, 32),
    "4.weight": (1, 32),
    "4.bias": (1, 1),
}
FACTORED = {"0.weight", "2.weight"}
CODEC = MinMaxUInt8Codec()
# Quantisation levels a result may differ from the simulation by (see assert_buckets_match).
LEVELS = 8


def first_q(name: str) -> torch.Tensor:
    """The spec's first Q: standard normal m x r seeded by the CRC-32 of the shape, columns orthonormalised."""
    rows, cols = SHAPES[name]
    seed = zlib.crc32(f"{rows}x{cols}|{RANK}".encode())
    q = torch.randn(cols, RANK, generator=torch.Generator().manual_seed(seed))
    return orthonormal(q)


def orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt column by column, written out: subtract the projections, then normalise (zero stays zero)."""
    columns = []
    for j in range(matrix.shape[1]):
        column = matrix[:, j].clone()
        for previous in columns:
            column = column - torch.dot(previous, matrix[:, j]) * previous
        norm = column.norm()
        columns.append(column / norm if norm > 0 else column)
    return torch.stack(columns, dim=1)


def quantised(factor: torch.Tensor) -> torch.Tensor:
    """A factor as it arrives: its columns (k elements each) coded with one range per 1024 elements of a column."""
    k, r = factor.shape
    chunks = r * math.ceil(k / 1024)
    flat = factor.T.reshape(-1)
    return CODEC.decompress(CODEC.compress(flat, num_chunks=chunks), flat.numel(), torch.float32).view(r, k).T


def in_order_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total = total + tensor
    return total


def split_bucket(names: list[str], inputs: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Every participant's gradient of each parameter of a bucket, reshaped to its rows x cols."""
    pieces, offset = {}, 0
    for name in names:
        rows, cols = SHAPES[name]
        pieces[name] = [flat[offset : offset + rows * cols].view(rows, cols) for flat in inputs]
        offset += rows * cols
    return pieces


class Simulation:
    """The hook's steps 1-7 for N participants, with its own errors and warm-start factors per parameter."""

    def __init__(self, participants: int, average: bool) -> None:
        self.n = participants
        self.average = average
        self.errors = [{} for _ in range(participants)]
        self.q = {}

    def bucket(self, names: list[str], inputs: list[torch.Tensor]) -> torch.Tensor:
        """Reduce one bucket given every participant's flat input; returns the result every participant holds."""
        pieces = split_bucket(names, inputs)
        out = {}
        for name in names:
            grads = pieces[name]
            if name not in FACTORED:
                total = in_order_sum(grads)
                out[name] = total / self.n if self.average else total
                continue
            q = self.q.get(name, first_q(name))
            m = [g + self.errors[i].get(name, torch.zeros_like(g)) for i, g in enumerate(grads)]
            p_hat = orthonormal(in_order_sum([quantised(mi @ q) for mi in m]))
            q_sum = in_order_sum([quantised(mi.T @ p_hat) for mi in m])
            q_new = q_sum / self.n if self.average else q_sum
            g_hat = p_hat @ q_new.T
            for i in range(self.n):
                self.errors[i][name] = m[i] - g_hat
            self.q[name] = q_new
            out[name] = g_hat
        return torch.cat([out[name].reshape(-1) for name in names])


def train_with_low_rank(
    rank: int, world_size: int, kwargs: dict, ranks_per_node: int | None, device: str = "cpu"
) -> dict:
    recorded, states_before = [], []
    original = hook.reduce_bucket

    def spy(state, buffer, slots):
        before = buffer.detach().cpu().clone()
        names = {slot.name for slot in slots}
        states_before.append(
            {
                kind: to_cpu({name: tensor for name, tensor in getattr(state.memory, kind).items() if name in names})
                for kind in ("errors", "factors")
            }
        )
        after = original(state, buffer, slots)
        recorded.append(([slot.name for slot in slots], before, after.detach().cpu().clone()))
        return after

    original_add = hook.StepBatcher.add
    held: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []

    def add_spy(self, state, buffer, slots, step, last):
        """The whole-step path: each bucket's input when handed over, its result once the step's last is reduced."""
        names = {slot.name for slot in slots}
        states_before.append(
            {
                kind: to_cpu({name: tensor for name, tensor in getattr(state.memory, kind).items() if name in names})
                for kind in ("errors", "factors")
            }
        )
        held.append(([slot.name for slot in slots], buffer.detach().cpu().clone(), buffer))
        future = original_add(self, state, buffer, slots, step, last)
        if last:
            if buffer.is_cuda:
                torch.cuda.synchronize()  # the step was reduced on the executor's stream
            recorded.extend((names, before, buffer.detach().cpu().clone()) for names, before, buffer in held)
            held.clear()
        return future

    hook.reduce_bucket = spy
    hook.StepBatcher.add = add_spy
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], Algorithm.init("low_rank", **kwargs), ranks_per_node=ranks_per_node, bucket_cap_mb=0.004
    )
    counts, phases = [], []
    for step in range(STEPS):
        inputs, targets = (tensor.to(device) for tensor in batch_for(rank, step))
        optimizer.zero_grad()
        ddp.communication_counter.reset()
        first_bucket = len(recorded)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        counts.append(
            {
                "bytes": ddp.communication_counter.bytes_by_op,
                "calls": ddp.communication_counter.calls,
                "uncompressed": ddp.communication_counter.bytes_uncompressed,
                "buckets": [names for names, _, _ in recorded[first_bucket:]],
            }
        )
        phases.append(ddp.bagua_algorithm_impl.telemetry_phase())
    saved = ddp.bagua_state_dict()["state"]
    saved = {key: to_cpu(value) if isinstance(value, dict) else value for key, value in saved.items()}
    ddp.close()
    hook.reduce_bucket = original
    hook.StepBatcher.add = original_add
    return {
        "state": to_cpu(model.state_dict()),
        "buckets": recorded,
        "states_before": states_before,
        "counts": counts,
        "phases": phases,
        "saved": saved,
    }


def to_cpu(tensors: dict) -> dict:
    return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}


def message_bytes(names: list[str]) -> tuple[int, int]:
    """Bytes of the two all-gathered messages of a bucket: [exact fp32 | pad | P codes | pad] and [Q codes | pad]."""

    def codes(k: int) -> int:
        chunks = RANK * math.ceil(k / 1024)
        return chunks * (32 + math.ceil(k * RANK / chunks))

    def words(nbytes: int) -> int:
        return -(-nbytes // 8) * 8

    exact = sum(4 * SHAPES[name][0] * SHAPES[name][1] for name in names if name not in FACTORED)
    first = words(exact) + sum(codes(SHAPES[name][0]) for name in names if name in FACTORED)
    second = sum(codes(SHAPES[name][1]) for name in names if name in FACTORED)
    return words(first), words(second)


def alternating_message_bytes(names: list[str]) -> int:
    """Bytes of an alternating Q step's message: [exact fp32 | pad | Q codes | pad]."""
    exact, q_codes = message_bytes([name for name in names if name not in FACTORED])[0], message_bytes(names)[1]
    return -(-(exact + q_codes) // 8) * 8


class AlternatingSimulation:
    """``alternate=True``: one factor per step, P and Q in turn, each kept orthonormalised for the next step."""

    def __init__(self, participants: int, average: bool) -> None:
        self.n = participants
        self.average = average
        self.errors = [{} for _ in range(participants)]
        self.q = {}  # Q_hat, orthonormal: the first Q, then that of the last Q step
        self.p = {}  # P_hat of the last P step
        self.seen = {}  # compressed steps per parameter: even ones exchange P

    def bucket(self, names: list[str], inputs: list[torch.Tensor]) -> torch.Tensor:
        pieces = split_bucket(names, inputs)
        out = {}
        for name in names:
            grads = pieces[name]
            total_scale = self.n if self.average else 1
            if name not in FACTORED:
                out[name] = in_order_sum(grads) / total_scale
                continue
            m = [g + self.errors[i].get(name, torch.zeros_like(g)) for i, g in enumerate(grads)]
            step = self.seen.get(name, 0)
            self.seen[name] = step + 1
            if step % 2 == 0:
                q_hat = self.q.setdefault(name, first_q(name))
                p = in_order_sum([quantised(mi @ q_hat) for mi in m]) / total_scale
                g_hat = p @ q_hat.T
                self.p[name] = orthonormal(p)
            else:
                p_hat = self.p[name]
                q = in_order_sum([quantised(mi.T @ p_hat) for mi in m]) / total_scale
                g_hat = p_hat @ q.T
                self.q[name] = orthonormal(q)
            for i in range(self.n):
                self.errors[i][name] = m[i] - g_hat
            out[name] = g_hat
        return torch.cat([out[name].reshape(-1) for name in names])


def assert_within_levels(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """``actual`` within a few quantisation levels of ``expected`` anywhere, and within one on average.

    The simulation codes float32 factors with the same codec, but its Gram-Schmidt and sums round in their own
    order: a factor element that lands on the other side of a rounding boundary moves by one level (1/255 of its
    range), which moves G_hat by about a level of its largest value, and carries on through the error and the warm
    start. Allow a few such moves anywhere, and one level on average.
    """
    scale = expected.abs().max().item()
    difference = (actual - expected).abs()
    assert difference.max() <= LEVELS * scale / 255, f"{label}: {difference.max()}"
    assert difference.mean() <= scale / 255, f"{label}: {difference.mean()}"


def assert_buckets_match(
    results: list[dict], participants: list[list[int]], average: bool, alternate: bool = False
) -> None:
    """Every bucket of every rank against the simulation; ``participants`` groups the ranks into nodes."""
    assert_ranks_identical(results)
    simulation = (AlternatingSimulation if alternate else Simulation)(len(participants), average)
    num_buckets = len(results[0]["buckets"])
    assert num_buckets > STEPS, "expected several buckets per step"
    for index in range(num_buckets):
        names = results[0]["buckets"][index][0]
        inputs = [result["buckets"][index][1] for result in results]
        node_inputs = [in_order_sum([inputs[r] for r in node]) for node in participants]
        if average:
            node_inputs = [node_input / len(node) for node_input, node in zip(node_inputs, participants, strict=True)]
        expected = simulation.bucket(names, node_inputs)
        for rank, result in enumerate(results):
            assert_within_levels(result["buckets"][index][2], expected, f"bucket {index} rank {rank}")
            # Every participant decodes the same bytes in the same order.
            assert torch.equal(result["buckets"][index][2], results[0]["buckets"][index][2])
    # The error feedback each participant keeps (that of its node's leader, when two-level).
    for node, members in enumerate(participants):
        saved = results[members[0]]["saved"]
        assert set(saved["errors"]) == FACTORED
        for name in FACTORED:
            expected_error = simulation.errors[node][name]
            error_level = expected_error.abs().max().item() / 255
            torch.testing.assert_close(saved["errors"][name], expected_error, rtol=0, atol=LEVELS * error_level)
            factor_level = simulation.q[name].abs().max().item() / 255
            torch.testing.assert_close(saved["factors"][name], simulation.q[name], rtol=0, atol=LEVELS * factor_level)
            if alternate:
                torch.testing.assert_close(saved["left_factors"][name], simulation.p[name], rtol=0, atol=LEVELS / 255)


@pytest.mark.parametrize(("world_size", "average"), [(2, True), (4, True), (2, False)])
def test_flat_low_rank_matches_the_simulation_bucket_by_bucket(world_size, average):
    kwargs = {"rank": RANK, "warmup_steps": 0, "hierarchical": False, "average": average}
    results = run_processes(train_with_low_rank, world_size, kwargs, None)
    assert_buckets_match(results, [[rank] for rank in range(world_size)], average)
    assert_each_bucket_matches_from_its_state(results, average)
    assert_exact_and_rank_r(results, average)
    for result in results:
        for step in result["counts"]:
            # Two all-gathers per bucket that factors, one per bucket that does not; nothing else.
            two = sum(1 for names in step["buckets"] if FACTORED & set(names))
            assert step["calls"] == {"all_gather": len(step["buckets"]) + two}
            assert step["bytes"]["all_gather"] == sum(sum(message_bytes(names)) for names in step["buckets"])
            # What DDP would have sent: every gradient's fp32 bytes once.
            assert step["uncompressed"] == 4 * sum(SHAPES[name][0] * SHAPES[name][1] for name in SHAPES)
        assert result["phases"] == [{"compressed": 1.0}] * STEPS


def test_hierarchical_low_rank_on_two_nodes_of_two():
    kwargs = {"rank": RANK, "warmup_steps": 0, "hierarchical": True}
    results = run_processes(train_with_low_rank, 4, kwargs, 2)
    assert_buckets_match(results, [[0, 1], [2, 3]], average=True)
    for rank, result in enumerate(results):
        for step in result["counts"]:
            ops = set(step["calls"])
            # Full precision inside the node; only the leaders exchange factors.
            assert ops == ({"reduce", "broadcast", "all_gather"} if rank % 2 == 0 else {"reduce", "broadcast"})
        if rank % 2:
            assert result["saved"]["errors"] == {}
            assert result["saved"]["factors"] == {}


def test_warmup_is_the_exact_all_reduce_then_factors_take_over():
    results = run_processes(train_with_low_rank, 2, {"rank": RANK, "warmup_steps": STEPS, "hierarchical": False}, None)
    assert_ranks_identical(results)
    assert all(set(step["calls"]) == {"all_reduce"} for step in results[0]["counts"])
    assert results[0]["phases"] == [{"compressed": 0.0}] * STEPS
    torch.testing.assert_close(results[0]["state"], train_reference(2), rtol=1e-5, atol=1e-6)
    assert results[0]["saved"] == {"steps": STEPS, "errors": {}, "factors": {}}
    results = run_processes(train_with_low_rank, 2, {"rank": RANK, "warmup_steps": 2, "hierarchical": False}, None)
    assert [set(step["calls"]) for step in results[0]["counts"]] == [{"all_reduce"}] * 2 + [{"all_gather"}] * 2


def test_hierarchical_on_one_node_is_full_precision():
    results = run_processes(train_with_low_rank, 2, {"rank": RANK, "warmup_steps": 0}, None)
    assert_ranks_identical(results)
    assert all(set(step["calls"]) == {"all_reduce"} for step in results[0]["counts"])
    torch.testing.assert_close(results[0]["state"], train_reference(2), rtol=1e-5, atol=1e-6)


def assert_each_bucket_matches_from_its_state(results: list[dict], average: bool) -> None:
    """Flat ranks: every bucket against one simulated step that starts from the errors and ``Q`` the ranks held.

    :func:`assert_buckets_match` runs the simulation along its own trajectory, which stays close to the run's only
    where both round alike (the same CPU kernels). On CUDA, cuBLAS and the fused decoder round the factors' sums in
    another order: a code that flips by one level feeds the error, and the warm start carries it on, so the two
    trajectories part within a few steps (on two H100s: 0.1, 1 and 8 levels after steps 1, 2 and 3) while each step's
    math is right. Restarting the simulation from the run's own state at every bucket checks the math of each step.
    """
    assert_ranks_identical(results)
    for index in range(len(results[0]["buckets"])):
        simulation = Simulation(len(results), average)
        simulation.errors = [dict(result["states_before"][index]["errors"]) for result in results]
        simulation.q = dict(results[0]["states_before"][index]["factors"])
        names = results[0]["buckets"][index][0]
        expected = simulation.bucket(names, [result["buckets"][index][1] for result in results])
        assert_within_levels(results[0]["buckets"][index][2], expected, f"bucket {index}")


def assert_exact_and_rank_r(results: list[dict], average: bool) -> None:
    """Tensors that do not factor arrive as the exact fp32 mean (or sum); factored ones have rank at most r."""
    for index, (names, _, after) in enumerate(results[0]["buckets"]):
        inputs = [result["buckets"][index][1] for result in results]
        offset = 0
        for name in names:
            rows, cols = SHAPES[name]
            piece = slice(offset, offset + rows * cols)
            offset += rows * cols
            if name in FACTORED:
                assert torch.linalg.matrix_rank(after[piece].view(rows, cols)) <= RANK
            else:
                total = in_order_sum([flat[piece] for flat in inputs])
                assert torch.equal(after[piece], total / len(inputs) if average else total), name


def resume_runs(rank: int, world_size: int, cut: int, alternate: bool = False, whole_step: bool | None = None) -> dict:
    def train(model, optimizer, steps, state=None):
        algorithm = LowRankAlgorithm(
            rank=RANK, warmup_steps=1, hierarchical=False, alternate=alternate, whole_step=whole_step
        )
        ddp = BaguaDistributedDataParallel(model, [optimizer], algorithm, bucket_cap_mb=0.004)
        if state is not None:
            ddp.load_bagua_state_dict(state)
        for step in steps:
            inputs, targets = batch_for(rank, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(inputs), targets).backward()
            optimizer.step()
        saved = ddp.bagua_state_dict()
        ddp.close()
        return saved

    model = make_model()
    optimizer = make_optimizer(model)
    train(model, optimizer, range(STEPS))
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    model = make_model()
    optimizer = make_optimizer(model)
    saved = train(model, optimizer, range(cut))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "bagua": saved}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    fresh = make_model()
    with torch.no_grad():
        for param in fresh.parameters():
            param.normal_()  # so that only the checkpoint can make it right
    fresh.load_state_dict(checkpoint["model"])
    fresh_optimizer = make_optimizer(fresh)
    fresh_optimizer.load_state_dict(checkpoint["optimizer"])
    train(fresh, fresh_optimizer, range(cut, STEPS), checkpoint["bagua"])
    return {"uninterrupted": uninterrupted, "resumed": fresh.state_dict(), "saved": saved["state"]}


@pytest.mark.parametrize("whole_step", [False, True], ids=["per_bucket", "whole_step"])
def test_resume_is_bit_exact(whole_step):
    """Cut after the compressed phase began: the errors and warm-start factors carry the run on bit for bit."""
    for result in run_processes(resume_runs, 2, 3, False, whole_step):
        assert set(result["saved"]["errors"]) == FACTORED
        assert result["saved"]["steps"] == 3
        for name, tensor in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], tensor), name


@pytest.mark.parametrize("cut", [2, 3], ids=["before_a_Q_step", "before_a_P_step"])
def test_alternating_resume_is_bit_exact(cut):
    """Warm-up 1: step 1 exchanges P, step 2 Q. Either cut carries the kept P_hat and Q_hat on bit for bit."""
    for result in run_processes(resume_runs, 2, cut, True):
        assert set(result["saved"]["left_factors"]) == FACTORED
        for name, tensor in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], tensor), name


@pytest.mark.parametrize(("world_size", "average"), [(2, True), (4, True), (2, False)])
def test_whole_step_low_rank_matches_the_simulation_bucket_by_bucket(world_size, average):
    """All buckets of a step reduced together, batched by shape: each tensor's math is the per-bucket path's."""
    kwargs = {"rank": RANK, "warmup_steps": 0, "hierarchical": False, "average": average, "whole_step": True}
    results = run_processes(train_with_low_rank, world_size, kwargs, None)
    assert_buckets_match(results, [[rank] for rank in range(world_size)], average)
    assert_each_bucket_matches_from_its_state(results, average)
    assert_exact_and_rank_r(results, average)
    for result in results:
        assert max(len(step["buckets"]) for step in result["counts"]) > 1, "expected several buckets per step"
        for step in result["counts"]:
            # Two all-gathers a step, whatever the number of buckets: the messages of one bucket holding them all.
            assert step["calls"] == {"all_gather": 2}
            assert step["bytes"]["all_gather"] == sum(message_bytes(list(SHAPES)))
            assert step["uncompressed"] == 4 * sum(rows * cols for rows, cols in SHAPES.values())
        assert result["phases"] == [{"compressed": 1.0}] * STEPS


def test_whole_step_hierarchical_on_two_nodes_of_two():
    kwargs = {"rank": RANK, "warmup_steps": 0, "hierarchical": True, "whole_step": True}
    results = run_processes(train_with_low_rank, 4, kwargs, 2)
    assert_buckets_match(results, [[0, 1], [2, 3]], average=True)
    for rank, result in enumerate(results):
        for step in result["counts"]:
            buckets = len(step["buckets"])
            # Only the node leaders (local rank 0) exchange factors.
            leader = {"all_gather": 2} if rank % 2 == 0 else {}
            assert step["calls"] == {"reduce": buckets, "broadcast": buckets, **leader}


def test_whole_step_and_per_bucket_paths_train_alike():
    """The two paths code the same factors: the weights they train part by float rounding only."""
    kwargs = {"rank": RANK, "warmup_steps": 1, "hierarchical": False}
    per_bucket = run_processes(train_with_low_rank, 2, {**kwargs, "whole_step": False}, None)
    whole_step = run_processes(train_with_low_rank, 2, {**kwargs, "whole_step": True}, None)
    for name, tensor in per_bucket[0]["state"].items():
        torch.testing.assert_close(whole_step[0]["state"][name], tensor, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("world_size", "average"), [(2, True), (4, True), (2, False)])
def test_alternating_low_rank_matches_the_simulation_bucket_by_bucket(world_size, average):
    kwargs = {"rank": RANK, "warmup_steps": 0, "hierarchical": False, "average": average, "alternate": True}
    results = run_processes(train_with_low_rank, world_size, kwargs, None)
    assert_buckets_match(results, [[rank] for rank in range(world_size)], average, alternate=True)
    assert_exact_and_rank_r(results, average)
    for result in results:
        for step, counts in enumerate(result["counts"]):
            # One all-gather per bucket: [exact | P codes] on even steps, [exact | Q codes] on odd ones.
            assert counts["calls"] == {"all_gather": len(counts["buckets"])}
            sizes = [
                message_bytes(names)[0] if step % 2 == 0 else alternating_message_bytes(names)
                for names in counts["buckets"]
            ]
            assert counts["bytes"]["all_gather"] == sum(sizes)
            assert counts["uncompressed"] == 4 * sum(SHAPES[name][0] * SHAPES[name][1] for name in SHAPES)


def test_alternating_hierarchical_on_two_nodes_of_two():
    kwargs = {"rank": RANK, "warmup_steps": 0, "hierarchical": True, "alternate": True}
    results = run_processes(train_with_low_rank, 4, kwargs, 2)
    assert_buckets_match(results, [[0, 1], [2, 3]], average=True, alternate=True)


def test_low_rank_trains_close_to_full_precision():
    results = run_processes(train_with_low_rank, 2, {"rank": RANK, "warmup_steps": 1, "hierarchical": False}, None)
    # A rank-2 approximation with error feedback over a few steps stays near full precision's weights.
    torch.testing.assert_close(results[0]["state"], train_reference(2), rtol=0.05, atol=0.02)


@pytest.mark.parametrize(
    ("kwargs", "error", "shown"),
    [
        ({"rank": 0}, ValueError, "`rank` must be at least 1, got 0"),
        ({"rank": 1.5}, TypeError, "`rank` must be an int, got 1.5"),
        ({"rank": True}, TypeError, "`rank` must be an int, got True"),
        ({"warmup_steps": -1}, ValueError, "`warmup_steps` must be at least 0, got -1"),
        ({"warmup_steps": "10"}, TypeError, "`warmup_steps` must be an int, got '10'"),
        ({"hierarchical": 1}, TypeError, "`hierarchical` must be a bool"),
        ({"average": None}, TypeError, "`average` must be a bool"),
        ({"alternate": 1}, TypeError, "`alternate` must be a bool"),
        ({"whole_step": 1}, TypeError, "`whole_step` must be a bool"),
        ({"ranks": 2}, TypeError, "Unknown keyword argument(s) 'ranks'"),
    ],
)
def test_bad_keywords_name_the_value(kwargs, error, shown):
    with pytest.raises(error, match=shown.replace("(", r"\(").replace(")", r"\)")):
        Algorithm.init("low_rank", **kwargs)


def test_bad_state_names_the_keys():
    algorithm = LowRankAlgorithm(rank=RANK)
    assert repr(algorithm) == (
        "LowRankAlgorithm(rank=2, warmup_steps=10, hierarchical=True, average=True, alternate=False, whole_step=None)"
    )
    assert Algorithm.init("low_rank") == LowRankAlgorithm(
        rank=8, warmup_steps=10, hierarchical=True, average=True, alternate=False
    )
    # Checked without a process group: the impl validates against the shapes it was given.
    from lightning_bagua.engine.algorithms.base import AlgorithmContext
    from lightning_bagua.engine.communication import (
        CommunicationCounter,
        CommunicationGroups,
        NodeLayout,
        OrderedExecutor,
    )

    model = make_model()
    groups = CommunicationGroups(NodeLayout(1, 1), 0, [0], None)  # type: ignore[arg-type]
    context = AlgorithmContext(
        groups, CommunicationCounter(), OrderedExecutor(torch.device("cpu")), torch.device("cpu"),
        tuple(model.named_parameters()),
    )  # fmt: skip
    impl = algorithm.reify(context)
    good = {"steps": 3, "errors": {"0.weight": torch.zeros(64, 16)}, "factors": {"0.weight": torch.zeros(16, 2)}}
    impl.load_state_dict(good)
    assert impl.state_dict()["steps"] == 3
    with pytest.raises(ValueError, match=r"keys \['errors', 'factors', 'steps'\], got \['errors', 'steps'\]"):
        impl.load_state_dict({"steps": 3, "errors": {}})
    with pytest.raises(ValueError, match="names 'nope', which is not a communicated parameter"):
        impl.load_state_dict({**good, "errors": {"nope": torch.zeros(1)}})
    with pytest.raises(ValueError, match=r"'factors'\['0.weight'\] must be a \(16, 2\) tensor, got \(16, 1\)"):
        impl.load_state_dict({**good, "factors": {"0.weight": torch.zeros(16, 1)}})
    with pytest.raises(ValueError, match="'steps' must be at least 0"):
        impl.load_state_dict({**good, "steps": -1})


def lone_state(**fields: Any) -> hook.LowRankState:
    """A state for one participant, with no groups (the tests call the reduce functions directly)."""
    return hook.LowRankState(
        groups=None,  # type: ignore[arg-type]
        counter=CommunicationCounter(),
        executor=OrderedExecutor(torch.device("cpu")),
        rank=RANK,
        names={},
        **fields,
    )


@contextlib.contextmanager
def gather_is_a_copy() -> Iterator[None]:
    """One participant: the all-gather is a copy (world size 1 needs no process group for the exchange helpers)."""
    original = _factors.all_gather_into
    _factors.all_gather_into = lambda output, tensor, group: output.copy_(tensor.view(1, -1))
    try:
        yield
    finally:
        _factors.all_gather_into = original


def test_zero_and_non_finite_gradients_keep_the_state_finite():
    """A zero gradient stays zero (no NaN from normalising nothing); a non-finite one leaves errors and factors."""
    state = lone_state()
    slot = _factors.plan_slot("w", 0, torch.Size([64, 16]), RANK, 4, state.codec)
    assert slot.factored
    zero = torch.zeros(64 * 16)
    with gather_is_a_copy():
        hook.low_rank_reduce_(zero, [slot], None, 1, state)
        assert torch.equal(zero, torch.zeros(64 * 16))
        grad = torch.randn(64 * 16, generator=torch.Generator().manual_seed(0))
        hook.low_rank_reduce_(grad, [slot], None, 1, state)
        error, factor = state.memory.errors["w"].clone(), state.memory.factors["w"].clone()
        assert torch.isfinite(error).all()
        assert torch.isfinite(factor).all()
        bad = torch.full((64 * 16,), math.inf)
        hook.low_rank_reduce_(bad, [slot], None, 1, state)
        assert not torch.isfinite(bad).all()  # the skipped step sees a non-finite gradient
        assert torch.equal(state.memory.errors["w"], error)
        assert torch.equal(state.memory.factors["w"], factor)


def test_whole_step_zero_and_non_finite_gradients_keep_the_state_finite():
    """The whole-step path's device-side check: a non-finite step leaves every error and factor as it was."""
    state = lone_state(whole_step=True)
    slots = [
        _factors.plan_slot("w", 0, torch.Size([64, 16]), RANK, 4, state.codec),
        _factors.plan_slot("b", 64 * 16, torch.Size([16]), RANK, 4, state.codec),
        _factors.plan_slot("v", 64 * 16 + 16, torch.Size([64, 16]), RANK, 4, state.codec),
    ]
    numel = 2 * 64 * 16 + 16
    with gather_is_a_copy():
        zero = torch.zeros(numel)
        hook.reduce_step(state, [zero], [slots], None, 1)
        assert torch.equal(zero, torch.zeros(numel))
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        exact = grad[64 * 16 : 64 * 16 + 16].clone()
        hook.reduce_step(state, [grad], [slots], None, 1)
        assert torch.equal(grad[64 * 16 : 64 * 16 + 16], exact)  # one participant: the exact mean is itself
        errors = {name: state.memory.errors[name].clone() for name in ("w", "v")}
        factors = {name: state.memory.factors[name].clone() for name in ("w", "v")}
        assert all(torch.isfinite(tensor).all() for tensor in [*errors.values(), *factors.values()])
        # The same shape twice: one batch, yet each keeps its own error.
        assert not torch.equal(errors["w"], errors["v"])
        bad = torch.full((numel,), math.inf)
        hook.reduce_step(state, [bad], [slots], None, 1)
        for name in ("w", "v"):
            assert torch.equal(state.memory.errors[name], errors[name])
            assert torch.equal(state.memory.factors[name], factors[name])
        # A new layout (DDP's rebuilt buckets) takes the errors and factors over by name.
        state.forget_step_plan()
        hook.reduce_step(state, [zero.clone()], [slots], None, 1)


def test_a_plan_with_graphs_is_dropped_only_once_its_device_is_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new layout, a loaded checkpoint or closing drops the plan; with captured graphs, after its replays ended."""
    state = lone_state(whole_step=True)
    slots = [_factors.plan_slot("w", 0, torch.Size([64, 16]), RANK, 4, state.codec)]
    waited: list[torch.device] = []
    monkeypatch.setattr(hook.torch.cuda, "synchronize", waited.append)
    with gather_is_a_copy():
        hook.reduce_step(state, [torch.randn(64 * 16)], [slots], None, 1)
    plan = state.step_plan([slots], torch.device("cpu"))
    state.forget_step_plan()
    assert waited == []  # nothing was captured: nothing can still be replaying
    plan = state.step_plan([slots], torch.device("cpu"))
    assert plan is not state.step_plan([slots[:0]], torch.device("cpu"))  # another layout replaces it
    assert waited == []
    plan = state.step_plan([slots], torch.device("cpu"))
    plan.graphs._graphs = 1  # as if it had captured its halves
    state.step_plan([slots[:0]], torch.device("cpu"))
    assert waited == [torch.device("cpu")]
    state.forget_step_plan()
    assert state.plans.step is None


def test_whole_step_is_refused_with_alternate():
    with pytest.raises(ValueError, match=r"`whole_step=True` does not support `alternate=True`"):
        LowRankAlgorithm(alternate=True, whole_step=True)
    with pytest.raises(TypeError, match="whole_step"):
        LowRankAlgorithm(whole_step="yes")  # type: ignore[arg-type]
    assert LowRankAlgorithm(alternate=True).whole_step is False


def test_batched_orthonormalisation_is_the_per_gradient_one():
    """Gradients with the same row count are orthonormalised as one batch: each to the Gram-Schmidt basis alone."""
    generator = torch.Generator().manual_seed(3)
    factors = [torch.randn(48, 4, generator=generator) for _ in range(3)]
    batched = _factors.orthonormalise_columns(torch.stack(factors))
    for factor, result in zip(factors, batched, strict=True):
        torch.testing.assert_close(result, orthonormal(factor), rtol=0, atol=1e-5)
    factors[1][:, 2] = 0.0  # a zero column (a zero gradient's) stays zero, and the next one keeps all it has left
    batched = _factors.orthonormalise_columns(torch.stack(factors))
    for factor, result in zip(factors, batched, strict=True):
        torch.testing.assert_close(result, orthonormal(factor), rtol=0, atol=1e-5)
    assert torch.equal(batched[1][:, 2], torch.zeros(48))
    torch.testing.assert_close(_factors.orthonormalise_columns(torch.zeros(2, 48, 4)), torch.zeros(2, 48, 4))
