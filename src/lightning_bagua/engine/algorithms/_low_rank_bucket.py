"""``low_rank``'s per-bucket path: each bucket is factored, coded and exchanged as soon as DDP hands it over.

The path the CPU takes by default: a bucket's collectives block on Gloo, so the engine's ordered executor runs them
off the training thread while backward goes on, and the batches of work are small enough for the host to keep up.
See :func:`~lightning_bagua.engine.algorithms.low_rank.low_rank_hook` for the algorithm.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine._codec_segments import SegmentLayout, segment_backend
from lightning_bagua.engine.algorithms import _low_rank_factors as factors
from lightning_bagua.engine.algorithms._low_rank_factors import (
    ALIGNMENT,
    TensorSlot,
    all_gather_bytes,
    bounded,
    finite_factors,
    offsets_of,
    sum_in_order,
)
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import CommunicationCounter

__all__ = ["BucketPlan", "BucketState", "low_rank_reduce_", "plan_bucket"]


class BucketState(Protocol):
    """What the per-bucket path reads and keeps (:class:`~.low_rank.LowRankState` provides it).

    A protocol rather than the state class itself, so that this module does not import the one that imports it.
    """

    rank: int
    average: bool
    alternate: bool
    exchange_left: bool
    counter: CommunicationCounter
    factors: dict[str, Tensor]
    left_factors: dict[str, Tensor]

    def bucket_plan(self, slots: list[TensorSlot], tensor: Tensor) -> "BucketPlan": ...

    def factor(self, slot: TensorSlot) -> Tensor: ...

    def left_factor(self, slot: TensorSlot) -> Tensor: ...

    def corrected(self, slot: TensorSlot, gradient: Tensor) -> Tensor: ...

    def finish(
        self, slot: TensorSlot, gradient: Tensor, m: Tensor, left: Tensor, right: Tensor, finite: Tensor
    ) -> None: ...

    def keep_factor(self, factors: dict[str, Tensor], name: str, factor: Tensor, finite: Tensor) -> None: ...


def low_rank_reduce_(
    tensor: Tensor, slots: list[TensorSlot], group: dist.ProcessGroup | None, n: int, state: BucketState
) -> Tensor:
    """Run steps 1-7 of :func:`low_rank_hook` on ``tensor`` among the ``n`` ranks of ``group``, in place.

    Args:
        tensor: this participant's flat bucket; overwritten with the result.
        slots: where each gradient lives in ``tensor`` and whether it factors.
        group: the group to exchange over.
        n: the size of ``group``.
        state: the codec, counter, factors and errors.

    Returns:
        ``tensor``.
    """
    if state.alternate:
        return _alternating_reduce_(tensor, slots, group, n, state)
    plan = state.bucket_plan(slots, tensor)
    rank = state.rank
    views = [tensor[slot.offset : slot.offset + slot.numel].view(slot.rows, slot.cols) for slot in plan.factored]

    # Steps 1-2: M_i into the slot's scratch, P_i^T straight into the flat factor buffer.
    corrected = [state.corrected(slot, view) for slot, view in zip(plan.factored, views, strict=True)]
    p_flat = torch.empty(plan.p_elements, dtype=torch.float32, device=tensor.device)
    for slot, m, offset in zip(plan.factored, corrected, plan.p_offsets, strict=True):
        torch.mm(state.factor(slot).T, m.T, out=p_flat[offset : offset + slot.rows * rank].view(rank, slot.rows))

    # Step 3: [exact bytes | P codes], one all-gather.
    message = _message_with_exact(tensor, plan, plan.first_message_bytes)
    if plan.p_layout is not None:
        plan.p_layout.encode_into(p_flat, message)
    gathered = all_gather_bytes(message, group, n, state.counter, plan.first_share)
    _reduce_exact(tensor, plan, gathered, n, state.average)
    if plan.p_layout is None or plan.q_layout is None:
        return tensor
    p_sums = plan.p_layout.decode_sum(gathered)

    # Step 4, batched over the gradients with the same number of rows: a few launches per bucket, not per gradient.
    p_hats = _orthonormalised(p_sums, plan.p_offsets, plan.p_sizes, plan.same_rows, rank)

    # Steps 5-6: Q_i^T = P_hat^T M_i straight into the flat factor buffer.
    q_flat = torch.empty(plan.q_elements, dtype=torch.float32, device=tensor.device)
    for slot, m, p_hat, offset in zip(plan.factored, corrected, p_hats, plan.q_offsets, strict=True):
        torch.mm(p_hat.T, m, out=q_flat[offset : offset + slot.cols * rank].view(rank, slot.cols))
    message = torch.zeros(plan.second_message_bytes, dtype=torch.uint8, device=tensor.device)
    plan.q_layout.encode_into(q_flat, message)
    gathered = all_gather_bytes(message, group, n, state.counter, plan.bucket_bytes - plan.first_share)
    q_sums = plan.q_layout.decode_sum(gathered)
    if state.average:
        q_sums.div_(n)

    # Step 7.
    finite = finite_factors(p_sums, q_sums, rank)
    for slot, view, m, p_hat, offset in zip(plan.factored, views, corrected, p_hats, plan.q_offsets, strict=True):
        q = q_sums[offset : offset + slot.cols * rank].view(rank, slot.cols).T
        state.finish(slot, view, m, p_hat, q, finite)
        state.keep_factor(state.factors, slot.name, q, finite)
    return tensor


def _alternating_reduce_(
    tensor: Tensor, slots: list[TensorSlot], group: dist.ProcessGroup | None, n: int, state: BucketState
) -> Tensor:
    """Reduce ``tensor`` exchanging one factor, ``P`` or ``Q`` as ``state.exchange_left`` says, in place.

    ACP-SGD ("alternate compressed PowerSGD", from *Evaluation and Optimization of Gradient Compression for
    Distributed Deep Learning*) alternates PowerSGD's two half-steps between training steps, so each step takes
    one collective. Among the ``n`` participants, for every gradient
    ``G_i`` that factors, with its error ``e_i`` and the orthonormal factors ``Q_hat`` (``m x r``) and ``P_hat``
    (``n x r``) the last steps kept (at first ``Q_hat`` from :func:`factor_seed`, as :func:`low_rank_hook`):

    1. Add the error: ``M_i = G_i + e_i``.
    2. On a ``P`` step (the first compressed step, then every other one): ``P_i = M_i Q_hat``. On a ``Q`` step:
       ``Q_i = M_i^T P_hat``.
    3. One all-gather per bucket of ``[exact bytes | 8-bit codes of the P_i (or Q_i)]``; every participant decodes
       every row and sums in participant order, divided by ``n`` if ``average``: ``P = sum_i D(C(P_i)) / n``.
    4. Reconstruct: ``G_hat = P Q_hat^T`` (``Q`` step: ``G_hat = P_hat Q^T``), the mean of the ``M_i`` projected on
       the kept factor's span; ``e_i = M_i - G_hat``.
    5. Keep ``P_hat = orth(P)`` (``Q`` step: ``Q_hat = orth(Q)``) for the next step. A bucket whose result is not
       finite (``|P| >= float32 max / r``, or NaN) keeps its previous errors and factors.

    Args:
        tensor: this participant's flat bucket; overwritten with the result.
        slots: where each gradient lives in ``tensor`` and whether it factors.
        group: the group to exchange over.
        n: the size of ``group``.
        state: the codec, counter, factors, errors and phase.

    Returns:
        ``tensor``.
    """
    plan = state.bucket_plan(slots, tensor)
    rank = state.rank
    left_step = state.exchange_left
    sizes, offsets, layout, message_bytes, batches = plan.alternating_side(left_step)
    if left_step:
        kept, store = [state.factor(slot) for slot in plan.factored], state.left_factors
    else:
        kept, store = [state.left_factor(slot) for slot in plan.factored], state.factors
    views = [tensor[slot.offset : slot.offset + slot.numel].view(slot.rows, slot.cols) for slot in plan.factored]

    # Steps 1-2: P_i^T = Q_hat^T M_i^T (or Q_i^T = P_hat^T M_i) straight into the flat factor buffer.
    corrected = [state.corrected(slot, view) for slot, view in zip(plan.factored, views, strict=True)]
    flat = torch.empty(sum(sizes) * rank, dtype=torch.float32, device=tensor.device)
    for m, factor, offset, size in zip(corrected, kept, offsets, sizes, strict=True):
        torch.mm(factor.T, m.T if left_step else m, out=flat[offset : offset + size * rank].view(rank, size))

    # Step 3.
    message = _message_with_exact(tensor, plan, message_bytes)
    if layout is not None:
        layout.encode_into(flat, message)
    gathered = all_gather_bytes(message, group, n, state.counter, plan.bucket_bytes)
    _reduce_exact(tensor, plan, gathered, n, state.average)
    if layout is None:
        return tensor
    sums = layout.decode_sum(gathered)
    if state.average:
        sums.div_(n)

    # Step 4, then step 5 in place on the sums (G_hat is written by then).
    finite = bounded(sums, rank)
    for slot, view, m, factor, offset, size in zip(plan.factored, views, corrected, kept, offsets, sizes, strict=True):
        received = sums[offset : offset + size * rank].view(rank, size).T
        left, right = (received, factor) if left_step else (factor, received)
        state.finish(slot, view, m, left, right, finite)
    hats = _orthonormalised(sums, offsets, sizes, batches, rank)
    for slot, hat in zip(plan.factored, hats, strict=True):
        if left_step:
            state.left_factor(slot)  # a previous P_hat to keep if this step is not finite
        state.keep_factor(store, slot.name, hat, finite)
    return tensor


def _message_with_exact(tensor: Tensor, plan: "BucketPlan", nbytes: int) -> Tensor:
    """A zeroed ``nbytes`` message that starts with the exact bytes of the bucket's tensors that do not factor."""
    message = torch.zeros(nbytes, dtype=torch.uint8, device=tensor.device)
    if plan.exact_index is not None:
        message[: plan.exact_bytes] = tensor.take(plan.exact_index).view(torch.uint8)
    return message


