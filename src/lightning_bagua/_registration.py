"""Register entry-point strategies with Lightning as soon as a Lightning strategy registry is imported.

Packages declare strategies as entry points whose group is the name of a Lightning strategy registry
module, for example ``[project.entry-points."lightning.pytorch.strategies"] bagua = "pkg.module:Class"``.
:func:`install_registration_hook` puts a finder on :data:`sys.meta_path` that notices when such a module is
imported and, right after it has run, adds every entry point of the matching group to the module's strategy
registry. The wheel ships a ``.pth`` file that installs the hook at interpreter start-up, so
``Trainer(strategy="bagua")`` works in a script that never imports ``lightning_bagua``.

Each startup pays for this module, so it imports nothing beyond :mod:`sys` until a registry module is
actually imported; ``logging`` and ``importlib.metadata`` are loaded only then, when Lightning has already
loaded them anyway.
"""

from __future__ import annotations

import sys

# Importing `typing` would cost several milliseconds at every interpreter start-up; mypy honours this spelling.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from collections.abc import Iterable, Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from importlib.metadata import EntryPoint
    from types import ModuleType
    from typing import Any

__all__ = ["REGISTRY_MODULES", "install_registration_hook"]

#: Lightning modules that own a strategy registry. Each name is also the entry-point group read for it.
REGISTRY_MODULES: tuple[str, ...] = (
    "lightning.pytorch.strategies",
    "pytorch_lightning.strategies",
    "lightning.fabric.strategies",
    "lightning_fabric.strategies",
)

# The Trainer's registry module and Fabric's spell the registry's name differently.
_REGISTRY_ATTRIBUTES = ("StrategyRegistry", "STRATEGY_REGISTRY")


def __getattr__(name: str) -> Any:
    # `log` is created on first use: importing `logging` at start-up would cost more than the whole hook.
    if name == "log":
        return _get_log()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _get_log() -> logging.Logger:
    import logging

    log = logging.getLogger(__name__)
    globals()["log"] = log
    return log


class _LazyStrategy:
    """Import an entry point's strategy class only when Lightning instantiates the strategy.

    Registration runs while ``lightning.pytorch`` (or Fabric) is still half initialised; importing the
    strategy's module at that moment would import Lightning from inside its own import.

    Args:
        entry_point: The entry point naming the strategy class (or any factory returning a strategy).
    """

    def __init__(self, entry_point: EntryPoint) -> None:
        self.entry_point = entry_point

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Load the entry point and instantiate it with the arguments Lightning passes through."""
        return self.entry_point.load()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.entry_point.value!r})"


def _find_registry(module: ModuleType) -> Any:
    for attribute in _REGISTRY_ATTRIBUTES:
        registry = getattr(module, attribute, None)
        if registry is not None:
            return registry
    return None


def _register_entry_points(module: ModuleType) -> None:
    """Add every entry point of the group named after ``module`` to the module's strategy registry.

    Names that are already registered are left alone, and any failure is logged instead of raised: the
    user is in the middle of importing Lightning, and that import must succeed regardless.

    Args:
        module: A fully executed Lightning strategy registry module.
    """
    group = module.__name__
    registry = _find_registry(module)
    if registry is None:
        _get_log().warning("lightning-bagua found no strategy registry in %s; its strategies are not registered", group)
        return
    try:
        from importlib.metadata import entry_points

        selected = list(entry_points(group=group))
    except Exception as err:
        _get_log().warning("lightning-bagua could not read the %r entry points: %r", group, err)
        return
    for entry_point in selected:
        try:
            if entry_point.name in registry:
                continue
            registry.register(
                entry_point.name,
                _LazyStrategy(entry_point),
                description=f"{entry_point.value}, registered from the {group!r} entry points",
            )
        except Exception as err:
            _get_log().warning(
                "lightning-bagua could not register the strategy entry point %s = %s in %s: %r",
                entry_point.name,
                entry_point.value,
                group,
                err,
            )


class _RegisteringLoader:
    """Wrap a registry module's loader so that registration runs right after the module has executed.

    Args:
        loader: The loader the import system would have used for the module.
    """

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        """Create the module the way the wrapped loader does."""
        create_module = getattr(self.loader, "create_module", None)
        return None if create_module is None else create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Execute the module, hand it back its own loader, and register the entry points of its group."""
        self.loader.exec_module(module)
        # With its original loader back, the module looks exactly as if it had been imported without the hook.
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        _register_entry_points(module)

    def __getattr__(self, name: str) -> Any:
        # Anything else the import system or a tool asks for mid-import (get_code, resource readers) is the
        # wrapped loader's business.
        return getattr(self.loader, name)


class _RegistryModuleFinder:
    """Meta path finder that hooks registration into the import of Lightning's strategy registry modules.

    It finds nothing itself: for a watched module it asks the finders after it for the real spec and wraps
    that spec's loader. Every other import costs one set lookup.

    Args:
        module_names: Names of the registry modules to watch.
    """

    # Marks our finders even across copies of this module (a reload), so the hook is installed only once.
    _lightning_bagua_registration_hook = True

    def __init__(self, module_names: Iterable[str]) -> None:
        self.module_names = frozenset(module_names)
        # Names being resolved right now: a finder that re-enters the import system must not loop back here.
        self._resolving: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """Return the real spec of a watched registry module with its loader wrapped, else ``None``."""
        if fullname not in self.module_names or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = self._find_real_spec(fullname, path, target)
        except Exception:
            # Stepping aside lets the import system run the same finders and report their error itself.
            return None
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _RegisteringLoader(spec.loader)  # type: ignore[assignment]
        return spec

    def _find_real_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        for finder in list(sys.meta_path):
            if getattr(finder, "_lightning_bagua_registration_hook", False):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sorted(self.module_names)!r})"


def install_registration_hook() -> None:
    """Make Lightning's strategy registries pick up the strategies declared as entry points.

    Installs a finder at the front of :data:`sys.meta_path` that registers each group's entry points when
    the registry module of the same name is imported, and registers straight away into the registry
    modules that are already imported. Calling it again does nothing more; it never raises.
    """
    try:
        if not any(getattr(finder, "_lightning_bagua_registration_hook", False) for finder in sys.meta_path):
            sys.meta_path.insert(0, _RegistryModuleFinder(REGISTRY_MODULES))
        for name in REGISTRY_MODULES:
            module = sys.modules.get(name)
            # A module still being imported registers from its own loader once it has finished executing.
            if module is not None and not _is_initializing(module):
                _register_entry_points(module)
    except Exception as err:
        _get_log().warning("lightning-bagua could not install its strategy registration hook: %r", err)


def _is_initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
