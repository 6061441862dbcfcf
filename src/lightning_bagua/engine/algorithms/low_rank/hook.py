"""``low_rank``'s state, hook and algorithm: a bucket's trip, read top to bottom.

In torch's hook order: :class:`LowRankState` (options, then the :class:`FactorMemory` kept between steps), then
:func:`low_rank_hook`, then the two ways a bucket goes from there, both into :func:`power_step_`, the algorithm
written once: the per-bucket path (:func:`reduce_bucket`, :func:`low_rank_reduce_`) and the whole-step path
(:class:`StepBatcher`, :func:`reduce_pending`, :func:`reduce_step`). Then the alternating form and the helpers.
Layouts are in :mod:`._plans`, the shared math in :mod:`._factors`.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine.algorithms.base import HookState
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceState, gradient_allreduce_hook
from lightning_bagua.engine.algorithms.low_rank import _factors as factors
from lightning_bagua.engine.algorithms.low_rank._factors import (
    TensorSlot,
    all_gather_bytes,
    bounded,
    finite_factors,
    initial_factor,
    initial_left_factor,
    plan_slot,
    sum_in_order,
)
from lightning_bagua.engine.algorithms.low_rank._plans import BucketPlan, StepPlan, plan_bucket
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import all_reduce_hierarchically

__all__ = [
    "FactorMemory",
    "LowRankState",
    "PlanCache",
    "StepBatcher",
    "low_rank_hook",
    "low_rank_reduce_",
    "power_step_",
    "reduce_bucket",
    "reduce_pending",
    "reduce_step",
]

_FLOAT32_BYTES = 4


@dataclass
class FactorMemory:
    """What ``low_rank`` keeps between steps, by parameter name: what checkpoints save, and ``M``'s buffers.

    Args:
        rank: the factors' rank ``r``.
        device: where the factors and errors live.
        errors: error feedback ``e`` (``n x m``), on the ranks that compress.
        factors: warm-start ``Q`` (``m x r``), on the ranks that compress; with ``alternate``, orthonormalised.
        left_factors: with ``alternate``, the orthonormalised ``P_hat`` (``n x r``) of the last ``P`` step.
        scratch: the per-bucket path's ``M`` of every factored parameter (its error plus its gradient).
    """

    rank: int = 8
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    errors: dict[str, Tensor] = field(default_factory=dict)
    factors: dict[str, Tensor] = field(default_factory=dict)
    left_factors: dict[str, Tensor] = field(default_factory=dict)
    scratch: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def factor(self, slot: TensorSlot) -> Tensor:
        """Return the warm-start ``Q`` of ``slot``, created on first use."""
        q = self.factors.get(slot.name)
        if q is None:
            q = self.factors[slot.name] = initial_factor(slot, self.rank, self.device)
        return q

    def left_factor(self, slot: TensorSlot) -> Tensor:
        """Return the ``P_hat`` of ``slot`` the last alternating ``P`` step kept (see :func:`initial_left_factor`)."""
        p = self.left_factors.get(slot.name)
        if p is None:
            p = self.left_factors[slot.name] = initial_left_factor(slot, self.rank, self.device)
        return p

    def corrected(self, slot: TensorSlot, gradient: Tensor) -> Tensor:
        """Return ``M = G + e`` of ``slot`` (``e = 0`` at first) in float32, in the slot's scratch buffer.

        A buffer apart from the error: the error must survive a step whose result is not finite.
        """
        m = self.scratch.get(slot.name)
        if m is None:
            m = self.scratch[slot.name] = torch.empty(slot.rows, slot.cols, dtype=torch.float32, device=self.device)
        error = self.errors.get(slot.name)
        if error is None:
            m.copy_(gradient)
        else:
            torch.add(gradient, error, out=m)
        return m

    def finish(
        self, slot: TensorSlot, gradient: Tensor, m: Tensor, left: Tensor, right: Tensor, finite: Tensor
    ) -> None:
        """Write ``G_hat = left right^T`` into ``gradient``; keep ``e = M - G_hat`` if ``finite``.

        Args:
            slot: the gradient's slot.
            gradient: its view in the bucket.
            m: its ``M``, which becomes the new error in place.
            left: ``P_hat`` (or, on an alternating ``P`` step, ``P``), ``n x r``.
            right: ``Q`` (or, on an alternating ``P`` step, ``Q_hat``), ``m x r``.
            finite: a boolean scalar tensor, whether the bucket's results are finite.
        """
        if gradient.dtype == torch.float32:
            torch.mm(left, right.T, out=gradient)
            m.addmm_(left, right.T, alpha=-1.0)
        else:
            approximation = left @ right.T
            gradient.copy_(approximation)
            m.sub_(approximation)
        previous = self.errors.get(slot.name)
        if m.device.type == "cpu":
            if bool(finite):
                # Swap: the new error is M's buffer, and the old error's buffer holds the next M.
                self.errors[slot.name] = m
                if previous is None:
                    del self.scratch[slot.name]
                else:
                    self.scratch[slot.name] = previous
            return
        # On CUDA a host check would synchronise the streams.
        self.errors[slot.name] = torch.where(finite, m, previous if previous is not None else torch.zeros_like(m))

    def keep_factor(self, kept: dict[str, Tensor], name: str, factor: Tensor, finite: Tensor) -> None:
        """Keep ``factor`` (made contiguous) as ``kept[name]``, which exists already, if ``finite``."""
        factor = factor.contiguous()
        if factor.device.type == "cpu":
            if bool(finite):
                kept[name] = factor
            return
        kept[name] = torch.where(finite, factor, kept[name])


@dataclass
class PlanCache:
    """The layouts ``low_rank`` makes once and reuses: each bucket's slots and plan, and the whole step's plan.

    Args:
        slots: a bucket's slots by its parameters' names.
        buckets: a bucket's plan by its slots, dtype and device.
        step: the whole-step plan (one is kept), with its buffers and CUDA graphs.
        step_key: what ``step`` was made for: every bucket's slots and the device.
    """

    slots: dict[tuple[str, ...], list[TensorSlot]] = field(default_factory=dict)
    buckets: dict[tuple[Any, ...], BucketPlan] = field(default_factory=dict)
    step: StepPlan | None = None
    step_key: tuple[Any, ...] | None = None


@dataclass
class LowRankState(HookState):
    """State of :func:`low_rank_hook`.

    Beyond :class:`HookState`'s ``groups``, ``counter`` and ``executor``, the options, then what training changes:

    Args:
        rank: the factors' rank ``r``.
        warmup_steps: steps all-reduced at full precision before compression starts.
        average: divide by the number of ranks.
        alternate: exchange ``P`` and ``Q`` in turn, one per step.
        hierarchical: whether the user asked for two levels.
        full_precision_only: hierarchical on one node: every step is a full-precision all-reduce.
        whole_step: reduce each step's buckets together (:func:`reduce_step`).
        full_precision: the state of the full-precision all-reduce (warm-up).
        names: parameter name by ``id`` of the parameter.
        device: where the factors and errors live.
        codec: the 8-bit codec.
        steps: steps whose last bucket has been handed over.
        exchange_left: with ``alternate``, whether the step being reduced exchanges ``P`` (else ``Q``).
        last_compressed: whether the last bucket handed over was compressed (``None`` before one).
        memory: the errors and factors kept between steps (built from ``rank`` and ``device``).
        plans: the cached layouts.
        batcher: holds a step's buckets for the whole-step path.
    """

    rank: int = 8
    warmup_steps: int = 10
    average: bool = True
    alternate: bool = False
    hierarchical: bool = True
    full_precision_only: bool = False
    whole_step: bool = False
    full_precision: GradientAllReduceState | None = None
    names: dict[int, str] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    codec: MinMaxUInt8Codec = field(default_factory=MinMaxUInt8Codec)
    steps: int = 0
    exchange_left: bool = True
    last_compressed: bool | None = None
    memory: FactorMemory = field(init=False)
    plans: PlanCache = field(default_factory=PlanCache, repr=False)
    batcher: "StepBatcher" = field(default_factory=lambda: StepBatcher(), repr=False)

    def __post_init__(self) -> None:
        self.memory = FactorMemory(self.rank, self.device)

    def plan(self, parameters: Sequence[Tensor], element_size: int) -> list[TensorSlot]:
        """Return the slots of a bucket's parameters, in bucket order (cached per layout)."""
        names = tuple(self.names[id(parameter)] for parameter in parameters)
        slots = self.plans.slots.get(names)
        if slots is None:
            slots, offset = [], 0
            for name, parameter in zip(names, parameters, strict=True):
                slots.append(plan_slot(name, offset, parameter.shape, self.rank, element_size, self.codec))
                offset += parameter.numel()
            self.plans.slots[names] = slots
        return slots

    def bucket_plan(self, slots: list[TensorSlot], tensor: Tensor) -> BucketPlan:
        """Return how a bucket laid out as ``slots`` travels (cached per layout, dtype and device)."""
        key = (tuple(slots), tensor.dtype, tensor.device)
        plan = self.plans.buckets.get(key)
        if plan is None:
            plan = self.plans.buckets[key] = plan_bucket(slots, tensor, self.rank, self.codec)
        return plan

    def step_plan(self, layouts: Sequence[Sequence[TensorSlot]], device: torch.device) -> StepPlan:
        """Return the whole-step plan of a step laid out in ``layouts``, bound to the memory's errors and factors.

        One plan is kept: another layout (DDP's rebuilt buckets) makes a new one, which takes over the errors and
        factors by parameter name.
        """
        key = (tuple(tuple(slots) for slots in layouts), device)
        if self.plans.step is None or key != self.plans.step_key:
            plan = StepPlan(layouts, self.rank, self.codec, device)
            plan.bind(self.memory.errors, self.memory.factors)
            self.forget_step_plan()
            self.plans.step, self.plans.step_key = plan, key
        return self.plans.step

    def forget_step_plan(self) -> None:
        """Drop the whole-step plan, so that the next step binds a new one to the errors and factors held now.

        A plan whose CUDA graphs were captured waits for its device first: a replay may still be running, and the
        graphs' memory goes back to the allocator with them.
        """
        plan = self.plans.step
        if plan is not None and plan.graphs.captured:
            torch.cuda.synchronize(plan.device)
        self.plans.step = self.plans.step_key = None


