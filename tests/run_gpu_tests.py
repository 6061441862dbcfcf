"""Run the GPU tests (``pytest -m gpu``) in a few pytest processes side by side, and fail if any of them fails.

The two-GPU tests start processes, NCCL communicators and Lightning trainers, and one after the other they take
longer than a device session's call allows (on two H200s, the nine Lightning trainer tests alone took over five
minutes). They use free ports of their own and little of a GPU's memory, so shards can share the GPUs. The GPU
tests are collected once and dealt out to ``--shards`` processes in turn, in collection order, so that the tests
of one slow file spread over every shard; a new GPU test is dealt out like the others. Each shard's output goes
to ``--logs``; the last lines of each are printed at the end.

Usage (on a machine with two GPUs, the project installed)::

    python tests/run_gpu_tests.py               # four shards, side by side
    python tests/run_gpu_tests.py -- -x         # arguments after -- go to every pytest
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_test_ids() -> list[str]:
    """The node ids of every test marked ``gpu``, in collection order."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if collected.returncode not in (0, 5):  # 5: nothing collected
        raise SystemExit(f"Collecting the GPU tests failed:\n{collected.stdout[-3000:]}{collected.stderr[-3000:]}")
    return [line for line in collected.stdout.splitlines() if "::" in line]


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """``ids`` dealt out to ``shards`` lists in turn; empty lists are dropped."""
    return [hand for hand in (ids[index::shards] for index in range(shards)) if hand]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4, help="pytest processes side by side (default: 4)")
    parser.add_argument("--logs", default="gpu-test-logs", help="folder for each shard's output")
    parser.add_argument("pytest_args", nargs="*", help="after --: more arguments for every pytest")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error(f"--shards must be a positive number of processes, got {args.shards}")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    hands = deal(gpu_test_ids(), args.shards)
    running = []
    env = dict(os.environ)
    for index, hand in enumerate(hands):
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "--durations=5", *args.pytest_args, *hand]
        log = (logs / f"shard{index}.log").open("w")
        running.append(
            # A block of ports for each shard: two shards picking the same free port at once would collide.
            (
                index,
                len(hand),
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env | {"BAGUA_TEST_PORT_BLOCK": str(index)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    failed = []
    for index, count, process, log in running:
        code = process.wait()
        log.close()
        tail = (logs / f"shard{index}.log").read_text().splitlines()[-8:]
        print(f"--- shard {index} ({count} tests): exit {code} at {time.monotonic() - start:.0f} s", *tail, sep="\n")
        if code != 0:
            failed.append(index)
    total = sum(count for _, count, _, _ in running)
    print(f"GPU tests: {total} in {len(running)} shards; shards failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
