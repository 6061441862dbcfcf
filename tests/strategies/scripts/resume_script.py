"""Fit, checkpoint and resume every algorithm with BaguaStrategy; tests run this under torchrun.

``--phase full`` fits each case for ``EPOCHS`` epochs, saving a checkpoint after every epoch, and writes each
rank's final weights and algorithm state. ``--phase resume`` (in new processes) resumes each case from its
checkpoint after the first epoch and writes the same. Both phases run every case in one process pair, one
Trainer each, so that the test pays the start-up cost twice rather than twice per algorithm.
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
QADAM_WARMUP_STEPS = 4  # steps 1-3 warm up, so a resume after epoch 1 (step 2) crosses the switch to compression

# name: (algorithm, keywords, optimizer, average_before_save)
CASES: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd", False),
    "bytegrad": ("bytegrad", {}, "sgd", False),
    # Several buckets: the resumed wrapper's all-in-one first bucket must be cut as the uninterrupted run's were.
    "bytegrad_small_buckets": ("bytegrad", {"bucket_cap_mb": 0.004}, "sgd", False),
    "decentralized_all": ("decentralized", {"peer_selection_mode": "all"}, "sgd", False),
    # Every third pass exchanges, so the resumed run must know where in the interval it stopped.
    "decentralized_shift_one": (
        "decentralized",
        {"peer_selection_mode": "shift_one", "communication_interval": 3, "hierarchical": False},
        "sgd",
        False,
    ),
    "decentralized_averaged": ("decentralized", {}, "sgd", True),
    # One node: hierarchical=True would average the node at full precision (as Bagua does); the ring runs flat.
    "low_precision_decentralized": ("low_precision_decentralized", {"hierarchical": False}, "sgd", False),
    "qadam": ("qadam", {}, "qadam", False),
    # Flat on one node (hierarchical would all-reduce at full precision), compressing from step 2 on; several buckets,
    # so the resumed wrapper's all-in-one first bucket differs from the saved run's (the math is per tensor).
    "low_rank": ("low_rank", {"hierarchical": False, "warmup_steps": 1, "bucket_cap_mb": 0.004}, "sgd", False),
    # Shuffled data, validated at each epoch's last batch, where the checkpoint is written: resuming, Lightning sets
    # the finished epoch again before the next one, whose shuffle and generator draws must be the undisturbed run's.
    "shuffled_validated_at_last_batch": ("gradient_allreduce", {}, "sgd", False),
}
VALIDATED_AT_LAST_BATCH = {"shuffled_validated_at_last_batch"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", required=True, choices=["full", "resume"])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_bagua import BaguaStrategy, QAdamOptimizer
    from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

    class Regression(pl.LightningModule):
        def __init__(self, optimizer: str) -> None:
            super().__init__()
            self.net = make_network()
            self.optimizer_name = optimizer

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.mse_loss(self.net(inputs), targets)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.optimizer_name == "qadam":
                return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=QADAM_WARMUP_STEPS)
            return make_optimizer(self.parameters())

    class RecordAlgorithmState(Callback):
        """Keep the algorithm's state at the end of fitting, while the model is still wrapped."""

        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.state = trainer.strategy.model.bagua_state_dict()

    out = Path(args.out)
    for case in args.cases.split(","):
        algorithm, kwargs, optimizer, average = CASES[case]
        directory = out / case
        record = RecordAlgorithmState()
        callbacks: list[Callback] = [record]
        if args.phase == "full":
            callbacks.append(ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
        validated = case in VALIDATED_AT_LAST_BATCH
        validation = {"val_check_interval": BATCHES_PER_EPOCH, "check_val_every_n_epoch": None} if validated else {}
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=BaguaStrategy(algorithm=algorithm, average_before_save=average, **kwargs),
            max_epochs=EPOCHS,
            limit_train_batches=BATCHES_PER_EPOCH,
            limit_val_batches=1 if validated else 0,
            num_sanity_val_steps=0,
            **validation,
            logger=False,
            enable_checkpointing=args.phase == "full",
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        model = Regression(optimizer)
        loader = DataLoader(make_dataset(), batch_size=BATCH, shuffle=validated)
        ckpt_path = directory / "epoch=0.ckpt" if args.phase == "resume" else None
        trainer.fit(model, loader, loader if validated else None, ckpt_path=ckpt_path)
        result = {
            # The next draws of the global generator: equal if the resumed run drew what the undisturbed one did.
            "next_draws": torch.rand(4),
            "state": {key: value.detach().clone() for key, value in model.state_dict().items()},
            "algorithm_state": record.state,
            "global_step": trainer.global_step,
        }
        if args.phase == "resume" and average:
            # Evaluation reads the checkpoint's top-level weights: here the average of the ranks'.
            trainer.validate(model, loader, ckpt_path=directory / "epoch=0.ckpt", verbose=False)
            result["validated_state"] = {key: value.detach().clone() for key, value in model.state_dict().items()}
        torch.save(result, directory / f"{args.phase}_rank{trainer.global_rank}.pt")
    (out / f"{args.phase}_cases.json").write_text(json.dumps(args.cases.split(",")))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
