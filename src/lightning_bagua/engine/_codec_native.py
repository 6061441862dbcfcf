"""Fused C kernels of the MinMaxUInt8 codec for float32 CPU tensors, compiled on first use.

The blocked torch backend still goes over a block several times (one torch call per step) and pays a few hundred
microseconds of host time per call. Here one C loop finds every chunk's range, one writes its header and codes,
and decoding is one loop that can add into an output or sum the rows of several ranks. The per-element float32
operations are those of the torch backend, in the same order (``v * scale``, round half to even, ``- lower``,
clamp; decoding ``q * a`` then ``+ b``), built with ``-ffp-contract=off`` so that the compiler never fuses a
multiply and an add, so every backend writes the same bytes and decodes to the same values. (The sign of a zero
range end, where a chunk holds zeros of both signs, is settled with the blocked backend's reductions, chunk by
chunk where it arises.) (Where a chunk's
``|v * scale|`` stays below ``2^30`` the codes are computed in int32, which gives the same codes; see
``quantise_in_int32``.)

The source is compiled with the system's C compiler (``$CC``, else ``cc`` or ``gcc``, the compiler torch's own
inductor uses on CPU) into ``$LIGHTNING_BAGUA_CACHE`` (default ``~/.cache/lightning_bagua``), named by a hash of
the source, the flags and the machine, and loaded with :mod:`ctypes`. Without a compiler, or with
``LIGHTNING_BAGUA_NATIVE_CODEC=0``, :func:`available` is ``False`` and the codec's ``"auto"`` backend uses the
blocked torch kernels, which write the same bytes.

float16 and bfloat16 tensors, and decoding into them, go to the blocked kernels.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from lightning_bagua.engine import _codec_blocked

__all__ = [
    "available",
    "compress",
    "decode",
    "decode_add",
    "decode_sum",
    "decode_sum_rows",
    "encode_rows",
    "kernels",
    "library_path",
    "segment_ranges",
]

log = logging.getLogger(__name__)

DISABLE_ENV = "LIGHTNING_BAGUA_NATIVE_CODEC"
CACHE_ENV = "LIGHTNING_BAGUA_CACHE"

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const float LEVELS = 255.0f;

static float nan_f(void) {
    uint32_t bits = 0x7fc00000u; /* the NaN torch writes for math.nan */
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Per chunk: scale = 255 / (hi - lo + eps), lower = round(hi * scale) - 255, in float32. */
static void encode_params(float lo, float hi, float eps, float *scale, float *lower) {
    float range = hi - lo;
    range = range + eps;
    *scale = LEVELS / range;
    float top = hi * *scale;
    *lower = nearbyintf(top) - LEVELS;
}

/* Every value quantised is finite (its chunk is), and so are scale and lower: the clamp may then compile to one
   max and one min instruction, which GCC only emits when told that no NaN or signed zero can change the result. */
#if defined(__GNUC__) && !defined(__clang__)
#define LB_FINITE_VALUES __attribute__((optimize("finite-math-only", "no-signed-zeros")))
#else
#define LB_FINITE_VALUES
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define LB_ROUND_TO_INT32(x) __builtin_irintf(x)
#else
#define LB_ROUND_TO_INT32(x) ((int32_t)lrintf(x))
#endif

/* Minimum and maximum of v[start..end), sixteen lanes at a time; returns whether any is NaN or an infinity (its
   exponent bits all set, seen without float compares). */
LB_FINITE_VALUES static int span_range(const float *v, int64_t start, int64_t end, float *lo, float *hi) {
    float mn16[16], mx16[16];
    uint32_t special16[16];
    for (int lane = 0; lane < 16; ++lane) {
        mn16[lane] = mx16[lane] = v[start];
        special16[lane] = 0;
    }
    int64_t i = start;
    for (; i + 16 <= end; i += 16) {
        for (int lane = 0; lane < 16; ++lane) {
            float x = v[i + lane];
            uint32_t bits;
            memcpy(&bits, v + i + lane, sizeof bits);
            mn16[lane] = x < mn16[lane] ? x : mn16[lane];
            mx16[lane] = x > mx16[lane] ? x : mx16[lane];
            special16[lane] |= (bits & 0x7f800000u) == 0x7f800000u;
        }
    }
    float mn = mn16[0], mx = mx16[0];
    uint32_t special = 0;
    for (int lane = 0; lane < 16; ++lane) {
        mn = mn16[lane] < mn ? mn16[lane] : mn;
        mx = mx16[lane] > mx ? mx16[lane] : mx;
        special |= special16[lane];
    }
    for (; i < end; ++i) {
        float x = v[i];
        uint32_t bits;
        memcpy(&bits, v + i, sizeof bits);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
        special |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    *lo = special ? nan_f() : mn;
    *hi = special ? nan_f() : mx;
    return special != 0;
}

/* Whether a finite range has a zero extreme: min and max are exact in any order, except for the sign of a zero,
   which the caller settles as torch does. */
static int zero_extreme(int special, float lo, float hi) { return !special && (lo == 0.0f || hi == 0.0f); }

/* Range of every chunk (padding included: it repeats the last element); returns how many finite chunks have a
   zero extreme. A chunk with NaN or an infinity gets NaN for both. */
int64_t lb_row_ranges(const float *v, int64_t numel, int64_t chunks, int64_t length, float *lo, float *hi) {
    int64_t settle = 0;
    for (int64_t row = 0; row < chunks; ++row) {
        int64_t start = row * length < numel ? row * length : numel - 1;
        int64_t end = row * length + length < numel ? row * length + length : numel;
        int special = span_range(v, start, end, lo + row, hi + row);
        settle += zero_extreme(special, lo[row], hi[row]);
    }
    return settle;
}

/* quantise() for a chunk whose |v * scale| stays below 2^30: round and convert in one instruction, subtract and
   clamp in int32. The same codes: round(v * scale) - lower is an exact integer here, which float32 represents
   whenever it lies in [0, 255], and rounds to the same side of the clamp when it does not. */
LB_FINITE_VALUES static void quantise_in_int32(const float *v, int64_t n, float scale, int32_t lower,
                                               uint8_t *codes) {
    for (int64_t i = 0; i < n; ++i) {
        int32_t q = LB_ROUND_TO_INT32(v[i] * scale) - lower;
        q = q > 0 ? q : 0;
        q = q < 255 ? q : 255;
        codes[i] = (uint8_t)q;
    }
}

LB_FINITE_VALUES static void quantise(const float *v, int64_t n, float scale, float lower, uint8_t *codes) {
    for (int64_t i = 0; i < n; ++i) {
        float x = v[i] * scale;
        x = nearbyintf(x);
        x = x - lower;
        x = x > 0.0f ? x : 0.0f;
        x = x < LEVELS ? x : LEVELS;
        codes[i] = (uint8_t)(int32_t)x;
    }
}

/* One row: lo, hi (NaN if not finite), zeros to header_bytes, then the codes of the real elements of v and, up to
   length, copies of the last one's code (the padding repeats the last element). */
static void encode_row(const float *v, int64_t real, int64_t length, float lo, float hi, float eps,
                       int64_t header_bytes, uint8_t *dest) {
    int finite = isfinite(lo) && isfinite(hi);
    float range[2] = {finite ? lo : nan_f(), finite ? hi : nan_f()};
    memcpy(dest, range, sizeof range);
    memset(dest + sizeof range, 0, (size_t)header_bytes - sizeof range);
    uint8_t *codes = dest + header_bytes;
    float scale, lower;
    encode_params(lo, hi, eps, &scale, &lower);
    if (!finite || hi == lo) {
        memset(codes, 0, (size_t)length);
        return;
    }
    /* v lies in [lo, hi], and rounded products keep their order: |v * scale| is at most the larger end's. */
    if (fabsf(lo * scale) < 0x1p30f && fabsf(hi * scale) < 0x1p30f)
        quantise_in_int32(v, real, scale, (int32_t)lower, codes);
    else
        quantise(v, real, scale, lower, codes);
    if (real < length)
        memset(codes + real, codes[real - 1], (size_t)(length - real));
}

/* Rows of header_bytes + length: lo, hi (NaN if not finite), zeros, then the codes. */
void lb_compress(const float *v, int64_t numel, int64_t chunks, int64_t length, float eps, const float *lo,
                 const float *hi, int64_t header_bytes, uint8_t *out) {
    for (int64_t row = 0; row < chunks; ++row) {
        int64_t start = row * length;
        int64_t real = numel - start < length ? numel - start : length;
        encode_row(v + start, real, length, lo[row], hi[row], eps, header_bytes, out + row * (header_bytes + length));
    }
}

/* Rows of many segments into one message: row r codes v[start[r] .. start[r] + real[r]) padded to length[r] codes
   at byte offset[r]. Its range goes to lo[r] and hi[r]; returns how many finite rows have a zero extreme, which
   the caller settles and then writes with lb_encode_rows. */
int64_t lb_segment_ranges(const float *v, int64_t rows, const int64_t *start, const int64_t *real, float *lo,
                          float *hi) {
    int64_t settle = 0;
    for (int64_t row = 0; row < rows; ++row) {
        int special = span_range(v, start[row], start[row] + real[row], lo + row, hi + row);
        settle += zero_extreme(special, lo[row], hi[row]);
    }
    return settle;
}

void lb_encode_rows(const float *v, int64_t rows, const int64_t *start, const int64_t *real, const int64_t *length,
                    const int64_t *offset, float eps, const float *lo, const float *hi, int64_t header_bytes,
                    uint8_t *message) {
    for (int64_t row = 0; row < rows; ++row)
        encode_row(v + start[row], real[row], length[row], lo[row], hi[row], eps, header_bytes,
                   message + offset[row]);
}

/* decoded = q * a + b, with a and b rounded once from double; constant chunks decode to lo, others to NaN. */
static void decode_params(const uint8_t *row, float eps, float *a, float *b) {
    float range[2];
    memcpy(range, row, sizeof range);
    float lo = range[0], hi = range[1];
    float scale, lower;
    encode_params(lo, hi, eps, &scale, &lower);
    if (!(isfinite(lo) && isfinite(hi))) {
        *a = *b = nan_f();
        return;
    }
    if (hi == lo) {
        *a = 0.0f;
        *b = lo;
        return;
    }
    double scale64 = (double)scale;
    *a = (float)(1.0 / scale64);
    *b = (float)((double)lower / scale64);
    /* A finite chunk whose range overflows gets scale 0: a is inf and b NaN (as in the torch backend). */
}

static void affine(const uint8_t *codes, int64_t n, float a, float b, float *dest) {
    for (int64_t i = 0; i < n; ++i) {
        float x = (float)codes[i] * a;
        dest[i] = x + b;
    }
}

static void affine_add(const uint8_t *codes, int64_t n, float a, float b, float *dest) {
    for (int64_t i = 0; i < n; ++i) {
        float x = (float)codes[i] * a;
        x = x + b;
        dest[i] = dest[i] + x;
    }
}

/* The first numel elements of rows (row-major, padding included) into out; add instead of writing if add. */
void lb_decode(const uint8_t *encoded, int64_t rows, int64_t row_stride, int64_t header_bytes, int64_t length,
               int64_t numel, float eps, float *out, int add) {
    for (int64_t row = 0; row < rows && row * length < numel; ++row) {
        const uint8_t *source = encoded + row * row_stride;
        float a, b;
        decode_params(source, eps, &a, &b);
        int64_t start = row * length;
        int64_t n = numel - start < length ? numel - start : length;
        if (add)
            affine_add(source + header_bytes, n, a, b, out + start);
        else
            affine(source + header_bytes, n, a, b, out + start);
    }
}

/* out = row_0 + row_1 + ... over the first numel codes of every row, in row order, block by block in cache. Every
   row's decode factors are found once, not once per block. Returns -1 if their scratch cannot be allocated. */
int lb_decode_sum(const uint8_t *encoded, int64_t rows, int64_t row_stride, int64_t header_bytes, int64_t numel,
                  float eps, float *out) {
    const int64_t block = 4096;
    float *factors = malloc(2 * (size_t)rows * sizeof(float));
    if (!factors)
        return -1;
    for (int64_t row = 0; row < rows; ++row)
        decode_params(encoded + row * row_stride, eps, factors + 2 * row, factors + 2 * row + 1);
    for (int64_t start = 0; start < numel; start += block) {
        int64_t n = numel - start < block ? numel - start : block;
        for (int64_t row = 0; row < rows; ++row) {
            const uint8_t *codes = encoded + row * row_stride + header_bytes + start;
            if (row == 0)
                affine(codes, n, factors[0], factors[1], out + start);
            else
                affine_add(codes, n, factors[2 * row], factors[2 * row + 1], out + start);
        }
    }
    free(factors);
    return 0;
}

/* For every row r of a segment message (at byte offset[r], its real[r] codes into out[start[r] ..)): the sum of
   the participants' decoded values, first to last; participant p's message starts at byte p * stride. */
void lb_decode_sum_rows(const uint8_t *messages, int64_t participants, int64_t stride, int64_t rows,
                        const int64_t *start, const int64_t *real, const int64_t *offset, float eps,
                        int64_t header_bytes, float *out) {
    for (int64_t row = 0; row < rows; ++row) {
        for (int64_t p = 0; p < participants; ++p) {
            const uint8_t *source = messages + p * stride + offset[row];
            float a, b;
            decode_params(source, eps, &a, &b);
            if (p == 0)
                affine(source + header_bytes, real[row], a, b, out + start[row]);
            else
                affine_add(source + header_bytes, real[row], a, b, out + start[row]);
        }
    }
}
"""

