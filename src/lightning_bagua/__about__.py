"""Package metadata."""

__version__ = "0.2.0"
__author__ = "lightning-bagua developers"
__license__ = "Apache-2.0"
__homepage__ = "https://github.com/Lightning-Universe/lightning-Bagua"
__docs__ = "Bagua's communication algorithms as a PyTorch Lightning strategy, on torch.distributed."

__all__ = ["__author__", "__docs__", "__homepage__", "__license__", "__version__"]
