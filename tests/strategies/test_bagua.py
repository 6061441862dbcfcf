"""BaguaStrategy: construction errors in-process; fitting on real processes started the ways users start them."""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_bagua import BaguaStrategy
from lightning_bagua.engine import GradientAllReduceAlgorithm
from tests.distributed import assert_ranks_identical, free_port, run_job
from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

SCRIPT = Path(__file__).parent / "scripts" / "fit_script.py"
ROOT = Path(__file__).parents[2]
MAX_STEPS = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


# ----------------------------------------------------------------------------------------------- construction


def test_defaults_and_read_only_properties():
    strategy = BaguaStrategy()
    assert strategy.strategy_name == "bagua"
    assert strategy.algorithm == GradientAllReduceAlgorithm(hierarchical=False, average=True)
    assert strategy.flatten is True
    assert strategy.bagua_kwargs == {}
    assert strategy.communication_counter is None
    with pytest.raises(AttributeError):
        strategy.flatten = False


def test_bagua_kwargs_reach_the_algorithm():
    strategy = BaguaStrategy(algorithm="gradient_allreduce", hierarchical=True, average=False)
    assert strategy.algorithm == GradientAllReduceAlgorithm(hierarchical=True, average=False)
    assert strategy.bagua_kwargs == {"hierarchical": True, "average": False}


def test_algorithm_instance_is_accepted():
    algorithm = GradientAllReduceAlgorithm(hierarchical=True)
    assert BaguaStrategy(algorithm=algorithm).algorithm is algorithm
    with pytest.raises(TypeError, match="Pass them to the algorithm's constructor"):
        BaguaStrategy(algorithm=algorithm, average=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"algorithm": "allreduce"},
            ValueError,
            r"Unknown algorithm 'allreduce'. Available algorithms: .*gradient_allreduce",
        ),
        ({"algorithm": 3}, TypeError, r"got 3 \(int\). Available names: .*gradient_allreduce"),
        ({"hierarchicl": True}, TypeError, r"Unknown keyword argument\(s\) 'hierarchicl'.*hierarchical=False, avera"),
        ({"hierarchical": "yes"}, TypeError, r"`hierarchical` must be a bool, got 'yes' \(str\)"),
        ({"average": 1}, TypeError, r"`average` must be a bool, got 1 \(int\)"),
        ({"flatten": "true"}, TypeError, r"`flatten` must be a bool, got 'true' \(str\)"),
        ({"bucket_cap_mb": 0}, ValueError, r"`bucket_cap_mb` must be a positive number of MiB, got 0"),
        ({"bucket_cap_mb": float("nan")}, ValueError, r"`bucket_cap_mb` must be a positive number of MiB, got nan"),
        ({"bucket_cap_mb": float("inf")}, ValueError, r"`bucket_cap_mb` must be a positive number of MiB, got inf"),
        ({"timeout": timedelta(0)}, ValueError, r"`timeout` must be positive.*got datetime.timedelta\(0\)"),
        ({"timeout": timedelta(seconds=-5)}, ValueError, r"`timeout` must be positive"),
        ({"process_group_backend": "mpi2"}, ValueError, r"one of 'gloo', 'nccl'.*'cpu:gloo,cuda:nccl'.* Got 'mpi2'"),
        ({"process_group_backend": "cpu:gloo,cuda:nccl2"}, ValueError, r"Got 'cpu:gloo,cuda:nccl2'"),
        ({"process_group_backend": 3}, TypeError, r"Got 3 \(int\)"),
        ({"find_unused_parameters": "yes"}, TypeError, r"`find_unused_parameters` must be a bool, got 'yes'"),
    ],
)
def test_bad_input_fails_at_construction_naming_the_choices(kwargs, error, message):
    with pytest.raises(error, match=message):
        BaguaStrategy(**kwargs)


@pytest.mark.parametrize("backend", ["gloo", "NCCL", "cpu:gloo,cuda:nccl"])
def test_process_group_backends_torch_knows_are_accepted(backend):
    assert BaguaStrategy(process_group_backend=backend)._process_group_backend == backend


def test_bagua_environment_is_chosen_when_bagua_service_port_is_set(monkeypatch):
    from lightning_bagua import BaguaEnvironment

    monkeypatch.setenv("BAGUA_SERVICE_PORT", "29501")
    assert isinstance(BaguaStrategy().cluster_environment, BaguaEnvironment)
    monkeypatch.delenv("BAGUA_SERVICE_PORT")
    assert BaguaStrategy().cluster_environment is None


