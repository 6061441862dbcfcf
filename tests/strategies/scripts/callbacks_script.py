"""Fit every algorithm with Lightning's own weight-touching callbacks; tests run this under torchrun.

Cases are ``{callbacks}-{algorithm}``. ``--phase full`` fits each case, saving a checkpoint after every epoch
(and, in the ``swa`` set, after every training step too), and writes each rank's final weights, the bytes the
engine communicated and what the callbacks did. ``--phase resume`` (in new processes) resumes the cases that save
from a checkpoint of the first run (see ``RESUME_FROM``). Every case of a phase runs in one process pair, one
Trainer each.

Callback sets:

* ``swa``: ``StochasticWeightAveraging`` on a network with batch norm (so SWA adds its forward-only epoch that
  recomputes the batch-norm statistics), ``ModelCheckpoint`` every epoch and every training step,
  ``EarlyStopping`` and ``LearningRateMonitor``, with validation inside fit.
* ``ema``: ``EMAWeightAveraging`` (which swaps the averaged weights in for validation and into checkpoints) and
  ``ModelCheckpoint`` every epoch; only where Lightning has that callback (newer than the supported floor).
* ``pruning``: ``ModelPruning`` (reparametrises the weights after wrapping). Fit only: a pruned checkpoint is
  made permanent, so a resumed run cannot continue the uninterrupted one's hidden pruned values.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

EPOCHS = 3
BATCHES_PER_EPOCH = 2
QADAM_WARMUP_STEPS = 3
ALGORITHMS = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "low_rank",
    "qadam",
    "async",
    "diloco",
)
# One node: low_precision_decentralized's and low_rank's default hierarchical=True would reduce the node at full
# precision, as Bagua does; flat, they run their compressed exchanges.
KEYWORDS: dict[str, dict] = {
    "async": {"sync_interval_ms": 5},
    "low_precision_decentralized": {"hierarchical": False},
    "low_rank": {"hierarchical": False, "warmup_steps": 1},
    # Two fragments syncing at steps 1, 4, 7 and 3, 6, each merged a step later: an exchange is in flight across
    # the epoch ends at steps 4 and 6 (and the checkpoints there), and no run ends with both fragments just merged.
    "diloco": {"hierarchical": False, "sync_every": 3, "fragments": 2, "fragment_sync_delay": 1},
}


def lightning_has_ema() -> bool:
    """Whether the installed Lightning has ``EMAWeightAveraging`` (Lightning 2.2, the floor, does not)."""
    import lightning.pytorch.callbacks

    return hasattr(lightning.pytorch.callbacks, "EMAWeightAveraging")


CALLBACK_SETS = ("swa", "ema", "pruning") if lightning_has_ema() else ("swa", "pruning")
# The checkpoint each resumable set resumes from: SWA's after its first averaging epoch, so that its averaged
# model (per rank where the ranks' weights differ) is part of what resumes.
RESUME_FROM = {
    name: file for name, file in {"swa": "epoch=1.ckpt", "ema": "epoch=0.ckpt"}.items() if name in CALLBACK_SETS
}
CASES = [f"{callbacks}-{algorithm}" for callbacks in CALLBACK_SETS for algorithm in ALGORITHMS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", required=True, choices=["full", "resume"])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import (
        Callback,
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ModelPruning,
        StochasticWeightAveraging,
    )
    from lightning.pytorch.loggers import CSVLogger

    from lightning_bagua import BaguaStrategy, QAdamOptimizer
    from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

    class Regression(pl.LightningModule):
        def __init__(self, optimizer: str, batchnorm: bool) -> None:
            super().__init__()
            self.net = make_network(batchnorm)
            self.optimizer_name = optimizer

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.mse_loss(self.net(inputs), targets)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self) -> Any:
            if self.optimizer_name == "qadam":
                optimizer: torch.optim.Optimizer = QAdamOptimizer(
                    self.parameters(), lr=0.01, warmup_steps=QADAM_WARMUP_STEPS
                )
            else:
                optimizer = make_optimizer(self.parameters())
            # A scheduler for LearningRateMonitor to report (and for SWA to swap for its own).
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": scheduler}

    class Record(Callback):
        """Keep what the engine did, at the end of fitting, while the model is still wrapped."""

        def __init__(self) -> None:
            self.bytes_by_op: dict[str, int] = {}
            self.algorithm_state: dict[str, Any] = {}

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.bytes_by_op = dict(trainer.strategy.model.communication_counter.bytes_by_op)
            self.algorithm_state = trainer.strategy.model.bagua_state_dict()

    out = Path(args.out)
    for case in args.cases.split(","):
        callback_set, algorithm = case.split("-")
        if args.phase == "resume" and callback_set not in RESUME_FROM:
            continue
        directory = out / case
        saves = directory / args.phase  # each phase's own checkpoints
        record = Record()
        monitor = LearningRateMonitor(logging_interval="step")
        callbacks: list[Callback] = [
            record,
            ModelCheckpoint(dirpath=saves, filename="{epoch}", save_top_k=-1, every_n_epochs=1),
        ]
        if callback_set == "swa":
            callbacks += [
                StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
                # Mid-epoch saves, between every two training steps.
                ModelCheckpoint(dirpath=saves / "steps", filename="{step}", save_top_k=-1, every_n_train_steps=1),
                EarlyStopping(monitor="val_loss", patience=100),
                monitor,
            ]
        elif callback_set == "ema":
            from lightning.pytorch.callbacks import EMAWeightAveraging

            callbacks.append(EMAWeightAveraging(decay=0.5))
        else:
            callbacks.append(ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=BaguaStrategy(algorithm=algorithm, **KEYWORDS.get(algorithm, {})),
            max_epochs=EPOCHS,
            limit_train_batches=BATCHES_PER_EPOCH,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            logger=CSVLogger(directory / args.phase),
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        model = Regression("qadam" if algorithm == "qadam" else "sgd", batchnorm=callback_set == "swa")
        loader = DataLoader(make_dataset(), batch_size=BATCH, shuffle=False)
        ckpt_path = directory / "full" / RESUME_FROM[callback_set] if args.phase == "resume" else None
        trainer.fit(model, loader, loader, ckpt_path=ckpt_path)
        result = {
            "state": {key: value.detach().clone() for key, value in model.state_dict().items()},
            "bytes_by_op": record.bytes_by_op,
            "algorithm_state": record.algorithm_state,
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "lrs": {key: float(value) for key, value in monitor.lrs.items() for value in value[-1:]},
            "step_checkpoints": sorted(path.name for path in (saves / "steps").glob("*.ckpt")),
        }
        torch.save(result, directory / f"{args.phase}_rank{trainer.global_rank}.pt")
    (out / f"{args.phase}_cases.json").write_text(json.dumps(args.cases.split(",")))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
