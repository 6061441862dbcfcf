"""Optimizer utilities: fused updates of many parameters over flat storage."""

from lightning_bagua.optim.fused import fuse_optimizer

__all__ = ["fuse_optimizer"]
