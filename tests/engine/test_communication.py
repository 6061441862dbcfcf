"""The engine's plumbing: node layout, the ordered executor, the counter."""

import threading
import time

import pytest
import torch

from lightning_bagua.engine import CommunicationCounter, NodeLayout
from lightning_bagua.engine.communication import OrderedExecutor


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
