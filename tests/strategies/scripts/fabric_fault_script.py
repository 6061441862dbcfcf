"""A Fabric job of 12 optimizer steps on 2 Gloo processes, for the dead-rank tests (``test_fabric_faults.py``).

Takes the job options of ``benchmarks/robustness.py dead-rank``: ``--out``, ``--devices``, and ``--kill-rank``,
``--kill-at-step`` and ``--kill-marker`` (that rank writes the time to the marker, then SIGKILLs itself before the
step, or with ``--raise-instead`` raises an uncaught ``ValueError``). Without a launcher (``--no-launcher``), the
environment gives the rank and world size, as torchrun would.

``--kill-at-step 12`` kills the rank after its last step. With ``--loop-done-marker``, the other rank writes that
file when its loop is over and then waits for the kill marker before its script ends, while the rank to kill waits
for the file before it dies: the death happens after the other rank's loop, so only ending the script (closing the
engines at exit) can see it.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_bagua.strategies.fabric import BaguaStrategy

STEPS = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--kill-rank", type=int)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--kill-marker", type=Path)
    parser.add_argument("--raise-instead", action="store_true", help="the rank raises ValueError (uncaught) instead")
    parser.add_argument("--loop-done-marker", type=Path)
    args = parser.parse_args()

    kwargs = {"sync_interval_ms": 5} if args.algorithm == "async" else {}
    strategy = BaguaStrategy(algorithm=args.algorithm, **kwargs)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(STEPS + 1):
        if fabric.global_rank == args.kill_rank and step == args.kill_at_step:
            if args.loop_done_marker is not None:
                wait_for(args.loop_done_marker)
            args.kill_marker.write_text(json.dumps({"time": time.time()}))
            if args.raise_instead:
                raise ValueError(f"rank {fabric.global_rank} failed alone at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if step == STEPS:
            break
        loss = model(torch.randn(32, 8, generator=generator)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)  # async: leave the averaging thread rounds to run between the steps
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({"rank": fabric.global_rank}, args.out / f"rank{fabric.global_rank}.pt")
    if args.loop_done_marker is not None and fabric.global_rank != args.kill_rank:
        args.loop_done_marker.write_text(json.dumps({"time": time.time()}))
        wait_for(args.kill_marker)
        time.sleep(0.5)  # the rank writes the marker just before it kills itself


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
