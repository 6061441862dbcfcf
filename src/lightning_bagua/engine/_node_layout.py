"""Which ranks share a node: from the launch (``LOCAL_WORLD_SIZE``), an argument, or the hosts the ranks run on.

Hierarchical algorithms reduce inside a node before they communicate between nodes, so they need the layout
before they create any group; :class:`NodeLayout` holds it and :meth:`NodeLayout.detect` finds it.
"""

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["NodeLayout", "gather_hosts", "host_identity", "ranks_per_node_from_hosts"]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class NodeLayout:
    """How the ranks of a process group are laid out on nodes: consecutive blocks of ``ranks_per_node``.

    Args:
        world_size: number of ranks in the process group.
        ranks_per_node: ranks on each node; must divide ``world_size``.
        source: where ``ranks_per_node`` came from: ``"argument"``, ``"LOCAL_WORLD_SIZE"``, ``"hosts"``,
            ``"irregular hosts"`` (the hosts gave no regular layout, so every rank counts as its own node) or
            ``"nothing"`` (no information: one node).
        hosts: the host of every rank, when the layout was derived from them.
    """

    world_size: int
    ranks_per_node: int
    source: str = field(default="argument", compare=False)
    hosts: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"`world_size` must be at least 1, got {self.world_size}.")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"`ranks_per_node={self.ranks_per_node}` does not divide the world size {self.world_size}:"
                " every node must run the same number of processes. Set LOCAL_WORLD_SIZE (or the wrapper's"
                " `ranks_per_node`) to the number of processes on each node."
            )

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.world_size // self.ranks_per_node

    @property
    def trusted(self) -> bool:
        """Whether the layout reflects where the ranks run (``False`` when the hosts gave no regular layout)."""
        return self.source != "irregular hosts"

    def node_of(self, rank: int) -> int:
        """Return the node that holds group rank ``rank``."""
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Return the group ranks on ``node``, leader (local rank 0) first."""
        start = node * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def leaders(self) -> list[int]:
        """Return the group rank of every node's leader."""
        return [node * self.ranks_per_node for node in range(self.num_nodes)]

    @staticmethod
    def from_environment() -> int | None:
        """Return the processes per node that ``LOCAL_WORLD_SIZE`` gives, or ``None`` when it is unset."""
        env_value = os.environ.get("LOCAL_WORLD_SIZE")
        if env_value is None:
            return None
        try:
            return int(env_value)
        except ValueError:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={env_value!r} is not an integer; it must be the number of processes on each node."
            ) from None

    @classmethod
    def detect(
        cls, world_size: int, ranks_per_node: int | None = None, hosts: Sequence[str] | None = None
    ) -> "NodeLayout":
        """Build the layout from, in this order: ``ranks_per_node``, ``LOCAL_WORLD_SIZE``, the ranks' hosts.

        ``LOCAL_WORLD_SIZE`` is set by torchrun, Lightning's launcher and ours. ``hosts`` (see
        :func:`gather_hosts`) give the layout when their ranks form equal blocks of consecutive ranks per host;
        otherwise every rank counts as its own node and the layout is not :attr:`trusted`. With none of the three,
        all ranks count as one node.

        Args:
            world_size: number of ranks in the process group.
            ranks_per_node: processes per node, if the caller knows it.
            hosts: the host of every rank, by group rank.

        Returns:
            The layout.
        """
        if ranks_per_node is not None:
            return cls(world_size, ranks_per_node, "argument")
        from_env = cls.from_environment()
        if from_env is not None:
            return cls(world_size, from_env, "LOCAL_WORLD_SIZE")
        if hosts is None:
            return cls(world_size, world_size, "nothing")
        if len(hosts) != world_size:
            raise ValueError(f"Got the hosts of {len(hosts)} ranks for a world size of {world_size}.")
        derived = ranks_per_node_from_hosts(hosts)
        if derived is None:
            return cls(world_size, 1, "irregular hosts", tuple(hosts))
        return cls(world_size, derived, "hosts", tuple(hosts))


def ranks_per_node_from_hosts(hosts: Sequence[str]) -> int | None:
    """Return the ranks per node that ``hosts`` (the host of every rank) show, or ``None`` if they show none.

    A layout is only returned when every host runs the same number of ranks and those ranks are consecutive,
    which is what the engine's two-level groups assume (and how launchers number ranks).

    Example:
        >>> ranks_per_node_from_hosts(["a", "a", "b", "b"]), ranks_per_node_from_hosts(["a", "b", "a", "b"])
        (2, None)
    """
    if not hosts:
        return None
    block = hosts.count(hosts[0])
    if len(hosts) % block:
        return None
    starts = range(0, len(hosts), block)
    blocks = [hosts[start : start + block] for start in starts]
    if any(len(set(ranks)) != 1 for ranks in blocks) or len({ranks[0] for ranks in blocks}) != len(blocks):
        return None
    return block


# A host name (at most 253 bytes) and an IPv6 address fit: the labels are never cut.
_HOST_LABEL_BYTES = 320


def host_identity() -> str:
    """Return what tells this process's host from the others: its host name and the address it is reached at.

    Host names alone can collide (containers and network namespaces share them), so the label also names the
    local address this process routes to the rendezvous host from (the TCP store's host, or ``MASTER_ADDR``):
    processes of one host reach it from the same address, processes of different hosts from their own. Working
    the route out sends nothing.
    """
    name = socket.gethostname()
    target = _rendezvous_host()
    address = _local_address_towards(target) if target else None
    return f"{name}/{address}" if address else name


def _rendezvous_host() -> str | None:
    try:
        # Private, hence guarded: the store the default group was rendezvoused through.
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore) and store.host:
            return str(store.host)
    except (AttributeError, RuntimeError, ValueError):
        pass
    return os.environ.get("MASTER_ADDR") or None


def _local_address_towards(host: str) -> str | None:
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)  # a datagram socket's connect only picks the route
            return str(probe.getsockname()[0])
    except (OSError, IndexError, UnicodeError):
        return None


def gather_hosts(group: ProcessGroup | None, device: torch.device) -> list[str]:
    """Return :func:`host_identity` of every rank of ``group``, by group rank (a collective: call it on all ranks).

    Args:
        group: the process group.
        device: where the backend takes tensors (the model's device).

    Returns:
        One label per rank.
    """
    encoded = host_identity().encode()[:_HOST_LABEL_BYTES]
    mine = torch.zeros(_HOST_LABEL_BYTES, dtype=torch.uint8)
    mine[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(label.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for label in gathered]
