"""Autotuned bucket size against the default, on two GPUs whose NCCL traffic goes through TCP sockets.

NCCL is kept off NVLink, PCIe peer-to-peer and shared memory (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo``), so the two GPUs talk as two hosts on a network would, the regime where
the bucket size matters most. Each round trains the same model twice with gradient_allreduce:

- ``default``: the default bucket size (10 MiB), untuned;
- ``autotuned``: starting from the default, a :class:`~lightning_bagua.engine.BucketAutotuner` with its default
  candidates runs its tuning steps, then the chosen setting trains.

Both are then timed over ``--steps`` steps after ``--warmup`` steps. Run it on the device machine::

    python benchmarks/autotune_sockets.py                    # 2 GPUs, NCCL over sockets
    python benchmarks/autotune_sockets.py --device cpu       # smoke test: 2 CPU processes, Gloo, small model

Prints a table and writes ``benchmarks/results/autotune_sockets_{gpu,cpu}.json``: per round the choice, every
candidate's measured step time, and the median step times; overall the ratio autotuned / default.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel, BucketAutotuner

RESULTS = Path(__file__).parent / "results"
SOCKETS_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}
DEFAULT_BUCKET_MB = 10.0


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def train_step(model: BaguaDistributedDataParallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=False)
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=inputs.device.type == "cuda"):
        loss = model(inputs).float().pow(2).mean()
    loss.backward()
    optimizer.step()


def timed_steps(
    model: BaguaDistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    args: argparse.Namespace,
) -> list[float]:
    times = []
    for step in range(args.warmup + args.steps):
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, optimizer, inputs)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def worker(rank: int, args: argparse.Namespace, port: int, queue: "mp.Queue") -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cpu = args.device == "cpu"
    if cpu:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        os.environ.update(SOCKETS_ONLY)  # before NCCL's first communicator
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=2)
    inputs = torch.randn(args.batch, args.width, device=device)
    rounds = []
    for _ in range(args.rounds):
        entry: dict = {}
        for mode in ("default", "autotuned"):
            model = make_model(args.width, args.depth).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
            wrapped = BaguaDistributedDataParallel(
                model,
                [optimizer],
                "gradient_allreduce",
                device_ids=None if cpu else [rank],
                bucket_cap_mb=DEFAULT_BUCKET_MB,
            )
            if mode == "autotuned":
                tuner = BucketAutotuner()
                started = time.perf_counter()
                tuning_steps = 0
                while not tuner.finished:
                    wrapped = tuner.step(wrapped)
                    if tuner.finished:
                        break
                    train_step(wrapped, optimizer, inputs)
                    tuning_steps += 1
                assert tuner.decision is not None
                entry["decision"] = {
                    "bucket_cap_mb": tuner.decision.bucket_cap_mb,
                    "hierarchical": tuner.decision.hierarchical,
                }
                entry["candidates_ms"] = {f"{s.bucket_cap_mb:g}": t * 1000 for s, t in tuner.measurements}
                entry["tuning_steps"] = tuning_steps
                entry["tuning_wall_s"] = time.perf_counter() - started
            times = timed_steps(wrapped, optimizer, inputs, args)
            # The slowest rank sets the pace: report the per-step maximum over ranks.
            gathered = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
            entry[f"{mode}_median_ms"] = statistics.median(gathered.tolist()) * 1000
            wrapped.close()
            del wrapped, model, optimizer
        rounds.append(entry)
    if rank == 0:
        queue.put(rounds)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.device == "cpu":
        args.width, args.depth, args.batch = min(args.width, 256), min(args.depth, 3), min(args.batch, 64)
        args.steps, args.rounds = min(args.steps, 8), 1
    elif torch.cuda.device_count() < 2:
        raise SystemExit(
            f"This benchmark needs 2 GPUs, found {torch.cuda.device_count()}; use --device cpu to smoke-test."
        )

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = 29000 + os.getpid() % 1000
    processes = [context.Process(target=worker, args=(rank, args, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    rounds = queue.get(timeout=3600)
    for process in processes:
        process.join()

    default = statistics.median(entry["default_median_ms"] for entry in rounds)
    autotuned = statistics.median(entry["autotuned_median_ms"] for entry in rounds)
    gpu = args.device == "cuda"
    report = {
        "benchmark": "median step time (max over 2 ranks), gradient_allreduce, default 10 MiB buckets vs autotuned",
        "command": "python benchmarks/autotune_sockets.py" + ("" if gpu else " --device cpu"),
        "regime": "NCCL over TCP sockets on loopback: " + " ".join(f"{k}={v}" for k, v in SOCKETS_ONLY.items())
        if gpu
        else "Gloo on CPU (smoke test)",
        "settings": vars(args),
        "parameters": sum(p.numel() for p in make_model(args.width, args.depth).parameters()),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "rounds": rounds,
        "median_step_ms": {"default": default, "autotuned": autotuned},
        "ratio_autotuned_to_default": autotuned / default,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"autotune_sockets_{'gpu' if gpu else 'cpu'}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    for index, entry in enumerate(rounds):
        print(f"round {index}: chose {entry['decision']} from {entry['candidates_ms']}")
        print(
            f"  default {entry['default_median_ms']:.2f} ms/step, autotuned {entry['autotuned_median_ms']:.2f} ms/step"
        )
    print(f"autotuned / default: {report['ratio_autotuned_to_default']:.3f}  ->  {out}")


if __name__ == "__main__":
    main()
