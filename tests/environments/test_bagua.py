import logging

import lightning.fabric.plugins.environments as fabric_environments
import lightning_fabric.plugins.environments as pl_fabric_environments
import pytest

from lightning_bagua.environments import BaguaEnvironment
from lightning_bagua.environments.bagua import _BaguaEnvironmentLogic


# The pytorch_lightning flavour, built the way lightning_bagua.pytorch_lightning builds it, so that the mixin is
# checked against the second ClusterEnvironment hierarchy independently of that module.
class PLBaguaEnvironment(_BaguaEnvironmentLogic, pl_fabric_environments.ClusterEnvironment):
    pass


FLAVOURS = [
    pytest.param((BaguaEnvironment, fabric_environments.ClusterEnvironment), id="lightning"),
    pytest.param((PLBaguaEnvironment, pl_fabric_environments.ClusterEnvironment), id="pytorch_lightning"),
]

ALL_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "BAGUA_SERVICE_PORT",
)

LAUNCH = {
    "WORLD_SIZE": "8",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "NODE_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29500",
    "BAGUA_SERVICE_PORT": "29501",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # The test process may itself run under a launcher; start every test from an environment without its variables.
    for name in ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def set_env(monkeypatch, **values):
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(params=FLAVOURS)
def flavour(request):
    return request.param


def test_classes_are_cluster_environments_of_their_package():
    assert issubclass(BaguaEnvironment, fabric_environments.ClusterEnvironment)
    assert not issubclass(BaguaEnvironment, pl_fabric_environments.ClusterEnvironment)
    assert issubclass(PLBaguaEnvironment, pl_fabric_environments.ClusterEnvironment)
    assert not issubclass(PLBaguaEnvironment, fabric_environments.ClusterEnvironment)


def test_mixin_satisfies_every_abstract_method(flavour):
    cls, base = flavour
    assert base.__abstractmethods__, "the base class should declare abstract methods for this test to mean anything"
    assert cls.__abstractmethods__ == frozenset()
    assert isinstance(cls(), base)


def test_package_exports():
    import lightning_bagua
    import lightning_bagua.environments as environments

    assert environments.__all__ == ["BaguaEnvironment"]
    assert lightning_bagua.BaguaEnvironment is BaguaEnvironment


def test_values_from_launch_variables(monkeypatch, flavour):
    cls, _ = flavour
    set_env(monkeypatch, **LAUNCH)
    env = cls()
    assert env.creates_processes_externally is True
    assert env.main_address == "10.0.0.7"
    assert env.main_port == 29500
    assert env.service_port == 29501
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert env.local_rank() == 1
    assert env.node_rank() == 1
    assert env.local_world_size() == 4
    assert cls.detect() is True


def test_values_are_read_live(monkeypatch, flavour):
    cls, _ = flavour
    set_env(monkeypatch, **LAUNCH)
    env = cls()
    assert env.global_rank() == 5
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert env.global_rank() == 6
    assert env.main_port == 1234


def test_defaults(monkeypatch, flavour):
    cls, _ = flavour
    set_env(monkeypatch, WORLD_SIZE="2", RANK="0")
    env = cls()
    assert env.main_address == "127.0.0.1"
    assert env.main_port == -1
    assert env.service_port == -1
    assert env.local_rank() == 0
    assert env.node_rank() == 0
    assert env.local_world_size() is None
    assert env.creates_processes_externally is True


def test_detect(monkeypatch, flavour):
    cls, _ = flavour
    assert cls.detect() is False
    # Only the Bagua-specific variable counts: a torchrun-style launch is not a Bagua launch.
    set_env(monkeypatch, **{k: v for k, v in LAUNCH.items() if k != "BAGUA_SERVICE_PORT"})
    assert cls.detect() is False
    monkeypatch.setenv("BAGUA_SERVICE_PORT", "29501")
    assert cls.detect() is True
    assert cls().detect() is True


def test_setters_are_ignored_and_logged(monkeypatch, caplog, flavour):
    cls, _ = flavour
    set_env(monkeypatch, WORLD_SIZE="4", RANK="3")
    env = cls()
    with caplog.at_level(logging.DEBUG, logger="lightning_bagua.environments.bagua"):
        env.set_world_size(100)
        env.set_global_rank(42)
    assert env.world_size() == 4
    assert env.global_rank() == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "lightning_bagua.environments.bagua"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "lightning_bagua.environments.bagua")
    assert any("set_world_size(100)" in m for m in messages)
    assert any("set_global_rank(42)" in m for m in messages)


def test_setters_work_without_launch_variables(flavour):
    cls, _ = flavour
    env = cls()
    env.set_world_size(2)
    env.set_global_rank(1)


