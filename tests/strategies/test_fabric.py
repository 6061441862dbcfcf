"""The Fabric BaguaStrategy: construction in-process; training, checkpoints and setup on two real Gloo processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_bagua import QAdamOptimizer
from lightning_bagua.engine import GradientAllReduceAlgorithm
from lightning_bagua.strategies.fabric import ALGORITHM_STATE_KEY, BaguaStrategy
from tests.distributed import assert_ranks_identical, free_port
from tests.strategies.fit_script import make_network
from tests.strategies.test_bagua import reference_state

SCRIPT = Path(__file__).with_name("fabric_script.py")
ROOT = Path(__file__).parents[2]
EXACT = {"rtol": 0.0, "atol": 0.0}
# fp32 data parallelism against one process on the union of the batches: the sums run in another order.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


# ----------------------------------------------------------------------------------------------- construction


def test_defaults_and_read_only_properties():
    strategy = BaguaStrategy()
    assert isinstance(strategy, DDPStrategy)
    assert strategy.algorithm == GradientAllReduceAlgorithm(hierarchical=False, average=True)
    assert strategy.flatten is True
    assert strategy.bagua_kwargs == {}
    assert strategy.communication_counter is None
    assert strategy.bagua_modules == []
    with pytest.raises(AttributeError):
        strategy.flatten = False


def test_bagua_kwargs_reach_the_algorithm_and_instances_are_accepted():
    strategy = BaguaStrategy(algorithm="bytegrad", hierarchical=False, bucket_cap_mb=2)
    assert strategy.algorithm.hierarchical is False
    assert strategy.bagua_kwargs == {"hierarchical": False}
    assert strategy.bucket_cap_mb == 2.0
    algorithm = GradientAllReduceAlgorithm(hierarchical=True)
    assert BaguaStrategy(algorithm=algorithm).algorithm is algorithm
    with pytest.raises(TypeError, match="Pass them to the algorithm's constructor"):
        BaguaStrategy(algorithm=algorithm, average=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"algorithm": "allreduce"}, ValueError, r"Unknown algorithm 'allreduce'. Available algorithms: .*bytegrad"),
        ({"hierarchicl": True}, TypeError, r"Unknown keyword argument\(s\) 'hierarchicl'.*hierarchical=False"),
        ({"algorithm": "decentralized", "peer_selection_mode": "ring"}, ValueError, r"'ring'"),
        ({"flatten": "true"}, TypeError, r"`flatten` must be a bool, got 'true' \(str\)"),
        ({"bucket_cap_mb": -1}, ValueError, r"`bucket_cap_mb` must be a positive number of MiB, got -1"),
    ],
)
def test_bad_input_fails_at_construction_naming_the_choices(kwargs, error, message):
    with pytest.raises(error, match=message):
        BaguaStrategy(**kwargs)


def test_bagua_environment_is_chosen_when_bagua_service_port_is_set(monkeypatch):
    from lightning_bagua import BaguaEnvironment

    monkeypatch.setenv("BAGUA_SERVICE_PORT", "29501")
    assert isinstance(BaguaStrategy().cluster_environment, BaguaEnvironment)
    monkeypatch.delenv("BAGUA_SERVICE_PORT")
    assert BaguaStrategy().cluster_environment is None


def test_all_reduce_rejects_subgroups_and_unknown_ops_and_passes_non_tensors():
    strategy = BaguaStrategy()
    assert strategy.all_reduce("not a tensor") == "not a tensor"
    with pytest.raises(ValueError, match="all_reduce reduces over all processes and takes no `group`, got 'g'"):
        strategy.all_reduce(torch.ones(1), group="g")
    with pytest.raises(ValueError, match=r"Unsupported `reduce_op` 'median'. Use one of 'mean'"):
        strategy.all_reduce(torch.ones(1), reduce_op="median")


def test_qadam_refuses_other_optimizers_before_wrapping():
    # No process group exists here: the check must come before the engine builds its communicators.
    strategy = BaguaStrategy(algorithm="qadam", hierarchical=False)
    model = make_network()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    message = r"^Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler, got optimizers \['SGD'\]"
    with pytest.raises(MisconfigurationException, match=message):
        strategy.setup_module_and_optimizers(model, [sgd])
    two = [QAdamOptimizer(model.parameters()), QAdamOptimizer(model.parameters())]
    with pytest.raises(MisconfigurationException, match=r"got optimizers \['QAdamOptimizer', 'QAdamOptimizer'\]"):
        strategy.setup_module_and_optimizers(model, two)
    assert strategy.bagua_modules == []


def test_register_strategies_registers_bagua_once():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    registry = _StrategyRegistry()
    BaguaStrategy.register_strategies(registry)
    BaguaStrategy.register_strategies(registry)
    assert isinstance(registry.get("bagua"), BaguaStrategy)


def test_lightning_fabric_twin():
    import lightning_fabric

    from lightning_bagua.lightning_fabric import BaguaEnvironment as TwinEnvironment
    from lightning_bagua.lightning_fabric import BaguaStrategy as Twin
    from lightning_bagua.pytorch_lightning import BaguaEnvironment as TrainerTwinEnvironment
    from lightning_bagua.strategies.fabric import _FabricBaguaStrategyLogic

    assert issubclass(Twin, _FabricBaguaStrategyLogic)
    assert issubclass(Twin, lightning_fabric.strategies.DDPStrategy)
    assert not issubclass(Twin, DDPStrategy)
    assert Twin.__abstractmethods__ == frozenset()
    # pytorch_lightning builds on lightning_fabric: its Trainer and lightning_fabric's Fabric share one class.
    assert TrainerTwinEnvironment is TwinEnvironment
    assert Twin._configuration_error is lightning_fabric.utilities.exceptions.MisconfigurationException


# --------------------------------------------------------------------------------------------- real processes


def run_script(out: Path, mode: str, *args: str) -> list[dict]:
    """Run the script on two processes (Fabric's own launcher starts the second) and load what each rank saved."""
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--mode", mode, *args]
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "MASTER_PORT": str(free_port())}
    completed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    # The script's first Fabric asked for the strategy by name.
    assert {result["strategy_class"] for result in results} == {"lightning_bagua.strategies.fabric.BaguaStrategy"}
    return results


