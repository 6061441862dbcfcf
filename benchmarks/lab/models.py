"""The networks the benchmarks train and time: the convergence tasks' and the GPU lab's language model.

The convergence lab trains the tasks (:func:`task_model`, :func:`task_loss`), the CPU step-time lab times them on
random inputs of their shapes (:func:`random_batch`); the GPU lab trains :class:`DecoderLM`.
"""

import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

TASK_NETWORKS = ("digits", "charlm", "bytemlp")  # the networks convergence.py trains and the other labs time
CONTEXT = 128  # bytes per language-model window
BYTEMLP_CONTEXT = 32  # bytes an bytemlp prediction sees


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
        return example_script().DigitsClassifier(lr=3e-3).net  # the network alone: the LightningModule has the lr
    if task == "charlm":
        return CausalConvLM()
    if task == "bytemlp":
        return ByteMLP()
    raise ValueError(f"Unknown task {task!r}; choose one of {TASK_NETWORKS}.")


def example_script() -> ModuleType:
    """``examples/train.py``, whose digits model and data the tasks reuse (imported on demand: it imports Lightning).

    The example is a script, not a package: its folder goes on the path.
    """
    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import train

    return train


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