def test_reduce_refuses_unknown_ops_naming_the_choices_and_passes_non_tensors():
    strategy = BaguaStrategy()
    assert strategy.reduce("not a tensor") == "not a tensor"
    # Without a process group the tensor comes back as it is, whatever the op, as with Lightning's DDP.
    value = torch.tensor([3])
    assert strategy.reduce(value, reduce_op="SUM") is value
    with pytest.raises(ValueError, match=r"unsupported `reduce_op` 'median'. .* 'mean' \(or 'avg', None\), 'sum'"):
        strategy.reduce(torch.ones(1), reduce_op="median")
    with pytest.raises(ValueError, match=r"unsupported `reduce_op` \['sum'\] \(list\)"):
        strategy.reduce(torch.ones(1), reduce_op=["sum"])


def test_register_strategies_registers_bagua_once():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    registry = _StrategyRegistry()
    BaguaStrategy.register_strategies(registry)
    BaguaStrategy.register_strategies(registry)  # a second call must not raise
    assert isinstance(registry.get("bagua"), BaguaStrategy)


# --------------------------------------------------------------------------------------------- real processes


def python_path() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def run_script(out: Path, *args: str, env: dict[str, str] | None = None, launcher: list[str] | None = None) -> None:
    command = [*(launcher or [sys.executable]), str(SCRIPT), "--out", str(out), "--max-steps", str(MAX_STEPS), *args]
    completed = run_job(command, timeout=240, env={"MASTER_PORT": str(free_port()), **(env or {})})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]


def load_ranks(out: Path, world_size: int) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def union_batches(world_size: int, batch_size: int = BATCH) -> DataLoader:
    """What all ranks see together in each step, as one batch.

    Lightning gives training loaders a shuffling DistributedSampler (seed 0): it permutes the indices, then rank
    r takes every n-th from r on. So the samples of step s over all ranks are the slice [s*B*n, (s+1)*B*n) of
    the permutation, and the mean loss over that slice is the mean of the ranks' mean losses.
    """
    permutation = torch.randperm(len(make_dataset()), generator=torch.Generator().manual_seed(0)).tolist()
    return DataLoader(Subset(make_dataset(), permutation), batch_size=batch_size * world_size, shuffle=False)


def reference_state(world_size: int, accumulate: int = 1) -> dict:
    """Train one process on the union of what all ranks see in each step."""
    model = make_network()
    optimizer = make_optimizer(model.parameters())
    batches = iter(union_batches(world_size))
    for _ in range(MAX_STEPS):
        optimizer.zero_grad()
        for _ in range(accumulate):
            inputs, targets = next(batches)
            (nn.functional.mse_loss(model(inputs), targets) / accumulate).backward()
        optimizer.step()
    return {f"net.{k}": v for k, v in model.state_dict().items()}


def param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in make_network().parameters())


