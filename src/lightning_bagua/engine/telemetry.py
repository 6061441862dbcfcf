"""Per-step communication telemetry: bytes, compression ratio, time waiting on communication, algorithm phase.

Off by default. A wrapper built with ``telemetry=False`` creates none of this: no hook around the algorithm's,
no clocks read, no device synchronisation. With ``telemetry=True`` the wrapper owns one
:class:`CommunicationTelemetry`, which closes a step record whenever a step that communicated ends.
"""

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_bagua.engine._torch_compat import queue_backward_callback
from lightning_bagua.engine.communication import CommunicationCounter, CommunicationHook, CounterTotals

__all__ = ["TELEMETRY_KEYS", "CommunicationTelemetry", "PhaseSource"]

log = logging.getLogger(__name__)

TELEMETRY_KEYS = (
    "step",
    "bytes_sent",
    "bytes_received",
    "bytes_uncompressed",
    "compression_ratio",
    "communication_wait_s",
    "collective_calls",
)
"""The keys of every step record; the algorithm's phase adds ``"phase/<name>"`` keys."""


class PhaseSource(Protocol):
    """What the telemetry reads from the algorithm: its phase (an ``AlgorithmImpl`` is one)."""

    def telemetry_phase(self) -> dict[str, float]:
        """Describe the algorithm's phase in the step that just ended."""
        ...


# Read through the module so that a test can count the clock reads (there must be none while telemetry is off).
_clock: Callable[[], float] = time.perf_counter


class _Interval:
    """A start and an end mark: host clock readings on CPU, CUDA events on GPUs (read only when the step closes)."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._start: Any = None
        self._end: Any = None

    def start(self) -> None:
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = _clock()

    def end(self) -> None:
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = _clock()

    def seconds(self) -> float:
        if self._start is None or self._end is None:
            return 0.0
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0
        return float(self._end - self._start)


class CommunicationTelemetry:
    """Measure what one wrapped model communicates, step by step.

    A *step* is everything between the start of one training step and the start of the next: the forward
    passes (accumulating ones included), the synchronizing backward, the optimizer step and whatever the
    algorithm communicates around it. A step closes when :meth:`end_step` is called after a synchronizing
    backward, or, failing that, at the start of the next training forward pass. Its record (a ``dict``, see
    :data:`TELEMETRY_KEYS`) holds:

    - ``step``: the index of the step, counting closed steps from 0;
    - ``bytes_sent`` / ``bytes_received``: payload this rank handed to collectives and received from them,
      with the conventions of :class:`~lightning_bagua.engine.communication.CommunicationCounter`;
    - ``bytes_uncompressed`` and ``compression_ratio`` (``bytes_uncompressed / bytes_sent``; 1 for
      full-precision traffic, NaN in a step that sent nothing);
    - ``communication_wait_s``: time the training loop waited on communication that nothing overlapped: from
      the moment the last gradient bucket is ready to the end of the backward (when DDP's reducer has waited for
      every bucket and the algorithm has finished its end-of-backward work), plus blocking communication the
      algorithm reports outside backward (``low_precision_decentralized``'s ring round after the step). On CUDA
      it is measured between CUDA events on the current stream, so it is device time;
    - ``collective_calls``: collectives issued;
    - ``phase/<name>``: what :meth:`~lightning_bagua.engine.algorithms.base.AlgorithmImpl.telemetry_phase`
      reports (``phase/compressed`` for ``qadam``).

    Args:
        counter: the wrapper's counter.
        impl: the algorithm bound to the wrapper.
        device: the device the gradients live on.
    """

    def __init__(self, counter: CommunicationCounter, impl: PhaseSource, device: torch.device) -> None:
        self._counter = counter
        self._impl = impl
        self._cuda = device.type == "cuda"
        self._step = 0
        self._start_totals: CounterTotals = counter.totals()
        self._intervals: list[_Interval] = []
        self._backward: _Interval | None = None
        self._synchronized = False
        self.last_step: dict[str, float] | None = None
        """The record of the last closed step, ``None`` before the first."""

    def wrap_hook(self, hook: CommunicationHook) -> CommunicationHook:
        """Return ``hook`` with the end-of-backward wait measured around it.

        Args:
            hook: the algorithm's communication hook.

        Returns:
            A hook with the same contract.
        """

        def measured_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            last = bucket.is_last()
            if last:
                # Every gradient is ready once the reducer hands over the last bucket; what follows until the end
                # of backward is waiting on communication.
                self._backward = _Interval(self._cuda)
                self._backward.start()
            future = hook(state, bucket)
            if last:
                # Queued after DDP's finalisation (queued at the first gradient) and after any callback the
                # algorithm queued on an earlier bucket, so it runs when all of them are done.
                queue_backward_callback(self._backward_finished)
            return future

        return measured_hook

    def _backward_finished(self) -> None:
        interval, self._backward = self._backward, None
        if interval is not None:
            interval.end()
            self._intervals.append(interval)
        self._synchronized = True

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Count the time spent inside the ``with`` block as waiting on communication (for algorithms)."""
        interval = _Interval(self._cuda)
        interval.start()
        try:
            yield
        finally:
            interval.end()
            self._intervals.append(interval)

    def on_forward_start(self) -> None:
        """Close the previous step if a synchronizing backward ended it and nobody closed it yet."""
        if self._synchronized:
            self.end_step()

    def continue_from(self, previous: "CommunicationTelemetry") -> None:
        """Carry on another telemetry's record stream, as when an engine is rebuilt for the same module.

        Its last closed step stays readable here and step indices go on counting instead of restarting at 0.

        Args:
            previous: the telemetry of the engine this one replaces.
        """
        self.last_step = previous.last_step
        self._step = previous._step

    def end_step(self) -> dict[str, float] | None:
        """Close the current step if a synchronizing backward ran in it, and return its record.

        Returns:
            The step's record, or ``None`` when no synchronizing backward ran since the last close (an
            accumulating step, or a second call for the same step).
        """
        if not self._synchronized:
            return None
        totals = self._counter.totals()
        delta = totals - self._start_totals
        wait = sum(interval.seconds() for interval in self._intervals)
        record: dict[str, float] = {
            "step": self._step,
            "bytes_sent": delta.bytes_sent,
            "bytes_received": delta.bytes_received,
            "bytes_uncompressed": delta.bytes_uncompressed,
            "compression_ratio": delta.bytes_uncompressed / delta.bytes_sent if delta.bytes_sent else math.nan,
            "communication_wait_s": wait,
            "collective_calls": delta.calls,
        }
        record.update({f"phase/{key}": value for key, value in self._impl.telemetry_phase().items()})
        self._start_totals = totals
        self._intervals = []
        self._synchronized = False
        self._step += 1
        self.last_step = record
        return record
