"""Each public strategy class declares its own arguments: an explicit signature, documented argument by argument,
with only the algorithm's keywords passed through ``**bagua_kwargs``; Trainer-only arguments on the Trainer's class."""

import importlib
import importlib.util
import inspect
import re
from datetime import timedelta

import pytest

# (module, class name, framework); the standalone packages' classes where those packages are installed.
TRAINER = [("lightning_bagua", "trainer"), ("lightning_bagua.pytorch_lightning", "trainer")]
FABRIC = [("lightning_bagua.strategies.fabric", "fabric"), ("lightning_bagua.lightning_fabric", "fabric")]
STANDALONE = {
    "lightning_bagua.pytorch_lightning": "pytorch_lightning",
    "lightning_bagua.lightning_fabric": "lightning_fabric",
}
TRAINER_ONLY = {"pause_for_validation"}
# The one argument the frameworks name differently: Lightning's DDPStrategy calls it so, Fabric's `precision`.
PRECISION = {"trainer": "precision_plugin", "fabric": "precision"}


def _strategy_class(module_name: str) -> type:
    package = STANDALONE.get(module_name)
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed here")
    return importlib.import_module(module_name).BaguaStrategy


def _documented_arguments(cls: type) -> list[str]:
    """The names under the ``Args:`` section of the class docstring, ``**bagua_kwargs`` as ``bagua_kwargs``."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Args:\n", 1)[1]
    return re.findall(r"^    (?:\*\*)?(\w+):", section, flags=re.MULTILINE)


@pytest.mark.parametrize(("module_name", "framework"), TRAINER + FABRIC)
def test_the_signature_names_every_argument_and_passes_only_algorithm_keywords_through(module_name, framework):
    cls = _strategy_class(module_name)
    parameters = inspect.signature(cls).parameters
    var_keyword = [name for name, p in parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert var_keyword == ["bagua_kwargs"], var_keyword
    assert not [name for name, p in parameters.items() if p.kind is inspect.Parameter.VAR_POSITIONAL]
    # The standalone packages' classes carry a one-line docstring pointing at the documented class.
    documented = _strategy_class("lightning_bagua" if framework == "trainer" else "lightning_bagua.strategies.fabric")
    assert list(parameters) == _documented_arguments(documented)
    assert PRECISION[framework] in parameters
    if framework == "trainer":
        assert set(parameters) >= TRAINER_ONLY
    else:
        assert not TRAINER_ONLY & set(parameters)


def test_the_trainer_and_fabric_classes_share_their_arguments_and_defaults():
    trainer = inspect.signature(_strategy_class("lightning_bagua")).parameters
    fabric = inspect.signature(_strategy_class("lightning_bagua.strategies.fabric")).parameters
    shared = [name for name in trainer if name not in TRAINER_ONLY and name != PRECISION["trainer"]]
    assert shared == [name for name in fabric if name != PRECISION["fabric"]]
    for name in shared:
        assert (trainer[name].kind, trainer[name].default) == (fabric[name].kind, fabric[name].default), name


@pytest.mark.parametrize(("module_name", "framework"), [TRAINER[0], FABRIC[0]])
def test_arguments_reach_the_strategy(module_name, framework):
    cls = _strategy_class(module_name)
    strategy = cls(
        algorithm="bytegrad",
        flatten=False,
        timeout=timedelta(seconds=42),
        bucket_cap_mb=5,
        average_before_save=True,
        hierarchical=False,
    )
    assert strategy.algorithm.name == "bytegrad"
    assert strategy.flatten is False
    assert strategy._timeout == timedelta(seconds=42)
    assert strategy.bucket_cap_mb == 5.0
    assert strategy.average_before_save is True
    assert strategy.bagua_kwargs == {"hierarchical": False}


def test_trainer_only_arguments_are_checked_on_the_trainer_class():
    from lightning_bagua import BaguaStrategy

    assert BaguaStrategy(pause_for_validation=True).pause_for_validation is True
    with pytest.raises(TypeError, match=r"`pause_for_validation` must be a bool, got 'yes'"):
        BaguaStrategy(pause_for_validation="yes")
