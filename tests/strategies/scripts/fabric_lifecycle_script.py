"""Fabric BaguaStrategy around the edges of a run: exiting, loading into a running algorithm, filtered saves.

Run as ``python tests/strategies/scripts/fabric_lifecycle_script.py --out DIR --mode MODE`` with the repository on
PYTHONPATH: the first ``Fabric(..., devices=2).launch()`` starts the second process, as in a user's script. Each rank
writes ``DIR/rank{r}.pt`` before the mode's last act (``destroy_group`` ends with the interpreter's exit, which is what
it tests).

Modes:

* ``destroy_group``: train with ``--algorithm``, then destroy the default process group as many scripts do at their
  end, start a new one (as a test harness that runs several scripts in one process does) and end the script with it
  alive: the engine's exit cleanup must not destroy its groups a second time.
* ``restart_group``: train with ``--algorithm`` in a function that drops its model, destroy the default process
  group and start a new one through the same ``MASTER_PORT``, as Lightning's DDP parity test does, rank 0 last;
  then train a torch ``DistributedDataParallel`` model in it. The cycle collector stays off from the setup on.
* ``async_load``: the flow the Fabric docs show, under ``async``: set up, train, ``fabric.save``; set up a fresh
  model, then ``fabric.load`` into it while its averaging runs, and train on.
* ``filter``: ``fabric.save`` with filters for ``decentralized``, ``low_precision_decentralized`` and ``async``;
  rank 0 records what each file holds.
* ``kill_save``: ``fabric.save`` to ``DIR/last.ckpt`` after each of three steps, each checkpoint with a ballast of
  about 128 MB whose every value is the step; rank 0 is killed in the middle of writing the second
  (``kill_during_save.py``), so this mode writes no results.
"""

import argparse
import faulthandler
import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.strategies.scripts.fabric_script import cpu_state, fabric_strategy, new_fabric, rank_loader, train_steps
from tests.strategies.scripts.fit_script import make_network, make_optimizer
from tests.strategies.scripts.kill_during_save import kill_during_write
from tests.strategies.scripts.killed_save_script import BALLAST_VALUES

KEEP_UNTIL_EXIT: list[Any] = []

FILTER_ALGORITHMS = {
    "decentralized": {"hierarchical": False},
    "low_precision_decentralized": {"hierarchical": False},
    "async": {"sync_interval_ms": 5},
}


def destroy_group(fabric: Any, args: argparse.Namespace) -> dict[str, Any]:
    network = make_network()
    model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
    train_steps(fabric, model, optimizer, iter(rank_loader(fabric.world_size, fabric.global_rank)), 2)
    save_result(args, fabric.global_rank, {"state": cpu_state(network)})
    dist.destroy_process_group()
    # A new default group, alive when the script ends: the engine's subgroups died with the old one.
    store = Path(args.out) / "second_group_store"
    dist.init_process_group("gloo", init_method=store.as_uri(), rank=fabric.global_rank, world_size=fabric.world_size)
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == fabric.world_size
    return {}


def restart_group(fabric: Any, args: argparse.Namespace) -> dict[str, Any]:
    def train_with_fabric() -> dict[str, torch.Tensor]:
        network = make_network()
        model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
        train_steps(fabric, model, optimizer, iter(rank_loader(fabric.world_size, fabric.global_rank)), 2)
        return cpu_state(network)

    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where, before the test's timeout
    # Python's cycle collector off: a cycle that holds the engine's groups keeps the old store until it runs, which
    # in a script may be after the new group started. Only plain reference counting frees them here.
    gc.disable()
    state = train_with_fabric()
    fabric.barrier()
    dist.destroy_process_group()
    # Rank 1 joins first: with the old store still alive, it read rank 0's address in the old group and the new
    # group's creation hung past its own timeout.
    time.sleep(3.0 if fabric.global_rank == 0 else 0.5)
    dist.init_process_group(
        "gloo", rank=fabric.global_rank, world_size=fabric.world_size, timeout=timedelta(seconds=60)
    )
    network = make_network()
    model = DistributedDataParallel(network)
    optimizer = make_optimizer(network.parameters())
    batches = iter(rank_loader(fabric.world_size, fabric.global_rank))
    for _ in range(2):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    dist.destroy_process_group()
    # Kept until the process ends without teardown: freeing torch's DDP here frees its reducer's Gloo group, whose
    # destructor joins the group's worker threads while this thread holds the GIL, and a worker may still be freeing
    # the backward's last all-reduce, whose saved thread-local state holds a Python object (torch stashes the
    # backward's `contextvars` context there): its release waits for the GIL, and both threads wait for good.
    KEEP_UNTIL_EXIT.extend([model, optimizer])
    return {"state": state, "torch_state": cpu_state(network)}