@pytest.mark.parametrize(
    ("variable", "read"),
    [
        ("WORLD_SIZE", lambda env: env.world_size()),
        ("RANK", lambda env: env.global_rank()),
        ("LOCAL_RANK", lambda env: env.local_rank()),
        ("NODE_RANK", lambda env: env.node_rank()),
        ("LOCAL_WORLD_SIZE", lambda env: env.local_world_size()),
        ("MASTER_PORT", lambda env: env.main_port),
        ("BAGUA_SERVICE_PORT", lambda env: env.service_port),
    ],
)
@pytest.mark.parametrize("bad", ["abc", "1.5", ""])
def test_non_integer_value_names_variable_and_value(monkeypatch, flavour, variable, read, bad):
    cls, _ = flavour
    set_env(monkeypatch, **LAUNCH)
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError, match=rf"{variable}={bad!r}.*not an integer"):
        read(cls())


@pytest.mark.parametrize(
    ("variable", "value", "read"),
    [
        ("WORLD_SIZE", "0", lambda env: env.world_size()),
        ("RANK", "-1", lambda env: env.global_rank()),
        ("LOCAL_RANK", "-2", lambda env: env.local_rank()),
        ("NODE_RANK", "-1", lambda env: env.node_rank()),
        ("LOCAL_WORLD_SIZE", "0", lambda env: env.local_world_size()),
    ],
)
def test_out_of_range_value_names_variable_and_value(monkeypatch, flavour, variable, value, read):
    cls, _ = flavour
    set_env(monkeypatch, **LAUNCH)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}={value!r} must be at least"):
        read(cls())


def test_surrounding_whitespace_is_accepted(monkeypatch, flavour):
    cls, _ = flavour
    set_env(monkeypatch, WORLD_SIZE=" 4\n", RANK="2 ")
    env = cls()
    assert env.world_size() == 4
    assert env.global_rank() == 2


def test_empty_main_address_is_an_error(monkeypatch, flavour):
    cls, _ = flavour
    monkeypatch.setenv("MASTER_ADDR", " ")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _ = cls().main_address


@pytest.mark.parametrize("missing", ["WORLD_SIZE", "RANK"])
def test_missing_world_size_or_rank_under_bagua_launch(monkeypatch, flavour, missing):
    cls, _ = flavour
    set_env(monkeypatch, **{k: v for k, v in LAUNCH.items() if k != missing})
    assert cls.detect() is True
    env = cls()
    read = env.world_size if missing == "WORLD_SIZE" else env.global_rank
    with pytest.raises(ValueError, match=rf"needs the environment variable {missing}, but it is not set"):
        read()


def test_validate_settings(monkeypatch, flavour):
    cls, _ = flavour
    set_env(monkeypatch, **LAUNCH)
    env = cls()
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=r"devices=2 and num_nodes=2 \(4 processes\).*WORLD_SIZE=8"):
        env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"devices=2 per node.*LOCAL_WORLD_SIZE=4"):
        env.validate_settings(num_devices=2, num_nodes=4)
    # Without LOCAL_WORLD_SIZE only the total is checked.
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    env.validate_settings(num_devices=2, num_nodes=4)


SINGLE_PROCESS_LAUNCH = {
    "WORLD_SIZE": "1",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "BAGUA_SERVICE_PORT": "29501",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    ("trainer_module", "env_cls"),
    [
        pytest.param("lightning.pytorch", BaguaEnvironment, id="lightning"),
        pytest.param("pytorch_lightning", PLBaguaEnvironment, id="pytorch_lightning"),
    ],
)
def test_trainer_accepts_environment(monkeypatch, tmp_path, trainer_module, env_cls):
    trainer_cls = pytest.importorskip(trainer_module).Trainer
    set_env(monkeypatch, **SINGLE_PROCESS_LAUNCH)
    kwargs = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }

    env = env_cls()
    trainer = trainer_cls(plugins=[env], **kwargs)
    # One device gives a single-device strategy, which has no cluster environment; the connector still keeps ours.
    assert trainer._accelerator_connector.cluster_environment is env

    env = env_cls()
    trainer = trainer_cls(plugins=[env], strategy="ddp", **kwargs)
    assert trainer.strategy.cluster_environment is env
    assert trainer.world_size == 1
    assert trainer.global_rank == 0
    assert trainer.local_rank == 0
    assert trainer.node_rank == 0


def test_trainer_rejects_wrong_flavour(monkeypatch, tmp_path):
    # Each Lightning package only accepts its own ClusterEnvironment; this is why there are two classes.
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import Trainer

    set_env(monkeypatch, **SINGLE_PROCESS_LAUNCH)
    with pytest.raises(MisconfigurationException, match="invalid type for plugin"):
        Trainer(accelerator="cpu", devices=1, plugins=[PLBaguaEnvironment()], logger=False, default_root_dir=tmp_path)


def test_pytorch_lightning_module_twin():
    module = pytest.importorskip("lightning_bagua.pytorch_lightning")
    twin = module.BaguaEnvironment
    assert issubclass(twin, _BaguaEnvironmentLogic)
    assert issubclass(twin, pl_fabric_environments.ClusterEnvironment)
    assert twin.__abstractmethods__ == frozenset()
