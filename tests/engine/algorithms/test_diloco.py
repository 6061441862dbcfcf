"""``diloco`` on real Gloo processes, against a single-process reference of the math (outer step, fragments, merge)."""

import copy
import math

import pytest
import torch
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms import Algorithm
from lightning_bagua.engine.algorithms._diloco_quantize import CHUNK, OuterGradientCodec
from lightning_bagua.engine.algorithms.diloco import DiLoCoAlgorithm, DiLoCoImpl, fragment_offsets, split_fragments
from tests.distributed import run_processes

BATCH = 8
FEATURES = 6
LR = 0.05
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# Flat exchange: every rank is its own node, whatever the host.
FLAT = {"hierarchical": False}


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 10), nn.Tanh(), nn.Linear(10, 3), nn.Tanh(), nn.Linear(3, 1))


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7919 * step + rank)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)


def flat(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in parameters])


# ----------------------------------------------------------------------------------------------------------------
# The single-process reference.


def reference(n: int, steps: int, ranks_per_node: int = 1, **kwargs: object) -> dict:
    """Train ``n // ranks_per_node`` replicas as the docstring's numbered steps say, then close the last step."""
    config = DiLoCoAlgorithm(**kwargs)  # type: ignore[arg-type]
    nodes = n // ranks_per_node
    models = [make_model() for _ in range(nodes)]
    optimizers = [inner_optimizer(model) for model in models]
    parameters = [list(model.parameters()) for model in models]
    runs = split_fragments([p.numel() for p in parameters[0]], config.fragments)
    offsets = fragment_offsets(config.sync_every, config.fragments)
    outer = [nn.Parameter(flat([parameters[0][i] for i in run])) for run in runs]
    outer_optimizers = [config.outer_optimizer([o], **config.resolved_outer_optimizer_kwargs()) for o in outer]
    codec = OuterGradientCodec(config.quantization)
    pending: list[tuple[int, int]] = []

    def merge(p: int) -> None:
        for node in range(nodes):
            members = [parameters[node][i] for i in runs[p]]
            mixed = config.fragment_update_alpha * flat(members) + (1 - config.fragment_update_alpha) * outer[p].data
            offset = 0
            with torch.no_grad():
                for member in members:
                    member.copy_(mixed[offset : offset + member.numel()].view_as(member))
                    offset += member.numel()

    for k in range(1, steps + 1):
        for node, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            for local in range(ranks_per_node):  # the node's ranks average their gradients
                inputs, targets = batch_for(node * ranks_per_node + local, k - 1)
                (nn.functional.mse_loss(model(inputs), targets) / ranks_per_node).backward()
            optimizer.step()
        for p, _at in [entry for entry in pending if entry[1] == k]:
            merge(p)
        pending = [entry for entry in pending if entry[1] != k]
        for p, offset in enumerate(offsets):
            if k % config.sync_every != offset:
                continue
            deltas = [outer[p].data - flat([parameters[node][i] for i in runs[p]]) for node in range(nodes)]
            decoded = [codec.decode(codec.encode(delta), delta.numel()) for delta in deltas]
            outer[p].grad = torch.stack(decoded).sum(0) / nodes
            outer_optimizers[p].step()
            if config.fragment_sync_delay == 0:
                merge(p)
            else:
                pending.append((p, k + config.fragment_sync_delay))
    return {
        "weights": [flat(parameters[node]) for node in range(nodes)],
        "outer": [o.detach().clone() for o in outer],
    }


# ----------------------------------------------------------------------------------------------------------------
# What each rank runs.