def low_rank_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one bucket of gradients through rank-``r`` factors (:func:`power_step_`).

    During the first ``warmup_steps`` steps (and always with ``hierarchical=True`` on one node) the bucket is
    all-reduced at full precision, as ``gradient_allreduce`` does. After that it goes to the executor, which runs
    :func:`reduce_bucket` in bucket order, or (``whole_step``) to the :class:`StepBatcher`, which reduces the whole
    step once the last bucket arrives.

    Args:
        state: the groups, counter, executor, codec and per-parameter factors and errors.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A future of the reduced bucket.
    """
    compressed = state.steps >= state.warmup_steps and not state.full_precision_only
    state.last_compressed = compressed
    # The same for every bucket of a step: the step's jobs all finish before the next step's first hook.
    state.exchange_left = (state.steps - state.warmup_steps) % 2 == 0
    step = state.steps
    if bucket.is_last():
        state.steps += 1
    if not compressed:
        assert state.full_precision is not None
        return gradient_allreduce_hook(state.full_precision, bucket)
    buffer = bucket.buffer()
    slots = state.plan(bucket.parameters(), buffer.element_size())
    if state.whole_step:
        return state.batcher.add(state, buffer, slots, step, last=bucket.is_last())
    # Looked up at call time, so that a test can observe every bucket's input and output.
    return state.executor.submit(lambda: reduce_bucket(state, buffer, slots), last=bucket.is_last())


def reduce_bucket(state: LowRankState, buffer: Tensor, slots: list[TensorSlot]) -> Tensor:
    """Reduce ``buffer`` (laid out as ``slots``) over all ranks the way ``state`` says and return it (blocking)."""
    groups = state.groups
    if groups.is_hierarchical:
        ranks_per_node = groups.layout.ranks_per_node
        num_nodes = groups.layout.num_nodes

        def inter_node(node_sum: Tensor) -> None:
            if state.average:
                node_sum.div_(ranks_per_node)  # the node's mean; the nodes' mean of means is the global mean
            low_rank_reduce_(node_sum, slots, groups.inter_node, num_nodes, state)

        return all_reduce_hierarchically(buffer, groups, state.counter, inter_node)
    return low_rank_reduce_(buffer, slots, groups.flat, groups.world_size, state)


def low_rank_reduce_(
    tensor: Tensor, slots: list[TensorSlot], group: dist.ProcessGroup | None, n: int, state: LowRankState
) -> Tensor:
    """Reduce one bucket among the ``n`` ranks of ``group``, in place: :func:`power_step_`, or the alternating form.

    The path the CPU takes by default: a bucket's collectives block on Gloo, so the engine's ordered executor runs
    them off the training thread while backward goes on.

    Args:
        tensor: this participant's flat bucket; overwritten with the result.
        slots: where each gradient lives in ``tensor`` and whether it factors.
        group: the group to exchange over.
        n: the size of ``group``.
        state: the codec, counter, factors and errors.

    Returns:
        ``tensor``.
    """
    plan = state.bucket_plan(slots, tensor)
    if state.alternate:
        _alternating_reduce_(tensor, plan, group, n, state)
    else:
        power_step_(state, _BucketBatch(state, plan, tensor), group, n)
    return tensor


class StepBatcher:
    """Hold a step's buckets until the last, then reduce them together (:func:`reduce_pending`).

    Each bucket gets a future at once; all of them complete when the last bucket's hook has reduced the step. DDP's
    reducer waits on the futures only after backward, by when the last bucket has been handed over.

    With two levels, each bucket's intra-node reduce to the node leader starts when the bucket arrives.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, list[TensorSlot], torch.futures.Future]] = []
        self._step = -1

    def add(
        self, state: LowRankState, buffer: Tensor, slots: list[TensorSlot], step: int, last: bool
    ) -> torch.futures.Future:
        """Take one bucket of step ``step``; on the ``last`` one, reduce the step (blocking on Gloo).

        Args:
            state: the algorithm's state.
            buffer: the bucket's flat gradients; overwritten with the result.
            slots: where each gradient lives in ``buffer``.
            step: the step the bucket belongs to. Buckets left from a step whose backward never reached its
                last bucket (it failed) are dropped.
            last: whether this is the step's last bucket.

        Returns:
            A future of ``buffer``, completed when the step is reduced (failed with the error if it fails).
        """
        if step != self._step:
            self._pending, self._step = [], step
        groups = state.groups
        if groups.is_hierarchical:
            nbytes = buffer.numel() * buffer.element_size()
            state.counter.record("reduce", buffer, received=nbytes if groups.is_node_leader else 0)
            dist.reduce(buffer, dst=groups.node_leader_global_rank, op=dist.ReduceOp.SUM, group=groups.intra_node)
        future: torch.futures.Future = (
            torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        )
        self._pending.append((buffer, slots, future))
        if not last:
            return future
        pending, self._pending = self._pending, []
        # On the executor's stream: off backward's, and one a CUDA graph can be captured on. The futures completed
        # there make DDP's reducer wait for it.
        with state.executor.side_stream():
            try:
                reduce_pending(state, [buffer for buffer, _, _ in pending], [slots for _, slots, _ in pending])
            except BaseException as error:  # a failed collective must reach the reducer through every future
                for _, _, waiting in pending:
                    waiting.set_exception(error)
            else:
                for result, _, waiting in pending:
                    waiting.set_result(result)
        return future


