"""qadam: the optimizer against torch's Adam and a re-implementation of the spec, the algorithm on real Gloo processes
against an independent step-by-step simulation of the spec's math, checkpoints, and the configuration rules."""

import io
import math
import re

import pytest
import torch
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms import qadam
from lightning_bagua.engine.algorithms.base import AlgorithmContext, available_algorithms
from lightning_bagua.engine.algorithms.qadam import (
    QAdamAlgorithm,
    QAdamOptimizer,
    QAdamState,
    check_qadam_configuration,
)
from lightning_bagua.engine.communication import CommunicationCounter, OrderedExecutor
from tests.distributed import assert_ranks_identical, run_processes
from tests.engine.algorithms.test_bytegrad import expected_bytes, simulate_scatter_gather
from tests.engine.test_data_parallel import batch_for, make_model

HYPER = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.01}
WARMUP = 3
STEPS = 6  # steps 1 and 2 warm up; from step 3 (the step count reaching WARMUP) on the momentum is compressed

# ----------------------------------------------------------------------------------------------------- optimizer


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"lr": -0.1}, "-0.1"),
        ({"lr": float("nan")}, "nan"),
        ({"eps": -1e-8}, "-1e-08"),
        ({"warmup_steps": 0}, "0"),
        ({"warmup_steps": -3}, "-3"),
        ({"warmup_steps": 2.5}, "2.5"),
        ({"warmup_steps": True}, "True"),
        ({"betas": (1.0, 0.999)}, "1.0"),
        ({"betas": (0.9, -0.1)}, "-0.1"),
        ({"weight_decay": -1.0}, "-1.0"),
    ],
)
def test_optimizer_validation_names_the_value(kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown)):
        QAdamOptimizer(make_model().parameters(), **kwargs)


def test_optimizer_accepts_the_edges():
    QAdamOptimizer(make_model().parameters(), lr=0.0, eps=0.0, betas=(0.0, 0.0), warmup_steps=1)


def reference_step(x, grad, m, v, s, lr, betas, eps, weight_decay, warmup_steps):
    """§8 of the spec for one parameter and one step (one rank), in float64, written out independently."""
    b1, b2 = betas
    g = grad + weight_decay * x
    m = b1 * m + (1 - b1) * g  # in the compressed phase with one rank the communicated mean is the local value
    if s < warmup_steps:
        v = b2 * v + (1 - b2) * g * g
    x = x - lr / (1 - b1**s) * m / (v.sqrt() / math.sqrt(1 - b2**s) + eps)
    return x, m, v


def local_gradients(model, step):
    model.zero_grad()
    inputs, targets = batch_for(0, step)
    nn.functional.mse_loss(model(inputs), targets).backward()


def test_warmup_equals_torch_adam():
    model, twin = make_model(), make_model()
    ours = QAdamOptimizer(model.parameters(), warmup_steps=100, **HYPER)
    adam = torch.optim.Adam(twin.parameters(), amsgrad=False, **HYPER)
    for step in range(8):
        for module, optimizer in ((model, ours), (twin, adam)):
            local_gradients(module, step)
            optimizer.step()
        torch.testing.assert_close(model.state_dict(), twin.state_dict(), rtol=0, atol=1e-6)
    for param, other in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[param][key], adam.state[other][key], rtol=0, atol=1e-6)
        assert ours.state[param]["step"] == 8


def test_first_step_is_lr_times_sign_of_the_gradient():
    # At s = 1 the bias corrections cancel the (1 - b1) and sqrt(1 - b2) factors exactly:
    # m / (1 - b1) = g, sqrt(v / (1 - b2)) = |g|, so the update is lr * g / (|g| + eps).
    param = nn.Parameter(torch.tensor([0.5, -2.0, 3.0]))
    optimizer = QAdamOptimizer([param], lr=0.1, betas=(0.7, 0.9), eps=0.0, warmup_steps=5)
    param.grad = torch.tensor([0.003, -40.0, 1.0])
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.tensor([0.4, -1.9, 2.9]))


