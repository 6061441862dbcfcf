"""The start-up hook: strategies declared as entry points reach Lightning's registries without an import."""

import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import sysconfig
import textwrap
import types
from pathlib import Path

import pytest
from benchmarks.micro.startup_time import build_wheel

from lightning_bagua import _registration
from lightning_bagua._registration import REGISTRY_MODULES, install_registration_hook

REPO = Path(__file__).resolve().parents[1]
PTH_NAME = "lightning_bagua_registration.pth"
SUBPROCESS_TIMEOUT = 120
REGISTRY_PACKAGES = [
    pytest.param("lightning.pytorch", id="lightning"),
    pytest.param("pytorch_lightning", id="pytorch_lightning"),
]

# Undo whatever an installed .pth did at start-up, so that a subprocess sees an environment without the hook and
# the test decides when lightning_bagua is imported. The modules are forgotten, not only the finder, so that the
# `import lightning_bagua` that follows runs the package's __init__ again.
FORGET_STARTUP_HOOK = textwrap.dedent(
    """
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_lightning_bagua_registration_hook", False)]
    for _name in [m for m in sys.modules if m == "lightning_bagua" or m.startswith("lightning_bagua.")]:
        del sys.modules[_name]
    """
)


def run_python(code, python=sys.executable, env=None, without_startup_hook=False):
    """Run ``code`` in a fresh interpreter and return the JSON value it prints on its last line."""
    source = (FORGET_STARTUP_HOOK if without_startup_hook else "") + textwrap.dedent(code)
    result = subprocess.run(
        [str(python), "-c", source],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=env,
        check=False,
    )
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- fresh interpreters of the project's environment -----------------------------------------------------------------


def test_import_loads_neither_torch_nor_lightning():
    report = run_python(
        """
        import json, sys
        import lightning_bagua
        print(json.dumps({
            "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning",
                                                                           "lightning_fabric", "numpy")),
            "hooks": [type(f).__name__ for f in sys.meta_path
                      if getattr(f, "_lightning_bagua_registration_hook", False)],
        }))
        """
    )
    assert report["heavy"] == []
    assert report["hooks"] == ["_RegistryModuleFinder"]


def test_installing_the_hook_imports_nothing_beyond_the_package():
    report = run_python(
        """
        import json
        before = set(sys.modules)
        import lightning_bagua._registration
        lightning_bagua._registration.install_registration_hook()
        print(json.dumps(sorted(set(sys.modules) - before)))
        """,
        without_startup_hook=True,
    )
    # `logging` and `importlib.metadata` are deferred until a Lightning registry is actually imported.
    assert "logging" not in report
    assert "importlib.metadata" not in report
    assert not [name for name in report if name.split(".")[0] in ("torch", "lightning", "pytorch_lightning")]


@pytest.mark.parametrize("package", REGISTRY_PACKAGES)
def test_registry_imported_after_the_package_gets_bagua(package):
    report = run_python(
        f"""
        import json
        import lightning_bagua
        from {package}.strategies import StrategyRegistry
        entry = StrategyRegistry["bagua"]
        print(json.dumps({{
            "description": entry["description"],
            "factory": type(entry["strategy"]).__name__,
            "strategy_module_loaded": "lightning_bagua.strategies.bagua" in sys.modules
                                      or "lightning_bagua.pytorch_lightning" in sys.modules,
            "loader": type(sys.modules["{package}.strategies"].__loader__).__name__,
        }}))
        """,
        without_startup_hook=True,
    )
    assert report["description"]
    assert report["factory"] == "_LazyStrategy"
    # Importing the strategy while Lightning initialises could import Lightning from inside itself.
    assert report["strategy_module_loaded"] is False
    # The registry module ends up with its own loader, as if no hook had been involved.
    assert report["loader"] == "SourceFileLoader"


@pytest.mark.parametrize("package", REGISTRY_PACKAGES)
def test_registry_imported_before_the_package_gets_bagua(package):
    report = run_python(
        f"""
        import json
        from {package}.strategies import StrategyRegistry
        before = "bagua" in StrategyRegistry
        import lightning_bagua
        print(json.dumps({{"before": before, "after": "bagua" in StrategyRegistry}}))
        """,
        without_startup_hook=True,
    )
    assert report == {"before": False, "after": True}


def test_name_registered_by_someone_else_is_kept_and_nothing_raises():
    report = run_python(
        """
        import json
        from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

        class Theirs(SingleDeviceStrategy):
            pass

        StrategyRegistry.register("bagua", Theirs, description="registered first by someone else")
        import lightning_bagua
        lightning_bagua._registration.install_registration_hook()
        lightning_bagua._registration.install_registration_hook()
        print(json.dumps({
            "strategy": StrategyRegistry["bagua"]["strategy"].__name__,
            "description": StrategyRegistry["bagua"]["description"],
            "hooks": sum(getattr(f, "_lightning_bagua_registration_hook", False) for f in sys.meta_path),
        }))
        """,
        without_startup_hook=True,
    )
    assert report == {"strategy": "Theirs", "description": "registered first by someone else", "hooks": 1}


