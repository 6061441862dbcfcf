"""The job ``benchmarks/chaos.py`` kills: a small Trainer fit that resumes from ``last.ckpt``; run under torchrun.

The user's script of issue 34: ``ModelCheckpoint(every_n_train_steps=k, save_last=True)`` (or ``"link"``, with
``--save-last link``), a plain shuffled
``DataLoader`` and ``trainer.fit(model, loader, ckpt_path="last")``; a restarted worker runs it again, unchanged.
The model has dropout and the loss a draw from Python's ``random``, so resuming must restore the generators too.

For the harness to aim its kills, every rank appends ``<restart> <phase> <step>`` lines to ``OUT/markers/rank{r}.log``
(``setup``, ``fit_start``, ``step``, ``backward``, ``straggle``, ``save``, ``done``), and two options shape the job
without changing its arithmetic: ``--save-delay-s`` holds every checkpoint save open for that long while its file
(``.partial``, with the strategy's atomic checkpoint IO) is open, by making one entry slow to pickle, and
``--straggle-rank/--straggle-step`` make one rank sleep before its backward once, so that the other ranks wait
inside a collective. Each rank that finishes writes ``OUT/final/rank{r}.pt``: its weights, the loss of those weights
on the whole data set (evaluation mode), its step count and the launcher's restart count.
"""

import argparse
import collections
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 96
FEATURES = 8
BATCH = 4


class SlowToPickle:
    """A checkpoint entry that takes ``delay_s`` to pickle and loads as an empty ``OrderedDict``.

    ``torch.save`` pickles it while the checkpoint's file is open, so the save lasts long enough for the harness to
    kill a rank inside it; ``weights_only`` loading accepts ``OrderedDict``. It writes a ``save`` marker as it starts:
    with Lightning's own checkpoint IO (``ddp``) there is no ``.partial`` file to watch for.
    """

    def __init__(self, delay_s: float, markers: "Markers", step: int) -> None:
        self.delay_s, self.markers, self.step = delay_s, markers, step

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        self.markers.write("save", self.step)
        time.sleep(self.delay_s)
        return collections.OrderedDict, ()


class Markers:
    """Append this rank's progress to its marker file, flushed at once so the harness sees it as it happens."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.path = directory / f"rank{rank}.log"

    def write(self, phase: str, step: int) -> None:
        with self.path.open("a") as file:
            file.write(f"{self.restart} {phase} {step} {time.time():.4f}\n")


def fingerprint(*tensors: torch.Tensor) -> str:
    """Return a short digest of the tensors' bytes."""
    digest = hashlib.sha1()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:12]


def main() -> None:
    """Fit once (resuming from ``last.ckpt`` when there is one) and write this rank's final state."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--keywords", default="{}", help="JSON keywords for BaguaStrategy's algorithm")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--save-last", choices=("true", "link"), default="true", help="ModelCheckpoint's save_last")
    parser.add_argument("--step-sleep-s", type=float, default=0.01)
    parser.add_argument("--save-delay-s", type=float, default=0.0)
    parser.add_argument("--straggle-rank", type=int, default=-1)
    parser.add_argument("--straggle-step", type=int, default=-1)
    parser.add_argument("--straggle-s", type=float, default=2.0)
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bagua import BaguaStrategy, QAdamOptimizer

    out = Path(args.out)
    rank = int(os.environ["RANK"])
    markers = Markers(out / "markers", rank)
    markers.write("setup", -1)
    # The straggle happens once per job, whatever the restarts: the file outlives the process.
    straggled = out / "markers" / "straggled"
    trace: list[dict[str, Any]] = []

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))

        def on_train_start(self) -> None:
            markers.write("fit_start", self.global_step)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            markers.write("step", self.global_step)
            # What each step starts from, so that the harness can name the first step where a resumed job parts
            # from the undisturbed one, and what parted first: the batch, a generator or the weights.
            trace.append(
                {
                    "step": self.global_step,
                    "batch": fingerprint(batch[0]),
                    "weights": fingerprint(*self.parameters()),
                    "torch_rng": fingerprint(torch.get_rng_state()),
                    "cuda_rng": fingerprint(torch.cuda.get_rng_state()) if args.device == "cuda" else "",
                    "python_rng": hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:12],
                }
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            # Room for a kill to land inside the step rather than in Lightning's bookkeeping between steps.
            time.sleep(args.step_sleep_s)
            scale = 1 + 0.1 * random.random()
            return scale * nn.functional.mse_loss(self.net(inputs), targets)

        def on_before_backward(self, loss: torch.Tensor) -> None:
            chosen = self.global_rank == args.straggle_rank and self.global_step == args.straggle_step
            if chosen and not straggled.exists():
                straggled.write_text(str(self.global_step))
                markers.write("straggle", self.global_step)
                time.sleep(args.straggle_s)
            markers.write("backward", self.global_step)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if args.save_delay_s > 0:
                checkpoint["chaos_save_delay"] = SlowToPickle(args.save_delay_s, markers, self.global_step)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if args.algorithm == "qadam":
                return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=5)
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    generator = torch.Generator().manual_seed(1000 + args.seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    dataset = TensorDataset(inputs, targets)

    pl.seed_everything(args.seed, verbose=False)
    keywords = json.loads(args.keywords)
    strategy: Any = "ddp" if args.algorithm == "ddp" else BaguaStrategy(algorithm=args.algorithm, **keywords)
    save_last: bool | str = True if args.save_last == "true" else "link"
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        callbacks=[
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.checkpoint_every, save_last=save_last)
        ],
    )
    model = Regression()
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader, ckpt_path="last")

    model.eval()
    with torch.no_grad():
        net = model.net.cpu()
        loss = nn.functional.mse_loss(net(inputs), targets).item()
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    result = {
        "state": {key: value.detach().cpu().clone() for key, value in model.state_dict().items()},
        "loss": loss,
        "global_step": trainer.global_step,
        "restart_count": markers.restart,
        "trace": trace,
    }
    torch.save(result, final / f"rank{rank}.pt")
    markers.write("done", trainer.global_step)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
