"""Weight helpers shared by the algorithms that communicate weights instead of gradients.

``decentralized``, ``low_precision_decentralized`` and ``async`` copy the participating parameters into flat
buffers (one per dtype), exchange the buffers, and write the result back; a third-party weight-averaging
algorithm can build on the same pieces.
"""

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

__all__ = ["FlatWeights", "check_optimizers_cover", "group_by_dtype", "views_like"]


class FlatWeights:
    """Parameters of one dtype, and flat buffers to exchange them through.

    Args:
        parameters: parameters sharing a dtype and a device.
        needs_receive_buffer: also allocate a buffer for a peer's weights (point-to-point exchanges).
    """

    def __init__(self, parameters: list[Parameter], needs_receive_buffer: bool) -> None:
        self.parameters = parameters
        first = parameters[0]
        numel = sum(parameter.numel() for parameter in parameters)
        self.buffer = torch.empty(numel, dtype=first.dtype, device=first.device)
        self.received = torch.empty_like(self.buffer) if needs_receive_buffer else None

    def gather(self) -> Tensor:
        """Copy the parameters' current values into :attr:`buffer` and return it."""
        with torch.no_grad():
            torch.cat([parameter.detach().reshape(-1) for parameter in self.parameters], out=self.buffer)
        return self.buffer

    def scatter(self, flat: Tensor) -> None:
        """Copy ``flat`` (laid out as :meth:`gather` lays the parameters out) into the parameters."""
        pieces = flat.split([parameter.numel() for parameter in self.parameters])
        with torch.no_grad():
            # One multi-tensor copy, not a kernel per parameter.
            targets: list[Tensor] = list(self.parameters)
            torch._foreach_copy_(targets, [piece.view_as(p) for piece, p in zip(pieces, targets, strict=True)])


def group_by_dtype(parameters: Sequence[Parameter], needs_receive_buffer: bool = False) -> list[FlatWeights]:
    """Split ``parameters`` into flat groups of one dtype each (a flat buffer holds one dtype), in first-seen order.

    Args:
        parameters: the participating parameters.
        needs_receive_buffer: give each group a buffer for a peer's weights too.

    Returns:
        One group per dtype.
    """
    by_dtype: dict[torch.dtype, list[Parameter]] = {}
    for parameter in parameters:
        by_dtype.setdefault(parameter.dtype, []).append(parameter)
    return [FlatWeights(group, needs_receive_buffer) for group in by_dtype.values()]


def check_optimizers_cover(
    algorithm: str, named_parameters: Sequence[tuple[str, Parameter]], optimizers: Sequence[Optimizer]
) -> None:
    """Raise a ``ValueError`` naming the participating parameters that no optimizer in ``optimizers`` updates.

    Weight-exchanging algorithms overwrite every participating parameter around the optimizer step, so a
    parameter that takes part but is never stepped would be silently averaged and never trained.

    Args:
        algorithm: the algorithm's registry name, for the message.
        named_parameters: the participating parameters.
        optimizers: the bound optimizers.
    """
    optimized = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, parameter in named_parameters if id(parameter) not in optimized]
    if missing:
        raise ValueError(
            f"Algorithm {algorithm!r} exchanges weights around the optimizer step, so every parameter that takes"
            f" part must be updated by one of the bound optimizers, but none updates {', '.join(missing)}."
            " Add them to an optimizer, freeze them (requires_grad=False), or list them in the module's"
            " `_bagua_params_and_buffers_to_ignore`."
        )


def views_like(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Return views into ``flat`` shaped like ``tensors``, laid out one after another as ``gather`` lays them.

    Args:
        flat: a flat tensor with at least as many elements as ``tensors`` together.
        tensors: the shapes to cut, in order.

    Returns:
        One view per tensor.
    """
    views = []
    offset = 0
    for tensor in tensors:
        views.append(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return views
