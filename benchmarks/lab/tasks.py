"""The convergence tasks and methods: their settings, data sets, method lists and baselines.

``benchmarks/convergence.py`` trains them and, with ``--timed``, combines their learning curves with the CPU
network lab's step times; ``benchmarks/diloco_quantization.py`` simulates diloco on their data. The networks
are in :mod:`lab.models`.

- :data:`SETTINGS`: per task, the optimizers' settings, the batch per process and the training steps.
- :func:`task_data`: a task's training and held-out sets (the example's digits; the standard library's source as
  bytes for ``charlm`` and ``bytemlp``).
- :func:`available_methods`, :func:`accepted_methods`, :func:`baseline_of`: what the convergence runs can train,
  and the DDP run each method is compared with.
"""

import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lab.methods import (
    ALGORITHM_VARIANTS,
    DILOCO_METHODS,
    LOW_RANK_RANKS,
    TORCHFT_METHODS,
    diloco_period,
    extra_low_rank_methods,
    split_rank,
    torchft_settings,
)
from lab.models import BYTEMLP_CONTEXT, CONTEXT, example_script

TASKS = ("digits", "charlm")  # the default; ``bytemlp`` is the larger model where communication binds
ALL_TASKS = (*TASKS, "bytemlp")
METHODS = (
    "ddp",
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "async",
    "ddp_adam",
    "qadam",
)
# DDP with torch's communication hooks, set up as a Lightning user would (``DDPStrategy(ddp_comm_hook=...)``).
HOOK_METHODS = ("ddp_fp16", *(f"ddp_powersgd_r{rank}" for rank in LOW_RANK_RANKS))
ADAM_METHODS = frozenset({"ddp_adam", "qadam"})

# Per task: SGD learning rate and momentum, Adam learning rate, batch per process, training steps (full, quick).
SETTINGS: dict[str, dict[str, Any]] = {
    "digits": {"sgd_lr": 0.05, "momentum": 0.9, "adam_lr": 3e-3, "batch": 32, "steps": 230, "quick_steps": 60},
    "charlm": {"sgd_lr": 0.1, "momentum": 0.9, "adam_lr": 3e-3, "batch": 16, "steps": 400, "quick_steps": 80},
    "bytemlp": {"sgd_lr": 0.05, "momentum": 0.9, "adam_lr": 1e-3, "batch": 64, "steps": 400, "quick_steps": 80},
}
BYTEMLP_HELD_OUT_STRIDE = 32  # bytemlp scores every 32nd held-out position: an evaluation stays under a second
TEXT_BYTES = 1_200_000  # bytes of standard-library source read for charlm


def low_rank_available() -> bool:
    """Whether the engine of this checkout provides the ``low_rank`` algorithm."""
    from lightning_bagua.engine import available_algorithms

    return "low_rank" in available_algorithms()


def available_methods() -> list[str]:
    """Every method this checkout can run: the default ones, DDP's hooks, ``low_rank`` and ``diloco`` where present."""
    from lightning_bagua.engine import available_algorithms

    methods = [*METHODS, *HOOK_METHODS]
    if low_rank_available():
        methods += [f"low_rank_r{rank}" for rank in LOW_RANK_RANKS]
        methods += [f"{stem}_r{rank}" for stem in ALGORITHM_VARIANTS for rank in LOW_RANK_RANKS]
    if "diloco" in available_algorithms():
        methods += DILOCO_METHODS
    return methods


def accepted_methods() -> list[str]:
    """What ``--methods`` accepts: :func:`available_methods` and ``low_rank`` at the lab's extra ranks (``_r16``)."""
    return [*available_methods(), *extra_low_rank_methods(), "auto", *TORCHFT_METHODS]


def is_accepted(method: str) -> bool:
    """Whether ``--methods`` takes ``method``: :func:`accepted_methods`, or diloco or torchft's at any ``_h<H>``."""
    return method in accepted_methods() or diloco_period(method) is not None or torchft_settings(method) is not None


def is_hook_method(method: str) -> bool:
    """Whether ``method`` is DDP with one of torch's hooks: the fp16 hook, or PowerSGD at any rank (``_r16`` too)."""
    return method == "ddp_fp16" or split_rank(method)[0] == "ddp_powersgd"


def baseline_of(method: str) -> str:
    """The DDP run a method is compared with: DDP with Adam for the Adam family, DDP with SGD for the rest."""
    return "ddp_adam" if method in ADAM_METHODS else "ddp"


def compression_warmup(steps: int) -> int:
    """Uncompressed steps before DDP's PowerSGD and ``low_rank`` compress: a twentieth of the run (torch wants >= 2)."""
    return max(2, steps // 20)


def standard_library_text() -> tuple[bytes, dict[str, Any]]:
    """Return the first ``TEXT_BYTES`` of the standard library's top-level ``*.py`` files and a description."""
    directory = Path(sysconfig.get_paths()["stdlib"])
    chunks, total, used = [], 0, 0
    for path in sorted(directory.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        used += 1
        if total >= TEXT_BYTES:
            break
    text = b"".join(chunks)[:TEXT_BYTES]
    return text, {"directory": str(directory), "files": used, "bytes": len(text)}


class ByteWindows(Dataset):
    """Non-overlapping windows of ``CONTEXT + 1`` bytes: inputs are the first ``CONTEXT``, targets shifted by one."""

    def __init__(self, data: bytes) -> None:
        self.data = torch.tensor(list(data), dtype=torch.long)
        self.count = (len(data) - 1) // CONTEXT

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        window = self.data[index * CONTEXT : index * CONTEXT + CONTEXT + 1]
        return window[:-1], window[1:]


class ByteContexts(Dataset):
    """Every ``stride``-th position of ``data`` after the first ``BYTEMLP_CONTEXT``: the bytes before it, and it."""

    def __init__(self, data: bytes, stride: int = 1) -> None:
        self.data = torch.tensor(list(data), dtype=torch.long)
        self.stride = stride
        self.count = (len(data) - BYTEMLP_CONTEXT) // stride

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        position = BYTEMLP_CONTEXT + index * self.stride
        return self.data[position - BYTEMLP_CONTEXT : position], self.data[position]


def task_data(task: str) -> tuple[Dataset, Dataset]:
    """The training set and the held-out set of ``task``; ``charlm`` and ``bytemlp`` split the text 9:1."""
    if task == "digits":
        return example_script().load_data()
    text, _ = standard_library_text()
    split = len(text) * 9 // 10
    if task == "charlm":
        return ByteWindows(text[:split]), ByteWindows(text[split:])
    return ByteContexts(text[:split]), ByteContexts(text[split:], stride=BYTEMLP_HELD_OUT_STRIDE)
