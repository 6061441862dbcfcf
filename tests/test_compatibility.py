"""What a script written against lightning-bagua 0.1.0 or Bagua's algorithm classes still finds and calls."""

import copy
import inspect

import pytest
import torch
from torch import nn


def test_lightning_bagua_0_1_0_module_paths():
    from lightning_bagua import BaguaStrategy as Exported
    from lightning_bagua.environment import BaguaEnvironment
    from lightning_bagua.environments.bagua import BaguaEnvironment as Environment
    from lightning_bagua.strategies.bagua import BaguaStrategy as Strategy
    from lightning_bagua.strategy import BaguaStrategy

    # Aliases, not copies: one class each.
    assert BaguaStrategy is Strategy is Exported
    assert BaguaEnvironment is Environment


def test_the_strategy_keeps_0_1_0s_positional_signature():
    from lightning_bagua.strategy import BaguaStrategy

    names = list(inspect.signature(BaguaStrategy.__init__).parameters)[1:8]
    assert names == [
        "algorithm", "flatten", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
        "precision_plugin",
    ]  # fmt: skip
    strategy = BaguaStrategy("qadam", True)
    assert strategy.algorithm.name == "qadam"
    assert strategy.flatten is True


@pytest.mark.parametrize(
    ("name", "positional", "expected"),
    [
        ("gradient_allreduce", (True, False), {"hierarchical": True, "average": False}),
        ("bytegrad", (False, False), {"hierarchical": False, "average": False}),
        (
            "decentralized",
            (False, "shift_one", 2),
            {"hierarchical": False, "peer_selection_mode": "shift_one", "communication_interval": 2},
        ),
        ("low_precision_decentralized", (False, 3), {"hierarchical": False, "communication_interval": 3}),
        ("async", ("all", 20, 4), {"peer_selection_mode": "all", "sync_interval_ms": 20, "warmup_steps": 4}),
    ],
)
def test_algorithms_take_their_keywords_by_position_in_baguas_order(name, positional, expected):
    from lightning_bagua.engine.algorithms.base import algorithm_class

    algorithm = algorithm_class(name)(*positional)
    assert {key: getattr(algorithm, key) for key in expected} == expected
    assert algorithm == algorithm_class(name)(**expected)


def test_qadam_as_bagua_scripts_call_it():
    from lightning_bagua import QAdamAlgorithm, QAdamOptimizer

    model = nn.Linear(4, 2)
    optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=5)
    assert optimizer.warmup_steps == 5
    algorithm = QAdamAlgorithm(optimizer)  # Bagua: QAdamAlgorithm(q_adam_optimizer, hierarchical=True)
    assert algorithm.optimizer is optimizer is algorithm.q_adam_optimizer
    assert algorithm.hierarchical is True
    assert QAdamAlgorithm(optimizer, False).hierarchical is False


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
