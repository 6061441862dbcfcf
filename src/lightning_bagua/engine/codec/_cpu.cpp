// The MinMaxUInt8 codec's CPU kernels for float32, built by torch.utils.cpp_extension on first use (_cpu.py).
//
// Every per-element float32 operation is the torch reference's (_reference.py), in the same order:
// v * scale, round half to even, - lower, clamp; decoding q * a, then + b. The build passes -ffp-contract=off so
// that the compiler never fuses a multiply and an add into one rounding: these kernels write the reference's
// bytes and decode to its values. Where they differ from it is speed: one loop finds every chunk's range and
// one writes its header and codes, where the torch ops take several passes and a float32 temporary.

#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kLevels = 255.0f;

float quiet_nan() {
    uint32_t bits = 0x7fc00000u;  // the NaN torch writes for math.nan
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

uint32_t bits_of(const float* v) {
    uint32_t bits;
    std::memcpy(&bits, v, sizeof bits);
    return bits;
}

// scale = 255 / (hi - lo + eps), lower = round(hi * scale) - 255, in float32.
void encode_params(float lo, float hi, float eps, float* scale, float* lower) {
    float range = hi - lo;
    range = range + eps;
    *scale = kLevels / range;
    float top = hi * *scale;
    *lower = std::nearbyint(top) - kLevels;
}

// Every value quantised is finite (its chunk is), and so are scale and lower: the clamp may then compile to one
// max and one min instruction, which GCC only emits when told that no NaN or signed zero can change the result.
#if defined(__GNUC__) && !defined(__clang__)
#define LB_FINITE_VALUES __attribute__((optimize("finite-math-only", "no-signed-zeros")))
#define LB_ROUND_TO_INT32(x) __builtin_irintf(x)
#else
#define LB_FINITE_VALUES
#define LB_ROUND_TO_INT32(x) static_cast<int32_t>(std::lrint(x))
#endif

// Minimum and maximum of v[start..end), sixteen lanes at a time; returns whether one is NaN or an infinity (its
// exponent bits all set, seen without float compares). The sign of a zero extreme is left to span_range.
LB_FINITE_VALUES bool span_extremes(const float* v, int64_t start, int64_t end, float* lo, float* hi) {
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
            mn16[lane] = x < mn16[lane] ? x : mn16[lane];
            mx16[lane] = x > mx16[lane] ? x : mx16[lane];
            special16[lane] |= (bits_of(v + i + lane) & 0x7f800000u) == 0x7f800000u;
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
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
        special |= (bits_of(v + i) & 0x7f800000u) == 0x7f800000u;
    }
    *lo = mn;
    *hi = mx;
    return special != 0;
}

// span_extremes, with NaN for both ends of a span that holds NaN or an infinity, and a zero extreme signed as
// IEEE's total order says (-0.0 below +0.0): lo is -0.0 when the span holds one, hi +0.0 when it holds one.
// (Outside span_extremes: its flags let the compiler drop the sign of a zero.)
void span_range(const float* v, int64_t start, int64_t end, float* lo, float* hi) {
    float mn, mx;
    if (span_extremes(v, start, end, &mn, &mx)) {
        *lo = *hi = quiet_nan();
        return;
    }
    if (mn == 0.0f || mx == 0.0f) {
        // Rare (a zero region, such as an embedding's unseen rows): a second look at this span alone.
        bool negative_zero = false, positive_zero = false;
        for (int64_t j = start; j < end; ++j) {
            uint32_t bits = bits_of(v + j);
            negative_zero |= bits == 0x80000000u;
            positive_zero |= bits == 0u;
        }
        if (mn == 0.0f) mn = negative_zero ? -0.0f : 0.0f;
        if (mx == 0.0f) mx = positive_zero ? 0.0f : -0.0f;
    }
    *lo = mn;
    *hi = mx;
}

