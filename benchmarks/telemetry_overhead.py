"""Step time of BaguaDistributedDataParallel with communication telemetry off and on.

Same model, same buckets, same algorithm; the only difference is ``telemetry=``. With it off the wrapper registers
the algorithm's hook as it is and reads no clock; with it on, a hook around the algorithm's reads the clock (CUDA
events on GPUs) at the last bucket and at the end of backward, and each step closes a record. Runs two CPU
processes (Gloo) by default, or one process per GPU (NCCL):

    python benchmarks/telemetry_overhead.py --cpu --devices 2      # CPU, Gloo
    python benchmarks/telemetry_overhead.py --devices 2            # GPUs

Prints a table and writes ``benchmarks/results/telemetry_overhead_{cpu,gpu}.json``: the median step time over
``--steps`` steps after ``--warmup`` steps, per algorithm and setting, alternated in ``--rounds`` rounds, with a
sample telemetry record, the machine and versions.
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

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel

RESULTS = Path(__file__).parent / "results"
ALGORITHMS = {"gradient_allreduce": {}, "bytegrad": {"hierarchical": False}}


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def time_steps(
    wrapped: BaguaDistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    args: argparse.Namespace,
) -> list[float]:
    times = []
    for step in range(args.warmup + args.steps):
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        wrapped(inputs).float().pow(2).mean().backward()
        optimizer.step()
        if wrapped.telemetry is not None:
            wrapped.telemetry.end_step()  # what a user reading the record every step pays
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def worker(rank: int, args: argparse.Namespace, port: int, queue: "mp.Queue") -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if args.cpu:
        # One compute thread per rank: several ranks' thread pools on few cores make every timing noise.
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=rank, world_size=args.devices)
    inputs = torch.randn(args.batch, args.width, device=device)
    times: dict[str, list[float]] = {}
    samples: dict[str, dict] = {}
    # Alternate the settings in rounds so that clock drift and the neighbours' load hit all alike.
    for _ in range(args.rounds):
        for algorithm, kwargs in ALGORITHMS.items():
            for telemetry in (False, True):
                model = make_model(args.width, args.depth).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
                wrapped = BaguaDistributedDataParallel(
                    model,
                    [optimizer],
                    Algorithm.init(algorithm, **kwargs),
                    device_ids=None if args.cpu else [rank],
                    bucket_cap_mb=args.bucket_mb,
                    telemetry=telemetry,
                )
                key = f"{algorithm}/telemetry_{'on' if telemetry else 'off'}"
                times.setdefault(key, []).extend(time_steps(wrapped, optimizer, inputs, args))
                if wrapped.telemetry is not None:
                    samples[algorithm] = wrapped.telemetry.last_step
                wrapped.close()
                del wrapped, model, optimizer
    if rank == 0:
        queue.put((times, samples))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--bucket-mb", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.cpu:
        args.width, args.depth, args.batch = min(args.width, 512), min(args.depth, 4), min(args.batch, 256)

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = 29000 + os.getpid() % 1000
    processes = [context.Process(target=worker, args=(rank, args, port, queue)) for rank in range(args.devices)]
    for process in processes:
        process.start()
    times, samples = queue.get(timeout=1800)
    for process in processes:
        process.join()

    parameters = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    spread = {}
    for name, values in times.items():
        deciles = statistics.quantiles(values, n=10)
        spread[name] = {"p10_ms": deciles[0] * 1000, "p90_ms": deciles[-1] * 1000}
    ratios = {
        algorithm: medians[f"{algorithm}/telemetry_on"] / medians[f"{algorithm}/telemetry_off"]
        for algorithm in ALGORITHMS
    }
    report = {
        "benchmark": "median step time, BaguaDistributedDataParallel with telemetry off vs on",
        "command": "python benchmarks/telemetry_overhead.py "
        + ("--cpu " if args.cpu else "")
        + f"--devices {args.devices}",
        "settings": vars(args),
        "parameters": parameters,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "median_step_ms": medians,
        "spread": spread,
        "ratio_on_to_off": ratios,
        "sample_record_rank0": samples,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"telemetry_overhead_{'cpu' if args.cpu else 'gpu'}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{parameters / 1e6:.1f}M parameters on {report['device']} x{args.devices}")
    for name, value in medians.items():
        print(f"{name:36s} {value:8.2f} ms/step (p10 {spread[name]['p10_ms']:.2f}, p90 {spread[name]['p90_ms']:.2f})")
    for algorithm, ratio in ratios.items():
        print(f"{algorithm}: on / off = {ratio:.3f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
