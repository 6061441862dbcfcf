"""One elastic job that trains every algorithm in turn, resuming each from its last checkpoint at every restart.

``test_elastic.py`` runs it under ``torchrun --nnodes=1:2`` on two network namespaces and kills and restarts one
of them while an algorithm trains. Each start of an algorithm's fit, and each epoch end, appends a line to
``events.jsonl`` (rank 0); an algorithm trains until the test creates ``<out>/<algorithm>/stop``, then the next.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

ALGORITHMS: dict[str, dict[str, Any]] = {
    "gradient_allreduce": {},
    "low_rank": {"hierarchical": False, "warmup_steps": 1},
    "decentralized": {"hierarchical": False},
}
MAX_EPOCHS = 200  # a backstop: the test stops each algorithm long before
STEP_SECONDS = 0.2  # slow enough for the test to act between epochs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_bagua import BaguaStrategy
    from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

    out = Path(args.out)
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])

    def event(**fields: Any) -> None:
        if rank == 0:
            with (out / "events.jsonl").open("a") as events:
                events.write(json.dumps({**fields, "world_size": world_size, "time": time.time()}) + "\n")

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(STEP_SECONDS)
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    class StopWhenTold(Callback):
        def __init__(self, algorithm: str) -> None:
            self.algorithm = algorithm

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            event(kind="start", algorithm=self.algorithm, epoch=trainer.current_epoch)

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            event(kind="epoch", algorithm=self.algorithm, epoch=trainer.current_epoch)
            # Rank 0 decides for all: the ranks may reach an epoch's end at different moments.
            trainer.should_stop = trainer.strategy.broadcast((out / self.algorithm / "stop").exists())

    for algorithm, kwargs in ALGORITHMS.items():
        directory = out / algorithm
        if (directory / "done").exists():
            continue
        last = directory / "last.ckpt"
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            num_nodes=world_size,
            strategy=BaguaStrategy(algorithm=algorithm, **kwargs),
            max_epochs=MAX_EPOCHS,
            limit_train_batches=2,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[StopWhenTold(algorithm), ModelCheckpoint(dirpath=directory, save_last=True)],
        )
        trainer.fit(
            Regression(), DataLoader(make_dataset(), batch_size=BATCH), ckpt_path=last if last.exists() else None
        )
        trainer.strategy.barrier()
        if rank == 0:
            (directory / "done").touch()
        event(kind="done", algorithm=algorithm, epoch=trainer.current_epoch)
        trainer.strategy.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
