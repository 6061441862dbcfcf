"""A Lightning cluster environment for processes started by Bagua's launcher, or by any launcher that acts alike.

The launcher, not Lightning, creates the processes and hands each one its place in the job through environment
variables:

========================  ==========================================================  ===============
variable                  meaning                                                     when unset
========================  ==========================================================  ===============
``WORLD_SIZE``            number of processes in the job                              error
``RANK``                  global rank of this process                                 error
``LOCAL_RANK``            rank of this process on its node                            ``0``
``NODE_RANK``             index of this process's node                                ``0``
``LOCAL_WORLD_SIZE``      number of processes on each node                            ``None``
``MASTER_ADDR``           address of the rendezvous host                              ``"127.0.0.1"``
``MASTER_PORT``           port of the rendezvous host                                 ``-1``
``BAGUA_SERVICE_PORT``    port of Bagua's service; its presence marks a Bagua launch  ``-1``
========================  ==========================================================  ===============

A variable that is present but not an integer where one is expected (``RANK=abc``) is a :class:`ValueError` that
names the variable and its value, raised when the value is first read.
"""

import logging
import os
from typing import TYPE_CHECKING

from lightning.fabric.plugins.environments import ClusterEnvironment

log = logging.getLogger(__name__)

__all__ = ["BaguaEnvironment"]

_DEFAULT_MAIN_ADDRESS = "127.0.0.1"
_UNSET_PORT = -1

if TYPE_CHECKING:
    # Type-check the mixin against the interface it implements; at run time it stays a plain class, so that it can
    # be combined with the ClusterEnvironment of either Lightning package.
    _LogicBase = ClusterEnvironment
else:
    _LogicBase = object


def _read_int(name: str, default: int | None = None, minimum: int | None = None) -> int:
    """Read an integer environment variable.

    Args:
        name: The variable to read.
        default: The value when the variable is absent; ``None`` makes an absent variable an error.
        minimum: The smallest accepted value, if any.

    Returns:
        The variable's value as an integer, or ``default``.

    Raises:
        ValueError: If the variable is absent and has no default, is not an integer, or is below ``minimum``.
    """
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(
                f"BaguaEnvironment needs the environment variable {name}, but it is not set. Start the processes with"
                " a launcher that sets WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK, MASTER_ADDR and MASTER_PORT"
                " (for example `python -m torch.distributed.run`), or set them yourself."
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} is not an integer.") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"Environment variable {name}={raw!r} must be at least {minimum}.")
    return value


