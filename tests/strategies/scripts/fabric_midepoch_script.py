"""Fabric's counterpart of ``midepoch_script.py``: a loop that saves every few steps and resumes from its last save.

The loop keeps the data's position with ``fabric.strategy.data_state(loader)`` in the saved state, as the fault
tolerance page of the docs shows. With ``--kill-at-step``, rank 1 SIGKILLs itself before that step, once; the job
is then launched again, unchanged. Each rank of the launch that finishes writes ``OUT/<case>/rank{r}.pt``.
"""

import argparse
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.strategies.scripts.midepoch_script import BATCH, CASES, CHECKPOINT_EVERY, EPOCHS, FEATURES, NoisyDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", default="gradient_allreduce")
    parser.add_argument("--kill-at-step", type=int, default=None)
    args = parser.parse_args()

    from lightning.fabric import Fabric

    from lightning_bagua.strategies.fabric import BaguaStrategy

    algorithm, kwargs, _ = CASES[args.case]
    directory = Path(args.out) / args.case
    directory.mkdir(parents=True, exist_ok=True)
    marker, path = directory / "killed", directory / "last.ckpt"

    fabric = Fabric(accelerator="cpu", devices=2, strategy=BaguaStrategy(algorithm=algorithm, **kwargs))
    fabric.launch()
    fabric.seed_everything(7, verbose=False)
    dataset = NoisyDataset()
    torch.manual_seed(1234)
    network = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    model, optimizer = fabric.setup(network, torch.optim.SGD(network.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH, shuffle=True))
    data = fabric.strategy.data_state(loader)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "data": data}
    if path.exists():
        fabric.load(path, state)
    loaded_by_epoch: dict[int, list[int]] = {}
    for epoch in range(data.epoch, EPOCHS):
        for batch_idx, (inputs, targets, _) in enumerate(loader, start=data.batches):
            step = epoch * len(loader) + batch_idx
            if fabric.global_rank == 1 and step == args.kill_at_step and not marker.exists():
                marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            scale = 1 + 0.1 * random.random() + 0.1 * float(numpy.random.rand())
            fabric.backward(scale * nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
            data.batches = batch_idx + 1
            if (step + 1) % CHECKPOINT_EVERY == 0:
                fabric.save(path, state)
        data.batches = 0
        loaded_by_epoch[epoch] = list(dataset.loaded)
        dataset.loaded.clear()
    result = {
        "state": {key: value.detach().clone() for key, value in model.state_dict().items()},
        "loaded": loaded_by_epoch,
    }
    torch.save(result, directory / f"rank{fabric.global_rank}.pt")
    fabric.strategy.teardown()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
