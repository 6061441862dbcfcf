"""The engine's plumbing: node layout, the ordered executor, the counter."""

import logging
import os
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import (
    Algorithm,
    BaguaDistributedDataParallel,
    CommunicationCounter,
    NodeLayout,
    _node_layout,
)
from lightning_bagua.engine._cuda_graphs import CUDA_GRAPHS_VARIABLE, cuda_graphs_enabled
from lightning_bagua.engine.communication import (
    CounterTotals,
    OrderedExecutor,
    all_gather_into,
    all_to_all_into,
    batch_schedule,
    gloo_threads_batch_scheduled,
    host_identity,
    ranks_per_node_from_hosts,
    start_exchange,
)
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


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["a", "a", "b", "b"], 2),
        (["a", "b", "c", "d"], 1),
        (["a"] * 4, 4),
        (["a", "b", "a", "b"], None),  # interleaved: the two-level groups need consecutive ranks per host
        (["a", "a", "a", "b"], None),  # uneven
        (["a", "a", "b", "b", "a", "a"], None),  # one host in two blocks
    ],
)
def test_ranks_per_node_from_hosts_only_for_equal_consecutive_blocks(hosts, expected):
    assert ranks_per_node_from_hosts(hosts) == expected


def test_node_layout_detect_from_hosts_after_argument_and_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    layout = NodeLayout.detect(4, hosts=["h/10.0.0.1", "h/10.0.0.1", "h/10.0.0.2", "h/10.0.0.2"])
    assert (layout.num_nodes, layout.source, layout.trusted) == (2, "hosts", True)
    irregular = NodeLayout.detect(4, hosts=["a", "b", "a", "b"])
    assert (irregular.ranks_per_node, irregular.source, irregular.trusted) == (1, "irregular hosts", False)
    assert NodeLayout.detect(4, ranks_per_node=4, hosts=["a", "b", "a", "b"]).source == "argument"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert NodeLayout.detect(4, hosts=["a", "b", "c", "d"]).num_nodes == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="hosts of 3 ranks for a world size of 4"):
        NodeLayout.detect(4, hosts=["a", "a", "b"])


def test_host_identity_names_the_host_and_its_route_to_the_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert host_identity() == f"{socket.gethostname()}/127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    assert host_identity() == socket.gethostname()  # no rendezvous to route to: the host name alone


def _wrap_with_simulated_hosts(rank: int, world_size: int, hosts: list[str] | None, kwargs: dict) -> dict:
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # as under a plain env:// launcher
    if hosts is not None:
        _node_layout.host_identity = lambda: hosts[dist.get_rank()]  # type: ignore[assignment]
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_bagua.engine.data_parallel").addHandler(handler)
    layouts, bytes_by_op = [], []
    for _ in range(2):  # a second wrap (as autotuning's rewrapping does) must not repeat the warning
        torch.manual_seed(0)
        model = BaguaDistributedDataParallel(nn.Linear(8, 4), algorithm="bytegrad", **kwargs)
        model(torch.randn(3, 8)).sum().backward()
        layout = model.communication_groups.layout
        layouts.append((layout.ranks_per_node, layout.source, layout.hosts))
        bytes_by_op.append(sorted(model.communication_counter.bytes_by_op))
        model.close()
    return {"layouts": layouts, "ops": bytes_by_op, "messages": messages}


def test_layout_from_two_simulated_hosts_is_two_level_and_silent():
    hosts = ["node/10.0.0.1", "node/10.0.0.1", "node/10.0.0.2", "node/10.0.0.2"]  # one host name, two addresses
    results = run_processes(_wrap_with_simulated_hosts, 4, hosts, {})
    for rank, result in enumerate(results):
        assert result["layouts"][0] == (2, "hosts", tuple(hosts)), f"rank {rank}"
        # Full precision inside the host; the 8-bit exchange only among the two leaders.
        assert ("all_to_all" in result["ops"][0]) == (rank % 2 == 0), f"rank {rank}: {result['ops']}"
        assert result["messages"] == []


