"""The Fabric BaguaStrategy: construction in-process; training, checkpoints and setup on two real Gloo processes."""

import csv
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_bagua import QAdamOptimizer
from lightning_bagua.engine import GradientAllReduceAlgorithm
from lightning_bagua.engine.autotune import DEFAULT_BUCKET_SIZES_MB
from lightning_bagua.strategies.fabric import BaguaStrategy
from tests.distributed import assert_ranks_identical, free_port, run_job
from tests.engine.test_telemetry import scatter_gather_step
from tests.strategies.scripts.fit_script import make_network
from tests.strategies.test_bagua import param_bytes, reference_state
from tests.strategies.test_telemetry_autotune import TELEMETRY_COLUMNS

SCRIPT = Path(__file__).parent / "scripts" / "fabric_script.py"
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
        ({"bucket_cap_mb": float("nan")}, ValueError, r"`bucket_cap_mb` must be a positive number of MiB, got nan"),
        ({"timeout": timedelta(0)}, ValueError, r"`timeout` must be positive"),
        ({"process_group_backend": "mpi2"}, ValueError, r"`process_group_backend` must be one of .* Got 'mpi2'"),
        ({"find_unused_parameters": 1}, TypeError, r"`find_unused_parameters` must be a bool, got 1"),
        ({"telemetry": 1}, TypeError, r"`telemetry` must be a bool, got 1 \(int\). Pass True to measure"),
        ({"autotune": "yes"}, TypeError, r"`autotune` must be a bool or None, got 'yes' \(str\). Pass True to tune"),
    ],
)
def test_bad_input_fails_at_construction_naming_the_choices(kwargs, error, message):
    with pytest.raises(error, match=message):
        BaguaStrategy(**kwargs)


def test_telemetry_and_autotune_flags_follow_the_trainer_strategy(monkeypatch):
    from lightning_bagua.lightning_fabric import BaguaStrategy as Twin

    monkeypatch.setenv("BAGUA_AUTOTUNE", "1")
    assert BaguaStrategy()._autotune is True
    assert Twin()._autotune is True
    assert BaguaStrategy(autotune=False)._autotune is False  # an explicit value wins
    monkeypatch.delenv("BAGUA_AUTOTUNE")
    assert BaguaStrategy()._autotune is False
    assert BaguaStrategy(autotune=True)._autotune is True
    strategy = BaguaStrategy(telemetry=True)
    assert strategy._telemetry is True
    # Nothing is set up yet: no telemetry, no record, no tuner.
    assert (strategy.telemetry, strategy.telemetry_metrics, strategy.autotuner) == (None, {}, None)
    monkeypatch.setenv("BAGUA_AUTOTUNE", "fast")
    with pytest.raises(ValueError, match=r"BAGUA_AUTOTUNE='fast' is not a valid autotune level: use 0 \(off\) or 1"):
        BaguaStrategy()


def test_bagua_environment_is_chosen_when_bagua_service_port_is_set(monkeypatch):
    from lightning_bagua import BaguaEnvironment

    monkeypatch.setenv("BAGUA_SERVICE_PORT", "29501")
    assert isinstance(BaguaStrategy().cluster_environment, BaguaEnvironment)
    monkeypatch.delenv("BAGUA_SERVICE_PORT")
    assert BaguaStrategy().cluster_environment is None


def test_all_reduce_refuses_unknown_ops_and_passes_non_tensors():
    strategy = BaguaStrategy()
    assert strategy.all_reduce("not a tensor") == "not a tensor"
    with pytest.raises(ValueError, match=r"all_reduce: unsupported `reduce_op` 'median'. .* 'mean' \(or 'avg'"):
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
    completed = run_job(command, timeout=240, env={"MASTER_PORT": str(free_port())})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    # The script's first Fabric asked for the strategy by name.
    assert {result["strategy_class"] for result in results} == {"lightning_bagua.strategies.fabric.BaguaStrategy"}
    return results


