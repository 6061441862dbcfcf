"""The MinMaxUInt8 codec in torch ops: the reference that defines its bytes, on any device.

Every other path (the CPU kernels of ``_cpu.cpp``, the Triton kernels of ``_triton.py``, the segment layouts of
``_segments.py``) does these float32 operations in this order and is tested against the bytes written here.
"""

import math

import torch
from torch import Tensor

__all__ = ["LEVELS", "compress", "decode", "decode_params", "encode_params", "quantise_rows_", "range_header"]

LEVELS = 255.0
"""The largest code: codes run from 0 to 255."""


def encode_params(lo: Tensor, hi: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-chunk ``(finite, scale, lower)`` from float32 ``lo``/``hi``."""
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    # Tensor / Tensor: ``255.0 / t`` would be computed as 255 * reciprocal(t), rounded twice.
    scale = torch.full_like(lo, LEVELS) / (hi - lo + eps)
    lower = torch.round(hi * scale) - LEVELS
    return finite, scale, lower


def decode_params(lo: Tensor, hi: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per-chunk float32 ``(a, b)`` with ``decoded = q * a + b``, special chunks folded in."""
    finite, scale, lower = encode_params(lo, hi, eps)
    scale64 = scale.double()
    a = torch.reciprocal(scale64).float()
    b = (lower.double() / scale64).float()
    constant = hi == lo
    a = torch.where(constant, torch.zeros_like(a), a)
    b = torch.where(constant, lo, b)
    nan = torch.full_like(a, math.nan)
    return torch.where(finite, a, nan), torch.where(finite, b, nan)


def quantise_rows_(values: Tensor, scale: Tensor, lower: Tensor) -> Tensor:
    """``values = clamp(round(values * scale) - lower, 0, 255)`` in place, per row (``scale``, ``lower``: one per row).

    ``min(round(v * scale), upper) - lower == min(round(v * scale) - lower, 255)``: the clamp covers both.
    """
    return values.mul_(scale.unsqueeze(1)).round_().sub_(lower.unsqueeze(1)).clamp_(0.0, LEVELS)


def range_header(lo: Tensor, hi: Tensor, finite: Tensor) -> Tensor:
    """The first 8 header bytes of every chunk, ``(chunks, 8)`` uint8: ``lo`` and ``hi``, both NaN if not finite."""
    nan = torch.full_like(lo, math.nan)
    return torch.stack((torch.where(finite, lo, nan), torch.where(finite, hi, nan)), dim=1).view(torch.uint8)


@torch.no_grad()
def compress(tensor: Tensor, num_chunks: int, length: int, eps: float, header_bytes: int) -> Tensor:
    """Encode the contiguous 1-D ``tensor`` (``numel >= 1``) into ``(num_chunks, header_bytes + length)`` rows."""
    numel = tensor.numel()
    padded = num_chunks * length
    if numel == padded and tensor.dtype == torch.float32:
        values = tensor
    else:
        values = torch.empty(padded, dtype=torch.float32, device=tensor.device)
        values[:numel].copy_(tensor)
        if padded > numel:
            # Indexing, not .item(): no host synchronisation on CUDA.
            values[numel:].copy_(values[numel - 1].expand(padded - numel))
    rows = values.view(num_chunks, length)
    # NaN propagates into lo and hi. On CPU, amin + amax (vectorised) beat aminmax along a dim several times over.
    lo, hi = torch.aminmax(rows, dim=1) if rows.is_cuda else (rows.amin(dim=1), rows.amax(dim=1))
    finite, scale, lower = encode_params(lo, hi, eps)

    codes = quantise_rows_(rows.clone(), scale, lower)

    encoded = torch.empty((num_chunks, header_bytes + length), dtype=torch.uint8, device=tensor.device)
    payload = encoded[:, header_bytes:]
    payload.copy_(codes)
    # Non-finite rows held NaN codes (cast to uint8 arbitrarily); constant rows ignore their codes. On CPU a
    # check is free and skips a pass; on CUDA it would synchronise with the host.
    zero_rows = ~finite | (hi == lo)
    if rows.is_cuda:
        payload.masked_fill_(zero_rows.unsqueeze(1), 0)
    elif zero_rows.any():
        payload[zero_rows] = 0
    encoded[:, :8].copy_(range_header(lo, hi, finite))
    encoded[:, 8:header_bytes].zero_()
    return encoded


@torch.no_grad()
def decode(encoded: Tensor, out: Tensor, numel: int, eps: float, header_bytes: int) -> None:
    """Decode the first ``numel`` elements of ``encoded`` (row-major, padding included) into the flat ``out``."""
    length = encoded.shape[1] - header_bytes
    if length == 0 or numel == 0:
        return
    full_rows, rest = divmod(numel, length)
    used = encoded[: full_rows + (1 if rest else 0)]
    # A fresh copy: a row's header need not be 4-byte aligned in ``encoded``.
    header = torch.empty((used.shape[0], 8), dtype=torch.uint8, device=used.device)
    header = header.copy_(used[:, :8]).view(torch.float32)
    scale, offset = decode_params(header[:, 0], header[:, 1], eps)
    scale, offset = scale.unsqueeze(1), offset.unsqueeze(1)
    codes = used[:, header_bytes:]
    if full_rows:
        dest = out[: full_rows * length].view(full_rows, length)
        _affine(codes[:full_rows], scale[:full_rows], offset[:full_rows], dest)
    if rest:
        last = torch.empty((1, rest), dtype=out.dtype, device=out.device)
        _affine(codes[full_rows:, :rest], scale[full_rows:], offset[full_rows:], last)
        out[full_rows * length : numel].copy_(last.view(-1))


def _affine(codes: Tensor, scale: Tensor, offset: Tensor, dest: Tensor) -> None:
    """``dest = codes * scale + offset``, computed in float32 (rows broadcast ``scale`` and ``offset``)."""
    # Three same-dtype passes: addcmul straight from uint8 takes a slow mixed-dtype path on CPU (3x slower).
    if dest.dtype == torch.float32:
        dest.copy_(codes)
        dest.mul_(scale).add_(offset)
    else:
        dest.copy_(codes.to(torch.float32).mul_(scale).add_(offset))
