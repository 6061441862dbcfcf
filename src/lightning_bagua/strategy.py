"""lightning-bagua 0.1.0's module path for the strategy: ``from lightning_bagua.strategy import BaguaStrategy``.

An alias kept for scripts written against 0.1.0; the class lives in :mod:`lightning_bagua.strategies.bagua`.
"""

from lightning_bagua.strategies.bagua import BaguaStrategy

__all__ = ["BaguaStrategy"]
