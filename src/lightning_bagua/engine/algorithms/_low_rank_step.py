"""``low_rank``'s whole-step path: every bucket of a step reduced together, once backward has handed over the last.

On CUDA the per-bucket path is bound by the host, not by the device: each bucket of each step launches a few kernels
per gradient (its error, its two projections, its reconstruction) and the host cannot issue them as fast as the
GPU runs them. On two GPUs a 134M-parameter model took about 7,400 launches a step that way. Here the hook only
records each bucket (with two levels it also starts the bucket's intra-node reduce, which overlaps backward) and
returns a future; when DDP hands over the step's last bucket, the whole step is reduced at once:

* gradients of the same shape, wherever they sit in the buckets, are factored with one batched matmul
  (``torch.bmm``) per shape and side; copies in and out of the buckets are multi-tensor (``torch._foreach_copy_``);
* gradients with the same row count are orthonormalised as one batch;
* the step takes two all-gathers in all, not two per bucket, and each message is coded in one pass.

The launches per step then depend on the number of distinct shapes, not on the number of gradients or buckets.
The messages, the codes and the math are those of the per-bucket path (:func:`.low_rank.low_rank_hook`), tensor by
tensor; only the order of the gradients on the wire differs (grouped by shape), and the exact tensors always travel
as float32. What the step gives up is overlap between the factor exchange and backward, which on a link slow
enough for ``low_rank`` to pay is worth less than the host time it saves.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine._codec_segments import SegmentLayout, segment_backend
from lightning_bagua.engine._cuda_graphs import BucketGraphs
from lightning_bagua.engine._executor import OrderedExecutor
from lightning_bagua.engine.algorithms import _low_rank_factors as factors
from lightning_bagua.engine.algorithms._low_rank_factors import (
    ALIGNMENT,
    TensorSlot,
    all_gather_bytes,
    finite_factors,
    initial_factor,
    sum_in_order,
)
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import CommunicationCounter, CommunicationGroups

__all__ = ["ShapeGroup", "StepBatcher", "StepPlan", "StepState", "reduce_pending", "reduce_step"]


class StepState(Protocol):
    """What the whole-step path reads and keeps (:class:`~.low_rank.LowRankState` provides it).

    A protocol rather than the state class itself, so that this module does not import the one that imports it.
    """

    average: bool
    counter: CommunicationCounter
    executor: OrderedExecutor
    groups: CommunicationGroups
    errors: dict[str, Tensor]
    factors: dict[str, Tensor]

    def step_plan(self, layouts: Sequence[Sequence[TensorSlot]], device: torch.device) -> "StepPlan": ...


_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ShapeGroup:
    """Gradients of one shape, side by side in every buffer of a :class:`StepPlan`.

    Args:
        rows: ``n``, the gradients' first dimension.
        cols: ``m``, the product of the others.
        first: the index of the group's first gradient in the plan's wire order.
        count: how many gradients the group holds.
        m_offset: where the group starts in the ``M``, error and ``G_hat`` buffers (``count x n x m``).
        p_offset: where it starts in the ``P`` buffers (``count x r x n``: each ``P^T``).
        q_offset: where it starts in the ``Q`` buffers (``count x r x m``: each ``Q^T``).
    """

    rows: int
    cols: int
    first: int
    count: int
    m_offset: int
    p_offset: int
    q_offset: int


@dataclass(frozen=True)
class RowBatch:
    """Consecutive shape groups with the same row count: their ``P^T`` are one ``(count, r, rows)`` block."""

    rows: int
    count: int
    p_offset: int


class StepPlan:
    """How a step laid out in given buckets travels, and the buffers its factors and errors live in.

    Made once per bucket layout (DDP rebuilds its buckets after the first step, so usually twice a run). The
    factored gradients are ordered by shape, ``(rows, cols)`` ascending, then by bucket and offset, so that each
    shape's gradients are one batch in every buffer and each row count's ``P`` one orthonormalisation batch.

    Args:
        layouts: every bucket's slots, in bucket order.
        rank: the factors' rank ``r``.
        codec: the 8-bit codec.
        device: where the buffers live.
    """

    def __init__(
        self, layouts: Sequence[Sequence[TensorSlot]], rank: int, codec: MinMaxUInt8Codec, device: torch.device
    ) -> None:
        self.rank = rank
        placed = [(bucket, slot) for bucket, slots in enumerate(layouts) for slot in slots]
        self.factored = sorted((item for item in placed if item[1].factored), key=lambda i: (i[1].rows, i[1].cols))
        self.exact = [item for item in placed if not item[1].factored]
        self.exact_elements = sum(slot.numel for _, slot in self.exact)
        self.groups: list[ShapeGroup] = []
        self.row_batches: list[RowBatch] = []
        m_offset = p_offset = q_offset = 0
        for index, (_, slot) in enumerate(self.factored):
            last = self.groups[-1] if self.groups else None
            if last is not None and (last.rows, last.cols) == (slot.rows, slot.cols):
                self.groups[-1] = ShapeGroup(
                    last.rows, last.cols, last.first, last.count + 1, last.m_offset, last.p_offset, last.q_offset
                )
            else:
                self.groups.append(ShapeGroup(slot.rows, slot.cols, index, 1, m_offset, p_offset, q_offset))
            batch = self.row_batches[-1] if self.row_batches else None
            if batch is not None and batch.rows == slot.rows:
                self.row_batches[-1] = RowBatch(batch.rows, batch.count + 1, batch.p_offset)
            else:
                self.row_batches.append(RowBatch(slot.rows, 1, p_offset))
            m_offset += slot.numel
            p_offset += slot.rows * rank
            q_offset += slot.cols * rank
        self.m_elements, self.p_elements, self.q_elements = m_offset, p_offset, q_offset
        exact_bytes = self.exact_elements * _FLOAT32_BYTES
        start = exact_bytes + -exact_bytes % ALIGNMENT
        self.p_layout: SegmentLayout | None = None
        self.q_layout: SegmentLayout | None = None
        if self.factored:
            backend = segment_backend(codec)
            slots = [slot for _, slot in self.factored]
            self.p_layout = SegmentLayout([(s.rows * rank, s.p_chunks) for s in slots], start, codec.eps, backend)
            self.q_layout = SegmentLayout([(s.cols * rank, s.q_chunks) for s in slots], 0, codec.eps, backend)
        first = start + (0 if self.p_layout is None else self.p_layout.nbytes)
        second = 0 if self.q_layout is None else self.q_layout.nbytes
        self.first_message_bytes = first + -first % ALIGNMENT
        self.second_message_bytes = second + -second % ALIGNMENT
        self.device = device
        # Allocated by bind(): M = G + e, the errors e, G_hat, P^T (then P_hat^T), the kept Q^T, the two outgoing
        # messages, the exact gradients' reduced values and the gathered second messages.
        self.m = self.errors = self.approximation = self.p = self.q = torch.empty(0)
        self.first_message = self.second_message = self.exact_sum = self.second_gathered = torch.empty(0)
        # The step's two halves around the second exchange, replayed as CUDA graphs on the plan's own buffers.
        self.graphs = BucketGraphs()

    def uncompressed_shares(self, element_size: int) -> tuple[int, int]:
        """What DDP would send for the step, split between the two messages in proportion to what each carries."""
        total = sum(slot.numel for _, slot in self.factored) + self.exact_elements
        first = self.exact_elements * element_size + sum(
            slot.numel * element_size * slot.rows // (slot.rows + slot.cols) for _, slot in self.factored
        )
        return first, total * element_size - first

    def bind(self, state: StepState) -> None:
        """Allocate the buffers, take each gradient's error and warm start from ``state``, and lend it views back.

        ``state.errors`` and ``state.factors`` then hold views into this plan's buffers, by parameter name, so that
        the algorithm's checkpoints read (and a later plan takes over) what this one keeps.
        """
        rank, device = self.rank, self.device
        self.m = torch.empty(self.m_elements, dtype=torch.float32, device=device)
        self.approximation = torch.empty_like(self.m)
        self.errors = torch.zeros_like(self.m)
        self.p = torch.empty(self.p_elements, dtype=torch.float32, device=device)
        self.q = torch.empty(self.q_elements, dtype=torch.float32, device=device)
        # Zeroed once: the codec writes the same bytes at every step and leaves the padding and spare header bytes.
        self.first_message = torch.zeros(self.first_message_bytes, dtype=torch.uint8, device=device)
        self.second_message = torch.zeros(self.second_message_bytes, dtype=torch.uint8, device=device)
        self.exact_sum = torch.empty(self.exact_elements, dtype=torch.float32, device=device)
        for (_, slot), error, q_t in zip(self.factored, self.error_views(), self.factor_views(), strict=True):
            saved_error = state.errors.get(slot.name)
            if saved_error is not None:
                error.copy_(saved_error)
            saved_q = state.factors.get(slot.name)
            q_t.copy_((saved_q if saved_q is not None else initial_factor(slot, rank, device)).T)
            state.errors[slot.name] = error
            state.factors[slot.name] = q_t.T

    def exact_values(self) -> Tensor:
        """The first message's head: the exact gradients one after the other, float32."""
        return self.first_message[: self.exact_elements * _FLOAT32_BYTES].view(torch.float32)

    def gathered_second(self, n: int) -> Tensor:
        """The ``(n, bytes)`` buffer the second messages of ``n`` participants are gathered into."""
        if self.second_gathered.shape != (n, self.second_message_bytes):
            self.second_gathered = torch.empty(n, self.second_message_bytes, dtype=torch.uint8, device=self.device)
        return self.second_gathered

    def error_views(self) -> list[Tensor]:
        """Each factored gradient's error, ``rows x cols``, in wire order."""
        return self.matrices(self.errors)

    def factor_views(self) -> list[Tensor]:
        """Each factored gradient's kept ``Q^T``, ``r x cols``, in wire order."""
        views, offset = [], 0
        for _, slot in self.factored:
            views.append(self.q[offset : offset + slot.cols * self.rank].view(self.rank, slot.cols))
            offset += slot.cols * self.rank
        return views

    def gradient_views(self, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Each factored gradient in its bucket, ``rows x cols``, in wire order."""
        return [
            buffers[bucket][slot.offset : slot.offset + slot.numel].view(slot.rows, slot.cols)
            for bucket, slot in self.factored
        ]

    def exact_views(self, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Each exact gradient in its bucket, flat, in bucket order."""
        return [buffers[bucket][slot.offset : slot.offset + slot.numel] for bucket, slot in self.exact]

    def split_exact(self, flat: Tensor) -> list[Tensor]:
        """Cut a flat tensor of the exact gradients one after the other into one piece per gradient."""
        return list(flat.split([slot.numel for _, slot in self.exact]))

    def matrices(self, flat: Tensor) -> list[Tensor]:
        """Cut an ``M``-shaped buffer into one ``rows x cols`` view per factored gradient."""
        views, offset = [], 0
        for _, slot in self.factored:
            views.append(flat[offset : offset + slot.numel].view(slot.rows, slot.cols))
            offset += slot.numel
        return views

    def group_block(self, flat: Tensor, group: ShapeGroup, side: Literal["m", "p", "q"]) -> Tensor:
        """Return the group's batch in ``flat`` (``"m"``: count x n x m, ``"p"``: count x r x n, else count x r x m)."""
        if side == "m":
            start, shape = group.m_offset, (group.count, group.rows, group.cols)
        elif side == "p":
            start, shape = group.p_offset, (group.count, self.rank, group.rows)
        else:
            start, shape = group.q_offset, (group.count, self.rank, group.cols)
        return flat[start : start + shape[0] * shape[1] * shape[2]].view(shape)


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
        self, state: StepState, buffer: Tensor, slots: list[TensorSlot], step: int, last: bool
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


def reduce_pending(state: StepState, buffers: list[Tensor], layouts: list[list[TensorSlot]]) -> None:
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
    state: StepState,
    buffers: list[Tensor],
    layouts: list[list[TensorSlot]],
    group: dist.ProcessGroup | None,
    n: int,
) -> None:
    """Run steps 1-7 of :func:`.low_rank.low_rank_hook` on a whole step's buckets among the ``n`` ranks of ``group``.

    For every gradient ``G_i`` that factors (its error ``e_i``, the kept ``Q``), batched over the gradients of one
    shape:

    1. ``M_i = G_i + e_i``: one multi-tensor copy out of the buckets, one add over all of them.
    2. ``P_i^T = Q^T M_i^T``: one ``bmm`` per shape.
    3. One all-gather of ``[exact float32 values | 8-bit codes of every P_i]``; ``P = sum_i D(C(P_i))``, and the
       exact gradients' in-order sum (mean if ``average``) back into the buckets.
    4. ``P_hat = orth(P)``: one batch per row count.
    5. ``Q_i^T = P_hat^T M_i``: one ``bmm`` per shape.
    6. One all-gather of the 8-bit codes of every ``Q_i``; ``Q = sum_i D(C(Q_i))``, divided by ``n`` if ``average``.
    7. ``G_hat = P_hat Q^T`` (one ``bmm`` per shape) into the buckets; ``e_i = M_i - G_hat`` and ``Q`` are kept,
       unless the step's factors are not finite, which keeps the previous ones (no host synchronisation: a
       ``torch.where`` on the device).

    Steps 1 (after its copy) to 5, with the first exchange, and the decoding half of 6 with 7 (before its copy)
    work only on the plan's buffers, so on CUDA each is captured once as a graph and replayed: two launches where
    eagerly there are a few hundred (Gram-Schmidt alone takes several per column). The second exchange stays eager
    between them. That keeps every step's last collective in view of NCCL's watchdog: if a peer is lost during the
    first half's replay, the eager exchange queued behind it on the same communicator times out, and the watchdog's
    abort of the communicator ends the replay too.

    Args:
        state: the algorithm's state (its step plan, counter, codec, executor and options).
        buffers: the step's buckets; overwritten with the result.
        layouts: each bucket's slots.
        group: the group to exchange over.
        n: the size of ``group``.
    """
    plan = state.step_plan(layouts, buffers[0].device)
    first_share, second_share = plan.uncompressed_shares(buffers[0].element_size())
    gradients = plan.gradient_views(buffers)
    exact = plan.exact_views(buffers)
    # With nothing to factor the step is one exchange, which must stay eager (see above).
    graphed = state.executor.cuda_graphs and plan.q_layout is not None

    def run(half: str, job: Callable[[], None]) -> None:
        if graphed:
            plan.graphs.run_in_place(half, job, state.counter, f"low_rank's {half} of a step")
        else:
            job()

    if gradients:
        torch._foreach_copy_(plan.matrices(plan.m), gradients)
    if exact:
        torch._foreach_copy_(plan.split_exact(plan.exact_values()), exact)
    run("first half", lambda: _first_half(state, plan, group, n, first_share))
    if exact:
        torch._foreach_copy_(exact, plan.split_exact(plan.exact_sum))
    if plan.q_layout is None:
        return
    gathered = all_gather_bytes(plan.second_message, group, n, state.counter, second_share, plan.gathered_second(n))
    run("second half", lambda: _second_half(state, plan, gathered, n))
    torch._foreach_copy_(gradients, plan.matrices(plan.approximation))


