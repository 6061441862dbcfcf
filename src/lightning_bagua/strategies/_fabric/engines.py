"""The modules the Fabric strategy wrapped and the optimizers it set up, held weakly, and closing their engines.

Fabric may set up modules and optimizers in either order, together or apart, so each module is (re)bound to the
optimizers over its parameters whenever either side arrives. Both are held weakly, as Fabric's DDP strategy holds
none: a wrapper the script drops must go with its communicators, which keep the process group's store alive. A
script that destroys the default group and starts a new one would otherwise join it through the old store, whose
keys still name the old group's addresses.
"""

import weakref

from torch.nn import Module
from torch.optim import Optimizer

from lightning_bagua.engine import BaguaDistributedDataParallel

__all__ = ["WrappedEngines", "updates"]


def updates(optimizer: Optimizer, module: Module) -> bool:
    """Whether ``optimizer`` updates any parameter of ``module``."""
    parameters = {id(parameter) for parameter in module.parameters()}
    return any(id(parameter) in parameters for group in optimizer.param_groups for parameter in group["params"])


class WrappedEngines:
    """The wrapped modules and set-up optimizers of one Fabric strategy, held weakly, in the order they came."""

    def __init__(self) -> None:
        self._modules: list[_WrappedRef] = []
        self._optimizers: list[weakref.ref[Optimizer]] = []

    @property
    def modules(self) -> list[BaguaDistributedDataParallel]:
        """The wrapped modules the script still holds."""
        return [wrapped for ref in self._modules if (wrapped := ref.module()) is not None]

    @property
    def optimizers(self) -> list[Optimizer]:
        """The set-up optimizers the script still holds."""
        return [optimizer for reference in self._optimizers if (optimizer := reference()) is not None]

    def add_module(self, wrapped: BaguaDistributedDataParallel) -> None:
        """Hold ``wrapped`` (weakly), and let go of the references to modules and algorithms that are gone."""
        self._modules = [*(ref for ref in self._modules if ref.in_use()), _WrappedRef(wrapped)]

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """Hold ``optimizer`` (weakly), once."""
        if not any(optimizer is known for known in self.optimizers):
            self._optimizers.append(weakref.ref(optimizer))

    def replace_module(self, old: BaguaDistributedDataParallel, new: BaguaDistributedDataParallel) -> None:
        """Hold ``new`` where ``old`` was held."""
        self._modules = [_WrappedRef(new) if ref.module() is old else ref for ref in self._modules]

    def optimizers_of(self, module: Module) -> list[Optimizer]:
        """The held optimizers that update ``module``."""
        return [optimizer for optimizer in self.optimizers if updates(optimizer, module)]

    def close(self) -> None:
        """Stop every held module's algorithm, close its engine and let go of everything held.

        Raises:
            Exception: what stopping an algorithm raised (a failure of its background work found only now).
        """
        references, self._modules = self._modules, []
        self._optimizers = []
        failure: BaseException | None = None
        for reference in references:
            # Every engine is closed even when stopping one raised: the first failure is raised once all are.
            try:
                _close(reference)
            except BaseException as error:
                failure = failure or error
        if failure is not None:
            raise failure


def _close(reference: "_WrappedRef") -> None:
    wrapped = reference.module()
    if wrapped is not None:
        try:
            wrapped.bagua_algorithm_impl.stop()
        finally:
            wrapped.close()
    elif (impl := reference.impl()) is not None:
        # The script let go of the module while a thread of the algorithm's own still runs it (`async`): stopped
        # and closed as its wrapper would be, so that what the thread found out is reported.
        try:
            impl.stop()
        finally:
            impl.close()
            impl.context.groups.close()


class _WrappedRef:
    """A wrapped module, held weakly, and its algorithm, which outlives the module while a thread of its own runs."""

    def __init__(self, wrapped: BaguaDistributedDataParallel) -> None:
        self.module = weakref.ref(wrapped)
        self.impl = weakref.ref(wrapped.bagua_algorithm_impl)

    def in_use(self) -> bool:
        return self.module() is not None or self.impl() is not None
