"""Per-chunk parameters of the MinMaxUInt8 codec, shared by its torch and blocked backends.

The Triton kernels mirror these operations in their own language.
"""

import math

import torch
from torch import Tensor

__all__ = ["LEVELS", "decode_params", "encode_params", "quantise_rows_", "range_header"]

LEVELS = 255.0
"""The largest code: codes run from 0 to 255."""


def encode_params(lo: Tensor, hi: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-chunk ``(finite, scale, lower)`` from float32 ``lo``/``hi``; the Triton kernels mirror these ops."""
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
