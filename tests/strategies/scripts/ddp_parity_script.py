"""Three of Lightning's own checkpoint checks, for ``ddp`` and every Bagua algorithm; tests run this under torchrun.

Every case runs in one process pair, one after the other; each rank writes what it saw to ``rank<N>.json``:

* ``saves``: ``torch.save`` calls on this rank while fitting 4 epochs with a checkpoint after each;
* ``mocked_saves``: the same with ``torch.save`` replaced by a mock for the whole fit (a ``save_top_k=2`` checkpoint
  on a logged metric over 2 epochs), or the error that fit raised;
* ``fabric_saved``: on rank 0, the keys and values Fabric's checkpoint IO got from ``fabric.save`` with a filter
  that keeps nothing of the model, the optimizer or a dict, beside a plain ``foo=1``.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader

# Run as a script, the repository root is not on the path yet: the shared cases need it.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.strategies.scripts.cases import EVERY_ALGORITHM

EPOCHS = 4
BATCHES_PER_EPOCH = 2

# name: the algorithm's keywords (None: Lightning's own DDP)
CASES = EVERY_ALGORITHM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_bagua import BaguaStrategy, QAdamOptimizer
    from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy
    from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

    def optimizer_for(case: str, parameters: Any) -> torch.optim.Optimizer:
        return QAdamOptimizer(parameters, lr=0.01, warmup_steps=2) if case == "qadam" else make_optimizer(parameters)

    class Regression(pl.LightningModule):
        def __init__(self, case: str) -> None:
            super().__init__()
            self.net = make_network()
            self.case = case

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # Differs between ranks, as in Lightning's test, so that top-k has something to choose from.
            self.log("my_loss", float(batch_idx * (1 + self.global_rank)), on_epoch=True, sync_dist=True)
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(self.case, self.parameters())

    class CountSaves(Callback):
        """Count ``torch.save`` calls from the start of training to its end."""

        def __init__(self) -> None:
            self.count = 0
            self._original = torch.save

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            def counting(*args: Any, **kwargs: Any) -> None:
                self.count += 1
                self._original(*args, **kwargs)

            torch.save = counting

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            torch.save = self._original

    def trainer_strategy(case: str) -> Any:
        kwargs = CASES[case]
        return DDPStrategy() if kwargs is None else BaguaStrategy(algorithm=case, **kwargs)

    def fit(case: str, callbacks: list[Callback], epochs: int) -> pl.Trainer:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=trainer_strategy(case),
            max_epochs=epochs,
            limit_train_batches=BATCHES_PER_EPOCH,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        trainer.fit(Regression(case), DataLoader(make_dataset(), batch_size=BATCH))
        return trainer

    out = Path(args.out)
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for case in args.cases.split(","):
        directory = out / case
        counter = CountSaves()
        checkpoint = ModelCheckpoint(dirpath=directory / "saves", save_top_k=-1, every_n_epochs=1)
        fit(case, [counter, checkpoint], EPOCHS)
        result: dict[str, Any] = {"saves": counter.count}

        with mock.patch("torch.save") as save:
            try:
                top_k = ModelCheckpoint(dirpath=directory / "top_k", monitor="my_loss", save_top_k=2)
                fit(case, [top_k], 2)
                result["mocked_saves"] = save.call_count
            except Exception as error:  # reported to the test, which names it
                result["mocked_saves"] = f"{type(error).__name__}: {error}"

        kwargs = CASES[case]
        fabric_strategy = FabricDDPStrategy() if kwargs is None else FabricBaguaStrategy(algorithm=case, **kwargs)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy)
        fabric.launch()
        network = make_network()
        model, optimizer = fabric.setup(network, optimizer_for(case, network.parameters()))
        fabric.strategy.checkpoint_io = checkpoint_io = mock.Mock()
        state = {"model": model, "optimizer": optimizer, "anything": {"cocofruit": 1}, "foo": 1}
        fabric.save(directory / "filtered.ckpt", state, filter={key: lambda k, v: False for key in state})
        if rank == 0:
            saved = checkpoint_io.save_checkpoint.call_args.kwargs["checkpoint"]
            result["fabric_saved"] = {key: repr(value) for key, value in saved.items()}
        fabric.barrier()
        if hasattr(model, "_forward_module") and hasattr(fabric.strategy, "teardown"):
            fabric.strategy.teardown()
        results[case] = result
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
