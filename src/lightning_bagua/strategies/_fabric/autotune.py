"""Autotuning under Fabric: a tuner per wrapped module, and moving Fabric's references to a rebuilt wrapper.

The autotuner rebuilds a module's wrapper to try another bucket size. Under the Trainer the strategy owns the only
reference; under Fabric the user's loop calls the ``_FabricModule`` that holds the wrapper as a child, so while any
module is tuning, every module that registers one of ours as a child is noted, and a rebuilt wrapper replaces the
old one there.
"""

import weakref
from collections.abc import Callable

from torch.nn import Module
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

from lightning_bagua.engine import BaguaDistributedDataParallel
from lightning_bagua.engine.autotune import BucketAutotuner

__all__ = ["FabricAutotuning"]


class FabricAutotuning:
    """The tuners of the modules one Fabric strategy wrapped, and who holds each tuning wrapper.

    Args:
        on_replace: called with ``(old, new)`` when a tuner rebuilt a wrapper, after the holders were updated.
    """

    def __init__(
        self, on_replace: Callable[[BaguaDistributedDataParallel, BaguaDistributedDataParallel], None]
    ) -> None:
        self._on_replace = on_replace
        self._tuners: dict[int, BucketAutotuner] = {}
        self._holders: dict[int, list[tuple[weakref.ref[Module], str]]] = {}
        # Weak, as the strategy holds its wrappers: a wrapper the script drops goes (see `BaguaStrategy`). A plain
        # dict of references, not a `WeakValueDictionary`: the strategy is pickled when Lightning spawns processes.
        self._wrappers: dict[int, weakref.ref[BaguaDistributedDataParallel]] = {}
        self._hook: RemovableHandle | None = None

    def tuner_of(self, wrapped: BaguaDistributedDataParallel) -> BucketAutotuner | None:
        """Return the module's tuner, or ``None`` when it has none."""
        return self._tuners.get(id(wrapped))

    def add(self, wrapped: BaguaDistributedDataParallel) -> None:
        """Give a newly wrapped module a tuner and make its first call, before the first step's forward."""
        self._wrappers = {key: ref for key, ref in self._wrappers.items() if ref() is not None}
        self._tuners = {key: tuner for key, tuner in self._tuners.items() if key in self._wrappers}
        self._tuners[id(wrapped)] = BucketAutotuner()
        self._wrappers[id(wrapped)] = weakref.ref(wrapped)
        if self._hook is None:
            self._hook = register_module_module_registration_hook(self._note_holder)
        # The Trainer makes this call at the first batch's start; every later one follows an optimizer step, i.e.
        # comes before the next step's forward.
        self.advance(wrapped)

    def advance(self, wrapped: BaguaDistributedDataParallel) -> None:
        """Advance the module's tuner by one step; a rebuilt wrapper replaces the old one wherever it is held."""
        tuner = self._tuners[id(wrapped)]
        tuned = tuner.step(wrapped)
        if tuned is not wrapped:
            self._replace(wrapped, tuned)
        if all(tuner.finished for tuner in self._tuners.values()):
            self._stop_noting_holders()

    def clear(self) -> None:
        """Forget every tuner and holder (at teardown)."""
        self._tuners = {}
        self._wrappers = {}
        self._stop_noting_holders()

    def _note_holder(self, holder: Module, name: str, child: Module) -> None:
        # Called for every child module registered anywhere while a module is tuning: remember who holds ours.
        reference = self._wrappers.get(id(child))
        if reference is not None and reference() is child:
            self._holders.setdefault(id(child), []).append((weakref.ref(holder), name))

    def _replace(self, old: BaguaDistributedDataParallel, new: BaguaDistributedDataParallel) -> None:
        self._tuners[id(new)] = self._tuners.pop(id(old))
        self._wrappers[id(new)] = weakref.ref(new)
        del self._wrappers[id(old)]
        holders = self._holders.pop(id(old), [])
        for reference, name in holders:
            holder = reference()
            # Set in the children's table itself: `_FabricModule.__setattr__` would forward the name to the user's
            # module, and registering anew would record the holder twice.
            if holder is not None and holder._modules.get(name) is old:
                holder._modules[name] = new
                initialize = getattr(holder, "_initialize", None)
                if name == "_orig_mod" and callable(initialize):
                    # A torch.compile'd module bound its forward to the old wrapper when it was built: bind it anew.
                    # Fabric's record of the compile arguments was forwarded to the wrapper too; it moves along.
                    initialize()
                    if hasattr(old, "_compile_kwargs"):
                        new._compile_kwargs = old._compile_kwargs
        self._holders[id(new)] = holders
        self._on_replace(old, new)

    def _stop_noting_holders(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._holders = {}