def test_fabric_trains_exactly_as_the_trainer_strategy_for_each_algorithm(tmp_path):
    """Same start, same batches per rank, same algorithm: the Fabric loop and the Trainer reach the same weights.

    The cases are the six algorithms (decentralized with both peer selections, async within its warm-up, where it
    is deterministic) and gradient accumulation through
    ``fabric.no_backward_sync``; each rank compares its own weights, since decentralized replicas differ by design.
    """
    results = run_script(tmp_path, "compare")
    cases = sorted(set(results[0]) - {"strategy_class"})
    assert cases == sorted(
        [
            "bytegrad",
            "decentralized",
            "decentralized_shift_one",
            "gradient_allreduce",
            "gradient_allreduce_accumulate",
            "low_precision_decentralized",
            "qadam",
            "async_warmup",
        ]
    )
    for rank, result in enumerate(results):
        for case in cases:
            trainer, fabric = result[case]["trainer"], result[case]["fabric"]
            assert fabric["wrapped"] == "BaguaDistributedDataParallel"
            torch.testing.assert_close(fabric["state"], trainer["state"], **EXACT, msg=f"{case}, rank {rank}")
            assert fabric["bytes_by_op"] == trainer["bytes_by_op"], f"{case}, rank {rank}"
    # Data-parallel algorithms keep the replicas identical; gradient_allreduce matches one process on all batches.
    for case in ["gradient_allreduce", "gradient_allreduce_accumulate", "bytegrad", "qadam", "async_warmup"]:
        assert_ranks_identical([result[case]["fabric"] for result in results])
    # async's warm-up is gradient_allreduce, and the abort that ends the run averages replicas that are equal.
    torch.testing.assert_close(
        results[0]["async_warmup"]["fabric"]["state"], results[0]["gradient_allreduce"]["fabric"]["state"], **EXACT
    )
    torch.testing.assert_close(results[0]["gradient_allreduce"]["fabric"]["state"], reference_state(2), **TOLERANCE)
    accumulated = results[0]["gradient_allreduce_accumulate"]["fabric"]
    torch.testing.assert_close(accumulated["state"], reference_state(2, accumulate=3), **TOLERANCE)
    # Under no_backward_sync only the last of three backward passes per step communicates: four steps' worth.
    assert accumulated["bytes_by_op"] == results[0]["gradient_allreduce"]["fabric"]["bytes_by_op"]
    assert set(results[0]["bytegrad"]["fabric"]["bytes_by_op"]) == {"all_to_all", "all_gather"}
    assert set(results[0]["low_precision_decentralized"]["fabric"]["bytes_by_op"]) == {"send"}


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """One two-process run for the checkpoint and setup checks (each launch costs more than its checks)."""
    out = tmp_path_factory.mktemp("fabric-lifecycle")
    return out, run_script(out, "checkpoint,setup")


