"""The DCD-PSGD difference ``d = x + L/3 + R/3 - 5w/3`` in one Triton kernel, for CUDA tensors.

Imported lazily by :mod:`lightning_bagua.engine.algorithms.low_precision_decentralized` (importing this module
imports Triton). Torch's ops evaluate the difference in seven passes over the weights (three divisions by 3, a
multiplication by 5, three additions), each reading and writing weight-sized tensors; this kernel reads ``x``,
``L``, ``R`` and ``w`` once and writes ``d`` once, and writes the same bits as those ops do on CUDA:

- torch divides a CUDA tensor by a Python scalar as a multiplication by the scalar's reciprocal, taken in float32;
- every op rounds its result to the tensors' dtype (float32, float16 or bfloat16) before the next one reads it;
- no multiply-add is fused (``enable_fp_fusion=False``), since torch rounds the product before the sum.
"""

# mypy: disable-error-code="no-untyped-def"
# ruff: noqa: ANN001, ANN202

import struct

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["difference_into"]

_BLOCK = 4096  # elements per program
_NUM_WARPS = 8
# torch's reciprocal of the divisor 3, as float32: 1.0f / 3.0f.
_ONE_THIRD = struct.unpack("f", struct.pack("f", 1.0 / 3.0))[0]


@triton.jit
def _difference_kernel(out_ptr, x_ptr, left_ptr, right_ptr, w_ptr, numel, one_third, block: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
    valid = offsets < numel
    x = tl.load(x_ptr + offsets, mask=valid)
    dtype = x.dtype
    left = tl.load(left_ptr + offsets, mask=valid).to(tl.float32)
    right = tl.load(right_ptr + offsets, mask=valid).to(tl.float32)
    w = tl.load(w_ptr + offsets, mask=valid).to(tl.float32)
    # The ops in torch's order, each rounded to the dtype: x + L/3, then + R/3, then - (5w)/3.
    d = (x.to(tl.float32) + (left * one_third).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    d = (d + (right * one_third).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    five_w = (w * 5.0).to(dtype).to(tl.float32)
    d = d - (five_w * one_third).to(dtype).to(tl.float32)
    tl.store(out_ptr + offsets, d.to(dtype), mask=valid)


def difference_into(out: Tensor, x: Tensor, left: Tensor, right: Tensor, w: Tensor) -> None:
    """Write ``x + left/3 + right/3 - 5 w/3`` into ``out``, bit for bit as torch's CUDA ops evaluate it in turn.

    Args:
        out: a flat, contiguous tensor like ``x``, which may be ``x`` but no other operand.
        x: the flat, contiguous weights after the local step.
        left: the estimate of the left neighbour's ``w``, like ``x`` (it may be ``right`` or ``w``).
        right: the estimate of the right neighbour's ``w``, like ``x``.
        w: the weights last communicated, like ``x``.
    """
    numel = x.numel()
    if numel == 0:
        return
    grid = (triton.cdiv(numel, _BLOCK),)
    _difference_kernel[grid](
        out, x, left, right, w, numel, _ONE_THIRD, block=_BLOCK, num_warps=_NUM_WARPS, enable_fp_fusion=False
    )