class _BaguaEnvironmentLogic(_LogicBase):
    """Everything :class:`BaguaEnvironment` does, free of any particular Lightning package.

    Lightning ships as two packages (``lightning`` and ``pytorch_lightning``/``lightning_fabric``) whose
    ``ClusterEnvironment`` classes are unrelated, so each package gets its own concrete class that combines this mixin
    with that package's ``ClusterEnvironment``. The mixin must come first in the bases so that its methods replace the
    abstract ones.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """Report that the launcher, not Lightning, starts the processes."""
        return True

    @property
    def main_address(self) -> str:
        """Return the rendezvous address from ``MASTER_ADDR`` (default ``"127.0.0.1"``)."""
        address = os.environ.get("MASTER_ADDR", _DEFAULT_MAIN_ADDRESS)
        if not address.strip():
            # An empty address would otherwise surface much later as an obscure rendezvous failure.
            raise ValueError(f"Environment variable MASTER_ADDR={address!r} is empty.")
        return address

    @property
    def main_port(self) -> int:
        """Return the rendezvous port from ``MASTER_PORT`` (``-1`` when unset)."""
        return _read_int("MASTER_PORT", default=_UNSET_PORT)

    @property
    def service_port(self) -> int:
        """Return the port of Bagua's service from ``BAGUA_SERVICE_PORT`` (``-1`` when unset)."""
        return _read_int("BAGUA_SERVICE_PORT", default=_UNSET_PORT)

    @staticmethod
    def detect() -> bool:
        """Tell whether Bagua's launcher started this process, judged by the presence of ``BAGUA_SERVICE_PORT``."""
        return "BAGUA_SERVICE_PORT" in os.environ

    def world_size(self) -> int:
        """Return the number of processes in the job from ``WORLD_SIZE``.

        Raises:
            ValueError: If ``WORLD_SIZE`` is unset, not an integer, or below 1.
        """
        return _read_int("WORLD_SIZE", minimum=1)

    def set_world_size(self, size: int) -> None:
        """Ignore the request: the launcher decided the world size, and Lightning must not override it."""
        log.debug("BaguaEnvironment ignores set_world_size(%r); the world size comes from WORLD_SIZE.", size)

    def global_rank(self) -> int:
        """Return the rank of this process in the job from ``RANK``.

        Raises:
            ValueError: If ``RANK`` is unset, not an integer, or negative.
        """
        return _read_int("RANK", minimum=0)

    def set_global_rank(self, rank: int) -> None:
        """Ignore the request: the launcher decided the rank, and Lightning must not override it."""
        log.debug("BaguaEnvironment ignores set_global_rank(%r); the rank comes from RANK.", rank)

    def local_rank(self) -> int:
        """Return the rank of this process on its node from ``LOCAL_RANK`` (default 0)."""
        return _read_int("LOCAL_RANK", default=0, minimum=0)

    def node_rank(self) -> int:
        """Return the index of this process's node from ``NODE_RANK`` (default 0)."""
        return _read_int("NODE_RANK", default=0, minimum=0)

    def local_world_size(self) -> int | None:
        """Return the number of processes per node from ``LOCAL_WORLD_SIZE``, used to group ranks into nodes.

        Returns:
            The number of processes on each node, or ``None`` when ``LOCAL_WORLD_SIZE`` is unset. ``None`` means the
            layout is unknown to the environment; callers then fall back on their own knowledge (the Trainer's
            devices per node) rather than on a guess such as "everything on one node", which would be wrong for
            multi-node jobs.

        Raises:
            ValueError: If ``LOCAL_WORLD_SIZE`` is set but not an integer, or below 1.
        """
        if "LOCAL_WORLD_SIZE" not in os.environ:
            return None
        return _read_int("LOCAL_WORLD_SIZE", minimum=1)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check that the Trainer's ``devices`` and ``num_nodes`` describe the job the launcher started.

        Args:
            num_devices: Devices (processes) per node, as configured in Lightning.
            num_nodes: Number of nodes, as configured in Lightning.

        Raises:
            ValueError: If ``num_devices * num_nodes`` differs from ``WORLD_SIZE``, or ``num_devices`` differs from
                ``LOCAL_WORLD_SIZE`` when that is set.
        """
        world_size = self.world_size()
        if num_devices * num_nodes != world_size:
            raise ValueError(
                f"Lightning was configured with devices={num_devices} and num_nodes={num_nodes}"
                f" ({num_devices * num_nodes} processes), but the launcher started WORLD_SIZE={world_size}."
            )
        local_world_size = self.local_world_size()
        if local_world_size is not None and local_world_size != num_devices:
            raise ValueError(
                f"Lightning was configured with devices={num_devices} per node, but the launcher started"
                f" LOCAL_WORLD_SIZE={local_world_size} processes per node."
            )


class BaguaEnvironment(_BaguaEnvironmentLogic, ClusterEnvironment):
    """Cluster environment for jobs whose processes were started by Bagua's launcher.

    Every value is read from the environment variables listed in this module's documentation each time it is asked
    for; nothing is cached, and Lightning's attempts to set the world size or rank are ignored.

    Example:
        Launch with ``python -m torch.distributed.run --nproc_per_node 2 train.py`` plus ``BAGUA_SERVICE_PORT`` in
        the environment, and in ``train.py``::

            trainer = Trainer(strategy=BaguaStrategy(), devices=2, plugins=[BaguaEnvironment()])
    """
