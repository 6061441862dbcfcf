"""The engine's plumbing: node layout, the ordered executor, the counter."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_bagua.engine import CommunicationCounter, NodeLayout
from lightning_bagua.engine.communication import OrderedExecutor, all_gather_into, all_to_all_into, start_exchange
from tests.distributed import run_processes


def test_node_layout_of_two_nodes():
    layout = NodeLayout(world_size=4, ranks_per_node=2)
    assert layout.num_nodes == 2
    assert [layout.node_of(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert layout.node_ranks(1) == [2, 3]
    assert layout.leaders() == [0, 2]


def test_node_layout_rejects_uneven_nodes_with_the_fix():
    with pytest.raises(ValueError, match=r"`ranks_per_node=3` does not divide the world size 4.*LOCAL_WORLD_SIZE"):
        NodeLayout(world_size=4, ranks_per_node=3)


def test_node_layout_detect_reads_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert NodeLayout.detect(8).num_nodes == 4
    assert NodeLayout.detect(8, ranks_per_node=8).num_nodes == 1  # an explicit value wins
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert NodeLayout.detect(8).num_nodes == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two' is not an integer"):
        NodeLayout.detect(8)


def test_counter_counts_bytes_and_calls_per_operation():
    counter = CommunicationCounter()
    counter.record("all_reduce", torch.zeros(10))
    counter.record("all_reduce", torch.zeros(5, dtype=torch.float16))
    counter.record("broadcast", torch.zeros(3, dtype=torch.uint8))
    assert counter.bytes_by_op == {"all_reduce": 50, "broadcast": 3}
    assert counter.calls == {"all_reduce": 2, "broadcast": 1}
    assert counter.bytes_sent == 53
    counter.reset()
    assert counter.bytes_sent == 0
    assert counter.calls == {}


def test_executor_runs_cpu_jobs_in_submission_order_off_the_calling_thread():
    executor = OrderedExecutor(torch.device("cpu"))
    assert not executor.runs_inline
    order: list[int] = []
    threads: set[str] = set()

    def job(index: int, delay: float) -> torch.Tensor:
        time.sleep(delay)  # an earlier, slower job must still finish first
        order.append(index)
        threads.add(threading.current_thread().name)
        return torch.tensor([index])

    futures = [executor.submit(lambda i=i: job(i, 0.05 if i == 0 else 0.0)) for i in range(5)]
    assert [int(future.wait()) for future in futures] == [0, 1, 2, 3, 4]
    assert order == [0, 1, 2, 3, 4]
    assert threads == {"bagua-communication"}
    executor.close()
    assert not any(thread.name == "bagua-communication" for thread in threading.enumerate())


def test_executor_hands_a_failed_job_to_the_future_and_keeps_working():
    executor = OrderedExecutor(torch.device("cpu"))

    def failing() -> torch.Tensor:
        raise RuntimeError("collective timed out")

    failed = executor.submit(failing)
    with pytest.raises(RuntimeError, match="collective timed out"):
        failed.wait()
    assert int(executor.submit(lambda: torch.tensor([7])).wait()) == 7
    executor.close()
    executor.close()  # idempotent


def test_start_exchange_posts_every_receive_before_any_send(monkeypatch):
    started: list[list[dist.P2POp]] = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda operations: started.append(operations) or [])
    a, b, c, d = (torch.zeros(2) for _ in range(4))
    # Stand-ins for dist.P2POp, which needs a process group to exist; start_exchange reads only `op`.
    operations = [
        SimpleNamespace(op=dist.isend, tensor=a),
        SimpleNamespace(op=dist.irecv, tensor=b),
        SimpleNamespace(op=dist.isend, tensor=c),
        SimpleNamespace(op=dist.irecv, tensor=d),
    ]
    start_exchange(operations)
    (posted,) = started
    assert [(operation.op, operation.tensor) for operation in posted] == [
        (dist.irecv, b),
        (dist.irecv, d),
        (dist.isend, a),
        (dist.isend, c),
    ]
    assert start_exchange([]) == []


def _point_to_point_against_collectives(rank: int, world_size: int) -> dict[str, bool]:
    # Every rank joins every new_group call; the odd ranks form a subgroup whose group ranks differ from global ones.
    odd = dist.new_group([r for r in range(world_size) if r % 2])
    outcomes = {}
    for name, group in (("world", None), ("odd", odd)):
        if group is not None and rank % 2 == 0:
            continue
        n = dist.get_world_size(group)
        for dtype in (torch.uint8, torch.float32):
            generator = torch.Generator().manual_seed(100 * rank + n)
            rows = (torch.rand(n, 37, generator=generator) * 200).to(dtype)
            ours, theirs = torch.empty_like(rows), torch.empty_like(rows)
            all_to_all_into(ours, rows, group)
            dist.all_to_all_single(theirs, rows, group=group)
            outcomes[f"all_to_all {name} {dtype}"] = torch.equal(ours, theirs)
            mine = rows[0]
            ours, theirs = torch.empty(n, 37, dtype=dtype), torch.empty(n * 37, dtype=dtype)
            all_gather_into(ours, mine, group)
            dist.all_gather_into_tensor(theirs, mine, group=group)
            outcomes[f"all_gather {name} {dtype}"] = torch.equal(ours.view(-1), theirs)
    return outcomes


@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_point_to_point_exchanges_equal_gloo_collectives(world_size):
    results = run_processes(_point_to_point_against_collectives, world_size)
    for rank, outcomes in enumerate(results):
        assert outcomes, f"rank {rank} compared nothing"
        assert all(outcomes.values()), f"rank {rank}: {outcomes}"
        assert len(outcomes) == (8 if rank % 2 else 4), f"rank {rank}: {sorted(outcomes)}"
