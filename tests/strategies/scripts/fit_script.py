"""Fit a small regression model with BaguaStrategy and save what each rank saw; tests run this as a script.

Lightning's own launcher re-runs this file once per extra local process, exactly as for a user's script, so it
has to work as ``python tests/strategies/scripts/fit_script.py --out DIR ...``. Each rank writes ``DIR/rank{r}.pt``.
"""

import argparse
import importlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 96
FEATURES = 16
BATCH = 4


def make_network(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(1234)
    layers: list[nn.Module] = [nn.Linear(FEATURES, 64), nn.Tanh()]
    if batchnorm:
        layers.append(nn.BatchNorm1d(64))
    layers += [nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1)]
    return nn.Sequential(*layers)


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(99)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def make_optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--package", default="lightning", choices=["lightning", "pytorch_lightning"])
    parser.add_argument("--strategy", default="instance", choices=["instance", "name", "ddp"])
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--kwargs", default="{}", help="algorithm keywords as JSON")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--sync-batchnorm", action="store_true")
    parser.add_argument("--flatten", default="true", choices=["true", "false"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "qadam"])
    parser.add_argument("--val-check-interval", type=int, default=None, help="validate every N training batches")
    # Fault tolerance: epochs of a few batches, checkpoints, resuming, and a rank that kills itself once.
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--limit-train-batches", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default=None, help="ModelCheckpoint(save_last=True) every epoch here")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--timeout", type=float, default=None, help="the strategy's timeout in seconds")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument(
        "--kill-marker", default=None, help="written (time of death) before the kill; none if it exists"
    )
    return parser.parse_args()


def flat_weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([parameter.detach().flatten().cpu() for parameter in module.parameters()])


def main() -> None:
    args = parse_args()
    if args.package == "lightning":
        import lightning.pytorch as pl

        strategy_module = "lightning_bagua.strategies.bagua"
    else:
        import pytorch_lightning as pl

        strategy_module = "lightning_bagua.pytorch_lightning"

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network(args.sync_batchnorm)
            self.automatic_optimization = not args.manual
            self.seen: dict[str, object] = {}

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            if (
                self.global_rank == args.kill_rank
                and self.global_step == args.kill_at_step
                and not Path(args.kill_marker).exists()
            ):
                Path(args.kill_marker).write_text(json.dumps({"rank": self.global_rank, "time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            inputs, targets = batch
            self.local_weights = flat_weights(self)
            loss = nn.functional.mse_loss(self(inputs), targets)
            self.seen["fit_model"] = type(self.trainer.strategy.model).__name__
            if args.manual:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            self.log("train_loss", loss, sync_dist=True)
            return None if args.manual else loss

        def validation_step(self, batch, batch_idx):
            self.seen["validate_model"] = type(self.trainer.strategy.model).__name__
            if batch_idx == 0 and self.trainer.state.fn == "fit":
                # The weights validation sees inside fit, beside the training replica's at the last training batch.
                shown = {"shown": flat_weights(self), "local": self.local_weights}
                self.seen.setdefault("validated_in_fit", []).append(shown)
            self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            if args.optimizer == "qadam":
                from lightning_bagua import QAdamOptimizer

                return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=2)
            return make_optimizer(self.parameters())

    if args.strategy == "name":
        strategy = "bagua"
    elif args.strategy == "ddp":
        # Lightning's own DDP, as the reference for runs whose precision no fp32 reference can match.
        strategy = pl.strategies.DDPStrategy(gradient_as_bucket_view=args.flatten == "true", bucket_cap_mb=10)
    else:
        strategy_cls = importlib.import_module(strategy_module).BaguaStrategy
        timeout = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
        strategy = strategy_cls(
            algorithm=args.algorithm, flatten=args.flatten == "true", **timeout, **json.loads(args.kwargs)
        )

    model = Regression()
    loader = DataLoader(make_dataset(), batch_size=BATCH, shuffle=False)
    callbacks = []
    if args.checkpoint_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, every_n_epochs=1))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        limit_train_batches=args.limit_train_batches,
        callbacks=callbacks,
        accumulate_grad_batches=args.accumulate,
        sync_batchnorm=args.sync_batchnorm,
        limit_val_batches=2,
        val_check_interval=args.val_check_interval,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=args.checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, loader, ckpt_path=args.ckpt_path)
    strategy_obj = trainer.strategy
    counter = getattr(strategy_obj, "communication_counter", None)
    result = {
        "strategy_class": f"{type(strategy_obj).__module__}.{type(strategy_obj).__name__}",
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "bytes_by_op": counter.bytes_by_op if counter is not None else None,
        "calls": counter.calls if counter is not None else None,
        "model_after_fit": type(strategy_obj.model).__name__,
        "seen": dict(model.seen),
        "world_size": trainer.world_size,
        "cluster_environment": type(strategy_obj.cluster_environment).__name__,
        "train_loss": float(trainer.callback_metrics["train_loss"]),
    }
    rank = trainer.global_rank
    if args.strategy != "ddp":  # Lightning's DDPStrategy.reduce does not take every op BaguaStrategy takes
        value = torch.tensor([float(rank + 1)], device=strategy_obj.root_device)
        result["reduce"] = {
            str(op): strategy_obj.reduce(value.clone(), reduce_op=op).item()
            for op in [None, "mean", "avg", "sum", "max", "min", "product"]
        }
        # lightning-bagua 0.1.0 reduced in place: the tensor passed in holds the result and is what comes back.
        in_place = value.clone()
        result["reduce_in_place"] = strategy_obj.reduce(in_place, reduce_op="sum") is in_place and in_place.item()
        result["reduce_unchanged_non_tensor"] = strategy_obj.reduce("text") == "text"
        result["broadcast"] = strategy_obj.broadcast({"from": rank}, src=trainer.world_size - 1)
        strategy_obj.barrier()
        trainer.validate(model, loader, verbose=False)
        result["seen_after_validate"] = dict(model.seen)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
