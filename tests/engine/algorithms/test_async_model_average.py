"""``async`` (asynchronous model averaging) on real Gloo processes: warm-up, one round's math, life cycle, state."""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import AsyncModelAverageAlgorithm, BaguaDistributedDataParallel
from lightning_bagua.engine.algorithms.async_model_average import THREAD_NAME
from lightning_bagua.engine.algorithms.base import Algorithm, available_algorithms
from tests.distributed import run_processes

BATCH = 8
FEATURES = 12
LR = 0.1
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# Fast enough that the background loop runs many rounds in the short timed tests.
INTERVAL_MS = 5


def make_model() -> nn.Module:
    torch.manual_seed(4321)
    return nn.Sequential(nn.Linear(FEATURES, 24), nn.Tanh(), nn.Linear(24, 1))


def batch_for(rank: int, forward_pass: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7919 * forward_pass + rank)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def step(ddp: BaguaDistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int, index: int) -> None:
    optimizer.zero_grad()
    inputs, targets = batch_for(rank, index)
    nn.functional.mse_loss(ddp(inputs), targets).backward()
    optimizer.step()


def async_threads() -> int:
    return sum(thread.name == THREAD_NAME for thread in threading.enumerate())


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs) -> BaguaDistributedDataParallel:
    algorithm = AsyncModelAverageAlgorithm(**{"sync_interval_ms": INTERVAL_MS, **kwargs})
    return BaguaDistributedDataParallel(model, [optimizer], algorithm, gradient_as_bucket_view=True)


# ----------------------------------------------------------------------------------------------------------------
# Construction.


def test_registered_with_bagua_defaults():
    assert "async" in available_algorithms()
    algorithm = Algorithm.init("async")
    assert algorithm == AsyncModelAverageAlgorithm(peer_selection_mode="all", sync_interval_ms=500, warmup_steps=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"peer_selection_mode": "shift_one"}, ValueError, r"must be one of 'all' .*got 'shift_one'"),
        ({"sync_interval_ms": -1}, ValueError, r"`sync_interval_ms` must be at least 0, got -1"),
        ({"warmup_steps": -2}, ValueError, r"`warmup_steps` must be at least 0, got -2"),
        ({"warmup_steps": True}, TypeError, r"`warmup_steps` must be an int, got True"),
        ({"sync_interval_ms": 0.5}, TypeError, r"`sync_interval_ms` must be an int, got 0.5"),
        ({"hierarchical": True}, TypeError, r"Unknown keyword argument\(s\) 'hierarchical'"),
        ({"average_on_abort": 1}, TypeError, r"`average_on_abort` must be a bool, got 1"),
    ],
)
def test_bad_keywords_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        Algorithm.init("async", **kwargs)


def test_abort_and_resume_refuse_a_model_of_another_algorithm():
    with pytest.raises(TypeError, match="trains with the 'async' algorithm, got Linear"):
        AsyncModelAverageAlgorithm().abort(nn.Linear(1, 1))


# ----------------------------------------------------------------------------------------------------------------
# Warm-up equals gradient_allreduce.


def train_warmup(rank: int, algorithm: str, flatten: bool) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    algo = AsyncModelAverageAlgorithm(warmup_steps=3) if algorithm == "async" else algorithm
    ddp = BaguaDistributedDataParallel(model, [optimizer], algo, gradient_as_bucket_view=flatten)
    states = []
    for index in range(3):
        step(ddp, optimizer, rank, index)
        states.append(flat(model))
    threads = async_threads()
    ddp.close()
    return {"states": states, "threads": threads, "bytes": ddp.communication_counter.bytes_by_op}


def warmups(rank: int, world_size: int) -> dict:
    return {
        (algorithm, flatten): train_warmup(rank, algorithm, flatten)
        for algorithm in ("async", "gradient_allreduce")
        for flatten in (True, False)
    }


@pytest.mark.parametrize("flatten", [True, False])
def test_warmup_steps_equal_gradient_allreduce_exactly(processes, flatten):
    results = processes["warmup"]
    for rank in range(2):
        got, expected = results[rank][("async", flatten)], results[rank][("gradient_allreduce", flatten)]
        for ours, reference in zip(got["states"], expected["states"], strict=True):
            assert torch.equal(ours, reference)
        assert got["threads"] == 0  # still warming up: nothing runs in the background
        assert got["bytes"] == expected["bytes"]
    assert torch.equal(results[0][("async", flatten)]["states"][-1], results[1][("async", flatten)]["states"][-1])


# ----------------------------------------------------------------------------------------------------------------
# One averaging round, driven by hand: x <- x + avg(s) - s.


