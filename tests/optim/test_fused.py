"""fuse_optimizer: fused steps against the same optimizer unfused, state round trips, refusals, the engine."""

import copy
import io
import warnings

import pytest
import torch
from packaging.version import Version
from torch import nn

from lightning_bagua import fuse_optimizer
from tests.distributed import assert_ranks_identical, run_processes

STEPS = 24
TORCH = Version(torch.__version__).release
# Odd sizes, a 0-d and a 1-element tensor, a size-1 dimension, and a channels-last 4-d tensor.
SHAPES = [(7,), (3, 5), (), (1,), (33,), (2, 3, 4), (17, 19), (129,), (4, 1, 3), (2, 3, 2, 2)]


def make_params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)) for shape in SHAPES]
    params[-1].data = params[-1].data.contiguous(memory_format=torch.channels_last)
    return params


def set_grads(params: list[nn.Parameter], step: int) -> None:
    """Give every parameter a fresh gradient of the same values as its twin gets; reuse the tensor if present.

    New gradients take the parameter's memory layout, as autograd's do (torch's fused kernels rely on that).
    """
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.empty_like(p, requires_grad=False).copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)


def assert_same(reference: list[torch.Tensor], fused: list[torch.Tensor], exact: bool = True) -> None:
    for index, (expected, actual) in enumerate(zip(reference, fused, strict=True)):
        if exact:
            assert torch.equal(expected, actual), f"tensor {index}: max diff {(expected - actual).abs().max()}"
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def assert_same_state(reference: torch.optim.Optimizer, fused: torch.optim.Optimizer, exact: bool = True) -> None:
    expected, actual = reference.state_dict(), fused.state_dict()
    assert expected["param_groups"] == actual["param_groups"]
    assert expected["state"].keys() == actual["state"].keys()
    for index, entries in expected["state"].items():
        assert entries.keys() == actual["state"][index].keys()
        for key, value in entries.items():
            other = actual["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert_same([value], [other], exact)
            else:
                # torch 2.2 keeps some entries as None (SGD's momentum_buffer without momentum) or as Python
                # numbers (the step of RMSprop, Adadelta, Rprop); the fused optimizer must keep the same.
                assert type(other) is type(value), (index, key, value, other)
                assert other == value, (index, key, value, other)


CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True, "betas": (0.8, 0.9)}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "maximize": True}),
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "weight_decay": 0.01}),
    (torch.optim.Adamax, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.NAdam, {"lr": 0.01, "momentum_decay": 0.01}),
    (torch.optim.RAdam, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.01}),
    (torch.optim.Rprop, {"lr": 0.01}),
    (torch.optim.ASGD, {"lr": 0.01, "t0": 5, "weight_decay": 0.01}),
]


def case_id(case: tuple) -> str:
    cls, kwargs = case
    return cls.__name__ + "-" + ",".join(f"{k}={v}" for k, v in kwargs.items() if k != "lr")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_steps_equal_unfused_steps_bitwise(case):
    """The single-tensor and foreach paths compute every element alike wherever it lies: the results are identical."""
    cls, kwargs = case
    reference_params, fused_params = make_params(), make_params()
    reference = cls(reference_params, **kwargs)
    fused = fuse_optimizer(cls(fused_params, **kwargs))
    for step in range(STEPS):
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert_same(reference_params, fused_params)
    assert_same_state(reference, fused)
    # The parameters really are views into one buffer per dtype (all float32 here, so one).
    pointers = sorted(p.data_ptr() for p in fused_params)
    storages = {p.untyped_storage().data_ptr() for p in fused_params}
    assert len(storages) == 1, pointers