def train(
    rank: int,
    world_size: int,
    kwargs: dict,
    steps: int,
    ranks_per_node: int | None = None,
    resume_at: int | None = None,
    eager: bool = False,
) -> dict:
    """Train ``steps`` steps; ``eager`` tells the algorithm of each optimizer step, as the strategies do."""
    model = make_model()
    optimizer = inner_optimizer(model)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], Algorithm.init("diloco", **kwargs), ranks_per_node=ranks_per_node
    )
    saved = None
    for step in range(steps):
        if step == resume_at:
            # Deep copies, as a checkpoint on disk would hold: state dicts share tensors with the live state.
            saved = copy.deepcopy(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "bagua": ddp.bagua_state_dict()}
            )
        _one_step(ddp, optimizer, rank, step, eager)
    if not eager:
        ddp(batch_for(rank, 10_000)[0])  # the next step's forward closes the last step: its boundary runs
    impl = ddp.bagua_algorithm_impl
    assert isinstance(impl, DiLoCoImpl)
    result = {
        "weights": flat(list(model.parameters())),
        "outer": [f.outer.detach().clone() for f in impl.fragments],
        "bytes_by_op": ddp.communication_counter.bytes_by_op,
        "syncs": impl.stats.syncs,
    }
    ddp.close()
    if saved is not None:
        # A fresh wrapper restored from the mid-period checkpoint must end bit for bit where the run did.
        model = make_model()
        optimizer = inner_optimizer(model)
        ddp = BaguaDistributedDataParallel(
            model, [optimizer], Algorithm.init("diloco", **kwargs), ranks_per_node=ranks_per_node
        )
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        ddp.load_bagua_state_dict(saved["bagua"])
        assert resume_at is not None
        for step in range(resume_at, steps):
            _one_step(ddp, optimizer, rank, step, eager)
        if not eager:
            ddp(batch_for(rank, 10_000)[0])
        result["resumed_weights"] = flat(list(model.parameters()))
        impl = ddp.bagua_algorithm_impl
        assert isinstance(impl, DiLoCoImpl)
        result["resumed_outer"] = [f.outer.detach().clone() for f in impl.fragments]
        ddp.close()
    return result


def _one_step(
    ddp: BaguaDistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int, step: int, eager: bool
) -> None:
    optimizer.zero_grad()
    inputs, targets = batch_for(rank, step)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    optimizer.step()
    if eager:
        ddp.bagua_algorithm_impl.on_optimizer_step(optimizer)


def assert_matches_reference(results: list[dict], expected: dict, ranks_per_node: int = 1, **tolerance: float) -> None:
    tolerance = tolerance or TOLERANCE
    for rank, result in enumerate(results):
        node = rank // ranks_per_node
        torch.testing.assert_close(result["weights"], expected["weights"][node], **tolerance, msg=f"rank {rank}")
        for got, want in zip(result["outer"], expected["outer"], strict=True):
            torch.testing.assert_close(got, want, **tolerance, msg=f"rank {rank}: θ_outer")


# ----------------------------------------------------------------------------------------------------------------
# The schedule, without processes.


def test_offsets_spread_over_the_period_and_the_last_fragment_ends_it():
    assert fragment_offsets(5, 1) == [0]
    assert fragment_offsets(4, 2) == [2, 0]
    assert fragment_offsets(6, 3) == [2, 4, 0]
    assert sorted(fragment_offsets(7, 7)) == list(range(7))


def test_fragments_are_contiguous_nonempty_and_about_equal():
    runs = split_fragments([10, 10, 10, 10], 2)
    assert runs == [range(2), range(2, 4)]
    runs = split_fragments([1, 1, 100], 3)
    assert runs == [range(1), range(1, 2), range(2, 3)]
    runs = split_fragments([60, 5, 5, 5, 5], 2)
    assert [len(r) for r in runs] == [1, 4]


@pytest.mark.parametrize(("quantization", "levels"), [("uint8", 255), ("uint4", 15)])
def test_codec_error_is_within_half_a_level_of_each_chunk(quantization, levels):
    values = torch.randn(3 * CHUNK, generator=torch.Generator().manual_seed(0))
    values[5] = 40.0  # an outlier spoils its own chunk's resolution only
    codec = OuterGradientCodec(quantization)
    decoded = codec.decode(codec.encode(values), values.numel())
    odd = values[: CHUNK + 17]
    assert (codec.decode(codec.encode(odd), odd.numel()) - odd).abs().max() <= (odd.max() - odd.min()) / levels
    for start in range(0, values.numel(), CHUNK):
        chunk = values[start : start + CHUNK]
        bound = (chunk.max() - chunk.min()) / levels  # half a level each side, plus the uint8 codec's own rounding
        assert (decoded[start : start + CHUNK] - chunk).abs().max() <= bound


# ----------------------------------------------------------------------------------------------------------------
# Against the reference, on real processes.


@pytest.mark.parametrize("world_size", [2, 4])
def test_outer_nesterov_step_matches_the_reference(world_size):
    kwargs = {"sync_every": 3, "quantization": None, **FLAT}
    results = run_processes(train, world_size, kwargs, 7)
    assert_matches_reference(results, reference(world_size, 7, **kwargs))
    assert results[0]["syncs"] == 2
    assert set(results[0]["bytes_by_op"]) == {"all_gather"}  # no gradient ever crosses between ranks


