"""Bucket jobs replayed as CUDA graphs over NCCL on two GPUs (run on the device machine; skipped elsewhere)."""

import multiprocessing
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import Optimizer

from lightning_bagua.engine import BaguaDistributedDataParallel, LowRankAlgorithm
from lightning_bagua.engine.algorithms.bytegrad import ByteGradAlgorithm
from lightning_bagua.engine.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer
from lightning_bagua.engine.communication import CommunicationCounter
from tests.distributed import _child, assert_ranks_identical, free_port, run_processes
from tests.engine.test_data_parallel import batch_for, make_optimizer

pytestmark = pytest.mark.gpu(count=2)

STEPS = 6


def make_model() -> nn.Module:
    """Three buckets of a few KiB once DDP's reducer has rebuilt them: two replay as graphs, the last stays eager."""
    torch.manual_seed(1234)
    layers = [nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 1))


def wrap_flat_bytegrad(rank: int, **kwargs: Any) -> tuple[BaguaDistributedDataParallel, nn.Module, Optimizer]:
    """``bytegrad`` run flat on GPU ``rank``, with small buckets: its buckets replay as graphs from the third step."""
    model = make_model().to(torch.device("cuda", rank))
    optimizer = make_optimizer(model)
    algorithm = ByteGradAlgorithm(hierarchical=False)
    ddp = BaguaDistributedDataParallel(model, [optimizer], algorithm, device_ids=[rank], bucket_cap_mb=0.004, **kwargs)
    return ddp, model, optimizer


def train(
    rank: int,
    ddp: BaguaDistributedDataParallel,
    model: nn.Module,
    optimizer: Optimizer,
    steps: int,
    after_backward: Callable[[], None] = lambda: None,
    after_step: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Train ``steps`` steps on ``rank``'s batches, then close ``ddp``; return the weights and the graphs captured.

    ``after_backward`` sees each step's reduced gradients before the optimizer takes them, ``after_step`` the
    optimizer's state once it has.
    """
    device = torch.device("cuda", rank)
    for step in range(steps):
        inputs, targets = (t.to(device) for t in batch_for(rank, step))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        after_backward()
        optimizer.step()
        after_step()
    result = {
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "graphs": ddp._bagua_executor.graphs.captured,
    }
    ddp.close()
    return result


def assert_equal_step_by_step(graphed: list[dict], eager: list[dict], key: str) -> None:
    """Each rank's ``key`` tensors of every step are the same, bit for bit, in the graphed and the eager run."""
    for graphed_rank, eager_rank in zip(graphed, eager, strict=True):
        for got_step, want_step in zip(graphed_rank[key], eager_rank[key], strict=True):
            for got, want in zip(got_step, want_step, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def train_bytegrad(rank: int, world_size: int) -> dict:
    counter = CommunicationCounter()
    ddp, model, optimizer = wrap_flat_bytegrad(rank, communication_counter=counter)
    gradients, sent = [], []

    def record() -> None:
        gradients.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        sent.append(counter.totals())

    result = train(rank, ddp, model, optimizer, STEPS, after_backward=record)
    return {**result, "gradients": gradients, "totals": sent}


def test_bytegrad_replayed_as_cuda_graphs_matches_it_run_eagerly_bit_for_bit():
    """Compression and NCCL replayed from graphs give the eager run's gradients exactly, and count the same."""
    graphed = run_processes(train_bytegrad, 2, backend="nccl")
    eager = run_processes(train_bytegrad, 2, env={"BAGUA_CUDA_GRAPHS": "0"}, backend="nccl")
    assert_ranks_identical(graphed)
    # Every bucket but the step's last captured after its two eager calls (the one bucket of the first step, before
    # DDP's reducer rebuilt them, ran once and was not); the eager run captured nothing.
    assert graphed[0]["graphs"] == 2
    assert eager[0]["graphs"] == 0
    assert_equal_step_by_step(graphed, eager, "gradients")
    for rank in range(2):
        assert graphed[rank]["totals"] == eager[rank]["totals"]
    # Unreduced gradients would differ between the ranks, whose batches differ; replays that did nothing would too.
    for step in range(STEPS):
        for first, second in zip(graphed[0]["gradients"][step], graphed[1]["gradients"][step], strict=True):
            torch.testing.assert_close(first, second, rtol=0, atol=0)


QADAM_WARMUP = 2
QADAM_STEPS = 8


def train_qadam(rank: int, world_size: int) -> dict:
    model = make_model().to(torch.device("cuda", rank))
    optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=QADAM_WARMUP, weight_decay=0.01)
    algorithm = QAdamAlgorithm(optimizer, hierarchical=False)
    ddp = BaguaDistributedDataParallel(model, [optimizer], algorithm, device_ids=[rank], bucket_cap_mb=0.004)
    momenta = []

    def record() -> None:
        momenta.append([optimizer.state[p]["exp_avg"].detach().cpu().clone() for p in model.parameters()])

    result = train(rank, ddp, model, optimizer, QADAM_STEPS, after_step=record)
    return {**result, "momenta": momenta}


def test_qadam_momenta_exchanged_from_cuda_graphs_match_the_eager_run_bit_for_bit():
    """QAdam's compressed momentum exchange replayed from graphs gives the eager run's momenta and weights exactly."""
    graphed = run_processes(train_qadam, 2, backend="nccl")
    eager = run_processes(train_qadam, 2, env={"BAGUA_CUDA_GRAPHS": "0"}, backend="nccl")
    assert_ranks_identical(graphed)
    # The compressed phase starts at the second step, on the rebuilt three buckets: each but the last is captured
    # after its two eager calls.
    assert graphed[0]["graphs"] == 2
    assert eager[0]["graphs"] == 0
    assert_equal_step_by_step(graphed, eager, "momenta")
    for rank in range(2):
        for name, tensor in graphed[rank]["state"].items():
            torch.testing.assert_close(tensor, eager[rank]["state"][name], rtol=0, atol=0)
    # The averaged momenta are the same on both ranks, whose gradients differ: the replays exchanged them.
    for first, second in zip(graphed[0]["momenta"][-1], graphed[1]["momenta"][-1], strict=True):
        torch.testing.assert_close(first, second, rtol=0, atol=0)


PEER_TIMEOUT_S = 10


def wrap_to_lose_a_peer(algorithm: str, rank: int) -> tuple[BaguaDistributedDataParallel, Optimizer, Callable[[], int]]:
    """``algorithm`` on GPU ``rank`` with a short collective timeout, and a count of the graphs it has captured."""
    timeout = timedelta(seconds=PEER_TIMEOUT_S)
    if algorithm == "bytegrad":
        ddp, _, optimizer = wrap_flat_bytegrad(rank, timeout=timeout)
        return ddp, optimizer, lambda: ddp._bagua_executor.graphs.captured
    model = make_model().to(torch.device("cuda", rank))
    optimizer = make_optimizer(model)
    low_rank = LowRankAlgorithm(rank=2, warmup_steps=0, hierarchical=False, whole_step=True)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], low_rank, device_ids=[rank], bucket_cap_mb=0.004, timeout=timeout
    )
    return ddp, optimizer, lambda: ddp._bagua_impl.state._step_plan.graphs.captured