@pytest.mark.skipif(
    TORCH < (2, 4), reason="torch 2.4 added fused=True on CPU (Adam, AdamW, SGD, Adagrad); these tests run on CPU"
)
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, {"lr": 0.01, "fused": True}),
        (torch.optim.AdamW, {"lr": 0.01, "fused": True, "amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "fused": True}),
        (torch.optim.Adagrad, {"lr": 0.01, "fused": True}),
    ],
)
def test_torch_fused_kernels_agree_to_rounding(cls, kwargs):
    """Not bitwise: torch's CPU fused kernels round the vectorised part and the tail of a tensor differently.

    Which elements form the tail changes with the concatenation (a 7-element tensor is all tail alone, all vector
    inside the flat buffer), so a few elements differ in the last bits.
    """
    reference_params, fused_params = make_params(), make_params()
    reference = cls(reference_params, **kwargs)
    fused = fuse_optimizer(cls(fused_params, **kwargs))
    for step in range(STEPS):
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert_same(reference_params, fused_params, exact=False)
    assert_same_state(reference, fused, exact=False)


def make_groups(params: list[nn.Parameter], extra: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:4], "lr": 0.05, "betas": (0.5, 0.6)},
        {"params": params[4:8], "weight_decay": 0.3},
        {"params": params[8:] + extra, "lr": 0.001, "amsgrad": True},
    ]


def test_param_groups_with_different_hyperparameters_and_dtypes():
    def build():
        params = make_params()
        generator = torch.Generator().manual_seed(2)
        extra = [nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64)) for shape in [(5, 5), (9,)]]
        return params + extra, torch.optim.Adam(make_groups(params, extra), lr=0.01)

    reference_params, reference = build()
    fused_params, fused = build()
    fuse_optimizer(fused)
    for step in range(STEPS):
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert_same(reference_params, fused_params)
    assert_same_state(reference, fused)
    # Group 2 holds float32 and float64 parameters: one buffer each.
    group2 = fused.param_groups[2]["params"]
    storages = {(p.dtype, p.untyped_storage().data_ptr()) for p in group2}
    assert len(storages) == 2


def test_parameters_stay_the_same_objects_and_the_model_sees_the_updates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    params = list(model.parameters())
    optimizer = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert list(model.parameters()) == params
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    before = [p.detach().clone() for p in params]
    model(torch.randn(4, 6)).sum().backward()
    optimizer.fuse_step()
    for p, old in zip(params, before, strict=True):
        assert torch.equal(p.detach(), torch.add(old, p.grad, alpha=-0.1))


def train_model(optimizer_factory, fuse: bool, set_to_none: bool, steps: int = STEPS, **fuse_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = optimizer_factory(model.parameters())
    if fuse:
        fuse_optimizer(optimizer, **fuse_kwargs)
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        inputs = torch.randn(8, 6, generator=generator)
        optimizer.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True).sin()).backward()
        if fuse:
            optimizer.fuse_step()
        else:
            optimizer.step()
    return model, optimizer


def adam(params):
    return torch.optim.Adam(params, lr=0.01, weight_decay=0.01)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_either_way(set_to_none):
    """With set_to_none, every backward allocates new gradients; check_flatten copies them into the buffer."""
    reference, _ = train_model(adam, fuse=False, set_to_none=set_to_none)
    model, _ = train_model(adam, fuse=True, set_to_none=set_to_none)
    assert_same(list(reference.parameters()), list(model.parameters()))
    storage = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storage) == 1  # after the last fuse_step the gradients are views of one buffer again


def test_without_check_flatten_gradients_must_stay_in_place():
    reference, _ = train_model(adam, fuse=False, set_to_none=False)
    model, _ = train_model(adam, fuse=True, set_to_none=False, check_flatten=False)
    assert_same(list(reference.parameters()), list(model.parameters()))
    # The documented cost of skipping the check: new gradient tensors are not seen, so the buffer's stale values
    # are used, and the result differs.
    stale, _ = train_model(adam, fuse=True, set_to_none=True, check_flatten=False, steps=3)
    fresh, _ = train_model(adam, fuse=False, set_to_none=True, steps=3)
    assert not torch.equal(next(stale.parameters()), next(fresh.parameters()))