def test_single_process_across_the_switch_matches_the_reference():
    # One process, no algorithm: the optimizer updates m from .grad in the compressed phase (the mean of one rank).
    model = make_model()
    optimizer = QAdamOptimizer(model.parameters(), warmup_steps=WARMUP, **HYPER)
    expected = {}
    for name, param in model.named_parameters():
        zeros = torch.zeros_like(param, dtype=torch.float64)
        expected[name] = (param.detach().double(), zeros, zeros.clone())
    for step in range(STEPS):
        local_gradients(model, step)
        optimizer.step()
        for name, param in model.named_parameters():
            x, m, v = expected[name]
            expected[name] = reference_step(x, param.grad.double(), m, v, step + 1, warmup_steps=WARMUP, **HYPER)
            state = optimizer.state[param]
            for got, want in zip((param, state["exp_avg"], state["exp_avg_sq"]), expected[name], strict=True):
                torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-7)
            assert state["step"] == step + 1
            assert optimizer.is_compressed_step(param) == (step + 2 >= WARMUP)


def test_phase_follows_each_group_and_a_loaded_state():
    first, second = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    optimizer = QAdamOptimizer([first], warmup_steps=2)
    optimizer.add_param_group({"params": [second], "warmup_steps": 1})
    assert not optimizer.is_compressed_step(first)  # s = 1 < 2
    assert optimizer.is_compressed_step(second)  # s = 1 >= 1
    first.grad, second.grad = torch.ones(2), torch.ones(3)
    optimizer.step()
    assert optimizer.is_compressed_step(first)  # s = 2 reaches warmup_steps
    state = optimizer.state_dict()
    state["param_groups"][1]["warmup_steps"] = 9
    optimizer.load_state_dict(state)
    assert not optimizer.is_compressed_step(second)  # the loaded groups are read, not a stale copy
    with pytest.raises(ValueError, match="not optimised"):
        optimizer.is_compressed_step(nn.Parameter(torch.ones(1)))


def stepped_optimizer(params, groups=None):
    """A QAdamOptimizer past one step over ``params`` (so every parameter has its moments), and a bucket of them."""
    optimizer = QAdamOptimizer(groups or params, warmup_steps=1, **HYPER)
    generator = torch.Generator().manual_seed(0)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(memory_format=torch.preserve_format)
    optimizer.step()
    buffer = torch.randn(sum(param.numel() for param in params), generator=generator)
    gradients = [
        piece.view_as(param) for piece, param in zip(buffer.split([p.numel() for p in params]), params, strict=True)
    ]
    return optimizer, buffer, gradients


def test_bucket_momenta_read_the_flat_buffer_as_the_per_parameter_path_does():
    params = list(make_model().parameters())
    optimizer, buffer, gradients = stepped_optimizer(params)
    momenta = optimizer.bucket_momenta(0, params, buffer, lambda: gradients)
    assert momenta.reads_buffer
    before = [optimizer.state[param]["exp_avg"].clone() for param in params]
    got = momenta.local(buffer, None)
    torch.testing.assert_close(got, optimizer.local_momentum(params, gradients), rtol=1e-6, atol=1e-7)
    for param, momentum in zip(params, before, strict=True):  # m is written by store() only
        assert torch.equal(optimizer.state[param]["exp_avg"], momentum)
    averaged = got * 3
    momenta.store(averaged)
    offset = 0
    for param in params:
        torch.testing.assert_close(
            optimizer.state[param]["exp_avg"].view(-1), averaged[offset : offset + param.numel()]
        )
        offset += param.numel()
    assert optimizer._synchronized == {id(param) for param in params}
    assert optimizer.bucket_momenta(0, params, buffer, lambda: pytest.fail("built again")) is momenta  # kept


def test_bucket_momenta_read_the_weights_where_they_live_now():
    params = list(make_model().parameters())
    optimizer, buffer, gradients = stepped_optimizer(params)
    momenta = optimizer.bucket_momenta(0, params, buffer, lambda: gradients)
    for param in params:
        param.data = param.data * 2  # what moving a module does: the same parameters, new storage
    assert optimizer.bucket_momenta(0, params, buffer, lambda: gradients) is momenta
    want = optimizer.local_momentum(params, gradients)  # weight decay reads the new weights
    torch.testing.assert_close(momenta.local(buffer, None), want, rtol=1e-6, atol=1e-7)