// Codes of a chunk whose |v * scale| stays below 2^30: round and convert in one instruction, subtract and clamp
// in int32. The same codes as in float32: round(v * scale) - lower is then an exact integer, which float32
// represents whenever it lies in [0, 255], and which rounds to the same side of the clamp when it does not.
LB_FINITE_VALUES void quantise_in_int32(const float* v, int64_t n, float scale, int32_t lower, uint8_t* codes) {
    for (int64_t i = 0; i < n; ++i) {
        int32_t q = LB_ROUND_TO_INT32(v[i] * scale) - lower;
        q = q > 0 ? q : 0;
        q = q < 255 ? q : 255;
        codes[i] = static_cast<uint8_t>(q);
    }
}

LB_FINITE_VALUES void quantise(const float* v, int64_t n, float scale, float lower, uint8_t* codes) {
    for (int64_t i = 0; i < n; ++i) {
        float x = v[i] * scale;
        x = std::nearbyint(x);
        x = x - lower;
        x = x > 0.0f ? x : 0.0f;
        x = x < kLevels ? x : kLevels;
        codes[i] = static_cast<uint8_t>(static_cast<int32_t>(x));
    }
}

// One row: lo, hi (NaN if not finite), zeros up to header_bytes, then the codes of the real elements of v and,
// up to length, copies of the last one's code (the padding repeats the last element).
void encode_row(const float* v, int64_t real, int64_t length, float lo, float hi, float eps, int64_t header_bytes,
                uint8_t* dest) {
    bool finite = std::isfinite(lo) && std::isfinite(hi);
    float range[2] = {finite ? lo : quiet_nan(), finite ? hi : quiet_nan()};
    std::memcpy(dest, range, sizeof range);
    std::memset(dest + sizeof range, 0, static_cast<size_t>(header_bytes) - sizeof range);
    uint8_t* codes = dest + header_bytes;
    float scale, lower;
    encode_params(lo, hi, eps, &scale, &lower);
    if (!finite || hi == lo) {
        std::memset(codes, 0, static_cast<size_t>(length));
        return;
    }
    // v lies in [lo, hi], and rounded products keep their order: |v * scale| is at most the larger end's.
    if (std::fabs(lo * scale) < 0x1p30f && std::fabs(hi * scale) < 0x1p30f)
        quantise_in_int32(v, real, scale, static_cast<int32_t>(lower), codes);
    else
        quantise(v, real, scale, lower, codes);
    if (real < length) std::memset(codes + real, codes[real - 1], static_cast<size_t>(length - real));
}

// decoded = q * a + b, with a and b rounded once from double; constant chunks decode to lo, others to NaN.
void decode_params(const uint8_t* row, float eps, float* a, float* b) {
    float range[2];
    std::memcpy(range, row, sizeof range);
    float lo = range[0], hi = range[1];
    if (!(std::isfinite(lo) && std::isfinite(hi))) {
        *a = *b = quiet_nan();
        return;
    }
    if (hi == lo) {
        *a = 0.0f;
        *b = lo;
        return;
    }
    float scale, lower;
    encode_params(lo, hi, eps, &scale, &lower);
    // A finite chunk whose range overflows gets scale 0: a is inf and b NaN, as in the reference.
    double scale64 = static_cast<double>(scale);
    *a = static_cast<float>(1.0 / scale64);
    *b = static_cast<float>(static_cast<double>(lower) / scale64);
}

void affine(const uint8_t* codes, int64_t n, float a, float b, float* dest) {
    for (int64_t i = 0; i < n; ++i) {
        float x = static_cast<float>(codes[i]) * a;
        dest[i] = x + b;
    }
}

void affine_add(const uint8_t* codes, int64_t n, float a, float b, float* dest) {
    for (int64_t i = 0; i < n; ++i) {
        float x = static_cast<float>(codes[i]) * a;
        x = x + b;
        dest[i] = dest[i] + x;
    }
}

void check(const at::Tensor& t, c10::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, " must be a CPU tensor of ", dtype);
}