def test_reimported_registry_module_is_registered_again():
    report = run_python(
        """
        import json, sys
        import lightning_bagua
        import lightning.pytorch.strategies as first
        del sys.modules["lightning.pytorch.strategies"]
        import lightning.pytorch.strategies as second
        print(json.dumps({"fresh": first.StrategyRegistry is not second.StrategyRegistry,
                          "bagua": "bagua" in second.StrategyRegistry}))
        """
    )
    assert report == {"fresh": True, "bagua": True}


@pytest.mark.parametrize("package", REGISTRY_PACKAGES)
def test_trainer_builds_the_bagua_strategy_by_name(package):
    report = run_python(
        f"""
        import json
        import lightning_bagua
        from {package} import Trainer
        trainer = Trainer(strategy="bagua", accelerator="cpu", devices=1, max_steps=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        print(json.dumps({{"type": type(trainer.strategy).__name__, "name": trainer.strategy.strategy_name}}))
        """
    )
    assert report == {"type": "BaguaStrategy", "name": "bagua"}


# --- the hook's parts, in this process, against stand-in registries --------------------------------------------------


class FakeRegistry(dict):
    """Behaves like Lightning's registry where the hook relies on it: `register` refuses a name it already has."""

    def register(self, name, strategy=None, description=None, override=False, **init_params):
        if name in self and not override:
            raise ValueError(f"'{name}' is already present in the registry")
        self[name] = {"strategy": strategy, "description": description, "init_params": init_params}
        return strategy


class Built:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def fake_entry_points(monkeypatch, group, **targets):
    points = [importlib.metadata.EntryPoint(name=name, value=value, group=group) for name, value in targets.items()]

    def entry_points(**selection):
        assert selection == {"group": group}
        return points

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@pytest.fixture
def strategy_module(tmp_path, monkeypatch):
    """A module on sys.path whose import is recorded: it stands for a strategy module that must load lazily."""
    (tmp_path / "lazy_strategy_target.py").write_text(
        "import sys\nsys.modules[__name__].imported = True\n\n"
        "class Strategy:\n    def __init__(self, **kwargs):\n        self.kwargs = kwargs\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_strategy_target", raising=False)
    yield "lazy_strategy_target"
    sys.modules.pop("lazy_strategy_target", None)


def test_lazy_factory_imports_on_first_call_and_passes_arguments(strategy_module):
    entry_point = importlib.metadata.EntryPoint(name="lazy", value=f"{strategy_module}:Strategy", group="g")
    factory = _registration._LazyStrategy(entry_point)
    assert strategy_module not in sys.modules

    strategy = factory(process_group_backend="gloo", timeout=5)

    assert sys.modules[strategy_module].imported is True
    assert type(strategy).__name__ == "Strategy"
    assert strategy.kwargs == {"process_group_backend": "gloo", "timeout": 5}


def test_register_adds_every_entry_point_lazily_and_skips_taken_names(monkeypatch, strategy_module):
    group = "lightning.pytorch.strategies"
    fake_entry_points(monkeypatch, group, taken=f"{strategy_module}:Strategy", fresh=f"{strategy_module}:Strategy")
    module = types.ModuleType(group)
    module.StrategyRegistry = FakeRegistry(taken={"strategy": Built, "description": "theirs"})

    _registration._register_entry_points(module)

    assert module.StrategyRegistry["taken"] == {"strategy": Built, "description": "theirs"}
    fresh = module.StrategyRegistry["fresh"]
    assert isinstance(fresh["strategy"], _registration._LazyStrategy)
    assert strategy_module in fresh["description"]
    assert strategy_module not in sys.modules


def test_register_finds_fabrics_registry_name(monkeypatch):
    group = "lightning.fabric.strategies"
    fake_entry_points(monkeypatch, group, bagua="somewhere:Strategy")
    module = types.ModuleType(group)
    module.STRATEGY_REGISTRY = FakeRegistry()

    _registration._register_entry_points(module)

    assert list(module.STRATEGY_REGISTRY) == ["bagua"]


