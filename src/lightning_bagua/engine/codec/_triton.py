"""Triton kernels of the MinMaxUInt8 codec, for CUDA tensors.

Imported lazily by :mod:`lightning_bagua.engine.codec` (importing this module imports Triton); the formulas and
their special cases are documented on :class:`~lightning_bagua.engine.codec.MinMaxUInt8Codec`, and every
per-chunk quantity here is the same IEEE float32 operation as in the torch backend, so both write the same bytes.

Work split: the grid is (chunks, programs per chunk) and each program handles a contiguous span (whole blocks)
of its chunk, so one chunk of a 500 MB model spreads over the whole GPU just as eight chunks of a gradient
bucket do. Compression is two launches. First, a few looping programs per SM each write the min, max and NaN
flag of their span (partials). Then the same programs each reduce their chunk's partials (at most 1024 of
each, from L2), derive the chunk's scale, quantise their span (backwards, to start on what the first pass left
in L2) and, for the chunk's first span, write the header. Decompression is one launch with one block per
program: each reads its chunk's 8 header bytes and decodes its block, into the output or added to it
(``decode_add``, which reads the output too). The input is read twice and the codes written once, so compression
alone moves 2.25x the input's float32 bytes at the least; decompression 1.25x, and adding 2.25x.
"""

# mypy: disable-error-code="no-untyped-def"
# ruff: noqa: ANN001, ANN202

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

__all__ = ["compress", "decode", "decode_add"]


class _Config(NamedTuple):
    block: int  # elements per loop step of a program
    num_warps: int
    programs_per_sm: int  # programs launched per SM (over all chunks), before spans are rounded to blocks
    max_programs_per_row: int
    # Compression only: the share of L2 that the min/max pass fills with (the tails of) the spans to be quantised
    # next, and Triton's eviction policies ("", "evict_first", "evict_last") of the two passes' loads and stores.
    l2_share: float = 0.0
    early_eviction: str = ""
    late_eviction: str = ""
    load_eviction: str = ""
    store_eviction: str = ""


# Measured on an H200 (1 and 8 chunks, 4 MiB to 1 GiB, scratch sweeps of block, warps, programs per SM and
# eviction policies): compression is fastest with a few looping programs per SM (and must bound the programs per
# chunk: each quantising program reduces all its chunk's partials); decoding with one block per program, up to
# the grid's limit of 65535 programs per chunk. From 12 MiB up, marking the head of each span evict-first in the
# min/max pass leaves its tail in L2 for the quantising pass, which starts there, and longer loops of smaller
# blocks keep more loads in flight; below that, where launches dominate, fewer longer steps win.
COMPRESS_CONFIG = _Config(
    block=2048, num_warps=16, programs_per_sm=4, max_programs_per_row=1024, l2_share=0.7, early_eviction="evict_first"
)
SMALL_COMPRESS_CONFIG = _Config(block=4096, num_warps=8, programs_per_sm=8, max_programs_per_row=1024)
SMALL_COMPRESS_BYTES = 12 << 20  # inputs smaller than this use SMALL_COMPRESS_CONFIG
DECODE_CONFIG = _Config(block=4096, num_warps=8, programs_per_sm=1 << 20, max_programs_per_row=65535)


@triton.jit
def _load_values(x_ptr, row_start, j, end, numel, x_last, eviction: tl.constexpr):
    # Elements past the input are padding: they repeat the last element, as in the torch backend.
    index = row_start + j
    valid = index < numel
    x = tl.load(x_ptr + index, mask=valid & (j < end), other=0.0, eviction_policy=eviction).to(tl.float32)
    return tl.where(valid, x, x_last)