def test_fit_on_two_processes_started_by_lightning(tmp_path):
    run_script(tmp_path, "--devices", "2")
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2), **TOLERANCE)
    for rank, result in enumerate(results):
        assert result["strategy_class"] == "lightning_bagua.strategies.bagua.BaguaStrategy"
        assert result["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}
        # Wrapped while fitting, plain for validation and after teardown.
        assert result["seen"]["fit_model"] == "BaguaDistributedDataParallel"
        assert result["seen_after_validate"]["validate_model"] == "Regression"
        assert result["model_after_fit"] == "Regression"
        assert result["reduce"] == {
            "None": 1.5, "mean": 1.5, "avg": 1.5, "sum": 3.0, "max": 2.0, "min": 1.0, "product": 2.0,
        }  # fmt: skip
        assert result["reduce_in_place"] == 3.0
        assert result["reduce_unchanged_non_tensor"]
        assert result["broadcast"] == {"from": 1}, f"rank {rank}"


def test_gradient_accumulation_communicates_only_on_optimizer_steps(tmp_path):
    run_script(tmp_path, "--devices", "2", "--accumulate", "3")
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2, accumulate=3), **TOLERANCE)
    assert results[0]["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}


def test_manual_optimization(tmp_path):
    run_script(tmp_path, "--devices", "2", "--manual")
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2), **TOLERANCE)
    assert results[0]["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}


def test_without_flatten_and_summing(tmp_path):
    run_script(tmp_path, "--devices", "2", "--flatten", "false", "--kwargs", '{"average": false}')
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    # A sum of the two ranks' gradients is twice their mean: stock DDP could not produce this.
    model = make_network()
    optimizer = make_optimizer(model.parameters())
    for inputs, targets in list(union_batches(2))[:MAX_STEPS]:
        optimizer.zero_grad()
        (2 * nn.functional.mse_loss(model(inputs), targets)).backward()
        optimizer.step()
    expected = {f"net.{k}": v for k, v in model.state_dict().items()}
    torch.testing.assert_close(results[0]["state"], expected, **TOLERANCE)


def test_hierarchical_on_two_nodes_of_two_processes(tmp_path):
    """Two "nodes" on this machine, each started by Lightning's launcher with NODE_RANK, as on a real cluster."""
    port = str(free_port())
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    common = ["--devices", "2", "--num-nodes", "2", "--kwargs", '{"hierarchical": true}']
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--max-steps", str(MAX_STEPS), *common]
    nodes = [
        subprocess.Popen(
            command,
            env={**os.environ, "PYTHONPATH": python_path(), **env, "NODE_RANK": str(node)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(output[-4000:] for output in outputs)
    results = load_ranks(tmp_path, 4)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(4), **TOLERANCE)
    total = MAX_STEPS * param_bytes()
    for rank, result in enumerate(results):
        assert result["world_size"] == 4
        expected = {"reduce": total, "broadcast": total, **({"all_reduce": total} if rank % 2 == 0 else {})}
        assert result["bytes_by_op"] == expected, f"rank {rank}"


@pytest.mark.parametrize("bagua_service_port", [None, "29501"])
def test_fit_under_torchrun(tmp_path, bagua_service_port):
    env = {"BAGUA_SERVICE_PORT": bagua_service_port} if bagua_service_port else {}
    port = str(free_port())
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    run_script(tmp_path, "--devices", "2", env=env, launcher=launcher)
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2), **TOLERANCE)
    expected = "BaguaEnvironment" if bagua_service_port else "TorchElasticEnvironment"
    assert results[0]["cluster_environment"] == expected


def test_bf16_mixed_on_cpu(tmp_path):
    run_script(tmp_path, "--devices", "2", "--precision", "bf16-mixed")
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    # Parameters and their gradients stay fp32 under autocast, so the buckets are too.
    assert results[0]["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}
    # bf16 activations move the result away from the fp32 reference, but not far.
    torch.testing.assert_close(results[0]["state"], reference_state(2), rtol=0.05, atol=0.02)


def test_pytorch_lightning_trainer_by_name(tmp_path):
    run_script(tmp_path, "--devices", "2", "--package", "pytorch_lightning", "--strategy", "name")
    results = load_ranks(tmp_path, 2)
    assert results[0]["strategy_class"] == "lightning_bagua.pytorch_lightning.BaguaStrategy"
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2), **TOLERANCE)
    assert results[0]["bytes_by_op"] == {"all_reduce": MAX_STEPS * param_bytes()}