def reduce_pending(state: LowRankState, buffers: list[Tensor], layouts: list[list[TensorSlot]]) -> None:
    """Reduce a step's buckets over all ranks, in place: flat, or the node leaders' sums then a broadcast."""
    groups = state.groups
    if not groups.is_hierarchical:
        reduce_step(state, buffers, layouts, groups.flat, groups.world_size)
        return
    leader = groups.node_leader_global_rank
    if groups.is_node_leader:
        if state.average:
            # The node's mean; the nodes' mean of means is the global mean.
            torch._foreach_div_(buffers, float(groups.layout.ranks_per_node))
        reduce_step(state, buffers, layouts, groups.inter_node, groups.layout.num_nodes)
    for buffer in buffers:
        nbytes = buffer.numel() * buffer.element_size()
        state.counter.record("broadcast", buffer, received=0 if groups.is_node_leader else nbytes)
        dist.broadcast(buffer, src=leader, group=groups.intra_node)


def reduce_step(
    state: LowRankState,
    buffers: list[Tensor],
    layouts: list[list[TensorSlot]],
    group: dist.ProcessGroup | None,
    n: int,
) -> None:
    """Reduce a whole step's buckets together among the ``n`` ranks of ``group``: :func:`power_step_` by shape.

    On CUDA the per-bucket path is bound by the host: each bucket launches a few kernels per gradient. Here the
    gradients of one shape, wherever they sit in the buckets, take one batched matmul per shape and side; those
    with the same row count one orthonormalisation; the step two all-gathers in all, each message coded in one
    pass. Copies in and out of the buckets are multi-tensor. What the step gives up is overlap of the exchange
    with backward. The messages, codes and math are the per-bucket path's, tensor by tensor; only the order on the
    wire differs (by shape), and the exact tensors always travel as float32.

    The two halves of :func:`power_step_` around its second exchange work only on the plan's buffers, so on CUDA
    each is captured once as a graph and replayed: two launches where eagerly there are a few hundred. The second
    exchange stays eager between them, which keeps every step's last collective in view of NCCL's watchdog: if a
    peer is lost during the first half's replay, the eager exchange queued behind it on the same communicator
    times out, and the watchdog's abort of the communicator ends the replay too.

    Args:
        state: the algorithm's state (its step plan, counter, codec, executor and options).
        buffers: the step's buckets; overwritten with the result.
        layouts: each bucket's slots.
        group: the group to exchange over.
        n: the size of ``group``.
    """
    plan = state.step_plan(layouts, buffers[0].device)
    batch = _StepBatch(plan, buffers)
    # With nothing to factor the step is one exchange, which must stay eager (see above).
    graphed = state.executor.cuda_graphs and plan.q_layout is not None

    def run(half: str, job: Callable[[], None]) -> None:
        if graphed:
            plan.graphs.run_in_place(half, job, state.counter, f"low_rank's {half} of a step")
        else:
            job()

    batch.copy_in()
    power_step_(state, batch, group, n, run)
    batch.copy_out()


