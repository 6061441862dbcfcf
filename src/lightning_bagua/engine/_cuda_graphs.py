"""Replay a bucket's communication job as one CUDA graph once its shapes have settled."""

import logging
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_bagua.engine._counter import CommunicationCounter, CounterRecord

__all__ = ["CUDA_GRAPHS_VARIABLE", "BucketGraphs", "cuda_graphs_enabled"]

log = logging.getLogger(__name__)

CUDA_GRAPHS_VARIABLE = "BAGUA_CUDA_GRAPHS"
"""Set to ``0`` to run every bucket's job eagerly on CUDA (the graphs are on by default)."""

BucketJob = Callable[[Tensor], Tensor]
"""Reduces the flat bucket it is given in place and returns it."""


def cuda_graphs_enabled() -> bool:
    """Whether ``BAGUA_CUDA_GRAPHS`` allows graphs (anything but ``0``, ``false``, ``no`` or ``off``)."""
    return os.environ.get(CUDA_GRAPHS_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    records: list[CounterRecord]
    output: Any  # what the captured job returned: its tensors are the graph's, overwritten by every replay
    static_input: Tensor | None = None  # the graph's own copy of the bucket (:meth:`BucketGraphs.run`)


@dataclass
class _Slot:
    eager_calls: int = 0
    captured: _Captured | None = None


@dataclass
class BucketGraphs:
    """Run each bucket's job eagerly for its first ``warmup`` calls, then capture it and replay the graph.

    Over NVLink a step of the compressing algorithms waits on the host, and a bucket's job costs the host a few
    hundred microseconds of Python and launches (codec kernels, collectives, their bookkeeping). Replayed as a
    graph it costs one launch. The job must depend on nothing but its bucket's values: the same kernels and
    collectives on the same shapes at every call.

    NCCL requires every rank to capture, and replay, the same collectives together. Whether a call replays is
    therefore decided only from what every rank agrees on: the key (the bucket's index, element count and dtype,
    which DDP's reducer makes equal on all ranks) and how often it has run. The bucket's own storage may move
    between calls, so the graph works on a buffer of its own: the bucket is copied in before the replay and the
    result copied back after it, two device copies per bucket.

    Args:
        warmup: eager calls per key before capture: the first builds the kernels and the communicators'
            connections, which a capture must find ready.
        max_graphs: the most graphs kept; keys beyond them run eagerly (a layout that keeps changing).
    """

    warmup: int = 2
    max_graphs: int = 1024
    _slots: dict[Hashable, _Slot] = field(default_factory=dict)
    _pool: Any = None  # torch's private pool handle type, shared by this executor's graphs
    _graphs: int = 0

    @property
    def captured(self) -> int:
        """How many graphs have been captured."""
        return self._graphs

    def run(self, key: Hashable, buffer: Tensor, job: BucketJob, counter: CommunicationCounter) -> Tensor:
        """Reduce ``buffer`` with ``job`` on the current (side) stream, eagerly or by replaying its graph.

        Args:
            key: what every rank agrees identifies the job: its bucket's index, element count and dtype.
            buffer: the flat bucket; it holds the result afterwards.
            job: reduces the tensor it is given in place and returns it, recording its collectives in ``counter``.
            counter: where ``job`` records; a replay records what the capture recorded.

        Returns:
            ``buffer``.
        """
        slot = self._slot(key)
        captured = slot.captured
        if captured is None:
            if not self._capture_now(slot):
                return job(buffer)
            static_input = torch.empty_like(buffer)
            what = f"a bucket's communication ({buffer.numel()} {buffer.dtype} elements)"
            captured = slot.captured = self._capture(lambda: job(static_input), counter, what)
            captured.static_input = static_input
        else:
            counter.replay(captured.records)
        assert captured.static_input is not None
        captured.static_input.copy_(buffer)
        captured.graph.replay()
        return buffer.copy_(captured.output)

    def run_in_place(self, key: Hashable, job: Callable[[], object], counter: CommunicationCounter, what: str) -> None:
        """Run ``job`` on the current (side) stream, eagerly or by replaying its graph, with no copies in or out.

        For a job that reads and writes only tensors that live, at fixed addresses, as long as its key is used:
        buffers of the caller's own rather than DDP's buckets. The caller drops the :class:`BucketGraphs` (or never
        uses the key again) when it drops those tensors.

        Args:
            key: what every rank agrees identifies the job.
            job: the same kernels and collectives on the same tensors at every call, recorded in ``counter``.
            counter: where ``job`` records; a replay records what the capture recorded.
            what: the job, for the error a failed capture raises.
        """
        slot = self._slot(key)
        captured = slot.captured
        if captured is None:
            if not self._capture_now(slot):
                job()
                return
            captured = slot.captured = self._capture(job, counter, what)
        else:
            counter.replay(captured.records)
        captured.graph.replay()

    def clear(self) -> None:
        """Drop every graph and its buffers."""
        self._slots.clear()
        self._graphs = 0

    def _slot(self, key: Hashable) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
        return slot

    def _capture_now(self, slot: _Slot) -> bool:
        """Whether an uncaptured key's call captures its graph now; counts it as an eager call if not."""
        if slot.eager_calls < self.warmup or self._graphs >= self.max_graphs:
            slot.eager_calls += 1
            return False
        self._graphs += 1
        return True

    def _capture(self, job: Callable[[], object], counter: CommunicationCounter, what: str) -> _Captured:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Thread-local: NCCL's watchdog keeps using CUDA from its own thread while this one captures.
        with counter.logged() as records:
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                output = job()
            except Exception as error:
                raise RuntimeError(
                    f"Capturing {what} as a CUDA graph failed: {error}. Set {CUDA_GRAPHS_VARIABLE}=0 to run every"
                    " bucket eagerly."
                ) from error
            finally:
                graph.capture_end()
        log.debug("Captured a CUDA graph for %s", what)
        return _Captured(graph, records, output)