def channels_last_bucket():
    conv, linear = nn.Conv2d(2, 3, 3), nn.Linear(4, 2)
    conv.to(memory_format=torch.channels_last)
    return [conv.weight, conv.bias, linear.weight], None


def two_groups_bucket():
    first, second = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4))
    return [first, second], [{"params": [first]}, {"params": [second], "betas": (0.5, 0.9)}]


@pytest.mark.parametrize("make", [channels_last_bucket, two_groups_bucket], ids=["channels_last", "two_groups"])
def test_bucket_momenta_fall_back_per_parameter_where_the_buffer_does_not_line_up(make):
    params, groups = make()
    optimizer, buffer, gradients = stepped_optimizer(params, groups)
    momenta = optimizer.bucket_momenta(0, params, buffer, lambda: gradients)
    assert not momenta.reads_buffer
    got = momenta.local(buffer, gradients)
    torch.testing.assert_close(got, optimizer.local_momentum(params, gradients), rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass the gradients"):
        momenta.local(buffer, None)
    momenta.store(got)
    offset = 0
    for param in params:
        want = got[offset : offset + param.numel()].view_as(param)
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], want, rtol=0, atol=0)
        offset += param.numel()


def test_bucket_momenta_follow_state_moved_or_loaded():
    params = list(make_model().parameters())
    optimizer, buffer, gradients = stepped_optimizer(params)
    first = optimizer.bucket_momenta(0, params, buffer, lambda: gradients)
    # Lightning moves an optimizer's state between devices by replacing each parameter's dict and tensors.
    for param in params:
        optimizer.state[param] = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[param].items()
        }
    moved = optimizer.bucket_momenta(0, params, buffer, lambda: gradients)
    assert moved is not first
    flat = moved.local(buffer, None)
    moved.store(flat + 1)
    assert torch.equal(optimizer.state[params[0]]["exp_avg"].view(-1), (flat + 1)[: params[0].numel()])
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer.bucket_momenta(0, params, buffer, lambda: gradients) is not moved
    assert optimizer.bucket_momenta(0, params[::-1], buffer, lambda: gradients[::-1]) is not moved  # a new layout


# ----------------------------------------------------------------------------------- algorithm: keywords, binding


