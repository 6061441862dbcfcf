"""``decentralized``: D-PSGD, where ranks average weights with peers instead of all-reducing gradients."""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_bagua.engine._torch_compat import queue_backward_callback
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    HookState,
    check_keyword_type,
    check_positive_int,
    check_state_keys,
    register_algorithm,
    weakly_bound,
)
from lightning_bagua.engine.algorithms.weights import FlatWeights, check_optimizers_cover, group_by_dtype
from lightning_bagua.engine.communication import (
    CommunicationCounter,
    CommunicationGroups,
    all_reduce_hierarchically,
    start_exchange,
)

__all__ = [
    "PEER_SELECTION_MODES",
    "DecentralizedAlgorithm",
    "DecentralizedImpl",
    "DecentralizedState",
    "decentralized_hook",
    "local_gradient_hook",
    "shift_one_peer",
]

log = logging.getLogger(__name__)

PEER_SELECTION_MODES = ("all", "shift_one")
"""The values ``peer_selection_mode`` accepts."""

# A pending exchange: calling it waits for the communication and leaves the peer weights in the exchange buffers.
_Finish = Callable[[], None]


def shift_one_peer(rank: int, round_index: int, size: int) -> int:
    """Return the partner of ``rank`` in communication round ``round_index`` of the ``"shift_one"`` schedule.

    The ``size`` participants split into a lower half ``r < size/2`` and an upper half. In round ``k``, lower rank
    ``r`` pairs with ``((k + r) mod size/2) + size/2`` and upper rank ``r`` with ``(r - size/2 - k) mod size/2``,
    so every round is a perfect matching between the halves and the matching shifts by one each round.

    Args:
        rank: a participant's index in ``[0, size)``.
        round_index: the communication round, counted from 0.
        size: the number of participants; must be even.

    Returns:
        The partner's index.

    Example:
        >>> [shift_one_peer(r, 1, 4) for r in range(4)]
        [3, 2, 1, 0]
    """
    if size % 2:
        raise ValueError(f"The shift_one schedule pairs participants, so their number must be even, got {size}.")
    half = size // 2
    if rank < half:
        return (round_index + rank) % half + half
    return (rank - half - round_index) % half


@dataclass
class DecentralizedState(HookState):
    """State of :class:`DecentralizedImpl`: the groups, the counters and the exchange in flight.

    Beyond :class:`HookState`'s ``groups``, ``counter`` and ``executor``:

    Args:
        device: the device the parameters live on.
        peer_selection_mode: ``"all"`` or ``"shift_one"``.
        communication_interval: exchange on every ``communication_interval``-th forward pass.
        weights: the participating parameters, grouped by dtype.
        forward_passes: training forward passes seen (the spec's ``t``).
        rounds: exchanges started (the ``"shift_one"`` schedule's round).
        due: a forward pass asked for an exchange that has not started yet (it was an accumulating pass).
        pending: waits for the exchange in flight, if any.
        copy_queued: the end-of-backward copy is queued for the backward running now.
        copy_peer_weights: waits for the exchange in flight and copies its result into the parameters.
    """

    device: torch.device
    peer_selection_mode: str
    communication_interval: int
    weights: list[FlatWeights] = field(default_factory=list)
    forward_passes: int = 0
    rounds: int = 0
    due: bool = False
    pending: _Finish | None = None
    copy_queued: bool = False
    copy_peer_weights: Callable[[], None] | None = None

    @property
    def participants(self) -> int:
        """How many parties mix: ranks, or nodes when communication runs in two levels."""
        return self.groups.layout.num_nodes if self.groups.is_hierarchical else self.groups.world_size


