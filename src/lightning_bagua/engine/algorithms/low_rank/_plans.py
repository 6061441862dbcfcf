"""Where ``low_rank``'s factors and messages sit: a bucket's plan and a whole step's, made once per layout.

Plans are pure layout, read from the slots alone (:func:`~._factors.plan_slot`), so every rank lays its messages out
alike: ``[exact bytes | pad | P codes | pad]`` then ``[Q codes | pad]``. :class:`BucketPlan` keeps a bucket's
gradients in bucket order; :class:`StepPlan` groups all of a step's gradients by shape and owns the buffers the
whole-step path computes in. The algorithm that runs on them is :mod:`.hook`'s.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_bagua.engine._cuda_graphs import BucketGraphs
from lightning_bagua.engine.algorithms.low_rank._factors import ALIGNMENT, TensorSlot, initial_factor, offsets_of
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.codec._segments import SegmentLayout, segment_backend

__all__ = [
    "BucketPlan",
    "Messages",
    "RowBatch",
    "ShapeGroup",
    "StepPlan",
    "first_share",
    "lay_out_messages",
    "plan_bucket",
]

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Messages:
    """How the factors of some gradients travel: ``[exact bytes | pad | P codes | pad]`` and ``[Q codes | pad]``.

    Args:
        start: where the ``P`` codes start in the first message (the exact bytes padded to whole words).
        p_layout: the ``P`` codes' layout (``None`` with nothing factored).
        q_layout: the ``Q`` codes' layout, from byte 0 of the second message.
        first_bytes: the first message's length.
        second_bytes: the second message's length.
    """

    start: int
    p_layout: SegmentLayout | None
    q_layout: SegmentLayout | None
    first_bytes: int
    second_bytes: int


def lay_out_messages(factored: Sequence[TensorSlot], exact_bytes: int, rank: int, codec: MinMaxUInt8Codec) -> Messages:
    """Lay out both messages of the ``factored`` gradients (in wire order) after ``exact_bytes`` exact bytes."""
    start = _words(exact_bytes)
    p_layout = q_layout = None
    if factored:
        backend = segment_backend(codec)
        p_layout = SegmentLayout([(s.rows * rank, s.p_chunks) for s in factored], start, codec.eps, backend)
        q_layout = SegmentLayout([(s.cols * rank, s.q_chunks) for s in factored], 0, codec.eps, backend)
    first = start + (0 if p_layout is None else p_layout.nbytes)
    second = 0 if q_layout is None else q_layout.nbytes
    return Messages(start, p_layout, q_layout, _words(first), _words(second))


def first_share(factored: Sequence[TensorSlot], exact_bytes: int, element_size: int) -> int:
    """What DDP would send of the gradients, the part counted on the first message.

    The full-precision bytes are shared between the two collectives in proportion to what each carries: a factored
    gradient's ``n x m`` bytes as ``n : m``, the exact ones all on the first.
    """
    return exact_bytes + sum(slot.numel * element_size * slot.rows // (slot.rows + slot.cols) for slot in factored)


def _words(nbytes: int) -> int:
    """``nbytes`` rounded up to whole words of :data:`~._factors.ALIGNMENT` bytes."""
    return nbytes + -nbytes % ALIGNMENT


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
    """Lay out both messages of a bucket, its gradients in bucket order, the exact ones in the bucket's dtype."""
    factored = [slot for slot in slots if slot.factored]
    exact = [slot for slot in slots if not slot.factored]
    element_size = tensor.element_size()
    exact_index = None
    if exact:
        exact_index = torch.cat([torch.arange(slot.offset, slot.offset + slot.numel) for slot in exact])
        exact_index = exact_index.to(tensor.device)
    exact_bytes = sum(slot.numel for slot in exact) * element_size
    messages = lay_out_messages(factored, exact_bytes, rank, codec)
    # The alternating form's Q steps: [exact bytes | pad | Q codes | pad].
    q_alone_layout = None
    if factored:
        q_segments = [(slot.cols * rank, slot.q_chunks) for slot in factored]
        q_alone_layout = SegmentLayout(q_segments, messages.start, codec.eps, segment_backend(codec))
    q_alone = messages.start + (0 if messages.q_layout is None else messages.q_layout.nbytes)
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
        p_offsets=offsets_of([slot.rows * rank for slot in factored]),
        q_offsets=offsets_of([slot.cols * rank for slot in factored]),
        p_layout=messages.p_layout,
        q_layout=messages.q_layout,
        first_message_bytes=messages.first_bytes,
        second_message_bytes=messages.second_bytes,
        first_share=first_share(factored, exact_bytes, element_size),
        bucket_bytes=tensor.numel() * element_size,
        q_alone_layout=q_alone_layout,
        q_alone_message_bytes=_words(q_alone),
    )


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
        # The exact gradients always travel as float32, whatever the buckets' dtype.
        messages = lay_out_messages(
            [slot for _, slot in self.factored], self.exact_elements * _FLOAT32_BYTES, rank, codec
        )
        self.p_layout, self.q_layout = messages.p_layout, messages.q_layout
        self.first_message_bytes, self.second_message_bytes = messages.first_bytes, messages.second_bytes
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
        first = first_share([slot for _, slot in self.factored], self.exact_elements * element_size, element_size)
        return first, total * element_size - first

    def bind(self, errors: dict[str, Tensor], factors: dict[str, Tensor]) -> None:
        """Allocate the buffers, take each gradient's error and warm start from the dicts, and lend them views back.

        ``errors`` and ``factors`` (the state's, by parameter name) then hold views into this plan's buffers, so
        that the algorithm's checkpoints read (and a later plan takes over) what this one keeps.
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
            saved_error = errors.get(slot.name)
            if saved_error is not None:
                error.copy_(saved_error)
            saved_q = factors.get(slot.name)
            q_t.copy_((saved_q if saved_q is not None else initial_factor(slot, rank, device)).T)
            errors[slot.name] = error
            factors[slot.name] = q_t.T

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