def test_checkpoint_round_trip_restores_weights_optimizer_and_algorithm_state(lifecycle):
    out, results = lifecycle
    for rank, result in enumerate(results):
        counting = result["counting"]
        # The test algorithm counts forward passes on each rank; each rank gets its own count back.
        expected = {"algorithm": "gradient_allreduce", "state": {"forwards": 2, "rank": rank}}
        assert counting["saved"]["algorithm"] == expected
        assert counting["loaded"]["algorithm"] == expected
        assert counting["final_algorithm_states"][0] == counting["final_algorithm_states"][1]
        assert counting["step"] == 2
        assert counting["remainder"] == []  # the algorithm state is consumed, not handed back
        for case in ["counting", "qadam"]:
            saved, loaded = result[case]["saved"], result[case]["loaded"]
            torch.testing.assert_close(loaded["model"], saved["model"], **EXACT)
            torch.testing.assert_close(loaded["optimizer"], saved["optimizer"], **EXACT)
        # Resumed from the checkpoint, training continues exactly as if it had never stopped.
        torch.testing.assert_close(counting["resumed"], counting["continued"], **EXACT, msg=f"rank {rank}")
        # qadam resumes in the phase it was saved in: the optimizer's step count says compressed, and the next steps
        # exchange 8-bit momenta only (two steps of 3201 fp32 values, a quarter of the bytes plus chunk headers).
        qadam = result["qadam"]
        assert qadam["saved"]["optimizer"]["state"][0]["step"] == 2
        assert set(qadam["resumed_bytes_by_op"]) == {"all_to_all", "all_gather"}

    on_disk = torch.load(out / "counting.ckpt", weights_only=False)
    assert set(on_disk) == {"model", "optimizer", "step", ALGORITHM_STATE_KEY}
    assert on_disk[ALGORITHM_STATE_KEY] == {
        "model": [
            {"algorithm": "gradient_allreduce", "state": {"forwards": 2, "rank": 0}},
            {"algorithm": "gradient_allreduce", "state": {"forwards": 2, "rank": 1}},
        ]
    }


def test_setup_apart_in_either_order_qadam_check_reduce_and_teardown(lifecycle):
    _, results = lifecycle
    for rank, result in enumerate(results):
        # low_precision_decentralized acts after each optimizer step, so it only matches if the optimizer is bound.
        assert result["module_first_bound"]
        assert result["optimizer_first_bound"]
        torch.testing.assert_close(result["module_first"], result["together"], **EXACT, msg=f"rank {rank}")
        torch.testing.assert_close(result["optimizer_first"], result["together"], **EXACT, msg=f"rank {rank}")
        assert result["after_teardown"] == {"modules": 0, "closed": [True, True, True]}
        for way in ["together", "apart"]:
            assert result["qadam_errors"][way].startswith(
                "Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler, got optimizers ['SGD']"
            ), way
        assert result["all_reduce"] == {
            "None": 1.5, "mean": 1.5, "avg": 1.5, "sum": 3.0, "max": 2.0, "min": 1.0, "product": 2.0,
        }  # fmt: skip
        assert result["all_reduce_in_place"] == 3.0
        assert result["all_reduce_int_mean"] == [2.5]
        assert result["broadcast"] == {"from": 1}
