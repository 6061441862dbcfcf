"""``BucketGraphs``' decisions (eager, capture, replay) with a stand-in for CUDA graphs, on CPU."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_bagua.engine import _cuda_graphs
from lightning_bagua.engine._cuda_graphs import BucketGraphs
from lightning_bagua.engine.communication import CommunicationCounter


class RecordingGraph:
    """A stand-in for a CUDA graph: a job run while it captures registers its device work as ``kernels``."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.replays = 0
        self.capturing = False
        self.kernels: Callable[[], object] = lambda: None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.events.append(f"begin {capture_error_mode}")
        self.capturing = True

    def capture_end(self) -> None:
        self.events.append("end")
        self.capturing = False

    def replay(self) -> None:
        self.replays += 1
        self.kernels()


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> list[RecordingGraph]:
    made: list[RecordingGraph] = []

    def new_graph() -> RecordingGraph:
        made.append(RecordingGraph())
        return made[-1]

    monkeypatch.setattr(_cuda_graphs.torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(_cuda_graphs.torch.cuda, "graph_pool_handle", lambda: (0, 0))
    return made


def test_a_bucket_runs_eagerly_twice_then_is_captured_once_and_replayed(graphs: list[RecordingGraph]) -> None:
    counter = CommunicationCounter()
    calls: list[int] = []

    def job(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.data_ptr())
        counter.record("all_to_all", tensor, uncompressed=4 * tensor.numel())
        if graphs and graphs[-1].capturing:  # recorded, not run: the replays run it
            graphs[-1].kernels = lambda: tensor.add_(1)
            return tensor
        return tensor.add_(1)

    bucket_graphs = BucketGraphs()
    buffer = torch.zeros(4)
    for _ in range(5):
        assert bucket_graphs.run(("bytegrad", 0, 4, torch.float32), buffer, job, counter) is buffer
    # Two eager calls on the bucket, one in the capture on the graph's own buffer, none on the replays.
    assert len(calls) == 3
    assert calls[:2] == [buffer.data_ptr()] * 2
    assert calls[2] != buffer.data_ptr()
    assert len(graphs) == 1
    assert graphs[0].events == ["begin thread_local", "end"]
    assert graphs[0].replays == 3  # the capturing call runs its graph too
    assert bucket_graphs.captured == 1
    # Every call counted once: the capture recorded its call, each replay recorded it again.
    assert counter.calls == {"all_to_all": 5}
    # Each call added one: the replays to the graph's buffer, loaded from the bucket and copied back into it.
    assert torch.equal(buffer, torch.full((4,), 5.0))


def test_keys_are_captured_apart_and_a_new_size_starts_over(graphs: list[RecordingGraph]) -> None:
    counter = CommunicationCounter()
    bucket_graphs = BucketGraphs(warmup=1)
    for _ in range(3):
        for index, size in ((0, 4), (1, 6)):
            bucket_graphs.run(("bytegrad", index, size, torch.float32), torch.zeros(size), lambda t: t, counter)
    assert bucket_graphs.captured == 2
    bucket_graphs.run(("bytegrad", 0, 8, torch.float32), torch.zeros(8), lambda t: t, counter)
    assert bucket_graphs.captured == 2  # a rebuilt bucket of another size runs eagerly first
    bucket_graphs.clear()
    assert bucket_graphs.captured == 0


def test_a_failed_capture_names_the_way_out(graphs: list[RecordingGraph]) -> None:
    counter = CommunicationCounter()
    bucket_graphs = BucketGraphs(warmup=0)

    def job(tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match=r"4 torch.float32 elements.*BAGUA_CUDA_GRAPHS=0") as raised:
        bucket_graphs.run(("bytegrad", 0, 4, torch.float32), torch.zeros(4), job, counter)
    assert "not permitted" in str(raised.value.__cause__)
    assert graphs[0].events == ["begin thread_local", "end"]  # the capture was ended