def test_one_rank_with_outer_sgd_lr_one_is_local_training():
    kwargs = {"sync_every": 2, "outer_optimizer_kwargs": {"lr": 1.0}, "quantization": None, **FLAT}
    (result,) = run_processes(train, 1, kwargs, 5)
    model = make_model()
    optimizer = inner_optimizer(model)
    for step in range(5):
        optimizer.zero_grad()
        inputs, targets = batch_for(0, step)
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    torch.testing.assert_close(result["weights"], flat(list(model.parameters())), **TOLERANCE)


@pytest.mark.parametrize("eager", [False, True], ids=["boundary-at-next-forward", "boundary-after-optimizer-step"])
def test_streamed_fragments_with_delay_and_alpha_match_the_reference(eager):
    kwargs = {
        "sync_every": 4,
        "fragments": 2,
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.25,
        "quantization": None,
        **FLAT,
    }
    results = run_processes(train, 2, kwargs, 9, None, None, eager)
    assert_matches_reference(results, reference(2, 9, **kwargs))
    # Not the unstreamed algorithm: the schedule matters.
    with pytest.raises(AssertionError):
        assert_matches_reference(results, reference(2, 9, sync_every=4, quantization=None, **FLAT))


@pytest.mark.parametrize(("quantization", "atol"), [("uint8", 2e-3), ("uint4", 3e-2)])
def test_quantized_outer_gradients_stay_near_full_precision(quantization, atol):
    kwargs = {"sync_every": 2, "fragments": 2, "quantization": quantization, **FLAT}
    results = run_processes(train, 2, kwargs, 6)
    # The reference encodes as the ranks do; full precision is within the stated tolerance.
    assert_matches_reference(results, reference(2, 6, **kwargs), rtol=1e-4, atol=1e-5)
    full = reference(2, 6, **{**kwargs, "quantization": None})
    assert_matches_reference(results, full, rtol=0.0, atol=atol)
    # A quarter (uint8) or an eighth (uint4) of the float32 bytes, plus one small header per chunk.
    numel = sum(p.numel() for p in make_model().parameters())
    assert results[0]["bytes_by_op"]["all_gather"] < 3 * numel * (1 if quantization == "uint8" else 0.5) + 200


def test_hierarchical_two_nodes_of_two_trains_one_replica_per_node():
    kwargs = {"sync_every": 3, "quantization": None}
    results = run_processes(train, 4, kwargs, 5, 2)
    assert_matches_reference(results, reference(4, 5, ranks_per_node=2, **kwargs), ranks_per_node=2)
    for rank, result in enumerate(results):
        ops = result["bytes_by_op"]
        assert "all_reduce" in ops or "reduce" in ops, f"rank {rank}: the node all-reduces gradients"
        assert ("all_gather" in ops) == (rank % 2 == 0), f"rank {rank}: only leaders exchange between nodes"
        assert "broadcast" in ops


@pytest.mark.parametrize("eager", [False, True], ids=["boundary-at-next-forward", "boundary-after-optimizer-step"])
def test_resume_mid_period_with_an_exchange_in_flight_is_exact(eager):
    kwargs = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "error_feedback": True, **FLAT}
    # Step 5 (the 6th) is mid-period, one step after fragment 1 started its exchange at step 4: it is in flight.
    results = run_processes(train, 2, kwargs, 9, None, 5, eager)
    for result in results:
        torch.testing.assert_close(result["resumed_weights"], result["weights"], rtol=0, atol=0)
        for got, want in zip(result["resumed_outer"], result["outer"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sync_every": 0}, ValueError, "sync_every"),
        ({"sync_every": 2.5}, TypeError, "sync_every"),
        ({"sync_every": 4, "fragments": 5}, ValueError, "fragments"),
        ({"sync_every": 4, "fragment_sync_delay": 4}, ValueError, "fragment_sync_delay"),
        ({"fragment_sync_delay": -1}, ValueError, "fragment_sync_delay"),
        ({"fragment_update_alpha": 1.5}, ValueError, "fragment_update_alpha"),
        ({"quantization": "int8"}, ValueError, "'uint8', 'uint4', None"),
        ({"outer_optimizer": "sgd"}, TypeError, "outer_optimizer"),
        ({"outer_optimizer": torch.optim.LBFGS}, TypeError, "LBFGS.step\\(\\) failed without one"),
        ({"outer_optimizer_kwargs": {"lr": 0.7, "betas": 3}}, TypeError, "outer_optimizer_kwargs"),
        ({"outer_optimizer_kwargs": [("lr", 1)]}, TypeError, "outer_optimizer_kwargs"),
        ({"offload": "yes"}, TypeError, "offload"),
        ({"overlap": 2}, TypeError, "fragment_sync_delay"),
    ],
)
def test_bad_keywords_fail_at_construction_naming_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        Algorithm.init("diloco", **kwargs)


