"""SegmentLayout: many tensors through the codec at once, byte for byte what one codec call per tensor writes.

Both of its CPU paths run every test: the vectorised torch ops and the native C++ kernels.
"""

import math

import pytest
import torch

from lightning_bagua.engine.codec import MinMaxUInt8Codec, _cpu
from lightning_bagua.engine.codec._segments import SegmentLayout, segment_backend

CODEC = MinMaxUInt8Codec(backend="torch")


@pytest.fixture(params=["torch", "native"])
def backend(request):
    if request.param == "native":
        assert _cpu.available()  # this machine (and CI) has a C++ compiler and ninja: the native path must really run
    return request.param


def random_segments(generator: torch.Generator) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """Segments of random sizes and chunk counts (chunks may outnumber elements), values of random scales."""
    segments, values = [], []
    for _ in range(int(torch.randint(1, 7, (1,), generator=generator))):
        numel = int(torch.randint(1, 2500, (1,), generator=generator))
        chunks = int(torch.randint(1, 9, (1,), generator=generator))
        segments.append((numel, chunks))
        scale = float(torch.rand(1, generator=generator)) * 100
        values.append(torch.randn(numel, generator=generator) * scale + scale)
    return segments, values


def one_call_per_segment(
    segments: list[tuple[int, int]], values: list[torch.Tensor], codec: MinMaxUInt8Codec = CODEC
) -> torch.Tensor:
    return torch.cat([codec.compress(x, chunks).view(-1) for x, (_, chunks) in zip(values, segments, strict=True)])


