"""Data utilities: samplers that balance the work of the ranks in every step."""

from lightning_bagua.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
