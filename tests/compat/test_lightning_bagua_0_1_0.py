"""What a script written for lightning-bagua 0.1.0 or Bagua 0.9.2 imports and calls keeps working."""

import copy
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed import free_port

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "script_0_1_0.py"


def test_the_0_1_0_module_paths_import_the_current_classes():
    import lightning_bagua
    from lightning_bagua.environment import BaguaEnvironment as OldEnvironment
    from lightning_bagua.environments.bagua import BaguaEnvironment
    from lightning_bagua.strategies.bagua import BaguaStrategy
    from lightning_bagua.strategy import BaguaStrategy as OldStrategy

    assert OldStrategy is BaguaStrategy is lightning_bagua.BaguaStrategy
    assert OldEnvironment is BaguaEnvironment is lightning_bagua.BaguaEnvironment
    # 0.1.0's package star-imported its metadata.
    for name in ("__version__", "__author__", "__docs__", "__homepage__", "__license__"):
        assert isinstance(getattr(lightning_bagua, name), str), name


def test_the_0_1_0_environment_contract(monkeypatch):
    from lightning_bagua.environment import BaguaEnvironment

    for name in ("MASTER_ADDR", "MASTER_PORT", "BAGUA_SERVICE_PORT", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not BaguaEnvironment.detect()
    environment = BaguaEnvironment()
    assert (environment.main_address, environment.main_port, environment.service_port) == ("127.0.0.1", -1, -1)
    monkeypatch.setenv("BAGUA_SERVICE_PORT", "29501")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert BaguaEnvironment.detect()
    assert (environment.world_size(), environment.global_rank(), environment.service_port) == (4, 3, 29501)


# Bagua 0.9.2's constructors, all positional-or-keyword: (class name, positional arguments, the same by name).
BAGUA_POSITIONS = [
    ("GradientAllReduceAlgorithm", (True, False), {"hierarchical": True, "average": False}),
    ("ByteGradAlgorithm", (False, False), {"hierarchical": False, "average": False}),
    (
        "DecentralizedAlgorithm",
        (False, "shift_one", 3),
        {"hierarchical": False, "peer_selection_mode": "shift_one", "communication_interval": 3},
    ),
    ("LowPrecisionDecentralizedAlgorithm", (False, 2), {"hierarchical": False, "communication_interval": 2}),
    (
        "AsyncModelAverageAlgorithm",
        ("all", 50, 7),
        {"peer_selection_mode": "all", "sync_interval_ms": 50, "warmup_steps": 7},
    ),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), BAGUA_POSITIONS)
def test_algorithms_take_baguas_positional_arguments(name, args, kwargs):
    import lightning_bagua

    cls = getattr(lightning_bagua, name)
    positional = cls(*args)
    assert positional == cls(**kwargs)
    assert all(getattr(positional, key) == value for key, value in kwargs.items())
    # Every named argument is a keyword of the registry, in Bagua's order (keyword-only additions of ours, such as
    # async's average_on_abort, follow), so Algorithm.init takes them all.
    assert list(cls.keywords())[: len(kwargs)] == list(kwargs)
    assert lightning_bagua.Algorithm.init(cls.name, **kwargs) == positional
    assert repr(positional).startswith(f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}")
    with pytest.raises(TypeError):
        cls(*args, None)  # no more positions than Bagua had


def test_qadam_as_bagua_wrote_it():
    from lightning_bagua import Algorithm, QAdamAlgorithm, QAdamOptimizer

    model = nn.Linear(3, 1)
    optimizer = QAdamOptimizer(model.parameters(), 1e-3, 50)  # Bagua's positions: params, lr, warmup_steps
    assert optimizer.warmup_steps == 50
    algorithm = QAdamAlgorithm(optimizer)
    assert algorithm.optimizer is optimizer
    assert algorithm.hierarchical
    assert list(QAdamAlgorithm.keywords()) == ["q_adam_optimizer", "hierarchical"]
    assert Algorithm.init("qadam", q_adam_optimizer=optimizer, hierarchical=False) == QAdamAlgorithm(optimizer, False)
    assert [p.name for p in inspect.signature(QAdamOptimizer).parameters.values()][:6] == [
        "params",
        "lr",
        "warmup_steps",
        "betas",
        "eps",
        "weight_decay",
    ]


@pytest.mark.parametrize("algorithm", ["qadam", "async"])
def test_a_0_1_0_script_runs_unchanged(tmp_path, algorithm):
    out = tmp_path / "norms.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "MASTER_PORT": str(free_port())}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), algorithm, str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    norms = torch.load(out)
    # 0.1.0's own check after fitting a BoringModel: training did not blow the weights up.
    assert norms
    assert all(norm < 3 for norm in norms)


def _steps(optimizer: torch.optim.Optimizer, model: nn.Module, count: int) -> None:
    for index in range(count):
        optimizer.zero_grad()
        model(torch.full((3, 4), float(index + 1))).pow(2).sum().backward()
        optimizer.step()


def test_a_qadam_state_dict_saved_without_warmup_steps_loads_and_steps_as_the_original():
    from lightning_bagua import QAdamOptimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)
    _steps(optimizer, model, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    for group in saved["param_groups"]:
        del group["warmup_steps"]  # as releases before warmup_steps was kept per parameter group saved it
    resumed_model = copy.deepcopy(model)
    resumed = QAdamOptimizer(resumed_model.parameters(), lr=0.01, warmup_steps=3)
    resumed.load_state_dict(saved)
    assert [group["warmup_steps"] for group in resumed.param_groups] == [3]
    _steps(optimizer, model, 3)  # across the switch to the frozen second moment
    _steps(resumed, resumed_model, 3)
    torch.testing.assert_close(resumed_model.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_a_qadam_state_dict_round_trips_unchanged():
    from lightning_bagua import QAdamOptimizer

    model = nn.Linear(4, 2)
    optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)
    _steps(optimizer, model, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    resumed = QAdamOptimizer(copy.deepcopy(model).parameters(), lr=0.01, warmup_steps=3)
    resumed.load_state_dict(saved)
    # Filling settings an older state dict lacks must add nothing else (torch keeps keys such as ``differentiable``
    # in ``defaults`` that QAdam's groups never hold).
    assert resumed.state_dict()["param_groups"] == saved["param_groups"]
