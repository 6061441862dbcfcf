"""The MinMaxUInt8 codec on CUDA: the Triton kernels against the torch backend (run on the device machine).

The torch backend is the reference here (it is checked against a float64 re-implementation of the formula in
``test_codec.py``). Both backends do the same IEEE float32 operations per chunk, so the encoded bytes are
expected to be identical; the tests allow a code to differ by one level on a rare tie, and decoded values to
differ in the last float32 ulp (the Triton kernel fuses ``q * a + b`` into one FMA).
"""

import math

import pytest
import torch

from lightning_bagua.engine.codec import MinMaxUInt8Codec
from tests.engine.codec.test_codec import (
    DTYPES,
    HEADER,
    codes_of,
    error_bound,
    header_floats,
    random_values,
    representable,
)

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton", reason="the Triton backend needs triton")

DEVICE = torch.device("cuda", 0)
# 1 and 7: tiny; 4097: one block and a bit; 1_000_003: several programs per chunk; 9_000_011: many partials.
NUMELS = [1, 7, 4097, 1_000_003, 9_000_011]
CHUNKS = [1, 2, 8]


@pytest.fixture(scope="module")
def torch_codec():
    return MinMaxUInt8Codec(backend="torch")


@pytest.fixture(scope="module")
def triton_codec():
    return MinMaxUInt8Codec(backend="triton")


def assert_same_encoding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Headers equal (NaN == NaN), header padding zero, codes equal but for rare one-level ties."""
    assert got.shape == expected.shape
    assert got.dtype == torch.uint8
    assert got.device == expected.device
    torch.testing.assert_close(header_floats(got), header_floats(expected), rtol=0, atol=0, equal_nan=True)
    assert (got[:, 8:HEADER] == 0).all()
    diff = (codes_of(got) - codes_of(expected)).abs()
    if diff.numel():
        assert int(diff.max()) <= 1
        assert float((diff == 0).float().mean()) >= 0.9999, "more than rare ties differ"


def assert_decoded_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding of the decode (and a level where a tie was encoded differently)."""
    got, expected = got.double(), expected.double()
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    scale = expected[finite].abs().max() if finite.any() else torch.tensor(0.0)
    assert ((got - expected).abs()[finite] <= 4 * 2.0**-24 * scale + 1e-38).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks", CHUNKS)
@pytest.mark.parametrize("numel", NUMELS)
def test_triton_matches_torch_on_cuda(torch_codec, triton_codec, dtype, num_chunks, numel):
    values = random_values(numel, 0.01, 0.002, seed=numel + num_chunks, dtype=dtype).to(DEVICE)
    expected = torch_codec.compress(values, num_chunks)
    got = triton_codec.compress(values, num_chunks)
    assert_same_encoding(got, expected)

    for out_dtype in DTYPES:
        decoded = triton_codec.decompress(got, numel, out_dtype)
        assert decoded.shape == (numel,)
        assert decoded.dtype == out_dtype
        assert decoded.device == DEVICE
        # Compared in float32 so that fp16/bf16 outputs differ by at most their own last-place rounding.
        reference = torch_codec.decompress(got, numel, torch.float32)
        assert_decoded_close(triton_codec.decompress(got, numel, torch.float32), reference)
        half_ulp = reference.abs().max() * torch.finfo(out_dtype).eps
        assert ((decoded.float() - reference).abs() <= half_ulp + 1e-38).all()

    rows = triton_codec.decompress_rows(got)
    assert rows.shape == (num_chunks, triton_codec.chunk_length(numel, num_chunks))
    assert_decoded_close(rows, torch_codec.decompress_rows(got))
    # The error against the input is within the codec's bound.
    decoded = triton_codec.decompress(got, numel, torch.float32).cpu()
    error = (decoded.double() - values.cpu().double()).abs()
    assert (error <= error_bound(values.cpu().float(), num_chunks)).all()