# Each algorithm through the Lightning strategy: which collectives it must use (and which never), and how close
# four steps land to full-precision data parallelism.
ALGORITHMS = {
    "bytegrad": ('{"hierarchical": false}', {"all_to_all", "all_gather"}, {"rtol": 0.05, "atol": 0.01}),
    # Decentralized replicas differ from data parallelism by design; their own simulations are further down.
    "decentralized": ('{"hierarchical": false}', {"all_reduce"}, None),
    "low_precision_decentralized": ('{"hierarchical": false}', {"send"}, None),
    # One full-precision step, then rank-2 factors with error feedback: near full precision after four steps.
    "low_rank": (
        '{"hierarchical": false, "warmup_steps": 1}',
        {"all_reduce", "all_gather"},
        {"rtol": 0.05, "atol": 0.02},
    ),
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_each_algorithm_fits_through_lightning(tmp_path, algorithm):
    kwargs, ops, tolerance = ALGORITHMS[algorithm]
    run_script(tmp_path, "--devices", "2", "--algorithm", algorithm, "--kwargs", kwargs)
    results = load_ranks(tmp_path, 2)
    assert set(results[0]["bytes_by_op"]) == ops
    assert results[0]["seen"]["fit_model"] == "BaguaDistributedDataParallel"
    if tolerance is not None:
        torch.testing.assert_close(results[0]["state"], reference_state(2), **tolerance)


def rank_batches(world_size: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches Lightning's shuffling DistributedSampler (seed 0) deals rank ``rank``."""
    permutation = torch.randperm(len(make_dataset()), generator=torch.Generator().manual_seed(0)).tolist()
    return list(DataLoader(Subset(make_dataset(), permutation[rank::world_size]), batch_size=BATCH))


def simulate_d_psgd(world_size: int) -> list[dict]:
    """D-PSGD with all-peer averaging: x_r <- mean_i(x_i) + SGD update from the gradient at the old x_r."""
    models = [make_network() for _ in range(world_size)]
    optimizers = [make_optimizer(model.parameters()) for model in models]
    batches = [rank_batches(world_size, rank) for rank in range(world_size)]
    for step in range(MAX_STEPS):
        with torch.no_grad():
            mean = [torch.stack(ps).mean(0) for ps in zip(*(m.parameters() for m in models), strict=True)]
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            inputs, targets = batches[rank][step]
            nn.functional.mse_loss(model(inputs), targets).backward()
            with torch.no_grad():
                for parameter, averaged in zip(model.parameters(), mean, strict=True):
                    parameter.copy_(averaged)
            optimizer.step()
    return [{f"net.{k}": v for k, v in model.state_dict().items()} for model in models]


def test_decentralized_through_lightning_follows_d_psgd(tmp_path):
    """Lightning steps optimizers through a closure: the mixing must still land after backward, before the step."""
    run_script(tmp_path, "--devices", "2", "--algorithm", "decentralized", "--kwargs", '{"hierarchical": false}')
    results = load_ranks(tmp_path, 2)
    for rank, expected in enumerate(simulate_d_psgd(2)):
        torch.testing.assert_close(results[rank]["state"], expected, **TOLERANCE, msg=f"rank {rank}")


def simulate_dcd_psgd(world_size: int) -> list[dict]:
    """DCD-PSGD on a ring (spec section 7): a local SGD step, then the compressed-difference ring round."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from lightning_bagua.engine import MinMaxUInt8Codec

    codec = MinMaxUInt8Codec()

    def round_trip(d: torch.Tensor) -> torch.Tensor:
        return codec.decompress(codec.compress(d, 1), d.numel(), d.dtype)

    models = [make_network() for _ in range(world_size)]
    optimizers = [make_optimizer(model.parameters()) for model in models]
    batches = [rank_batches(world_size, rank) for rank in range(world_size)]
    start = parameters_to_vector(models[0].parameters()).detach()
    w = [start.clone() for _ in models]
    left = [start.clone() for _ in models]
    right = [start.clone() for _ in models]
    for step in range(MAX_STEPS):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            inputs, targets = batches[rank][step]
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        with torch.no_grad():
            x = [parameters_to_vector(model.parameters()) for model in models]
            c = [round_trip(x[r] + left[r] / 3 + right[r] / 3 - 5 * w[r] / 3) for r in range(world_size)]
            for r in range(world_size):
                left[r] += c[(r - 1) % world_size]
                right[r] += c[(r + 1) % world_size]
                w[r] += c[r]
                # A copy: vector_to_parameters makes the parameters views of the vector it is given.
                vector_to_parameters(w[r].clone(), models[r].parameters())
    return [{f"net.{k}": v for k, v in model.state_dict().items()} for model in models]


def test_low_precision_decentralized_through_lightning_follows_dcd_psgd(tmp_path):
    kwargs = '{"hierarchical": false}'
    run_script(tmp_path, "--devices", "2", "--algorithm", "low_precision_decentralized", "--kwargs", kwargs)
    results = load_ranks(tmp_path, 2)
    for rank, expected in enumerate(simulate_dcd_psgd(2)):
        # The same codec on the same values gives the same codes; float32 sums in another order move a value
        # by an ulp, which can move a code by one level (range / 255) now and then.
        torch.testing.assert_close(results[rank]["state"], expected, rtol=1e-3, atol=2e-3, msg=f"rank {rank}")
    assert set(results[0]["bytes_by_op"]) == {"send"}


def test_qadam_through_lightning_warms_up_then_compresses(tmp_path):
    kwargs = '{"hierarchical": false}'
    run_script(tmp_path, "--devices", "2", "--algorithm", "qadam", "--kwargs", kwargs, "--optimizer", "qadam")
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    # warmup_steps=2: step 1 all-reduces full-precision gradients; from step 2 (the count reaching 2) on, the
    # momentum travels as 8-bit codes.
    assert set(results[0]["bytes_by_op"]) == {"all_reduce", "all_to_all", "all_gather"}
    assert results[0]["bytes_by_op"]["all_reduce"] == param_bytes()


def test_qadam_refuses_other_optimizers_with_lightnings_configuration_error(tmp_path):
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--devices", "2", "--algorithm", "qadam"]
    completed = run_job(command, timeout=240, env={"MASTER_PORT": str(free_port())})
    assert completed.returncode != 0
    assert "MisconfigurationException: Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler" in (
        completed.stderr
    )
