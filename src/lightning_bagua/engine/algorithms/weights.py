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

__all__ = ["FlatWeights", "check_optimizers_cover", "group_by_dtype", "parameters_not_updated", "views_like"]


class FlatWeights:
    """Parameters of one dtype, and flat buffers to exchange them through.

    With ``alias=True`` the parameters themselves live in :attr:`buffer`: each parameter's ``data`` is a view into
    it, so :meth:`gather` copies nothing and :meth:`scatter` is one flat copy. On CUDA, torch copies a list of
    parameters to or from a flat tensor (``torch.cat``, ``torch._foreach_copy_``) at a fraction of the bandwidth
    of one flat copy. Anything that
    gives a parameter new storage later (``module.to()``, an assigning ``load_state_dict``) ends its view; the
    next :meth:`gather` notices and lays the group out again, so the exchange never reads stale values. Parameters
    that already are views into a larger storage of someone else's (a fused optimizer's flat buffer, see
    :func:`~lightning_bagua.optim.fuse_optimizer`), or that are not contiguous (``channels_last``), stay where they
    are, and the buffer holds a copy of them, as without ``alias``. Only an algorithm that exchanges the weights in
    step with training may alias them: one that sends them while the next step runs (``decentralized``,
    ``async``) needs a copy that the step does not change.

    Args:
        parameters: parameters sharing a dtype and a device.
        needs_receive_buffer: also allocate a buffer for a peer's weights (point-to-point exchanges).
        alias: lay the parameters out in :attr:`buffer` instead of copying them into it.
    """

    def __init__(self, parameters: list[Parameter], needs_receive_buffer: bool, alias: bool = False) -> None:
        self.parameters = parameters
        self.alias = alias
        first = parameters[0]
        numel = sum(parameter.numel() for parameter in parameters)
        self.buffer = torch.empty(numel, dtype=first.dtype, device=first.device)
        if alias:
            self._lay_out()
        self.received = torch.empty_like(self.buffer) if needs_receive_buffer else None

    @property
    def aliased(self) -> bool:
        """Whether every parameter is the view into :attr:`buffer` that :meth:`gather` laid out."""
        if not self.alias:
            return False
        base, size, offset = self.buffer.data_ptr(), self.buffer.element_size(), 0
        for parameter in self.parameters:
            numel = parameter.numel()
            if numel and (parameter.data_ptr() != base + offset * size or not parameter.is_contiguous()):
                return False
            offset += numel
        return True

    def gather(self) -> Tensor:
        """Return :attr:`buffer` holding the parameters' current values.

        Where the parameters are laid out in it (``alias``), it is their own storage: read it, and change the
        parameters through :meth:`scatter` only. Otherwise their values are copied into it.
        """
        if not self.aliased and not (self.alias and self._lay_out()):
            with torch.no_grad():
                # One multi-tensor copy: faster than torch.cat into the buffer.
                sources: list[Tensor] = [parameter.detach() for parameter in self.parameters]
                torch._foreach_copy_(views_like(self.buffer, sources), sources)
        return self.buffer

    def scatter(self, flat: Tensor) -> None:
        """Copy ``flat`` (laid out as :meth:`gather` lays the parameters out) into the parameters."""
        with torch.no_grad():
            if self.aliased:
                if flat is not self.buffer:
                    self.buffer.copy_(flat)
                return
            # One multi-tensor copy, not a kernel per parameter.
            targets: list[Tensor] = list(self.parameters)
            torch._foreach_copy_(targets, views_like(flat, targets))

    def _lay_out(self) -> bool:
        """Make each parameter's ``data`` a view into a new :attr:`buffer` holding its values, where that is safe.

        Returns:
            Whether the parameters were laid out (``False``: they stay where they are, to be copied).
        """
        group = self.buffer  # the group's dtype and device: the algorithm's copies of the weights were made like it
        own = group.untyped_storage().data_ptr()
        in_own = held_elsewhere = False
        for parameter in self.parameters:
            if parameter.dtype != group.dtype or parameter.device != group.device:
                raise RuntimeError(
                    f"The weights were grouped as {group.dtype} on {group.device}, but a parameter is now"
                    f" {parameter.dtype} on {parameter.device}. Move or cast the model before wrapping it, not after."
                )
            storage = parameter.untyped_storage()
            if not parameter.numel():
                continue
            if storage.data_ptr() == own:
                in_own = True
            elif storage.nbytes() != parameter.numel() * parameter.element_size() or not parameter.is_contiguous():
                held_elsewhere = True
        if held_elsewhere:
            # Re-pointing would cut the storage's owner off from the parameters: copy them instead, into a buffer
            # that no parameter lies in.
            if in_own:
                self.buffer = torch.empty_like(group)
            return False
        with torch.no_grad():
            flat = torch.cat([parameter.detach().reshape(-1) for parameter in self.parameters])
            for parameter, view in zip(self.parameters, views_like(flat, self.parameters), strict=True):
                parameter.data = view
        self.buffer = flat
        return True


def group_by_dtype(
    parameters: Sequence[Parameter], needs_receive_buffer: bool = False, alias: bool = False
) -> list[FlatWeights]:
    """Split ``parameters`` into flat groups of one dtype each (a flat buffer holds one dtype), in first-seen order.

    Args:
        parameters: the participating parameters.
        needs_receive_buffer: give each group a buffer for a peer's weights too.
        alias: lay each group's parameters out in its buffer (see :class:`FlatWeights`).

    Returns:
        One group per dtype.
    """
    by_dtype: dict[torch.dtype, list[Parameter]] = {}
    for parameter in parameters:
        by_dtype.setdefault(parameter.dtype, []).append(parameter)
    return [FlatWeights(group, needs_receive_buffer, alias) for group in by_dtype.values()]


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
    missing = parameters_not_updated(named_parameters, optimizers)
    if missing:
        raise ValueError(
            f"Algorithm {algorithm!r} exchanges weights around the optimizer step, so every parameter that takes"
            f" part must be updated by one of the bound optimizers, but none updates {', '.join(missing)}."
            " Add them to an optimizer, freeze them (requires_grad=False), or list them in the module's"
            " `_bagua_params_and_buffers_to_ignore`."
        )


def parameters_not_updated(
    named_parameters: Sequence[tuple[str, Parameter]], optimizers: Sequence[Optimizer]
) -> list[str]:
    """Return the names of the parameters that none of ``optimizers`` updates, in order.

    Args:
        named_parameters: the participating parameters.
        optimizers: the optimizers.

    Returns:
        The names; empty when the optimizers together update every parameter.
    """
    optimized = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    return [name for name, parameter in named_parameters if id(parameter) not in optimized]


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