def test_failed_registration_is_logged_and_the_rest_still_registers(monkeypatch, caplog):
    group = "pytorch_lightning.strategies"
    fake_entry_points(monkeypatch, group, broken="pkg.mod:Broken", fine="pkg.mod:Fine")

    class PickyRegistry(FakeRegistry):
        def register(self, name, *args, **kwargs):
            if name == "broken":
                raise TypeError("cannot take this one")
            return super().register(name, *args, **kwargs)

    module = types.ModuleType(group)
    module.StrategyRegistry = PickyRegistry()

    with caplog.at_level(logging.WARNING, logger=_registration.__name__):
        _registration._register_entry_points(module)

    assert list(module.StrategyRegistry) == ["fine"]
    (record,) = caplog.records
    assert record.name == "lightning_bagua._registration"
    assert "broken" in record.getMessage()
    assert "pkg.mod:Broken" in record.getMessage()
    assert "cannot take this one" in record.getMessage()


def test_unreadable_entry_points_and_missing_registry_are_logged_not_raised(monkeypatch, caplog):
    def entry_points(**selection):
        raise OSError("metadata is corrupt")

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with_registry = types.ModuleType("lightning.pytorch.strategies")
    with_registry.StrategyRegistry = FakeRegistry()
    without_registry = types.ModuleType("lightning_fabric.strategies")

    with caplog.at_level(logging.WARNING, logger=_registration.__name__):
        _registration._register_entry_points(with_registry)
        _registration._register_entry_points(without_registry)

    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "metadata is corrupt" in messages[0]
    assert "lightning_fabric.strategies" in messages[1]


def test_module_level_log_is_the_package_logger():
    assert _registration.log is logging.getLogger("lightning_bagua._registration")


@pytest.fixture
def fake_registry_package(tmp_path, monkeypatch):
    """An importable stand-in for a Lightning registry module, plus the entry points of its group."""
    name = "fake_lightning_registry"
    (tmp_path / f"{name}.py").write_text(
        "class Registry(dict):\n"
        "    def register(self, name, strategy, description=None, **init_params):\n"
        "        self[name] = {'strategy': strategy, 'description': description}\n\n"
        "StrategyRegistry = Registry()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    fake_entry_points(monkeypatch, name, bagua="nowhere_yet:Strategy")
    yield name
    sys.modules.pop(name, None)


def test_finder_registers_right_after_the_watched_module_runs(monkeypatch, fake_registry_package):
    finder = _registration._RegistryModuleFinder([fake_registry_package])
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])

    module = importlib.import_module(fake_registry_package)

    assert isinstance(module.StrategyRegistry["bagua"]["strategy"], _registration._LazyStrategy)
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__


def test_finder_ignores_other_modules_and_missing_ones(fake_registry_package):
    finder = _registration._RegistryModuleFinder([fake_registry_package, "no_such_registry_module"])

    assert finder.find_spec("json", None) is None
    assert finder.find_spec("no_such_registry_module", None) is None
    spec = finder.find_spec(fake_registry_package, None)
    assert spec is not None
    assert type(spec.loader).__name__ == "_RegisteringLoader"


def test_finder_does_not_loop_when_another_finder_reenters_the_import_system(monkeypatch, fake_registry_package):
    class Reentrant:
        calls = 0

        def find_spec(self, fullname, path=None, target=None):
            if fullname == fake_registry_package:
                Reentrant.calls += 1
                # Some finders consult importlib.util.find_spec themselves, which walks sys.meta_path again.
                return importlib.util.find_spec(fullname) if Reentrant.calls == 1 else None
            return None

    finder = _registration._RegistryModuleFinder([fake_registry_package])
    monkeypatch.setattr(sys, "meta_path", [finder, Reentrant(), *sys.meta_path])

    module = importlib.import_module(fake_registry_package)

    assert "bagua" in module.StrategyRegistry


def test_an_error_inside_the_watched_module_still_propagates(tmp_path, monkeypatch):
    (tmp_path / "broken_registry_module.py").write_text("raise RuntimeError('the registry module itself fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = _registration._RegistryModuleFinder(["broken_registry_module"])
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])

    with pytest.raises(RuntimeError, match="the registry module itself fails"):
        importlib.import_module("broken_registry_module")
    assert "broken_registry_module" not in sys.modules


def test_install_is_idempotent(monkeypatch):
    monkeypatch.setattr(
        sys, "meta_path", [f for f in sys.meta_path if not getattr(f, "_lightning_bagua_registration_hook", False)]
    )

    install_registration_hook()
    install_registration_hook()

    hooks = [f for f in sys.meta_path if getattr(f, "_lightning_bagua_registration_hook", False)]
    assert len(hooks) == 1
    assert sys.meta_path[0] is hooks[0]
    assert hooks[0].module_names == frozenset(REGISTRY_MODULES)


# --- the built wheel in a fresh virtual environment ------------------------------------------------------------------

# What the main environment's site-packages must not lend the fresh one: its own lightning_bagua (an editable
# install) and every .pth, which a plain sys.path entry would not run anyway.
NOT_LENT = ("lightning_bagua", "__editable__", "__pycache__")


