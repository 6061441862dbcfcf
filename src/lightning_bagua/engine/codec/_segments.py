"""Many small tensors through the MinMaxUInt8 codec in a constant number of torch calls.

:class:`~lightning_bagua.engine.codec.MinMaxUInt8Codec` encodes one flat tensor per call, and a call costs a few
hundred microseconds of host time on a CPU whatever its size. ``low_rank`` sends dozens of small factors per
bucket, each cut into its own chunks, so one call per factor made the codec's host cost larger than its work.

:class:`SegmentLayout` is computed once per message layout. It lays every segment's chunks out as the rows of
one padded ``(rows, widest chunk)`` matrix, so that one gather, one vectorised quantisation and two scatters
encode all of them, and one gather and one vectorised decode read them back. The bytes are those of
``torch.cat([codec.compress(segment_i, chunks_i).view(-1) for i ...])``: a row is padded by repeating its
segment's last element, which is what the codec pads with, and which never widens a chunk's range.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_bagua.engine.codec import MinMaxUInt8Codec, _cpu
from lightning_bagua.engine.codec._reference import decode_params, encode_params, quantise_rows_, range_header

__all__ = ["SegmentBackend", "SegmentLayout", "segment_backend"]

SegmentBackend = Literal["auto", "torch", "native"]


def segment_backend(codec: MinMaxUInt8Codec) -> SegmentBackend:
    """Return the segment backend that follows ``codec``'s.

    A codec told to run torch ops keeps the segments off the native kernels too, one told ``"native"`` needs them,
    and the others leave the choice to ``"auto"``.
    """
    if codec.backend == "torch":
        return "torch"
    return "native" if codec.backend == "native" else "auto"


_HEADER_BYTES = MinMaxUInt8Codec.HEADER_BYTES


@dataclass(frozen=True)
class _Indices:
    """Index tensors of a layout on one device."""

    gather: Tensor  # (rows, width): element of the flat input behind every padded position
    code_source: Tensor  # (codes,): position in the flat (rows * width) codes of every code on the wire
    code_target: Tensor  # (codes,): byte of the message it goes to
    header_target: Tensor  # (rows * 8,): bytes of the message that hold every row's lo and hi
    code_bytes: Tensor  # (rows, width): byte of the message behind every padded code position
    unpad: Tensor  # (elements,): position in the flat (rows * width) decoded values of every input element


@dataclass(frozen=True)
class _Rows:
    """Every row of a layout for the native kernels (int64 CPU tensors, one entry per row)."""

    start: Tensor  # element of the flat input (and of the decoded sum) where the row's real elements begin
    encoded: Tensor  # real elements the row codes (at least one: a row past its segment's end repeats the last)
    decoded: Tensor  # real elements the row decodes (zero for a row past its segment's end)
    length: Tensor  # codes on the wire
    offset: Tensor  # message byte of the row's header


class SegmentLayout:
    """Where the chunks of several flat tensors go in one 8-bit message, and back.

    Segment ``i`` has ``numel_i`` elements cut into ``chunks_i`` chunks of ``L_i = ceil(numel_i / chunks_i)``
    elements, as ``MinMaxUInt8Codec.compress(segment_i, chunks_i)`` cuts it; its rows (a 32-byte header, then
    ``L_i`` codes) follow those of segment ``i - 1`` in the message, from byte ``start``.

    Args:
        segments: ``(numel_i, chunks_i)`` of every segment, in message order; ``numel_i >= 1``.
        start: the message byte where the first segment's first row begins.
        eps: the codec's ``eps``.
        backend: ``"native"`` codes float32 CPU tensors with the codec's C++ kernels, one call each way; ``"torch"``
            with a fixed number of vectorised torch calls (CUDA tensors, and other dtypes, always take these);
            ``"auto"`` is ``"native"`` where those kernels are built. Both write the same bytes.
    """

    def __init__(
        self,
        segments: list[tuple[int, int]],
        start: int,
        eps: float,
        backend: SegmentBackend = "auto",
    ) -> None:
        if not segments or any(numel < 1 or chunks < 1 for numel, chunks in segments):
            raise ValueError(f"Segments need at least one element and one chunk each, got {segments}.")
        if backend not in ("auto", "torch", "native"):
            raise ValueError(f"Unknown segment backend {backend!r}: choose 'auto', 'torch' or 'native'.")
        if backend == "native":
            _cpu.kernels()  # says why it cannot run
        self.native = backend != "torch" and _cpu.available()
        self.segments = segments
        self.start = start
        self.eps = eps
        self.lengths = [-(-numel // chunks) for numel, chunks in segments]
        self.rows = sum(chunks for _, chunks in segments)
        self.width = max(self.lengths)
        self.elements = sum(numel for numel, _ in segments)
        self.nbytes = sum(
            chunks * (_HEADER_BYTES + length) for (_, chunks), length in zip(segments, self.lengths, strict=True)
        )
        self._indices: dict[torch.device, _Indices] = {}
        self._rows: _Rows | None = None

    def encode_into(self, flat: Tensor, message: Tensor) -> None:
        """Encode the concatenated segments ``flat`` (float32, ``elements`` long) into bytes ``start..`` of ``message``.

        Args:
            flat: the segments one after the other, float32.
            message: a ``uint8`` tensor of at least ``start + nbytes`` bytes; header bytes 8-31 must be zero.
        """
        if self._runs_native(flat):
            self._encode_native(flat.contiguous(), message)
            return
        indices = self._on(flat.device)
        values = flat.take(indices.gather)
        # On CPU, amin + amax (vectorised) beat aminmax along a dim; NaN propagates into both.
        lo, hi = torch.aminmax(values, dim=1) if values.is_cuda else (values.amin(dim=1), values.amax(dim=1))
        finite, scale, lower = encode_params(lo, hi, self.eps)
        quantise_rows_(values, scale, lower)
        # Non-finite rows hold NaN codes and constant rows ignore theirs: both carry zeros.
        values.masked_fill_((~finite | (hi == lo)).unsqueeze(1), 0.0)
        codes = values.to(torch.int32).to(torch.uint8)  # float32 -> uint8 directly is a slow scalar path on CPU
        message[indices.header_target] = range_header(lo, hi, finite).view(-1)
        message[indices.code_target] = codes.view(-1)[indices.code_source]

    def decode_sum(self, gathered: Tensor) -> Tensor:
        """Decode the segments of every row of ``gathered`` and sum them over the rows, first to last, in float32.

        Args:
            gathered: ``(participants, message bytes)`` uint8, one message per participant.

        Returns:
            The summed segments one after the other, a new float32 tensor of ``elements``.
        """
        if self.native and gathered.device.type == "cpu":
            rows = self._native_rows()
            total = torch.empty(self.elements, dtype=torch.float32)
            _cpu.decode_sum_segments(gathered, rows.start, rows.decoded, rows.offset, self.eps, _HEADER_BYTES, total)
            return total
        indices = self._on(gathered.device)
        participants = gathered.shape[0]
        header = gathered[:, indices.header_target].view(torch.float32).view(participants, self.rows, 2)
        scale, offset = decode_params(header[..., 0], header[..., 1], self.eps)
        decoded = gathered[:, indices.code_bytes].to(torch.float32)
        decoded.mul_(scale.unsqueeze(2)).add_(offset.unsqueeze(2))
        total = decoded[0]
        for row in decoded[1:]:
            total.add_(row)
        return total.view(-1).take(indices.unpad)

    def _runs_native(self, flat: Tensor) -> bool:
        return self.native and flat.device.type == "cpu" and flat.dtype == torch.float32

    def _encode_native(self, flat: Tensor, message: Tensor) -> None:
        rows = self._native_rows()
        _cpu.encode_segments(
            flat, rows.start, rows.encoded, rows.length, rows.offset, self.eps, _HEADER_BYTES, message
        )  # fmt: skip

    def _native_rows(self) -> _Rows:
        if self._rows is None:
            start, encoded, decoded, length, offset = [], [], [], [], []
            element, byte = 0, self.start
            for (numel, chunks), size in zip(self.segments, self.lengths, strict=True):
                for chunk in range(chunks):
                    first = element + chunk * size
                    real = max(0, min(size, element + numel - first))
                    # A row wholly past its segment's end repeats the segment's last element.
                    start.append(first if real else element + numel - 1)
                    encoded.append(max(real, 1))
                    decoded.append(real)
                    length.append(size)
                    offset.append(byte + chunk * (_HEADER_BYTES + size))
                element, byte = element + numel, byte + chunks * (_HEADER_BYTES + size)
            self._rows = _Rows(
                *(torch.tensor(values, dtype=torch.int64) for values in (start, encoded, decoded, length, offset))
            )
        return self._rows

    def _on(self, device: torch.device) -> _Indices:
        indices = self._indices.get(device)
        if indices is None:
            indices = self._indices[device] = self._build(device)
        return indices

    def _build(self, device: torch.device) -> _Indices:
        width = self.width
        column = torch.arange(width)
        gather, code_source, code_target, header_target, code_bytes, unpad = [], [], [], [], [], []
        element, row, byte = 0, 0, self.start
        for (numel, chunks), length in zip(self.segments, self.lengths, strict=True):
            last = element + numel - 1
            starts = element + torch.arange(chunks).unsqueeze(1) * length
            # Past a chunk's length, and past the segment's end, the row repeats the segment's last element.
            gather.append(torch.minimum(starts + column.clamp(max=length - 1), torch.tensor(last)))
            row_bytes = byte + torch.arange(chunks).unsqueeze(1) * (_HEADER_BYTES + length)
            header_target.append((row_bytes + torch.arange(8)).view(-1))
            codes = row_bytes + _HEADER_BYTES + column.clamp(max=length - 1)
            code_bytes.append(codes)
            code_target.append(codes[:, :length].reshape(-1))
            code_source.append(((row + torch.arange(chunks)).unsqueeze(1) * width + column[:length]).view(-1))
            within = torch.arange(numel)
            unpad.append((row + within // length) * width + within % length)
            element, row, byte = element + numel, row + chunks, byte + chunks * (_HEADER_BYTES + length)
        return _Indices(
            gather=torch.cat(gather).to(device),
            code_source=torch.cat(code_source).to(device),
            code_target=torch.cat(code_target).to(device),
            header_target=torch.cat(header_target).to(device),
            code_bytes=torch.cat(code_bytes).to(device),
            unpad=torch.cat(unpad).to(device),
        )