@pytest.mark.parametrize("num_chunks", CHUNKS)
def test_cuda_torch_backend_matches_cpu(torch_codec, num_chunks):
    values = random_values(100_003, 3.0, 1.0, seed=num_chunks)
    on_gpu = torch_codec.compress(values.to(DEVICE), num_chunks)
    assert_same_encoding(on_gpu.cpu(), torch_codec.compress(values, num_chunks))
    assert_decoded_close(torch_codec.decompress_rows(on_gpu).cpu(), torch_codec.decompress_rows(on_gpu.cpu()))


def test_cross_backend_decoding(torch_codec, triton_codec):
    values = random_values(300_007, 1.0, 0.0, seed=1).to(DEVICE)
    for encoder, decoder in [(torch_codec, triton_codec), (triton_codec, torch_codec)]:
        decoded = decoder.decompress(encoder.compress(values, 8), values.numel(), torch.float32)
        assert ((decoded.cpu().double() - values.cpu().double()).abs() <= error_bound(values.cpu(), 8)).all()


def test_auto_uses_the_same_bytes_as_triton(triton_codec):
    values = random_values(50_001, 1.0, 0.0, seed=2).to(DEVICE)
    assert torch.equal(MinMaxUInt8Codec().compress(values, 4), triton_codec.compress(values, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [5, 20_000, 3_000_001])
def test_non_finite_chunks_on_triton(torch_codec, triton_codec, dtype, numel):
    num_chunks = 4
    values = random_values(numel, 1.0, 0.0, seed=4, dtype=dtype).to(DEVICE)
    length = triton_codec.chunk_length(numel, num_chunks)
    bad = {1: math.nan, 2: math.inf, 3: -math.inf}
    for row, value in bad.items():
        index = min(row * length + length // 2, numel - 1)
        if index // length == row:
            values[index] = value
    got = triton_codec.compress(values, num_chunks)
    assert_same_encoding(got, torch_codec.compress(values, num_chunks))
    header = header_floats(got)
    decoded_rows = triton_codec.decompress_rows(got, dtype)
    for row in range(num_chunks):
        poisoned = values[row * length : (row + 1) * length].float().isfinite().logical_not().any()
        if row * length < numel and poisoned:
            assert header[row].isnan().all()
            assert (codes_of(got)[row] == 0).all()
            assert decoded_rows[row].isnan().all()
        elif row * length < numel:
            assert decoded_rows[row].isfinite().all()


@pytest.mark.parametrize(("dtype", "constant"), representable([0.0, 3.3, -1e-12, 1e35]))
def test_constant_chunks_on_triton(triton_codec, dtype, constant):
    values = torch.full((100_003,), constant, dtype=torch.float32).to(dtype).to(DEVICE)
    for num_chunks in CHUNKS:
        encoded = triton_codec.compress(values, num_chunks)
        assert (codes_of(encoded) == 0).all()
        assert torch.equal(triton_codec.decompress(encoded, values.numel(), dtype), values)


def test_one_large_chunk_spreads_over_the_gpu(torch_codec, triton_codec):
    # 2**25 + 3 elements in one chunk: the max sits at the very end, the min in the middle, so the
    # partial min/max of many programs must be combined correctly.
    numel = (1 << 25) + 3
    values = torch.rand(numel, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    values[-1] = 2.0
    values[numel // 2] = -1.0
    got = triton_codec.compress(values, 1)
    assert header_floats(got).tolist() == [[-1.0, 2.0]]
    assert_same_encoding(got, torch_codec.compress(values, 1))
    out = torch.empty(numel, device=DEVICE)
    assert triton_codec.decompress(got, numel, torch.float32, out=out) is out
    assert float((out - values).abs().max()) <= 3.0 / 510 * (1 + 1e-6) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks", [1, 8])
@pytest.mark.parametrize("where", ["head", "tail", "none"])
def test_both_compress_configs_agree_with_torch(torch_codec, triton_codec, dtype, num_chunks, where):
    # Inputs from the small-input threshold up take the large configuration, whose min/max pass loads the head of
    # each span with another eviction policy than its tail: a non-finite value in either part must still be seen.
    from lightning_bagua.engine.codec import _triton as _codec_triton

    threshold = _codec_triton.SMALL_COMPRESS_BYTES // torch.tensor([], dtype=dtype).element_size()
    for numel in (threshold - 1, threshold, 3 * threshold + 5):
        values = random_values(numel, 3.0, -1.0, seed=numel % 97).to(DEVICE, dtype)
        if where != "none":
            position = 1 if where == "head" else numel - 2
            values[position] = float("inf") if where == "head" else float("nan")
        encoded = triton_codec.compress(values, num_chunks)
        assert_same_encoding(encoded, torch_codec.compress(values, num_chunks))
        decoded = triton_codec.decompress(encoded, numel, torch.float32)
        assert_decoded_close(decoded, torch_codec.decompress(encoded, numel, torch.float32))


def test_strided_rows_and_partial_decode_on_triton(torch_codec, triton_codec):
    values = random_values(10_001, 1.0, 0.0, seed=6).to(DEVICE)
    encoded = triton_codec.compress(values, 8)
    assert_decoded_close(triton_codec.decompress_rows(encoded[1::3]), torch_codec.decompress_rows(encoded[1::3]))
    assert_decoded_close(
        triton_codec.decompress(encoded, 3333, torch.float32), torch_codec.decompress(encoded, 3333, torch.float32)
    )


def test_triton_backend_rejects_cpu_tensors(triton_codec):
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        triton_codec.compress(torch.zeros(4))


@pytest.mark.parametrize("numel", [7, 1_000_003])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_decompress_sum_and_add_on_cuda_match_the_cpu(numel, rows):
    # What bytegrad (sum of received rows) and low_precision_decentralized (add into the copies) do on a GPU.
    codec = MinMaxUInt8Codec()
    parts = [random_values(numel + 1, 10.0**i, float(i), seed=i) for i in range(rows)]
    encoded = torch.cat([codec.compress(part) for part in parts])
    expected_sum = codec.decompress_sum(encoded, torch.empty(numel))
    summed = codec.decompress_sum(encoded.to(DEVICE), torch.empty(numel, device=DEVICE))
    torch.testing.assert_close(summed.cpu(), expected_sum, rtol=8 * 2.0**-23, atol=1e-6 * rows * 10.0**rows)
    base = random_values(numel + 1, 1.0, 0.0, seed=99)
    expected_add = codec.decompress_add(encoded[:1], base.clone())
    added = codec.decompress_add(encoded[:1].to(DEVICE), base.to(DEVICE))
    torch.testing.assert_close(added.cpu(), expected_add, rtol=2.0**-22, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("chunks", CHUNKS)
def test_triton_decode_add_writes_what_decoding_then_adding_writes(triton_codec, dtype, numel, chunks):
    # low_precision_decentralized adds decoded differences into its weight copies: one pass, the bits of two.
    values = random_values(numel, 3.0, -1.0, seed=numel + chunks, dtype=dtype).to(DEVICE)
    encoded = triton_codec.compress(values, chunks)
    base = random_values(numel, 1.0, 0.5, seed=7, dtype=dtype).to(DEVICE)
    expected = base + triton_codec.decompress(encoded, numel, dtype)
    out = base.clone()
    assert triton_codec.decompress_add(encoded, out) is out
    assert torch.equal(out, expected), f"{int((out != expected).sum())} of {numel} elements differ"
    # Only the first out.numel() elements are added (a shorter output than the codes hold).
    shorter = base[: numel // 2 + 1].clone()
    triton_codec.decompress_add(encoded, shorter)
    assert torch.equal(shorter, expected[: numel // 2 + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("chunks", CHUNKS)
def test_triton_writes_the_references_bytes(torch_codec, triton_codec, dtype, numel, chunks):
    # The same float32 operations in the same order: the bytes themselves, not a tolerance (no signed zeros here).
    values = random_values(numel, 3.0, -1.0, seed=numel * chunks, dtype=dtype).to(DEVICE)
    assert torch.equal(triton_codec.compress(values, chunks), torch_codec.compress(values, chunks))
