"""Fit with a load-balancing sampler (or batch sampler) under BaguaStrategy; each rank saves what it was given.

Run as ``python tests/data/scripts/fit_sampler_script.py --out DIR --mode sampler|batch_sampler``; Lightning's launcher
re-runs it for the second process. The samplers are built here without ``num_replicas``/``rank``, before any process
group exists, so the strategy has to fill those in. Each rank writes ``DIR/rank{r}.pt``.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SAMPLES = 45  # odd, so that two ranks need padding
FEATURES = 4
BATCH = 4
TOKEN_BUDGET = 60
EPOCHS = 3
SEED = 7


class IndexedDataset(Dataset):
    """Samples with a skewed "length" (the complexity); each sample carries its index so ranks can report it."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(5)
        self.inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.lengths = (torch.rand(SAMPLES, generator=generator) ** 3 * 40 + 1).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.inputs[index], self.lengths[index], index


def complexity(sample: tuple[torch.Tensor, torch.Tensor, int]) -> int:
    return int(sample[1])


def make_batch_fn(dataset: IndexedDataset):
    def batch_fn(indices: list[int]) -> list[list[int]]:
        """Pack consecutive indices into batches of at most TOKEN_BUDGET total length."""
        batches: list[list[int]] = []
        current: list[int] = []
        used = 0
        for index in indices:
            length = int(dataset.lengths[index])
            if current and used + length > TOKEN_BUDGET:
                batches.append(current)
                current, used = [], 0
            current.append(index)
            used += length
        if current:
            batches.append(current)
        return batches

    return batch_fn


def make_network() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def loss_of(network: nn.Module, inputs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(network(inputs).squeeze(1), lengths.float().log())


def make_optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=0.01, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["sampler", "batch_sampler"], required=True)
    parser.add_argument("--use-distributed-sampler", choices=["true", "false"], default="true")
    args = parser.parse_args()

    import lightning.pytorch as pl

    from lightning_bagua import (
        BaguaStrategy,
        LoadBalancingDistributedBatchSampler,
        LoadBalancingDistributedSampler,
        fuse_optimizer,
    )

    class RecordingSampler(LoadBalancingDistributedSampler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.set_epoch_calls: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.set_epoch_calls.append(epoch)
            super().set_epoch(epoch)

    dataset = IndexedDataset()
    sampler = RecordingSampler(dataset, complexity, shuffle=True, seed=SEED, random_level=0.2)
    if args.mode == "sampler":
        loader = DataLoader(dataset, sampler=sampler, batch_size=BATCH)
        strategy = BaguaStrategy()
        use_distributed_sampler = True  # Lightning's default: it must still keep our sampler
    else:
        batch_sampler = LoadBalancingDistributedBatchSampler(sampler, make_batch_fn(dataset))
        loader = DataLoader(dataset, batch_sampler=batch_sampler)
        # flatten=False, as fuse_optimizer wants (the gradients stay out of the communication buckets).
        strategy = BaguaStrategy(flatten=False)
        # With Lightning's default, the Trainer rebuilds the batch sampler around its own DistributedSampler
        # (it decides by `loader.sampler`, a SequentialSampler here); ours must survive that rebuild.
        use_distributed_sampler = args.use_distributed_sampler == "true"

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network()
            self.seen: dict[int, list[list[int]]] = {}
            self.fuse_steps = 0

        def training_step(self, batch, batch_idx):
            inputs, lengths, indices = batch
            self.seen.setdefault(self.current_epoch, []).append(indices.tolist())
            return loss_of(self.net, inputs, lengths)

        def configure_optimizers(self):
            optimizer = make_optimizer(self.parameters())
            if args.mode == "batch_sampler":
                fuse_optimizer(optimizer)
                fuse_step = optimizer.fuse_step

                def counting_fuse_step(closure=None):
                    self.fuse_steps += 1
                    return fuse_step(closure)

                optimizer.step = counting_fuse_step  # the documented recipe: Lightning's step runs fuse_step
            return optimizer

    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=EPOCHS,
        use_distributed_sampler=use_distributed_sampler,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    train_loader = trainer.train_dataloader
    if args.mode == "sampler":
        kept = train_loader.sampler is sampler
    else:
        used = train_loader.batch_sampler
        kept = isinstance(used, LoadBalancingDistributedBatchSampler) and used.sampler is sampler
    result = {
        "rank": trainer.global_rank,
        "seen": model.seen,
        "set_epoch_calls": sampler.set_epoch_calls,
        "kept": kept,
        "loader_kept": train_loader is loader,
        "num_replicas": sampler.num_replicas,
        "sampler_rank": sampler.rank,
        "filled_by_strategy": sampler._filled,
        "fuse_steps": model.fuse_steps,
        "global_step": trainer.global_step,
        "state": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
