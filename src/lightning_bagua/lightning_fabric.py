"""The Fabric strategy and cluster environment for the standalone ``lightning_fabric`` package.

``lightning.fabric`` and ``lightning_fabric`` define separate class hierarchies, and each Fabric accepts only its
own package's strategies and plugins. These classes share all their logic with
:class:`lightning_bagua.strategies.fabric.BaguaStrategy` and :class:`lightning_bagua.BaguaEnvironment`::

    from lightning_fabric import Fabric
    from lightning_bagua.lightning_fabric import BaguaStrategy

    fabric = Fabric(strategy=BaguaStrategy(algorithm="gradient_allreduce"), devices=2)

``Fabric(strategy="bagua")`` selects it without any import. The standalone ``pytorch_lightning`` package builds on
``lightning_fabric``, so its Trainer takes this module's :class:`BaguaEnvironment` too.
"""

from lightning_fabric.plugins.environments import ClusterEnvironment
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.exceptions import MisconfigurationException

from lightning_bagua.environments.bagua import _BaguaEnvironmentLogic
from lightning_bagua.strategies._core.checkpoint_io import _AtomicTorchCheckpointIOLogic
from lightning_bagua.strategies.fabric import _FabricBaguaStrategyLogic

__all__ = ["AtomicTorchCheckpointIO", "BaguaEnvironment", "BaguaStrategy"]


class BaguaEnvironment(_BaguaEnvironmentLogic, ClusterEnvironment):
    """:class:`lightning_bagua.BaguaEnvironment` for the ``lightning_fabric`` and ``pytorch_lightning`` packages."""


class AtomicTorchCheckpointIO(_AtomicTorchCheckpointIOLogic, TorchCheckpointIO):
    """:class:`lightning_bagua.strategies._core.checkpoint_io.AtomicTorchCheckpointIO` for ``lightning_fabric``."""


class BaguaStrategy(_FabricBaguaStrategyLogic, DDPStrategy):  # type: ignore[misc]
    """:class:`lightning_bagua.strategies.fabric.BaguaStrategy` for the ``lightning_fabric`` package."""

    _bagua_environment_cls = BaguaEnvironment
    _checkpoint_io_cls = AtomicTorchCheckpointIO
    _configuration_error = MisconfigurationException
