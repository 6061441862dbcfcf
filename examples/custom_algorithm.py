"""Write your own algorithm: local SGD, which averages the weights every ``period`` optimizer steps.

Between two averages every process trains on its own, so the processes hold different weights; the algorithm says
so (``ranks_hold_different_weights = True``), and the strategies then checkpoint and resume every process's own
weights and optimizer state. Registering it makes ``BaguaStrategy(algorithm="local_sgd", period=4)`` work under
the Trainer and Fabric.

Run it on two CPU processes (Lightning starts the second one)::

    python examples/custom_algorithm.py --devices 2 --period 4
"""

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_bagua.engine.algorithms import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    check_optimizers_cover,
    check_positive_int,
    check_state_keys,
    group_by_dtype,
    register_algorithm,
)


def keep_local_gradients(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hand a bucket back to DDP's reducer untouched: gradients stay local, nothing is communicated.

    Args:
        state: unused.
        bucket: the bucket the reducer hands over.

    Returns:
        A completed future of the bucket's own gradients.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class LocalSGDImpl(AlgorithmImpl):
    """:class:`LocalSGDAlgorithm` bound to one wrapped model."""

    def __init__(self, algorithm: "LocalSGDAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.period = algorithm.period
        self.steps = 0
        # One flat buffer per dtype: one all-reduce each, instead of one per parameter.
        self.weights = group_by_dtype([parameter for _, parameter in context.named_parameters])
        self.handles: list[RemovableHandle] = []

    def communication_hook(self) -> tuple[Any, Any]:
        """Return no state and :func:`keep_local_gradients`."""
        return None, keep_local_gradients

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Average after every ``period``-th step of the optimizers, which must update every parameter.

        Args:
            optimizers: the optimizers that update the model.
        """
        if optimizers:
            check_optimizers_cover(self.algorithm.name, self.context.named_parameters, optimizers)
        self.close()
        self.handles = [optimizer.register_step_post_hook(self.after_step) for optimizer in optimizers]

    def after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Count the step; on every ``period``-th, replace each process's weights by the average of all."""
        self.steps += 1
        if self.steps % self.period:
            return
        groups = self.context.groups
        for weights in self.weights:
            flat = weights.gather()
            self.context.counter.record("all_reduce", flat)  # what telemetry and communication_counter report
            dist.all_reduce(flat, group=groups.flat)
            weights.scatter(flat.div_(groups.world_size))

    def state_dict(self) -> dict[str, Any]:
        """Return where in the period this process is: the steps taken so far."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count, so that a resumed run averages at the same steps as an uninterrupted one."""
        check_state_keys(self.algorithm.name, state, {"steps": int})
        self.steps = state["steps"]

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


@register_algorithm("local_sgd")
class LocalSGDAlgorithm(Algorithm):
    """Local SGD: train on each process alone and average the weights every ``period`` optimizer steps.

    Args:
        period: optimizer steps between two averages.
    """

    ranks_hold_different_weights = True
    communicates_gradient_buckets = False  # autotuning the bucket size would change nothing
    impl_class = LocalSGDImpl

    def __init__(self, *, period: int = 4) -> None:
        check_positive_int(self.name, "period", period)
        self.period = period


def main() -> None:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bagua import BaguaStrategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--max-epochs", type=int, default=3)
    args = parser.parse_args()

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=BaguaStrategy(algorithm="local_sgd", period=args.period),
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=16))
    if trainer.is_global_zero:
        print(f"train_loss={float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
