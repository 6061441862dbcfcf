"""Fit the regression model of fit_script.py with telemetry and/or autotuning, logging to a CSVLogger.

Run as ``python tests/strategies/scripts/telemetry_fit_script.py --out DIR [--telemetry] [--max-steps N]``; autotuning
follows ``BAGUA_AUTOTUNE`` as a user's run would. Rank 0's logger writes ``DIR/csv/version_0/metrics.csv``; each
rank writes ``DIR/rank{r}.pt``.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--telemetry", action="store_true")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_bagua import BaguaStrategy
    from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network()

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    strategy = BaguaStrategy(telemetry=args.telemetry)
    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=CSVLogger(args.out, name="csv", version=0),
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_dataset(), batch_size=BATCH, shuffle=False))
    tuner = strategy.autotuner
    result = {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "telemetry_after_fit": strategy.telemetry,
        "decision": None if tuner is None else tuner.decision,
        "measurements": None if tuner is None else tuner.measurements,
        "bytes_by_op": strategy.communication_counter.bytes_by_op,
    }
    torch.save(result, Path(args.out) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