# No contraction of a multiply and an add into one rounding, nor any reassociation: the same float32 operations
# as the torch backend. (-fno-math-errno and -fno-trapping-math only let nearbyintf inline and vectorise.)
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
# The widest vectors this CPU has (AVX-512 halves the quantising loop's time against AVX2); the library's name
# carries the CPU's feature flags, so a cache directory shared by different machines never hands one another's
# instructions. A compiler that does not know the flag builds without it.
_NATIVE_FLAGS = ["-march=native"]

_i64, _f32 = ctypes.c_int64, ctypes.c_float
_ptr = ctypes.c_void_p


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate.split()[0]):
            return candidate
    return None


def library_path() -> Path:
    """Where the compiled kernels live (or will): the cache directory, named by source, flags and machine."""
    return _library_path(_compiler())


def _library_path(compiler: str | None) -> Path:
    cache = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lightning_bagua"
    )
    key = "\0".join([_SOURCE, *_FLAGS, *_NATIVE_FLAGS, _cpu_features(), platform.system(), str(compiler)])
    return Path(cache) / f"codec-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _cpu_features() -> str:
    """The CPU's architecture and, on Linux, its feature flags (what ``-march=native`` compiles for)."""
    features = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return f"{features} {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"{features} {platform.processor()}"


def _build(path: Path, compiler: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        source = Path(scratch) / "codec.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / path.name
        command = [*compiler.split(), *_FLAGS, str(source), "-o", str(built), "-lm"]
        try:
            subprocess.run([*command, *_NATIVE_FLAGS], check=True, capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        # Atomic: ranks building at once each rename a whole library into place.
        os.replace(built, path)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.debug("The native codec kernels are disabled by %s=0.", DISABLE_ENV)
        return None
    compiler = _compiler()
    path = _library_path(compiler)
    try:
        if not path.exists():
            if compiler is None:
                log.debug("No C compiler ($CC, cc, gcc): the codec runs on the blocked torch kernels.")
                return None
            _build(path, compiler)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.debug("The native codec kernels could not be built or loaded (%s); using the torch kernels.", detail)
        return None
    library.lb_row_ranges.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr]
    library.lb_row_ranges.restype = _i64
    library.lb_compress.argtypes = [_ptr, _i64, _i64, _i64, _f32, _ptr, _ptr, _i64, _ptr]
    library.lb_compress.restype = None
    library.lb_decode.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _f32, _ptr, ctypes.c_int]
    library.lb_decode.restype = None
    library.lb_decode_sum.argtypes = [_ptr, _i64, _i64, _i64, _i64, _f32, _ptr]
    library.lb_decode_sum.restype = ctypes.c_int
    library.lb_segment_ranges.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr]
    library.lb_segment_ranges.restype = _i64
    library.lb_encode_rows.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64, _ptr]
    library.lb_encode_rows.restype = None
    library.lb_decode_sum_rows.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _f32, _i64, _ptr]
    library.lb_decode_sum_rows.restype = None
    return library


