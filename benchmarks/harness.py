"""What the benchmark labs share: method names, the round order, the machine record, reports, the task networks.

The labs are scripts, not a package: each puts ``benchmarks/`` on ``sys.path`` and imports this module, so that no
lab imports another for these pieces. It imports torch at load, Lightning on first use.

- Method names: ``low_rank_r4`` is ``low_rank`` at rank 4 (:func:`split_rank`), and a method stem may stand for an
  algorithm with keywords of its own (:data:`ALGORITHM_VARIANTS`, :func:`resolve_algorithm`), in every lab alike.
- :func:`interleaved`: every method once per round, each round rotated by one.
- :func:`machine`: Python, torch, Lightning, the platform and the load, for a report.
- :func:`write_report`: ``<stem>.json`` and ``<stem>.md`` in the results folder; :func:`free_port`.
- The tasks' networks (:func:`task_model`, :func:`random_batch`, :func:`task_loss`): convergence.py trains them,
  the network lab and low_rank_host_cost.py time them; the LM labs' :class:`DecoderLM` and :data:`SOCKETS_ENV`.
"""

import json
import logging
import os
import platform
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

log = logging.getLogger(__name__)

T = TypeVar("T")

LOW_RANK_RANKS = (1, 4, 8)  # the ranks of ``low_rank`` and of DDP's PowerSGD that are compared
# Methods that run an algorithm with keywords of their own: method stem -> (algorithm, keywords).
ALGORITHM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"low_rank_alt": ("low_rank", {"alternate": True})}
# Ranks of ``low_rank`` (and its variants) accepted by name, ``low_rank_r16``, but not in the default list.
EXTRA_LOW_RANK_RANKS = (16,)
TASK_NETWORKS = ("digits", "charlm", "bytemlp")  # the networks convergence.py trains and the other labs time
CONTEXT = 128  # bytes per language-model window
BYTEMLP_CONTEXT = 32  # bytes an bytemlp prediction sees
# NCCL over TCP sockets on the loopback, as between machines (the LM labs' ``sockets`` regime).
SOCKETS_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}


# ------------------------------------------------------------------------------------------------ method names


def split_rank(method: str) -> tuple[str, int | None]:
    """``"low_rank_r4"`` -> ``("low_rank", 4)``; a name without an ``_r<k>`` suffix -> ``(name, None)``."""
    stem, _, suffix = method.rpartition("_r")
    return (stem, int(suffix)) if stem and suffix.isdigit() else (method, None)


def resolve_algorithm(stem: str) -> tuple[str, dict[str, Any]]:
    """A method stem's algorithm and extra keywords: ``"low_rank_alt"`` -> ``("low_rank", {"alternate": True})``.

    ``diloco_h<H>`` is ``diloco`` syncing every ``H`` steps: ``("diloco", {"sync_every": H})``.
    """
    period = diloco_period(stem)
    if period is not None:
        return "diloco", {"sync_every": period}
    name, keywords = ALGORITHM_VARIANTS.get(stem, (stem, {}))
    return name, dict(keywords)


DILOCO_METHODS = ("diloco_h10", "diloco_h20", "diloco_h50")
"""``diloco`` at the sync periods the labs accept by name (any ``diloco_h<H>`` resolves; these are listed)."""


def diloco_period(stem: str) -> int | None:
    """``"diloco_h20"`` -> ``20``; any other stem -> ``None``."""
    head, _, period = stem.partition("_h")
    return int(period) if head == "diloco" and period.isdigit() and int(period) > 0 else None


TORCHFT_METHODS = ("torchft_diloco", *(f"torchft_{method}" for method in DILOCO_METHODS))
"""torchft's DiLoCo (``benchmarks/torchft_peer.py``) by name: ``torchft_diloco_h<H>`` mirrors ``diloco_h<H>``."""
TORCHFT_NOTE = (
    "torchft's DiLoCo, full precision: torchft quantizes outer gradients only with Triton on CUDA (diloco sends uint8)"
)
TORCHFT_FLAT_NOTE = "flat: one torchft replica per rank (torchft's peer has no hierarchical layout)"


def torchft_settings(method: str) -> dict[str, Any] | None:
    """``"torchft_diloco_h20"`` -> the peer's keywords at our ``diloco``'s defaults, H=20; other names -> ``None``.

    ``sync_every``, ``fragments``, ``fragment_sync_delay`` and ``fragment_update_alpha`` are the ones the labs'
    ``diloco_h<H>`` runs with (the algorithm's defaults; ``torchft_diloco`` alone takes its default H too).
    """
    import inspect

    head, _, period = method.partition("_h")
    if head != "torchft_diloco" or (method != head and not (period.isdigit() and int(period) > 0)):
        return None
    from lightning_bagua.engine.algorithms.diloco import DiLoCoAlgorithm

    shared = ("sync_every", "fragments", "fragment_sync_delay", "fragment_update_alpha")
    parameters = inspect.signature(DiLoCoAlgorithm.__init__).parameters
    settings: dict[str, Any] = {name: parameters[name].default for name in shared}
    if period:
        settings["sync_every"] = int(period)
    return settings


