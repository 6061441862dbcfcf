"""Step time of BaguaDistributedDataParallel (gradient_allreduce) against torch's DDP, same model, same buckets.

Both wrap the same model with the same bucket size; the only difference is who communicates (our hook on our
own communicator, or DDP's built-in all-reduce). Runs one process per GPU (NCCL) or two CPU processes (Gloo):

    python benchmarks/engine_overhead.py --devices 2            # GPUs
    python benchmarks/engine_overhead.py --devices 2 --cpu      # CPU, Gloo

Prints a table and writes ``benchmarks/results/engine_overhead_{gpu,cpu}.json``: the median step time over
``--steps`` steps after ``--warmup`` steps, per wrapper, with the machine and versions.
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
from torch.nn.parallel import DistributedDataParallel

from lightning_bagua.engine import BaguaDistributedDataParallel

RESULTS = Path(__file__).parent / "results"


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def time_steps(
    wrapped: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, args: argparse.Namespace
) -> list[float]:
    times = []
    autocast = torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=inputs.device.type == "cuda")
    for step in range(args.warmup + args.steps):
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        with autocast:
            loss = wrapped(inputs).float().pow(2).mean()
        loss.backward()
        optimizer.step()
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
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=rank, world_size=args.devices)
    inputs = torch.randn(args.batch, args.width, device=device)
    result = {}
    # Alternate the wrappers in rounds so that clock and thermal drift hit both alike.
    for _ in range(args.rounds):
        for name in ("torch_ddp", "bagua_gradient_allreduce"):
            model = make_model(args.width, args.depth).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            device_ids = [rank] if device.type == "cuda" else None
            common = {"device_ids": device_ids, "bucket_cap_mb": args.bucket_mb, "gradient_as_bucket_view": True}
            if name == "torch_ddp":
                wrapped = DistributedDataParallel(model, **common)
            else:
                wrapped = BaguaDistributedDataParallel(model, [optimizer], "gradient_allreduce", **common)
            result.setdefault(name, []).extend(time_steps(wrapped, optimizer, inputs, args))
            if isinstance(wrapped, BaguaDistributedDataParallel):
                wrapped.close()
            del wrapped, model, optimizer
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
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
    times = queue.get(timeout=1800)
    for process in processes:
        process.join()

    parameters = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    deciles = {name: statistics.quantiles(values, n=10) for name, values in times.items()}
    spread = {name: {"p10_ms": q[0] * 1000, "p90_ms": q[-1] * 1000} for name, q in deciles.items()}
    report = {
        "benchmark": "median step time, torch DDP vs BaguaDistributedDataParallel(gradient_allreduce)",
        "command": "python benchmarks/engine_overhead.py "
        + ("--cpu " if args.cpu else "")
        + f"--devices {args.devices}",
        "settings": vars(args),
        "parameters": parameters,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "median_step_ms": medians,
        "spread": spread,
        "ratio_bagua_to_ddp": medians["bagua_gradient_allreduce"] / medians["torch_ddp"],
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"engine_overhead_{'cpu' if args.cpu else 'gpu'}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{parameters / 1e6:.1f}M parameters on {report['device']} x{args.devices}")
    for name, value in medians.items():
        print(f"{name:28s} {value:8.2f} ms/step (p10 {spread[name]['p10_ms']:.2f}, p90 {spread[name]['p90_ms']:.2f})")
    print(f"ratio bagua / ddp: {report['ratio_bagua_to_ddp']:.3f}  ->  {out}")


if __name__ == "__main__":
    main()
