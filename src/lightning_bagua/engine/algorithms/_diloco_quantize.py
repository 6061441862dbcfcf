"""How ``diloco`` sends its outer gradients: full precision, 8-bit MinMaxUInt8 rows, or 4-bit packed rows.

Every participant encodes its pseudo-gradient, the encoded rows are gathered from every participant, and every
participant decodes all of them (its own included) and averages in float32. So every participant ends with the same
average, bit for bit, and the outer step keeps the replicas of ``θ_outer`` identical.
"""

import math

import torch
from torch import Tensor

from lightning_bagua.engine.codec import MinMaxUInt8Codec

__all__ = ["QUANTIZATIONS", "OuterGradientCodec"]

QUANTIZATIONS = ("uint8", "uint4", None)
"""The values ``quantization`` accepts."""

CHUNK = 2048
"""Elements per independently scaled chunk: one outlier spoils the resolution of its chunk only."""

_EPS = 1e-7
_FOUR_BIT_LEVELS = 15
_FOUR_BIT_HEADER = 8  # lo and hi, two float32 values


class OuterGradientCodec:
    """Encode a flat float32 pseudo-gradient into rows of bytes, and average such rows gathered from every rank.

    Args:
        quantization: ``"uint8"`` (the project's MinMaxUInt8 codec, one min/max per chunk), ``"uint4"`` (16 levels
            per chunk, two codes a byte) or ``None`` (float32 as is).
    """

    def __init__(self, quantization: str | None) -> None:
        self.quantization = quantization
        self._uint8 = MinMaxUInt8Codec() if quantization == "uint8" else None

    def encode(self, delta: Tensor) -> Tensor:
        """Return ``delta`` (1-D float32) encoded as one tensor that :meth:`average` decodes.

        Args:
            delta: this rank's pseudo-gradient.

        Returns:
            A contiguous tensor of the same shape for every rank with this ``delta.numel()``.
        """
        if self.quantization is None:
            return delta.contiguous()
        chunks = max(1, math.ceil(delta.numel() / CHUNK))
        if self._uint8 is not None:
            return self._uint8.compress(delta, chunks)
        return _encode_four_bit(delta, chunks)

    def decode(self, encoded: Tensor, numel: int) -> Tensor:
        """Decode one rank's :meth:`encode` result back into ``numel`` float32 values."""
        if self.quantization is None:
            return encoded.float()
        if self._uint8 is not None:
            return self._uint8.decompress(encoded, numel, torch.float32)
        return _decode_four_bit(encoded, numel)

    def average(self, gathered: Tensor, ranks: int, numel: int) -> Tensor:
        """Average the encodings of ``ranks`` ranks, laid one after another in ``gathered``, in float32.

        Args:
            gathered: the ranks' encodings, rank-major.
            ranks: how many ranks contributed.
            numel: elements of each pseudo-gradient.

        Returns:
            The float32 mean of the decoded pseudo-gradients (a new tensor).
        """
        per_rank = gathered.view(ranks, -1) if self.quantization is None else None
        total = torch.zeros(numel, dtype=torch.float32, device=gathered.device)
        rows = gathered.shape[0] // ranks
        for rank in range(ranks):
            if per_rank is not None:
                total.add_(per_rank[rank].view(-1)[:numel])
            else:
                total.add_(self.decode(gathered[rank * rows : (rank + 1) * rows], numel))
        return total.div_(ranks)


def _encode_four_bit(delta: Tensor, chunks: int) -> Tensor:
    length = CHUNK if chunks > 1 else delta.numel() + delta.numel() % 2
    padded = torch.zeros(chunks * length, dtype=torch.float32, device=delta.device)
    padded[: delta.numel()] = delta
    rows = padded.view(chunks, length)
    if delta.numel() < chunks * length:
        # Padding repeats a real value, so that it widens no chunk's range.
        padded[delta.numel() :] = delta[-1] if delta.numel() else 0.0
    lo = rows.amin(dim=1, keepdim=True)
    hi = rows.amax(dim=1, keepdim=True)
    scale = _FOUR_BIT_LEVELS / (hi - lo + _EPS)
    codes = torch.round((rows - lo) * scale).clamp_(0, _FOUR_BIT_LEVELS).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    header = torch.cat([lo, hi], dim=1).contiguous().view(torch.uint8)
    return torch.cat([header, packed], dim=1).contiguous()


def _decode_four_bit(encoded: Tensor, numel: int) -> Tensor:
    # A fresh copy: a row's header may start at a byte offset that float32 cannot view.
    header = torch.empty((encoded.shape[0], _FOUR_BIT_HEADER), dtype=torch.uint8, device=encoded.device)
    header = header.copy_(encoded[:, :_FOUR_BIT_HEADER]).view(torch.float32)
    lo, hi = header[:, :1], header[:, 1:2]
    packed = encoded[:, _FOUR_BIT_HEADER:]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(encoded.shape[0], -1).float()
    scale = _FOUR_BIT_LEVELS / (hi - lo + _EPS)
    return (codes / scale + lo).view(-1)[:numel].contiguous()
