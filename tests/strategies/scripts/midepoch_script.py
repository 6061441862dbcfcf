"""Fit with checkpoints every few steps and a plain shuffled DataLoader; tests run this under torchrun.

The user's script of issue 34: ``ModelCheckpoint(every_n_train_steps=CHECKPOINT_EVERY, save_last=True)`` and
``trainer.fit(model, loader, ckpt_path="last")``, nothing else for resuming. Every random number generator a
training step can draw from is drawn from: the dataset adds torch noise to each sample it loads, the model has
dropout, and the loss is scaled by draws from Python's ``random`` and NumPy. With ``--kill-at-step``, rank 1
SIGKILLs itself before that step, once (a marker file remembers it); the job is then launched again, unchanged,
and resumes from ``last.ckpt``. Each rank of the launch that finishes writes ``OUT/<case>/rank{r}.pt``: its final
weights, and by epoch the dataset indices its main process loaded and those it trained on.
"""

import argparse
import os
import random
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

SAMPLES = 64
FEATURES = 8
BATCH = 4
EPOCHS = 3
CHECKPOINT_EVERY = 5
# 8 batches per rank and epoch: the last checkpoint before step 13 is step 10, batch 2 of epoch 1.
KILL_AT_STEP = 13
BATCHES_PER_EPOCH = SAMPLES // BATCH // 2

# name: (strategy, algorithm keywords, dataloader workers)
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "gradient_allreduce": ("gradient_allreduce", {}, 0),
    "bytegrad": ("bytegrad", {}, 0),
    # Flat on one node (hierarchical would all-reduce at full precision), compressing from step 2 on.
    "low_rank": ("low_rank", {"hierarchical": False, "warmup_steps": 1}, 0),
    # Workers take their first indices when the iterator is created, before Lightning sets the epoch.
    "gradient_allreduce_workers": ("gradient_allreduce", {}, 2),
    # Lightning's own DDP, which restarts the epoch's data from its first batch: the control.
    "ddp": ("ddp", {}, 0),
}


class NoisyDataset(Dataset):
    """Regression samples, with their index, and noise added as they load; remembers which it loaded.

    In the main process the noise comes from torch's global generator. In a worker process it follows from the
    sample's index: a worker's generator depends on how many samples that worker loaded before, which a resumed
    epoch cannot reproduce (the fault tolerance page of the docs says why).
    """

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(99)
        self.inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True).sin()
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.loaded.append(index)
        if get_worker_info() is None:
            noise = torch.randn(FEATURES)
        else:
            noise = torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))
        return self.inputs[index] + 0.01 * noise, self.targets[index], index


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--kill-at-step", type=int, default=None)
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_bagua import BaguaStrategy

    class Regression(pl.LightningModule):
        def __init__(self, dataset: NoisyDataset, marker: Path, kill_at_step: int | None) -> None:
            super().__init__()
            torch.manual_seed(1234)
            self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
            self.dataset, self.marker, self.kill_at_step = dataset, marker, kill_at_step
            self.loaded_by_epoch: dict[int, list[int]] = {}
            self.trained_by_epoch: dict[int, list[int]] = {}

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.global_rank == 1 and self.global_step == self.kill_at_step and not self.marker.exists():
                self.marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets, indices = batch
            self.trained_by_epoch.setdefault(self.current_epoch, []).extend(indices.tolist())
            scale = 1 + 0.1 * random.random() + 0.1 * float(numpy.random.rand())
            return scale * nn.functional.mse_loss(self.net(inputs), targets)

        def on_train_epoch_end(self) -> None:
            self.loaded_by_epoch[self.current_epoch] = list(self.dataset.loaded)
            self.dataset.loaded.clear()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    out = Path(args.out)
    for case in args.cases.split(","):
        name, kwargs, workers = CASES[case]
        directory = out / case
        directory.mkdir(parents=True, exist_ok=True)
        marker = directory / "killed"
        dataset = NoisyDataset()

        pl.seed_everything(7, verbose=False)
        # A peer that stops answering fails the job within the tests' timeouts, not Lightning's default 30 minutes.
        timeout = timedelta(seconds=60)
        strategy: Any
        if name == "ddp":
            strategy = DDPStrategy(timeout=timeout)
        else:
            strategy = BaguaStrategy(algorithm=name, timeout=timeout, **kwargs)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=EPOCHS,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                ModelCheckpoint(dirpath=directory / "ckpt", every_n_train_steps=CHECKPOINT_EVERY, save_last=True)
            ],
        )
        model = Regression(dataset, marker, args.kill_at_step)
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
        trainer.fit(model, loader, ckpt_path="last")
        result = {
            "state": {key: value.detach().clone() for key, value in model.state_dict().items()},
            "loaded": model.loaded_by_epoch,
            "trained": model.trained_by_epoch,
            "global_step": trainer.global_step,
        }
        torch.save(result, directory / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
