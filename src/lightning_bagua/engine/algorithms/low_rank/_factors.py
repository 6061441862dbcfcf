"""The math both of ``low_rank``'s paths share: how a gradient travels, its first factors, their basis and checks.

A gradient is planned from its shape alone (:func:`plan_slot`), so every rank plans alike; its warm start comes from
the shape too (:func:`factor_seed`). The per-bucket and the whole-step path (:mod:`.hook`) code the same factors
into the same messages and orthonormalise them the same way.
"""

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import CommunicationCounter, all_gather_into

__all__ = [
    "ALIGNMENT",
    "CODEC_CHUNK_ELEMENTS",
    "MAX_FACTOR_BYTES_FRACTION",
    "TensorSlot",
    "all_gather_bytes",
    "bounded",
    "factor_seed",
    "finite_factors",
    "gram_schmidt_",
    "initial_factor",
    "initial_left_factor",
    "offsets_of",
    "orthonormalise_columns",
    "plan_slot",
    "sum_in_order",
]

CODEC_CHUNK_ELEMENTS = 1024
# A tensor is factored only if its two 8-bit factors (headers included) weigh at most this fraction of its bytes.
MAX_FACTOR_BYTES_FRACTION = 0.25
# Messages are padded to whole 8-byte words, so that a gathered row's full-precision part can be viewed as floats.
ALIGNMENT = 8


@dataclass(frozen=True)
class TensorSlot:
    """Where one gradient lives in a flat bucket, and how ``low_rank`` sends it.

    Args:
        name: the parameter's name.
        offset: its first element in the bucket.
        rows: ``n``, the gradient's first dimension (1 for a scalar or 1-D tensor, which is never factored).
        cols: ``m``, the product of the other dimensions.
        factored: whether it travels as rank-``r`` factors (else at full precision).
        p_chunks: codec chunks of the ``P`` factor (``r`` columns of ``n`` elements).
        q_chunks: codec chunks of the ``Q`` factor (``r`` columns of ``m`` elements).
    """

    name: str
    offset: int
    rows: int
    cols: int
    factored: bool
    p_chunks: int = 0
    q_chunks: int = 0

    @property
    def numel(self) -> int:
        """The gradient's number of elements."""
        return self.rows * self.cols


