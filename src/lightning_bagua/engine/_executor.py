"""Run a bucket's dependent collectives in bucket order, off the thread that runs backward."""

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Hashable, Iterator

import torch
from torch import Tensor

from lightning_bagua.engine._counter import CommunicationCounter
from lightning_bagua.engine._cuda_graphs import BucketGraphs, BucketJob, cuda_graphs_enabled

__all__ = ["OrderedExecutor"]


class OrderedExecutor:
    """Run multi-step communication jobs in submission order, off the thread that submits them.

    DDP's reducer hands buckets to the communication hook in the same order on every rank. An algorithm that
    needs several dependent collectives per bucket must issue them in that same order on every rank, yet
    without blocking backward.

    - On CUDA the collectives are asynchronous with respect to the host already, so jobs run inline, but on a
      stream of the executor's own: a job's codec kernels and its waits on the communicators would otherwise
      queue on the stream backward runs on, so that backward stalls at every dependent collective (and at the
      other rank's pace). The side stream first waits for the work already queued on the submitting stream;
      the returned future makes its waiter's stream wait for the job's (DDP's reducer waits at the end of
      backward). Each job is kept referenced until the side stream has run it, so that tensors it captured
      are not handed to other work early by the caching allocator.
    - On CPU (Gloo) a job blocks while it communicates, so jobs run on one worker thread per executor, first in
      first out, and backward carries on meanwhile. The step's last bucket runs in the submitting thread when
      the worker has nothing unfinished: backward is over, so there is nothing to overlap.

    Jobs submitted with :meth:`submit_bucket` may, on CUDA, be captured once and replayed as CUDA graphs
    (:class:`~lightning_bagua.engine._cuda_graphs.BucketGraphs`).

    Args:
        device: the device the gradients live on.
        cuda_graphs: replay bucket jobs as CUDA graphs; by default unless ``BAGUA_CUDA_GRAPHS=0``.
    """

    def __init__(self, device: torch.device, cuda_graphs: bool | None = None) -> None:
        self._device = device
        self._cuda_graphs = cuda_graphs_enabled() if cuda_graphs is None else cuda_graphs
        self.graphs = BucketGraphs()
        self._queue: queue.SimpleQueue[tuple[Callable[[], Tensor], torch.futures.Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._unfinished = 0  # jobs queued or running on the worker
        self._stream: torch.cuda.Stream | None = None
        # CUDA jobs whose kernels may still run on the side stream, with an event recorded after them.
        self._in_flight: collections.deque[tuple[torch.cuda.Event, Callable[[], Tensor]]] = collections.deque()

    @property
    def runs_inline(self) -> bool:
        """Whether jobs run in the submitting thread (on CUDA)."""
        return self._device.type == "cuda"

    @property
    def cuda_graphs(self) -> bool:
        """Whether jobs on CUDA may be captured and replayed as CUDA graphs."""
        return self.runs_inline and self._cuda_graphs

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """Queue the block's CUDA work on the executor's stream, after what the current stream holds so far.

        For work that runs in the submitting thread outside :meth:`submit` yet must not run on the stream backward
        runs on: a CUDA graph cannot be captured on the default stream. Futures completed inside the block make
        their waiters wait for this stream. Nothing changes on CPU.
        """
        if not self.runs_inline:
            yield
            return
        if self._stream is None:
            # High priority: a job's kernels gate its collectives, and the last bucket's gate the step.
            self._stream = torch.cuda.Stream(self._device, priority=-1)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            yield

    def submit(self, job: Callable[[], Tensor], last: bool = False) -> torch.futures.Future:
        """Queue ``job`` and return a future of its result; an exception in the job fails the future.

        Args:
            job: a callable that issues the collectives, waits for them, and returns the result tensor.
            last: the job is the step's last bucket. If no earlier job is unfinished it runs in the submitting
                thread: backward has nothing left to overlap with it, and on a loaded CPU each hand-over to the
                worker and back can cost a scheduler time slice.

        Returns:
            A future completed with the job's tensor (wrapped for DDP's reducer on CUDA).
        """
        if self.runs_inline:
            return self._run_on_side_stream(job)
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            inline = last and self._unfinished == 0
            if not inline:
                self._unfinished += 1
        if inline:
            _run_into(job, future)
            return future
        self._ensure_worker()
        self._queue.put((job, future))
        return future

    def submit_bucket(
        self, key: Hashable, buffer: Tensor, job: BucketJob, counter: CommunicationCounter, last: bool = False
    ) -> torch.futures.Future:
        """Queue ``job(buffer)`` like :meth:`submit`; on CUDA it may run as a replayed graph.

        The step's last bucket always runs eagerly. A collective replayed from a graph is invisible to torch's NCCL
        watchdog, so a peer lost during a replay would leave it spinning on the GPU for good; the last bucket's
        collectives queue behind it on the same stream and communicator, and the watchdog times them out and aborts
        the communicator, which ends the stuck replay too.

        Args:
            key: what every rank agrees identifies the job (see :meth:`BucketGraphs.run`).
            buffer: the flat bucket ``job`` reduces in place.
            job: depends on nothing but the values it is given: the same kernels and collectives at every call.
            counter: where ``job`` records its collectives.
            last: the step's last bucket, as for :meth:`submit`; never replayed.

        Returns:
            A future completed with ``buffer`` once reduced.
        """
        return self.submit(lambda: self.run_part(key, buffer, job, counter, last=last), last=last)

    def run_part(
        self, key: Hashable, tensor: Tensor, job: BucketJob, counter: CommunicationCounter, last: bool = False
    ) -> Tensor:
        """Run ``job(tensor)`` from inside a job of :meth:`submit`; on CUDA it may run as a replayed graph.

        For a job whose own work cannot be captured (it reads host state, or has effects beyond its tensors) but
        whose communication can: the job calls this for that part, under the same rules as :meth:`submit_bucket`.

        Args:
            key: what every rank agrees identifies the part (see :meth:`BucketGraphs.run`).
            tensor: what ``job`` reduces in place.
            job: depends on nothing but the values it is given: the same kernels and collectives at every call.
            counter: where ``job`` records its collectives.
            last: part of the step's last bucket; never replayed.

        Returns:
            ``tensor``, reduced.
        """
        if self.cuda_graphs and not last:
            return self.graphs.run(key, tensor, job, counter)
        return job(tensor)

    def close(self) -> None:
        """Finish the queued jobs and stop the worker thread; safe to call twice."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        if self._stream is not None:
            self._stream.synchronize()
        self._in_flight.clear()
        self.graphs.clear()

    def _run_on_side_stream(self, job: Callable[[], Tensor]) -> torch.futures.Future:
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
        submitting = torch.cuda.current_stream(self._device)
        future: torch.futures.Future = torch.futures.Future(devices=[self._device])
        with self.side_stream():
            result = job()
            # A result made on the side stream may be read, and freed, on the waiter's stream.
            result.record_stream(submitting)
            done = torch.cuda.Event()
            done.record()
            future.set_result(result)
        self._in_flight.append((done, job))
        return future

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="bagua-communication", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, future = item
            # Counted as finished before its future completes: whoever waits on it may submit the next step's
            # last bucket at once, and should find nothing unfinished.
            _run_into(job, future, before_completing=self._finished)

    def _finished(self) -> None:
        with self._lock:
            self._unfinished -= 1


def _run_into(
    job: Callable[[], Tensor], future: torch.futures.Future, before_completing: Callable[[], None] | None = None
) -> None:
    """Run ``job`` and complete ``future`` with its result or its exception, calling ``before_completing`` first."""
    try:
        result = job()
    except BaseException as error:  # a failed collective must reach the reducer, not die with the thread
        if before_completing is not None:
            before_completing()
        future.set_exception(error)
    else:
        if before_completing is not None:
            before_completing()
        future.set_result(result)