def lend_dependencies(target: Path) -> Path:
    """Link the main environment's installed packages, except lightning_bagua itself, into ``target``."""
    target.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.startswith(NOT_LENT) or entry.suffix == ".pth":
            continue
        (target / entry.name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A new virtualenv with only the wheel installed; torch and Lightning are lent without an install."""
    workdir = tmp_path_factory.mktemp("fresh-venv")
    wheel = build_wheel(workdir)
    venv = workdir / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = run_python("import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))", python=python)
    site_packages = Path(purelib)
    # A path line in a .pth only extends sys.path: nothing in the lent folder runs at start-up.
    (site_packages / "_lent_dependencies.pth").write_text(f"{lend_dependencies(workdir / 'lent')}\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    result = subprocess.run(install, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return types.SimpleNamespace(python=python, site_packages=site_packages, prefix=venv)


def fresh_env() -> dict[str, str]:
    # PYTHONPATH would let the checkout's src/ shadow the installed wheel.
    return {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}


@pytest.mark.slow
def test_wheel_installs_the_startup_hook_which_loads_nothing_heavy(fresh_venv):
    assert (fresh_venv.site_packages / PTH_NAME).read_text().startswith("import lightning_bagua._registration")
    report = run_python(
        """
        import json, sys
        print(json.dumps({
            "modules": sorted(sys.modules),
            "hooks": sum(getattr(f, "_lightning_bagua_registration_hook", False) for f in sys.meta_path),
            "package": sys.modules["lightning_bagua"].__file__,
        }))
        """,
        python=fresh_venv.python,
        env=fresh_env(),
    )
    assert report["hooks"] == 1
    assert report["package"].startswith(str(fresh_venv.prefix))
    heavy = [name for name in report["modules"] if name.split(".")[0] in ("torch", "lightning", "pytorch_lightning")]
    assert heavy == []
    assert "lightning_bagua.strategies" not in report["modules"]


@pytest.mark.slow
@pytest.mark.parametrize("package", REGISTRY_PACKAGES)
def test_trainer_finds_bagua_in_a_script_that_never_imports_it(fresh_venv, package):
    # The .pth has imported lightning_bagua._registration, but nothing of torch, Lightning or our strategies.
    report = run_python(
        f"""
        import json, sys
        assert "torch" not in sys.modules and "{package.split(".")[0]}" not in sys.modules
        assert not [m for m in sys.modules if m.startswith(("lightning_bagua.strategies",
                                                            "lightning_bagua.pytorch_lightning"))]
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from {package} import LightningModule, Trainer

        class Tiny(LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                inputs, targets = batch
                return torch.nn.functional.mse_loss(self.layer(inputs), targets)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer = Trainer(strategy="bagua", accelerator="cpu", devices=1, max_steps=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        torch.manual_seed(0)
        model = Tiny()
        before = model.layer.weight.detach().clone()
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4))
        print(json.dumps({{
            "type": type(trainer.strategy).__name__,
            "name": trainer.strategy.strategy_name,
            "from": sys.modules[type(trainer.strategy).__module__].__file__,
            "steps": trainer.global_step,
            "trained": not torch.equal(before, model.layer.weight.detach()),
        }}))
        """,
        python=fresh_venv.python,
        env=fresh_env(),
    )
    assert report["type"] == "BaguaStrategy"
    assert report["name"] == "bagua"
    assert report["from"].startswith(str(fresh_venv.prefix))
    assert report["steps"] == 2
    assert report["trained"] is True


FABRIC_PACKAGES = [
    pytest.param("lightning.fabric", "lightning_bagua.strategies.fabric", id="lightning"),
    pytest.param("lightning_fabric", "lightning_bagua.lightning_fabric", id="lightning_fabric"),
]


@pytest.mark.parametrize(("package", "strategy_module"), FABRIC_PACKAGES)
def test_fabric_builds_the_bagua_strategy_by_name_without_an_import(package, strategy_module):
    # The script never imports lightning_bagua: the installed start-up hook registers "bagua" with Fabric's registry.
    report = run_python(
        f"""
        import json, sys
        from {package} import Fabric
        from {package}.strategies import STRATEGY_REGISTRY
        factory = type(STRATEGY_REGISTRY["bagua"]["strategy"]).__name__
        loaded_before = "{strategy_module}" in sys.modules
        fabric = Fabric(strategy="bagua", accelerator="cpu", devices=1)
        strategy = fabric.strategy
        print(json.dumps({{
            "factory": factory,
            "loaded_before": loaded_before,
            "class": type(strategy).__module__ + "." + type(strategy).__name__,
            "algorithm": strategy.algorithm.name,
        }}))
        """
    )
    assert report == {
        "factory": "_LazyStrategy",
        "loaded_before": False,
        "class": f"{strategy_module}.BaguaStrategy",
        "algorithm": "gradient_allreduce",
    }
