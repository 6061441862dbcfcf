"""Train, checkpoint and resume a user's algorithm (``examples/custom_algorithm.py``, local SGD) under the Trainer
and Fabric; ``test_user_algorithm.py`` runs this under torchrun on 2 processes.

``--phase full`` trains ``STEPS`` steps in epochs of ``CHECKPOINT_STEP``, checkpointing after the first epoch
(between two averages, so the processes' weights differ there), and writes each rank's final weights;
``--phase resume`` (new processes) resumes from that checkpoint and writes the same.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 9
CHECKPOINT_STEP = 3
PERIOD = 2  # averages after steps 2, 4, 6 and 8: the checkpoint at step 3 holds different weights per rank
BATCH = 4


def make_network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of this rank's batches (an epoch is CHECKPOINT_STEP steps); ranks see different targets."""
    generator = torch.Generator().manual_seed(100 + rank)
    inputs = torch.randn(CHECKPOINT_STEP, BATCH, 6, generator=generator)
    return [(x, x.sum(dim=1, keepdim=True) * (rank + 1)) for x in inputs]


def run_trainer(out: Path, phase: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bagua import BaguaStrategy

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    rank = int(os.environ["RANK"])
    batches = rank_batches(rank)
    data = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    # At the end of every epoch (CHECKPOINT_STEP steps): Lightning 2.2 resumes a checkpoint saved by
    # every_n_train_steps on an epoch's last batch with one batch too many, even under its own DDP strategy.
    checkpoints = ModelCheckpoint(dirpath=out, filename="trainer-{step}", every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=BaguaStrategy(algorithm="local_sgd", period=PERIOD),
        max_epochs=STEPS // CHECKPOINT_STEP,
        logger=False,
        enable_checkpointing=phase == "full",
        callbacks=[checkpoints] if phase == "full" else [],
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each rank trains on its own batches, in order
    )
    model = Regression()
    ckpt_path = out / f"trainer-step={CHECKPOINT_STEP}.ckpt" if phase == "resume" else None
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=False), ckpt_path=ckpt_path)
    counter = trainer.strategy.communication_counter
    return {
        "state": {key: value.detach().clone() for key, value in model.net.state_dict().items()},
        "bytes_by_op": dict(counter.bytes_by_op) if counter is not None else {},
    }


def run_fabric(out: Path, phase: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_bagua.strategies.fabric import BaguaStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=BaguaStrategy(algorithm="local_sgd", period=PERIOD))
    fabric.launch()
    network = make_network()
    model, optimizer = fabric.setup(network, torch.optim.SGD(network.parameters(), lr=0.05, momentum=0.9))
    start = 0
    if phase == "resume":
        with torch.no_grad():  # a different start, so that only a working load can make the runs agree
            for parameter in network.parameters():
                parameter.add_(1.0)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / "fabric.ckpt", state)
        start = state["step"]
    batches = rank_batches(fabric.global_rank)
    for step in range(start, STEPS):
        inputs, targets = batches[step % len(batches)]
        loss = nn.functional.mse_loss(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if phase == "full" and step + 1 == CHECKPOINT_STEP:
            fabric.save(out / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": step + 1})
    counter = fabric.strategy.communication_counter
    return {
        "state": {key: value.detach().clone() for key, value in network.state_dict().items()},
        "bytes_by_op": dict(counter.bytes_by_op),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--phase", required=True, choices=["full", "resume"])
    parser.add_argument("--framework", required=True, choices=["trainer", "fabric"])
    args = parser.parse_args()
    import examples.custom_algorithm  # noqa: F401 - registers "local_sgd"

    run = run_trainer if args.framework == "trainer" else run_fabric
    result = run(args.out, args.phase)
    torch.save(result, args.out / f"{args.framework}_{args.phase}_rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