def test_fabric_trains_exactly_as_the_trainer_strategy_for_each_algorithm(tmp_path):
    """Same start, same batches per rank, same algorithm: the Fabric loop and the Trainer reach the same weights.

    The cases are the seven algorithms (decentralized with both peer selections, async within its warm-up, where it
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
            "low_rank",
            "qadam",
            "async_warmup",
            "auto",
            "diloco",
        ]
    )
    for rank, result in enumerate(results):
        for case in cases:
            trainer, fabric = result[case]["trainer"], result[case]["fabric"]
            assert fabric["wrapped"] == "BaguaDistributedDataParallel"
            torch.testing.assert_close(fabric["state"], trainer["state"], **EXACT, msg=f"{case}, rank {rank}")
            assert fabric["bytes_by_op"] == trainer["bytes_by_op"], f"{case}, rank {rank}"
    # Data-parallel algorithms keep the replicas identical; gradient_allreduce matches one process on all batches.
    for case in [
        "gradient_allreduce",
        "gradient_allreduce_accumulate",
        "bytegrad",
        "low_rank",
        "qadam",
        "async_warmup",
    ]:
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
    # auto's pick (from given figures) is readable on both strategies after the run, the same on every rank.
    for result in results:
        for loop in ("trainer", "fabric"):
            assert result["auto"][loop]["auto_pick"] == "low_rank(rank=16, hierarchical=False)"
        # The Trainer knows the run's length and bounds auto's measuring by it.
        assert result["auto"]["trainer"]["auto_run_steps"] == 4
    assert_ranks_identical([result["auto"]["fabric"] for result in results])
    # diloco (with accumulation): only the outer exchanges communicate, and the replicas differ between them.
    assert set(results[0]["diloco"]["fabric"]["bytes_by_op"]) == {"all_gather"}


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
        for when in ["saved", "loaded"]:
            assert {k: v for k, v in counting[when]["algorithm"].items() if k != "bucket_layout"} == expected
        assert counting["loaded"]["algorithm"]["bucket_layout"] == counting["saved"]["algorithm"]["bucket_layout"]
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
        # The resumed wrapper replays the saved gradient buckets on its first step, so 8-bit rounding matches too.
        torch.testing.assert_close(qadam["resumed"], qadam["continued"], **EXACT, msg=f"qadam, rank {rank}")

    on_disk = torch.load(out / "counting.ckpt", weights_only=False)
    assert set(on_disk) == {"model", "optimizer", "step", "bagua_algorithm_state"}
    # The Trainer strategy's versioned format under the reserved key the Fabric docs name; gradient_allreduce's ranks
    # hold equal weights, so none per rank.
    assert on_disk["bagua_algorithm_state"]["version"] == 2
    assert on_disk["bagua_algorithm_state"]["world_size"] == 2
    entry = on_disk["bagua_algorithm_state"]["modules"]["model"]
    assert entry["algorithm"] == "gradient_allreduce"
    assert entry["ranks"] is None
    assert entry["averaged"] is False
    saved_states = entry["algorithm_states"]
    assert [{k: v for k, v in state.items() if k != "bucket_layout"} for state in saved_states] == [
        {"algorithm": "gradient_allreduce", "state": {"forwards": 2, "rank": 0}},
        {"algorithm": "gradient_allreduce", "state": {"forwards": 2, "rank": 1}},
    ]
    # Each process also saves the gradient buckets of its last step, which a resumed wrapper replays.
    layouts = [state["bucket_layout"] for state in saved_states]
    assert layouts[0] == layouts[1]
    assert layouts[0]
    assert all(isinstance(name, str) for bucket in layouts[0] for name in bucket)


def test_setup_apart_in_either_order_qadam_check_reduce_and_teardown(lifecycle):
    _, results = lifecycle
    for rank, result in enumerate(results):
        # low_precision_decentralized acts after each optimizer step, so it only matches if the optimizer is bound.
        assert result["module_first_bound"]
        assert result["optimizer_first_bound"]
        torch.testing.assert_close(result["module_first"], result["together"], **EXACT, msg=f"rank {rank}")
        torch.testing.assert_close(result["optimizer_first"], result["together"], **EXACT, msg=f"rank {rank}")
        for way in ["two_together", "two_apart"]:
            # Two SGD optimizers over disjoint halves step as one over all the parameters.
            assert result[f"{way}_bound"] == 2, way
            torch.testing.assert_close(result[way], result["together"], **EXACT, msg=f"{way}, rank {rank}")
        assert "none updates 2.weight, 2.bias, 4.weight, 4.bias" in result["one_of_two_error"]
        assert result["after_teardown"] == {"modules": 0, "closed": [True] * 6}
        for way in ["together", "apart"]:
            assert result["qadam_errors"][way].startswith(
                "Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler, got optimizers ['SGD']"
            ), way
        assert result["all_reduce"] == {
            "None": 1.5, "mean": 1.5, "avg": 1.5, "sum": 3.0, "max": 2.0, "min": 1.0, "product": 2.0,
        }  # fmt: skip
        assert result["all_reduce_in_place"] == 3.0
        # An integer tensor's mean stays an integer tensor, rounded toward zero, as with Fabric's DDPStrategy.
        assert result["all_reduce_int_mean"] == [2]
        assert result["broadcast"] == {"from": 1}


@pytest.fixture(scope="module")
def telemetry_runs(tmp_path_factory):
    """One two-process run: telemetry on (two algorithms) and off, then autotuned and untuned runs."""
    out = tmp_path_factory.mktemp("fabric-telemetry")
    return out, run_script(out, "telemetry")


def theory(algorithm: str) -> dict[str, float]:
    # The network fits one bucket (under DDP's 1 MiB first bucket too), so every step reduces one of all parameters.
    assert param_bytes() < 2**20
    if algorithm == "gradient_allreduce":
        return {"bytes_sent": param_bytes(), "bytes_received": param_bytes(), "bytes_uncompressed": param_bytes()}
    expected = scatter_gather_step([param_bytes() // 4], n=2)
    return {key: expected[key] for key in ("bytes_sent", "bytes_received", "bytes_uncompressed")}


def test_telemetry_counts_the_theoretical_bytes_each_step_and_logs_through_fabric(telemetry_runs):
    out, results = telemetry_runs
    for rank, result in enumerate(results):
        for algorithm, run in result["telemetry"].items():
            expected = theory(algorithm)
            assert len(run["records"]) == 4
            for step, (record, metrics) in enumerate(zip(run["records"], run["metrics"], strict=True)):
                assert record["step"] == step, (algorithm, rank)
                for key, value in expected.items():
                    assert record[key] == value, (algorithm, rank, step, key)
                assert record["compression_ratio"] == pytest.approx(
                    expected["bytes_uncompressed"] / expected["bytes_sent"]
                )
                assert record["communication_wait_s"] >= 0.0
                # The Trainer strategy's metric names, the step index left to the logger.
                assert metrics == {f"bagua/{key}": value for key, value in record.items() if key != "step"}
                assert set(metrics) == set(TELEMETRY_COLUMNS)
            assert run["clock_reads"] > 0
        assert result["telemetry"]["bytegrad"]["records"][-1]["compression_ratio"] > 3.0
    # `fabric.log_dict(strategy.telemetry_metrics, step=step)` reached the Fabric's CSVLogger (rank zero writes).
    with open(out / "csv" / "gradient_allreduce" / "version_0" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3]
    assert all(int(float(row["bagua/bytes_sent"])) == param_bytes() for row in rows)


def test_nothing_is_measured_when_telemetry_is_off(telemetry_runs):
    _, results = telemetry_runs
    for result in results:
        off, on = result["telemetry_off"], result["telemetry"]["bytegrad"]
        assert off["telemetry_is_none"]
        assert off["records"] == [None] * 4
        assert off["metrics"] == [{}] * 4
        assert off["clock_reads"] == 0
        assert off["bytes_by_op"] == on["bytes_by_op"]  # the communication itself is the same


def test_autotune_under_fabric_agrees_on_every_rank_and_trains_as_untuned(telemetry_runs):
    _, results = telemetry_runs
    tuned = [result["autotuned"] for result in results]
    steps = len(DEFAULT_BUCKET_SIZES_MB) * 4 + 2
    decision = tuned[0]["decision"]
    assert decision is not None
    assert decision.bucket_cap_mb in DEFAULT_BUCKET_SIZES_MB
    assert [run["decision"] for run in tuned] == [decision, decision]
    assert tuned[0]["measurements"] == tuned[1]["measurements"]
    assert [setting.bucket_cap_mb for setting, _ in tuned[0]["measurements"]] == [10.0, 1.0, 4.0, 25.0, 64.0]
    assert tuned[0]["steps_needed"] == steps - 2
    for run, result in zip(tuned, results, strict=True):
        # Every candidate got its own wrapper, and the module Fabric returned calls the chosen one.
        assert run["wrappers"] >= len(DEFAULT_BUCKET_SIZES_MB)
        assert run["calls_current_wrapper"]
        assert run["bucket_cap_mb"] == decision.bucket_cap_mb
        assert run["stopped_noting_holders"]
        # Telemetry carried on across the rebuilt wrappers: one full gradient per step.
        assert [record["bytes_sent"] for record in run["records"]] == [param_bytes()] * steps
        assert [record["step"] for record in run["records"]] == list(range(steps))
        assert run["bytes_by_op"] == result["untuned"]["bytes_by_op"] == {"all_reduce": steps * param_bytes()}
        torch.testing.assert_close(run["state"], result["untuned"]["state"], **TOLERANCE)
        assert result["untuned"]["decision"] is None
        assert result["untuned"]["wrappers"] == 1
    assert_ranks_identical(tuned)
    for result in results:
        compiled = result["autotuned_compiled"]
        # torch.compile bound its forward to the first wrapper: after each rebuild it must call the new one.
        assert compiled["calls_current_wrapper"]
        assert compiled["wrappers"] >= len(DEFAULT_BUCKET_SIZES_MB)
        assert [record["step"] for record in compiled["records"]] == list(range(steps))
        torch.testing.assert_close(compiled["state"], result["untuned"]["state"], **TOLERANCE)
    # The choice is logged once, by rank zero.
    assert [len(run["log"]) for run in tuned] == [1, 0]
    assert tuned[0]["log"][0].startswith(f"Bagua autotune chose {decision.describe()}")