void check_rows(const at::Tensor& t, const char* name) {
    check(t, at::kByte, name);
    TORCH_CHECK(t.dim() == 2 && (t.size(0) <= 1 || t.stride(1) == 1), name, " must be uint8 rows of contiguous bytes");
}

int64_t row_stride(const at::Tensor& rows) { return rows.size(0) > 1 ? rows.stride(0) : rows.size(1); }

// Encode the contiguous float32 values (numel >= 1) as chunks rows of length codes into encoded.
void compress(const at::Tensor& values, int64_t chunks, int64_t length, double eps, int64_t header_bytes,
              at::Tensor& encoded) {
    check(values, at::kFloat, "values");
    check(encoded, at::kByte, "encoded");
    TORCH_CHECK(values.is_contiguous() && encoded.is_contiguous() && values.numel() >= 1, "bad compress arguments");
    TORCH_CHECK(encoded.numel() == chunks * (header_bytes + length), "encoded has the wrong size");
    const float* v = values.data_ptr<float>();
    int64_t numel = values.numel();
    uint8_t* out = encoded.data_ptr<uint8_t>();
    for (int64_t row = 0; row < chunks; ++row) {
        // A row wholly past the input is padding alone: the last element, repeated.
        int64_t start = row * length < numel ? row * length : numel - 1;
        int64_t end = row * length + length < numel ? row * length + length : numel;
        float lo, hi;
        span_range(v, start, end, &lo, &hi);
        encode_row(v + start, end - start, length, lo, hi, static_cast<float>(eps), header_bytes,
                   out + row * (header_bytes + length));
    }
}

// The first numel values of the rows (row-major, padding included) into the contiguous float32 out, or added to
// it when add is true.
void decode(const at::Tensor& encoded, at::Tensor& out, int64_t numel, double eps, int64_t header_bytes, bool add) {
    check_rows(encoded, "encoded");
    check(out, at::kFloat, "out");
    TORCH_CHECK(out.is_contiguous() && out.numel() >= numel, "out must be contiguous and hold numel values");
    int64_t length = encoded.size(1) - header_bytes;
    if (length <= 0) return;
    const uint8_t* rows = encoded.data_ptr<uint8_t>();
    int64_t stride = row_stride(encoded);
    float* dest = out.data_ptr<float>();
    for (int64_t row = 0; row < encoded.size(0) && row * length < numel; ++row) {
        const uint8_t* source = rows + row * stride;
        float a, b;
        decode_params(source, static_cast<float>(eps), &a, &b);
        int64_t start = row * length;
        int64_t n = numel - start < length ? numel - start : length;
        if (add)
            affine_add(source + header_bytes, n, a, b, dest + start);
        else
            affine(source + header_bytes, n, a, b, dest + start);
    }
}

// out = row_0 + row_1 + ... over the first out.numel() codes of every row, in row order, a cache-sized block at
// a time; every row's decode factors are found once.
void decode_sum(const at::Tensor& encoded, at::Tensor& out, double eps, int64_t header_bytes) {
    check_rows(encoded, "encoded");
    check(out, at::kFloat, "out");
    TORCH_CHECK(out.is_contiguous() && out.numel() <= encoded.size(1) - header_bytes, "out is too long");
    constexpr int64_t kBlock = 4096;
    int64_t rows = encoded.size(0), numel = out.numel(), stride = row_stride(encoded);
    const uint8_t* source = encoded.data_ptr<uint8_t>();
    float* dest = out.data_ptr<float>();
    std::vector<float> factors(2 * static_cast<size_t>(rows));
    for (int64_t row = 0; row < rows; ++row)
        decode_params(source + row * stride, static_cast<float>(eps), &factors[2 * row], &factors[2 * row + 1]);
    for (int64_t start = 0; start < numel; start += kBlock) {
        int64_t n = numel - start < kBlock ? numel - start : kBlock;
        for (int64_t row = 0; row < rows; ++row) {
            const uint8_t* codes = source + row * stride + header_bytes + start;
            if (row == 0)
                affine(codes, n, factors[0], factors[1], dest + start);
            else
                affine_add(codes, n, factors[2 * row], factors[2 * row + 1], dest + start);
        }
    }
}

