"""The Fabric strategy's weakly held modules and optimizers, and the closing of their engines."""

import gc
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_bagua.strategies._fabric.engines import WrappedEngines


class FakeGroups:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(f"close groups of {self.name}")


class FakeImpl:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.context = self  # `impl.context.groups.close()`
        self.groups = FakeGroups(log, name)

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")


class FakeWrapped(nn.Module):
    """A stand-in for a wrapped module: its parameters, its algorithm and its ``close``."""

    def __init__(self, log: list[str], name: str) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.bagua_algorithm_impl = FakeImpl(log, f"impl {name}")
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(f"close {self.name}")


def engines_holding(*names: str) -> tuple[WrappedEngines, list[str], tuple[FakeWrapped, ...]]:
    """Engines holding one stand-in module per name, in order, all writing to the returned log.

    The returned modules are their only strong references: once the caller lets go of one, the engines drop it.
    """
    log: list[str] = []
    engines = WrappedEngines()
    modules = tuple(FakeWrapped(log, name) for name in names)
    for module in modules:
        engines.add_module(module)  # type: ignore[arg-type]  # a stand-in with what WrappedEngines uses
    return engines, log, modules


def test_modules_and_optimizers_are_held_weakly_in_order_and_matched_by_parameters():
    engines, log, (first, second) = engines_holding("first", "second")
    optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    engines.add_optimizer(optimizer)
    engines.add_optimizer(optimizer)
    assert engines.modules == [first, second]
    assert engines.optimizers == [optimizer]
    assert engines.optimizers_of(second) == [optimizer]
    assert engines.optimizers_of(first) == []

    replacement = FakeWrapped(log, "replacement")
    engines.replace_module(first, replacement)
    assert engines.modules == [replacement, second]
    del optimizer, second
    gc.collect()
    assert engines.modules == [replacement]
    assert engines.optimizers == []


def test_close_stops_and_closes_every_module_and_an_orphaned_algorithm_then_lets_go():
    engines, log, (_kept, dropped) = engines_holding("kept", "dropped")  # `_kept` holds its module alive
    # The script let go of the module while its algorithm lives on (an `async` thread holds it).
    orphan = dropped.bagua_algorithm_impl
    del dropped
    gc.collect()
    engines.close()
    assert log == [
        "stop impl kept",
        "close kept",
        "stop impl dropped",
        "close impl dropped",
        "close groups of impl dropped",
    ]
    assert orphan is not None
    assert engines.modules == []
    log.clear()
    engines.close()
    assert log == []


def test_closing_engines_closes_every_one_when_stopping_one_fails():
    closed = []

    def engine(name: str, stop_fails: bool) -> SimpleNamespace:
        def stop() -> None:
            if stop_fails:
                raise RuntimeError(f"{name}: a peer died")

        return SimpleNamespace(bagua_algorithm_impl=SimpleNamespace(stop=stop), close=lambda: closed.append(name))

    engines = WrappedEngines()
    held = [engine("a", True), engine("b", True), engine("c", False)]
    engines._modules = [SimpleNamespace(module=lambda e=e: e) for e in held]
    with pytest.raises(RuntimeError, match="a: a peer died"):
        engines.close()
    assert closed == ["a", "b", "c"]
    assert engines.modules == []