def test_interleaved_simulated_hosts_warn_once_from_rank_zero_and_compress_everywhere():
    hosts = ["a/10.0.0.1", "b/10.0.0.2", "a/10.0.0.1", "b/10.0.0.2"]
    results = run_processes(_wrap_with_simulated_hosts, 4, hosts, {})
    for rank, result in enumerate(results):
        assert result["layouts"][0][:2] == (1, "irregular hosts")
        assert "all_to_all" in result["ops"][0], f"rank {rank}: every rank is a node, all compress"
    (message,) = results[0]["messages"]
    for part in ("show no node layout", "0: a/10.0.0.1, 1: b/10.0.0.2", "LOCAL_WORLD_SIZE", "hierarchical=False"):
        assert part in message
    assert all(result["messages"] == [] for result in results[1:])


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_real_host_warns_that_hierarchical_bytegrad_compresses_nothing(world_size):
    results = run_processes(_wrap_with_simulated_hosts, world_size, None, {})
    host = f"{socket.gethostname()}/127.0.0.1"  # tests.distributed rendezvous at 127.0.0.1
    for result in results:
        assert result["layouts"][0] == (world_size, "hosts", (host,) * world_size)
        assert "all_to_all" not in result["ops"][0]
    (message,) = results[0]["messages"]
    assert f"bytegrad (hierarchical=True) found a single node of {world_size} ranks" in message
    assert f"every rank runs on host {host}" in message
    for part in ("nothing is compressed", "LOCAL_WORLD_SIZE", "hierarchical=False"):
        assert part in message
    assert all(result["messages"] == [] for result in results[1:])


def test_an_explicit_layout_of_two_nodes_gathers_no_hosts_and_does_not_warn():
    results = run_processes(_wrap_with_simulated_hosts, 2, ["a", "b"], {"ranks_per_node": 1})
    assert all(result["layouts"][0] == (1, "argument", ()) for result in results)
    assert all(result["messages"] == [] for result in results)


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


def test_counter_lists_what_a_block_records_and_counts_it_again_on_replay():
    counter = CommunicationCounter()
    counter.record("all_reduce", torch.zeros(2))
    with counter.logged() as records:
        counter.record("all_to_all", torch.zeros(8, dtype=torch.uint8), received=4, uncompressed=32)
        counter.record("all_gather", torch.zeros(4, dtype=torch.uint8), received=4, uncompressed=16)
    counter.record("broadcast", torch.zeros(1))  # after the block: not listed
    assert records == [("all_to_all", 8, 4, 32), ("all_gather", 4, 4, 16)]
    once = counter.totals()
    counter.replay(records)
    assert counter.totals() - once == CounterTotals(12, 8, 48, 2)
    assert counter.calls == {"all_reduce": 1, "all_to_all": 2, "all_gather": 2, "broadcast": 1}


def test_counter_lists_only_the_recording_thread():
    counter = CommunicationCounter()
    with counter.logged() as records:
        other = threading.Thread(target=lambda: counter.record("all_reduce", torch.zeros(3)))
        other.start()
        other.join()
        counter.record("all_reduce", torch.zeros(1))
    assert records == [("all_reduce", 4, 4, 4)]
    assert counter.bytes_sent == 16


