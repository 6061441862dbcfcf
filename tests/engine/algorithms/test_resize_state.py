"""Each algorithm's ``resize_state`` follows its documented rule (the end-to-end resize is in tests/strategies)."""

from types import SimpleNamespace

import pytest
import torch

from lightning_bagua.engine.algorithms.async_model_average import AsyncModelAverageImpl
from lightning_bagua.engine.algorithms.base import Algorithm, AlgorithmImpl, algorithm_class, available_algorithms
from lightning_bagua.engine.algorithms.decentralized import DecentralizedImpl
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceImpl
from lightning_bagua.engine.algorithms.low_precision_decentralized import LowPrecisionDecentralizedImpl
from lightning_bagua.engine.algorithms.low_rank import LowRankImpl

EXACT = {"rtol": 0, "atol": 0}


def _bound(impl_class: type[AlgorithmImpl], world_size: int, rank: int = 0, ranks_per_node: int | None = None, **state):
    # resize_state reads the groups and the algorithm's settings only: no process group is needed.
    hierarchical = ranks_per_node is not None
    layout = SimpleNamespace(num_nodes=world_size // (ranks_per_node or 1), ranks_per_node=ranks_per_node or 1)
    groups = SimpleNamespace(
        world_size=world_size,
        rank=rank,
        layout=layout,
        is_hierarchical=hierarchical,
        is_node_leader=rank % (ranks_per_node or 1) == 0,
    )
    impl = impl_class.__new__(impl_class)
    impl.context = SimpleNamespace(groups=groups)
    impl.state = SimpleNamespace(**state)
    return impl


@pytest.mark.timeout(10)
def test_an_algorithm_without_state_resizes_to_nothing_and_refuses_state_it_cannot_reshard():
    assert _bound(GradientAllReduceImpl, 3).resize_state([{}, {}]) == {}
    with pytest.raises(ValueError, match="cannot resize the state 2 processes saved to 3: it does not implement"):
        AlgorithmImpl.resize_state(_bound(GradientAllReduceImpl, 3), [{"x": 1}, {"x": 2}])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", available_algorithms())
def test_an_algorithm_that_keeps_state_says_what_a_resize_does_with_it(name):
    # The resize warning prints resize_effect: the base's "keeps no state" would be wrong beside a resize_state.
    registered = algorithm_class(name)
    keeps_state = registered.impl_class.resize_state is not AlgorithmImpl.resize_state
    assert keeps_state == (registered.resize_effect != Algorithm.resize_effect), registered.resize_effect


@pytest.mark.timeout(10)
def test_the_decentralized_schedule_and_async_progress_are_kept():
    saved = [{"forward_passes": 6, "rounds": 2, "due": True}] * 2
    assert _bound(DecentralizedImpl, 3).resize_state(saved) == saved[0]
    counters = [{"forward_passes": 6, "rounds": 9}, {"forward_passes": 7, "rounds": 8}]
    assert _bound(AsyncModelAverageImpl, 1).resize_state(counters) == {"forward_passes": 7, "rounds": 9}


@pytest.mark.timeout(10)
def test_low_precision_ring_copies_are_rebuilt_from_the_averaged_weights():
    copies = [{"w": torch.ones(3), "left": torch.zeros(3), "right": torch.zeros(3)}]
    saved = [{"forward_passes": 4, "due": False, "armed": True, "copies": copies}] * 2
    resized = _bound(LowPrecisionDecentralizedImpl, 4).resize_state(saved)
    assert resized == {"forward_passes": 4, "due": False, "armed": True, "copies": None}


def _low_rank_saved() -> list[dict]:
    return [
        {"steps": 5, "errors": {"w": torch.full((2, 2), float(rank + 1))}, "factors": {"w": torch.full((2, 1), 7.0)}}
        for rank in range(2)
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_low_rank_residuals_keep_their_sum_and_the_factors_are_kept(world_size):
    saved = _low_rank_saved()
    resized = [
        _bound(LowRankImpl, world_size, rank, full_precision_only=False, alternate=False).resize_state(saved)
        for rank in range(world_size)
    ]
    torch.testing.assert_close(sum(state["errors"]["w"] for state in resized), torch.full((2, 2), 3.0), **EXACT)
    for state in resized:
        assert state["steps"] == 5
        torch.testing.assert_close(state["factors"], saved[0]["factors"], **EXACT)


@pytest.mark.timeout(10)
def test_two_level_low_rank_splits_the_residuals_over_the_node_leaders_only():
    # Four ranks on two nodes: ranks 0 and 2 compress, each gets half the saved sum; 1 and 3 keep nothing.
    saved = _low_rank_saved()
    resized = [
        _bound(LowRankImpl, 4, rank, ranks_per_node=2, full_precision_only=False, alternate=False).resize_state(saved)
        for rank in range(4)
    ]
    for rank in (0, 2):
        torch.testing.assert_close(resized[rank]["errors"]["w"], torch.full((2, 2), 1.5), **EXACT)
    for rank in (1, 3):
        assert resized[rank]["errors"] == {}
        assert resized[rank]["factors"] == {}
