"""Fit with ``ModelCheckpoint(save_last=True)`` on two CPU processes, optionally killing rank 0 inside a save.

Run as ``python tests/strategies/scripts/killed_save_script.py --dir CKPT --out DIR --max-epochs N [--kill-at K]
[--resume]`` with the repository on PYTHONPATH; Lightning's own launcher starts rank 1. Every checkpoint carries a
ballast of about 128 MB whose every value is the epoch it was saved at plus one, so that a torn file is told from a
whole one. ``--kill-at K`` kills rank 0 in the middle of writing its K-th ``last`` checkpoint (see
``kill_during_save.py``); ``--resume`` fits with ``ckpt_path="last"``. With ``--link``, ``last.ckpt`` is
``ModelCheckpoint(save_last="link")``'s link to the newest checkpoint, the ballast is small, and ``--kill-at K``
kills rank 0 as it makes its K-th link. Each rank that finishes writes
``DIR/rank{r}.pt``: the checkpoint it resumed from and what that checkpoint held.
"""

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network
from tests.strategies.scripts.kill_during_save import kill_at_link, kill_during_write

BALLAST_VALUES = 32 * 1024 * 1024
LINK_BALLAST_VALUES = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--link", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ballast_values = LINK_BALLAST_VALUES if args.link else BALLAST_VALUES
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.network = make_network()
            self.loaded: dict[str, Any] | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.mse_loss(self.network(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_dataset(), batch_size=BATCH)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["ballast"] = torch.full((ballast_values,), float(self.current_epoch + 1))

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            ballast = checkpoint["ballast"]
            self.loaded = {
                "epoch": checkpoint["epoch"],
                "ballast_values": ballast.numel(),
                "ballast_whole": bool((ballast == checkpoint["epoch"] + 1).all()),
            }

    checkpoints = Path(args.dir)
    # Lightning's launcher sets LOCAL_RANK for the ranks it starts; the main process is rank 0.
    if args.kill_at and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        if args.link:
            kill_at_link(checkpoints, args.kill_at, Path(args.out) / "entries_at_kill")
        else:
            kill_during_write(checkpoints, "last", args.kill_at, Path(args.out) / "killed_at_size")
    trainer = pl.Trainer(
        strategy="bagua",
        accelerator="cpu",
        devices=2,
        max_epochs=args.max_epochs,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last="link" if args.link else True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    trainer.fit(model, ckpt_path="last" if args.resume else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"ckpt_path": trainer.ckpt_path, "loaded": model.loaded, "epoch": trainer.current_epoch}
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