def test_registered_and_keywords_are_checked():
    assert "qadam" in available_algorithms()
    model = make_model()
    optimizer = QAdamOptimizer(model.parameters())
    algorithm = Algorithm.init("qadam", q_adam_optimizer=optimizer, hierarchical=False)
    assert isinstance(algorithm, QAdamAlgorithm)
    assert algorithm.q_adam_optimizer is optimizer
    assert not algorithm.hierarchical
    assert Algorithm.init("qadam").hierarchical  # hierarchical by default; the optimizer may be bound later
    with pytest.raises(TypeError, match="q_adam_optimizer"):
        QAdamAlgorithm(q_adam_optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(TypeError, match="hierarchical"):
        QAdamAlgorithm(hierarchical="yes")
    with pytest.raises(TypeError, match="Unknown keyword"):
        Algorithm.init("qadam", warmup_steps=3)


def bound_impl(model, optimizer=None):
    context = AlgorithmContext(
        groups=None,  # binding never communicates
        counter=CommunicationCounter(),
        executor=OrderedExecutor(torch.device("cpu")),
        device=torch.device("cpu"),
        named_parameters=tuple(model.named_parameters()),
    )
    return QAdamAlgorithm(q_adam_optimizer=optimizer).reify(context)


def test_the_optimizer_is_bound_later_and_checked():
    model = make_model()
    impl = bound_impl(model)
    state, _ = impl.communication_hook()
    assert isinstance(state, QAdamState)
    with pytest.raises(RuntimeError, match="no QAdamOptimizer"):
        state.require_optimizer()
    impl.bind_optimizers([])  # nothing yet: still unbound
    with pytest.raises(ValueError, match="exactly one QAdamOptimizer"):
        impl.bind_optimizers([torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(ValueError, match="exactly one QAdamOptimizer"):
        impl.bind_optimizers([QAdamOptimizer(model.parameters()), QAdamOptimizer(model.parameters())])
    with pytest.raises(ValueError, match=r"does not optimise 0\.weight"):
        impl.bind_optimizers([QAdamOptimizer(list(model.parameters())[1:])])
    optimizer = QAdamOptimizer(model.parameters())
    impl.bind_optimizers([optimizer])
    assert state.require_optimizer() is optimizer


def test_a_given_optimizer_wins_and_must_match_the_bound_one():
    model = make_model()
    optimizer = QAdamOptimizer(model.parameters())
    impl = bound_impl(model, optimizer)
    assert impl.communication_hook()[0].require_optimizer() is optimizer
    impl.bind_optimizers([optimizer])
    with pytest.raises(ValueError, match="not the `q_adam_optimizer`"):
        impl.bind_optimizers([QAdamOptimizer(model.parameters())])


@pytest.mark.parametrize(
    ("make", "schedulers", "ok"),
    [
        (lambda p: [QAdamOptimizer(p)], [], True),
        (lambda p: [QAdamOptimizer(p)], ["one"], True),
        (lambda p: [QAdamOptimizer(p)], ["one", "two"], False),
        (lambda p: [torch.optim.Adam(p)], [], False),
        (lambda p: [], [], False),
        (lambda p: [QAdamOptimizer(p), QAdamOptimizer(p)], [], False),
    ],
)
def test_lightning_configuration_rule(make, schedulers, ok):
    optimizers = make(list(make_model().parameters()))
    if ok:
        check_qadam_configuration(optimizers, schedulers)
    else:
        with pytest.raises(ValueError, match=r"^Bagua QAdam can only accept one QAdamOptimizer and one LR Scheduler"):
            check_qadam_configuration(optimizers, schedulers)


# ----------------------------------------------------------------------------------------- algorithm: real ranks


def snapshot(model, optimizer):
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        "x": {name: p.detach().clone() for name, p in model.named_parameters()},
        "m": {names[id(p)]: s["exp_avg"].clone() for p, s in optimizer.state.items()},
        "v": {names[id(p)]: s["exp_avg_sq"].clone() for p, s in optimizer.state.items()},
        "step": {names[id(p)]: s["step"] for p, s in optimizer.state.items()},
    }


def train_with_qadam(rank: int, world_size: int, kwargs: dict, ranks_per_node: int | None) -> dict:
    layouts: list[list[str]] = []
    original = qadam.qadam_hook
    model = make_model()
    names = {id(p): name for name, p in model.named_parameters()}

    def spy(state, bucket):
        layouts.append([names[id(p)] for p in bucket.parameters()])
        return original(state, bucket)

    qadam.qadam_hook = spy  # looked up when the wrapper registers the hook
    optimizer = QAdamOptimizer(model.parameters(), warmup_steps=WARMUP, **HYPER)
    ddp = BaguaDistributedDataParallel(
        model, algorithm=QAdamAlgorithm(**kwargs), ranks_per_node=ranks_per_node, bucket_cap_mb=0.004
    )
    ddp.bind_optimizers([optimizer])  # bound after wrapping, as the Lightning strategy does
    qadam.qadam_hook = original
    parts: list[tuple] = []  # the exchanges handed to the executor as parts it may replay as CUDA graphs
    run_part = ddp._bagua_executor.run_part

    def spy_part(key, tensor, job, counter, last=False):
        parts.append((key, last))
        return run_part(key, tensor, job, counter, last=last)

    ddp._bagua_executor.run_part = spy_part
    steps = []
    for step in range(STEPS):
        before = snapshot(model, optimizer)
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        ddp.communication_counter.reset()
        first, first_part = len(layouts), len(parts)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        steps.append(
            {
                "before": before,
                "after": snapshot(model, optimizer),
                "grads": grads,
                "layout": layouts[first:],
                "parts": parts[first_part:],
                "bytes": ddp.communication_counter.bytes_by_op,
            }
        )
    ddp.close()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "steps": steps}


def independent_gradients(x: dict, rank: int, step: int) -> dict:
    model = make_model()
    model.load_state_dict(x, strict=False)
    inputs, targets = batch_for(rank, step)
    nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check_against_simulation(results: list[dict], ranks_per_node: int | None) -> None:
    """Step by step, from the run's state before each step, the spec's math for that step (teacher forcing)."""
    n = len(results)
    b1, b2 = HYPER["betas"]
    lr, eps, wd = HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
    for step, record in enumerate(results[0]["steps"]):
        s = step + 1
        before, after = record["before"], record["after"]
        x = before["x"]
        m = {name: before["m"].get(name, torch.zeros_like(t)) for name, t in x.items()}
        v = {name: before["v"].get(name, torch.zeros_like(t)) for name, t in x.items()}
        grads = [independent_gradients(x, rank, step) for rank in range(n)]
        assert all(count == s for count in after["step"].values())
        if s < WARMUP:
            for name in x:
                mean_grad = sum(g[name] for g in grads) / n
                # Warm-up: .grad is the full-precision mean on every rank.
                for result in results:
                    torch.testing.assert_close(result["steps"][step]["grads"][name], mean_grad, rtol=1e-5, atol=1e-7)
                g = mean_grad + wd * x[name]
                expected_m = b1 * m[name] + (1 - b1) * g
                expected_v = b2 * v[name] + (1 - b2) * g * g
                torch.testing.assert_close(after["m"][name], expected_m, rtol=1e-5, atol=1e-8)
                torch.testing.assert_close(after["v"][name], expected_v, rtol=1e-5, atol=1e-12)
            assert set(record["bytes"]) == (
                {"all_reduce"} if ranks_per_node is None else {"reduce", "broadcast", "all_reduce"}
            )
        else:
            for name in x:
                # v is frozen; .grad stays each rank's local gradient.
                assert torch.equal(after["v"][name], v[name]), f"step {s}: v of {name} changed"
                for rank, result in enumerate(results):
                    torch.testing.assert_close(
                        result["steps"][step]["grads"][name], grads[rank][name], rtol=1e-5, atol=1e-7
                    )
            local_m = [{name: b1 * m[name] + (1 - b1) * (g[name] + wd * x[name]) for name in x} for g in grads]
            for layout in record["layout"]:
                inputs = [torch.cat([local[name].reshape(-1) for name in layout]) for local in local_m]
                if ranks_per_node is not None:  # full-precision node means, compressed among the node leaders
                    inputs = [sum(inputs[i : i + ranks_per_node]) / ranks_per_node for i in range(0, n, ranks_per_node)]
                expected, allowance = simulate_scatter_gather(inputs, average=True)
                got = torch.cat([after["m"][name].reshape(-1) for name in layout]).double()
                error = (got - expected).abs()
                assert (error <= allowance + 1e-6).all(), f"step {s}: momentum off by {(error - allowance).max()}"
            if ranks_per_node is None:
                sizes = [sum(x[name].numel() for name in layout) for layout in record["layout"]]
                assert record["bytes"] == expected_bytes(sizes, n), f"step {s}"
        # The update, from the run's own m (already checked) and v.
        for name in x:
            denominator = after["v"][name].sqrt() / math.sqrt(1 - b2**s) + eps
            expected_x = x[name] - lr / (1 - b1**s) * after["m"][name] / denominator
            torch.testing.assert_close(after["x"][name], expected_x, rtol=1e-5, atol=1e-6)
    for result in results[1:]:
        for step, record in enumerate(result["steps"]):
            for key in ("m", "v"):
                for name, tensor in record["after"][key].items():
                    assert torch.equal(tensor, results[0]["steps"][step]["after"][key][name]), f"{key} {name} {step}"


def test_flat_qadam_matches_the_spec_step_by_step():
    results = run_processes(train_with_qadam, 2, {"hierarchical": False}, None)
    assert_ranks_identical(results)
    check_against_simulation(results, None)
    # Flat, each compressed bucket's exchange is a part the executor may replay as a CUDA graph, keyed by what
    # every rank agrees on, the step's last bucket marked (never replayed); the warm-up's all-reduce is not.
    for step, record in enumerate(results[0]["steps"]):
        if step + 1 < WARMUP:
            assert record["parts"] == []
            continue
        sizes = [sum(record["before"]["x"][name].numel() for name in layout) for layout in record["layout"]]
        keys = [key for key, _ in record["parts"]]
        assert [(name, numel, dtype) for name, _, numel, dtype in keys] == [
            ("qadam", size, torch.float32) for size in sizes
        ]
        assert len({index for _, index, _, _ in keys}) == len(keys)
        assert [last for _, last in record["parts"]] == [False] * (len(keys) - 1) + [True]


def test_hierarchical_qadam_on_two_nodes_of_two():
    results = run_processes(train_with_qadam, 4, {"hierarchical": True}, 2)
    # Hierarchical, the exchange runs over two communicators: never captured.
    assert all(record["parts"] == [] for result in results for record in result["steps"])
    assert_ranks_identical(results)
    check_against_simulation(results, 2)
    for rank, result in enumerate(results):
        compressed_ops = set().union(*(record["bytes"].keys() for record in result["steps"][WARMUP - 1 :]))
        leader = rank % 2 == 0
        assert compressed_ops == (
            {"reduce", "broadcast", "all_to_all", "all_gather"} if leader else {"reduce", "broadcast"}
        )


def resume_runs(rank: int, world_size: int, resume_at: list[int]) -> dict:
    def wrap(model, optimizer):
        return BaguaDistributedDataParallel(
            model, [optimizer], QAdamAlgorithm(q_adam_optimizer=optimizer, hierarchical=False), bucket_cap_mb=0.004
        )

    def train(model, optimizer, steps):
        ddp = wrap(model, optimizer)
        for step in steps:
            inputs, targets = batch_for(rank, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(inputs), targets).backward()
            optimizer.step()
        ddp.close()

    def final(model, optimizer):
        return {"model": {k: v.clone() for k, v in model.state_dict().items()}, **snapshot(model, optimizer)}

    def start():
        model = make_model()
        return model, QAdamOptimizer(model.parameters(), warmup_steps=WARMUP, **HYPER)

    model, optimizer = start()
    train(model, optimizer, range(STEPS))
    results = {"uninterrupted": final(model, optimizer)}
    for cut in resume_at:
        model, optimizer = start()
        train(model, optimizer, range(cut))
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        # The reference: the same objects, wrapped again (a new wrapper starts over with DDP's initial buckets).
        train(model, optimizer, range(cut, STEPS))
        fresh, fresh_optimizer = start()
        with torch.no_grad():
            for param in fresh.parameters():
                param.normal_()  # so that only the checkpoint can make it right
        fresh.load_state_dict(checkpoint["model"])
        fresh_optimizer.load_state_dict(checkpoint["optimizer"])
        phase = fresh_optimizer.is_compressed_step(next(fresh.parameters()))
        train(fresh, fresh_optimizer, range(cut, STEPS))
        results[cut] = {"compressed_next": phase, "rewrapped": final(model, optimizer), **final(fresh, fresh_optimizer)}
    return results


def assert_same_training(got: dict, expected: dict, what: str) -> None:
    assert got["step"] == expected["step"], what
    for key in ("model", "m", "v"):
        for name, tensor in expected[key].items():
            assert torch.equal(got[key][name], tensor), f"{what}: {key} of {name} differs"


def test_checkpoint_round_trip_in_both_phases():
    cuts = [1, WARMUP - 1, 4]  # mid warm-up, just before the switch, mid compressed phase
    results = run_processes(resume_runs, 2, cuts)
    for result in results:
        for cut in cuts:
            resumed = result[cut]
            assert resumed["compressed_next"] == (cut + 1 >= WARMUP)
            # Bit for bit what the same optimizer object does when training goes on under a new wrapper.
            assert_same_training(resumed, resumed["rewrapped"], f"resumed at {cut}")
        # Resumed in the warm-up, the new wrapper's first step (one initial DDP bucket) is full precision, and its
        # buckets are rebuilt before the compressed phase: bit for bit the uninterrupted run. (Resumed in the
        # compressed phase, the first step's momentum is quantised over DDP's initial single bucket instead of the
        # rebuilt ones, a different chunking, so only the rewrapped reference is bitwise comparable.)
        assert_same_training(result[1], result["uninterrupted"], "resumed at 1 vs uninterrupted")


def backward_without_an_optimizer(rank: int, world_size: int) -> dict:
    model = make_model()
    ddp = BaguaDistributedDataParallel(model, algorithm=QAdamAlgorithm())
    inputs, targets = batch_for(rank, 0)
    try:
        nn.functional.mse_loss(ddp(inputs), targets).backward()
    except RuntimeError as error:
        message = str(error)
    else:
        message = ""
    ddp.close()
    return {"message": message}


def test_backward_without_a_bound_optimizer_says_how_to_bind_one():
    (result,) = run_processes(backward_without_an_optimizer, 1)
    assert "Algorithm 'qadam' has no QAdamOptimizer: pass `q_adam_optimizer=`" in result["message"]


class _WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 4)
        self.unused = nn.Linear(6, 4)  # an auxiliary head this phase of training never calls

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.used(inputs)


