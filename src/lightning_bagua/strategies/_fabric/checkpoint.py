"""Fabric's save and load with each process's Bagua state, in the format of ``strategies/_core/checkpoint.py``.

Process 0 writes the file Fabric saves, so each wrapped module's per-process state is gathered to it and stored under
``"bagua_algorithm_state"``; loading gives each process its own entry back. The strategy's ``save_checkpoint`` and
``load_checkpoint`` hold the documentation and call these.
"""

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Protocol

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_bagua.engine import BaguaDistributedDataParallel
from lightning_bagua.strategies._core import checkpoint as bagua_checkpoint
from lightning_bagua.strategies._core.checkpoint import ModuleEntry, RankResume
from lightning_bagua.strategies._core.data_resume import DataState

__all__ = ["CheckpointingStrategy", "load_and_restore", "state_to_save"]

_Filter = Callable[[str, Any], bool]


class CheckpointingStrategy(Protocol):
    """What saving and loading use of the Fabric strategy."""

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def bagua_modules(self) -> list[BaguaDistributedDataParallel]: ...

    def get_module_state_dict(self, module: Module) -> dict[str, Any | Tensor]: ...

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]: ...

    def load_module_state_dict(
        self, module: Module, state_dict: dict[str, Any | Tensor], strict: bool = True
    ) -> None: ...

    def _gather_module_entry(
        self, wrapped: BaguaDistributedDataParallel, weights: Callable[[], Mapping[str, Any]]
    ) -> ModuleEntry | None: ...


def state_to_save(
    strategy: CheckpointingStrategy, state: dict[str, Any], filters: dict[str, _Filter]
) -> dict[str, Any]:
    """Gather every process's Bagua state into what process 0 writes; every process must call this.

    Args:
        strategy: the Fabric strategy saving.
        state: names to modules, optimizers and other objects, as given to ``fabric.save``.
        filters: per-key filters, as given to ``fabric.save``; they apply to the per-process copies too.

    Returns:
        ``state`` with the Bagua entry added (a new dict); each :class:`DataState` in it has gathered every
        process's generator states.

    Raises:
        ValueError: ``state`` uses a key the entry is stored under.
    """
    bagua_checkpoint.refuse_reserved_keys(state, type(strategy).__name__)
    entries = {
        key: entry
        for key, obj in state.items()
        if isinstance(obj, BaguaDistributedDataParallel)
        and (entry := _module_entry(strategy, key, obj, state, filters)) is not None
    }
    state = bagua_checkpoint.attach_entries(
        state, entries, strategy.world_size, weights_key=lambda name: name, key=bagua_checkpoint.FABRIC_CHECKPOINT_KEY
    )
    for obj in state.values():
        if isinstance(obj, DataState):
            obj.gather()  # every process's generator states, to rank 0, which writes them
    return state


def load_and_restore(
    strategy: CheckpointingStrategy, state: Any, strict: bool, load: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Load with Fabric's ``load``, then give each wrapped module in ``state`` this process's Bagua state.

    Algorithms of the modules being loaded are stopped first and started again only once all is restored, so that
    no averaging round between steps mixes the old weights into the loaded ones; if loading raises they stay
    stopped. Every process must call this.

    Args:
        strategy: the Fabric strategy loading.
        state: what to restore, as given to ``fabric.load``.
        strict: whether every requested key must be in the checkpoint.
        load: Fabric's own loading of ``state``, returning the checkpoint's items it did not restore.

    Returns:
        What ``load`` returned, without the Bagua entry when ``state`` is a non-empty dict.
    """
    paused = _pause_algorithms(strategy.bagua_modules, state)
    remainder = load()
    if isinstance(state, dict) and state:
        saved = bagua_checkpoint.module_entries(remainder, default_name="model")
        remainder.pop(bagua_checkpoint.CHECKPOINT_KEY, None)
        modules = {} if saved is None else saved[1]
        for key, obj in state.items():
            if isinstance(obj, BaguaDistributedDataParallel) and key in modules:
                name = obj.bagua_algorithm.name
                resume = bagua_checkpoint.rank_resume(
                    modules[key], key, name, strategy.world_size, strategy.global_rank
                )
                _restore_rank_weights(strategy, obj, resume, state, strict)
                obj.load_bagua_state_dict(resume.algorithm_state_for(obj))
    for wrapped in paused:
        wrapped.bagua_algorithm_impl.start()
    return remainder


def _module_entry(
    strategy: CheckpointingStrategy,
    key: str,
    wrapped: BaguaDistributedDataParallel,
    state: dict[str, Any],
    filters: dict[str, _Filter],
) -> ModuleEntry | None:
    # As under Fabric's DDP, a filter that keeps none of the module's weights writes nothing of the module; one that
    # keeps some keeps the whole algorithm state, which only resumes whole. Every rank decides alike (the filter sees
    # the same names on each), since gathering is collective.
    keep = filters.get(key)
    if keep is not None and _filtered(strategy.get_module_state_dict(wrapped), keep) is None:
        return None
    entry = strategy._gather_module_entry(wrapped, partial(_rank_weights, strategy, key, wrapped, state, filters))
    return entry if entry is not None and bagua_checkpoint.entry_restores_something(entry, wrapped) else None


def _rank_weights(
    strategy: CheckpointingStrategy,
    module_key: str,
    wrapped: BaguaDistributedDataParallel,
    state: dict[str, Any],
    filters: dict[str, _Filter],
) -> dict[str, Any]:
    # This rank's weights, and the states of the saved optimizers that update them, keyed as in `state`; each
    # through the filter `fabric.save` got for its key, so that nothing the filter drops is written per rank.
    optimizers = {
        key: filtered
        for key, obj in state.items()
        if isinstance(obj, Optimizer)
        and any(obj is bound for bound in wrapped.bagua_optimizers)
        and (filtered := _filtered(strategy.get_optimizer_state(obj), filters.get(key))) is not None
    }
    weights = _filtered(strategy.get_module_state_dict(wrapped), filters.get(module_key))
    return {"state_dict": weights, "optimizer_states": optimizers}


def _pause_algorithms(
    wrapped_modules: Iterable[BaguaDistributedDataParallel], state: Any
) -> list[BaguaDistributedDataParallel]:
    # The wrapped modules about to be loaded whose algorithm works between steps: stopped on every rank (async's
    # stop is collective, and every rank loads the same objects), to be started again once loading is done.
    targets = state.values() if isinstance(state, dict) else [state]
    paused = []
    for wrapped in wrapped_modules:
        if any(obj is wrapped or obj is wrapped.module for obj in targets) and wrapped.bagua_algorithm_impl.started:
            wrapped.bagua_algorithm_impl.stop()
            paused.append(wrapped)
    return paused


def _restore_rank_weights(
    strategy: CheckpointingStrategy,
    wrapped: BaguaDistributedDataParallel,
    resume: RankResume,
    state: dict[str, Any],
    strict: bool,
) -> None:
    if resume.state_dict is not None:
        strategy.load_module_state_dict(wrapped, resume.state_dict, strict=strict)
    for key, optimizer_state in (resume.optimizer_states or {}).items():
        optimizer = state.get(key)
        if isinstance(optimizer, Optimizer):
            optimizer.load_state_dict(optimizer_state)


def _filtered(state_dict: dict[str, Any], keep: _Filter | None) -> dict[str, Any] | None:
    # Fabric's rule for a filtered key: the entries the filter keeps, and no entry at all when it keeps none.
    if keep is None:
        return state_dict
    kept = {name: value for name, value in state_dict.items() if keep(name, value)}
    return kept or None
