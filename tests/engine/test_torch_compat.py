"""`_torch_compat`: `store_has_key` on every store type, through both of its branches, without waiting;
`destroy_process_group` while a Python callback of the group's work is still pending."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_bagua.engine._torch_compat import backward_context_out_of_tls, destroy_process_group, store_has_key
from tests.distributed import free_port, run_processes


class _StoreWithoutCheck:
    # The part of the Store API torch 2.2 has: no `check`, so `store_has_key` takes its compare_set branch.
    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(key, expected, desired)


def _stores(tmp_path):
    return {
        "tcp": dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10)),
        "file": dist.FileStore(str(tmp_path / "store"), 1),
        "hash": dist.HashStore(),
    }


@pytest.mark.parametrize("kind", ["tcp", "file", "hash"])
@pytest.mark.parametrize("without_check", [False, True], ids=["check", "compare_set"])
def test_store_has_key_answers_at_once_and_creates_nothing(tmp_path, kind, without_check):
    store = dist.PrefixStore("reports", _stores(tmp_path)[kind])
    looked_at = _StoreWithoutCheck(store) if without_check else store
    keys_before = store.num_keys()
    started = time.monotonic()
    assert not store_has_key(looked_at, "rank1")  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert store.num_keys() == keys_before
    store.set("rank1", "RuntimeError: boom")
    assert store_has_key(looked_at, "rank1")  # type: ignore[arg-type]
    assert not store_has_key(looked_at, "rank0")  # type: ignore[arg-type]
    assert store.get("rank1") == b"RuntimeError: boom"


def _free_a_group_whose_work_has_a_python_callback(rank: int, world_size: int) -> float:
    group = dist.new_group(list(range(world_size)))
    tensor = torch.ones(4)
    if rank == 1:
        time.sleep(2)  # rank 0 frees its group while its all-reduce still waits for this rank
        dist.all_reduce(tensor, group=group)
        return tensor.sum().item()
    future = dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda done: done.value()[0] * 2)
    destroy_process_group(group)
    # The last reference: freeing the group joins its Gloo worker, which runs and then lets go of the callback
    # above once rank 1 joins. On torch 2.2 with `dist.destroy_process_group` this line never returned.
    del group
    return future.wait().sum().item()


def test_freeing_a_destroyed_group_waits_for_its_python_callbacks_without_deadlock():
    # On a deadlock rank 0 never reports: the call fails after its timeout (twice over, as it waits for the exit).
    assert run_processes(_free_a_group_whose_work_has_a_python_callback, 2, timeout=30) == [16.0, 8.0]


def _destroy_the_default_group_whose_work_has_a_python_callback(rank: int, world_size: int) -> dict:
    subgroup = dist.new_group(list(range(world_size)))
    tensor = torch.ones(4)
    if rank == 1:
        time.sleep(2)
        dist.all_reduce(tensor)
        result = tensor.sum().item()
    else:
        future = dist.all_reduce(tensor, async_op=True).get_future().then(lambda done: done.value()[0] * 2)
        world = dist.GroupMember.WORLD
        assert world is not None
        # What the strategy's at-exit handler does; torch drops its references to the default group inside.
        destroy_process_group(world)
        del world
        result = future.wait().sum().item()
    left = subgroup in dist.distributed_c10d._world.pg_map
    return {"result": result, "initialized": dist.is_initialized(), "subgroup_left": left}


def test_destroying_the_default_group_destroys_every_group_without_deadlock():
    results = run_processes(_destroy_the_default_group_whose_work_has_a_python_callback, 2, timeout=30)
    assert results[0] == {"result": 16.0, "initialized": False, "subgroup_left": False}
    assert results[1]["result"] == 8.0


def _destroy_the_default_group_while_a_subgroup_work_has_a_python_callback(rank: int, world_size: int) -> float:
    subgroup = dist.new_group(list(range(world_size)))
    tensor = torch.ones(4)
    if rank == 1:
        time.sleep(2)  # rank 0 destroys every group while its subgroup's all-reduce still waits for this rank
        dist.all_reduce(tensor, group=subgroup)
        return tensor.sum().item()
    future = dist.all_reduce(tensor, group=subgroup, async_op=True).get_future()
    future = future.then(lambda done: done.value()[0] * 2)
    world = dist.GroupMember.WORLD
    assert world is not None
    destroy_process_group(world)
    # The subgroup's last reference: on torch 2.2 freeing it joined a Gloo worker that needed the GIL to let go
    # of the callback above, while this thread held the GIL (only the default group's backends were kept).
    del world, subgroup
    return future.wait().sum().item()


def test_destroying_the_default_group_frees_a_busy_subgroup_without_deadlock():
    results = run_processes(_destroy_the_default_group_while_a_subgroup_work_has_a_python_callback, 2, timeout=30)
    assert results == [16.0, 8.0]


def test_the_backward_context_is_out_of_thread_local_state_inside_the_block_and_back_after():
    seen: list[tuple[str, bool]] = []

    def tensor_hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(("before", torch._C._is_key_in_tls("context")))
        with backward_context_out_of_tls():
            seen.append(("inside", torch._C._is_key_in_tls("context")))
        seen.append(("after", torch._C._is_key_in_tls("context")))
        return grad

    weight = torch.ones(3, requires_grad=True)
    weight.register_hook(tensor_hook)
    (weight * 2).sum().backward()
    # torch stashes the caller's contextvars context for the backward; outside a backward the block changes nothing.
    assert seen == [("before", True), ("inside", False), ("after", True)]
    with backward_context_out_of_tls():
        assert not torch._C._is_key_in_tls("context")


def record_context_in_the_engine_hook(rank: int, world_size: int) -> list[bool]:
    from torch import nn

    from lightning_bagua.engine import BaguaDistributedDataParallel
    from lightning_bagua.engine.algorithms import gradient_allreduce

    seen: list[bool] = []
    original = gradient_allreduce.gradient_allreduce_hook

    def recording_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append(torch._C._is_key_in_tls("context"))
        return original(state, bucket)

    gradient_allreduce.GradientAllReduceImpl.communication_hook = lambda self: (self.state, recording_hook)
    model = BaguaDistributedDataParallel(nn.Linear(4, 2), algorithm="gradient_allreduce")
    model(torch.ones(2, 4)).sum().backward()
    model.close()
    return seen


def test_the_engine_runs_its_hooks_without_the_backward_context():
    """What a hook issues must hold no Python object, or a Gloo worker needs the GIL to free it (a deadlock)."""
    assert run_processes(record_context_in_the_engine_hook, 2) == [[False], [False]]


def record_completing_threads(rank: int, world_size: int) -> list[str]:
    import threading
    import time

    from torch import nn

    from lightning_bagua.engine import BaguaDistributedDataParallel
    from lightning_bagua.engine.algorithms import gradient_allreduce

    completed_on: list[str] = []
    original = gradient_allreduce.gradient_allreduce_hook

    def recording_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = original(state, bucket)

        def record(done: torch.futures.Future) -> torch.Tensor:
            # A thread Python did not start (one of Gloo's) shows as a _DummyThread.
            thread = threading.current_thread()
            completed_on.append("foreign" if isinstance(thread, threading._DummyThread) else thread.name)
            return done.value()

        return future.then(record)

    gradient_allreduce.GradientAllReduceImpl.communication_hook = lambda self: (self.state, recording_hook)
    torch.manual_seed(0)
    network = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    # About one layer per bucket, so that some buckets are not the step's last.
    model = BaguaDistributedDataParallel(network, algorithm="gradient_allreduce", bucket_cap_mb=0.25)
    for _ in range(2):
        loss = model(torch.ones(2, 256)).sum()
        if rank == 1:
            time.sleep(0.5)  # rank 0's collectives are still running when its hook returns their futures
        loss.backward()
    model.close()
    return completed_on


def test_the_engine_completes_its_gloo_futures_on_python_threads():
    """A Gloo thread that enters Python while the process forks (a DataLoader worker) can deadlock the child.

    CPython before 3.12 (python/cpython#112275): the thread creates a thread state under a lock that the child
    inherits locked, and the child takes that lock in its fork handler. With torch's own allreduce-then-callback, the
    callback above ran on Gloo's threads on rank 0.
    """
    results = run_processes(record_completing_threads, 2)
    for rank, completed_on in enumerate(results):
        assert len(completed_on) >= 4, completed_on
        assert "foreign" not in completed_on, f"rank {rank}: {completed_on}"
    assert "bagua-communication" in results[0]  # the buckets before the last waited on the executor's worker