def test_parameters_without_gradients_are_skipped_like_step_does():
    """Frozen and unused parameters get no update; a part where only some have gradients steps them one by one."""

    def run(fuse: bool) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        params = make_params()
        params[1].requires_grad_(False)  # frozen: kept out of the buffers altogether
        optimizer = torch.optim.Adam(params, lr=0.01, weight_decay=0.1)
        if fuse:
            fuse_optimizer(optimizer)
        for step in range(STEPS):
            set_grads(params, step)
            params[1].grad = None
            if step % 5 == 2:
                params[3].grad = None  # unused this step: must be skipped, not updated with a zero gradient
            if step == 7:
                for p in params:
                    p.grad = None  # a step without any gradient changes nothing
            (optimizer.fuse_step if fuse else optimizer.step)()
        return params, optimizer

    reference_params, reference = run(fuse=False)
    fused_params, fused = run(fuse=True)
    assert_same(reference_params, fused_params)
    assert_same_state(reference, fused)


def test_momentum_sgd_returns_to_fused_steps_after_a_partial_step():
    """SGD keeps no step count, so once every momentum buffer exists the buffers are laid out flat again."""
    params = make_params()
    optimizer = fuse_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    set_grads(params, 0)
    params[0].grad = None
    optimizer.fuse_step()  # one by one: params[0] has no gradient
    set_grads(params, 1)
    optimizer.fuse_step()  # still one by one: params[0] has no momentum buffer yet, the others have
    set_grads(params, 2)
    optimizer.fuse_step()
    fuser = optimizer._lightning_bagua_fuser
    (run,) = fuser.runs[0]
    assert not run.state_dirty
    buffers = {optimizer.state[p]["momentum_buffer"].untyped_storage().data_ptr() for p in params}
    assert buffers == {run.states["momentum_buffer"].untyped_storage().data_ptr()}


def test_closure_is_called_once_and_its_loss_returned():
    params = make_params()
    optimizer = fuse_optimizer(torch.optim.SGD(params, lr=0.1))
    calls = []

    def closure():
        calls.append(1)
        set_grads(params, 0)
        return torch.tensor(3.0)

    assert optimizer.fuse_step(closure).item() == 3.0
    assert calls == [1]


# ------------------------------------------------------------------------------------------------ state dicts


