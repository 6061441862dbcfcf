"""Lightning strategies (the ``lightning`` package's; ``lightning_bagua.pytorch_lightning`` has the others)."""

from lightning_bagua.strategies.bagua import BaguaStrategy

__all__ = ["BaguaStrategy"]