def _mixed_phase_optimizer(model: _WithUnusedHead, case: str) -> QAdamOptimizer:
    if case == "unused":
        return QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    late = [model.used.bias, *model.unused.parameters()]
    return QAdamOptimizer(
        [{"params": [model.used.weight], "warmup_steps": 2}, {"params": late}], lr=0.01, warmup_steps=5
    )


def _mixed_phase_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 4, generator=generator)


def _train_mixed_phases(rank: int, ddp: BaguaDistributedDataParallel, optimizer: QAdamOptimizer, steps: int) -> dict:
    for step in range(steps):
        inputs, targets = _mixed_phase_batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
    ddp.close()
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def train_with_buckets_in_both_phases(rank: int, world_size: int, case: str, steps: int) -> dict:
    import logging

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(qadam.__name__).addHandler(handler)
    torch.manual_seed(0)
    model = _WithUnusedHead()
    optimizer = _mixed_phase_optimizer(model, case)
    algorithm = Algorithm.init("qadam", hierarchical=False)
    ddp = BaguaDistributedDataParallel(model, [optimizer], algorithm, find_unused_parameters=True)
    return {"state": _train_mixed_phases(rank, ddp, optimizer, steps), "warnings": warnings}


@pytest.mark.parametrize(("case", "steps"), [("unused", 5), ("groups", 4)])
def test_a_bucket_in_both_phases_is_averaged_at_full_precision_as_one_process_would(case, steps):
    # A parameter without gradients never steps, so its count stays in the warm-up beside bucket-mates that left
    # it; groups with different warmup_steps do the same. Such a bucket goes at full precision: exact.
    results = run_processes(train_with_buckets_in_both_phases, 2, case, steps)
    torch.manual_seed(0)
    reference = _WithUnusedHead()
    optimizer = _mixed_phase_optimizer(reference, case)
    for step in range(steps):
        optimizer.zero_grad()
        losses = [nn.functional.mse_loss(reference(x), y) for x, y in (_mixed_phase_batch(r, step) for r in range(2))]
        (sum(losses) / 2).backward()
        optimizer.step()
    for result in results:
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert len(results[0]["warnings"]) == 1
    assert "gradient bucket 0 holds parameters in the warm-up and in the compressed phase" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []  # said once, by rank 0
    torch.testing.assert_close(results[0]["state"]["unused.weight"], reference.unused.weight.detach(), rtol=0, atol=0)