def checkpoint(optimizer: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.NAdam, {"lr": 0.01}),
        (torch.optim.ASGD, {"lr": 0.01, "t0": 3}),
    ],
)
def test_state_dict_round_trips_between_fused_and_unfused(cls, kwargs):
    fused_params = make_params()
    fused = fuse_optimizer(cls(fused_params, **kwargs))
    for step in range(STEPS // 2):
        set_grads(fused_params, step)
        fused.fuse_step()
    saved = checkpoint(fused)

    # Into an unfused optimizer, which continues exactly as the fused one does.
    unfused_params = [nn.Parameter(p.detach().clone()) for p in fused_params]
    unfused = cls(unfused_params, **kwargs)
    unfused.load_state_dict(saved)
    for step in range(STEPS // 2, STEPS):
        set_grads(fused_params, step)
        set_grads(unfused_params, step)
        fused.fuse_step()
        unfused.step()
    assert_same(unfused_params, fused_params)
    assert_same_state(unfused, fused)

    # And back: an unfused optimizer's state loaded into a fused one is laid out flat and continues alike.
    refused_params = [nn.Parameter(p.detach().clone()) for p in unfused_params]
    refused = fuse_optimizer(cls(refused_params, **kwargs))
    refused.load_state_dict(checkpoint(unfused))
    for step in range(STEPS, STEPS + 4):
        set_grads(unfused_params, step)
        set_grads(refused_params, step)
        unfused.step()
        refused.fuse_step()
    assert_same(unfused_params, refused_params)
    assert_same_state(unfused, refused)
    # The loaded state was laid out flat: every parameter's entries are views of the run's buffers.
    (run,) = refused._lightning_bagua_fuser.runs[0]
    assert run.states
    for key, buffer in run.states.items():
        storages = {refused.state[p][key].untyped_storage().data_ptr() for p in refused_params}
        assert storages == {buffer.untyped_storage().data_ptr()}, key


def test_plain_step_still_works_after_fusing_and_mixes_with_fuse_step():
    reference_params, fused_params = make_params(), make_params()
    reference = torch.optim.RAdam(reference_params, lr=0.01)
    fused = fuse_optimizer(torch.optim.RAdam(fused_params, lr=0.01))
    for step in range(STEPS):
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        (fused.step if step % 3 == 0 else fused.fuse_step)()
    assert_same(reference_params, fused_params)
    assert_same_state(reference, fused)


def test_add_param_group_after_fusing():
    reference_params, fused_params = make_params(), make_params()
    reference = torch.optim.AdamW(reference_params[:5], lr=0.01)
    fused = fuse_optimizer(torch.optim.AdamW(fused_params[:5], lr=0.01))
    for step in range(STEPS):
        if step == 4:
            reference.add_param_group({"params": reference_params[5:], "lr": 0.003})
            fused.add_param_group({"params": fused_params[5:], "lr": 0.003})
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert_same(reference_params, fused_params)
    assert len(fused._lightning_bagua_fuser.runs) == 2


# --------------------------------------------------------------------------------------------- do_flatten=False


def test_without_flatten_nothing_moves_and_results_are_equal():
    reference_params, fused_params = make_params(), make_params()
    pointers = [p.data_ptr() for p in fused_params]
    reference = torch.optim.Adam(reference_params, lr=0.01)
    fused = fuse_optimizer(torch.optim.Adam(fused_params, lr=0.01), do_flatten=False)
    for step in range(STEPS):
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert [p.data_ptr() for p in fused_params] == pointers
    assert_same(reference_params, fused_params)
    assert_same_state(reference, fused)
    assert fused._lightning_bagua_fuser.runs == [[]]  # separate tensors: nothing to fuse


@pytest.mark.parametrize("check_flatten", [True, False])
def test_without_flatten_parameters_already_back_to_back_are_fused(check_flatten):
    """Parameters and gradients laid out contiguously by someone else are found and stepped as one."""

    def build():
        shapes = [(3, 4), (5,), (2, 2, 2)]
        total = sum(torch.Size(shape).numel() for shape in shapes)
        data = torch.randn(total, generator=torch.Generator().manual_seed(0))
        grads = torch.zeros(total)
        params, offset = [], 0
        for shape in shapes:
            numel = torch.Size(shape).numel()
            p = nn.Parameter(data[offset : offset + numel].view(shape))
            p.grad = grads[offset : offset + numel].view(shape)
            params.append(p)
            offset += numel
        return params, grads

    reference_params, _ = build()
    fused_params, flat_grads = build()
    reference = torch.optim.Adam(reference_params, lr=0.01)
    fused = fuse_optimizer(torch.optim.Adam(fused_params, lr=0.01), do_flatten=False, check_flatten=check_flatten)
    for step in range(STEPS):
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert_same(reference_params, fused_params)
    assert_same_state(reference, fused)
    (runs,) = fused._lightning_bagua_fuser.runs
    assert len(runs) == 1
    assert runs[0].params == fused_params
    assert runs[0].flat.grad.data_ptr() == flat_grads.data_ptr()


# -------------------------------------------------------------------------------------------------- refusals


class MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize(
    "factory",
    [
        lambda params: torch.optim.LBFGS(params),
        lambda params: torch.optim.SparseAdam(params),
        pytest.param(
            lambda params: torch.optim.Adafactor(params),
            marks=pytest.mark.skipif(TORCH < (2, 5), reason="torch 2.5 added torch.optim.Adafactor"),
        ),
        lambda params: MyAdam(params),
    ],
    ids=["LBFGS", "SparseAdam", "Adafactor", "subclass"],
)
def test_non_elementwise_or_unknown_optimizers_are_refused(factory):
    optimizer = factory(make_params()[:3])
    with pytest.raises(TypeError, match=rf"cannot fuse .*{type(optimizer).__name__}.*ASGD, Adadelta, Adagrad, Adam"):
        fuse_optimizer(optimizer)
    assert not hasattr(optimizer, "fuse_step")


def test_other_bad_input_is_refused():
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer, got list"):
        fuse_optimizer([])
    with pytest.raises(ValueError, match="group 0 uses differentiable=True"):
        fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1, differentiable=True))


