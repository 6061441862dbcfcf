"""The strategy and cluster environment for the standalone ``pytorch_lightning`` package.

``lightning.pytorch`` and ``pytorch_lightning`` define separate class hierarchies, and each Trainer accepts
only its own package's strategies and plugins. These classes share all their logic with
:class:`lightning_bagua.BaguaStrategy` and :class:`lightning_bagua.BaguaEnvironment`::

    import pytorch_lightning as pl
    from lightning_bagua.pytorch_lightning import BaguaStrategy

    trainer = pl.Trainer(strategy=BaguaStrategy(algorithm="gradient_allreduce"))

``pl.Trainer(strategy="bagua")`` selects it without any import.
"""

from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.strategies import DDPStrategy

# The environment is a `lightning_fabric` class, shared with that package's Fabric strategy.
from lightning_bagua.lightning_fabric import AtomicTorchCheckpointIO, BaguaEnvironment
from lightning_bagua.strategies.bagua import _BaguaStrategyLogic

__all__ = ["BaguaEnvironment", "BaguaStrategy"]


class BaguaStrategy(_BaguaStrategyLogic, DDPStrategy):  # type: ignore[misc]
    """:class:`lightning_bagua.BaguaStrategy` for the ``pytorch_lightning`` package."""

    _bagua_environment_cls = BaguaEnvironment
    _checkpoint_io_cls = AtomicTorchCheckpointIO
    _configuration_error = MisconfigurationException
