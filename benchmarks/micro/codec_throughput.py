"""Throughput of the MinMaxUInt8 codec (compress + decompress) against the device's own copy bandwidth.

    python benchmarks/micro/codec_throughput.py                    # one GPU: Triton and torch backends
    python benchmarks/micro/codec_throughput.py --cpu --threads 1  # CPU: native and torch backends
    python benchmarks/micro/codec_throughput.py --cpu --sizes-mb 1 4 --no-save

For float32 buffers of 4 MiB and up, split into ``k`` chunks, each call is timed as the median (``--statistic min``:
the minimum) of ``--reps`` batches of ``--inner`` calls after warm-up, after one check of the codec's error bound. On
a GPU in two modes: ``eager`` (CUDA events around calls launched one by one, so a slow host shows) and ``graph``
(the batch replayed from a CUDA graph: the device's own time). :data:`DEFINITIONS` says what each figure is; the
host time per call on a tiny tensor is recorded too. Prints a Markdown table and writes
``benchmarks/results/codec_throughput_{gpu,cpu}.json`` (unless ``--no-save``).
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_bagua.engine.codec import MinMaxUInt8Codec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.render import markdown_table
from lab.results import RESULTS, new_report, write_report

MB = 1 << 20


DEFINITIONS = {
    "mode": "eager: launched call after call; graph: the same calls replayed from a CUDA graph",
    "copy_gbps": "2 * bytes / median copy time (read + write), the faster of the eager and graph timings",
    "input_gbps": "float32 input bytes / (median compress time + median decompress time)",
    "effective_gbps": "(input read + codes written + codes read + output written) / (compress + decompress)",
    "fraction_of_copy": "effective_gbps / copy_gbps",
    "host_us_per_call": "host time a compress or decompress call takes to issue (mean of the two); eager only",
    "statistic": "how the --reps batch timings are summarised: median, or min (least disturbed)",
}


def summary(times: list[float], args: argparse.Namespace) -> float:
    """The ``--statistic`` of ``times``: the median, or the minimum (the least disturbed run, on a loaded host)."""
    return min(times) if args.statistic == "min" else statistics.median(times)


def eager_time(fn: Callable[[], object], device: torch.device, args: argparse.Namespace) -> tuple[float, float]:
    """Seconds per call, and host seconds per call, over ``--reps`` batches of ``--inner`` calls, after warm-up.

    The host time is what the calling thread spends issuing a call (on a GPU, until the last call of the batch
    has been queued); on CPU it is the time itself.
    """
    for _ in range(args.warmup):
        fn()
    times, host_times = [], []
    for _ in range(args.reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            for _ in range(args.inner):
                fn()
            host_times.append((time.perf_counter() - begin) / args.inner)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000 / args.inner)
        else:
            begin = time.perf_counter()
            for _ in range(args.inner):
                fn()
            times.append((time.perf_counter() - begin) / args.inner)
            host_times.append(times[-1])
    return summary(times, args), summary(host_times, args)


def graph_time(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Like :func:`eager_time`, but ``--inner`` calls captured in a CUDA graph: device time, no launch gaps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(args.warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.inner):
            fn()
    graph.replay()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / args.inner)
    del graph
    return summary(times, args)


def host_overhead(codec: MinMaxUInt8Codec, device: torch.device, calls: int = 300) -> dict[str, float]:
    """Host time per call (microseconds) on a 1000-element tensor: launches, allocations, Python."""
    values = torch.randn(1000, device=device)
    encoded = codec.compress(values, 8)
    out = torch.empty_like(values)
    result = {}
    for name, fn in [
        ("compress_us", lambda: codec.compress(values, 8)),
        ("decompress_us", lambda: codec.decompress(encoded, 1000, torch.float32, out=out)),
    ]:
        for _ in range(20):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        result[name] = (time.perf_counter() - start) / calls * 1e6
        if device.type == "cuda":
            torch.cuda.synchronize()
    return result


def check(codec: MinMaxUInt8Codec, values: torch.Tensor, num_chunks: int, out: torch.Tensor) -> None:
    codec.decompress(codec.compress(values, num_chunks), values.numel(), torch.float32, out=out)
    span = float(values.max() - values.min())
    error = float((out - values).abs().max())
    if not error <= span / 510 * (1 + 1e-5) + 1e-6:
        raise AssertionError(f"{codec}: max error {error} exceeds the bound {span / 510} for k={num_chunks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="benchmark the CPU backends")
    parser.add_argument("--sizes-mb", type=int, nargs="+", help="float32 buffer sizes in MiB (default: 4 ... 1024)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 8], help="numbers of chunks k")
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["torch", "native", "triton"],
        help="default: every one the device has",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, help="calls per timed batch (default: 10 on GPU, 1 on CPU)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument(
        "--statistic", choices=["median", "min"], default="median", help="min: the least disturbed batch (loaded hosts)"
    )
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    sizes = args.sizes_mb or ([4, 16, 64] if args.cpu else [4, 16, 64, 256, 1024])
    backends = args.backends or (["native", "torch"] if args.cpu else ["triton", "torch"])
    args.inner = args.inner or (1 if args.cpu else 10)
    generator = torch.Generator(device).manual_seed(0)

    modes = ["eager"] if args.cpu else ["eager", "graph"]

    def timed_with_host(fn: Callable[[], object], mode: str) -> tuple[float, float | None]:
        return eager_time(fn, device, args) if mode == "eager" else (graph_time(fn, args), None)

    def timed(fn: Callable[[], object], mode: str) -> float:
        return timed_with_host(fn, mode)[0]

    rows = []
    for size_mb in sizes:
        numel = size_mb * MB // 4
        nbytes = numel * 4
        values = torch.randn(numel, device=device, generator=generator)
        out = torch.empty_like(values)
        copy_by_mode = {mode: 2 * nbytes / timed(lambda o=out, v=values: o.copy_(v), mode) for mode in modes}
        copy_bandwidth = max(copy_by_mode.values())
        for mode in modes:
            for backend in backends:
                codec = MinMaxUInt8Codec(backend=backend)
                for num_chunks in args.chunks:
                    check(codec, values, num_chunks, out)
                    encoded = codec.compress(values, num_chunks)
                    compress_s, compress_host_s = timed_with_host(
                        lambda c=codec, k=num_chunks, v=values: c.compress(v, k), mode
                    )
                    decompress_s, decompress_host_s = timed_with_host(
                        lambda c=codec, e=encoded, n=numel, o=out: c.decompress(e, n, torch.float32, out=o), mode
                    )
                    total = compress_s + decompress_s
                    effective = (2 * nbytes + 2 * numel) / total
                    host_us = None if compress_host_s is None else (compress_host_s + decompress_host_s) / 2 * 1e6
                    rows.append({
                        "size_mb": size_mb, "mode": mode, "backend": backend, "chunks": num_chunks,
                        "copy_gbps": copy_bandwidth / 1e9,
                        "copy_gbps_by_mode": {name: value / 1e9 for name, value in copy_by_mode.items()},
                        "compress_ms": compress_s * 1e3, "decompress_ms": decompress_s * 1e3,
                        "host_us_per_call": host_us, "input_gbps": nbytes / total / 1e9,
                        "effective_gbps": effective / 1e9, "fraction_of_copy": effective / copy_bandwidth,
                    })  # fmt: skip
                    del encoded
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del values, out
        if device.type == "cuda":
            torch.cuda.empty_cache()

    overhead = {backend: host_overhead(MinMaxUInt8Codec(backend=backend), device) for backend in backends}
    for backend, times in overhead.items():
        print(
            f"host time per call, {backend}: compress {times['compress_us']:.1f} us,"
            f" decompress {times['decompress_us']:.1f} us"
        )
    header = ["MiB", "timing", "backend", "k", "copy GB/s", "compress ms", "decompress ms", "host us/call",
              "input GB/s", "eff. GB/s", "of copy"]  # fmt: skip
    table = markdown_table(header, [table_row(row) for row in rows])
    print(table, end="")
    if args.no_save:
        return
    flags = [" --cpu" if args.cpu else "", f" --threads {args.threads}" if args.threads else ""]
    flags.append(f" --statistic {args.statistic}" if args.statistic != "median" else "")
    settings = {**vars(args), "sizes_mb": sizes, "backends": backends}
    benchmark = "MinMaxUInt8 codec compress + decompress throughput vs dst.copy_(src) bandwidth"
    command = "python benchmarks/micro/codec_throughput.py" + "".join(flags)
    report = new_report(benchmark, settings, rows, device=device, command=command)
    report["machine"]["triton"] = triton_version()
    report["definitions"] = DEFINITIONS
    report["host_overhead"] = overhead
    stem = "codec_throughput_cpu" if args.cpu else "codec_throughput_gpu"
    print(f"-> {write_report(RESULTS, stem, report)}")


def table_row(row: dict) -> list[str]:
    host = "" if row["host_us_per_call"] is None else format(row["host_us_per_call"], ".0f")
    return [str(row["size_mb"]), row["mode"], row["backend"], str(row["chunks"]), f"{row['copy_gbps']:.1f}",
            f"{row['compress_ms']:.3f}", f"{row['decompress_ms']:.3f}", host, f"{row['input_gbps']:.1f}",
            f"{row['effective_gbps']:.1f}", f"{row['fraction_of_copy']:.3f}"]  # fmt: skip


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


if __name__ == "__main__":
    main()