def test_fusing_twice_is_an_error():
    optimizer = fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1))
    with pytest.raises(RuntimeError, match="was fused already"):
        fuse_optimizer(optimizer)


def test_a_parameter_converted_after_fusing_is_reported():
    params = make_params()
    optimizer = fuse_optimizer(torch.optim.SGD(params, lr=0.1))
    params[2].data = params[2].data.double()
    set_grads(params, 0)
    with pytest.raises(RuntimeError, match=r"changed to shape \(\), torch.float64 .* Move or convert the model before"):
        optimizer.fuse_step()


def test_a_parameter_replaced_in_place_of_the_same_kind_is_copied_back():
    reference_params, fused_params = make_params(), make_params()
    reference = torch.optim.SGD(reference_params, lr=0.1, momentum=0.5)
    fused = fuse_optimizer(torch.optim.SGD(fused_params, lr=0.1, momentum=0.5))
    for step in range(6):
        if step == 3:
            for p in (reference_params[4], fused_params[4]):
                p.data = p.data.clone() + 1  # e.g. a checkpoint loader that re-assigns .data
        set_grads(reference_params, step)
        set_grads(fused_params, step)
        reference.step()
        fused.fuse_step()
    assert_same(reference_params, fused_params)
    (run,) = fused._lightning_bagua_fuser.runs[0]
    assert fused_params[4].untyped_storage().data_ptr() == run.flat.untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------- with Lightning, the engine


def test_step_routed_to_fuse_step_works_with_lr_schedulers():
    """The documented Lightning recipe: `optimizer.step = optimizer.fuse_step`, here under an LR scheduler."""

    def run(fuse: bool) -> list[nn.Parameter]:
        params = make_params()
        optimizer = torch.optim.Adam(params, lr=0.01)
        if fuse:
            fuse_optimizer(optimizer)
            optimizer.step = optimizer.fuse_step
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        for step in range(STEPS):
            set_grads(params, step)
            optimizer.step()
            scheduler.step()
        return params

    reference = run(fuse=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        fused = run(fuse=True)
    assert_same(reference, fused)


def train_with_engine(rank: int, world_size: int, gradient_as_bucket_view: bool) -> dict:
    """Train twice on this rank, fused and unfused, each under its own engine; return both final states."""
    from lightning_bagua.engine import BaguaDistributedDataParallel

    results = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        ddp = BaguaDistributedDataParallel(
            model, optimizers=[optimizer], gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=0.002
        )
        if fuse:
            fuse_optimizer(optimizer)
        for step in range(8):
            generator = torch.Generator().manual_seed(100 * step + rank)
            inputs = torch.randn(4, 8, generator=generator)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(inputs), inputs.sum(1, keepdim=True).cos()).backward()
            optimizer.fuse_step() if fuse else optimizer.step()
        ddp.close()
        results["fused" if fuse else "unfused"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": results["fused"], "unfused": results["unfused"]}


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_under_the_engine_equals_unfused(gradient_as_bucket_view):
    """Works with the strategy's flatten=False (and, copying every gradient each step, with flatten=True)."""
    results = run_processes(train_with_engine, 2, gradient_as_bucket_view)
    assert_ranks_identical(results)
    for key, value in results[0]["unfused"].items():
        assert torch.equal(value, results[0]["state"][key]), key


def test_deepcopy_of_a_state_dict_is_plain():
    params = make_params()
    optimizer = fuse_optimizer(torch.optim.Adam(params, lr=0.01))
    set_grads(params, 0)
    optimizer.fuse_step()
    copied = copy.deepcopy(optimizer.state_dict())
    assert set(copied["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert copied["state"][0]["exp_avg"].shape == params[0].shape
