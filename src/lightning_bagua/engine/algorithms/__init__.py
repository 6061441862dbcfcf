"""Bagua's algorithms. Importing this package registers every algorithm this release provides."""

from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    available_algorithms,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.gradient_allreduce import (
    GradientAllReduceAlgorithm,
    GradientAllReduceState,
    gradient_allreduce_hook,
)

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "GradientAllReduceAlgorithm",
    "GradientAllReduceState",
    "available_algorithms",
    "gradient_allreduce_hook",
    "register_algorithm",
]