def available() -> bool:
    """Whether the kernels are built and loaded (building them on first call)."""
    return _library() is not None


def kernels() -> ctypes.CDLL:
    """The loaded library; raises ``RuntimeError`` saying why when it cannot be built."""
    library = _library()
    if library is None:
        raise RuntimeError(
            "The codec's 'native' backend needs a C compiler ($CC, cc or gcc) to build its kernels on first use"
            f" (or {DISABLE_ENV} is 0). Install one, or use backend='blocked' or 'auto'."
        )
    return library


def _row_stride(encoded: Tensor) -> int:
    return encoded.stride(0) if encoded.shape[0] > 1 else encoded.shape[1]


@torch.no_grad()
def compress(tensor: Tensor, num_chunks: int, length: int, eps: float, header_bytes: int) -> Tensor:
    """Encode the contiguous 1-D CPU ``tensor`` (``numel >= 1``) into ``(num_chunks, header_bytes + length)`` rows."""
    if tensor.dtype != torch.float32:
        return _codec_blocked.compress(tensor, num_chunks, length, eps, header_bytes)
    library = kernels()
    numel = tensor.numel()
    pointer = tensor.data_ptr()
    ranges = torch.empty((2, num_chunks), dtype=torch.float32)
    lo, hi = ranges[0], ranges[1]
    if library.lb_row_ranges(pointer, numel, num_chunks, length, lo.data_ptr(), hi.data_ptr()):
        # -0.0 and 0.0 compare equal, and the header carries the sign (a constant chunk decodes to it): where an
        # extreme is zero, the blocked backend's torch reductions say which. Only those chunks are reduced again:
        # a zero region, such as the embedding rows of tokens a batch did not see, has one every step.
        zero = ((lo == 0) | (hi == 0)).nonzero().view(-1)
        _codec_blocked.fill_row_ranges(tensor, length, lo, hi, zero)
    encoded = torch.empty((num_chunks, header_bytes + length), dtype=torch.uint8)
    library.lb_compress(
        pointer, numel, num_chunks, length, eps, lo.data_ptr(), hi.data_ptr(), header_bytes, encoded.data_ptr()
    )
    return encoded


