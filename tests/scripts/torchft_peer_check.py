"""Check that torchft's DiLoCo runs here through :mod:`lab.torchft_peer`, and that it computes what DiLoCo means.

Two Gloo processes on the loopback train a small MLP under :func:`lab.torchft_peer.torchft_diloco` (H=4, 2 fragments,
no delay, no mixing) for a few outer rounds, as the network lab's workers do (a default Gloo group first, then the
peer). Then this process replays the same run alone, with both ranks' models, their inner SGD and the same
batches, and the DiLoCo math written out: every ``H / fragments`` steps the next fragment's pseudo-gradient
Δ = θ_outer - θ_local is averaged over the ranks, a Nesterov SGD per fragment steps θ_outer with it, and both ranks
adopt θ_outer. It checks that

1. right after each sync, the synced fragment's weights are bit-identical on both ranks;
2. every rank's final weights match the single-process replay (``torch.testing.assert_close``, fp32 tolerances);
3. the peer counted every sync and its bytes.

Run it with an interpreter that has torchft (``requirements/benchmarks-torchft.txt``)::

    .venv-torchft/bin/python tests/scripts/torchft_peer_check.py

It prints ``torchft_peer_check: PASS ...`` and exits 0, or names what failed and exits 1 (2 when torchft is missing).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The peer is in the benchmarks' lab package: benchmarks/ goes on the path, as the labs run it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from lab.harness import free_port
from lab.torchft_peer import split_fragments, torchft_diloco

WORLD_SIZE = 2
SYNC_EVERY = 4
FRAGMENTS = 2
STEPS = 12  # three outer rounds: every fragment synced three times
INNER_LR = 0.05
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
TIMEOUT_S = 60


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(STEPS)]


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()


def worker(rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE)}
    )
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=TIMEOUT_S))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    wrapped = torchft_diloco(
        model,
        optimizer,
        sync_every=SYNC_EVERY,
        fragments=FRAGMENTS,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    synced: list[dict[str, Any]] = []
    for step, batch in enumerate(batches(rank)):
        syncs = wrapped.syncs
        inner_step(wrapped, optimizer, batch)
        if wrapped.syncs != syncs:
            fragment = syncs % FRAGMENTS
            weights = [p.detach().clone() for p in wrapped.fragments[fragment].parameters()]
            synced.append({"step": step, "fragment": fragment, "weights": weights})
    wrapped.close()
    torch.save(
        {
            "synced": synced,
            "final": [p.detach().clone() for p in model.parameters()],
            "bytes_sent": wrapped.communication_counter.bytes_sent,
            "syncs": wrapped.syncs,
        },
        out / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def replay() -> tuple[list[list[torch.Tensor]], list[tuple[int, int]]]:
    """Both ranks in this process, with DiLoCo's outer step written out: each rank's final weights, and the syncs."""
    models = [make_model() for _ in range(WORLD_SIZE)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    outer = make_model()
    outer_fragments = split_fragments(outer, FRAGMENTS)
    outer_optimizers = [
        torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for f in outer_fragments
    ]
    local_fragments = [split_fragments(m, FRAGMENTS) for m in models]
    data = [batches(rank) for rank in range(WORLD_SIZE)]
    syncs: list[tuple[int, int]] = []
    for step in range(STEPS):
        for rank in range(WORLD_SIZE):
            inner_step(models[rank], optimizers[rank], data[rank][step])
        if (step + 1) % (SYNC_EVERY // FRAGMENTS):
            continue
        fragment = len(syncs) % FRAGMENTS
        syncs.append((step, fragment))
        with torch.no_grad():
            for index, global_parameter in enumerate(outer_fragments[fragment].parameters()):
                locals_ = [list(f[fragment].parameters())[index] for f in local_fragments]
                global_parameter.grad = torch.stack([global_parameter - p for p in locals_]).mean(0)
        outer_optimizers[fragment].step()
        outer_optimizers[fragment].zero_grad()
        with torch.no_grad():
            for f in local_fragments:
                for local, global_parameter in zip(
                    f[fragment].parameters(), outer_fragments[fragment].parameters(), strict=True
                ):
                    local.copy_(global_parameter)
    return [[p.detach().clone() for p in m.parameters()] for m in models], syncs


def check(out: Path) -> list[str]:
    """Compare the ranks with each other and with the replay; return what failed."""
    ranks = [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    expected_final, expected_syncs = replay()
    failures = []
    for rank, result in enumerate(ranks):
        got = [(s["step"], s["fragment"]) for s in result["synced"]]
        if got != expected_syncs:
            failures.append(f"rank {rank} synced at (step, fragment) {got}, expected {expected_syncs}")
    for first, second in zip(ranks[0]["synced"], ranks[1]["synced"], strict=False):
        if not all(torch.equal(a, b) for a, b in zip(first["weights"], second["weights"], strict=True)):
            failures.append(f"fragment {first['fragment']} differs between the ranks right after step {first['step']}")
    for rank, result in enumerate(ranks):
        try:
            for got_parameter, want in zip(result["final"], expected_final[rank], strict=True):
                torch.testing.assert_close(got_parameter, want, rtol=1e-5, atol=1e-6)
        except AssertionError as error:
            failures.append(f"rank {rank}'s final weights differ from the single-process replay: {error}")
    fragment_bytes = [sum(p.numel() * 4 for p in f.parameters()) for f in split_fragments(make_model(), FRAGMENTS)]
    want_bytes = sum(fragment_bytes[fragment] for _, fragment in expected_syncs)
    for rank, result in enumerate(ranks):
        if (result["syncs"], result["bytes_sent"]) != (len(expected_syncs), want_bytes):
            failures.append(
                f"rank {rank} counted {result['syncs']} syncs and {result['bytes_sent']} bytes,"
                f" expected {len(expected_syncs)} and {want_bytes}"
            )
    return failures


def orchestrate() -> int:
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("torchft_peer_check: this interpreter cannot import torchft; see requirements/benchmarks-torchft.txt")
        return 2
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory)
        port = free_port()
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--port", str(port), "--out", directory]
        logs = [open(out / f"rank{rank}.log", "w+") for rank in range(WORLD_SIZE)]  # noqa: SIM115
        start = time.perf_counter()
        processes = [
            subprocess.Popen([*command, "--rank", str(rank)], stdout=logs[rank], stderr=subprocess.STDOUT, text=True)
            for rank in range(WORLD_SIZE)
        ]
        try:
            codes = [process.wait(timeout=3 * TIMEOUT_S) for process in processes]
        except subprocess.TimeoutExpired:
            codes = [-1]
        finally:
            for process in processes:
                process.kill()
                process.wait()
        outputs = []
        for log_file in logs:
            log_file.seek(0)
            outputs.append(log_file.read())
            log_file.close()
        if any(code != 0 for code in codes):
            print(f"torchft_peer_check: FAIL: workers exited {codes}")
            for rank, output in enumerate(outputs):
                print(f"--- rank {rank} ---\n{output[-3000:]}")
            return 1
        failures = check(out)
    if failures:
        print("torchft_peer_check: FAIL:\n  " + "\n  ".join(failures))
        return 1
    summary = {
        "torchft": _version("torchft"),
        "torch": torch.__version__,
        "world_size": WORLD_SIZE,
        "sync_every": SYNC_EVERY,
        "fragments": FRAGMENTS,
        "steps": STEPS,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(
        "torchft_peer_check: PASS: the synced fragments agree bit for bit after every sync and the final weights"
        f" match the single-process DiLoCo replay {json.dumps(summary)}"
    )
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.rank, args.port, args.out)
        return
    raise SystemExit(orchestrate())


if __name__ == "__main__":
    main()
