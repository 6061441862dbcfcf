"""Count the bytes the engine hands to collectives and receives from them."""

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import Tensor

__all__ = ["CommunicationCounter", "CounterRecord", "CounterTotals"]

CounterRecord = tuple[str, int, int, int]
"""One recorded collective call: ``(op, bytes sent, bytes received, uncompressed bytes)``."""


@dataclass(frozen=True)
class CounterTotals:
    """A consistent snapshot of a :class:`CommunicationCounter`'s totals (all operations together).

    Args:
        bytes_sent: payload bytes handed to collectives.
        bytes_received: payload bytes the collectives delivered from other ranks (see the counter's table).
        bytes_uncompressed: what the sent payload would have weighed at full precision.
        calls: collective calls.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_uncompressed: int = 0
    calls: int = 0

    def __sub__(self, other: "CounterTotals") -> "CounterTotals":
        return CounterTotals(
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
            self.bytes_uncompressed - other.bytes_uncompressed,
            self.calls - other.calls,
        )


class CommunicationCounter:
    """Count the payload this rank hands to collectives and receives from them, by operation.

    A byte is counted as *sent* once for every collective call that takes it as input on this rank (the tensor's
    ``numel * element_size``), whatever the collective's own wire protocol does with it. *Received* bytes are
    the payload the call delivers to this rank from the other ranks; each call site states it, with these
    conventions (``P`` the bytes passed, ``n`` the group's size):

    ===============  ==================================================================
    operation        received by this rank
    ===============  ==================================================================
    ``all_reduce``   ``P`` (the reduced tensor; the default when a call site says nothing)
    ``all_gather``   ``(n - 1) * P`` (every other rank's contribution)
    ``all_to_all``   ``(n - 1) / n * P`` (one row from each other rank; the own row stays)
    ``reduce``       ``P`` on the destination, ``0`` elsewhere
    ``broadcast``    ``P`` on every rank but the source, ``0`` there
    ``send``         the bytes of the matching receive (every send here is paired with one)
    ===============  ==================================================================

    Compressed collectives also state the *uncompressed* bytes: what the float data they carry weighs at full
    precision. ``bytes_uncompressed / bytes_sent`` is the compression ratio (1 for full-precision traffic).

    The counter is thread-safe: the engine records from the autograd thread and from its communication thread.

    Example:
        >>> import torch
        >>> counter = CommunicationCounter()
        >>> counter.record("all_reduce", torch.zeros(4))
        >>> counter.bytes_sent, counter.bytes_received, counter.calls["all_reduce"]
        (16, 16, 1)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}
        self._received: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self._uncompressed = 0
        self._log = threading.local()

    def record(self, op: str, tensor: Tensor, received: int | None = None, uncompressed: int | None = None) -> None:
        """Record one collective call.

        Args:
            op: the collective's name, e.g. ``"all_reduce"``.
            tensor: the tensor this rank passes to it.
            received: payload bytes the call delivers to this rank from others; the tensor's bytes when ``None``.
            uncompressed: full-precision bytes of the data ``tensor`` encodes; the tensor's bytes when ``None``.
        """
        nbytes = tensor.numel() * tensor.element_size()
        received = nbytes if received is None else received
        uncompressed = nbytes if uncompressed is None else uncompressed
        log = getattr(self._log, "records", None)
        if log is not None:
            log.append((op, nbytes, received, uncompressed))
        self._add(op, nbytes, received, uncompressed)

    @contextlib.contextmanager
    def logged(self) -> Iterator[list[CounterRecord]]:
        """Count as usual, and also list every call this thread records inside the block.

        A job captured into a CUDA graph records its collectives once, at capture; :meth:`replay` counts the list
        again at each replay, which runs the same collectives on the same shapes.

        Yields:
            The list the records are appended to, as ``(op, sent, received, uncompressed)`` byte counts.
        """
        records: list[CounterRecord] = []
        outer = getattr(self._log, "records", None)
        self._log.records = records
        try:
            yield records
        finally:
            self._log.records = outer

    def replay(self, records: Iterable[CounterRecord]) -> None:
        """Count ``records`` (from :meth:`logged`) once more."""
        for op, nbytes, received, uncompressed in records:
            self._add(op, nbytes, received, uncompressed)

    def _add(self, op: str, nbytes: int, received: int, uncompressed: int) -> None:
        with self._lock:
            self._bytes[op] = self._bytes.get(op, 0) + nbytes
            self._received[op] = self._received.get(op, 0) + received
            self._calls[op] = self._calls.get(op, 0) + 1
            self._uncompressed += uncompressed

    @property
    def bytes_sent(self) -> int:
        """Total payload bytes over all operations since the last reset."""
        with self._lock:
            return sum(self._bytes.values())

    @property
    def bytes_received(self) -> int:
        """Total bytes received over all operations since the last reset (conventions in the class docstring)."""
        with self._lock:
            return sum(self._received.values())

    @property
    def bytes_uncompressed(self) -> int:
        """What the sent payload would have weighed at full precision, since the last reset."""
        with self._lock:
            return self._uncompressed

    @property
    def bytes_by_op(self) -> dict[str, int]:
        """Payload bytes per operation since the last reset."""
        with self._lock:
            return dict(self._bytes)

    @property
    def received_by_op(self) -> dict[str, int]:
        """Received bytes per operation since the last reset."""
        with self._lock:
            return dict(self._received)

    @property
    def calls(self) -> dict[str, int]:
        """Number of collective calls per operation since the last reset."""
        with self._lock:
            return dict(self._calls)

    def totals(self) -> CounterTotals:
        """Return all totals at once, taken under one lock (consistent with each other)."""
        with self._lock:
            return CounterTotals(
                sum(self._bytes.values()), sum(self._received.values()), self._uncompressed, sum(self._calls.values())
            )

    def reset(self) -> None:
        """Forget everything counted so far."""
        with self._lock:
            self._bytes.clear()
            self._received.clear()
            self._calls.clear()
            self._uncompressed = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bytes_by_op={self.bytes_by_op}, calls={self.calls})"
