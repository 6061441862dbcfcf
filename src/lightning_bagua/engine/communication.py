"""Process-group plumbing shared by every algorithm: groups, collectives, counting.

The node layout (:mod:`._node_layout`), the ordered executor (:mod:`._executor`) and the counter
(:mod:`._counter`) live in modules of their own and are re-exported here, where the algorithms and users import
them from.
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bagua.engine._counter import CommunicationCounter, CounterRecord, CounterTotals
from lightning_bagua.engine._executor import OrderedExecutor
from lightning_bagua.engine._node_layout import NodeLayout, gather_hosts, host_identity, ranks_per_node_from_hosts
from lightning_bagua.engine._torch_compat import destroy_process_group, process_group_exists

__all__ = [
    "CommunicationCounter",
    "CommunicationGroups",
    "CommunicationHook",
    "CounterRecord",
    "CounterTotals",
    "NodeLayout",
    "OrderedExecutor",
    "all_gather_into",
    "all_to_all_into",
    "batch_schedule",
    "gather_hosts",
    "gloo_threads_batch_scheduled",
    "host_identity",
    "ranks_per_node_from_hosts",
    "start_exchange",
]

log = logging.getLogger(__name__)

GLOO_SCHED_BATCH_VARIABLE = "LIGHTNING_BAGUA_GLOO_SCHED_BATCH"

ProcessGroup = dist.ProcessGroup

CommunicationHook = Callable[[Any, dist.GradBucket], torch.futures.Future]
"""A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``."""


@dataclass
class CommunicationGroups:
    """The engine's own communicators, created once per wrapped model.

    The engine never communicates on the caller's process group directly: it clones it, so that its
    traffic cannot interleave with collectives the training loop issues on that group (metric syncs,
    DDP's own buffer broadcasts, barriers). For hierarchical algorithms it also holds this node's intra-node
    group and, on node leaders, the group of all leaders.

    Every rank of the default process group must create the same groups in the same order, which
    :meth:`create` guarantees when it is called on every rank.
    """

    layout: NodeLayout
    rank: int
    global_ranks: list[int]
    flat: ProcessGroup
    intra_node: ProcessGroup | None = None
    inter_node: ProcessGroup | None = None
    _owned: list[ProcessGroup] = field(default_factory=list, repr=False)

    @classmethod
    def create(
        cls,
        process_group: ProcessGroup | None,
        layout_ranks_per_node: int | None,
        hierarchical: bool,
        timeout: timedelta | None = None,
        device: torch.device | None = None,
    ) -> "CommunicationGroups":
        """Create the groups for ``process_group`` (the default group when ``None``).

        The node layout comes from ``layout_ranks_per_node``, else ``LOCAL_WORLD_SIZE``, else the hosts the ranks
        run on (gathered once, here; see :meth:`NodeLayout.detect`).

        Args:
            process_group: the group the model is replicated over.
            layout_ranks_per_node: processes per node, or ``None`` to read the launch environment or the hosts.
            hierarchical: also create the intra-node and inter-node groups.
            timeout: how long a collective on these groups may wait before it fails; torch's default if ``None``.
            device: the model's device, where the hosts are gathered; the CPU when ``None``.

        Returns:
            The groups; ``close()`` destroys them.
        """
        group = process_group if process_group is not None else dist.group.WORLD
        global_ranks = dist.get_process_group_ranks(group)
        rank = dist.get_rank(group)
        # Every rank takes the same branch: launchers set LOCAL_WORLD_SIZE for all ranks or none.
        from_hosts = layout_ranks_per_node is None and NodeLayout.from_environment() is None
        # A bad explicit layout fails here, before any communicator exists.
        layout = None if from_hosts else NodeLayout.detect(len(global_ranks), layout_ranks_per_node)
        # A bad setting fails here too. new_group takes the default group's backend: decide before it starts threads.
        batch_scheduled = gloo_threads_batch_scheduled() and dist.get_backend() == "gloo"
        threads_before = _thread_ids() if batch_scheduled else set()
        flat = dist.new_group(ranks=global_ranks, timeout=timeout)
        if layout is None:
            hosts = gather_hosts(flat, device if device is not None else torch.device("cpu"))
            layout = NodeLayout.detect(len(global_ranks), hosts=hosts)
        owned = [flat]
        intra_node = inter_node = None
        # With one node, or one rank per node, a second level adds latency and changes nothing.
        if hierarchical and layout.num_nodes > 1 and layout.ranks_per_node > 1:
            # new_group must be entered by every rank for every group, members or not.
            for node in range(layout.num_nodes):
                node_group = dist.new_group(ranks=[global_ranks[r] for r in layout.node_ranks(node)], timeout=timeout)
                owned.append(node_group)
                if node == layout.node_of(rank):
                    intra_node = node_group
            leaders_group = dist.new_group(ranks=[global_ranks[r] for r in layout.leaders()], timeout=timeout)
            owned.append(leaders_group)
            if rank in layout.leaders():
                inter_node = leaders_group
        if batch_scheduled:
            scheduled = batch_schedule(_thread_ids() - threads_before)
            log.debug("%d threads of the engine's Gloo groups run under SCHED_BATCH", len(scheduled))
        return cls(layout, rank, global_ranks, flat, intra_node, inter_node, owned)

    @property
    def world_size(self) -> int:
        """Number of ranks in the replicated group."""
        return len(self.global_ranks)

    @property
    def is_hierarchical(self) -> bool:
        """Whether communication runs in two levels (intra-node groups were created)."""
        return self.intra_node is not None

    @property
    def is_node_leader(self) -> bool:
        """Whether this rank is local rank 0 of its node."""
        return self.rank % self.layout.ranks_per_node == 0

    @property
    def node_leader_global_rank(self) -> int:
        """Global rank of this node's leader (collectives address ranks globally)."""
        return self.global_ranks[self.layout.node_ranks(self.layout.node_of(self.rank))[0]]

    def close(self) -> None:
        """Destroy the communicators this object created; safe to call twice.

        Groups torch no longer knows are skipped: destroying the default group (as many scripts do at their end)
        destroyed them already, even if a new default group was started since.
        """
        for group in self._owned:
            if process_group_exists(group):
                destroy_process_group(group)
        self._owned.clear()


def all_reduce_hierarchically(
    tensor: Tensor, groups: CommunicationGroups, counter: CommunicationCounter, inter_node: Callable[[Tensor], None]
) -> Tensor:
    """Reduce ``tensor`` in two levels and return it, holding the sum over every rank (or what ``inter_node`` makes).

    1. Sum the tensors of the ranks of each node on the node's leader (local rank 0), at full precision.
    2. On the leaders only, run ``inter_node`` on the node sums: the algorithm's inter-node communication
       (a plain all-reduce, or a compressed one), with one participant per node.
    3. Broadcast the leader's result to the ranks of its node.

    Blocks until done; call it from an :class:`OrderedExecutor` job.

    Args:
        tensor: this rank's flat buffer; overwritten with the result.
        groups: the engine's groups, created with ``hierarchical=True``.
        counter: where the collectives are recorded.
        inter_node: works in place on the leader's node sum, communicating over ``groups.inter_node``.

    Returns:
        ``tensor``.
    """
    assert groups.intra_node is not None, "all_reduce_hierarchically needs groups created with hierarchical=True"
    leader = groups.node_leader_global_rank
    nbytes = tensor.numel() * tensor.element_size()
    # The leader is the reduce's destination and the broadcast's source: it receives the first, others the second.
    counter.record("reduce", tensor, received=nbytes if groups.is_node_leader else 0)
    dist.reduce(tensor, dst=leader, op=dist.ReduceOp.SUM, group=groups.intra_node)
    if groups.is_node_leader:
        inter_node(tensor)
    counter.record("broadcast", tensor, received=0 if groups.is_node_leader else nbytes)
    dist.broadcast(tensor, src=leader, group=groups.intra_node)
    return tensor


def gloo_threads_batch_scheduled() -> bool:
    """Whether the engine runs the threads of its Gloo groups under ``SCHED_BATCH`` (see :func:`batch_schedule`).

    Yes on Linux unless ``LIGHTNING_BAGUA_GLOO_SCHED_BATCH=0``; never where the platform lacks the policy.

    Raises:
        ValueError: if ``LIGHTNING_BAGUA_GLOO_SCHED_BATCH`` is neither ``0`` nor ``1``.
    """
    value = os.environ.get(GLOO_SCHED_BATCH_VARIABLE, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{GLOO_SCHED_BATCH_VARIABLE}={value!r} must be 1 (run the engine's Gloo threads under SCHED_BATCH, the"
            " default) or 0 (leave them as torch starts them)."
        )
    return value == "1" and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")


def batch_schedule(thread_ids: set[int]) -> list[int]:
    """Put the given threads of this process under Linux's ``SCHED_BATCH`` policy; return those it applied to.

    The engine gives it the threads that creating its Gloo groups started: each group's I/O loop and its
    workers. Gloo's I/O loop only *tries* the lock of a connection, and when the thread that holds it is writing
    to that socket, it returns at once to ``epoll``, which reports the socket ready again: it spins. Woken by
    traffic while the writer holds the lock, it can preempt the writer on the writer's core, and the writer cannot
    finish and release the lock until the scheduler's tick ends the loop's slice. On a host whose cores are busy
    (CPU training, or several ranks per host) an exchange of a few kB then takes a whole tick instead of the
    fraction of a millisecond it needs, at random. ``SCHED_BATCH`` changes one thing: a woken thread does not
    preempt the running one. The threads keep their share of the CPU, and an idle core still takes them at once.

    Threads that have ended meanwhile, or that the process may not change, are skipped.

    Args:
        thread_ids: thread ids of this process (``/proc/self/task``).

    Returns:
        The ids now under ``SCHED_BATCH``, sorted.
    """
    applied = []
    for thread_id in sorted(thread_ids):
        try:
            os.sched_setscheduler(thread_id, os.SCHED_BATCH, os.sched_param(0))
        except OSError as error:  # ended since it was listed, or not ours to change: it keeps its policy
            log.debug("Thread %d keeps its scheduling policy: %s", thread_id, error)
            continue
        applied.append(thread_id)
    return applied


def start_exchange(operations: list[dist.P2POp]) -> list[dist.Work]:
    """Start point-to-point operations with every receive posted before any send, and return their works.

    Gloo's TCP transport writes a send's payload only once the peer has announced the matching receive, and the
    announcement travels on the same connection as the announcer's own payloads. A receive posted after a send
    announces itself behind that send's payload: on a slow link the two directions of an exchange then take turns
    instead of running together, which doubles its time. Posting receives first puts every announcement ahead of
    every payload. NCCL starts a batch as one group, so the order costs it nothing.

    Args:
        operations: the sends and receives, in any order.

    Returns:
        One work per operation, receives first; wait on all of them.
    """
    receives = [operation for operation in operations if operation.op is dist.irecv]
    sends = [operation for operation in operations if operation.op is not dist.irecv]
    return dist.batch_isend_irecv(receives + sends) if operations else []


def _thread_ids() -> set[int]:
    """Ids of this process's threads; empty where ``/proc`` does not list them (not Linux)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def all_to_all_into(output: Tensor, tensor: Tensor, group: ProcessGroup | None) -> None:
    """Send row ``j`` of ``tensor`` to rank ``j`` of ``group``; row ``i`` of ``output`` arrives from rank ``i``.

    Blocks until done. On CPU the rows travel point to point through :func:`start_exchange`, since Gloo's
    all-to-all posts its sends before its receives (see there); elsewhere it is the backend's all-to-all.

    Args:
        output: a tensor shaped like ``tensor``; row ``i`` receives rank ``i``'s row for this rank.
        tensor: one row per rank of ``group``.
        group: the process group.
    """
    if tensor.device.type != "cpu":
        dist.all_to_all_single(output, tensor, group=group)
        return
    _exchange_with_every_peer(output, lambda index: tensor[index], group)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same arguments); older releases have only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(output: Tensor, tensor: Tensor, group: ProcessGroup | None) -> None:
    """Gather ``tensor`` from every rank of ``group`` into ``output`` (rank-major), blocking until done.

    On CPU each rank sends its tensor to every other one point to point through :func:`start_exchange` (as many
    bytes leave each rank as in Gloo's ring, without its send-before-receive stalls); elsewhere it is the
    backend's all-gather.

    Args:
        output: a tensor of ``group size * tensor.numel()`` elements.
        tensor: this rank's contribution.
        group: the process group.
    """
    if tensor.device.type != "cpu":
        _all_gather_single(output, tensor, group=group)
        return
    flat = tensor.reshape(-1)
    _exchange_with_every_peer(output.view(-1, flat.numel()), lambda _: flat, group)


def _exchange_with_every_peer(rows: Tensor, outgoing: Callable[[int], Tensor], group: ProcessGroup | None) -> None:
    """Send ``outgoing(i)`` to rank ``i`` of ``group`` and receive row ``i`` of ``rows`` from it, for every other rank.

    This rank's own row is ``outgoing(me)``, copied in place. Blocks until every exchange is done.
    """
    if group is None:
        ranks, me = list(range(dist.get_world_size())), dist.get_rank()
    else:
        ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)
    rows[me].copy_(outgoing(me))
    operations = []
    for index, peer in enumerate(ranks):
        if index != me:
            operations.append(dist.P2POp(dist.irecv, rows[index], peer, group))
            operations.append(dist.P2POp(dist.isend, outgoing(index), peer, group))
    for work in start_exchange(operations):
        work.wait()
