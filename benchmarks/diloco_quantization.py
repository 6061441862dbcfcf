"""How far diloco's 8-bit and 4-bit outer gradients move the average and the loss, with and without error feedback.

A single-process simulation of ``--replicas`` DiLoCo replicas (the math of ``algorithm="diloco"``, the engine's own
codec) training the convergence lab's ``charlm`` task on its data, each replica on its own shuffle, one run per
quantization; no timing. For
every outer step it records the relative error of the averaged pseudo-gradient against the full-precision average,
``|mean(D(Q(Δ_i))) - mean(Δ_i)| / |mean(Δ_i)|``, and the cosine of the two (a bias would show as a cosine that stays
below 1 and an error that does not shrink with more replicas), and at the end the held-out loss of ``θ_outer``.

Run: ``.venv/bin/python benchmarks/diloco_quantization.py`` (a few minutes on two cores); results go to
``benchmarks/results/diloco_quantization.json`` and ``.md``.
"""

import argparse
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.models import task_loss, task_model
from lab.results import new_report, write_report
from lab.tasks import task_data
from lightning_bagua.engine.algorithms._diloco_quantize import OuterGradientCodec

RESULTS = Path(__file__).parent / "results"
CASES = (("fp32", None, False), ("uint8", "uint8", False), ("uint4", "uint4", False), ("uint4+ef", "uint4", True))


def cycle(loader: DataLoader) -> Iterator[Any]:
    """Batches from ``loader``, epoch after epoch (each epoch its own shuffle)."""
    while True:
        yield from loader


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model: nn.Module, values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def run(args: argparse.Namespace, quantization: str | None, error_feedback: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    train_set, test_set = task_data(args.task)
    models = []
    for _ in range(args.replicas):
        torch.manual_seed(0)
        models.append(task_model(args.task))
    for model in models[1:]:
        load(model, flat(models[0]))
    inner = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in models]
    outer = nn.Parameter(flat(models[0]).clone())
    outer_optimizer = torch.optim.SGD([outer], lr=0.7, momentum=0.9, nesterov=True)
    codec = OuterGradientCodec(quantization)
    residuals = [torch.zeros_like(outer.data) for _ in models]
    loaders = [
        cycle(DataLoader(train_set, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(i)))
        for i in range(args.replicas)
    ]
    errors, cosines = [], []
    for step in range(1, args.steps + 1):
        for model, optimizer, loader in zip(models, inner, loaders, strict=True):
            inputs, targets = next(loader)
            optimizer.zero_grad()
            task_loss(model(inputs), targets).backward()
            optimizer.step()
        if step % args.sync_every:
            continue
        exact = torch.stack([outer.data - flat(m) for m in models])
        sent = []
        for i, delta in enumerate(exact):
            corrected = delta + residuals[i] if error_feedback else delta
            decoded = codec.decode(codec.encode(corrected), corrected.numel())
            if error_feedback:
                residuals[i] = corrected - decoded
            sent.append(decoded)
        average, true_average = torch.stack(sent).mean(0), exact.mean(0)
        errors.append(float((average - true_average).norm() / true_average.norm()))
        cosines.append(float(nn.functional.cosine_similarity(average, true_average, dim=0)))
        outer.grad = average
        outer_optimizer.step()
        for model in models:
            load(model, outer.data)
    with torch.no_grad():
        losses = [float(task_loss(models[0](x), y)) for x, y in DataLoader(test_set, batch_size=256)]
    return {
        "relative_error_median": statistics.median(errors),
        "relative_error_max": max(errors),
        "cosine_min": min(cosines),
        "held_out_loss": statistics.fmean(losses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="charlm", choices=("charlm", "digits"))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = [{"case": name, **run(args, quantization, feedback)} for name, quantization, feedback in CASES]
    report = new_report("diloco_quantization", vars(args), rows)
    lines = [
        f"DiLoCo's outer gradients quantized: {args.replicas} simulated replicas, task {args.task}, {args.steps} AdamW"
        f" steps, outer Nesterov every {args.sync_every}. Written by `{report['command']}`.",
        "",
        "| case | relative error of the average (median, max) | min cosine to fp32 | held-out loss |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['relative_error_median']:.4f}, {row['relative_error_max']:.4f} |"
            f" {row['cosine_min']:.5f} | {row['held_out_loss']:.4f} |"
        )
    print("\n".join(lines))
    if not args.no_save:
        write_report(Path(args.out), "diloco_quantization", report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
