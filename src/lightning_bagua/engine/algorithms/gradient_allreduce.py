"""``gradient_allreduce``: average (or sum) gradients over all ranks, bucketed and overlapped with backward."""

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    HookState,
    check_keyword_type,
    register_algorithm,
)
from lightning_bagua.engine.communication import (
    all_reduce_hierarchically,
)

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceState", "all_reduce_bucket", "gradient_allreduce_hook"]


class GradientAllReduceImpl(AlgorithmImpl):
    """:class:`GradientAllReduceAlgorithm` bound to one wrapped model."""

    def __init__(self, algorithm: "GradientAllReduceAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.state = GradientAllReduceState.from_context(
            context,
            average=algorithm.average,
        )

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`gradient_allreduce_hook`."""
        return self.state, gradient_allreduce_hook


@register_algorithm("gradient_allreduce")
class GradientAllReduceAlgorithm(Algorithm):
    """All-reduce gradients at full precision, as DDP does, optionally in two levels.

    Args:
        hierarchical: reduce inside each node first, all-reduce among node leaders, then broadcast inside each
            node. Nodes are laid out from the wrapper's ``ranks_per_node``, ``LOCAL_WORLD_SIZE``, or the ranks' hosts.
        average: divide the sum by the number of ranks; ``False`` keeps the sum.
    """

    # A full-precision sum is the same whatever the buckets, as under DDP, whose checkpoints keep no layout either.
    results_depend_on_buckets = False
    impl_class = GradientAllReduceImpl

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        check_keyword_type(self.name, "hierarchical", hierarchical, bool)
        check_keyword_type(self.name, "average", average, bool)
        self.hierarchical = hierarchical
        self.average = average


@dataclass
class GradientAllReduceState(HookState):
    """State of :func:`gradient_allreduce_hook`.

    Beyond :class:`HookState`'s ``groups``, ``counter`` and ``executor``:

    Args:
        average: divide by the number of ranks.
    """

    average: bool = True


def gradient_allreduce_hook(
    state: GradientAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one bucket of gradients.

    With ``n`` ranks and ``g_i`` rank ``i``'s bucket:

    1. If ``average``, scale locally: ``g_i <- g_i / n`` (before communicating, so that low-precision sums
       stay in range).
    2. Flat: all-reduce ``sum_i g_i`` over all ranks. Hierarchical: sum inside each node on its leader,
       all-reduce the node sums among leaders, broadcast the result inside each node.

    Args:
        state: the groups, counter and executor to use.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A future of the reduced bucket.
    """
    buffer = bucket.buffer()
    if state.average:
        buffer.div_(state.groups.world_size)
    if state.groups.is_hierarchical:
        return state.executor.submit(lambda: _all_reduce_two_level(state, buffer), last=bucket.is_last())
    state.counter.record("all_reduce", buffer)
    work = dist.all_reduce(buffer, group=state.groups.flat, async_op=True)
    if state.executor.runs_inline:
        # NCCL: the future completes as the collective is queued, so the callback runs here, in this thread.
        return work.get_future().then(_first_tensor)
    # Gloo completes its futures on threads of its own, which would enter Python to run a callback, creating a
    # thread state each time. CPython before 3.12 can then deadlock a process forked meanwhile (a DataLoader
    # worker) in the child's fork handler (python/cpython#112275). So a Python thread waits for the collective
    # instead: the executor's worker, or this one for the step's last bucket. Gloo still runs the collectives
    # side by side.
    return state.executor.submit(partial(_waited, work, buffer), last=bucket.is_last())


def all_reduce_bucket(state: GradientAllReduceState, buffer: Tensor) -> Tensor:
    """Run :func:`gradient_allreduce_hook`'s steps on ``buffer`` in place and wait, for a job of the executor.

    An algorithm whose other buckets run on the executor (``qadam`` past its warm-up) reduces a full-precision
    bucket this way, so that its collectives keep their place among the executor's on every rank.

    Args:
        state: the groups, counter and ``average`` to use.
        buffer: the bucket's flat gradients.

    Returns:
        ``buffer``, reduced.
    """
    if state.average:
        buffer.div_(state.groups.world_size)
    if state.groups.is_hierarchical:
        return _all_reduce_two_level(state, buffer)
    state.counter.record("all_reduce", buffer)
    dist.all_reduce(buffer, group=state.groups.flat)
    return buffer


def _all_reduce_two_level(state: GradientAllReduceState, buffer: Tensor) -> Tensor:
    def inter_node(node_sum: Tensor) -> None:
        state.counter.record("all_reduce", node_sum)
        dist.all_reduce(node_sum, group=state.groups.inter_node)

    return all_reduce_hierarchically(buffer, state.groups, state.counter, inter_node)


def _first_tensor(future: torch.futures.Future) -> Tensor:
    return future.value()[0]


def _waited(work: dist.Work, buffer: Tensor) -> Tensor:
    work.wait()
    return buffer