def _reduce_exact(tensor: Tensor, plan: "BucketPlan", gathered: Tensor, n: int, average: bool) -> None:
    """Write the in-order sum (mean if ``average``) of the gathered exact bytes into their places in ``tensor``."""
    if plan.exact_index is None:
        return
    exact_sum = sum_in_order(gathered[:, : plan.exact_bytes].view(tensor.dtype).float())
    if average:
        exact_sum.div_(n)
    tensor.index_copy_(0, plan.exact_index, exact_sum.to(tensor.dtype))


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


@dataclass
class BucketPlan:
    """How one bucket layout travels: the factored slots, the exact tensors' elements and both messages' layouts."""

    factored: list[TensorSlot]
    same_rows: list[list[int]]  # indices into ``factored`` grouped by row count, for batched orthonormalisation
    same_cols: list[list[int]]  # the same by column count (the alternating form's Q steps)
    exact_index: Tensor | None
    exact_bytes: int
    p_sizes: list[int]  # each factored gradient's rows (the length of a P column)
    q_sizes: list[int]  # and its columns (the length of a Q column)
    p_offsets: list[int]
    q_offsets: list[int]
    p_layout: SegmentLayout | None
    q_layout: SegmentLayout | None
    first_message_bytes: int
    second_message_bytes: int
    first_share: int
    bucket_bytes: int
    # The alternating form's Q steps: [exact bytes | pad | Q codes | pad].
    q_alone_layout: SegmentLayout | None
    q_alone_message_bytes: int

    def alternating_side(self, left: bool) -> tuple[list[int], list[int], SegmentLayout | None, int, list[list[int]]]:
        """An alternating step's factor lengths, offsets, layout, message bytes and orthonormalisation batches."""
        if left:
            return self.p_sizes, self.p_offsets, self.p_layout, self.first_message_bytes, self.same_rows
        return self.q_sizes, self.q_offsets, self.q_alone_layout, self.q_alone_message_bytes, self.same_cols

    @property
    def p_elements(self) -> int:
        return 0 if self.p_layout is None else self.p_layout.elements

    @property
    def q_elements(self) -> int:
        return 0 if self.q_layout is None else self.q_layout.elements


