"""Cache-blocked CPU kernels of the MinMaxUInt8 codec, in plain torch.

The formulas and special cases are documented on :class:`~lightning_bagua.engine.codec.MinMaxUInt8Codec`; every
per-element operation here is the same IEEE float32 operation as in the vectorised torch backend (the same
``mul``, ``round``, ``sub``, ``clamp``; decoding ``q * a`` then ``+ b``), so both write the same bytes and
decode to the same values.

Why it is faster on CPU: the torch backend runs each step over the whole buffer, allocating a float32
temporary as large as the input and converting float32 to uint8 on a slow scalar path. Here a chunk is read
once for its min and max, then quantised block by block: each block of ``BLOCK`` elements goes through every
step while it sits in the core's L2 cache, in preallocated scratch buffers, and reaches uint8 through int32
(two vectorised conversions). Decoding likewise runs every step on a block in cache, and can add decoded rows
into an output (:func:`decode_sum`, :func:`decode_add`) without materialising them. Per-chunk quantities reach
the kernels as Python floats holding float32 values: torch applies a float scalar to a float32 tensor in
float32, as it applies a float32 tensor.
"""

import threading

import torch
from torch import Tensor

from lightning_bagua.engine._codec_params import LEVELS, decode_params, encode_params, range_header

__all__ = ["BLOCK", "compress", "decode", "decode_add", "decode_sum", "fill_row_ranges", "row_ranges"]

# Elements per block: 512 KiB of float32 (plus as much scratch) stays in a core's L2 on current x86 and Arm
# server parts, while the per-op host cost (a few microseconds per torch call) stays small next to the work.
BLOCK = 1 << 17


class _Scratch(threading.local):
    """Per-thread scratch blocks: an engine's communication thread and the training thread may both encode."""

    def __init__(self) -> None:
        self.floats = torch.empty(BLOCK, dtype=torch.float32)
        self.ints = torch.empty(BLOCK, dtype=torch.int32)


_scratch = _Scratch()