def lose_the_peer_once_graphed(rank: int, world_size: int, algorithm: str) -> dict:
    device = torch.device("cuda", rank)
    ddp, optimizer, captured = wrap_to_lose_a_peer(algorithm, rank)

    def step(index: int) -> None:
        inputs, targets = (t.to(device) for t in batch_for(rank, index))
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        torch.cuda.synchronize()

    for index in range(4):
        step(index)
    assert captured() > 0
    if rank == 1:
        time.sleep(240)  # gone, as far as rank 0 can tell; the test kills it
        return {}
    step(4)  # the replays wait for rank 1 for good: the eager collective between or after them must end this
    return {"finished": True}


# bytegrad: the step's last bucket stays eager; low_rank: the second all-gather, between the step's two graphs.
@pytest.mark.parametrize("algorithm", ["bytegrad", "low_rank"])
def test_a_peer_lost_during_graph_replays_ends_the_job_within_the_timeout(algorithm):
    """Replayed collectives escape NCCL's watchdog; an eager collective in every step lets it end the job."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_child, args=(lose_the_peer_once_graphed, rank, 2, port, "nccl", {}, (algorithm,), results)
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    start = time.monotonic()
    try:
        # Start-up and four steps take well under a minute; then the watchdog's timeout.
        processes[0].join(timeout=PEER_TIMEOUT_S + 110)
        assert not processes[0].is_alive(), f"rank 0 waits for its lost peer after {time.monotonic() - start:.0f} s"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
    assert processes[0].exitcode != 0, "rank 0 finished a step that its peer never joined"
