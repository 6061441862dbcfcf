"""Run one misconfigured fit with BaguaStrategy; ``tests/test_bad_inputs.py`` runs it and reads the error.

``python tests/strategies/scripts/bad_input_script.py CASE --out DIR``: nothing may be written to ``DIR`` unless the fit
succeeds, so a test can tell that a failure left nothing half-written.
"""

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

CASES = ("params_differ_between_ranks", "port_in_use", "unreachable_master")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()

    import lightning.pytorch as pl

    from lightning_bagua import BaguaStrategy
    from tests.strategies.scripts.fit_script import BATCH, FEATURES, make_dataset

    class Regression(pl.LightningModule):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # Short enough for the unreachable address to fail fast, long enough for a loaded machine to start 2 processes.
    strategy_kwargs: dict = {"timeout": timedelta(seconds=10 if args.case == "unreachable_master" else 60)}
    # Lightning's launcher hands each process its rank in LOCAL_RANK; the others start as rank 0.
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    hidden = 8 + rank if args.case == "params_differ_between_ranks" else 8
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=BaguaStrategy(**strategy_kwargs),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(hidden)
    trainer.fit(model, DataLoader(make_dataset(), batch_size=BATCH))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