def gather(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


def one_round_by_hand(rank: int, world_size: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, warmup_steps=1)
    algorithm = ddp.bagua_algorithm
    algorithm.abort(ddp)  # during the warm-up: only keeps the loop from starting, so the test drives the rounds
    impl = ddp.bagua_algorithm_impl
    for index in range(3):  # one warm-up step, then two local ones: the replicas now differ
        step(ddp, optimizer, rank, index)
    before = flat(model)
    impl._snapshot()
    impl._reduce()
    snapshots = gather(flat(model), world_size)  # s of every rank (the weights did not move since the snapshot)
    step(ddp, optimizer, rank, 3)  # local progress between the all-reduce and the update
    progressed = flat(model)
    impl._apply()
    after_round = flat(model)
    threads = async_threads()
    algorithm.abort(ddp)  # idempotent: averaging is not running
    ddp.close()
    return {
        "before": before,
        "snapshots": snapshots,
        "progressed": progressed,
        "after_round": after_round,
        "threads": threads,
        "rounds": impl.rounds,
    }


def test_a_round_applies_the_average_of_the_snapshots_minus_the_own_snapshot(processes):
    results = processes["round"]
    snapshots = results[0]["snapshots"]
    assert torch.equal(snapshots, results[1]["snapshots"])
    assert not torch.allclose(snapshots[0], snapshots[1])  # local steps made the replicas differ
    for rank, result in enumerate(results):
        assert torch.equal(result["before"], snapshots[rank])
        expected = result["progressed"] + snapshots.mean(dim=0) - snapshots[rank]
        torch.testing.assert_close(result["after_round"], expected, **TOLERANCE)
        # The local step taken during the round is kept, not overwritten by the average.
        assert not torch.allclose(result["after_round"], snapshots.mean(dim=0), **TOLERANCE)
        assert result["threads"] == 0
        assert result["rounds"] == 1


# ----------------------------------------------------------------------------------------------------------------
# The background loop: life cycle, slow ranks, teardown.


def life_cycle(rank: int, world_size: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, warmup_steps=2)
    algorithm = ddp.bagua_algorithm
    impl = ddp.bagua_algorithm_impl
    seen = {}
    algorithm.resume(ddp)  # during the warm-up: nothing starts yet
    seen["warmup"] = async_threads()
    index = 0
    for index in range(3):  # the third pass is the first after the warm-up: the loop starts
        step(ddp, optimizer, rank, index)
    seen["started"] = async_threads()
    algorithm.resume(ddp)  # running already: no second thread
    seen["resumed_twice"] = async_threads()
    deadline = time.monotonic() + 30
    while impl.rounds < 3 and time.monotonic() < deadline:
        index += 1
        step(ddp, optimizer, rank, index + rank)  # different data per rank keeps the replicas apart
    # Between steps, what a callback or a checkpoint reads must not move under it: rounds wait for the next step.
    idle_before, rounds_before = flat(model), impl.rounds
    time.sleep(40 * INTERVAL_MS / 1000)  # many intervals, in which a round would otherwise land
    idle = {"unchanged": torch.equal(flat(model), idle_before), "rounds": impl.rounds - rounds_before}
    algorithm.abort(ddp)
    seen["aborted"] = async_threads()
    averaged = flat(model)
    algorithm.abort(ddp)  # idempotent: no collective, no change
    seen["aborted_twice"] = async_threads()
    step(ddp, optimizer, rank, 100 + rank)  # aborted: this step is local and starts nothing
    seen["after_aborted_step"] = async_threads()
    algorithm.resume(ddp)
    algorithm.resume(ddp)
    seen["resumed_again"] = async_threads()
    step(ddp, optimizer, rank, 200 + rank)
    ddp.close()  # aborts (averages once more) and ends the thread
    seen["closed"] = async_threads()
    return {"seen": seen, "averaged": averaged, "final": flat(model), "rounds": impl.rounds, "idle": idle}


def test_abort_and_resume_are_idempotent_and_close_ends_the_thread(processes):
    results = processes["life_cycle"]
    for result in results:
        assert result["seen"] == {
            "warmup": 0,
            "started": 1,
            "resumed_twice": 1,
            "aborted": 0,
            "aborted_twice": 0,
            "after_aborted_step": 0,
            "resumed_again": 1,
            "closed": 0,
        }
        assert result["rounds"] >= 5  # three in the loop at least, and the final round of each abort
        assert result["idle"] == {"unchanged": True, "rounds": 0}
    # abort ends with a plain average, so the replicas agree bit for bit.
    assert torch.equal(results[0]["averaged"], results[1]["averaged"])
    assert torch.equal(results[0]["final"], results[1]["final"])


def on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank: an all-reduce on the default group, which the averaging never uses."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def weights_written_before_abort(rank: int, world_size: int) -> dict:
    """A round waits to apply its update while the caller rewrites the weights between steps, then aborts."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, warmup_steps=1)
    impl = ddp.bagua_algorithm_impl
    waiting = threading.Event()  # set while the thread has a reduced round and waits for the weights to apply it
    apply = impl._apply

    def apply_when_let_go(exact: bool = False) -> None:
        waiting.set()
        try:
            apply(exact)
        finally:
            waiting.clear()

    impl._apply = apply_when_let_go
    step(ddp, optimizer, rank, 0)  # the warm-up step: both ranks meet here
    index = 1
    # Between steps the training thread holds the weights, so a thread seen waiting now applies only after abort.
    # The ranks stop stepping together, each with its thread waiting: a rank that stopped alone left its peer
    # stepping, whose thread then applied that round and opened the next one, and the peer never saw its thread
    # wait again (a hang, once in seven suite runs).
    while not on_every_rank(waiting.wait(0.2)):
        step(ddp, optimizer, rank, index + 1000 * rank)  # different data per rank keeps the replicas apart
        index += 1
    pending = waiting.is_set()
    with torch.no_grad():  # what a callback's on_train_end may do: write final weights, the same on every rank
        for parameter in model.parameters():
            parameter.fill_(0.25)
    rounds = impl.rounds
    ddp.bagua_algorithm.abort(ddp)
    final = flat(model)
    ddp.close()
    return {"pending": pending, "final": final, "rounds": impl.rounds - rounds}


def test_abort_drops_a_round_taken_before_the_weights_were_rewritten(processes):
    for result in processes["written_before_abort"]:
        assert result["pending"]
        # The stale round's collective ran and counts, but its x += a/n - s was not added: only the abort's exact
        # average (of equal weights) changed the weights.
        assert result["rounds"] == 2
        torch.testing.assert_close(result["final"], torch.full_like(result["final"], 0.25), rtol=0, atol=0)


def slow_and_fast(rank: int, world_size: int, seconds: float = 3.0) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, warmup_steps=1)
    impl = ddp.bagua_algorithm_impl
    step(ddp, optimizer, rank, 0)  # the warm-up step: both ranks meet here
    steps = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        optimizer.zero_grad()
        inputs, targets = batch_for(rank, steps + 1)
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        if rank == 1:
            # A slow rank, inside its step, holding its weights' lock. Slow enough that the fast rank, at twice
            # its steps, has 125 ms per step: a loaded CI machine (one stop ran the suite twice at once) stays
            # well inside that, so only a fast rank held back by the slow one fails.
            time.sleep(0.25)
        optimizer.step()
        steps += 1
    ddp.close()  # after the final average every rank has run the same rounds
    return {"steps": steps, "rounds": impl.rounds, "final": flat(model)}


def test_a_slow_rank_does_not_hold_back_a_fast_one(processes):
    fast, slow = processes["slow_and_fast"]
    assert slow["steps"] >= 1
    assert fast["steps"] > 2 * slow["steps"], (fast["steps"], slow["steps"])
    assert fast["rounds"] >= 2
    assert fast["rounds"] == slow["rounds"]  # rounds are collective: every rank runs the same number
    assert torch.equal(fast["final"], slow["final"])


def failing_peer(rank: int, world_size: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, warmup_steps=0)
    impl = ddp.bagua_algorithm_impl
    for index in range(2):  # DDP's second forward pass rebuilds its buckets, a collective: both ranks take it
        step(ddp, optimizer, rank, index)
    index = 2
    while impl.rounds < 2:  # rounds copy weights at step boundaries, so they advance as the ranks step
        step(ddp, optimizer, rank, index)
        index += 1
    outcome = "trained"
    if rank == 1:
        impl.stop_on_failure()  # what the strategy does on an exception: no barrier, peers are told
        outcome = "stopped"
    else:
        deadline = time.monotonic() + 60  # only a bound for a broken implementation: the error comes in a round
        try:
            while time.monotonic() < deadline:
                step(ddp, optimizer, rank, index)
                index += 1
        except RuntimeError as error:
            outcome = str(error)
    ddp.close()  # no collective left to wait for on either rank
    return {"outcome": outcome, "threads": async_threads()}


def test_a_failing_rank_stops_its_peers_instead_of_hanging_them(processes):
    healthy, failing = processes["failing_peer"]
    assert failing == {"outcome": "stopped", "threads": 0}
    assert "stopped because another rank failed" in healthy["outcome"]
    assert healthy["threads"] == 0


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint state: the warm-up counter resumes in the same phase.


def save_and_resume(rank: int, world_size: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, warmup_steps=4)
    for index in range(3):
        step(ddp, optimizer, rank, index)
    saved = ddp.bagua_state_dict()
    ddp.close()

    resumed = BaguaDistributedDataParallel(
        model, [optimizer], AsyncModelAverageAlgorithm(sync_interval_ms=INTERVAL_MS, warmup_steps=4)
    )
    resumed.load_bagua_state_dict(saved)
    step(resumed, optimizer, rank, 3)  # the fourth pass: still warm-up, gradients all-reduced
    in_warmup = flat(model)
    threads_in_warmup = async_threads()
    step(resumed, optimizer, rank, 4)  # the fifth: averaging starts
    threads_after = async_threads()
    state = resumed.bagua_state_dict()
    with pytest.raises(RuntimeError, match="abort"):
        resumed.load_bagua_state_dict(saved)
    resumed.close()
    with pytest.raises(ValueError, match="expects state with keys"):
        resumed.load_bagua_state_dict({"algorithm": "async", "state": {"steps": 3}})
    return {
        "saved": saved,
        "state": state,
        "in_warmup": in_warmup,
        "threads_in_warmup": threads_in_warmup,
        "threads_after": threads_after,
    }


def test_checkpoint_state_resumes_the_warmup_counter(processes):
    results = processes["checkpoint"]
    for result in results:
        assert result["saved"]["algorithm"] == "async"
        assert result["saved"]["state"] == {"forward_passes": 3, "rounds": 0}
        assert result["state"]["state"]["forward_passes"] == 5
        assert result["threads_in_warmup"] == 0
        assert result["threads_after"] == 1
    assert torch.equal(results[0]["in_warmup"], results[1]["in_warmup"])  # the resumed warm-up step all-reduced


# ----------------------------------------------------------------------------------------------------------------
# Every scenario above runs in one pair of processes (starting processes is what costs time here); each builds and
# closes its own wrapper, so they are independent. The failing-peer scenario leaves no collective behind: last.


def bagua_edges(rank: int, world_size: int) -> dict:
    """Bagua's rules at two edges: sync_interval_ms=0 never averages; abort just stops when asked to."""
    outcome: dict = {}
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = wrap(model, optimizer, sync_interval_ms=0)
    for index in range(4):
        step(ddp, optimizer, rank, index)
    time.sleep(0.1)
    outcome["never"] = {"rounds": ddp.bagua_algorithm_impl.rounds, "threads": async_threads()}
    outcome["never_weights"] = flat(model)
    ddp.bagua_algorithm.abort(ddp)
    ddp.close()
    for average_on_abort in (False, True):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        ddp = wrap(model, optimizer, average_on_abort=average_on_abort)
        for index in range(4):
            step(ddp, optimizer, rank, index)
        ddp.bagua_algorithm.abort(ddp)
        outcome[f"abort_{average_on_abort}"] = flat(model)
        ddp.close()
    return outcome


def test_bagua_edges_sync_interval_zero_never_averages_and_abort_can_just_stop(processes):
    results = processes["bagua_edges"]
    # sync_interval_ms=0: no thread, no round; the ranks trained on their own data and differ, as in Bagua.
    for result in results:
        assert result["never"] == {"rounds": 0, "threads": 0}
    assert not torch.equal(results[0]["never_weights"], results[1]["never_weights"])
    # average_on_abort=False: abort just stops, and the ranks keep the weights their last steps gave them (Bagua's
    # abort); the default averages once more, which leaves every rank with the same weights, bit for bit.
    assert not torch.equal(results[0]["abort_False"], results[1]["abort_False"])
    torch.testing.assert_close(results[0]["abort_True"], results[1]["abort_True"], rtol=0, atol=0)


SCENARIOS = {
    "warmup": warmups,
    "round": one_round_by_hand,
    "life_cycle": life_cycle,
    "written_before_abort": weights_written_before_abort,
    "checkpoint": save_and_resume,
    "slow_and_fast": slow_and_fast,
    "failing_peer": failing_peer,
    "bagua_edges": bagua_edges,
}


def run_scenarios(rank: int, world_size: int) -> dict:
    return {name: scenario(rank, world_size) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def processes() -> dict[str, list]:
    by_rank = run_processes(run_scenarios, 2, timeout=150)
    return {name: [result[name] for result in by_rank] for name in SCENARIOS}
