"""Train a small MLP on scikit-learn's digits data set with one of Bagua's algorithms.

Run it as it is; Lightning starts the extra processes itself::

    python examples/train.py --devices 2 --accelerator cpu --algorithm gradient_allreduce

The digits data set ships with scikit-learn, so nothing is downloaded. The script prints the test accuracy it
reached; ``make demo`` runs it on two CPU processes, and tests/test_examples.py checks it reaches at least 90%.
"""

import argparse
import json
import sys
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from lightning.pytorch import LightningModule, Trainer, seed_everything
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bagua import BaguaStrategy, QAdamOptimizer

__all__ = ["DigitsClassifier", "load_data", "main", "parse_args"]

# Fixed independently of --seed, so runs with different seeds are scored on the same held-out images.
_SPLIT_SEED = 0
_TEST_FRACTION = 0.2


class DigitsClassifier(LightningModule):
    """A two-layer perceptron for 8x8 digit images, flattened to 64 features.

    Args:
        lr: Learning rate of the optimizer.
        hidden: Width of the hidden layer.
        optimizer: ``"adam"`` for torch's Adam, or ``"qadam"`` for :class:`~lightning_bagua.QAdamOptimizer` (the
            optimizer the ``qadam`` algorithm requires), which switches from warm-up to compressed momentum after
            its default ``warmup_steps``.
    """

    def __init__(self, lr: float, hidden: int = 128, optimizer: str = "adam") -> None:
        super().__init__()
        if optimizer not in ("adam", "qadam"):
            raise ValueError(f"Unknown optimizer {optimizer!r}: choose 'adam' or 'qadam'.")
        self.lr = lr
        self.optimizer = optimizer
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        # Lightning weights each batch by its size within a rank, and sync_dist averages the ranks, which hold equally
        # many test samples (the distributed sampler pads the shorter ones by repeating samples).
        self.log("test_acc", accuracy, sync_dist=True, batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "qadam":
            return QAdamOptimizer(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """Split the digits data set into standardised train and test sets.

    Returns:
        The training and the test set, as ``(features, label)`` tensor data sets.
    """
    features, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=_TEST_FRACTION, random_state=_SPLIT_SEED, stratify=labels
    )
    # Fit the scaler on the training images only, so no statistics of the test images leak into training.
    scaler = StandardScaler().fit(x_train)

    def to_dataset(x: object, y: object) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))

    return to_dataset(scaler.transform(x_train), y_train), to_dataset(scaler.transform(x_test), y_test)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: The arguments, without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="gradient_allreduce", help="Bagua algorithm (default: %(default)s)")
    parser.add_argument(
        "--algorithm-kwargs",
        type=json.loads,
        default={},
        help="the algorithm's keywords as JSON, e.g. '{\"hierarchical\": false}' (default: none)",
    )
    parser.add_argument("--devices", type=int, default=2, help="processes per node (default: %(default)s)")
    parser.add_argument(
        "--accelerator", default="cpu", choices=["cpu", "gpu", "cuda"], help="device type (default: %(default)s)"
    )
    parser.add_argument("--max-epochs", type=int, default=10, help="training epochs (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process (default: %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="learning rate of Adam (QAdam for qadam) (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=42, help="seed for weights and shuffling (default: %(default)s)")
    parser.add_argument(
        "--precision", default="32-true", help="Lightning precision, e.g. 32-true or bf16-mixed (default: %(default)s)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> float:
    """Train, test and report the test accuracy.

    Args:
        argv: The arguments, without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The test accuracy, the same on every rank.
    """
    args = parse_args(argv)
    # The data sit in memory already; loader worker processes would only add start-up time.
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    seed_everything(args.seed, workers=True)

    train_set, test_set = load_data()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)

    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=BaguaStrategy(algorithm=args.algorithm, **args.algorithm_kwargs),
        precision=args.precision,
        max_epochs=args.max_epochs,
        # The example keeps nothing: no checkpoints or log files appear in the working directory.
        logger=False,
        enable_checkpointing=False,
        deterministic=True,
        # A live progress bar only helps on a terminal; in CI logs and pipes it turns into pages of carriage returns.
        enable_progress_bar=sys.stdout.isatty(),
    )
    # The qadam algorithm runs only with its own optimizer; every other algorithm trains with Adam.
    model = DigitsClassifier(lr=args.lr, optimizer="qadam" if args.algorithm == "qadam" else "adam")
    trainer.fit(model, train_dataloaders=train_loader)
    (results,) = trainer.test(model, dataloaders=test_loader, verbose=False)
    accuracy = float(results["test_acc"])
    if trainer.is_global_zero:
        print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