def power_step_(
    state: LowRankState,
    batch: "_BucketBatch | _StepBatch",
    group: dist.ProcessGroup | None,
    n: int,
    run: Callable[[str, Callable[[], None]], None] = lambda half, job: job(),
) -> None:
    """Reduce a batch of gradients (one bucket, or a whole step) through rank-``r`` factors, in place.

    `PowerSGD <https://arxiv.org/abs/1905.13727>`_ (Vogels et al., 2019), one step of power iteration warm-started
    from the last step's factor, with error feedback and 8-bit factors. Among the ``N`` participants (the ranks,
    or the node leaders holding their node's mean or sum when two-level), for every gradient ``G_i`` of
    participant ``i`` that factors, reshaped to ``n x m``, with its error ``e_i`` (zero at first) and the
    warm-start ``Q`` (``m x r``, the same on every participant; at first standard normal from
    :func:`~._factors.factor_seed`, orthonormalised):

    1. Add the error: ``M_i = G_i + e_i``.
    2. Project: ``P_i = M_i Q`` (``n x r``).
    3. First collective, one all-gather: every participant sends the exact bytes of the gradients that do not
       factor followed by the 8-bit codes of all its ``P_i`` (``P_i^T`` flattened, about one range per 1024
       elements of a column). Each participant decodes every row and sums in participant order:
       ``P = sum_i D(C(P_i))``, and for the exact tensors ``G = sum_i G_i`` (divided by ``N`` if ``average``).
    4. Orthonormalise: ``P_hat = orth(P)`` (:func:`~._factors.orthonormalise_columns`), batched over the
       gradients with the same row count; a column with nothing left stays zero. ``P``'s scale does not matter,
       so it is not averaged.
    5. Project back: ``Q_i = M_i^T P_hat`` (``m x r``).
    6. Second collective, one all-gather of the 8-bit codes of all ``Q_i``: ``Q = sum_i D(C(Q_i))``, divided by
       ``N`` if ``average``.
    7. Reconstruct: ``G_hat = P_hat Q^T`` is written into the buckets; ``e_i = M_i - G_hat`` and ``Q`` are kept
       for the next step. If ``G_hat`` is not finite (an overflowing gradient a ``GradScaler`` will skip), the
       batch's ``e_i`` and ``Q`` keep their previous values (checked on the factors: ``P`` finite and
       ``|Q| < float32 max / r``).

    Every participant decodes the same bytes in the same order, so all of them hold the same ``P_hat``, ``Q`` and
    ``G_hat``; only ``e_i`` differs between participants. The codec chunks are per gradient, so the result does
    not depend on how the gradients were cut into buckets beyond float rounding.

    A bucket (:class:`_BucketBatch`) takes one matmul per gradient, in bucket order; a whole step
    (:class:`_StepBatch`) one batched matmul per shape, in its plan's buffers.

    Args:
        state: the counter, options and kept factors.
        batch: the gradients and where their factors go.
        group: the group to exchange over.
        n: the size of ``group``.
        run: runs each half around the second exchange (the whole-step path replays them as CUDA graphs).
    """

    def first_half() -> None:
        # Step 1.
        batch.add_errors()
        # Step 2: P_i^T = Q^T M_i^T straight into the flat factor buffer.
        for q_t, m, p_t in zip(batch.kept_q_t(), batch.m_blocks(), batch.p_blocks(), strict=True):
            _matmul(q_t, m.mT, out=p_t)
        # Step 3: [exact bytes | P codes], one all-gather.
        message = batch.first_message()
        if batch.p_layout is not None:
            batch.p_layout.encode_into(batch.p, message)
        gathered = all_gather_bytes(message, group, n, state.counter, batch.first_share)
        batch.reduce_exact(gathered, n, state.average)
        if batch.p_layout is None or batch.q_layout is None:
            return
        batch.receive_p(batch.p_layout.decode_sum(gathered))
        # Step 4.
        batch.orthonormalise_p()
        # Step 5: Q_i^T = P_hat^T M_i, then the codes of step 6.
        q_flat = torch.empty(batch.q_elements, dtype=torch.float32, device=batch.p.device)
        for p_hat, m, q_t in zip(batch.p_hats(), batch.m_blocks(), batch.q_blocks(q_flat), strict=True):
            _matmul(p_hat.mT, m, out=q_t)
        batch.q_layout.encode_into(q_flat, batch.second_message)

    def second_half(gathered: Tensor) -> None:
        assert batch.q_layout is not None
        q_sums = batch.q_layout.decode_sum(gathered)
        if state.average:
            q_sums.div_(n)
        # Step 7.
        batch.reconstruct(q_sums, finite_factors(batch.p, q_sums, state.rank))

    run("first half", first_half)
    if batch.q_layout is None:
        return
    # Step 6: the second all-gather, always eager.
    out = batch.second_gathered(n)
    gathered = all_gather_bytes(batch.second_message, group, n, state.counter, batch.second_share, out)
    run("second half", lambda: second_half(gathered))


