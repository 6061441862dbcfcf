"""A training script written against lightning-bagua 0.1.0's README and tests, unchanged but for CPU devices.

Run as ``python tests/compat/scripts/script_0_1_0.py ALGORITHM OUT_FILE``; Lightning's launcher re-runs it for
the second process. Rank 0 writes the parameters' norms to ``OUT_FILE``.
"""

import sys

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_bagua import QAdamOptimizer
from lightning_bagua.strategy import BaguaStrategy


class BoringModel4QAdam(BoringModel):
    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = QAdamOptimizer(self.layer.parameters(), lr=0.05, warmup_steps=20)
        lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return [optimizer], [lr_scheduler]


def main() -> None:
    algorithm, out = sys.argv[1], sys.argv[2]
    if algorithm == "qadam":
        model: BoringModel = BoringModel4QAdam()
        strategy = BaguaStrategy(algorithm="qadam")
    else:
        model = BoringModel()
        strategy = BaguaStrategy(algorithm="async", sync_interval_ms=100)
    trainer = Trainer(
        default_root_dir=out + ".d",
        fast_dev_run=2,
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save([float(torch.norm(param)) for param in model.parameters()], out)


if __name__ == "__main__":
    main()
