"""The MinMaxUInt8 codec on CPU (the torch reference and the native kernels), against an independent float64
re-implementation of the formula.

The native kernels are also compared byte for byte with the torch reference.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_bagua.engine.codec import MinMaxUInt8Codec, _cpu

EPS = 1e-7
HEADER = MinMaxUInt8Codec.HEADER_BYTES
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(values: torch.Tensor, num_chunks: int, eps: float = EPS) -> dict[str, torch.Tensor]:
    """§3 in float64: pad by repeating the last element, per chunk lo/hi, scale, upper/lower, codes, decoded."""
    x = values.detach().to(torch.float64).cpu()
    numel = x.numel()
    length = -(-numel // num_chunks)
    padded = torch.cat([x, x[-1:].expand(num_chunks * length - numel)]).view(num_chunks, length)
    lo = padded.min(dim=1).values
    hi = padded.max(dim=1).values
    scale = 255.0 / (hi - lo + eps)
    upper = torch.round(hi * scale)  # torch.round rounds half to even
    lower = upper - 255.0
    q = torch.minimum(torch.round(padded * scale[:, None]), upper[:, None]) - lower[:, None]
    q = q.clamp(0.0, 255.0)
    decoded = (q + lower[:, None]) / scale[:, None]
    return {"lo": lo, "hi": hi, "codes": q, "decoded": decoded, "length": torch.tensor(length)}


def error_bound(values: torch.Tensor, num_chunks: int, eps: float = EPS) -> torch.Tensor:
    """Per-element bound: half a quantisation step, plus float32 rounding of the chunk's offset and range."""
    ref = reference(values, num_chunks, eps)
    lo, hi = ref["lo"], ref["hi"]
    step = (hi - lo + eps) / 510.0
    rounding = 8 * 2.0**-24 * (torch.maximum(lo.abs(), hi.abs()) + (hi - lo))
    per_chunk = step * (1 + 1e-6) + rounding
    return per_chunk[:, None].expand(num_chunks, int(ref["length"])).reshape(-1)[: values.numel()]


def header_floats(encoded: torch.Tensor) -> torch.Tensor:
    """The (k, 2) float32 lo/hi of each row, read back from the raw bytes."""
    return encoded[:, :8].reshape(-1).clone().view(torch.float32).view(-1, 2)


def codes_of(encoded: torch.Tensor) -> torch.Tensor:
    return encoded[:, HEADER:].to(torch.int64)


def random_values(numel: int, scale: float, offset: float, seed: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator, dtype=torch.float64) * scale + offset
    return values.to(dtype)


@pytest.fixture(params=["torch", "native"])
def codec(request):
    return MinMaxUInt8Codec(backend=request.param)


def test_layout_helpers(codec):
    assert codec.chunk_length(10, 3) == 4
    assert codec.chunk_length(9, 3) == 3
    assert codec.chunk_length(1, 8) == 1
    assert codec.chunk_length(0, 4) == 0
    assert codec.row_bytes(10, 3) == HEADER + 4
    assert HEADER == 32


@pytest.mark.parametrize("num_chunks", range(1, 9))
def test_codes_match_the_float64_reference(codec, num_chunks):
    # Gradient-like data (range comparable to the offset from zero): float32 and float64 agree but on ties.
    total = identical = 0
    for seed, (scale, offset) in enumerate([(1e-6, 0.0), (1e-3, 2e-3), (1.0, -0.5), (1e3, 1e3), (1e6, 0.0)]):
        values = random_values(10_007 + seed, scale, offset, seed=100 * num_chunks + seed)
        encoded = codec.compress(values, num_chunks)
        ref = reference(values, num_chunks)
        torch.testing.assert_close(
            header_floats(encoded).double(), torch.stack([ref["lo"], ref["hi"]], 1), rtol=0, atol=0
        )
        diff = (codes_of(encoded) - ref["codes"].to(torch.int64)).abs()
        assert diff.max() <= 1
        total += diff.numel()
        identical += int((diff == 0).sum())
        assert (encoded[:, 8:HEADER] == 0).all()
    assert identical / total >= 0.999, f"only {identical}/{total} codes equal the float64 reference"


