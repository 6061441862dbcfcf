"""Bagua's communication algorithms for PyTorch Lightning, implemented on ``torch.distributed``.

Importing this package is cheap: it loads neither torch nor Lightning. The public names below are
resolved on first access, and the package's start-up hook (``lightning_bagua._registration``) makes
``Trainer(strategy="bagua")`` work as soon as a Lightning strategy registry is imported.
"""

# 0.1.0 star-imported its metadata into the package; the names stay importable from here.
from lightning_bagua.__about__ import __author__ as __author__
from lightning_bagua.__about__ import __docs__ as __docs__
from lightning_bagua.__about__ import __homepage__ as __homepage__
from lightning_bagua.__about__ import __license__ as __license__
from lightning_bagua.__about__ import __version__
from lightning_bagua._registration import install_registration_hook

# Not `from typing import TYPE_CHECKING`: the start-up hook imports this package in every interpreter, where
# `typing` would cost more than the hook itself (benchmarks/micro/startup_time.py). mypy treats this spelling the same.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from typing import Any

    from lightning_bagua.data.cache import CachedDataset, CacheLoader
    from lightning_bagua.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
    from lightning_bagua.engine import (
        Algorithm,
        AlgorithmImpl,
        AsyncModelAverageAlgorithm,
        BaguaDistributedDataParallel,
        ByteGradAlgorithm,
        CommunicationCounter,
        DecentralizedAlgorithm,
        GradientAllReduceAlgorithm,
        LowPrecisionDecentralizedAlgorithm,
        LowRankAlgorithm,
        MinMaxUInt8Codec,
        QAdamAlgorithm,
        QAdamOptimizer,
    )
    from lightning_bagua.environments.bagua import BaguaEnvironment
    from lightning_bagua.optim.fused import fuse_optimizer
    from lightning_bagua.strategies.bagua import BaguaStrategy

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "BaguaDistributedDataParallel",
    "BaguaEnvironment",
    "BaguaStrategy",
    "ByteGradAlgorithm",
    "CacheLoader",
    "CachedDataset",
    "CommunicationCounter",
    "DecentralizedAlgorithm",
    "GradientAllReduceAlgorithm",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "LowPrecisionDecentralizedAlgorithm",
    "LowRankAlgorithm",
    "MinMaxUInt8Codec",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "__version__",
    "fuse_optimizer",
]

_LAZY_ATTRIBUTES = {
    "Algorithm": "lightning_bagua.engine",
    "AlgorithmImpl": "lightning_bagua.engine",
    "AsyncModelAverageAlgorithm": "lightning_bagua.engine",
    "BaguaDistributedDataParallel": "lightning_bagua.engine",
    "CommunicationCounter": "lightning_bagua.engine",
    "GradientAllReduceAlgorithm": "lightning_bagua.engine",
    "ByteGradAlgorithm": "lightning_bagua.engine",
    "DecentralizedAlgorithm": "lightning_bagua.engine",
    "LowPrecisionDecentralizedAlgorithm": "lightning_bagua.engine",
    "LowRankAlgorithm": "lightning_bagua.engine",
    "MinMaxUInt8Codec": "lightning_bagua.engine",
    "QAdamAlgorithm": "lightning_bagua.engine",
    "QAdamOptimizer": "lightning_bagua.engine",
    "BaguaEnvironment": "lightning_bagua.environments.bagua",
    "BaguaStrategy": "lightning_bagua.strategies.bagua",
    "CacheLoader": "lightning_bagua.data.cache",
    "CachedDataset": "lightning_bagua.data.cache",
    "LoadBalancingDistributedBatchSampler": "lightning_bagua.data.samplers",
    "LoadBalancingDistributedSampler": "lightning_bagua.data.samplers",
    "fuse_optimizer": "lightning_bagua.optim.fused",
}


def __getattr__(name: str) -> "Any":
    # Resolving public names lazily keeps `import lightning_bagua` (and the start-up hook) free of torch.
    import importlib  # here, not at the top: `importlib` and the `warnings` it loads cost start-up time

    module_name = _LAZY_ATTRIBUTES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'lightning_bagua' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


install_registration_hook()
