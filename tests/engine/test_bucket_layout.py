"""A wrapper resumed from ``bagua_state_dict`` replays the saved gradient buckets on its all-in-one first step."""

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, BucketLayout, QAdamOptimizer
from tests.distributed import run_processes

EXACT = {"rtol": 0, "atol": 0}
STEPS, SAVED_AT = 5, 3
# Small enough for several buckets once torch has rebuilt them after the first step.
BUCKET_CAP_MB = 0.004


class HeadFirst(nn.Module):
    """A network whose head is registered before the layers that run first, as in many real models.

    torch's all-in-one first bucket follows registration order; the buckets it rebuilds follow the order in
    which gradients become ready. They differ here, so the first step of a new wrapper rounds unlike later ones.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.head = nn.Linear(48, 1)
        self.body = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(inputs))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(8, 16, generator=generator)
    return inputs.to(_device()), inputs.sum(dim=1, keepdim=True).cos().to(_device())


def _model() -> nn.Module:
    return HeadFirst().to(_device())


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "qadam":
        return QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _wrap(algorithm: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> BaguaDistributedDataParallel:
    return BaguaDistributedDataParallel(
        model, [optimizer], Algorithm.init(algorithm, hierarchical=False), bucket_cap_mb=BUCKET_CAP_MB
    )


def _train(wrapped: BaguaDistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        inputs, targets = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(inputs), targets).backward()
        optimizer.step()


def _resume_and_finish(rank: int, algorithm: str, saved: dict, bagua_state: dict) -> dict[str, torch.Tensor]:
    model = _model()
    model.load_state_dict(saved["model"])
    optimizer = _optimizer(algorithm, model)
    optimizer.load_state_dict(saved["optimizer"])
    wrapped = _wrap(algorithm, model, optimizer)
    wrapped.load_bagua_state_dict(bagua_state)
    _train(wrapped, optimizer, rank, range(SAVED_AT, STEPS))
    wrapped.close()
    return _cpu(model.state_dict())


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def resume_in_a_new_wrapper(rank: int, world_size: int, algorithm: str) -> dict:
    model = _model()
    optimizer = _optimizer(algorithm, model)
    wrapped = _wrap(algorithm, model, optimizer)
    _train(wrapped, optimizer, rank, range(STEPS))
    uninterrupted = _cpu(model.state_dict())
    wrapped.close()

    model = _model()
    optimizer = _optimizer(algorithm, model)
    wrapped = _wrap(algorithm, model, optimizer)
    _train(wrapped, optimizer, rank, range(SAVED_AT))
    saved = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "bagua": wrapped.bagua_state_dict()}
    )
    wrapped.close()

    first_bucket = [name for name, _ in reversed(list(model.named_parameters()))]
    without_layout = {key: value for key, value in saved["bagua"].items() if key != "bucket_layout"}
    return {
        "uninterrupted": uninterrupted,
        "resumed": _resume_and_finish(rank, algorithm, saved, saved["bagua"]),
        "resumed_without_layout": _resume_and_finish(rank, algorithm, saved, without_layout),
        "layout": saved["bagua"]["bucket_layout"],
        "registration_order_reversed": first_bucket,
    }


@pytest.mark.parametrize("algorithm", ["bytegrad", "qadam"])
def test_resumed_wrapper_replays_the_saved_buckets_and_ends_bit_exact(algorithm):
    results = run_processes(resume_in_a_new_wrapper, 2, algorithm)
    for rank, result in enumerate(results):
        layout = result["layout"]
        assert len(layout) > 1, f"rank {rank}: {layout}"
        assert sorted(n for bucket in layout for n in bucket) == sorted(result["registration_order_reversed"])
        # The rebuilt buckets do not follow registration order: a fresh first bucket would lay gradients out otherwise.
        assert [n for bucket in layout for n in bucket] != result["registration_order_reversed"]
        torch.testing.assert_close(result["resumed"], result["uninterrupted"], **EXACT, msg=f"rank {rank}")
        # Without the layout the first resumed step rounds in other chunks: close, but not the same run.
        differs = any(
            not torch.equal(result["resumed_without_layout"][name], result["uninterrupted"][name])
            for name in result["uninterrupted"]
        )
        assert differs, f"rank {rank}: the layout made no difference, so this test cannot tell replay from none"
    assert results[0]["layout"] == results[1]["layout"]


@pytest.mark.gpu
def test_replay_on_cuda_ends_bit_exact():
    # One NCCL rank: the codec still cuts each bucket into a chunk of its own range, so the layout decides rounding.
    (result,) = run_processes(resume_in_a_new_wrapper, 1, "bytegrad", backend="nccl")
    assert len(result["layout"]) > 1
    torch.testing.assert_close(result["resumed"], result["uninterrupted"], **EXACT)
    assert any(
        not torch.equal(result["resumed_without_layout"][k], result["uninterrupted"][k]) for k in result["resumed"]
    )


class _AllInOneBucket:
    """The all-in-one first bucket of a new wrapper, as DDP's reducer hands it to the hook."""

    def __init__(self, parameters: list[nn.Parameter], buffer: torch.Tensor) -> None:
        self._parameters = parameters
        self._buffer = buffer
        pieces = buffer.split([p.numel() for p in parameters])
        self._gradients = [piece.view_as(p) for piece, p in zip(pieces, parameters, strict=True)]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients


def _all_reduce_hook(_: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # gradient_allreduce's flat path: an asynchronous all-reduce whose future DDP's reducer waits on.
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda future: future.value()[0])


def replay_while_backward_reuses_memory(rank: int, world_size: int) -> list[float]:
    device = _device()
    numel = 1 << 22
    parameters = [nn.Parameter(torch.empty(numel, device=device)) for _ in range(2)]
    layout = BucketLayout([("a", parameters[0]), ("b", parameters[1])])
    layout.restore([["a"], ["b"]])
    hook = layout.wrap_hook(_all_reduce_hook)
    # Registration order is the reverse of the saved one, so the all-in-one bucket is cut into the saved two.
    halves = [torch.full((numel,), value + rank, device=device) for value in (2.0, 1.0)]
    buffer = torch.cat(halves)
    bucket = _AllInOneBucket([parameters[1], parameters[0]], buffer)
    if rank == 1:
        torch.cuda._sleep(1_000_000_000)  # the peer's collectives start late, so rank 0's complete late
    future = hook(None, bucket)  # type: ignore[arg-type]
    # What backward goes on to do meanwhile: allocate and write memory of the sizes the replay lets go.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        scratch = [torch.full((numel,), -1e6, device=device) for _ in range(4)]
        del scratch
        time.sleep(0.002)
    result = future.wait()
    torch.cuda.synchronize(device)
    return result.view(2, numel).unique(dim=1).flatten().tolist()


@pytest.mark.gpu(count=2)
def test_replay_keeps_its_parts_until_their_collectives_and_copies_are_done():
    # Rank 0 holds (2, 1) and rank 1 (3, 2) per parameter in the all-in-one bucket: the sums are (5, 3).
    assert run_processes(replay_while_backward_reuses_memory, 2, backend="nccl") == [[5.0, 3.0], [5.0, 3.0]]


def test_restore_refuses_a_layout_of_another_model_naming_the_parameters():
    model = HeadFirst()
    layout = BucketLayout(list(model.named_parameters()))
    with pytest.raises(ValueError, match=r"unknown: \['encoder.weight'\], missing: \['head.bias'\]"):
        layout.restore(
            [["encoder.weight", "head.weight"], ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]]
        )
    assert layout.buckets == []