class _BucketBatch:
    """One bucket's gradients for :func:`power_step_`: one matmul per gradient, ``M`` in the memory's scratch."""

    def __init__(self, state: LowRankState, plan: BucketPlan, tensor: Tensor) -> None:
        self.memory, self.plan, self.tensor, self.rank = state.memory, plan, tensor, state.rank
        self.views = _gradient_views(plan, tensor)
        self.p = torch.empty(plan.p_elements, dtype=torch.float32, device=tensor.device)
        self.p_layout, self.q_layout, self.q_elements = plan.p_layout, plan.q_layout, plan.q_elements
        self.first_share, self.second_share = plan.first_share, plan.bucket_bytes - plan.first_share
        self.second_message = torch.zeros(plan.second_message_bytes, dtype=torch.uint8, device=tensor.device)
        self._m: list[Tensor] = []
        self._p_hats: list[Tensor] = []

    def add_errors(self) -> None:
        self._m = [self.memory.corrected(slot, view) for slot, view in zip(self.plan.factored, self.views, strict=True)]

    def m_blocks(self) -> list[Tensor]:
        return self._m

    def kept_q_t(self) -> list[Tensor]:
        return [self.memory.factor(slot).T for slot in self.plan.factored]

    def p_blocks(self) -> list[Tensor]:
        return _factor_views(self.p, self.plan.p_offsets, self.plan.p_sizes, self.rank)

    def q_blocks(self, flat: Tensor) -> list[Tensor]:
        return _factor_views(flat, self.plan.q_offsets, self.plan.q_sizes, self.rank)

    def first_message(self) -> Tensor:
        return _message_with_exact(self.tensor, self.plan, self.plan.first_message_bytes)

    def reduce_exact(self, gathered: Tensor, n: int, average: bool) -> None:
        _reduce_exact(self.tensor, self.plan, gathered, n, average)

    def receive_p(self, p_sums: Tensor) -> None:
        self.p = p_sums

    def orthonormalise_p(self) -> None:
        plan = self.plan
        self._p_hats = _orthonormalised(self.p, plan.p_offsets, plan.p_sizes, plan.same_rows, self.rank)

    def p_hats(self) -> list[Tensor]:
        return self._p_hats

    def second_gathered(self, n: int) -> None:
        return None

    def reconstruct(self, q_sums: Tensor, finite: Tensor) -> None:
        for slot, view, m, p_hat, q_t in zip(
            self.plan.factored, self.views, self._m, self._p_hats, self.q_blocks(q_sums), strict=True
        ):
            self.memory.finish(slot, view, m, p_hat, q_t.T, finite)
            self.memory.keep_factor(self.memory.factors, slot.name, q_t.T, finite)


