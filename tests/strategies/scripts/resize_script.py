"""Fit on 2 processes, then resume the checkpoint on another number; tests run this under torchrun.

``--phase save`` (2 processes) fits every case for ``SAVED_EPOCHS`` epochs with an epoch-end
``ModelCheckpoint(save_last=True)``. ``--phase resume`` (on any number of processes) resumes each case from its
``last.ckpt`` to ``EPOCHS`` epochs, recording each rank's weights and algorithm state when training starts and its
weights at the end; for the synchronous algorithms (and ``ddp``) it also fits the reference: a run at the new size
from the checkpoint's weights and optimizer state (``low_rank`` also from its residuals split by the documented rule,
computed here on its own), for ``EPOCHS - SAVED_EPOCHS`` epochs. Under Fabric, ``FABRIC_CASES`` are saved after
four steps on 2 processes and loaded at the new size. One process group runs every case in turn.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

# Run as a script, the repository root is not on the path yet: the shared cases need it.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from lightning_bagua.engine.algorithms.auto import AutoFigures
from tests.strategies.scripts.cases import EVERY_ALGORITHM

SAVED_EPOCHS = 2
EPOCHS = 4
BATCHES_PER_EPOCH = 2
QADAM_WARMUP_STEPS = 6  # steps 1-5 warm up: the resumed run (from step 4) crosses the switch to compression

CASES: dict[str, dict[str, Any] | None] = {
    **EVERY_ALGORITHM,
    "async": {"sync_interval_ms": 5, "warmup_steps": 1},
    # Synced at step 3 and saved at step 4: the replicas differ, and θ_outer has taken an outer step.
    "diloco": {"sync_every": 3, "hierarchical": False},
    # Step times given in place of measurements: the pick (low_rank) is made at once, on every layout alike.
    "auto": {
        "figures": AutoFigures(
            step_s={
                "gradient_allreduce": 0.010,
                "bytegrad(hierarchical=False)": 0.009,
                "low_rank(rank=16, hierarchical=False)": 0.005,
            }
        )
    },
}
FABRIC_CASES = ("low_rank", "decentralized")
SYNCHRONOUS = ("ddp", "gradient_allreduce", "bytegrad", "low_rank", "qadam")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", required=True, choices=["save", "resume"])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_bagua import BaguaStrategy, QAdamOptimizer
    from lightning_bagua.engine import BaguaDistributedDataParallel
    from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])

    class Regression(pl.LightningModule):
        def __init__(self, case: str, optimizer_state: dict[str, Any] | None = None) -> None:
            super().__init__()
            self.net = make_network()
            self.case = case
            self.optimizer_state = optimizer_state

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.case == "qadam":
                optimizer = QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=QADAM_WARMUP_STEPS)
            else:
                optimizer = make_optimizer(self.parameters())
            if self.optimizer_state is not None:
                optimizer.load_state_dict(self.optimizer_state)
            return optimizer

    def weights(module: nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in module.state_dict().items()}

    class RecordStart(Callback):
        """Keep the weights and the algorithm state training starts from, after the checkpoint is restored."""

        def __init__(self, algorithm_state: dict[str, Any] | None = None) -> None:
            self.algorithm_state = algorithm_state  # the reference's, loaded here
            self.start: dict[str, Any] = {}

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            wrapped = trainer.strategy.model
            if isinstance(wrapped, BaguaDistributedDataParallel):
                if self.algorithm_state is not None:
                    wrapped.load_bagua_state_dict(self.algorithm_state)
                self.start["algorithm_state"] = wrapped.bagua_state_dict()
            self.start["weights"] = weights(pl_module)

    def fit(case: str, epochs: int, callbacks: list[Callback], model: Regression, ckpt_path: Path | None) -> pl.Trainer:
        kwargs = CASES[case]
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=DDPStrategy() if kwargs is None else BaguaStrategy(algorithm=case, **kwargs),
            max_epochs=epochs,
            limit_train_batches=BATCHES_PER_EPOCH,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        # Not shuffled, whatever the epoch: the resumed epochs and the reference's see the same batches on the same
        # ranks (the framework keeps a DistributedSampler it is given).
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        trainer.fit(model, DataLoader(dataset, batch_size=BATCH, sampler=sampler), ckpt_path=ckpt_path)
        return trainer

    def fabric_case(algorithm: str, path: Path, save: bool) -> dict[str, Any]:
        # Fabric's save and load: four steps on 2 processes and a save, or a load at this size.
        from lightning.fabric import Fabric

        from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy

        fabric = Fabric(
            accelerator="cpu", devices=world_size, strategy=FabricBaguaStrategy(algorithm, **CASES[algorithm])
        )
        fabric.launch()
        network = make_network()
        model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
        state = {"model": model, "optimizer": optimizer}
        if save:
            inputs, targets = make_dataset().tensors
            for step in range(4):
                rows = slice(BATCH * (2 * step + rank), BATCH * (2 * step + rank + 1))
                fabric.backward(nn.functional.mse_loss(model(inputs[rows]), targets[rows]))
                optimizer.step()
                optimizer.zero_grad()
            fabric.save(path, state)
            return {}
        fabric.load(path, state)
        return {"weights": weights(model.module), "algorithm_state": model._forward_module.bagua_state_dict()}

    out = Path(args.out)
    results: dict[str, Any] = {}
    for algorithm in FABRIC_CASES:
        path = out / f"fabric_{algorithm}.ckpt"
        result = fabric_case(algorithm, path, save=args.phase == "save")
        if result:
            results[f"fabric_{algorithm}"] = result
    for case in args.cases.split(","):
        directory = out / case
        if args.phase == "save":
            fit(case, SAVED_EPOCHS, [ModelCheckpoint(dirpath=directory, save_last=True)], Regression(case), None)
            continue
        checkpoint_path = directory / "last.ckpt"
        record = RecordStart()
        model = Regression(case)
        trainer = fit(case, EPOCHS, [record], model, checkpoint_path)
        result: dict[str, Any] = {**record.start, "final": weights(model), "global_step": trainer.global_step}
        if case == "auto":
            decision = trainer.strategy.auto_decision
            result["auto_pick"] = None if decision is None else decision.to_dict()
        if case in SYNCHRONOUS:
            checkpoint = torch.load(checkpoint_path, weights_only=False)
            reference = Regression(case, optimizer_state=checkpoint["optimizer_states"][0])
            reference.load_state_dict(checkpoint["state_dict"])
            record = RecordStart(_split_residuals(checkpoint, world_size) if case == "low_rank" else None)
            fit(case, EPOCHS - SAVED_EPOCHS, [record], reference, None)
            result["reference_final"] = weights(reference)
        results[case] = result
    if args.phase == "resume":
        torch.save(results, out / f"resumed_{world_size}_rank{rank}.pt")


def _split_residuals(checkpoint: dict[str, Any], world_size: int) -> dict[str, Any]:
    # low_rank's rule, written out on its own: steps and factors kept, the summed residual split evenly.
    saved = [state["state"] for state in checkpoint["bagua"]["modules"]["model"]["algorithm_states"]]
    errors = {name: sum(state["errors"][name] for state in saved) / world_size for name in saved[0]["errors"]}
    state = {"steps": saved[0]["steps"], "errors": errors, "factors": saved[0]["factors"]}
    return {"algorithm": "low_rank", "state": state, "bucket_layout": []}


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
