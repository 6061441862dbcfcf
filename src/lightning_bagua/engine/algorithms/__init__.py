"""Bagua's algorithms. Importing this package registers every algorithm this release provides.

It also exports what a third-party algorithm builds on: the interface (:class:`Algorithm`, :class:`AlgorithmImpl`,
:class:`AlgorithmContext`, :class:`HookState`), the keyword and state checkers, and the weight helpers of
:mod:`~lightning_bagua.engine.algorithms.weights`. The documentation's "Writing your own algorithm" page shows one.
"""

from lightning_bagua.engine.algorithms.async_model_average import AsyncModelAverageAlgorithm
from lightning_bagua.engine.algorithms.auto import AutoAlgorithm, AutoDecision, AutoFigures
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    HookState,
    available_algorithms,
    check_keyword_type,
    check_positive_int,
    check_state_keys,
    register_algorithm,
)
from lightning_bagua.engine.algorithms.bytegrad import ByteGradAlgorithm, ByteGradState, bytegrad_hook
from lightning_bagua.engine.algorithms.decentralized import DecentralizedAlgorithm
from lightning_bagua.engine.algorithms.diloco import DiLoCoAlgorithm
from lightning_bagua.engine.algorithms.gradient_allreduce import (
    GradientAllReduceAlgorithm,
    GradientAllReduceState,
    gradient_allreduce_hook,
)
from lightning_bagua.engine.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from lightning_bagua.engine.algorithms.low_rank import LowRankAlgorithm, LowRankState, low_rank_hook
from lightning_bagua.engine.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer, check_qadam_configuration
from lightning_bagua.engine.algorithms.weights import FlatWeights, check_optimizers_cover, group_by_dtype, views_like

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "AutoAlgorithm",
    "AutoDecision",
    "AutoFigures",
    "ByteGradAlgorithm",
    "ByteGradState",
    "DecentralizedAlgorithm",
    "DiLoCoAlgorithm",
    "FlatWeights",
    "GradientAllReduceAlgorithm",
    "GradientAllReduceState",
    "HookState",
    "LowPrecisionDecentralizedAlgorithm",
    "LowRankAlgorithm",
    "LowRankState",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "available_algorithms",
    "bytegrad_hook",
    "check_keyword_type",
    "check_optimizers_cover",
    "check_positive_int",
    "check_qadam_configuration",
    "check_state_keys",
    "gradient_allreduce_hook",
    "group_by_dtype",
    "low_rank_hook",
    "register_algorithm",
    "views_like",
]