class _StepBatch:
    """A whole step for :func:`power_step_`: one batched matmul per shape, everything in the plan's buffers.

    It keeps nothing of its own between the halves, which a CUDA graph replays without running this code.
    """

    def __init__(self, plan: StepPlan, buffers: list[Tensor]) -> None:
        self.plan = plan
        self.p, self.p_layout, self.q_layout, self.q_elements = plan.p, plan.p_layout, plan.q_layout, plan.q_elements
        self.first_share, self.second_share = plan.uncompressed_shares(buffers[0].element_size())
        self.second_message = plan.second_message
        self.gradients = plan.gradient_views(buffers)
        self.exact = plan.exact_views(buffers)

    def copy_in(self) -> None:
        """Copy the gradients into ``M``'s buffer and the exact ones into the first message's head."""
        plan = self.plan
        if self.gradients:
            torch._foreach_copy_(plan.matrices(plan.m), self.gradients)
        if self.exact:
            torch._foreach_copy_(plan.split_exact(plan.exact_values()), self.exact)

    def copy_out(self) -> None:
        """Copy the exact gradients' reduced values and every ``G_hat`` back into the buckets."""
        plan = self.plan
        if self.exact:
            torch._foreach_copy_(self.exact, plan.split_exact(plan.exact_sum))
        if plan.q_layout is not None:
            torch._foreach_copy_(self.gradients, plan.matrices(plan.approximation))

    def add_errors(self) -> None:
        if self.plan.factored:
            self.plan.m.add_(self.plan.errors)

    def m_blocks(self) -> list[Tensor]:
        return [self.plan.group_block(self.plan.m, group, "m") for group in self.plan.groups]

    def kept_q_t(self) -> list[Tensor]:
        return [self.plan.group_block(self.plan.q, group, "q") for group in self.plan.groups]

    def p_blocks(self) -> list[Tensor]:
        return [self.plan.group_block(self.plan.p, group, "p") for group in self.plan.groups]

    def q_blocks(self, flat: Tensor) -> list[Tensor]:
        return [self.plan.group_block(flat, group, "q") for group in self.plan.groups]

    def first_message(self) -> Tensor:
        return self.plan.first_message

    def reduce_exact(self, gathered: Tensor, n: int, average: bool) -> None:
        plan = self.plan
        if plan.exact:
            plan.exact_sum.copy_(_exact_sum(gathered, plan.exact_elements * _FLOAT32_BYTES, torch.float32, n, average))

    def receive_p(self, p_sums: Tensor) -> None:
        self.plan.p.copy_(p_sums)

    def orthonormalise_p(self) -> None:
        # Each batch holds P^T, so its columns are the transposed view's.
        rank = self.plan.rank
        for batch in self.plan.row_batches:
            block = self.plan.p[batch.p_offset : batch.p_offset + batch.count * rank * batch.rows]
            factors.orthonormalise_columns(block.view(batch.count, rank, batch.rows).transpose(1, 2))

    def p_hats(self) -> list[Tensor]:
        return [block.transpose(1, 2) for block in self.p_blocks()]

    def second_gathered(self, n: int) -> Tensor:
        return self.plan.gathered_second(n)

    def reconstruct(self, q_sums: Tensor, finite: Tensor) -> None:
        plan = self.plan
        for group, p_hat in zip(plan.groups, self.p_hats(), strict=True):
            torch.bmm(p_hat, plan.group_block(q_sums, group, "q"), out=plan.group_block(plan.approximation, group, "m"))
        plan.m.sub_(plan.approximation)
        torch.where(finite, plan.m, plan.errors, out=plan.errors)
        torch.where(finite, q_sums, plan.q, out=plan.q)


