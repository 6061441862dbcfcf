"""Bagua's algorithms. Importing this package registers every algorithm this release provides."""

from lightning_bagua.engine.algorithms.async_model_average import AsyncModelAverageAlgorithm
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    available_algorithms,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.bytegrad import ByteGradAlgorithm, ByteGradState, bytegrad_hook
from lightning_bagua.engine.algorithms.decentralized import DecentralizedAlgorithm
from lightning_bagua.engine.algorithms.gradient_allreduce import (
    GradientAllReduceAlgorithm,
    GradientAllReduceState,
    gradient_allreduce_hook,
)
from lightning_bagua.engine.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from lightning_bagua.engine.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer, check_qadam_configuration

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "ByteGradAlgorithm",
    "ByteGradState",
    "DecentralizedAlgorithm",
    "GradientAllReduceAlgorithm",
    "GradientAllReduceState",
    "LowPrecisionDecentralizedAlgorithm",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "available_algorithms",
    "bytegrad_hook",
    "check_qadam_configuration",
    "gradient_allreduce_hook",
    "register_algorithm",
]