def _header_params(lo: Tensor, hi: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    finite, scale, lower = encode_params(lo, hi, eps)
    return finite, scale, lower, finite & (hi != lo)


@torch.no_grad()
def compress(tensor: Tensor, num_chunks: int, length: int, eps: float, header_bytes: int) -> Tensor:
    """Encode the contiguous 1-D CPU ``tensor`` (``numel >= 1``) into ``(num_chunks, header_bytes + length)`` rows."""
    numel = tensor.numel()
    lo, hi = row_ranges(tensor, num_chunks, length)
    finite, scale, lower, varying = _header_params(lo, hi, eps)

    encoded = torch.empty((num_chunks, header_bytes + length), dtype=torch.uint8)
    encoded[:, :8].copy_(range_header(lo, hi, finite))
    encoded[:, 8:header_bytes].zero_()
    payload = encoded[:, header_bytes:]
    scales, lowers, quantised = scale.tolist(), lower.tolist(), varying.tolist()
    for row in range(num_chunks):
        codes = payload[row]
        if not quantised[row]:
            # Non-finite and constant chunks carry zero codes (their decoding reads the header alone).
            codes.zero_()
            continue
        start = row * length
        real = min(length, numel - start)  # only a varying chunk reaches here, so real >= 1
        _quantise(tensor[start : start + real], scales[row], lowers[row], codes[:real])
        if real < length:
            # The padding repeats the last element, so it repeats that element's code.
            codes[real:].fill_(codes[real - 1])
    return encoded


def row_ranges(tensor: Tensor, num_chunks: int, length: int) -> tuple[Tensor, Tensor]:
    """Per-chunk float32 ``lo`` and ``hi``, padding included (it repeats the last element, so only fills empty rows)."""
    lo = torch.empty(num_chunks, dtype=torch.float32)
    hi = torch.empty(num_chunks, dtype=torch.float32)
    fill_row_ranges(tensor, length, lo, hi)
    return lo, hi


def fill_row_ranges(tensor: Tensor, length: int, lo: Tensor, hi: Tensor, chunks: Tensor | None = None) -> None:
    """Write :func:`row_ranges` into ``lo`` and ``hi``: of every chunk, or only of the int64 indices ``chunks``.

    Each chunk is reduced the same way either way (the native backend redoes a few chunks with it).
    """
    full_rows, rest = divmod(tensor.numel(), length)
    if full_rows:
        # Min and max are exact in the input's dtype; NaN propagates into both.
        rows = tensor[: full_rows * length].view(full_rows, length)
        full = None if chunks is None else chunks[chunks < full_rows]
        if full_rows == 1:
            if full is None or full.numel():
                lo[0], hi[0] = rows[0].amin(), rows[0].amax()
        elif full is None:
            lo[:full_rows].copy_(rows.amin(dim=1))
            hi[:full_rows].copy_(rows.amax(dim=1))
        elif full.numel():
            picked = rows[full]
            lo[full], hi[full] = picked.amin(dim=1), picked.amax(dim=1)
    if rest and (chunks is None or bool((chunks == full_rows).any())):
        tail = tensor[full_rows * length :]
        lo[full_rows], hi[full_rows] = tail.amin(), tail.amax()
    empty_from = full_rows + (1 if rest else 0)
    empty = slice(empty_from, lo.numel()) if chunks is None else chunks[chunks >= empty_from]
    if empty_from < lo.numel():
        lo[empty] = tensor[-1]
        hi[empty] = tensor[-1]


def _quantise(values: Tensor, scale: float, lower: float, codes: Tensor) -> None:
    """``codes = clamp(round(values * scale) - lower, 0, 255)`` as uint8, block by block."""
    floats, ints = _scratch.floats, _scratch.ints
    upcast = values.dtype != torch.float32
    for start in range(0, values.numel(), BLOCK):
        block = values[start : start + BLOCK]
        size = block.numel()
        work = floats[:size]
        if upcast:
            work.copy_(block)
            work.mul_(scale)
        else:
            torch.mul(block, scale, out=work)
        work.round_()
        work.sub_(lower)
        work.clamp_(0.0, LEVELS)
        # float32 -> uint8 has no vectorised path; float32 -> int32 -> uint8 has two.
        narrow = ints[:size]
        narrow.copy_(work)
        codes[start : start + size].copy_(narrow)


def _decode_factors(encoded: Tensor, rows: int, eps: float) -> tuple[list[float], list[float]]:
    header = torch.empty((rows, 8), dtype=torch.uint8)
    header = header.copy_(encoded[:rows, :8]).view(torch.float32)
    scale, offset = decode_params(header[:, 0], header[:, 1], eps)
    return scale.tolist(), offset.tolist()


def _decode_block(codes: Tensor, scale: float, offset: float, dest: Tensor) -> None:
    """``dest = codes * scale + offset`` in float32, then rounded to ``dest``'s dtype."""
    if dest.dtype == torch.float32:
        dest.copy_(codes)
        dest.mul_(scale).add_(offset)
    else:
        work = _scratch.floats[: codes.numel()]
        work.copy_(codes)
        work.mul_(scale).add_(offset)
        dest.copy_(work)


def _row_spans(numel: int, length: int) -> list[tuple[int, int, int, int]]:
    """``(row, column, flat start, size)`` of every block of the first ``numel`` elements of rows of ``length``."""
    spans = []
    for flat in range(0, numel, length):
        row, end = flat // length, min(flat + length, numel)
        for column in range(0, end - flat, BLOCK):
            spans.append((row, column, flat + column, min(BLOCK, end - flat - column)))
    return spans


@torch.no_grad()
def decode(encoded: Tensor, out: Tensor, numel: int, eps: float, header_bytes: int) -> None:
    """Decode the first ``numel`` elements of ``encoded`` (row-major, padding included) into the flat ``out``."""
    length = encoded.shape[1] - header_bytes
    if length == 0 or numel == 0:
        return
    scales, offsets = _decode_factors(encoded, -(-numel // length), eps)
    codes = encoded[:, header_bytes:]
    for row, column, flat, size in _row_spans(numel, length):
        _decode_block(codes[row, column : column + size], scales[row], offsets[row], out[flat : flat + size])


@torch.no_grad()
def decode_add(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out += decoded`` for the first ``out.numel()`` elements of ``encoded``, decoded in ``out``'s dtype."""
    numel = out.numel()
    length = encoded.shape[1] - header_bytes
    if length == 0 or numel == 0:
        return
    scales, offsets = _decode_factors(encoded, -(-numel // length), eps)
    codes = encoded[:, header_bytes:]
    work = torch.empty(min(BLOCK, numel), dtype=out.dtype) if out.dtype != torch.float32 else _scratch.floats
    for row, column, flat, size in _row_spans(numel, length):
        decoded = work[:size]
        _decode_block(codes[row, column : column + size], scales[row], offsets[row], decoded)
        out[flat : flat + size].add_(decoded)


@torch.no_grad()
def decode_sum(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out = row_0 + row_1 + ...`` (in this order, in float32) over the first ``out.numel()`` codes of every row."""
    rows = encoded.shape[0]
    numel = out.numel()
    scales, offsets = _decode_factors(encoded, rows, eps)
    codes = encoded[:, header_bytes:]
    for start in range(0, numel, BLOCK):
        size = min(BLOCK, numel - start)
        dest = out[start : start + size]
        _decode_block(codes[0, start : start + size], scales[0], offsets[0], dest)
        work = _scratch.floats[:size]
        for row in range(1, rows):
            _decode_block(codes[row, start : start + size], scales[row], offsets[row], work)
            dest.add_(work)