def extra_low_rank_methods() -> list[str]:
    """``low_rank``, its variants and DDP's PowerSGD at ``EXTRA_LOW_RANK_RANKS`` (PowerSGD only without ``low_rank``).

    PowerSGD comes at the same ranks, so that every ``low_rank`` rank has torch's hook at that rank to compare with.
    """
    from lightning_bagua.engine import available_algorithms

    powersgd = [f"ddp_powersgd_r{rank}" for rank in EXTRA_LOW_RANK_RANKS]
    if "low_rank" not in available_algorithms():
        return powersgd
    stems = ["low_rank", *(stem for stem, (name, _) in ALGORITHM_VARIANTS.items() if name == "low_rank")]
    return [*powersgd, *(f"{stem}_r{rank}" for stem in stems for rank in EXTRA_LOW_RANK_RANKS)]


# ------------------------------------------------------------------------------------------------ the tasks


class CausalConvLM(nn.Module):
    """Byte embeddings, residual causal convolutions with growing dilation, and a linear read-out over 256 bytes."""

    def __init__(self, width: int = 64, dilations: tuple[int, ...] = (1, 2, 4, 8, 16), kernel: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.kernel = kernel
        self.dilations = dilations
        self.convs = nn.ModuleList(nn.Conv1d(width, width, kernel, dilation=d) for d in dilations)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in dilations)
        self.out = nn.Linear(width, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)  # (batch, time, width)
        for conv, norm, dilation in zip(self.convs, self.norms, self.dilations, strict=True):
            # Pad on the left only, so position t sees bytes <= t.
            h = F.pad(norm(x).transpose(1, 2), ((self.kernel - 1) * dilation, 0))
            x = x + F.gelu(conv(h)).transpose(1, 2)
        return self.out(x)  # (batch, time, 256)


class ByteMLP(nn.Module):
    """Next-byte prediction from the previous ``BYTEMLP_CONTEXT`` bytes: embeddings and a wide perceptron (2.4M).

    Most of its parameters sit in two dense 1024-wide layers whose compute is small: its gradient is large for
    the work of a step, so the link, not the arithmetic, sets the step time on slow links.
    """

    def __init__(self, embed: int = 32, hidden: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, embed)
        self.net = nn.Sequential(
            nn.Linear(BYTEMLP_CONTEXT * embed, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 256),
        )

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(self.embed(tokens).flatten(1))  # (batch, 256)


def task_model(task: str) -> nn.Module:
    """The bare network of ``task`` (what the network lab times): the digits perceptron, CausalConvLM, ByteMLP."""
    if task == "digits":
        # The example's script is not a package: its folder goes on the path (imported here: it imports Lightning).
        examples = str(Path(__file__).resolve().parents[1] / "examples")
        if examples not in sys.path:
            sys.path.insert(0, examples)
        from train import DigitsClassifier

        return DigitsClassifier(lr=3e-3).net  # the network alone: the learning rate is the LightningModule's
    if task == "charlm":
        return CausalConvLM()
    if task == "bytemlp":
        return ByteMLP()
    raise ValueError(f"Unknown task {task!r}; choose one of {TASK_NETWORKS}.")


def random_batch(task: str, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A batch of ``task``'s shapes and types, for timing: the work of a step does not depend on the values."""
    if task == "digits":
        return torch.randn(batch, 64, generator=generator), torch.randint(10, (batch,), generator=generator)
    length = CONTEXT if task == "charlm" else BYTEMLP_CONTEXT
    tokens = torch.randint(256, (batch, length + 1), generator=generator)
    if task == "charlm":
        return tokens[:, :-1], tokens[:, 1:]
    return tokens[:, :-1], tokens[:, -1]


def task_loss(output: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of every task: classes are the last dimension of ``output``."""
    return F.cross_entropy(output.flatten(0, -2), targets.flatten())


class DecoderLM(nn.Module):
    """A pre-norm decoder-only transformer with tied input and output embeddings."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.norm(self.blocks(hidden, mask=mask, is_causal=True))
        return hidden @ self.embed.weight.t()


# ------------------------------------------------------------------------------------------------ the order


def rotated(items: Sequence[T], index: int) -> list[T]:
    """Round ``index``'s order of ``items``: the list started ``index`` places later (wrapping round)."""
    shift = index % len(items)
    return [*items[shift:], *items[:shift]]


def interleaved(methods: list[str], rounds: int) -> list[tuple[int, str]]:
    """The measuring order: every method once per round, each round starting one method later than the last.

    Rotating the order keeps a method from always following the same neighbour (a slow one that heats the
    machine, or one whose sockets are still draining).
    """
    return [(index, method) for index in range(rounds) for method in rotated(methods, index)]


# ------------------------------------------------------------------------------------------------ the report


def machine() -> dict[str, Any]:
    """Python, torch, Lightning, the platform and the load when the report was written."""
    import lightning

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # Other work on the machine slows the unshaped and 10 Gbit/s runs most: recorded, not hidden.
        "load_average_1_5_15": os.getloadavg(),
    }


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (and a warning) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart")
        return None
    return plt


def write_report(out: Path, stem: str, report: dict[str, Any], table: str) -> None:
    """Write ``report`` to ``out/<stem>.json`` and its table to ``out/<stem>.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)


def free_port() -> int:
    """Return a TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
