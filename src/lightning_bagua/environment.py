"""lightning-bagua 0.1.0's module path for the cluster environment: ``from lightning_bagua.environment import ...``.

An alias kept for scripts written against 0.1.0; the class lives in :mod:`lightning_bagua.environments.bagua`.
"""

from lightning_bagua.environments.bagua import BaguaEnvironment

__all__ = ["BaguaEnvironment"]