class DecentralizedImpl(AlgorithmImpl):
    """:class:`DecentralizedAlgorithm` bound to one wrapped model.

    Accumulating steps: every training forward pass counts towards ``t``, but an exchange starts only on a
    pass whose backward synchronizes (the last pass of an accumulated step). A due pass under ``no_sync()``
    defers its exchange to that synchronizing pass; the weights do not change between the passes of one step, so
    this exchanges the same weights and keeps one exchange per optimizer step, whatever the interval. Whether an
    exchange starts depends only on the pass count and ``no_sync()``, never on optimizer steps, so every rank
    issues the same communication.

    When the copy happens: at the end of the synchronizing backward (an autograd callback queued by the
    communication hook, after DDP's own end-of-backward work), so after the gradients exist and before any
    optimizer step, however the step is driven: ``backward(); step()`` in plain PyTorch, or Lightning's
    ``optimizer.step(closure)``, whose pre-step hooks run before the closure's forward and backward. Every
    bound optimizer then applies gradients taken at the old weights, once per exchange.

    An exchange that no backward consumed is waited for and dropped when the next one starts.
    """

    def __init__(self, algorithm: "DecentralizedAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.state = DecentralizedState.from_context(
            context,
            device=context.device,
            peer_selection_mode=algorithm.peer_selection_mode,
            communication_interval=algorithm.communication_interval,
        )
        groups = context.groups
        if algorithm.peer_selection_mode == "shift_one" and algorithm.hierarchical and groups.layout.num_nodes == 1:
            if groups.world_size > 1:
                # Bagua pairs nodes here and refuses a single one; pairing the node's ranks silently would be
                # another algorithm than the one asked for.
                raise ValueError(
                    f"Algorithm {DecentralizedAlgorithm.name!r} with peer_selection_mode='shift_one' and"
                    " hierarchical=True pairs nodes, but all"
                    f" {groups.world_size} ranks are on one node. Pass hierarchical=False to pair the ranks, or"
                    " peer_selection_mode='all' to average the node."
                )
        elif algorithm.peer_selection_mode == "shift_one" and self.state.participants % 2:
            raise ValueError(_odd_participants_message(self.state.groups, self.state.participants))
        self.state.weights = group_by_dtype(
            [parameter for _, parameter in context.named_parameters],
            needs_receive_buffer=algorithm.peer_selection_mode == "shift_one",
        )
        self.state.copy_peer_weights = weakly_bound(self._copy_peer_weights)
        self._optimizers: list[Optimizer] = []

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`decentralized_hook`, which leaves gradients local."""
        return self.state, decentralized_hook

    def on_forward_start(self, synchronizing: bool) -> None:
        """Count the pass and, when one is due, start the weight exchange.

        Args:
            synchronizing: ``False`` on the passes of accumulating steps; those defer a due exchange.
        """
        state = self.state
        if not self._optimizers and state.weights:
            raise RuntimeError(
                f"Algorithm {DecentralizedAlgorithm.name!r} copies the exchanged weights in just before the"
                " optimizer step, but no optimizer is bound to the model. Pass `optimizers=` to"
                " BaguaDistributedDataParallel or call its `bind_optimizers()` before training."
            )
        if state.forward_passes % state.communication_interval == 0:
            state.due = True
        state.forward_passes += 1
        if state.due and synchronizing:
            state.due = False
            self._start_exchange()

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Check that the optimizers update every participating parameter, and remember them.

        Args:
            optimizers: the optimizers; together they must update every participating parameter.

        Raises:
            ValueError: a participating parameter is not updated by any of ``optimizers``.
        """
        if optimizers:
            check_optimizers_cover(DecentralizedAlgorithm.name, self.context.named_parameters, optimizers)
        self._optimizers = list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        """Return the counters that place this rank in the schedule: passes seen, rounds run, an exchange owed.

        The exchange buffers are not saved: every exchange refills them from the parameters first, so the
        parameters (saved with the model) are all of the weight state. What differs between ranks is the weights
        and the optimizer state, which the caller saves per rank.

        An exchange still in flight (a training forward pass ran and its backward has not, or never will: a
        callback such as Lightning's ``StochasticWeightAveraging`` runs forward-only passes in training mode) is
        waited for first, so nothing is half done while the caller reads; its result stays for that backward's
        copy, if one comes. The parameters are never touched by an exchange before that copy, so they too are a
        consistent state to save at any time.

        Returns:
            ``{"forward_passes": int, "rounds": int, "due": bool}``.
        """
        self.settle()
        state = self.state
        return {"forward_passes": state.forward_passes, "rounds": state.rounds, "due": state.due}

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Keep the schedule's counters, which every rank shares; the weights the exchanges start from are averaged.

        Args:
            saved: each saved rank's :meth:`state_dict`.

        Returns:
            Rank 0's counters.
        """
        return dict(saved[0])

    def settle(self) -> None:
        """Wait for the exchange in flight, if any, keeping its result for the end of the backward that consumes it.

        Idempotent, and free when nothing is in flight. After it, nothing runs in the background until the next
        training forward pass starts an exchange.
        """
        pending = self.state.pending
        if pending is None:
            return
        pending()
        # The peer weights now sit in the exchange buffers; the copy at the end of backward (or the next exchange,
        # which drops an unconsumed one) must not wait, or divide, a second time.
        self.state.pending = _settled

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters :meth:`state_dict` returned.

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            ValueError: ``state`` lacks a key, has extra ones, or holds a value of the wrong type.
        """
        check_state_keys(DecentralizedAlgorithm.name, state, {"forward_passes": int, "rounds": int, "due": bool})
        self.state.forward_passes = state["forward_passes"]
        self.state.rounds = state["rounds"]
        self.state.due = state["due"]

    def close(self) -> None:
        """Wait out an exchange still in flight (its result is dropped)."""
        pending, self.state.pending = self.state.pending, None
        if pending is not None:
            try:
                pending()
            except RuntimeError as error:  # a peer that is gone must not turn shutdown into a crash
                log.warning("Dropping an unfinished weight exchange on close: %s", error)

    def _start_exchange(self) -> None:
        state = self.state
        if not state.weights:
            return
        if state.pending is not None:
            state.pending()  # not consumed by a step: finish it so the communication stays matched, then drop it
            state.pending = None
        round_index = state.rounds
        state.rounds += 1
        for weights in state.weights:
            weights.gather()
        if state.groups.is_hierarchical:
            # Three dependent collectives: run them in order on the executor's thread, off the training loop.
            future = state.executor.submit(lambda: _exchange_two_level(state, round_index))

            def finish() -> None:
                future.wait()

        else:
            finishers = [_start_flat_exchange(state, weights, round_index) for weights in state.weights]

            def finish() -> None:
                for finish_one in finishers:
                    finish_one()

        state.pending = finish

    def _copy_peer_weights(self) -> None:
        self.state.copy_queued = False
        pending, self.state.pending = self.state.pending, None
        if pending is None:
            return
        pending()
        with torch.no_grad():
            for weights in self.state.weights:
                weights.scatter(weights.buffer)