@triton.jit
def _minmax_update(x_ptr, row_start, j, end, numel, x_last, lo, hi, nan_seen, eviction: tl.constexpr):
    inside = j < end
    x = _load_values(x_ptr, row_start, j, end, numel, x_last, eviction)
    lo = tl.where(inside, tl.minimum(lo, x), lo)
    hi = tl.where(inside, tl.maximum(hi, x), hi)
    # min/max need not propagate NaN, so it is tracked apart; +-inf shows up in lo/hi.
    nan_seen = nan_seen | ((x != x) & inside).to(tl.int32)
    return lo, hi, nan_seen


@triton.jit
def _minmax_kernel(
    x_ptr,
    partial_ptr,
    numel,
    length,
    span,
    keep_per_mille,
    block: tl.constexpr,
    early_eviction: tl.constexpr,
    late_eviction: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    per_row = tl.num_programs(1)
    programs = tl.num_programs(0) * per_row
    row_start = row.to(tl.int64) * length
    x_last = tl.load(x_ptr + (numel - 1)).to(tl.float32)
    start = part * span
    end = tl.minimum(start + span, length)
    offsets = tl.arange(0, block)
    lo = tl.full([block], float("inf"), tl.float32)
    hi = tl.full([block], float("-inf"), tl.float32)
    nan_seen = tl.zeros([block], tl.int32)
    # The quantising pass reads each span backwards, so the span's tail is what it can find in L2: the tail
    # (keep_per_mille of the span) is loaded with late_eviction, the head with early_eviction.
    steps = tl.cdiv(end - start, block)
    split = start + (steps - (steps * keep_per_mille) // 1000) * block
    for base in range(start, split, block):
        lo, hi, nan_seen = _minmax_update(
            x_ptr, row_start, base + offsets, end, numel, x_last, lo, hi, nan_seen, early_eviction
        )
    for base in range(split, end, block):
        lo, hi, nan_seen = _minmax_update(
            x_ptr, row_start, base + offsets, end, numel, x_last, lo, hi, nan_seen, late_eviction
        )
    slot = row * per_row + part
    tl.store(partial_ptr + slot, tl.min(lo, axis=0))
    tl.store(partial_ptr + programs + slot, tl.max(hi, axis=0))
    tl.store(partial_ptr + 2 * programs + slot, tl.max(nan_seen, axis=0).to(tl.float32))


@triton.jit
def _chunk_scale(lo, hi, eps):
    # Same operations, same order as codec._encode_params: correctly rounded division and round-half-even.
    scale = libdevice.div_rn(tl.full([], 255.0, tl.float32), (hi - lo) + eps)
    lower = libdevice.rint(hi * scale) - 255.0
    finite = (tl.abs(lo) < float("inf")) & (tl.abs(hi) < float("inf"))
    return scale, lower, finite


@triton.jit
def _quantize_kernel(
    x_ptr,
    partial_ptr,
    out_ptr,
    numel,
    length,
    span,
    eps,
    header_bytes: tl.constexpr,
    partials_block: tl.constexpr,
    block: tl.constexpr,
    load_eviction: tl.constexpr,
    store_eviction: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    per_row = tl.num_programs(1)
    programs = tl.num_programs(0) * per_row
    p = tl.arange(0, partials_block)
    p_mask = p < per_row
    p_ptr = partial_ptr + row * per_row + p
    lo = tl.min(tl.load(p_ptr, mask=p_mask, other=float("inf")), axis=0)
    hi = tl.max(tl.load(p_ptr + programs, mask=p_mask, other=float("-inf")), axis=0)
    nan_seen = tl.max(tl.load(p_ptr + 2 * programs, mask=p_mask, other=0.0), axis=0)
    scale, lower, finite = _chunk_scale(lo, hi, eps)
    finite = finite & (nan_seen == 0.0)
    zero_codes = (hi == lo) | ~finite

    row_ptr = out_ptr + row.to(tl.int64) * (header_bytes + length)
    # Header: lo and hi as little-endian float32 bytes, NaN for a non-finite chunk, then zeros.
    h = tl.arange(0, header_bytes)
    lo_bits = tl.where(finite, lo, float("nan")).to(tl.uint32, bitcast=True)
    hi_bits = tl.where(finite, hi, float("nan")).to(tl.uint32, bitcast=True)
    word = tl.where(h < 4, lo_bits, tl.where(h < 8, hi_bits, 0))
    header = (word >> ((h % 4) * 8).to(tl.uint32)) & 0xFF
    tl.store(row_ptr + h, header.to(tl.uint8), mask=(h < header_bytes) & (part == 0))

    row_start = row.to(tl.int64) * length
    x_last = tl.load(x_ptr + (numel - 1)).to(tl.float32)
    start = part * span
    end = tl.minimum(start + span, length)
    offsets = tl.arange(0, block)
    # Backwards: the min/max pass ended on the tail of each span, which may still be in L2.
    steps = tl.cdiv(end - start, block)
    for step in range(steps):
        j = start + (steps - 1 - step) * block + offsets
        x = _load_values(x_ptr, row_start, j, end, numel, x_last, load_eviction)
        q = libdevice.rint(x * scale) - lower
        q = tl.minimum(tl.maximum(q, 0.0), 255.0)
        q = tl.where(zero_codes, 0.0, q)
        tl.store(row_ptr + header_bytes + j, q.to(tl.uint8), mask=j < end, eviction_policy=store_eviction)


@triton.jit
def _decode_kernel(
    encoded_ptr,
    out_ptr,
    numel,
    length,
    row_pitch,
    span,
    eps,
    header_bytes: tl.constexpr,
    block: tl.constexpr,
    accumulate: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    row_ptr = encoded_ptr + row.to(tl.int64) * row_pitch
    # Rows need not be 4-byte aligned, so the header floats are assembled from bytes (disjoint bits: sum == or).
    h = tl.arange(0, 8)
    raw = tl.load(row_ptr + h).to(tl.uint32) << ((h % 4) * 8).to(tl.uint32)
    lo = tl.sum(tl.where(h < 4, raw, 0), axis=0).to(tl.uint32).to(tl.float32, bitcast=True)
    hi = tl.sum(tl.where(h >= 4, raw, 0), axis=0).to(tl.uint32).to(tl.float32, bitcast=True)
    scale, lower, finite = _chunk_scale(lo, hi, eps)
    # decoded = q * a + b, with a = 1 / scale and b = lower / scale each rounded once from float64.
    scale64 = scale.to(tl.float64)
    a = libdevice.div_rn(tl.full([], 1.0, tl.float64), scale64).to(tl.float32)
    b = libdevice.div_rn(lower.to(tl.float64), scale64).to(tl.float32)
    constant = hi == lo
    a = tl.where(constant, 0.0, a)
    b = tl.where(constant, lo, b)
    a = tl.where(finite, a, float("nan"))
    b = tl.where(finite, b, float("nan"))

    row_start = row.to(tl.int64) * length
    start = part * span
    end = tl.minimum(start + span, length)
    offsets = tl.arange(0, block)
    for base in range(start, end, block):
        j = base + offsets
        index = row_start + j
        mask = (j < end) & (index < numel)
        q = tl.load(row_ptr + header_bytes + j, mask=mask, other=0).to(tl.float32)
        decoded = (q * a + b).to(out_ptr.dtype.element_ty)
        if accumulate:
            # out += decoded as torch adds two tensors of out's dtype: in float32, rounded once to the dtype.
            previous = tl.load(out_ptr + index, mask=mask, other=0).to(tl.float32)
            decoded = (previous + decoded.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + index, decoded, mask=mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def _keep_per_mille(nbytes: int, device_index: int, config: _Config) -> int:
    """Return how much of each span (in thousandths, from its tail) the min/max pass asks L2 to keep."""
    keep = config.l2_share * _l2_bytes(device_index)
    return min(1000, int(1000 * keep / nbytes))


@functools.lru_cache(maxsize=1024)
def _split(rows: int, length: int, device_index: int, config: _Config) -> tuple[int, int]:
    """Return ``(span, programs_per_row)``: each program handles ``span`` elements (whole blocks) of a row."""
    wanted = max(1, _sm_count(device_index) * config.programs_per_sm // rows)
    per_row = max(1, min(triton.cdiv(length, config.block), wanted, config.max_programs_per_row))
    span = triton.cdiv(triton.cdiv(length, per_row), config.block) * config.block
    return span, triton.cdiv(length, span)


def _on(device: torch.device) -> "contextlib.AbstractContextManager[object]":
    # Triton launches on the current device; switching costs host time, so only when needed.
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def compress(tensor: Tensor, num_chunks: int, length: int, eps: float, header_bytes: int) -> Tensor:
    """Encode a non-empty contiguous 1-D CUDA tensor into ``(num_chunks, header_bytes + length)`` bytes.

    Args:
        tensor: the flat float32/float16/bfloat16 input.
        num_chunks: number of chunks.
        length: elements per chunk, ``ceil(numel / num_chunks)``.
        eps: the codec's epsilon.
        header_bytes: bytes of each row's header.

    Returns:
        The encoded rows.
    """
    device = tensor.device
    nbytes = tensor.numel() * tensor.element_size()
    config = SMALL_COMPRESS_CONFIG if nbytes < SMALL_COMPRESS_BYTES else COMPRESS_CONFIG
    span, per_row = _split(num_chunks, length, device.index, config)
    partials = torch.empty(3 * num_chunks * per_row, dtype=torch.float32, device=device)
    out = torch.empty((num_chunks, header_bytes + length), dtype=torch.uint8, device=device)
    grid = (num_chunks, per_row)
    with _on(device):
        _minmax_kernel[grid](
            tensor,
            partials,
            tensor.numel(),
            length,
            span,
            _keep_per_mille(nbytes, device.index, config),
            block=config.block,
            early_eviction=config.early_eviction,
            late_eviction=config.late_eviction,
            num_warps=config.num_warps,
        )
        _quantize_kernel[grid](
            tensor,
            partials,
            out,
            tensor.numel(),
            length,
            span,
            eps,
            header_bytes=header_bytes,
            partials_block=max(16, triton.next_power_of_2(per_row)),
            block=config.block,
            load_eviction=config.load_eviction,
            store_eviction=config.store_eviction,
            num_warps=config.num_warps,
        )
    return out


def decode(encoded: Tensor, out: Tensor, numel: int, eps: float, header_bytes: int, accumulate: bool = False) -> None:
    """Decode the first ``numel`` elements of ``encoded`` (rows with contiguous bytes) into the flat ``out``.

    Args:
        encoded: ``(k, header_bytes + L)`` uint8 rows on CUDA.
        out: a contiguous tensor of at least ``numel`` elements on the same device.
        numel: number of elements to decode, at most ``k * L``.
        eps: the codec's epsilon.
        header_bytes: bytes of each row's header.
        accumulate: add the decoded values to ``out`` (in one pass) instead of overwriting it.
    """
    length = encoded.shape[1] - header_bytes
    if numel == 0 or length == 0:
        return
    rows = triton.cdiv(numel, length)
    config = DECODE_CONFIG
    span, per_row = _split(rows, length, encoded.device.index, config)
    with _on(encoded.device):
        _decode_kernel[(rows, per_row)](
            encoded,
            out,
            numel,
            length,
            encoded.stride(0),
            span,
            eps,
            header_bytes=header_bytes,
            block=config.block,
            accumulate=accumulate,
            num_warps=config.num_warps,
        )


def decode_add(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out += decoded`` for the first ``out.numel()`` elements of ``encoded``, decoded in ``out``'s dtype.

    One pass that reads the codes and ``out`` and writes ``out``, where decoding into a temporary and adding it
    reads and writes the temporary too; the sums are the bits torch's ``out.add_(decoded)`` writes.
    """
    decode(encoded, out, out.numel(), eps, header_bytes, accumulate=True)
