"""Bucket autotuning: every rank chooses the same setting from injected timings, and training stays exact."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, BucketAutotuner, NodeLayout
from lightning_bagua.engine.algorithms.async_model_average import AsyncModelAverageImpl
from lightning_bagua.engine.algorithms.auto import AutoImpl
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceImpl
from lightning_bagua.engine.algorithms.low_rank.algorithm import LowRankImpl
from lightning_bagua.engine.autotune import AutotuneSetting, autotune_from_environment
from lightning_bagua.launch import build_parser, child_environment, main
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.test_data_parallel import TOLERANCE, batch_for, make_model, make_optimizer

START_MB = 0.004
SIZES_MB = (0.0001, 0.016)  # with START_MB: 2, 5 and 1 buckets on the small model, in this order of trials
# Per rank, the step time each candidate "takes": alone, rank 0 would choose 0.0001 and rank 1 0.004. The slowest
# rank decides, so both must choose the maximum's minimum: 0.016 (max times 3, 5, 2.5).
FAKE_STEP_TIMES = {0: [3.0, 1.0, 2.5], 1: [1.0, 5.0, 2.0]}
TRAIN_STEPS = 8  # 3 candidates x (1 warm-up + 1 timed) steps, then 2 steps with the choice


def fake_timer(step_times: list[float]):
    """A clock read twice per candidate (start and end of its one timed step) that advances by the given times."""
    readings = [0.0]
    for seconds in step_times:
        readings += [readings[-1] + 1.0, readings[-1] + 1.0 + seconds]
    values = iter(readings[1:])
    return lambda: next(values)


def train_autotuned(rank: int, world_size: int, algorithm: str, kwargs: dict) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], Algorithm.init(algorithm, **kwargs), bucket_cap_mb=START_MB, telemetry=True
    )
    tuner = BucketAutotuner(
        bucket_sizes_mb=SIZES_MB, warmup_steps=1, measured_steps=1, timer=fake_timer(FAKE_STEP_TIMES[rank])
    )
    sizes_used, buckets_per_step = [], []
    for step in range(TRAIN_STEPS):
        ddp = tuner.step(ddp)
        sizes_used.append(ddp.bucket_cap_mb)
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        buckets_per_step.append(ddp.telemetry.end_step()["collective_calls"])
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "decision": tuner.decision,
        "measurements": tuner.measurements,
        "sizes_used": sizes_used,
        "buckets_per_step": buckets_per_step,
        "final_bucket_cap_mb": ddp.bucket_cap_mb,
        "all_reduce_bytes": ddp.communication_counter.bytes_by_op.get("all_reduce", 0),
    }
    ddp.close()
    return result


def train_reference(world_size: int, steps: int) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(steps):
        batches = [batch_for(rank, step) for rank in range(world_size)]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
    return model.state_dict()


def test_all_ranks_choose_the_same_setting_and_training_stays_exact():
    results = run_processes(train_autotuned, 2, "gradient_allreduce", {})
    expected = AutotuneSetting(0.016, False)
    for result in results:
        assert result["decision"] == expected
        assert result["measurements"] == [
            (AutotuneSetting(START_MB, False), 3.0),
            (AutotuneSetting(0.0001, False), 5.0),
            (AutotuneSetting(0.016, False), 2.5),
        ]
        # The model's own size first, then the others; the choice from the 7th step on.
        assert result["sizes_used"] == [START_MB, START_MB, 0.0001, 0.0001, 0.016, 0.016, 0.016, 0.016]
        assert result["final_bucket_cap_mb"] == 0.016
        # Smaller buckets mean more all-reduces per step: the rebuilt reducers really used the sizes (from each
        # wrapper's second step on; torch lays buckets out by its own rule in the first).
        assert result["buckets_per_step"][3] > result["buckets_per_step"][1] > result["buckets_per_step"][5]
        # The counter carried over the rebuilt wrappers: every step's gradients, once.
        assert result["all_reduce_bytes"] == TRAIN_STEPS * 4 * sum(p.numel() for p in make_model().parameters())
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], train_reference(2, TRAIN_STEPS), **TOLERANCE)


def test_algorithms_without_gradient_buckets_have_nothing_to_tune():
    model = SimpleNamespace(
        bagua_algorithm=Algorithm.init("decentralized"),
        bucket_cap_mb=10.0,
        communication_groups=SimpleNamespace(layout=NodeLayout(4, 2), rank=1),
    )
    tuner = BucketAutotuner()
    assert tuner.step(model) is model
    assert tuner.decision == AutotuneSetting(10.0, True)
    assert tuner.step(model) is model


def plan_for(
    algorithm: Algorithm, layout: NodeLayout, bucket_cap_mb: float = 10.0, impl_type: type = GradientAllReduceImpl
) -> list[AutotuneSetting]:
    model = SimpleNamespace(
        bagua_algorithm=algorithm,
        bagua_algorithm_impl=object.__new__(impl_type),  # only its type is read
        bucket_cap_mb=bucket_cap_mb,
        communication_groups=SimpleNamespace(layout=layout),
    )
    return BucketAutotuner(bucket_sizes_mb=(4, 10, 25))._make_plan(model)


@pytest.mark.parametrize(
    ("name", "impl_type"),
    [("low_rank", LowRankImpl), ("async", AsyncModelAverageImpl), ("auto", AutoImpl)],
)
def test_algorithms_that_keep_state_are_not_rebuilt(name, impl_type):
    # A rebuild binds the algorithm anew: low_rank's error feedback, async's thread or auto's trials would restart.
    algorithm = Algorithm.init(name)
    own = AutotuneSetting(10.0, bool(algorithm.hierarchical))
    assert plan_for(algorithm, NodeLayout(4, 2), impl_type=impl_type) == [own]


def train_low_rank_with_tuner(rank: int, world_size: int) -> dict:
    model = make_model()
    optimizer = make_optimizer(model)
    ddp = BaguaDistributedDataParallel(model, [optimizer], Algorithm.init("low_rank", rank=1, warmup_steps=2))
    tuner = BucketAutotuner(bucket_sizes_mb=SIZES_MB, warmup_steps=1, measured_steps=1)
    wrappers = set()
    for step in range(5):
        ddp = tuner.step(ddp)
        wrappers.add(id(ddp))
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
    result = {"wrappers": len(wrappers), "steps": ddp.bagua_state_dict()["state"]["steps"]}
    ddp.close()
    return result


def test_low_rank_keeps_its_step_count_under_the_tuner():
    for result in run_processes(train_low_rank_with_tuner, 2):
        assert result == {"wrappers": 1, "steps": 5}


def test_hierarchical_is_tried_only_on_several_nodes_of_several_ranks():
    flat = Algorithm.init("gradient_allreduce")
    assert plan_for(flat, NodeLayout(4, 4)) == [
        AutotuneSetting(10.0, False),
        AutotuneSetting(4.0, False),
        AutotuneSetting(25.0, False),
    ]
    assert len(plan_for(flat, NodeLayout(4, 1))) == 3  # one rank per node: hierarchical changes nothing
    two_nodes = plan_for(Algorithm.init("bytegrad"), NodeLayout(4, 2), bucket_cap_mb=8.0)
    assert two_nodes[0] == AutotuneSetting(8.0, True)  # the model's own setting first
    assert set(two_nodes[1:]) == {AutotuneSetting(size, h) for size in (4.0, 10.0, 25.0) for h in (True, False)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_sizes_mb": ()}, "`bucket_sizes_mb` must be positive numbers of MiB, got ()"),
        ({"bucket_sizes_mb": (4, -1)}, r"got \(4, -1\)"),
        ({"warmup_steps": -1}, "`warmup_steps` must be an int of at least 0, got -1"),
        ({"measured_steps": 0}, "`measured_steps` must be an int of at least 1, got 0"),
    ],
)
def test_bad_tuner_settings_fail_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BucketAutotuner(**kwargs)


def test_environment_and_launcher_flag(monkeypatch):
    monkeypatch.delenv("BAGUA_AUTOTUNE", raising=False)
    assert autotune_from_environment() is False
    monkeypatch.setenv("BAGUA_AUTOTUNE", "1")
    assert autotune_from_environment() is True
    monkeypatch.setenv("BAGUA_AUTOTUNE", "2")
    with pytest.raises(ValueError, match=r"BAGUA_AUTOTUNE='2' is not a valid autotune level: use 0 \(off\) or 1"):
        autotune_from_environment()
    args = build_parser().parse_args(["--autotune_level", "1", "train.py"])
    assert child_environment(args, environ={})["BAGUA_AUTOTUNE"] == "1"
    args = build_parser().parse_args(["train.py"])
    assert "BAGUA_AUTOTUNE" not in child_environment(args, environ={})
    with pytest.raises(SystemExit, match=r"--autotune_level must be 0 .* got 3"):
        main(["--autotune_level", "3", "train.py"])