// Rows of many segments into one message: row r codes flat[start[r] .. start[r] + real[r]) padded to length[r]
// codes, at byte offset[r] of message (a row past its segment's end has real[r] = 1 on the segment's last element).
void encode_segments(const at::Tensor& flat, const at::Tensor& start, const at::Tensor& real,
                     const at::Tensor& length, const at::Tensor& offset, double eps, int64_t header_bytes,
                     at::Tensor& message) {
    check(flat, at::kFloat, "flat");
    check(message, at::kByte, "message");
    for (const at::Tensor* t : {&start, &real, &length, &offset}) check(*t, at::kLong, "row indices");
    TORCH_CHECK(flat.is_contiguous() && message.is_contiguous(), "flat and message must be contiguous");
    const float* v = flat.data_ptr<float>();
    const int64_t *s = start.data_ptr<int64_t>(), *n = real.data_ptr<int64_t>();
    const int64_t *l = length.data_ptr<int64_t>(), *o = offset.data_ptr<int64_t>();
    uint8_t* bytes = message.data_ptr<uint8_t>();
    for (int64_t row = 0; row < start.numel(); ++row) {
        float lo, hi;
        span_range(v, s[row], s[row] + n[row], &lo, &hi);
        encode_row(v + s[row], n[row], l[row], lo, hi, static_cast<float>(eps), header_bytes, bytes + o[row]);
    }
}

// For every row r of a segment message (at byte offset[r], its real[r] codes into out[start[r] ..)): the sum of
// the participants' decoded values, first to last; participant p's message is row p of messages.
void decode_sum_segments(const at::Tensor& messages, const at::Tensor& start, const at::Tensor& real,
                         const at::Tensor& offset, double eps, int64_t header_bytes, at::Tensor& out) {
    check_rows(messages, "messages");
    check(out, at::kFloat, "out");
    for (const at::Tensor* t : {&start, &real, &offset}) check(*t, at::kLong, "row indices");
    TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
    const uint8_t* source = messages.data_ptr<uint8_t>();
    int64_t participants = messages.size(0), stride = row_stride(messages);
    const int64_t *s = start.data_ptr<int64_t>(), *n = real.data_ptr<int64_t>(), *o = offset.data_ptr<int64_t>();
    float* dest = out.data_ptr<float>();
    for (int64_t row = 0; row < start.numel(); ++row) {
        for (int64_t p = 0; p < participants; ++p) {
            const uint8_t* bytes = source + p * stride + o[row];
            float a, b;
            decode_params(bytes, static_cast<float>(eps), &a, &b);
            if (p == 0)
                affine(bytes + header_bytes, n[row], a, b, dest + s[row]);
            else
                affine_add(bytes + header_bytes, n[row], a, b, dest + s[row]);
        }
    }
}

}  // namespace

TORCH_LIBRARY(lightning_bagua_codec, m) {
    m.def("compress(Tensor values, int chunks, int length, float eps, int header_bytes, Tensor(a!) encoded) -> ()");
    m.def("decode(Tensor encoded, Tensor(a!) out, int numel, float eps, int header_bytes, bool add) -> ()");
    m.def("decode_sum(Tensor encoded, Tensor(a!) out, float eps, int header_bytes) -> ()");
    m.def(
        "encode_segments(Tensor flat, Tensor start, Tensor real, Tensor length, Tensor offset, float eps,"
        " int header_bytes, Tensor(a!) message) -> ()");
    m.def(
        "decode_sum_segments(Tensor messages, Tensor start, Tensor real, Tensor offset, float eps, int header_bytes,"
        " Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_bagua_codec, CPU, m) {
    m.impl("compress", &compress);
    m.impl("decode", &decode);
    m.impl("decode_sum", &decode_sum);
    m.impl("encode_segments", &encode_segments);
    m.impl("decode_sum_segments", &decode_sum_segments);
}
