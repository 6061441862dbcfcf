"""Lightning cluster environments for jobs launched the Bagua way."""

from lightning_bagua.environments.bagua import BaguaEnvironment

__all__ = ["BaguaEnvironment"]
