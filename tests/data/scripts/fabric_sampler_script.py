"""Iterate a load-balancing sampler's loader under Fabric on two CPU processes; each rank saves what it got.

Run as ``python tests/data/scripts/fabric_sampler_script.py --out DIR``: ``fabric.launch()`` starts the second process.
The sampler is built without ``num_replicas``/``rank``; Fabric must keep it instead of swapping in a
DistributedSampler, and it takes the ranks from the process group on first use.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fit_sampler_script import BATCH, EPOCHS, SEED, IndexedDataset, complexity


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from lightning.fabric import Fabric

    from lightning_bagua import LoadBalancingDistributedSampler

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    sampler = LoadBalancingDistributedSampler(IndexedDataset(), complexity, seed=SEED)
    loader = fabric.setup_dataloaders(DataLoader(IndexedDataset(), batch_size=BATCH, sampler=sampler))
    seen = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        seen.append([int(index) for _, _, indices in loader for index in indices])
    result = {"sampler_kept": loader.sampler is sampler, "ranks": (sampler.num_replicas, sampler.rank), "seen": seen}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(result, Path(args.out) / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