@pytest.mark.parametrize("num_chunks", [1, 2, 5, 8])
def test_decoded_values_match_the_reference_where_codes_agree(codec, num_chunks):
    values = random_values(4099, 0.02, 0.01, seed=num_chunks)
    encoded = codec.compress(values, num_chunks)
    ref = reference(values, num_chunks)
    decoded = codec.decompress_rows(encoded).double()
    same = codes_of(encoded) == ref["codes"].to(torch.int64)
    magnitude = torch.maximum(ref["lo"].abs(), ref["hi"].abs())[:, None].expand_as(decoded)
    assert ((decoded - ref["decoded"]).abs()[same] <= 4 * 2.0**-24 * magnitude[same] + 1e-30).all()


@pytest.mark.parametrize("num_chunks", [1, 3, 8])
def test_error_is_within_half_a_step_over_many_scales_and_offsets(codec, num_chunks):
    cases = [(scale, offset) for scale in (1e-30, 1e-8, 1e-3, 1.0, 1e4, 1e30) for offset in (0.0, 10.0, -1e3)]
    cases += [(1.0, 1e6), (1e-3, 1.0), (1e-6, -1.0), (1e30, 1e31)]  # far from zero: float32 rounding dominates
    for seed, (scale, offset) in enumerate(cases):
        values = random_values(3001, scale, offset, seed=seed)
        decoded = codec.decompress(codec.compress(values, num_chunks), values.numel(), torch.float32)
        error = (decoded.double() - values.double()).abs()
        bound = error_bound(values, num_chunks)
        worst = int(torch.argmax(error - bound))
        assert (error <= bound).all(), f"scale={scale} offset={offset}: error {error[worst]} > bound {bound[worst]}"


def test_rounds_half_to_even(codec):
    # hi - lo + eps rounds to exactly 255 in float32, so scale == 1 and codes are round(v) with lower == 0.
    values = torch.tensor([0.0, 255.0, 0.5, 1.5, 2.5, 3.5, 254.5, 7.49])
    encoded = codec.compress(values)
    assert codes_of(encoded)[0].tolist() == [0, 255, 0, 2, 2, 4, 254, 7]
    assert codec.decompress(encoded, 8, torch.float32).tolist() == [0, 255, 0, 2, 2, 4, 254, 7]


def representable(constants: list[float]) -> list[tuple[torch.dtype, float]]:
    """Every (dtype, constant) pair whose constant is finite in that dtype (1e35 is not, in float16)."""
    return [(d, c) for d in DTYPES for c in constants if torch.tensor(c).to(d).isfinite()]


@pytest.mark.parametrize(("dtype", "constant"), representable([0.0, -0.0, 1e-12, 3.3, -7e5, 1e35, -65504.0]))
def test_constant_chunks_decode_exactly(codec, dtype, constant):
    values = torch.full((37,), constant, dtype=torch.float32).to(dtype)
    for num_chunks in (1, 4, 37, 50):
        encoded = codec.compress(values, num_chunks)
        assert (codes_of(encoded) == 0).all()
        for out_dtype in DTYPES:
            decoded = codec.decompress(encoded, 37, out_dtype)
            assert torch.equal(decoded, values.to(out_dtype)), (num_chunks, out_dtype, decoded[:3])