def async_load(fabric: Any, args: argparse.Namespace) -> dict[str, Any]:
    path = Path(args.out) / "async.ckpt"
    batches = iter(rank_loader(fabric.world_size, fabric.global_rank))
    network = make_network()
    model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
    train_steps(fabric, model, optimizer, batches, 3)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    saved_algorithm_state = model._forward_module.bagua_state_dict()

    restored_network = make_network()
    restored, restored_optimizer = fabric.setup(restored_network, make_optimizer(restored_network.parameters()))
    impl = restored._forward_module.bagua_algorithm_impl
    started_before = impl.enabled
    state = {"model": restored, "optimizer": restored_optimizer, "step": 0}
    fabric.load(path, state)
    loaded_algorithm_state = restored._forward_module.bagua_state_dict()
    started_after = impl.enabled
    rounds_after_load = impl.rounds
    train_steps(fabric, restored, restored_optimizer, batches, 3)
    fabric.barrier()
    fabric.strategy.teardown()  # aborts the averaging: one last exact average, so the ranks end equal
    return {
        "started_before": started_before,
        "started_after": started_after,
        "step": state["step"],
        "saved_algorithm_state": saved_algorithm_state,
        "loaded_algorithm_state": loaded_algorithm_state,
        "rounds_after_load": rounds_after_load,
        "state": cpu_state(restored_network),
    }


def filtered_saves(fabric_of: Any, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for algorithm, kwargs in FILTER_ALGORITHMS.items():
        fabric = fabric_of(algorithm, kwargs)
        network = make_network()
        model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
        train_steps(fabric, model, optimizer, iter(rank_loader(fabric.world_size, fabric.global_rank)), 2)
        first_weight = next(iter(network.state_dict()))

        def drop(key: str, value: Any) -> bool:
            return False

        def first_only(key: str, value: Any, first: str = first_weight) -> bool:
            return key == first

        filters = {
            "nothing": {"model": drop, "optimizer": drop},
            "first_weight": {"model": first_only, "optimizer": drop},
            "unfiltered": {},
        }
        files: dict[str, Any] = {}
        for name, save_filter in filters.items():
            path = Path(args.out) / f"{algorithm}-{name}.ckpt"
            fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2}, filter=save_filter)
            fabric.barrier()
            files[name] = torch.load(path, weights_only=False) if fabric.global_rank == 0 else None
        results[algorithm] = {"files": files, "first_weight": first_weight}
        fabric.strategy.teardown()
    return results


def kill_save(fabric: Any, args: argparse.Namespace) -> None:
    batches = iter(rank_loader(fabric.world_size, fabric.global_rank))
    network = make_network()
    model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
    for step in (1, 2, 3):
        train_steps(fabric, model, optimizer, batches, 1)
        ballast = torch.full((BALLAST_VALUES,), float(step))
        fabric.save(
            Path(args.out) / "last.ckpt", {"model": model, "optimizer": optimizer, "step": step, "ballast": ballast}
        )


def save_result(args: argparse.Namespace, rank: int, result: dict[str, Any]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"rank{rank}.pt.partial"
    torch.save(result, partial)
    os.replace(partial, out / f"rank{rank}.pt")  # whole or absent: rank 0 may read it before rank 1 exits


def end_without_teardown(args: argparse.Namespace, rank: int) -> None:
    """End the process at once, once both ranks' results are written, skipping the interpreter's teardown.

    With the cycle collector off, this script's teardown hung about once in eight runs under ``decentralized``
    after both ranks wrote their results, the ranks spinning in CPython's cycle collector (gdb). That defect is open
    and tracked apart; this mode tests that the restarted group is joined, so it ends here. (A hang under
    ``gradient_allreduce`` at the same place was another one: freeing torch's DDP, see ``KEEP_UNTIL_EXIT``.)
    """
    if rank == 0:
        deadline = time.monotonic() + 60
        while not (Path(args.out) / "rank1.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--mode", required=True, choices=["destroy_group", "restart_group", "async_load", "filter", "kill_save"]
    )
    parser.add_argument("--algorithm", default="gradient_allreduce")
    args = parser.parse_args()

    from lightning.fabric import Fabric

    if args.mode == "kill_save":
        # Lightning's launcher sets LOCAL_RANK for the ranks it starts; the main process is rank 0.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            kill_during_write(Path(args.out), "last", 2, Path(args.out) / "killed_at_size")
        kill_save(new_fabric(fabric_strategy("gradient_allreduce")), args)
        return
    if args.mode in ("destroy_group", "restart_group"):
        kwargs = FILTER_ALGORITHMS.get(args.algorithm, {})
        fabric = Fabric(accelerator="cpu", devices=2, strategy=fabric_strategy(args.algorithm, **kwargs))
        fabric.launch()
        if args.mode == "destroy_group":
            destroy_group(fabric, args)
        else:
            save_result(args, fabric.global_rank, restart_group(fabric, args))
            end_without_teardown(args, fabric.global_rank)
        return
    first = Fabric(accelerator="cpu", devices=2, strategy="bagua")
    first.launch()  # starts rank 1 and creates the process group every later Fabric joins
    if args.mode == "async_load":
        result = async_load(new_fabric(fabric_strategy("async", sync_interval_ms=5)), args)
    else:
        result = filtered_saves(lambda algorithm, kwargs: new_fabric(fabric_strategy(algorithm, **kwargs)), args)
    save_result(args, first.global_rank, result)


if __name__ == "__main__":
    main()
