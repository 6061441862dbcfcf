"""Data utilities: samplers that balance the work of the ranks in every step, and a cache for expensive samples."""

from lightning_bagua.data.cache import CachedDataset, CacheLoader
from lightning_bagua.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["CacheLoader", "CachedDataset", "LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
