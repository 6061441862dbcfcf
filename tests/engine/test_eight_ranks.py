"""Every hierarchical-capable algorithm at eight Gloo ranks: flat, as 2 nodes x 4 and as 4 nodes x 2.

With two ranks several algorithms degenerate: shift_one has a single partner, the ring's left and right neighbours
are the same rank, and a hierarchy has one level. At eight, shift_one meets four different partners in four rounds,
the ring has two distinct neighbours, and the two layouts put 2 or 4 leaders between the nodes. Each scenario is
checked step by step against the same single-process simulation as the 2- and 4-rank tests, and its bytes per
step against the theoretical count.

Starting eight interpreters costs far more on a small machine than the tiny trainings themselves, so one spawn of
eight processes runs every scenario in turn (a module fixture), and each test checks its own scenario.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import assert_ranks_identical, run_processes
from tests.engine import test_data_parallel
from tests.engine.algorithms import test_bytegrad, test_decentralized
from tests.engine.algorithms import test_low_precision_decentralized as test_lpd

WORLD_SIZE = 8
# Ranks per node of each layout; None is the flat algorithm over all eight ranks.
LAYOUTS: dict[str, int | None] = {"flat": None, "2x4": 4, "4x2": 2}


def decentralized(mode: str) -> Callable[[int, int, int | None], dict]:
    def run(rank: int, world_size: int, ranks_per_node: int | None) -> dict:
        kwargs = {"peer_selection_mode": mode, "hierarchical": ranks_per_node is not None}
        return test_decentralized.train(rank, world_size, kwargs, ranks_per_node)

    return run


def low_precision_decentralized(rank: int, world_size: int, ranks_per_node: int | None) -> dict:
    return test_lpd.train(
        rank, world_size, {"hierarchical": ranks_per_node is not None}, {"ranks_per_node": ranks_per_node}
    )


def bytegrad(rank: int, world_size: int, ranks_per_node: int | None) -> dict:
    return test_bytegrad.train_with_bytegrad(
        rank, world_size, {"hierarchical": ranks_per_node is not None}, ranks_per_node
    )


def gradient_allreduce(rank: int, world_size: int, ranks_per_node: int | None) -> dict:
    kwargs = {"hierarchical": ranks_per_node is not None}
    return test_data_parallel.train_distributed(rank, world_size, kwargs, ranks_per_node)


ALGORITHMS: dict[str, Callable[[int, int, int | None], dict]] = {
    "decentralized_all": decentralized("all"),
    "decentralized_shift_one": decentralized("shift_one"),
    "low_precision_decentralized": low_precision_decentralized,
    "bytegrad": bytegrad,
    "gradient_allreduce": gradient_allreduce,
}


@contextmanager
def recording_send_peers() -> Iterator[list[list[int]]]:
    """Record, per point-to-point batch this rank starts, the global ranks it sends to (in the order given)."""
    batches: list[list[int]] = []
    original = dist.batch_isend_irecv

    def spy(p2p_op_list: list[dist.P2POp]) -> Any:
        batches.append([op.peer for op in p2p_op_list if op.op is dist.isend])
        return original(p2p_op_list)

    dist.batch_isend_irecv = spy
    try:
        yield batches
    finally:
        dist.batch_isend_irecv = original


def run_every_scenario(rank: int, world_size: int) -> dict[tuple[str, str], dict]:
    outcomes = {}
    for algorithm, train in ALGORITHMS.items():
        for layout, ranks_per_node in LAYOUTS.items():
            with recording_send_peers() as peers:
                result = train(rank, world_size, ranks_per_node)
            outcomes[(algorithm, layout)] = {**result, "send_peers": peers}
    return outcomes


@pytest.fixture(scope="module")
def eight_ranks() -> Callable[[str, str], list[dict]]:
    # Every scenario's collectives run in this one spawn; the timeout covers all of them.
    by_rank = run_processes(run_every_scenario, WORLD_SIZE, timeout=280)
    return lambda algorithm, layout: [outcomes[(algorithm, layout)] for outcomes in by_rank]


def ranks_per_node_of(layout: str) -> int:
    return LAYOUTS[layout] or 1


def expected_bytes(rank: int, layout: str, full: int, inter_node: dict[str, int]) -> dict[str, int]:
    """Flat: ``inter_node`` on every rank. Two-level: every rank reduces to and hears back from its node's leader at
    full precision (``full`` bytes each way); leaders alone add ``inter_node``."""
    if LAYOUTS[layout] is None:
        return inter_node
    leader = rank % ranks_per_node_of(layout) == 0
    return {"reduce": full, "broadcast": full, **(inter_node if leader else {})}


# ----------------------------------------------------------------------------------------------------------------
# decentralized


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_decentralized_matches_the_simulation(eight_ranks, mode, layout):
    results = eight_ranks(f"decentralized_{mode}", layout)
    k = ranks_per_node_of(layout)
    test_decentralized.assert_matches(results, test_decentralized.simulate(WORLD_SIZE, mode, ranks_per_node=k))
    if mode == "shift_one" and k > 1:  # pairs of nodes mix node averages: nothing like flat shift_one over 8
        with pytest.raises(AssertionError):
            test_decentralized.assert_matches(results, test_decentralized.simulate(WORLD_SIZE, mode))
    total = test_decentralized.STEPS * test_decentralized.param_bytes()
    op = "all_reduce" if mode == "all" else "send"
    for rank, result in enumerate(results):
        assert result["hierarchical"] == (LAYOUTS[layout] is not None)
        assert result["bytes_by_op"] == expected_bytes(rank, layout, total, {op: total}), f"rank {rank}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shift_one_meets_a_different_partner_every_round(eight_ranks, layout):
    results = eight_ranks("decentralized_shift_one", layout)
    k = ranks_per_node_of(layout)
    nodes = WORLD_SIZE // k
    rounds = test_decentralized.STEPS
    for rank, result in enumerate(results):
        if rank % k:  # a non-leader only reduces to and hears back from its leader
            assert result["send_peers"] == [], f"rank {rank}"
            continue
        node = rank // k
        partners = [peers[0] // k for peers in result["send_peers"]]
        assert [len(peers) for peers in result["send_peers"]] == [1] * rounds, f"rank {rank}"
        assert partners == [test_decentralized.spec_partner(node, t, nodes) for t in range(rounds)], f"rank {rank}"
        # Every round a new partner from the other half, until the whole other half has been met.
        other_half = set(range(nodes // 2, nodes)) if node < nodes // 2 else set(range(nodes // 2))
        assert len(set(partners)) == min(rounds, nodes // 2), f"rank {rank}"
        assert set(partners) <= other_half, f"rank {rank}"


# ----------------------------------------------------------------------------------------------------------------
# low_precision_decentralized


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_low_precision_ring_matches_the_simulation_with_distinct_neighbours(eight_ranks, layout):
    results = eight_ranks("low_precision_decentralized", layout)
    k = ranks_per_node_of(layout)
    test_lpd.assert_matches(results, test_lpd.simulate(WORLD_SIZE, ranks_per_node=k))
    with pytest.raises(AssertionError):  # the test can tell the compressed ring from a full-precision one
        test_lpd.assert_matches(results, test_lpd.simulate(WORLD_SIZE, ranks_per_node=k, quantise=False))
    members = WORLD_SIZE // k
    leaders = results[::k]
    assert [result["copies"] is None for result in results] == [rank % k != 0 for rank in range(WORLD_SIZE)]
    test_lpd.assert_ring_consistent(leaders)  # L and R are the previous and next member's w, bit for bit
    full = test_lpd.STEPS * test_lpd.numel() * 4
    for rank, result in enumerate(results):
        inter_node = {"send": test_lpd.STEPS * test_lpd.ring_bytes(members)}
        assert result["bytes_by_op"] == expected_bytes(rank, layout, full, inter_node), f"rank {rank}"
        if rank % k:
            assert result["send_peers"] == [], f"rank {rank}"
            continue
        # Left, then right; a ring of two has one peer and exchanges its code once.
        position = rank // k
        neighbours = [((position - 1) % members) * k, ((position + 1) % members) * k]
        expected = neighbours if members > 2 else neighbours[:1]
        assert result["send_peers"] == [expected] * test_lpd.STEPS, f"rank {rank}"


# ----------------------------------------------------------------------------------------------------------------
# bytegrad and gradient_allreduce


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bytegrad_matches_the_simulation_bucket_by_bucket(eight_ranks, layout):
    results = eight_ranks("bytegrad", layout)
    if LAYOUTS[layout] is None:
        test_bytegrad.assert_flat_buckets_match(results, average=True)
    else:
        test_bytegrad.assert_hierarchical_buckets_match(results, ranks_per_node_of(layout))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradient_allreduce_matches_single_process_training(eight_ranks, layout):
    results = eight_ranks("gradient_allreduce", layout)
    assert_ranks_identical(results)
    reference = test_data_parallel.train_reference(WORLD_SIZE)
    torch.testing.assert_close(results[0]["state"], reference, **test_data_parallel.TOLERANCE)
    total = test_data_parallel.STEPS * test_data_parallel.param_bytes()
    for rank, result in enumerate(results):
        assert result["hierarchical"] == (LAYOUTS[layout] is not None)
        assert result["bytes_by_op"] == expected_bytes(rank, layout, total, {"all_reduce": total}), f"rank {rank}"