@register_algorithm("decentralized")
class DecentralizedAlgorithm(Algorithm):
    """Average weights with peers, never gradients: decentralized parallel SGD (D-PSGD).

    D-PSGD is described by Lian et al. 2017, https://arxiv.org/abs/1705.09056. Each rank keeps its own replica
    ``x_r``, trains on its own data without any gradient all-reduce, and mixes its weights with its peers'. With
    ``t`` counting training forward passes from 0, on every ``t`` with ``t % communication_interval == 0``:

    1. At the start of the forward pass, copy the weights ``x_r`` into a flat buffer and start exchanging it,
       asynchronously, so that the exchange overlaps forward and backward:

       - ``"all"``: the peer weight is the average over all ``n`` ranks, ``p_r = (1/n) sum_i x_i``;
       - ``"shift_one"``: ranks pair off by :func:`shift_one_peer` (a different partner each communication round
         ``k``) and the peer weight is ``p_r = (x_r + x_partner) / 2``. ``n`` must be even.

    2. Forward and backward run at the old weights, giving the local gradient ``g_r(x_r)``; DDP's reducer is
       handed the gradients back untouched.
    3. Just before the optimizer step, wait for the exchange and copy ``p_r`` into the parameters. The optimizer
       then applies the gradient taken at the old weights: ``x_r <- p_r - lr * g_r(x_r)``, i.e.
       ``x_{t+1} = W x_t - lr * g(x_t)`` with ``W`` the mixing matrix of step 1.

    On the other forward passes the step is local: ``x_r <- x_r - lr * g_r(x_r)``.

    Args:
        hierarchical: mix in two levels. Every rank's weights are first averaged inside its node (full
            precision, on the node's leader); the leaders then run the exchange among nodes (``n`` counts nodes,
            so ``"shift_one"`` pairs nodes), and each leader broadcasts the result inside its node. With one
            node, or one rank per node, this is the flat algorithm over all ranks.
        peer_selection_mode: ``"all"`` or ``"shift_one"``.
        communication_interval: exchange weights on every ``communication_interval``-th forward pass.

    Raises:
        ValueError: ``peer_selection_mode`` is not one of :data:`PEER_SELECTION_MODES`, or
            ``communication_interval`` is below 1.
        TypeError: a keyword has the wrong type.
    """

    ranks_hold_different_weights = True
    resize_effect = "the schedule's counters are kept; every rank starts from the ranks' average weights"
    impl_class = DecentralizedImpl

    # Weights travel as flat per-dtype buffers; the gradient buckets never leave the rank.
    communicates_gradient_buckets = False

    def __init__(
        self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1
    ) -> None:
        check_keyword_type(self.name, "hierarchical", hierarchical, bool)
        check_keyword_type(self.name, "peer_selection_mode", peer_selection_mode, str)
        check_keyword_type(self.name, "communication_interval", communication_interval, int)
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"Algorithm {self.name!r}: `peer_selection_mode` must be one of"
                f" {', '.join(map(repr, PEER_SELECTION_MODES))}, got {peer_selection_mode!r}."
            )
        check_positive_int(self.name, "communication_interval", communication_interval)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval


