"""What differs between the Lightning releases the package supports, in one place.

The requirements admit Lightning from 2.2 (``requirements/base.txt``); the strategies are written against the newest
release, and each function here bridges one hook whose calling convention changed since, naming the releases of
each branch. When Lightning changes a hook again, only this module changes (torch's differences live in
``engine/_torch_compat.py``).

The ``lightning`` package and the standalone ``lightning_fabric``/``pytorch_lightning`` packages may be installed at
different releases side by side, and one strategy class serves both. So a branch follows how the caller called the
hook, which is what differs between releases, rather than a version number read once at import.
"""

from typing import Any, Final

from torch.nn import Module
from torch.optim import Optimizer

__all__ = ["SCHEDULER_NOT_PASSED", "fabric_load_checkpoint_keywords", "fabric_setup_result"]


class _NotPassed:
    """The type of :data:`SCHEDULER_NOT_PASSED`."""

    def __repr__(self) -> str:
        return "SCHEDULER_NOT_PASSED"


SCHEDULER_NOT_PASSED: Final = _NotPassed()
"""The default of the Fabric strategy's ``setup_module_and_optimizers`` ``scheduler``: Fabric before 2.6 passes none."""


def fabric_setup_result(module: Module, optimizers: list[Optimizer], scheduler: Any) -> tuple[Any, ...]:
    """Return what Fabric's ``setup`` unpacks from ``Strategy.setup_module_and_optimizers``.

    - Fabric 2.2 to 2.5.x call ``setup_module_and_optimizers(module, optimizers)`` and unpack
      ``(module, optimizers)``.
    - Fabric 2.6 and later pass the LR scheduler (``None`` when there is none) as a third argument and unpack
      ``(module, optimizers, scheduler)``.

    Args:
        module: the set-up module.
        optimizers: the set-up optimizers.
        scheduler: the scheduler the caller passed, or :data:`SCHEDULER_NOT_PASSED` when it passed none.

    Returns:
        The two or three values the calling Fabric expects.
    """
    if scheduler is SCHEDULER_NOT_PASSED:
        return module, optimizers
    return module, optimizers, scheduler


def fabric_load_checkpoint_keywords(weights_only: bool | None) -> dict[str, bool]:
    """Return the keywords to forward to Fabric's ``Strategy.load_checkpoint`` for ``weights_only``.

    - Fabric 2.2 to 2.5.x: ``Strategy.load_checkpoint(path, state, strict)`` takes no ``weights_only``, and
      ``Fabric.load`` passes none, so ``weights_only`` is ``None`` and nothing is forwarded.
    - Fabric 2.6 and later: ``Fabric.load`` always passes ``weights_only``; ``None`` (torch's default) is also the
      strategy's default, so only ``True`` or ``False`` is forwarded.

    Args:
        weights_only: what the caller passed (``None`` when it passed nothing).

    Returns:
        ``{"weights_only": weights_only}``, or an empty dict for ``None``.
    """
    return {} if weights_only is None else {"weights_only": weights_only}
