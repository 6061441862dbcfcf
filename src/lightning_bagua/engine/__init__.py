"""The engine: Bagua's algorithms on ``torch.distributed``. Imports torch only, never Lightning.

Use it from plain PyTorch::

    from lightning_bagua.engine import BaguaDistributedDataParallel

    model = BaguaDistributedDataParallel(model, optimizers=[optimizer], algorithm="gradient_allreduce")
"""

from lightning_bagua.engine.algorithms import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    AsyncModelAverageAlgorithm,
    AutoAlgorithm,
    AutoDecision,
    AutoFigures,
    ByteGradAlgorithm,
    DecentralizedAlgorithm,
    GradientAllReduceAlgorithm,
    HookState,
    LowPrecisionDecentralizedAlgorithm,
    LowRankAlgorithm,
    QAdamAlgorithm,
    QAdamOptimizer,
    available_algorithms,
    register_algorithm,
)
from lightning_bagua.engine.autotune import BucketAutotuner
from lightning_bagua.engine.bucket_layout import BucketLayout
from lightning_bagua.engine.codec import MinMaxUInt8Codec
from lightning_bagua.engine.communication import CommunicationCounter, CommunicationGroups, NodeLayout
from lightning_bagua.engine.data_parallel import DEFAULT_BUCKET_CAP_MB, BaguaDistributedDataParallel
from lightning_bagua.engine.telemetry import CommunicationTelemetry

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "AutoAlgorithm",
    "AutoDecision",
    "AutoFigures",
    "BaguaDistributedDataParallel",
    "BucketAutotuner",
    "BucketLayout",
    "ByteGradAlgorithm",
    "CommunicationCounter",
    "CommunicationGroups",
    "CommunicationTelemetry",
    "DecentralizedAlgorithm",
    "GradientAllReduceAlgorithm",
    "HookState",
    "LowPrecisionDecentralizedAlgorithm",
    "LowRankAlgorithm",
    "MinMaxUInt8Codec",
    "NodeLayout",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "available_algorithms",
    "register_algorithm",
]