def train_with_a_warm_up_bucket_after_a_compressed_one(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    # The last layer's gradients are ready first, so its bucket goes first: compressed from step 2, while the
    # first layer's bucket stays in the warm-up until step 5 and must queue behind it on the executor.
    groups = [{"params": model[2].parameters(), "warmup_steps": 2}, {"params": model[0].parameters()}]
    optimizer = QAdamOptimizer(groups, lr=0.01, warmup_steps=5)
    algorithm = Algorithm.init("qadam", hierarchical=False)
    ddp = BaguaDistributedDataParallel(model, [optimizer], algorithm, bucket_cap_mb=1e-5)  # a bucket each
    queued: list[int] = []
    original = qadam.all_reduce_bucket

    def spy(state, buffer):
        queued.append(buffer.numel())
        return original(state, buffer)

    qadam.all_reduce_bucket = spy
    return {"state": _train_mixed_phases(rank, ddp, optimizer, steps), "queued": queued}


def test_a_full_precision_bucket_after_a_compressed_one_keeps_the_ranks_in_step():
    results = run_processes(train_with_a_warm_up_bucket_after_a_compressed_one, 2, 4)
    assert_ranks_identical(results)
    # Steps 2 to 4: the first layer's buckets (weight 30 and bias 5 values) went behind the compressed ones.
    assert sorted(results[0]["queued"]) == sorted([30, 5] * 3)