def plan_bucket(slots: list[TensorSlot], tensor: Tensor, rank: int, codec: MinMaxUInt8Codec) -> BucketPlan:
    """Lay out both messages of a bucket: ``[exact bytes | pad | P codes | pad]`` and ``[Q codes | pad]``."""
    factored = [slot for slot in slots if slot.factored]
    exact = [slot for slot in slots if not slot.factored]
    element_size = tensor.element_size()
    exact_index = None
    if exact:
        exact_index = torch.cat([torch.arange(slot.offset, slot.offset + slot.numel) for slot in exact])
        exact_index = exact_index.to(tensor.device)
    exact_bytes = sum(slot.numel for slot in exact) * element_size
    start = exact_bytes + -exact_bytes % ALIGNMENT
    p_layout = q_layout = q_alone_layout = None
    p_offsets, q_offsets = (
        offsets_of([slot.rows * rank for slot in factored]),
        offsets_of([slot.cols * rank for slot in factored]),
    )
    if factored:
        backend = segment_backend(codec)
        p_segments = [(slot.rows * rank, slot.p_chunks) for slot in factored]
        q_segments = [(slot.cols * rank, slot.q_chunks) for slot in factored]
        p_layout = SegmentLayout(p_segments, start, codec.eps, backend)
        q_layout = SegmentLayout(q_segments, 0, codec.eps, backend)
        q_alone_layout = SegmentLayout(q_segments, start, codec.eps, backend)
    first = start + (0 if p_layout is None else p_layout.nbytes)
    second = 0 if q_layout is None else q_layout.nbytes
    q_alone = start + (0 if q_layout is None else q_layout.nbytes)
    # The bucket's full-precision bytes, shared between the two collectives in proportion to what each carries.
    first_share = exact_bytes + sum(
        slot.numel * element_size * slot.rows // (slot.rows + slot.cols) for slot in factored
    )
    same_rows: dict[int, list[int]] = {}
    same_cols: dict[int, list[int]] = {}
    for index, slot in enumerate(factored):
        same_rows.setdefault(slot.rows, []).append(index)
        same_cols.setdefault(slot.cols, []).append(index)
    return BucketPlan(
        factored=factored,
        same_rows=list(same_rows.values()),
        same_cols=list(same_cols.values()),
        exact_index=exact_index,
        exact_bytes=exact_bytes,
        p_sizes=[slot.rows for slot in factored],
        q_sizes=[slot.cols for slot in factored],
        p_offsets=p_offsets,
        q_offsets=q_offsets,
        p_layout=p_layout,
        q_layout=q_layout,
        first_message_bytes=first + -first % ALIGNMENT,
        second_message_bytes=second + -second % ALIGNMENT,
        first_share=first_share,
        bucket_bytes=tensor.numel() * element_size,
        q_alone_layout=q_alone_layout,
        q_alone_message_bytes=q_alone + -q_alone % ALIGNMENT,
    )