def test_defaults_are_the_papers_outer_nesterov():
    algorithm = Algorithm.init("diloco")
    assert algorithm.resolved_outer_optimizer_kwargs() == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert algorithm.quantization == "uint8"
    assert algorithm == Algorithm.init("diloco")
    assert hash(algorithm) == hash(Algorithm.init("diloco"))


def test_resize_keeps_the_shared_state_and_the_residuals_sum():
    impl = DiLoCoImpl.__new__(DiLoCoImpl)
    impl.participants = 3
    outer = [torch.ones(4)]
    saved = [
        {"steps": 6, "outer": outer, "residuals": [torch.full((4,), float(rank))], "pending": [[0, 7]]}
        for rank in range(2)
    ]
    state = impl.resize_state(saved)
    assert state["steps"] == 6
    assert state["pending"] == [[0, 7]]
    torch.testing.assert_close(state["residuals"][0] * 3, torch.full((4,), 1.0))
    assert math.isclose(float(state["outer"][0].sum()), 4.0)
    assert state.get("local") is None  # saved between steps: the strategy restores the averaged weights


def test_resize_averages_the_replicas_held_aside_while_validation_showed_the_outer_weights():
    impl = DiLoCoImpl.__new__(DiLoCoImpl)
    impl.participants = 1
    saved = [
        {
            "steps": 9,
            "outer": [torch.zeros(3)],
            "residuals": [None],
            "pending": [],
            "local": [torch.full((3,), float(rank)), torch.full((2, 2), 2.0 * rank)],
        }
        for rank in range(2)
    ]
    state = impl.resize_state(saved)
    torch.testing.assert_close(state["local"][0], torch.full((3,), 0.5), rtol=0, atol=0)
    torch.testing.assert_close(state["local"][1], torch.full((2, 2), 1.0), rtol=0, atol=0)
    assert saved[0]["local"][0].sum() == 0  # the saved states are left as they were


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: the side stream, the exchange thread and pinned host memory (offload) against the same reference.


def _train_on_cuda(rank: int, world_size: int, kwargs: dict, steps: int) -> dict:
    device = torch.device("cuda", rank)
    model = make_model().to(device)
    optimizer = inner_optimizer(model)
    ddp = BaguaDistributedDataParallel(model, [optimizer], Algorithm.init("diloco", **kwargs))
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = batch_for(rank, step)
        nn.functional.mse_loss(ddp(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
    ddp(batch_for(rank, 10_000)[0].to(device))  # the next step's forward closes the last step: its boundary runs
    impl = ddp.bagua_algorithm_impl
    assert isinstance(impl, DiLoCoImpl)
    result = {
        "weights": flat(list(model.parameters())).cpu(),
        "outer": [f.outer.detach().cpu().clone() for f in impl.fragments],
        "outer_pinned": [f.outer.is_pinned() for f in impl.fragments] if kwargs.get("offload") else None,
        "syncs": impl.stats.syncs,
    }
    ddp.close()
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize(("quantization", "atol"), [(None, 1e-5), ("uint8", 2e-3)])
def test_streamed_diloco_on_one_gpu_matches_the_reference(offload, quantization, atol):
    kwargs = {
        "sync_every": 4,
        "fragments": 2,
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.25,
        "quantization": quantization,
        "offload": offload,
        **FLAT,
    }
    (result,) = run_processes(_train_on_cuda, 1, kwargs, 9, backend="nccl")
    assert result["syncs"] >= 4
    if offload:
        assert all(result["outer_pinned"]), "offload keeps θ_outer in pinned host memory"
    expected = reference(1, 9, **kwargs)
    torch.testing.assert_close(result["weights"], expected["weights"][0], rtol=1e-4, atol=atol)
    for got, want in zip(result["outer"], expected["outer"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)