def _chunks_for_columns(length: int, rank: int) -> int:
    """Codec chunks for ``rank`` columns of ``length`` elements: about one range per column piece."""
    return rank * -(-length // CODEC_CHUNK_ELEMENTS)


def plan_slot(
    name: str, offset: int, shape: torch.Size, rank: int, element_size: int, codec: MinMaxUInt8Codec
) -> TensorSlot:
    """Decide how the gradient of one parameter travels, from its shape alone (the same on every rank).

    A gradient of ``n x m`` (first dimension by the rest) is factored when it has at least two dimensions, rank
    ``r`` is below ``min(n, m)`` and its two 8-bit factors weigh at most :data:`MAX_FACTOR_BYTES_FRACTION` of
    its full-precision bytes; otherwise it travels exactly, at full precision.

    Args:
        name: the parameter's name.
        offset: its first element in the bucket.
        shape: the gradient's shape.
        rank: the factors' rank ``r``.
        element_size: bytes per gradient element.
        codec: the codec (for its chunk sizes).

    Returns:
        The slot.
    """
    numel = shape.numel()
    rows = shape[0] if len(shape) >= 2 else 1
    cols = numel // rows if rows else 0
    if len(shape) < 2 or min(rows, cols) <= rank:
        return TensorSlot(name, offset, rows, cols, factored=False)
    p_chunks, q_chunks = _chunks_for_columns(rows, rank), _chunks_for_columns(cols, rank)
    factor_bytes = p_chunks * codec.row_bytes(rows * rank, p_chunks) + q_chunks * codec.row_bytes(cols * rank, q_chunks)
    if factor_bytes > MAX_FACTOR_BYTES_FRACTION * numel * element_size:
        return TensorSlot(name, offset, rows, cols, factored=False)
    return TensorSlot(name, offset, rows, cols, True, p_chunks, q_chunks)


def factor_seed(rows: int, cols: int, rank: int) -> int:
    """Return the seed of a gradient's first ``Q``: the CRC-32 of ``"{rows}x{cols}|{rank}"``.

    Every rank derives the same seed (Python's ``hash`` would differ between processes). The shape alone, not the
    parameter's name, so that a model trains the same under the Trainer and under Fabric, which name it apart.
    """
    return zlib.crc32(f"{rows}x{cols}|{rank}".encode())


def initial_factor(slot: TensorSlot, rank: int, device: torch.device) -> Tensor:
    """Return the first ``Q`` of ``slot``: ``m x r`` standard normal from :func:`factor_seed`, orthonormalised."""
    generator = torch.Generator().manual_seed(factor_seed(slot.rows, slot.cols, rank))
    q = torch.randn(slot.cols, rank, generator=generator, dtype=torch.float32)
    return orthonormalise_columns(q.unsqueeze(0))[0].to(device)


def initial_left_factor(slot: TensorSlot, rank: int, device: torch.device) -> Tensor:
    """Return the ``P_hat`` an alternating ``Q`` step uses before any ``P`` step kept one: ``n x r``, orthonormal.

    Only reached when the first ``P`` step of a bucket was not finite; seeded as :func:`initial_factor`, from the
    shape and a prefix of its own.
    """
    generator = torch.Generator().manual_seed(zlib.crc32(f"P|{slot.rows}x{slot.cols}|{rank}".encode()))
    p = torch.randn(slot.rows, rank, generator=generator, dtype=torch.float32)
    return orthonormalise_columns(p.unsqueeze(0))[0].to(device)


def orthonormalise_columns(matrices: Tensor) -> Tensor:
    """Orthonormalise the columns of each matrix of a ``(b, k, r)`` batch by Gram-Schmidt, in place.

    Column ``j`` loses its projections on columns ``0..j-1``, then is divided by its norm. A column with no
    length left (a zero gradient, or one of rank below ``r``) stays zero instead of becoming NaN.

    On a CPU the same basis comes from one batched Householder QR, ``A = Q R`` (LAPACK), with each column of ``Q``
    multiplied by the sign of ``R``'s diagonal entry (``R_jj`` is the length column ``j`` has left): a few calls
    instead of several per column, about ten times less host time at ``r = 8``, equal to float rounding. Where
    some ``R_jj`` is exactly zero, QR would keep the later columns orthogonal to a direction of its own choosing,
    so that batch takes the column-by-column loop, as on CUDA.

    Args:
        matrices: a float tensor of shape ``(b, k, r)``.

    Returns:
        ``matrices``.
    """
    if matrices.device.type == "cpu":
        q, r = torch.linalg.qr(matrices)
        length_left = torch.diagonal(r, dim1=-2, dim2=-1)
        if not bool((length_left == 0).any()):
            return matrices.copy_(q.mul_(length_left.sign().unsqueeze(-2)))
    return gram_schmidt_(matrices)


def gram_schmidt_(matrices: Tensor) -> Tensor:
    """:func:`orthonormalise_columns` written out column by column, on any device, in place; returns ``matrices``."""
    tiny = torch.finfo(matrices.dtype).tiny
    for j in range(matrices.shape[2]):
        column = matrices[:, :, j : j + 1]
        if j:
            previous = matrices[:, :, :j]
            column.sub_(previous @ (previous.transpose(1, 2) @ column))
        column.div_(column.norm(dim=1, keepdim=True).clamp_min(tiny))
    return matrices


def finite_factors(p_sums: Tensor, q_sums: Tensor, rank: int) -> Tensor:
    """Whether every ``G_hat = P_hat Q^T`` of a bucket is finite, from its factors alone (a boolean scalar tensor).

    ``P_hat`` is finite where ``P`` is (its columns have norm one or zero), so each entry of ``G_hat`` is at most
    ``r`` times ``Q``'s largest entry: ``|Q| < float32 max / r`` keeps it finite. NaN fails the comparison. One
    check per bucket: a non-finite gradient (a step a ``GradScaler`` skips) leaves the whole bucket's state as it
    was.
    """
    return torch.isfinite(p_sums).all() & bounded(q_sums, rank)


def bounded(factor: Tensor, rank: int) -> Tensor:
    """Whether ``|factor| < float32 max / r`` everywhere (False on NaN): times an orthonormal factor, stays finite."""
    return factor.abs().amax() < torch.finfo(torch.float32).max / rank


def offsets_of(sizes: list[int]) -> list[int]:
    """Where each of ``sizes`` starts when they are laid one after the other."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def all_gather_bytes(
    message: Tensor,
    group: dist.ProcessGroup | None,
    n: int,
    counter: CommunicationCounter,
    uncompressed: int,
    out: Tensor | None = None,
) -> Tensor:
    """All-gather one byte message; return the ``(n, length)`` rows (in ``out`` if given)."""
    gathered = torch.empty((n, message.numel()), dtype=torch.uint8, device=message.device) if out is None else out
    counter.record("all_gather", message, received=message.numel() * (n - 1), uncompressed=uncompressed)
    all_gather_into(gathered, message, group)
    return gathered


def sum_in_order(rows: Tensor) -> Tensor:
    """Sum the rows of ``rows`` (one per participant) from the first to the last, as a new tensor."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total
