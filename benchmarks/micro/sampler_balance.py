"""Step-time balance: LoadBalancingDistributedSampler against DistributedSampler on variable-length sequences.

Two CPU ranks (spawned, Gloo, one thread each) train a small GRU on log-normally long sequences, each run on its own
(``unpadded``: a step costs the batch's total length) or padded to the batch's longest (``padded``), and all-reduce
their gradients after the backward, so a rank that drew short sequences waits for the slowest. One epoch with each
sampler (``complexity_fn=len`` for the balancing one), in ``--rounds`` rounds of alternating order:

    python benchmarks/micro/sampler_balance.py

Prints a table and writes ``benchmarks/results/sampler_balance.json``: per sampler, medians over the rounds of the
slowest rank's compute time, the time ranks wait for it, the step time, the gap in work between the ranks' batches
and the epoch time.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, DistributedSampler

from lightning_bagua.data.samplers import LoadBalancingDistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.harness import spawn_ranks
from lab.render import markdown_table
from lab.results import RESULTS, new_report, write_report

WORLD_SIZE = 2
LAYOUTS = ("unpadded", "padded")
SAMPLERS = ("DistributedSampler", "LoadBalancingDistributedSampler")


def make_dataset(args: argparse.Namespace) -> list[torch.Tensor]:
    # Log-normal lengths from a seeded normal (torch's LogNormal takes no generator): every rank builds the same data.
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(args.samples, generator=generator)
    lengths = (args.median_length * torch.exp(args.sigma * normal)).round()
    lengths = lengths.clamp(args.min_length, args.max_length).long()
    return [torch.randn(int(length), args.features, generator=generator) for length in lengths]


def run_epoch(model: nn.Module, loader: DataLoader, params: list[torch.Tensor], layout: str) -> dict:
    compute, steps, work = [], [], []
    dist.barrier()
    epoch_start = time.perf_counter()
    for batch in loader:
        start = time.perf_counter()
        if layout == "padded":
            # Padded to the batch's longest sequence: the cost follows batch size x longest length.
            inputs = pad_sequence(batch, batch_first=True)
            work.append(inputs.shape[0] * inputs.shape[1])
            output = model(inputs)[0].square().mean()
        else:
            # Unpadded: every sequence runs on its own (as variable-size inputs that cannot be padded do), so the
            # cost follows the batch's total length.
            work.append(sum(len(x) for x in batch))
            output = sum(model(x.unsqueeze(0))[0].square().mean() for x in batch) / len(batch)
        output.backward()
        computed = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)  # waits for the slowest rank, as every synchronous data-parallel step does
        for p in params:
            p.grad = None
        steps.append(time.perf_counter() - start)
        compute.append(computed - start)
    dist.barrier()
    return {"compute": compute, "steps": steps, "work": work, "epoch": time.perf_counter() - epoch_start}


def worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict] | None:
    """Time every layout and sampler on this rank; rank 0 returns every rank's timings."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dataset = make_dataset(args)
    torch.manual_seed(0)
    model = nn.GRU(args.features, args.hidden, batch_first=True)
    params = list(model.parameters())
    samplers = {
        "DistributedSampler": DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0),
        "LoadBalancingDistributedSampler": LoadBalancingDistributedSampler(
            dataset, complexity_fn=len, num_replicas=world_size, rank=rank, shuffle=True, seed=0
        ),
    }
    # Warm-up: allocator and kernels settle before anything is timed.
    warm = DataLoader(dataset[: args.batch_size * 4], batch_size=args.batch_size, collate_fn=list)
    for layout in LAYOUTS:
        run_epoch(model, warm, params, layout)
    results: dict[str, list[dict]] = {f"{layout}/{name}": [] for layout in LAYOUTS for name in samplers}
    for round_index in range(args.rounds):
        # Short rounds, in alternating order, so drift and background load hit every variant alike.
        order = list(samplers.items()) if round_index % 2 == 0 else list(reversed(samplers.items()))
        for layout in LAYOUTS:
            for name, sampler in order:
                sampler.set_epoch(round_index)
                loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=list)
                results[f"{layout}/{name}"].append(run_epoch(model, loader, params, layout))
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, results)
    dist.destroy_process_group()
    return gathered if rank == 0 else None