def _alternating_reduce_(
    tensor: Tensor, plan: BucketPlan, group: dist.ProcessGroup | None, n: int, state: LowRankState
) -> None:
    """Reduce ``tensor`` exchanging one factor, ``P`` or ``Q`` as ``state.exchange_left`` says, in place.

    ACP-SGD ("alternate compressed PowerSGD", from *Evaluation and Optimization of Gradient Compression for
    Distributed Deep Learning*) alternates :func:`power_step_`'s two half-steps between training steps, so each step
    takes one collective. Among the ``n`` participants, for every gradient ``G_i`` that factors, with its error
    ``e_i`` and the orthonormal factors ``Q_hat`` (``m x r``) and ``P_hat`` (``n x r``) the last steps kept (at
    first ``Q_hat`` from :func:`~._factors.factor_seed`, as :func:`power_step_`):

    1. Add the error: ``M_i = G_i + e_i``.
    2. On a ``P`` step (the first compressed step, then every other one): ``P_i = M_i Q_hat``. On a ``Q`` step:
       ``Q_i = M_i^T P_hat``.
    3. One all-gather per bucket of ``[exact bytes | 8-bit codes of the P_i (or Q_i)]``; every participant decodes
       every row and sums in participant order, divided by ``n`` if ``average``: ``P = sum_i D(C(P_i)) / n``.
    4. Reconstruct: ``G_hat = P Q_hat^T`` (``Q`` step: ``G_hat = P_hat Q^T``), the mean of the ``M_i`` projected on
       the kept factor's span; ``e_i = M_i - G_hat``.
    5. Keep ``P_hat = orth(P)`` (``Q`` step: ``Q_hat = orth(Q)``) for the next step. A bucket whose result is not
       finite (``|P| >= float32 max / r``, or NaN) keeps its previous errors and factors.
    """
    memory = state.memory
    rank = state.rank
    left_step = state.exchange_left
    sizes, offsets, layout, message_bytes, batches = plan.alternating_side(left_step)
    if left_step:
        kept, store = [memory.factor(slot) for slot in plan.factored], memory.left_factors
    else:
        kept, store = [memory.left_factor(slot) for slot in plan.factored], memory.factors
    views = _gradient_views(plan, tensor)

    # Steps 1-2: P_i^T = Q_hat^T M_i^T (or Q_i^T = P_hat^T M_i) straight into the flat factor buffer.
    corrected = [memory.corrected(slot, view) for slot, view in zip(plan.factored, views, strict=True)]
    flat = torch.empty(sum(sizes) * rank, dtype=torch.float32, device=tensor.device)
    for m, factor, out in zip(corrected, kept, _factor_views(flat, offsets, sizes, rank), strict=True):
        torch.mm(factor.T, m.T if left_step else m, out=out)

    # Step 3.
    message = _message_with_exact(tensor, plan, message_bytes)
    if layout is not None:
        layout.encode_into(flat, message)
    gathered = all_gather_bytes(message, group, n, state.counter, plan.bucket_bytes)
    _reduce_exact(tensor, plan, gathered, n, state.average)
    if layout is None:
        return
    sums = layout.decode_sum(gathered)
    if state.average:
        sums.div_(n)

    # Step 4, then step 5 in place on the sums (G_hat is written by then).
    finite = bounded(sums, rank)
    received = _factor_views(sums, offsets, sizes, rank)
    for slot, view, m, factor, factor_t in zip(plan.factored, views, corrected, kept, received, strict=True):
        left, right = (factor_t.T, factor) if left_step else (factor, factor_t.T)
        memory.finish(slot, view, m, left, right, finite)
    hats = _orthonormalised(sums, offsets, sizes, batches, rank)
    for slot, hat in zip(plan.factored, hats, strict=True):
        if left_step:
            memory.left_factor(slot)  # a previous P_hat to keep if this step is not finite
        memory.keep_factor(store, slot.name, hat, finite)