class _OnDevice(Protocol):
    device: torch.device


def _settled() -> None:
    """The pending call of an exchange that :meth:`DecentralizedImpl.settle` has already finished."""


def local_gradient_hook(state: _OnDevice, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Hand a bucket of gradients back untouched, for algorithms that communicate weights instead.

    Args:
        state: any state with the ``device`` the gradients live on.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A completed future of the bucket's buffer.
    """
    # On CUDA the future must know the device, so that the reducer's stream waits on the current one.
    future: torch.futures.Future[Tensor] = (
        torch.futures.Future(devices=[state.device]) if state.device.type == "cuda" else torch.futures.Future()
    )
    future.set_result(bucket.buffer())
    return future


def decentralized_hook(state: DecentralizedState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Hand a bucket of gradients back untouched (in D-PSGD every rank steps with its own gradient).

    On the first bucket of a backward that has an exchange in flight, queue the copy of the peer weights for
    the end of that backward.

    Args:
        state: the algorithm's state.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A completed future of the bucket's buffer.
    """
    if state.pending is not None and not state.copy_queued and state.copy_peer_weights is not None:
        # Runs once this backward has finished, after DDP's own end-of-backward callback (queued earlier).
        state.copy_queued = True
        queue_backward_callback(state.copy_peer_weights)
    return local_gradient_hook(state, bucket)


def _start_flat_exchange(state: DecentralizedState, weights: FlatWeights, round_index: int) -> _Finish:
    groups = state.groups
    if state.peer_selection_mode == "all":
        return _start_average_all(weights.buffer, groups.flat, groups.world_size, state.counter)
    assert weights.received is not None
    partner = groups.global_ranks[shift_one_peer(groups.rank, round_index, groups.world_size)]
    return _start_average_with_partner(weights.buffer, weights.received, partner, groups.flat, state.counter)


def _exchange_two_level(state: DecentralizedState, round_index: int) -> Tensor:
    groups = state.groups
    layout = groups.layout

    def among_leaders(received: Tensor | None, node_sum: Tensor) -> None:
        node_sum.div_(layout.ranks_per_node)  # the node's average weight
        if state.peer_selection_mode == "all":
            _start_average_all(node_sum, groups.inter_node, layout.num_nodes, state.counter)()
            return
        assert received is not None
        partner_node = shift_one_peer(layout.node_of(groups.rank), round_index, layout.num_nodes)
        partner = groups.global_ranks[layout.leaders()[partner_node]]
        _start_average_with_partner(node_sum, received, partner, groups.inter_node, state.counter)()

    for weights in state.weights:
        all_reduce_hierarchically(weights.buffer, groups, state.counter, partial(among_leaders, weights.received))
    return state.weights[0].buffer


def _start_average_all(
    weights: Tensor, group: dist.ProcessGroup | None, size: int, counter: CommunicationCounter
) -> _Finish:
    """Start replacing ``weights`` by the average of every member's ``weights``; the returned call finishes it."""
    counter.record("all_reduce", weights)
    work = dist.all_reduce(weights, group=group, async_op=True)

    def finish() -> None:
        work.wait()
        weights.div_(size)

    return finish


def _start_average_with_partner(
    weights: Tensor, received: Tensor, partner: int, group: dist.ProcessGroup | None, counter: CommunicationCounter
) -> _Finish:
    """Start replacing ``weights`` by ``(weights + partner's weights) / 2``; the returned call finishes it.

    ``partner`` is a global rank; ``received`` is scratch space for the partner's weights.
    """
    counter.record("send", weights)
    works = start_exchange(
        [dist.P2POp(dist.isend, weights, partner, group), dist.P2POp(dist.irecv, received, partner, group)]
    )

    def finish() -> None:
        for work in works:
            work.wait()
        # Only now may `weights` change: the send may read it until its work completes.
        weights.add_(received).div_(2)

    return finish


def _odd_participants_message(groups: CommunicationGroups, participants: int) -> str:
    if groups.is_hierarchical:
        what = f"{participants} nodes (hierarchical=True pairs nodes, not ranks)"
        fix = "use an even number of nodes, pass hierarchical=False to pair ranks instead, or use"
    else:
        what = f"{participants} ranks"
        fix = "use an even number of ranks, or use"
    return (
        f"Algorithm {DecentralizedAlgorithm.name!r} with peer_selection_mode='shift_one' pairs participants off,"
        f" so it needs an even number of them, but there are {what}. To fix this, {fix}"
        " peer_selection_mode='all'."
    )