def _first_half(state: StepState, plan: StepPlan, group: dist.ProcessGroup | None, n: int, share: int) -> None:
    """Steps 1-5 of :func:`reduce_step` and the encoding of step 6, from ``plan.m`` holding the gradients."""
    rank = plan.rank
    if plan.factored:
        plan.m.add_(plan.errors)
    for group_ in plan.groups:
        m = plan.group_block(plan.m, group_, "m")
        torch.bmm(plan.group_block(plan.q, group_, "q"), m.transpose(1, 2), out=plan.group_block(plan.p, group_, "p"))
    if plan.p_layout is not None:
        plan.p_layout.encode_into(plan.p, plan.first_message)
    gathered = all_gather_bytes(plan.first_message, group, n, state.counter, share)
    if plan.exact:
        exact_sum = sum_in_order(gathered[:, : plan.exact_elements * _FLOAT32_BYTES].view(torch.float32))
        if state.average:
            exact_sum.div_(n)
        plan.exact_sum.copy_(exact_sum)
    if plan.p_layout is None or plan.q_layout is None:
        return
    plan.p.copy_(plan.p_layout.decode_sum(gathered))
    # Step 4: each batch holds P^T, so its columns are the transposed view's.
    for batch in plan.row_batches:
        block = plan.p[batch.p_offset : batch.p_offset + batch.count * rank * batch.rows]
        factors.orthonormalise_columns(block.view(batch.count, rank, batch.rows).transpose(1, 2))
    q_new = torch.empty(plan.q_elements, dtype=torch.float32, device=plan.device)
    for group_ in plan.groups:
        p_hat_t = plan.group_block(plan.p, group_, "p")
        torch.bmm(p_hat_t, plan.group_block(plan.m, group_, "m"), out=plan.group_block(q_new, group_, "q"))
    plan.q_layout.encode_into(q_new, plan.second_message)


def _second_half(state: StepState, plan: StepPlan, gathered: Tensor, n: int) -> None:
    """The decoding of step 6 and step 7 of :func:`reduce_step`, up to ``G_hat`` in ``plan.approximation``."""
    assert plan.q_layout is not None
    q_sums = plan.q_layout.decode_sum(gathered)
    if state.average:
        q_sums.div_(n)
    finite = finite_factors(plan.p, q_sums, plan.rank)
    for group_ in plan.groups:
        p_hat = plan.group_block(plan.p, group_, "p").transpose(1, 2)
        torch.bmm(p_hat, plan.group_block(q_sums, group_, "q"), out=plan.group_block(plan.approximation, group_, "m"))
    plan.m.sub_(plan.approximation)
    torch.where(finite, plan.m, plan.errors, out=plan.errors)
    torch.where(finite, q_sums, plan.q, out=plan.q)