def _matmul(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a b``: ``torch.mm`` for one gradient's matrices, ``torch.bmm`` for a shape's batch of them."""
    if a.dim() == 2:
        torch.mm(a, b, out=out)
    else:
        torch.bmm(a, b, out=out)


def _gradient_views(plan: BucketPlan, tensor: Tensor) -> list[Tensor]:
    """Each factored gradient of a bucket, ``rows x cols``, in bucket order."""
    return [tensor[slot.offset : slot.offset + slot.numel].view(slot.rows, slot.cols) for slot in plan.factored]


def _factor_views(flat: Tensor, offsets: list[int], sizes: list[int], rank: int) -> list[Tensor]:
    """Each factor in ``flat``, stored transposed: ``r`` rows of its length."""
    return [flat[offset : offset + size * rank].view(rank, size) for offset, size in zip(offsets, sizes, strict=True)]


def _message_with_exact(tensor: Tensor, plan: BucketPlan, nbytes: int) -> Tensor:
    """A zeroed ``nbytes`` message that starts with the exact bytes of the bucket's tensors that do not factor."""
    message = torch.zeros(nbytes, dtype=torch.uint8, device=tensor.device)
    if plan.exact_index is not None:
        message[: plan.exact_bytes] = tensor.take(plan.exact_index).view(torch.uint8)
    return message


def _reduce_exact(tensor: Tensor, plan: BucketPlan, gathered: Tensor, n: int, average: bool) -> None:
    """Write the in-order sum (mean if ``average``) of the gathered exact bytes into their places in ``tensor``."""
    if plan.exact_index is None:
        return
    exact_sum = _exact_sum(gathered, plan.exact_bytes, tensor.dtype, n, average)
    tensor.index_copy_(0, plan.exact_index, exact_sum.to(tensor.dtype))


def _exact_sum(gathered: Tensor, nbytes: int, dtype: torch.dtype, n: int, average: bool) -> Tensor:
    """The in-order float32 sum (mean if ``average``) of every gathered row's first ``nbytes``, read as ``dtype``."""
    exact_sum = sum_in_order(gathered[:, :nbytes].view(dtype).float())
    if average:
        exact_sum.div_(n)
    return exact_sum


def _orthonormalised(
    flat: Tensor, offsets: list[int], sizes: list[int], batches: list[list[int]], rank: int
) -> list[Tensor]:
    """Orthonormalise the factors in ``flat`` (each stored transposed: ``r`` rows of its length), batch by batch.

    ``batches`` groups the factors of the same length, so that each group takes a few launches, not one per factor.
    A lone factor is orthonormalised in place, as a batch of one.

    Returns:
        One ``length x r`` matrix per factor.
    """
    hats: list[Tensor] = [flat] * len(sizes)
    for members in batches:
        size = sizes[members[0]]
        columns = [flat[offsets[i] : offsets[i] + size * rank].view(rank, size).T for i in members]
        stacked = torch.stack(columns) if len(columns) > 1 else columns[0].unsqueeze(0)
        factors.orthonormalise_columns(stacked)
        for position, i in enumerate(members):
            hats[i] = stacked[position]
    return hats
