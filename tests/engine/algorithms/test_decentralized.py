"""``decentralized`` (D-PSGD) on real Gloo processes, step by step against a single-process simulation of the spec."""

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_bagua.engine import BaguaDistributedDataParallel, CommunicationCounter, NodeLayout
from lightning_bagua.engine.algorithms.base import Algorithm, AlgorithmContext
from lightning_bagua.engine.algorithms.decentralized import DecentralizedAlgorithm, shift_one_peer
from lightning_bagua.engine.communication import CommunicationGroups, OrderedExecutor
from tests.distributed import run_processes

STEPS = 4
BATCH = 8
FEATURES = 12
LR = 0.1
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def make_model() -> nn.Module:
    torch.manual_seed(4321)
    return nn.Sequential(nn.Linear(FEATURES, 24), nn.Tanh(), nn.Linear(24, 1))


def batch_for(rank: int, forward_pass: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7919 * forward_pass + rank)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in make_model().parameters())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------------------------
# The reference: n replicas in one process, the spec's math written out on flat weight vectors.


def spec_partner(rank: int, round_index: int, n: int) -> int:
    # Section 6, verbatim: r < n/2 pairs with ((t + r) mod ceil(n/2)) + n/2; r >= n/2 with (r - n/2 - t) mod (n/2).
    if rank < n // 2:
        return (round_index + rank) % -(-n // 2) + n // 2
    return (rank - n // 2 - round_index) % (n // 2)


def mix_all(x: list[torch.Tensor], round_index: int, ranks_per_node: int) -> list[torch.Tensor]:
    mean = torch.stack(x).mean(dim=0)  # node averages of equal-sized nodes average to the global average
    return [mean.clone() for _ in x]


def mix_shift_one(x: list[torch.Tensor], round_index: int, ranks_per_node: int) -> list[torch.Tensor]:
    # Each node (a single rank when flat) contributes its average; paired nodes meet halfway.
    nodes = [torch.stack(x[i : i + ranks_per_node]).mean(dim=0) for i in range(0, len(x), ranks_per_node)]
    mixed = [(nodes[j] + nodes[spec_partner(j, round_index, len(nodes))]) / 2 for j in range(len(nodes))]
    return [mixed[r // ranks_per_node] for r in range(len(x))]


MIXING: dict[str, Callable[[list[torch.Tensor], int, int], list[torch.Tensor]]] = {
    "all": mix_all,
    "shift_one": mix_shift_one,
    "none": lambda x, round_index, ranks_per_node: x,  # local SGD: what a broken exchange would give
}


def simulate(
    world_size: int, mode: str, ranks_per_node: int = 1, interval: int = 1, accumulate: int = 1, steps: int = STEPS
) -> list[list[dict[str, torch.Tensor]]]:
    """Return, per step, every replica's parameters after ``x_r <- (W x)_r - lr * g_r(x_r)``."""
    replicas = [make_model() for _ in range(world_size)]
    names = [name for name, _ in replicas[0].named_parameters()]
    history = []
    rounds = 0
    for step in range(steps):
        passes = range(step * accumulate, (step + 1) * accumulate)
        gradients = []
        for rank, replica in enumerate(replicas):
            replica.zero_grad()
            for forward_pass in passes:
                inputs, targets = batch_for(rank, forward_pass)
                (nn.functional.mse_loss(replica(inputs), targets) / accumulate).backward()
            gradients.append(torch.cat([p.grad.reshape(-1) for p in replica.parameters()]))
        weights = [torch.cat([p.detach().reshape(-1) for p in replica.parameters()]) for replica in replicas]
        # The documented rule: a step mixes when any of its forward passes is due.
        if any(forward_pass % interval == 0 for forward_pass in passes):
            weights = MIXING[mode](weights, rounds, ranks_per_node)
            rounds += 1
        for replica, x, g in zip(replicas, weights, gradients, strict=True):
            torch.nn.utils.vector_to_parameters(x - LR * g, replica.parameters())
        history.append([dict(zip(names, (p.detach().clone() for p in r.parameters()), strict=True)) for r in replicas])
    return history


def assert_matches(results: list[dict], reference: list[list[dict[str, torch.Tensor]]]) -> None:
    for rank, result in enumerate(results):
        for step, state in enumerate(result["states"]):
            torch.testing.assert_close(state, reference[step][rank], **TOLERANCE, msg=f"rank {rank}, step {step}")


# ----------------------------------------------------------------------------------------------------------------
# What each rank runs.


def train(
    rank: int,
    world_size: int,
    algorithm_kwargs: dict,
    ranks_per_node: int | None = None,
    accumulate: int = 1,
    steps: int = STEPS,
    cuda: bool = False,
    closure: bool = False,
    reads: str = "",
) -> dict:
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = BaguaDistributedDataParallel(
        model,
        [optimizer],
        DecentralizedAlgorithm(**algorithm_kwargs),
        ranks_per_node=ranks_per_node,
        device_ids=[rank] if cuda else None,
    )
    states = []
    for step in range(steps):
        if closure:
            # As Lightning drives it: step() runs its pre-step hooks first, then forward and backward.
            def forward_backward(step: int = step) -> torch.Tensor:
                optimizer.zero_grad()
                inputs, targets = (t.to(device) for t in batch_for(rank, step))
                loss = nn.functional.mse_loss(ddp(inputs), targets)
                loss.backward()
                return loss

            optimizer.step(forward_backward)
            states.append(snapshot(model))
            continue
        if reads == "forward_only":
            # A training-mode pass that no backward follows (SWA's batch-norm pass), then a checkpoint-style read
            # while its exchange is in flight: the exchange is waited for and dropped, the weights stay as they are.
            ddp(batch_for(rank, 1000 + step)[0].to(device))
            saved_before = snapshot(model)
            ddp.bagua_state_dict()
            torch.testing.assert_close(snapshot(model), saved_before, rtol=0, atol=0)
        optimizer.zero_grad()
        for micro in range(accumulate):
            inputs, targets = (t.to(device) for t in batch_for(rank, step * accumulate + micro))
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(ddp(inputs), targets) / accumulate
                if reads == "mid_step":
                    # Read between forward and backward: waits for the exchange, which backward still applies.
                    ddp.bagua_state_dict()
                    model.state_dict()
                loss.backward()
        optimizer.step()
        states.append(snapshot(model))
    with torch.no_grad():  # evaluation passes neither count nor communicate
        ddp.eval()
        ddp(batch_for(rank, 0)[0].to(device))
    result = {
        "states": states,
        "bytes_by_op": ddp.communication_counter.bytes_by_op,
        "calls": ddp.communication_counter.calls,
        "hierarchical": ddp.communication_groups.is_hierarchical,
    }
    ddp.close()
    return result


# ----------------------------------------------------------------------------------------------------------------
# The shift_one schedule.


def test_shift_one_schedule_matches_the_spec_tables():
    assert [[shift_one_peer(r, k, 2) for r in range(2)] for k in range(3)] == [[1, 0]] * 3
    assert [[shift_one_peer(r, k, 4) for r in range(4)] for k in range(3)] == [
        [2, 3, 0, 1],
        [3, 2, 1, 0],
        [2, 3, 0, 1],
    ]
    assert [[shift_one_peer(r, k, 6) for r in range(6)] for k in range(4)] == [
        [3, 4, 5, 0, 1, 2],
        [4, 5, 3, 2, 0, 1],
        [5, 3, 4, 1, 2, 0],
        [3, 4, 5, 0, 1, 2],
    ]


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_shift_one_schedule_is_a_matching_between_halves_that_meets_everyone(n):
    half = n // 2
    met: dict[int, set[int]] = {r: set() for r in range(half)}
    for k in range(half):
        partners = [shift_one_peer(r, k, n) for r in range(n)]
        assert partners == [spec_partner(r, k, n) for r in range(n)]
        for r, p in enumerate(partners):
            assert partners[p] == r, f"round {k}: {r} -> {p} is not symmetric"
            assert (r < half) != (p < half), f"round {k}: {r} and {p} are in the same half"
        for r in range(half):
            met[r].add(partners[r])
    # Over n/2 consecutive rounds every lower rank meets every upper rank once.
    assert all(partners == set(range(half, n)) for partners in met.values())


def test_shift_one_schedule_rejects_an_odd_size():
    with pytest.raises(ValueError, match="must be even, got 5"):
        shift_one_peer(0, 0, 5)


# ----------------------------------------------------------------------------------------------------------------
# Training on real processes against the simulation.


@pytest.mark.parametrize(("world_size", "mode"), [(2, "all"), (4, "all"), (2, "shift_one"), (4, "shift_one")])
def test_flat_matches_the_simulation_step_by_step(world_size, mode):
    results = run_processes(train, world_size, {"peer_selection_mode": mode, "hierarchical": False})
    assert_matches(results, simulate(world_size, mode))
    # Weights are mixed, gradients are not: replicas differ after their local steps.
    assert not torch.equal(results[0]["states"][-1]["0.weight"], results[1]["states"][-1]["0.weight"])
    with pytest.raises(AssertionError):
        assert_matches(results, simulate(world_size, "none"))
    op = "all_reduce" if mode == "all" else "send"
    for result in results:
        # One flat exchange of every parameter per step, and no gradient bytes at all.
        assert result["bytes_by_op"] == {op: STEPS * param_bytes()}
        assert result["calls"] == {op: STEPS}
        assert not result["hierarchical"]


def test_communication_interval_mixes_only_on_due_steps():
    results = run_processes(train, 2, {"communication_interval": 2, "hierarchical": False}, None, 1, 5)
    assert_matches(results, simulate(2, "all", interval=2, steps=5))
    assert results[0]["calls"] == {"all_reduce": 3}  # steps 0, 2, 4
    assert results[0]["bytes_by_op"] == {"all_reduce": 3 * param_bytes()}
    with pytest.raises(AssertionError):
        assert_matches(results, simulate(2, "all", interval=1, steps=5))


@pytest.mark.parametrize(
    ("interval", "exchanges"),
    # accumulate=2 runs passes (0,1) (2,3) (4,5) (6,7) (8,9); interval 3 is due at 0, 3, 6, 9 -> steps 0, 1, 3, 4.
    [(1, 5), (3, 4)],
)
def test_accumulating_passes_count_but_exchange_once_on_the_synchronizing_pass(interval, exchanges):
    results = run_processes(
        train,
        2,
        {"communication_interval": interval, "peer_selection_mode": "shift_one", "hierarchical": False},
        None,
        2,
        5,
    )
    assert_matches(results, simulate(2, "shift_one", interval=interval, accumulate=2, steps=5))
    assert results[0]["calls"] == {"send": exchanges}


@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_hierarchical_two_nodes_of_two_matches_the_simulation(mode):
    results = run_processes(train, 4, {"peer_selection_mode": mode}, 2)
    assert_matches(results, simulate(4, mode, ranks_per_node=2))
    if mode == "shift_one":  # two nodes pair with each other: nothing like flat shift_one over 4 ranks
        with pytest.raises(AssertionError):
            assert_matches(results, simulate(4, mode))
    total = STEPS * param_bytes()
    for rank, result in enumerate(results):
        assert result["hierarchical"]
        expected = {"reduce": total, "broadcast": total}
        if rank % 2 == 0:  # leaders alone talk between nodes
            expected["all_reduce" if mode == "all" else "send"] = total
        assert result["bytes_by_op"] == expected, f"rank {rank}"


def test_hierarchical_all_on_one_node_averages_the_node():
    # Bagua's rule: the node average among one leader is the average of all ranks.
    results = run_processes(train, 2, {"peer_selection_mode": "all", "hierarchical": True})
    assert not results[0]["hierarchical"]
    assert_matches(results, simulate(2, "all"))
    assert results[0]["bytes_by_op"] == {"all_reduce": STEPS * param_bytes()}


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_nccl_matches_the_simulation(mode):
    # One node of two GPUs: shift_one pairs ranks only with hierarchical=False (hierarchical pairs nodes).
    kwargs = {"peer_selection_mode": mode, "hierarchical": False}
    results = run_processes(train, 2, kwargs, None, 1, STEPS, True, backend="nccl")
    for rank, result in enumerate(results):
        for step, state in enumerate(result["states"]):
            torch.testing.assert_close(state, simulate(2, mode)[step][rank], rtol=1e-4, atol=1e-5)
    assert results[0]["bytes_by_op"] == {("all_reduce" if mode == "all" else "send"): STEPS * param_bytes()}


def train_with_a_parameter_left_out(rank: int, world_size: int) -> dict:
    outcome = {}
    model = make_model()
    optimizer = torch.optim.SGD([p for name, p in model.named_parameters() if name != "2.bias"], lr=LR)
    try:
        BaguaDistributedDataParallel(model, [optimizer], DecentralizedAlgorithm(hierarchical=False))
    except ValueError as error:
        outcome["error"] = str(error)
    model._bagua_params_and_buffers_to_ignore = ["2.bias"]
    ddp = BaguaDistributedDataParallel(model, [optimizer], DecentralizedAlgorithm(hierarchical=False))
    inputs, targets = batch_for(rank, 0)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    optimizer.step()
    outcome["bytes_by_op"] = ddp.communication_counter.bytes_by_op
    ddp.close()
    return outcome


def test_a_parameter_no_optimizer_drives_fails_at_wrapping_unless_ignored():
    result = run_processes(train_with_a_parameter_left_out, 2)[0]
    assert "none updates 2.bias" in result["error"]
    assert "_bagua_params_and_buffers_to_ignore" in result["error"]
    assert result["bytes_by_op"] == {"all_reduce": param_bytes() - 4}  # the ignored bias is not exchanged


# ----------------------------------------------------------------------------------------------------------------
# Errors.


def wrap_odd_shift_one(rank: int, world_size: int, ranks_per_node: int) -> str:
    try:
        BaguaDistributedDataParallel(
            make_model(),
            algorithm=DecentralizedAlgorithm(peer_selection_mode="shift_one"),
            ranks_per_node=ranks_per_node,
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_odd_number_of_ranks_with_shift_one_fails_at_wrapping():
    message = run_processes(wrap_odd_shift_one, 3, 1)[0]
    assert "even number" in message
    assert "3 ranks" in message
    assert "peer_selection_mode='all'" in message


def fake_context(
    world_size: int, ranks_per_node: int, model: nn.Module | None = None, hierarchical: bool = True
) -> AlgorithmContext:
    # Enough of a context to reify without a process group: the checks run before anything communicates.
    layout = NodeLayout(world_size, ranks_per_node)
    two_level = hierarchical and layout.num_nodes > 1 and ranks_per_node > 1
    groups = CommunicationGroups(layout, 0, list(range(world_size)), None, object() if two_level else None)  # type: ignore[arg-type]
    named = tuple((model or make_model()).named_parameters())
    return AlgorithmContext(
        groups, CommunicationCounter(), OrderedExecutor(torch.device("cpu")), torch.device("cpu"), named
    )


def test_odd_number_of_nodes_with_shift_one_names_nodes_and_the_fix():
    algorithm = DecentralizedAlgorithm(peer_selection_mode="shift_one")
    with pytest.raises(ValueError, match=r"3 nodes \(hierarchical=True pairs nodes.*hierarchical=False"):
        algorithm.reify(fake_context(6, 2))
    # The same 6 ranks flat are an even number: no error.
    DecentralizedAlgorithm(peer_selection_mode="shift_one", hierarchical=False).reify(fake_context(6, 2, None, False))


def test_hierarchical_shift_one_on_one_node_is_refused_as_in_bagua():
    # Bagua pairs nodes, and one node cannot pair; pairing its ranks instead would be another algorithm.
    algorithm = DecentralizedAlgorithm(peer_selection_mode="shift_one", hierarchical=True)
    with pytest.raises(ValueError, match=r"pairs nodes, but all 2 ranks are on one node\. Pass hierarchical=False"):
        algorithm.reify(fake_context(2, 2))
    DecentralizedAlgorithm(peer_selection_mode="shift_one", hierarchical=False).reify(fake_context(2, 2, None, False))


def test_parameters_no_optimizer_drives_are_named_with_the_hint():
    model = make_model()
    impl = DecentralizedAlgorithm().reify(fake_context(2, 2, model))
    partial = torch.optim.SGD(model[0].parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"2\.weight, 2\.bias.*_bagua_params_and_buffers_to_ignore"):
        impl.bind_optimizers([partial])
    impl.bind_optimizers([])  # nothing bound yet: nothing to check
    impl.bind_optimizers([partial, torch.optim.SGD(model[2].parameters(), lr=LR)])  # together they cover all


@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_optimizer_step_with_a_closure_matches_the_simulation(mode):
    """The mixing lands at the end of backward, so it is right however the step is driven."""
    results = run_processes(train, 2, {"peer_selection_mode": mode, "hierarchical": False}, None, 1, STEPS, False, True)
    assert_matches(results, simulate(2, mode))


@pytest.mark.parametrize("mode", ["all", "shift_one"])
@pytest.mark.parametrize("reads", ["mid_step", "forward_only"])
def test_state_reads_while_an_exchange_is_in_flight_wait_for_it_and_change_nothing(mode, reads):
    """A read mid-step (a callback, a checkpoint) or after a forward-only pass sees a consistent state.

    Mid-step, the waited-for exchange is still copied in at the end of backward; after a forward-only pass it is
    dropped, as the next exchange would drop it. Either way training matches the simulation without the reads.
    """
    kwargs = {"peer_selection_mode": mode, "hierarchical": False}
    results = run_processes(train, 2, kwargs, None, 1, STEPS, False, False, reads)
    # shift_one pairs the two ranks whatever the round, so the dropped rounds do not change the partner.
    assert_matches(results, simulate(2, mode))


def test_training_without_a_bound_optimizer_is_an_error():
    impl = DecentralizedAlgorithm().reify(fake_context(2, 2))
    with pytest.raises(RuntimeError, match="no optimizer is bound"):
        impl.on_forward_start(True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"peer_selection_mode": "ring"}, ValueError, r"one of 'all', 'shift_one', got 'ring'"),
        ({"peer_selection_mode": 1}, TypeError, "`peer_selection_mode` must be a str"),
        ({"communication_interval": 0}, ValueError, "at least 1, got 0"),
        ({"communication_interval": 2.0}, TypeError, "`communication_interval` must be an int"),
        ({"communication_interval": True}, TypeError, "`communication_interval` must be an int"),
        ({"hierarchical": "yes"}, TypeError, "`hierarchical` must be a bool"),
        ({"average": True}, TypeError, "Unknown keyword argument.*'average'"),
    ],
)
def test_bad_keywords_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        Algorithm.init("decentralized", **kwargs)


def test_registered_with_the_spec_defaults():
    algorithm = Algorithm.init("decentralized")
    assert isinstance(algorithm, DecentralizedAlgorithm)
    assert repr(algorithm) == (
        "DecentralizedAlgorithm(hierarchical=True, peer_selection_mode='all', communication_interval=1)"
    )
