"""A script that catches an error every rank raises inside a run and runs again, for each algorithm in turn.

``python tests/strategies/scripts/recover_script.py --out DIR --framework trainer|fabric [--strategy bagua|ddp]``, with
the repository on PYTHONPATH: the framework's own launcher starts the second process, as in a user's script. For
each algorithm of ``available_algorithms()`` (once, with ``--strategy ddp``, Lightning's own DDP as the
reference) the script runs a fit whose every rank raises ``ValueError`` at batch 2, catches it, and runs a second
fit that must complete. The place of the error cycles through the training step, a callback, the data loader and
validation (the Trainer) or the loop's forward, backward and data (Fabric). After every algorithm it records the
Python threads alive and the number of process groups, so that a test can tell that nothing leaks between runs.
Each rank writes ``DIR/rank{r}.json``.

With ``--only-rank R`` (the Trainer) only rank R raises, for ``gradient_allreduce`` alone: the other rank waits for
it in a collective, so the job must end instead, naming rank R, and nothing is written.
"""

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

FAIL_AT_BATCH = 2
TRAINER_PLACES = ("training_step", "callback", "dataloader", "validation")
FABRIC_PLACES = ("forward", "backward", "dataloader")


class InjectedError(ValueError):
    """The error every rank raises on purpose."""


class FailingDataset(Dataset):
    """The regression data, failing when the sample of batch ``FAIL_AT_BATCH`` is read, when ``fail`` is set."""

    def __init__(self, fail: bool) -> None:
        self.data = make_dataset()
        self.fail = fail

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        # Per rank, the sampler hands indices in order (no shuffling): batch 2 starts at position 2 * BATCH.
        if self.fail and self.reads == FAIL_AT_BATCH * BATCH:
            raise InjectedError(f"dataloader failed at batch {FAIL_AT_BATCH}")
        self.reads += 1
        return self.data[index]

    reads = 0


def algorithm_setup(name: str) -> tuple[dict[str, Any], str]:
    """Return the algorithm's keywords and the optimizer it needs (qadam's own; SGD for the others)."""
    kwargs: dict[str, Any] = {"sync_interval_ms": 5} if name == "async" else {}
    return kwargs, "qadam" if name == "qadam" else "sgd"


def build_optimizer(kind: str, parameters: Any) -> torch.optim.Optimizer:
    if kind == "qadam":
        from lightning_bagua import QAdamOptimizer

        return QAdamOptimizer(parameters, lr=0.01, warmup_steps=2)
    return make_optimizer(parameters)


def resources() -> dict[str, Any]:
    """The Python threads alive (by name) and the number of process groups, the default one included."""
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    return {"threads": sorted(thread.name for thread in threading.enumerate()), "groups": groups}


# --------------------------------------------------------------------------------------------------------- Trainer


def trainer_round(
    name: str, strategy_name: str, place: str, only_rank: int | None = None, marker: Path | None = None
) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_bagua.strategies.bagua import BaguaStrategy

    kwargs, optimizer_kind = algorithm_setup(name)

    class Regression(pl.LightningModule):
        def __init__(self, fail: str | None) -> None:
            super().__init__()
            self.net = make_network()
            self.fail = fail

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.fail == "training_step" and batch_idx == FAIL_AT_BATCH and only_rank in (None, self.global_rank):
                if only_rank is not None and marker is not None:
                    marker.write_text(json.dumps({"time": time.time()}))
                raise InjectedError(f"training_step failed at batch {batch_idx}")
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if self.fail == "validation" and batch_idx == 1:
                raise InjectedError("validation failed at batch 1")
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return build_optimizer(optimizer_kind, self.parameters())

    class FailingCallback(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == FAIL_AT_BATCH:
                raise InjectedError(f"callback failed at batch {batch_idx}")

    def trainer(fail: str | None) -> "pl.Trainer":
        strategy: Any = "ddp" if strategy_name == "ddp" else BaguaStrategy(algorithm=name, **kwargs)
        return pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=1,
            limit_train_batches=5,
            limit_val_batches=2,
            # Validation runs after the fourth batch, so that a failing validation interrupts training.
            val_check_interval=4 if fail == "validation" else None,
            num_sanity_val_steps=0,
            callbacks=[FailingCallback()] if fail == "callback" else [],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    def loader(fail: bool) -> DataLoader:
        return DataLoader(FailingDataset(fail), batch_size=BATCH)

    caught = None
    try:
        trainer(place).fit(Regression(place), loader(place == "dataloader"), loader(False))
    except InjectedError as error:
        caught = str(error)
    second = trainer(None)
    second.fit(Regression(None), loader(False), loader(False))
    validated = second.validate(Regression(None), loader(False), verbose=False)
    return {"caught": caught, "second_fit_steps": second.global_step, "validated": bool(validated)}


# ---------------------------------------------------------------------------------------------------------- Fabric


def fabric_round(name: str, strategy_name: str, place: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_bagua.strategies.fabric import BaguaStrategy

    kwargs, optimizer_kind = algorithm_setup(name)

    def run(fail: str | None) -> int:
        strategy: Any = "ddp" if strategy_name == "ddp" else BaguaStrategy(algorithm=name, **kwargs)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        network = make_network()
        model, optimizer = fabric.setup(network, build_optimizer(optimizer_kind, network.parameters()))
        batches: Iterator = iter(fabric.setup_dataloaders(DataLoader(FailingDataset(fail == "dataloader"), BATCH)))
        steps = 0
        try:
            for batch_idx, (inputs, targets) in enumerate(batches):
                if batch_idx == 5:
                    break
                loss = nn.functional.mse_loss(model(inputs), targets)
                if fail == "forward" and batch_idx == FAIL_AT_BATCH:
                    raise InjectedError(f"forward failed at batch {batch_idx}")
                fabric.backward(loss)
                if fail == "backward" and batch_idx == FAIL_AT_BATCH:
                    raise InjectedError(f"backward failed at batch {batch_idx}")
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
        finally:
            # What ends a Fabric run, failed or not: Fabric has no end of run at which it would do it itself.
            fabric.strategy.teardown()
        return steps

    caught = None
    try:
        run(place)
    except InjectedError as error:
        caught = str(error)
    return {"caught": caught, "second_fit_steps": run(None), "validated": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--framework", choices=["trainer", "fabric"], required=True)
    parser.add_argument("--strategy", choices=["bagua", "ddp"], default="bagua")
    parser.add_argument("--devices", type=int, choices=[2], default=2, help="the job's processes (two)")
    parser.add_argument("--only-rank", type=int, default=None, help="only this rank raises (the Trainer)")
    parser.add_argument("--marker", type=Path, default=None, help="--only-rank writes the time it raises here")
    args = parser.parse_args()
    if args.only_rank is not None:
        trainer_round("gradient_allreduce", "bagua", "training_step", args.only_rank, args.marker)
        trainer_round("gradient_allreduce", "bagua", "training_step", args.only_rank, args.marker)
        return  # never reached: the job ends at the first error

    from lightning_bagua.engine import available_algorithms

    names = ["ddp"] if args.strategy == "ddp" else available_algorithms()
    places = TRAINER_PLACES if args.framework == "trainer" else FABRIC_PLACES
    round_fn = trainer_round if args.framework == "trainer" else fabric_round
    rounds = []
    for index, name in enumerate(names):
        place = places[index % len(places)]
        outcome = round_fn(name, args.strategy, place)
        rounds.append({"algorithm": name, "place": place, **outcome, **resources()})
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
