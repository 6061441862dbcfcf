"""Bagua's MinMaxUInt8 codec: 8-bit min/max quantisation of flat float buffers, chunk by chunk.

Used by ``bytegrad`` (gradients), ``qadam`` (momentum), ``low_precision_decentralized`` (weight differences) and
``low_rank`` (its factors, through ``_segments``). The torch ops of ``_reference`` define the bytes on every
device; two fast paths write the same bytes where measurements show they pay (the Performance page's "codec
paths"): C++ kernels for CPU tensors (``_cpu.cpp``, built by torch's extension tooling on first use) and Triton
kernels for CUDA tensors (``_triton``, imported only when first needed).
"""

import functools
import logging
import math
from types import ModuleType
from typing import ClassVar, Literal

import torch
from torch import Tensor

from lightning_bagua.engine.codec import _cpu, _reference

__all__ = ["CodecBackend", "MinMaxUInt8Codec"]

log = logging.getLogger(__name__)

CodecBackend = Literal["auto", "torch", "native", "triton"]
_BACKENDS = ("auto", "torch", "native", "triton")

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class MinMaxUInt8Codec:
    """Quantise a flat float tensor to one byte per element, with a min/max header per chunk.

    The tensor is split into ``num_chunks`` chunks of ``L = ceil(numel / num_chunks)`` elements. Chunk ``i`` is
    row ``i`` of the encoded ``uint8`` tensor of shape ``(num_chunks, HEADER_BYTES + L)``: a 32-byte header
    (the chunk's ``lo`` and ``hi`` as little-endian float32 in bytes 0-7, bytes 8-31 zero) followed by the
    chunk's ``L`` codes. Rows are independent, so a row can be sent to another rank on its own.

    Per chunk, in float32 (fp16 and bf16 inputs are upcast first), with ``round`` rounding half to even::

        lo, hi = min(chunk), max(chunk)
        scale  = 255 / (hi - lo + eps)
        upper  = round(hi * scale);  lower = upper - 255
        q      = clamp(min(round(v * scale), upper) - lower, 0, 255)        # the uint8 code
        v'     = (q + lower) / scale                                         # the decoded value

    Rounding is deterministic: the same input gives the same bytes. The decoded value is computed as
    ``q * (1 / scale) + lower / scale``, with both per-chunk factors rounded once from float64, which equals
    ``(q + lower) / scale`` up to float32 rounding. Per element, ``|v' - v| <= (hi - lo + eps) / 510`` plus a
    few float32 ulps of ``max(|lo|, |hi|)`` (the lattice ``(q + lower) / scale`` is anchored at zero, so a chunk
    far from zero relative to its range pays float32 rounding on its offset).

    Padding: when ``num_chunks`` does not divide ``numel``, the input is padded to ``num_chunks * L`` elements
    by repeating its last element. That element belongs to the last non-empty chunk, so padding never widens a
    chunk's range; chunks made only of padding are constant chunks of the last element. Padding decodes to
    whatever it decodes to; :meth:`decompress` drops it.

    Special chunks, identified from the header alone:

    - A chunk containing NaN or +-inf gets ``lo = hi = NaN`` in its header and all-zero codes, and every
      element of it decodes to NaN (also in fp16/bf16), so that a non-finite gradient stays non-finite after
      communication (a ``GradScaler`` then skips the step) instead of decoding to finite garbage. Other chunks
      are unaffected. A finite chunk whose range ``hi - lo`` overflows float32 (beyond 3.4e38) also decodes to
      NaN.
    - A constant chunk (``hi == lo``) gets all-zero codes and decodes exactly to the constant (the formula
      alone would lose constants far from zero to float32 rounding and those below ``eps`` to zero).

    Backends: ``"torch"`` runs vectorised torch ops on any device (several passes over the data): the reference,
    whose bytes the others write. ``"native"`` runs C++ kernels on CPU tensors (one pass finds each chunk's range,
    one writes headers and codes; decoding is one pass, fused with a sum or an addition; float16 and bfloat16 are
    converted to float32 around them), built on first use by ``torch.utils.cpp_extension``. ``"triton"`` runs fused
    CUDA kernels (a split min/max pass, then one quantising pass that also writes the headers; decoding is one
    pass), which needs Triton and CUDA tensors. ``"auto"`` picks Triton for CUDA tensors when Triton imports, the
    C++ kernels for CPU tensors when they build (``LIGHTNING_BAGUA_NATIVE_CODEC=0`` turns them off), torch
    otherwise. All do the same IEEE float32 operations per chunk (correctly rounded division, round-half-even), so
    they write the same bytes, and each can decode the others'; torch and native decode to the same values,
    Triton's may differ in the last ulp (the kernel fuses ``q * a + b``). One exception: where a chunk's smallest
    or largest value is a zero and it holds zeros of both signs, the header carries whichever zero the backend's
    reduction returned (native follows IEEE's total order, -0.0 below +0.0; torch's and Triton's depend on their
    reductions' order); the decoded values are the same.

    Decoding can be fused with what follows it: :meth:`decompress_sum` sums decoded rows (a reduction over the
    rows several ranks sent) and :meth:`decompress_add` adds decoded values into a buffer, without holding the
    decoded rows in memory on the native and Triton backends.

    Args:
        eps: added to the range, so that a constant chunk gets a finite scale; must be positive.
        backend: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"``.

    Raises:
        ValueError: for a non-positive ``eps`` or an unknown backend.
        RuntimeError: if ``backend="triton"`` and Triton cannot be imported, or ``backend="native"`` and its
            kernels cannot be built.

    Example:
        >>> codec = MinMaxUInt8Codec()
        >>> encoded = codec.compress(torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0]), num_chunks=2)
        >>> encoded.shape, encoded.dtype
        (torch.Size([2, 35]), torch.uint8)
        >>> codec.decompress(encoded, numel=5, dtype=torch.float32)
        tensor([0.0000, 0.4980, 1.0000, 2.0000, 4.0000])
    """

    HEADER_BYTES: ClassVar[int] = 32

    def __init__(self, eps: float = 1e-7, backend: CodecBackend = "auto") -> None:
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"`eps` must be a positive finite number, got {eps!r}.")
        if backend not in _BACKENDS:
            raise ValueError(f"Unknown codec backend {backend!r}: choose one of {', '.join(map(repr, _BACKENDS))}.")
        self.eps = float(eps)
        self.backend: CodecBackend = backend
        if backend == "triton":
            _triton_kernels()
        if backend == "native":
            _cpu.kernels()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eps={self.eps!r}, backend={self.backend!r})"

    def chunk_length(self, numel: int, num_chunks: int) -> int:
        """Return ``L``, the number of elements (and codes) per chunk: ``ceil(numel / num_chunks)``.

        Args:
            numel: number of elements of the flat tensor.
            num_chunks: number of chunks it is split into.
        """
        _check_num_chunks(num_chunks)
        if numel < 0:
            raise ValueError(f"`numel` must be non-negative, got {numel}.")
        return -(-numel // num_chunks)

    def row_bytes(self, numel: int, num_chunks: int) -> int:
        """Return the bytes of one encoded chunk: ``HEADER_BYTES + chunk_length(numel, num_chunks)``.

        Args:
            numel: number of elements of the flat tensor.
            num_chunks: number of chunks it is split into.
        """
        return self.HEADER_BYTES + self.chunk_length(numel, num_chunks)

    def compress(self, tensor: Tensor, num_chunks: int = 1) -> Tensor:
        """Encode ``tensor`` as ``num_chunks`` independently scaled chunks.

        Args:
            tensor: a 1-D float32, float16 or bfloat16 tensor, on CPU or CUDA.
            num_chunks: number of chunks, each with its own min/max.

        Returns:
            A contiguous ``uint8`` tensor of shape ``(num_chunks, row_bytes(numel, num_chunks))`` on the
            tensor's device; row ``i`` is the header of chunk ``i`` followed by its codes.

        Raises:
            TypeError: for an unsupported dtype.
            ValueError: for a tensor that is not 1-D or a ``num_chunks`` below 1.
        """
        _check_num_chunks(num_chunks)
        if tensor.dim() != 1:
            raise ValueError(f"The codec compresses flat tensors; got shape {tuple(tensor.shape)}. Flatten it first.")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"The codec compresses float32, float16 or bfloat16 tensors, got {tensor.dtype}.")
        numel = tensor.numel()
        length = self.chunk_length(numel, num_chunks)
        if numel == 0:
            # Nothing to encode: headers of zeros (lo = hi = 0.0) and no codes.
            return torch.zeros((num_chunks, self.HEADER_BYTES), dtype=torch.uint8, device=tensor.device)
        tensor = tensor.contiguous()
        kernels = self._kernels(tensor.device)
        if kernels is not None:
            return kernels.compress(tensor, num_chunks, length, self.eps, self.HEADER_BYTES)
        return _reference.compress(tensor, num_chunks, length, self.eps, self.HEADER_BYTES)

    def decompress_rows(self, encoded: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Decode every row of ``encoded``, padding included.

        Args:
            encoded: ``uint8`` rows of shape ``(k, HEADER_BYTES + L)``, e.g. rows from :meth:`compress`
                gathered from several ranks (a view with any row stride will do).
            dtype: dtype of the result (float32 by default, for summing rows from several ranks).

        Returns:
            A contiguous ``(k, L)`` tensor of ``dtype`` on ``encoded``'s device.
        """
        rows, length = self._check_encoded(encoded, dtype)
        out = torch.empty((rows, length), dtype=dtype, device=encoded.device)
        self._decode(encoded, out.view(-1), rows * length)
        return out

    def decompress(self, encoded: Tensor, numel: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        """Decode ``encoded`` back into a flat tensor of ``numel`` elements, dropping the padding.

        Args:
            encoded: the ``(k, HEADER_BYTES + L)`` rows from :meth:`compress`.
            numel: number of elements the original tensor had (at most ``k * L``).
            dtype: dtype of the result.
            out: optional contiguous ``(numel,)`` tensor of ``dtype`` on ``encoded``'s device to decode into.

        Returns:
            The ``(numel,)`` decoded tensor (``out`` if given).
        """
        rows, length = self._check_encoded(encoded, dtype)
        if not 0 <= numel <= rows * length:
            raise ValueError(f"`numel={numel}` does not fit {rows} encoded chunks of {length} elements.")
        if out is None:
            out = torch.empty(numel, dtype=dtype, device=encoded.device)
        elif out.shape != (numel,) or out.dtype != dtype or out.device != encoded.device or not out.is_contiguous():
            raise ValueError(
                f"`out` must be a contiguous ({numel},) tensor of {dtype} on {encoded.device}; got shape"
                f" {tuple(out.shape)}, {out.dtype} on {out.device}."
            )
        if numel:
            self._decode(encoded, out, numel)
        return out

    def decompress_sum(self, encoded: Tensor, out: Tensor) -> Tensor:
        """Decode every row of ``encoded`` and sum the rows into ``out``: ``out = D(row_0) + D(row_1) + ...``.

        The rows are summed in order, in float32, over their first ``out.numel()`` codes (padding beyond is
        ignored): the same values as ``decompress_rows(encoded)[:, :out.numel()].sum(0)``, without holding the
        decoded rows in memory on the blocked backend.

        Args:
            encoded: ``uint8`` rows of shape ``(k, HEADER_BYTES + L)``, ``k >= 1``, e.g. one row from each rank.
            out: a contiguous 1-D float32 tensor of at most ``L`` elements on ``encoded``'s device.

        Returns:
            ``out``.
        """
        rows, length = self._check_encoded(encoded, torch.float32)
        self._check_out(out, encoded.device, length)
        if out.dtype != torch.float32 or rows == 0:
            raise ValueError(
                f"`decompress_sum` sums at least one row into float32; got {rows} rows and `out` of {out.dtype}."
                " Pass a float32 `out`."
            )
        if out.numel() == 0:
            return out
        if encoded.stride(1) != 1:
            encoded = encoded.contiguous()
        kernels = self._kernels(encoded.device)
        if kernels is not None and hasattr(kernels, "decode_sum"):
            kernels.decode_sum(encoded, out, self.eps, self.HEADER_BYTES)
        else:
            torch.sum(self.decompress_rows(encoded)[:, : out.numel()], dim=0, out=out)
        return out

    def decompress_add(self, encoded: Tensor, out: Tensor) -> Tensor:
        """Add the decoded values to ``out``: ``out += decompress(encoded, out.numel(), out.dtype)``.

        Args:
            encoded: the ``(k, HEADER_BYTES + L)`` rows from :meth:`compress`.
            out: a contiguous 1-D float tensor of at most ``k * L`` elements on ``encoded``'s device.

        Returns:
            ``out``.
        """
        rows, length = self._check_encoded(encoded, out.dtype)
        self._check_out(out, encoded.device, rows * length)
        if out.numel() == 0:
            return out
        if encoded.stride(1) != 1:
            encoded = encoded.contiguous()
        kernels = self._kernels(encoded.device)
        if kernels is not None and hasattr(kernels, "decode_add"):
            kernels.decode_add(encoded, out, self.eps, self.HEADER_BYTES)
        else:
            out.add_(self.decompress(encoded, out.numel(), out.dtype))
        return out

    @staticmethod
    def _check_out(out: Tensor, device: torch.device, capacity: int) -> None:
        if out.dim() != 1 or out.numel() > capacity or out.device != device or not out.is_contiguous():
            raise ValueError(
                f"`out` must be a contiguous 1-D tensor of at most {capacity} elements on {device}; got shape"
                f" {tuple(out.shape)} on {out.device}."
            )

    def _kernels(self, device: torch.device) -> ModuleType | None:
        """The fast kernels for tensors on ``device``, or ``None`` for the reference's torch ops."""
        if self.backend == "torch":
            return None
        if self.backend == "triton":
            if device.type != "cuda":
                raise ValueError(f"The codec's 'triton' backend needs CUDA tensors, got a tensor on {device}.")
            return _triton_kernels()
        if self.backend == "native":
            if device.type != "cpu":
                raise ValueError(
                    f"The codec's 'native' backend runs on CPU tensors, got a tensor on {device}."
                    " Use backend='auto' (Triton on CUDA when it imports) or 'torch'."
                )
            return _cpu
        if device.type == "cpu":
            return _cpu if _cpu.available() else None
        return _triton_kernels() if device.type == "cuda" and _triton_available() else None

    def _check_encoded(self, encoded: Tensor, dtype: torch.dtype) -> tuple[int, int]:
        if encoded.dtype != torch.uint8 or encoded.dim() != 2 or encoded.shape[1] < self.HEADER_BYTES:
            raise ValueError(
                f"Encoded chunks are uint8 rows of at least {self.HEADER_BYTES} bytes; got {encoded.dtype} of shape"
                f" {tuple(encoded.shape)}."
            )
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"The codec decodes to float32, float16 or bfloat16, got {dtype}.")
        return encoded.shape[0], encoded.shape[1] - self.HEADER_BYTES

    def _decode(self, encoded: Tensor, out: Tensor, numel: int) -> None:
        """Decode the first ``numel`` elements of ``encoded`` (row-major) into the flat tensor ``out``."""
        if numel == 0:
            return
        if encoded.stride(1) != 1:
            encoded = encoded.contiguous()
        kernels = self._kernels(encoded.device)
        if kernels is not None:
            kernels.decode(encoded, out, numel, self.eps, self.HEADER_BYTES)
        else:
            _reference.decode(encoded, out, numel, self.eps, self.HEADER_BYTES)


def _check_num_chunks(num_chunks: int) -> None:
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
        raise TypeError(f"`num_chunks` must be an int, got {num_chunks!r} ({type(num_chunks).__name__}).")
    if num_chunks < 1:
        raise ValueError(f"`num_chunks` must be at least 1, got {num_chunks}.")


@functools.cache
def _import_triton_kernels() -> tuple[ModuleType | None, str]:
    """Import the Triton kernels once: ``(module, "")``, or ``(None, why)`` when Triton cannot be imported."""
    try:
        from lightning_bagua.engine.codec import _triton
    except ImportError as error:
        log.debug("Triton is unavailable (%s); the codec runs on torch ops.", error)
        return None, str(error)
    return _triton, ""


def _triton_available() -> bool:
    return _import_triton_kernels()[0] is not None


def _triton_kernels() -> ModuleType:
    module, why = _import_triton_kernels()
    if module is None:
        raise RuntimeError(
            f"The codec's 'triton' backend was requested, but Triton cannot be imported ({why})."
            " Install triton, or use backend='torch' or 'auto'."
        )
    return module