@torch.no_grad()
def decode(encoded: Tensor, out: Tensor, numel: int, eps: float, header_bytes: int) -> None:
    """Decode the first ``numel`` elements of ``encoded`` (row-major, padding included) into the flat ``out``."""
    length = encoded.shape[1] - header_bytes
    if out.dtype != torch.float32:
        _codec_blocked.decode(encoded, out, numel, eps, header_bytes)
    elif length and numel:
        kernels().lb_decode(
            encoded.data_ptr(), encoded.shape[0], _row_stride(encoded), header_bytes, length, numel, eps,
            out.data_ptr(), 0,
        )  # fmt: skip


@torch.no_grad()
def decode_add(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out += decoded`` for the first ``out.numel()`` elements of ``encoded``, decoded in ``out``'s dtype."""
    length = encoded.shape[1] - header_bytes
    if out.dtype != torch.float32:
        _codec_blocked.decode_add(encoded, out, eps, header_bytes)
    elif length and out.numel():
        kernels().lb_decode(
            encoded.data_ptr(), encoded.shape[0], _row_stride(encoded), header_bytes, length, out.numel(), eps,
            out.data_ptr(), 1,
        )  # fmt: skip


@torch.no_grad()
def decode_sum(encoded: Tensor, out: Tensor, eps: float, header_bytes: int) -> None:
    """``out = row_0 + row_1 + ...`` (in this order, in float32) over the first ``out.numel()`` codes of every row."""
    status = kernels().lb_decode_sum(
        encoded.data_ptr(), encoded.shape[0], _row_stride(encoded), header_bytes, out.numel(), eps, out.data_ptr()
    )
    if status:
        raise MemoryError(f"The native codec could not allocate the decode factors of {encoded.shape[0]} rows.")


@torch.no_grad()
def segment_ranges(flat: Tensor, start: Tensor, real: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Each row's ``(lo, hi)`` over ``flat[start[r] : start[r] + real[r]]``, and whether one has a zero extreme.

    ``flat`` is contiguous float32 on CPU; ``start`` and ``real`` are int64 and every ``real[r] >= 1``. A row with
    NaN or an infinity gets NaN for both. Where a finite row's extreme is a zero, its sign is left to the caller.
    """
    rows = start.numel()
    ranges = torch.empty((2, rows), dtype=torch.float32)
    settle = kernels().lb_segment_ranges(
        flat.data_ptr(), rows, start.data_ptr(), real.data_ptr(), ranges[0].data_ptr(), ranges[1].data_ptr()
    )
    return ranges[0], ranges[1], bool(settle)


@torch.no_grad()
def encode_rows(
    flat: Tensor, start: Tensor, real: Tensor, length: Tensor, offset: Tensor, lo: Tensor, hi: Tensor, eps: float,
    header_bytes: int, message: Tensor,
) -> None:  # fmt: skip
    """Write row ``r`` (header, then ``length[r]`` codes of ``flat[start[r]:]``) at byte ``offset[r]`` of ``message``.

    The codes are those of ``real[r]`` elements, padded with the last one's code; the header holds ``lo[r]`` and
    ``hi[r]`` (NaN if either is not finite), then zeros.
    """
    kernels().lb_encode_rows(
        flat.data_ptr(), start.numel(), start.data_ptr(), real.data_ptr(), length.data_ptr(), offset.data_ptr(), eps,
        lo.data_ptr(), hi.data_ptr(), header_bytes, message.data_ptr(),
    )  # fmt: skip


@torch.no_grad()
def decode_sum_rows(
    messages: Tensor, start: Tensor, real: Tensor, offset: Tensor, eps: float, header_bytes: int, out: Tensor
) -> None:
    """``out[start[r] : start[r] + real[r]]`` = the decoded codes of row ``r`` summed over ``messages``' rows, in order.

    ``messages`` is ``(participants, bytes)`` uint8 with contiguous rows; row ``r`` of a message is at its byte
    ``offset[r]``; ``out`` is contiguous float32.
    """
    kernels().lb_decode_sum_rows(
        messages.data_ptr(), messages.shape[0], _row_stride(messages), start.numel(), start.data_ptr(),
        real.data_ptr(), offset.data_ptr(), eps, header_bytes, out.data_ptr(),
    )  # fmt: skip