def summarize(gathered: list[dict], name: str) -> dict:
    rounds = []
    for round_index in range(len(gathered[0][name])):
        per_rank = [ranks[name][round_index] for ranks in gathered]
        steps = len(per_rank[0]["steps"])
        max_compute = [max(r["compute"][s] for r in per_rank) for s in range(steps)]
        idle = [statistics.mean(max_compute[s] - r["compute"][s] for r in per_rank) for s in range(steps)]
        step_time = [max(r["steps"][s] for r in per_rank) for s in range(steps)]
        gap = [max(r["work"][s] for r in per_rank) - min(r["work"][s] for r in per_rank) for s in range(steps)]
        rounds.append(
            {
                "steps": steps,
                "mean_max_compute_s": statistics.mean(max_compute),
                "mean_idle_per_rank_s": statistics.mean(idle),
                "mean_step_s": statistics.mean(step_time),
                "mean_work_gap_tokens": statistics.mean(gap),
                "epoch_s": per_rank[0]["epoch"],
            }
        )
    # Medians over the rounds: robust to a round disturbed by other load on the machine.
    summary = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "steps"}
    summary["steps"] = rounds[0]["steps"]
    summary["idle_fraction"] = summary["mean_idle_per_rank_s"] / summary["mean_max_compute_s"]
    return {"summary": summary, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--median-length", type=float, default=48)
    parser.add_argument("--sigma", type=float, default=0.9, help="log-normal shape of the lengths")
    parser.add_argument("--min-length", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=600)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    gathered = spawn_ranks(worker, WORLD_SIZE, args)
    wall = time.perf_counter() - start

    results = {f"{layout}/{name}": summarize(gathered, f"{layout}/{name}") for layout in LAYOUTS for name in SAMPLERS}
    speedup = {}
    for layout in LAYOUTS:
        base, balanced = (results[f"{layout}/{name}"]["summary"] for name in SAMPLERS)
        speedup[layout] = {
            "mean_step": base["mean_step_s"] / balanced["mean_step_s"],
            "epoch": base["epoch_s"] / balanced["epoch_s"],
            "mean_max_compute": base["mean_max_compute_s"] / balanced["mean_max_compute_s"],
        }
    rows = [{"layout/sampler": name, **result} for name, result in results.items()]
    settings = {**vars(args), "world_size": WORLD_SIZE, "backend": "gloo", "threads_per_rank": 1}
    benchmark = "synchronous step time on variable-length sequences: DistributedSampler vs " + SAMPLERS[1]
    report = new_report(benchmark, settings, rows, command="python benchmarks/micro/sampler_balance.py")
    report.update(speedup=speedup, wall_s=wall)
    header = ["layout/sampler", "steps", "max compute ms", "idle/rank ms", "step ms", "work gap", "epoch s"]
    cells = []
    for row in rows:
        summary = row["summary"]
        cells.append([row["layout/sampler"], str(summary["steps"]), f"{summary['mean_max_compute_s'] * 1e3:.2f}",
                      f"{summary['mean_idle_per_rank_s'] * 1e3:.2f}", f"{summary['mean_step_s'] * 1e3:.2f}",
                      f"{summary['mean_work_gap_tokens']:.1f}", f"{summary['epoch_s']:.2f}"])  # fmt: skip
    print(markdown_table(header, cells), end="")
    for layout in LAYOUTS:
        print(f"{layout}: speedup step x{speedup[layout]['mean_step']:.2f}, epoch x{speedup[layout]['epoch']:.2f}")
    print(f"wrote {write_report(RESULTS, 'sampler_balance', report)} ({wall:.1f} s)")


if __name__ == "__main__":
    main()