@pytest.mark.parametrize("seed", range(12))
def test_the_message_is_the_codec_calls_concatenated(seed, backend):
    generator = torch.Generator().manual_seed(seed)
    segments, values = random_segments(generator)
    if seed % 3 == 0:
        values[0][len(values[0]) // 2] = math.inf  # a non-finite chunk: NaN header, zero codes
    if seed % 4 == 0:
        values[-1].fill_(2.5)  # constant chunks: zero codes, exact header
    if seed % 5 == 0:
        values[-1].clamp_(min=0.0)[: len(values[-1]) // 2] = 0.0  # zero extremes: the header keeps 0.0's sign
        values[0][0] = -0.0
    if seed % 6 == 1:
        segments[0] = (5, 4)  # four chunks of two elements: the last row lies past the segment's end
        values[0] = values[0][:5]
    layout = SegmentLayout(segments, start=16, eps=CODEC.eps, backend=backend)
    message = torch.full((16 + layout.nbytes + 5,), 7, dtype=torch.uint8)
    message[16 : 16 + layout.nbytes] = 0  # header bytes 8-31 are the caller's zeros
    layout.encode_into(torch.cat(values), message)

    expected = one_call_per_segment(segments, values)
    assert layout.nbytes == expected.numel()
    assert torch.equal(message[16 : 16 + layout.nbytes], expected)
    # Bytes outside the layout are left alone.
    assert torch.equal(message[:16], torch.full((16,), 7, dtype=torch.uint8))
    assert torch.equal(message[16 + layout.nbytes :], torch.full((5,), 7, dtype=torch.uint8))


@pytest.mark.parametrize("participants", [1, 2, 4])
def test_decode_sum_adds_the_decoded_segments_in_participant_order(participants, backend):
    generator = torch.Generator().manual_seed(participants)
    segments, _ = random_segments(generator)
    segments.append((5, 4))  # a row past the segment's end, which decodes to nothing
    layout = SegmentLayout(segments, start=8, eps=CODEC.eps, backend=backend)
    rows, expected = [], []
    for _ in range(participants):
        values = [torch.randn(numel, generator=generator) for numel, _ in segments]
        message = torch.zeros(8 + layout.nbytes, dtype=torch.uint8)
        layout.encode_into(torch.cat(values), message)
        rows.append(message)
        expected.append(
            torch.cat(
                [
                    CODEC.decompress(CODEC.compress(x, chunks), numel, torch.float32)
                    for x, (numel, chunks) in zip(values, segments, strict=True)
                ]
            )
        )
    total = expected[0].clone()
    for decoded in expected[1:]:
        total = total + decoded  # first to last, as the rows arrive
    torch.testing.assert_close(layout.decode_sum(torch.stack(rows)), total, rtol=0, atol=0)


def test_a_non_finite_segment_decodes_to_nan_and_leaves_the_others(backend):
    layout = SegmentLayout([(10, 1), (20, 2)], start=0, eps=CODEC.eps, backend=backend)
    values = torch.linspace(-1, 1, 30)
    values[3] = math.nan
    message = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.encode_into(values, message)
    decoded = layout.decode_sum(message.unsqueeze(0))
    assert torch.isnan(decoded[:10]).all()
    assert torch.isfinite(decoded[10:]).all()
    torch.testing.assert_close(decoded[10:], values[10:], rtol=0, atol=2 / 255)


@pytest.mark.parametrize("segments", [[], [(0, 1)], [(5, 0)]])
def test_empty_segments_are_refused(segments):
    with pytest.raises(ValueError, match="at least one element and one chunk"):
        SegmentLayout(segments, start=0, eps=CODEC.eps)


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'fast'.*'auto', 'torch' or 'native'"):
        SegmentLayout([(5, 1)], start=0, eps=CODEC.eps, backend="fast")


def test_auto_codes_float32_on_cpu_with_the_native_kernels(monkeypatch):
    calls = []
    original = _cpu.encode_segments
    monkeypatch.setattr(_cpu, "encode_segments", lambda *args: calls.append(1) or original(*args))
    layout = SegmentLayout([(40, 2)], start=0, eps=CODEC.eps)
    layout.encode_into(torch.randn(40), torch.zeros(layout.nbytes, dtype=torch.uint8))
    assert layout.native
    assert calls == [1]
    monkeypatch.setattr(_cpu, "available", lambda: False)
    assert not SegmentLayout([(40, 2)], start=0, eps=CODEC.eps).native


@pytest.mark.gpu
def test_on_cuda_the_message_and_the_sums_are_those_of_the_cpu():
    generator = torch.Generator().manual_seed(99)
    segments, values = random_segments(generator)
    values[0][0] = math.nan
    layout = SegmentLayout(segments, start=8, eps=CODEC.eps)
    flat = torch.cat(values)
    on_cpu = torch.zeros(8 + layout.nbytes, dtype=torch.uint8)
    layout.encode_into(flat, on_cpu)
    on_gpu = torch.zeros(8 + layout.nbytes, dtype=torch.uint8, device="cuda")
    layout.encode_into(flat.cuda(), on_gpu)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    rows = torch.stack([on_cpu, on_cpu])
    torch.testing.assert_close(
        layout.decode_sum(rows.cuda()).cpu(), layout.decode_sum(rows), rtol=0, atol=0, equal_nan=True
    )


def test_zero_extremes_carry_the_sign_their_codec_backend_picks(backend):
    """Where a chunk's extreme is a zero of either sign, the header holds the one the codec's backend writes.

    torch's reductions return the zero their order meets, the native kernels follow IEEE's total order.
    """
    patterns = [[0.0, -0.0, 1.0, 2.0], [-0.0, 0.0, 3.0], [1.0, -0.0, 0.0], [-0.0, 0.0], [0.0, -0.0], [-0.0] * 3]
    values = [torch.tensor(pattern * 20) for pattern in patterns]  # several rows each, across vector lanes
    segments = [(len(value), 3) for value in values]
    layout = SegmentLayout(segments, start=0, eps=CODEC.eps, backend=backend)
    message = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.encode_into(torch.cat(values), message)
    assert torch.equal(message, one_call_per_segment(segments, values, MinMaxUInt8Codec(backend=backend)))


def test_the_segments_follow_the_codec_backend():
    expected = {"torch": "torch", "native": "native", "auto": "auto"}
    for codec_backend, backend in expected.items():
        assert segment_backend(MinMaxUInt8Codec(backend=codec_backend)) == backend, codec_backend
    assert not SegmentLayout([(40, 2)], start=0, eps=CODEC.eps, backend=segment_backend(CODEC)).native
