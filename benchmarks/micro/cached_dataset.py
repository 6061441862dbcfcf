"""Epoch time with and without CachedDataset, for a data set whose samples are expensive to compute.

Each sample is a deterministic, CPU-heavy function of its index (a seeded 96x96 "image" put through ``--passes``
rounds of FFT filtering, a stand-in for decoding and preprocessing). A ``DataLoader`` with ``--workers`` workers (one
torch thread each) reads the data set for two epochs, plainly and through ``CachedDataset`` with the embedded backend
and, when ``redis`` and ``redis-server`` are installed, the redis backend (a server started by the library). The
first cached epoch computes and stores every sample; the second is served from the cache:

    python benchmarks/micro/cached_dataset.py

Prints a table and writes ``benchmarks/results/cached_dataset.json``: per variant, the time of each epoch and the
second epoch's speed-up over the plain data set's second epoch.
"""

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_bagua.data.cache import CachedDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.render import markdown_table
from lab.results import RESULTS, new_report, write_report


class ExpensiveDataset(Dataset):
    def __init__(self, samples: int, passes: int) -> None:
        self.samples = samples
        self.passes = passes

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = torch.randn(96, 96, generator=torch.Generator().manual_seed(index))
        for _ in range(self.passes):
            spectrum = torch.fft.rfft2(image)
            spectrum[..., 24:, :] = 0  # a low-pass filter, then a non-linearity: nothing to precompute
            image = torch.tanh(torch.fft.irfft2(spectrum, s=image.shape) * 3)
        return image.to(torch.float16), index


def one_thread(_: int) -> None:
    torch.set_num_threads(1)


def time_epochs(dataset: Dataset, args: argparse.Namespace) -> tuple[list[float], list[torch.Tensor]]:
    times, checksums = [], []
    for epoch in range(args.epochs):
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            worker_init_fn=one_thread,
            generator=torch.Generator().manual_seed(epoch),
        )
        start = time.perf_counter()
        total = torch.zeros(())
        for images, _ in loader:
            total += images.float().sum()
        times.append(time.perf_counter() - start)
        checksums.append(total)
    return times, checksums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    variants: dict[str, dict] = {}
    start = time.perf_counter()
    base = ExpensiveDataset(args.samples, args.passes)
    times, reference = time_epochs(base, args)
    variants["plain"] = {"epoch_s": times}
    redis_ready = importlib.util.find_spec("redis") is not None and shutil.which("redis-server") is not None
    backends = ["embedded", "redis"] if redis_ready else ["embedded"]
    skipped = [] if "redis" in backends else ["redis (needs `pip install redis` and redis-server)"]
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            kwargs = {"path": os.path.join(tmp, "cache.sqlite")} if backend == "embedded" else {}
            cached = CachedDataset(base, backend=backend, dataset_name="bench", **kwargs)
            try:
                times, checksums = time_epochs(cached, args)
                keys = cached.cache_loader.num_keys()
            finally:
                cached.close()
            # The cache must serve exactly what the data set computes (float sums over the same values and order).
            assert all(torch.allclose(c, r) for c, r in zip(checksums, reference, strict=True)), backend
            assert keys == args.samples, (backend, keys)
            variants[f"CachedDataset({backend})"] = {"epoch_s": times, "keys": keys}
    wall = time.perf_counter() - start

    plain_last = variants["plain"]["epoch_s"][-1]
    for result in variants.values():
        result["last_epoch_speedup_vs_plain"] = plain_last / result["epoch_s"][-1]
    rows = [{"dataset": name, **result} for name, result in variants.items()]
    benchmark = "DataLoader epoch time with and without CachedDataset, expensive per-sample preprocessing"
    report = new_report(benchmark, vars(args), rows, command="python benchmarks/micro/cached_dataset.py")
    report.update(skipped=skipped, wall_s=wall)
    header = ["dataset", *(f"epoch {epoch + 1}" for epoch in range(args.epochs)), "speed-up"]
    cells = [[row["dataset"], *(f"{t:.2f} s" for t in row["epoch_s"]), f"{row['last_epoch_speedup_vs_plain']:.1f}x"]
             for row in rows]  # fmt: skip
    print(markdown_table(header, cells), end="")
    for name in skipped:
        print(f"skipped: {name}")
    print(f"wrote {write_report(RESULTS, 'cached_dataset', report)} ({wall:.1f} s)")


if __name__ == "__main__":
    main()