def test_executor_runs_bucket_jobs_eagerly_off_cuda_and_captures_no_graph():
    executor = OrderedExecutor(torch.device("cpu"))
    counter = CommunicationCounter()

    def job(tensor: torch.Tensor) -> torch.Tensor:
        counter.record("all_reduce", tensor)
        return tensor.mul_(2)

    buffer = torch.ones(4)
    for _ in range(4):
        executor.submit_bucket(("bytegrad", 0, 4, torch.float32), buffer, job, counter).wait()
    assert torch.equal(buffer, torch.full((4,), 16.0))
    assert counter.calls == {"all_reduce": 4}
    assert executor.graphs.captured == 0
    executor.close()


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("1", True), ("0", False), ("off", False), (" False ", False), ("no", False)]
)
def test_cuda_graphs_follow_the_environment_variable(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(CUDA_GRAPHS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(CUDA_GRAPHS_VARIABLE, value)
    assert cuda_graphs_enabled() is expected


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


def test_executor_runs_the_last_job_inline_only_when_nothing_is_unfinished():
    executor = OrderedExecutor(torch.device("cpu"))
    order: list[tuple[int, str]] = []
    release = threading.Event()

    def job(index: int) -> torch.Tensor:
        if index == 0:
            release.wait(5)
        order.append((index, threading.current_thread().name))
        return torch.tensor([index])

    # Behind an unfinished job, the last bucket queues: it must not overtake it.
    first = executor.submit(lambda: job(0))
    second = executor.submit(lambda: job(1), last=True)
    release.set()
    assert [int(first.wait()), int(second.wait())] == [0, 1]
    assert order == [(0, "bagua-communication"), (1, "bagua-communication")]
    # With nothing unfinished it runs in the calling thread, its future already complete; a failure still
    # reaches the future instead of the caller.
    inline = executor.submit(lambda: job(2), last=True)
    assert inline.done()
    assert int(inline.wait()) == 2
    assert order[-1] == (2, threading.current_thread().name)

    def failing() -> torch.Tensor:
        raise RuntimeError("collective timed out")

    with pytest.raises(RuntimeError, match="collective timed out"):
        executor.submit(failing, last=True).wait()
    executor.close()


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


def _thread_policies() -> dict[int, tuple[str, int]]:
    policies = {}
    for name in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{name}/comm") as comm:
            policies[int(name)] = (comm.read().strip(), os.sched_getscheduler(int(name)))
    return policies


def _scheduling_of_the_engine_threads(rank: int, world_size: int, hierarchical: bool) -> dict[str, Any]:
    before = _thread_policies()
    model = BaguaDistributedDataParallel(
        nn.Linear(8, 4), algorithm=Algorithm.init("bytegrad", hierarchical=hierarchical), ranks_per_node=2
    )
    after = _thread_policies()
    model(torch.randn(3, 8)).sum().backward()  # the batch-scheduled threads still communicate
    gradient = next(model.parameters()).grad.clone()
    check = gradient.clone()
    dist.all_reduce(check)  # on the default group, whose threads are torch's own
    model.close()
    new = {tid: policy for tid, policy in after.items() if tid not in before}
    # Compared by policy alone: a thread may name itself after it starts.
    changed = {tid: after[tid] for tid, (_, policy) in before.items() if tid in after and after[tid][1] != policy}
    return {
        "old_changed": changed,
        "old_policies": {policy for _, policy in before.values()},
        "new_batch": sorted(name for name, policy in new.values() if policy == os.SCHED_BATCH),
        "new_other": sorted(name for name, policy in new.values() if policy != os.SCHED_BATCH),
        "same_gradient_everywhere": torch.allclose(check / world_size, gradient, atol=1e-6),
    }


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is a Linux scheduling policy")
@pytest.mark.parametrize(("world_size", "hierarchical"), [(2, False), (4, True)])
def test_engine_runs_the_threads_of_its_gloo_groups_under_sched_batch(world_size, hierarchical):
    results = run_processes(_scheduling_of_the_engine_threads, world_size, hierarchical)
    for rank, result in enumerate(results):
        assert result["old_changed"] == {}, f"rank {rank}: threads that existed before the wrapper changed policy"
        assert result["old_policies"] == {os.SCHED_OTHER}, f"rank {rank}"
        # One I/O loop and its workers per group: the flat group, and with two levels the node's and the leaders'.
        assert len(result["new_batch"]) >= (3 if hierarchical else 1), f"rank {rank}: {result}"
        # Only the engine's executor (a Python thread) may keep the default; every Gloo thread is batch-scheduled.
        assert not any(name.startswith(("gloo", "pt_gloo")) for name in result["new_other"]), f"rank {rank}: {result}"
        assert result["same_gradient_everywhere"], f"rank {rank}"


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is a Linux scheduling policy")
def test_engine_leaves_its_gloo_threads_alone_when_told_to():
    results = run_processes(_scheduling_of_the_engine_threads, 2, False, env={"LIGHTNING_BAGUA_GLOO_SCHED_BATCH": "0"})
    for result in results:
        assert result["new_batch"] == [], result
        assert result["same_gradient_everywhere"]


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False)])
def test_gloo_threads_batch_scheduled_reads_its_variable(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("LIGHTNING_BAGUA_GLOO_SCHED_BATCH", raising=False)
    else:
        monkeypatch.setenv("LIGHTNING_BAGUA_GLOO_SCHED_BATCH", value)
    assert gloo_threads_batch_scheduled() is (expected and hasattr(os, "SCHED_BATCH"))


def test_batch_schedule_skips_threads_that_have_ended():
    if not hasattr(os, "SCHED_BATCH"):
        assert gloo_threads_batch_scheduled() is False
        return
    with open("/proc/sys/kernel/pid_max") as pid_max:
        no_such_thread = int(pid_max.read()) + 1  # as a thread that ended between listing and scheduling
    assert batch_schedule({no_such_thread}) == []