def test_a_constant_chunk_beside_varying_ones(codec):
    values = torch.cat([torch.linspace(-1, 1, 100), torch.full((100,), 0.123), torch.linspace(5, 9, 100)])
    decoded = codec.decompress(codec.compress(values, 3), 300, torch.float32)
    assert torch.equal(decoded[100:200], values[100:200])
    assert ((decoded - values).abs() <= error_bound(values, 3)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks", [1, 2, 8])
def test_half_precision_inputs_and_outputs(codec, dtype, num_chunks):
    values = random_values(5003, 0.05, 0.0, seed=7, dtype=dtype)
    encoded = codec.compress(values, num_chunks)
    ref = reference(values.float(), num_chunks)  # fp16/bf16 are upcast exactly before anything else
    assert torch.equal(header_floats(encoded).double(), torch.stack([ref["lo"], ref["hi"]], 1))
    assert ((codes_of(encoded) - ref["codes"].to(torch.int64)).abs() <= 1).all()
    for out_dtype in DTYPES:
        decoded = codec.decompress(encoded, values.numel(), out_dtype)
        assert decoded.dtype == out_dtype
        # The float32 bound, plus the output dtype's rounding of the decoded value (half an ulp).
        half_ulp = values.double().abs().max() * torch.finfo(out_dtype).eps / 2
        error = (decoded.double() - values.double()).abs()
        assert (error <= error_bound(values.float(), num_chunks) + half_ulp).all()


@pytest.mark.parametrize("numel", [1, 2, 3, 7, 9, 16, 1001])
@pytest.mark.parametrize("num_chunks", range(1, 9))
def test_odd_lengths_shapes_and_padding(codec, numel, num_chunks):
    values = random_values(numel, 1.0, 0.0, seed=numel)
    length = codec.chunk_length(numel, num_chunks)
    encoded = codec.compress(values, num_chunks)
    assert encoded.shape == (num_chunks, codec.row_bytes(numel, num_chunks))
    assert encoded.dtype == torch.uint8
    assert encoded.is_contiguous()
    rows = codec.decompress_rows(encoded)
    assert rows.shape == (num_chunks, length)
    assert rows.dtype == torch.float32
    decoded = codec.decompress(encoded, numel, torch.float32)
    assert decoded.shape == (numel,)
    assert torch.equal(decoded, rows.reshape(-1)[:numel])
    assert ((decoded - values).abs() <= error_bound(values, num_chunks)).all()
    # Padding repeats the last element: it never widens a range, and chunks of padding alone are constant.
    ref = reference(values, num_chunks)
    assert torch.equal(header_floats(encoded).double(), torch.stack([ref["lo"], ref["hi"]], 1))
    for row in range(num_chunks):
        if row * length >= numel:
            assert header_floats(encoded)[row].tolist() == [values[-1].item()] * 2
            assert torch.equal(rows[row], values[-1].expand(length))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_a_non_finite_chunk_decodes_to_nan_and_leaves_the_others_alone(codec, bad, out_dtype):
    values = random_values(1000, 1.0, 0.0, seed=3)
    values[250] = bad  # chunk 1 of 4
    encoded = codec.compress(values, 4)
    header = header_floats(encoded)
    assert header[1].isnan().all()
    assert not header[[0, 2, 3]].isnan().any()
    assert (codes_of(encoded)[1] == 0).all()
    decoded = codec.decompress(encoded, 1000, out_dtype)
    assert decoded[250:500].isnan().all()
    others = torch.cat([torch.arange(0, 250), torch.arange(500, 1000)])
    assert decoded[others].isfinite().all()
    clean = torch.cat([values[:250], values[500:]])
    reencoded = codec.decompress(codec.compress(clean, 3), 750, torch.float32)
    half_ulp = clean.abs().max() * torch.finfo(out_dtype).eps / 2
    assert ((decoded[others].float() - clean).abs() <= (reencoded - clean).abs() + half_ulp + 1e-6).all()


def test_nan_and_inf_together_and_everywhere(codec):
    values = torch.tensor([math.nan, math.inf, -math.inf, 1.0, 2.0, math.inf, 3.0, 4.0, 5.0])
    decoded = codec.decompress(codec.compress(values, 3), 9, torch.float32)
    assert decoded[:6].isnan().all()
    assert ((decoded[6:] - values[6:]).abs() <= 2 / 510 + 1e-6).all()
    all_bad = torch.full((10,), math.nan)
    assert codec.decompress(codec.compress(all_bad, 2), 10, torch.float16).isnan().all()


def test_a_non_finite_last_element_also_poisons_the_padding_chunks(codec):
    values = torch.tensor([1.0, 2.0, 3.0, math.inf])
    encoded = codec.compress(values, 8)  # L = 1: rows 4..7 are padding that repeats the inf
    assert header_floats(encoded)[3:].isnan().all()
    decoded = codec.decompress_rows(encoded)
    assert decoded[:3, 0].tolist() == [1.0, 2.0, 3.0]
    assert decoded[3:].isnan().all()


def test_a_range_beyond_float32_decodes_to_nan_not_garbage(codec):
    values = torch.tensor([-3e38, 0.0, 3e38])
    assert codec.decompress(codec.compress(values), 3, torch.float32).isnan().all()


def test_compression_is_deterministic(codec):
    values = random_values(100_003, 1.0, 0.1, seed=11)
    first = codec.compress(values, 8)
    assert torch.equal(first, codec.compress(values.clone(), 8))
    assert torch.equal(first, MinMaxUInt8Codec().compress(values, 8))  # "auto" is native on CPU


@pytest.mark.parametrize(("dtype", "ratio"), [(torch.float32, 0.25), (torch.float16, 0.5), (torch.bfloat16, 0.5)])
def test_compressed_size(codec, dtype, ratio):
    values = torch.randn(1 << 20).to(dtype)
    for num_chunks in (1, 8):
        encoded = codec.compress(values, num_chunks)
        size = encoded.numel() / (values.numel() * values.element_size())
        assert ratio <= size <= ratio * 1.001


def test_rows_of_several_encodings_decode_together(codec):
    # What bytegrad does: chunk r of every rank, gathered into one (k, row_bytes) tensor.
    parts = [random_values(333, 10.0**i, 0.0, seed=i) for i in range(-2, 3)]
    rows = torch.cat([codec.compress(part) for part in parts])
    decoded = codec.decompress_rows(rows)
    for i, part in enumerate(parts):
        assert ((decoded[i] - part).abs() <= error_bound(part, 1)).all()
    # A strided view of rows (every second one) decodes the same.
    assert torch.equal(codec.decompress_rows(rows[::2]), decoded[::2])


def test_decompress_into_out_and_its_checks(codec):
    values = random_values(101, 1.0, 0.0, seed=5)
    encoded = codec.compress(values, 3)
    out = torch.empty(101, dtype=torch.bfloat16)
    assert codec.decompress(encoded, 101, torch.bfloat16, out=out) is out
    assert torch.equal(out, codec.decompress(encoded, 101, torch.bfloat16))
    partial = codec.decompress(encoded, 40, torch.float32)
    assert torch.equal(partial, codec.decompress(encoded, 101, torch.float32)[:40])
    with pytest.raises(ValueError, match="does not fit"):
        codec.decompress(encoded, 103, torch.float32)
    with pytest.raises(ValueError, match="`out` must be"):
        codec.decompress(encoded, 101, torch.float32, out=out)
    with pytest.raises(TypeError, match="decodes to float32"):
        codec.decompress(encoded, 101, torch.float64)
    with pytest.raises(ValueError, match="uint8 rows"):
        codec.decompress_rows(encoded.view(-1))


def test_empty_input(codec):
    encoded = codec.compress(torch.empty(0), 3)
    assert encoded.shape == (3, HEADER)
    assert codec.decompress_rows(encoded).shape == (3, 0)
    assert codec.decompress(encoded, 0, torch.float16).shape == (0,)


def test_input_checks():
    codec = MinMaxUInt8Codec()
    with pytest.raises(ValueError, match="flat tensors"):
        codec.compress(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        codec.compress(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_chunks"):
        codec.compress(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="eps"):
        MinMaxUInt8Codec(eps=0.0)
    with pytest.raises(ValueError, match="Unknown codec backend"):
        MinMaxUInt8Codec(backend="cuda")  # type: ignore[arg-type]


def test_non_contiguous_input(codec):
    values = random_values(200, 1.0, 0.0, seed=9)
    assert torch.equal(codec.compress(values[::2], 2), codec.compress(values[::2].clone(), 2))


def test_triton_backend_needs_triton_and_cuda():
    try:
        # The kernels, not just Triton: torch 2.2's Triton 2.2 imports, but has no `triton.language.extra.libdevice`.
        import lightning_bagua.engine.codec._triton  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="'triton' backend was requested, but Triton cannot be imported"):
            MinMaxUInt8Codec(backend="triton")
        return
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        MinMaxUInt8Codec(backend="triton").compress(torch.zeros(4))


def loads_module(code: str, module: str) -> bool:
    """Whether running ``code`` in a fresh interpreter leaves ``module`` imported."""
    code += f"\nimport sys\nprint({module!r} in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.strip() == "True"


def test_importing_and_using_the_codec_on_cpu_does_not_import_triton():
    code = (
        "import torch\n"
        "from lightning_bagua.engine.codec import MinMaxUInt8Codec\n"
        "c = MinMaxUInt8Codec()\n"
        "c.decompress(c.compress(torch.ones(3)), 3, torch.float32)\n"
    )
    assert not loads_module(code, "lightning_bagua.engine.codec._triton")


def _special_values(kind: str, numel: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    values = random_values(numel, 1.0, 0.0, seed, dtype)
    if kind == "far from zero":
        values = random_values(numel, 1e-3, 1e4, seed, dtype)
    elif kind == "nan":
        values[numel // 2] = math.nan
    elif kind == "inf last":
        values[-1] = math.inf
    elif kind == "constant":
        values.fill_(3.3)
    elif kind == "zeros":
        values.zero_()
    elif kind == "signed zeros":
        # Non-negative with zeros of both signs: every chunk's minimum is a zero, whose sign torch settles.
        values = values.abs()
        values[::3] = 0.0
        values[1::5] = -0.0
    elif kind == "zero region":
        # Some chunks are all zeros of both signs (an embedding's unseen rows), the others ordinary.
        values[numel // 3 : 2 * numel // 3] = 0.0
        values[numel // 3 : 2 * numel // 3 : 7] = -0.0
    return values


SIGNED_ZERO_KINDS = ("signed zeros", "zero region")


def _unsigned_zero_ranges(encoded: torch.Tensor) -> torch.Tensor:
    """``encoded`` with every header's ``lo`` and ``hi`` of -0.0 written as 0.0."""
    encoded = encoded.clone()
    ranges = encoded[:, :8].reshape(-1).clone().view(torch.float32)
    encoded[:, :8] = (ranges + 0.0).view(torch.uint8).view(-1, 8)
    return encoded


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Bit patterns (signed zeros told apart), every NaN as one: the two backends' float16 NaNs differ in payload on
    torch 2.2."""
    values = values.float()
    return torch.where(values.isnan(), torch.full_like(values, math.nan), values).view(torch.int32)


def _total_order_zeros(values: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Per chunk ``(lo, hi)`` bits where a zero extreme takes IEEE's total order: -0.0 below +0.0."""
    x = values.float()
    length = -(-x.numel() // num_chunks)
    rows = torch.cat([x, x[-1:].expand(num_chunks * length - x.numel())]).view(num_chunks, length)
    lo, hi = rows.amin(dim=1), rows.amax(dim=1)
    negative = (rows.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any(dim=1)
    positive = (rows.view(torch.int32) == 0).any(dim=1)
    lo = torch.where(lo == 0, torch.where(negative, -0.0, 0.0), lo)
    hi = torch.where(hi == 0, torch.where(positive, 0.0, -0.0), hi)
    return torch.stack([lo, hi], dim=1).view(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind", ["random", "far from zero", "nan", "inf last", "constant", "zeros", "signed zeros", "zero region"]
)
# Sizes around the native decode_sum's block of 4096 and the 16 lanes of its range loop.
@pytest.mark.parametrize("numel", [1, 5, 17, 1000, 4095, 4097, 300_001])
@pytest.mark.parametrize("num_chunks", [1, 3, 8])
def test_the_native_kernels_write_and_decode_the_references_bytes(dtype, kind, numel, num_chunks):
    torch_codec, codec = MinMaxUInt8Codec(backend="torch"), MinMaxUInt8Codec(backend="native")
    values = _special_values(kind, numel, seed=numel + num_chunks, dtype=dtype)
    encoded = torch_codec.compress(values, num_chunks)
    written = codec.compress(values, num_chunks)
    if kind in SIGNED_ZERO_KINDS:
        # Where a chunk's extreme is a zero and it holds zeros of both signs, torch's reduction returns whichever
        # its order meets; the native kernels follow IEEE's total order. The values are equal.
        assert torch.equal(header_floats(written).view(torch.int32), _total_order_zeros(values, num_chunks))
        written, encoded = _unsigned_zero_ranges(written), _unsigned_zero_ranges(encoded)
    assert torch.equal(written, encoded)
    for out_dtype in {torch.float32, dtype}:
        expected = torch_codec.decompress(encoded, numel, out_dtype)
        assert torch.equal(_bits(codec.decompress(encoded, numel, out_dtype)), _bits(expected)), out_dtype
        base = random_values(numel, 1.0, 0.0, seed=1, dtype=out_dtype)
        added = torch_codec.decompress_add(encoded, base.clone())
        assert torch.equal(_bits(codec.decompress_add(encoded, base.clone())), _bits(added)), out_dtype
    assert torch.equal(
        codec.decompress_rows(encoded).view(torch.int32), torch_codec.decompress_rows(encoded).view(torch.int32)
    )


def test_auto_picks_the_native_kernels_on_cpu(monkeypatch):
    assert _cpu.available()  # this machine (and CI) has a C++ compiler and ninja: the native path must really run
    calls = []
    monkeypatch.setattr(_cpu, "compress", lambda *args: calls.append(args) or torch.zeros(1, 1))
    MinMaxUInt8Codec().compress(torch.ones(10))
    MinMaxUInt8Codec().compress(torch.ones(1 << 16), num_chunks=8)
    MinMaxUInt8Codec().compress(torch.ones(10, dtype=torch.bfloat16))
    assert len(calls) == 3
    MinMaxUInt8Codec(backend="torch").compress(torch.ones(10))
    assert len(calls) == 3


def test_the_native_backend_refuses_non_cpu_tensors():
    with pytest.raises(ValueError, match="'native' backend runs on CPU tensors"):
        MinMaxUInt8Codec(backend="native")._kernels(torch.device("meta"))


def _run_fresh(code: str, tmp_path, **env: str) -> str:
    """Run ``code`` in a fresh interpreter whose torch extension cache is ``tmp_path``; return its stdout."""
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), **env}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=280, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_native_kernels_build_into_torchs_extension_cache_and_load_from_it(tmp_path):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from lightning_bagua.engine.codec import _cpu\n"
        "assert _cpu.available()\n"
        f"[library] = Path({str(tmp_path)!r}).glob('lightning_bagua_codec_*/*.so')\n"
        "print(library.stat().st_mtime_ns, 'torch.utils.cpp_extension' in sys.modules)\n"
    )
    built = _run_fresh(code, tmp_path)
    assert built.endswith(" True")  # built by torch's tooling
    # Loaded, not rebuilt, and from the build's record: torch's tooling (setuptools, ninja) is not even imported.
    assert _run_fresh(code, tmp_path) == built.replace(" True", " False")
    # A record of other inputs (another source, flags or torch) is not trusted: torch's loader checks the build
    # again and the record is written anew.
    [stamp] = tmp_path.glob("lightning_bagua_codec_*/*.built.json")
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "inputs": "an older source"}))
    assert _run_fresh(code, tmp_path) == built
    assert json.loads(stamp.read_text())["inputs"] == _cpu._build_inputs_digest()
    assert _run_fresh(code, tmp_path) == built.replace(" True", " False")


@pytest.mark.parametrize(
    "env", [{"CXX": "no-such-compiler-lb"}, {_cpu.DISABLE_ENV: "0"}], ids=["no compiler", "turned off"]
)
def test_without_the_native_kernels_auto_writes_the_same_bytes_and_native_says_why(tmp_path, env):
    values = random_values(1000, 3.0, 1.0, seed=8)
    expected = MinMaxUInt8Codec(backend="native").compress(values, 3)
    torch.save(values, tmp_path / "values.pt")
    code = (
        "import pytest, torch\n"
        "from lightning_bagua.engine.codec import MinMaxUInt8Codec, _cpu\n"
        "assert not _cpu.available()\n"
        f"values = torch.load({str(tmp_path / 'values.pt')!r})\n"
        "with pytest.raises(RuntimeError, match=r\"'native' backend needs a C\\+\\+ compiler.*backend='torch'\"):\n"
        "    MinMaxUInt8Codec(backend='native')\n"
        "print(MinMaxUInt8Codec().compress(values, 3).view(-1).tolist())\n"
    )
    assert _run_fresh(code, tmp_path, **env) == str(expected.view(-1).tolist())


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("numel", [1, 999, 4096 + 7])
def test_decompress_sum_equals_decoding_then_summing(codec, rows, numel):
    # What bytegrad's reduction does: one row from each rank, summed; the padding column is left out.
    parts = [random_values(numel + 1, 10.0**i, float(i), seed=i) for i in range(rows)]
    encoded = torch.cat([codec.compress(part) for part in parts])
    out = torch.full((numel,), math.nan)
    assert codec.decompress_sum(encoded, out) is out
    expected = codec.decompress_rows(encoded)[:, :numel].sum(dim=0)
    # The order of the float32 additions may differ from torch.sum's (which pairs rows); a few ulps of the sum.
    torch.testing.assert_close(out, expected, rtol=4 * 2.0**-23, atol=1e-6 * rows * 10.0**rows)
    if rows <= 2:
        assert torch.equal(out, expected)


def test_decompress_sum_carries_a_non_finite_row_into_the_sum(codec):
    good, bad = random_values(64, 1.0, 0.0, seed=1), random_values(64, 1.0, 0.0, seed=2)
    bad[3] = math.inf
    out = codec.decompress_sum(torch.cat([codec.compress(good), codec.compress(bad)]), torch.empty(64))
    assert out.isnan().all()


def test_decompress_sum_checks_its_output(codec):
    encoded = codec.compress(random_values(10, 1.0, 0.0, seed=3), 2)
    with pytest.raises(ValueError, match="at most 5 elements"):
        codec.decompress_sum(encoded, torch.empty(6))
    with pytest.raises(ValueError, match="float32"):
        codec.decompress_sum(encoded, torch.empty(5, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [7, 4096 + 3])
def test_decompress_add_adds_what_decompress_returns(codec, dtype, numel):
    values = random_values(numel, 2.0, 1.0, seed=4, dtype=dtype)
    encoded = codec.compress(values, 3)
    base = random_values(numel, 1.0, 0.0, seed=6, dtype=dtype)
    out = base.clone()
    assert codec.decompress_add(encoded, out) is out
    assert torch.equal(out, base + codec.decompress(encoded, numel, dtype))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        codec.decompress_add(encoded, torch.empty(numel + 3, dtype=dtype))


@pytest.mark.parametrize("ratio_exponent", range(10))
def test_native_codes_equal_the_torch_codes_on_both_sides_of_its_int32_path(ratio_exponent):
    # The native kernel rounds in int32 while |v * scale| < 2^30 (about 255 times a chunk's offset over its spread)
    # and in float32 beyond: offsets from 1 to 1e9 spreads put chunks on both sides and at the switch.
    spread = torch.rand(64, 1, generator=torch.Generator().manual_seed(ratio_exponent), dtype=torch.float64) + 0.5
    offsets = spread * 10.0**ratio_exponent * torch.linspace(0.5, 8.0, 64, dtype=torch.float64).unsqueeze(1)
    values = random_values(64 * 512, 1.0, 0.0, seed=ratio_exponent, dtype=torch.float64).view(64, 512)
    values = (values * spread + offsets * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0).unsqueeze(1)).float()
    torch_codec, native = MinMaxUInt8Codec(backend="torch"), MinMaxUInt8Codec(backend="native")
    encoded = torch_codec.compress(values.view(-1), 64)
    assert torch.equal(native.compress(values.view(-1), 64), encoded)
    assert torch.equal(
        native.decompress(encoded, values.numel(), torch.float32),
        torch_codec.decompress(encoded, values.numel(), torch.float32),
    )


def test_a_lock_left_by_a_dead_build_is_removed_and_a_live_one_waited_for(tmp_path, monkeypatch, caplog):
    import threading
    import time

    stale = tmp_path / "stale.lock"
    stale.touch()
    old = time.time() - _cpu._STALE_LOCK_S - 5
    os.utime(stale, (old, old))
    with caplog.at_level("WARNING", logger=_cpu.__name__):
        _cpu._clear_stale_lock(stale)
    assert not stale.exists()
    assert "did not finish" in caplog.text
    assert str(stale) in caplog.text
    # A young lock is another process's build: wait until it releases, and leave its file to it.
    live = tmp_path / "live.lock"
    live.touch()
    releaser = threading.Timer(1.0, live.unlink)
    releaser.start()
    started = time.monotonic()
    _cpu._clear_stale_lock(live)
    releaser.join()
    assert time.monotonic() - started >= 0.9


def test_the_lock_is_judged_by_how_the_installed_torch_locks_a_build():
    import inspect

    from torch.utils import cpp_extension

    # torch before 2.14 blocks on the lock file's existence (FileBaton); 2.14 holds an advisory lock (filelock).
    by_existence = "FileBaton(" in inspect.getsource(cpp_extension._jit_compile)
    assert _cpu._locks_by_existence(cpp_extension) is by_existence


def test_an_advisory_lock_file_left_by_a_finished_build_delays_no_process(tmp_path, monkeypatch):
    import time
    import types

    # A loader that locks the way torch 2.14's does: its lock file stays after every build, and means nothing.
    built: list[str] = []

    def load(name: str, build_directory: str, **kwargs: object) -> str:
        built.append(name)
        return str(Path(build_directory) / f"{name}.so")

    monkeypatch.setattr(torch.utils, "cpp_extension", types.SimpleNamespace(load=load), raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(_cpu.DISABLE_ENV, raising=False)
    _cpu._ops.cache_clear()
    try:
        lock = tmp_path / _cpu._build_name() / "lock"
        lock.parent.mkdir()
        lock.touch()
        started = time.monotonic()
        assert _cpu._ops() is not None
        assert time.monotonic() - started < 5
    finally:
        _cpu._ops.cache_clear()
    assert len(built) == 1
    assert lock.exists()  # the lock's file belongs to torch's loader
