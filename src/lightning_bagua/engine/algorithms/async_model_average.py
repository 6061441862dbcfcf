"""``async``: asynchronous model averaging, weights averaged by a background thread while every rank trains.

Design:

* Warm-up: the first ``warmup_steps`` training forward passes (the spec's ``t``, counted by ``on_forward_start``)
  have their gradients all-reduced by the ``gradient_allreduce`` hook, so every replica starts the asynchronous
  phase from the same weights.
* Afterwards the communication hook hands gradients back untouched and a background thread, on a process group
  of its own, repeats *rounds*: snapshot the weights ``s``, all-reduce (sum) the snapshot into ``a``, apply
  ``x += a/n - s``, sleep ``sync_interval_ms``. The training loop never waits on that group, so a slow rank does
  not slow a fast one; the fast one's steps simply land between more of its own rounds.
* A gate (a lock that lets a waiting averaging thread go first) keeps the thread's snapshot and update at step
  boundaries: while averaging runs, the training thread holds it all the time except for a moment each time a
  bound optimizer's ``step()`` returns (or the backward pass ends, when no optimizer is bound), in which a
  waiting thread takes its copy. So whatever the training thread does between steps (a callback that copies or
  averages the weights, a checkpoint that reads and serialises them, validation) sees weights no round is
  halfway through changing, and that do not change under it. The thread holds the gate only to copy weights,
  never while it communicates, so the training thread waits for a local copy at most. While averaging does not
  run (warm-up, aborted), the gate is held from a training forward pass to the end of its step only.
* Every round starts with an all-reduce (max) of a stop code, so that every rank leaves the loop after the same
  round: :meth:`AsyncModelAverageImpl.abort` raises this rank's code and waits for its thread, then averages the
  weights once more (plain ``x = a/n``) with every other rank, which makes abort a synchronisation point and leaves
  the replicas identical. A round still waiting to apply its update when abort is called drops it: the update
  was taken from weights that the caller may have rewritten since (a callback's ``on_train_end``), and abort leaves
  the weights as the caller left them, averaged. A rank that fails raises a different code instead, so its peers
  stop and report it rather than wait for it.
* On CUDA the thread works on a stream of its own: it waits there for the training stream before it reads or
  writes the weights, the training stream waits for its copies, and the host waits for the all-reduce before the
  update is queued, so the training stream never waits on a peer.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_bagua.engine._torch_compat import destroy_process_group, process_group_exists, queue_backward_callback
from lightning_bagua.engine.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    CommunicationHook,
    check_keyword_type,
    register_algorithm,
    weakly_bound,
)
from lightning_bagua.engine.algorithms.decentralized import local_gradient_hook
from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceState, gradient_allreduce_hook
from lightning_bagua.engine.algorithms.weights import FlatWeights, group_by_dtype, views_like

__all__ = [
    "AsyncModelAverageAlgorithm",
    "AsyncModelAverageImpl",
    "AsyncModelAverageState",
    "async_model_average_hook",
]

log = logging.getLogger(__name__)

PEER_SELECTION_MODES = ("all",)
"""The values ``peer_selection_mode`` accepts."""

# Stop codes exchanged (max) at the start of every round: everyone carries on, someone aborts, someone failed.
_CONTINUE, _ABORT, _FAILED = 0, 1, 2

# How long a failing rank waits for its own thread to leave the loop before it gives up on it.
_FAILURE_JOIN_SECONDS = 10.0

THREAD_NAME = "bagua-async-averaging"
"""The name of the background thread, one per wrapped model while averaging runs."""


def _async_impl_of(bagua_ddp_module: Any) -> "AsyncModelAverageImpl":
    impl = getattr(bagua_ddp_module, "bagua_algorithm_impl", None)
    if not isinstance(impl, AsyncModelAverageImpl):
        raise TypeError(
            "abort()/resume() take the BaguaDistributedDataParallel model that trains with the 'async' algorithm,"
            f" got {type(bagua_ddp_module).__name__}"
            + ("" if impl is None else f" training with {type(impl).__name__}")
            + "."
        )
    return impl


@dataclass
class AsyncModelAverageState:
    """State of :func:`async_model_average_hook`.

    Args:
        warmup: the warm-up's gradient all-reduce state.
        device: the device the gradients live on.
        all_reduce_gradients: whether the backward running now belongs to a warm-up pass.
        release_after_backward: gives the weights back to the averaging thread; set when no optimizer is bound.
        release_queued: the release is queued for the backward running now.
    """

    warmup: GradientAllReduceState
    device: torch.device
    all_reduce_gradients: bool = True
    release_after_backward: Callable[[], None] | None = None
    release_queued: bool = False


def async_model_average_hook(state: AsyncModelAverageState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """All-reduce a bucket of gradients during the warm-up; hand it back untouched afterwards.

    Args:
        state: the hook's state.
        bucket: the bucket DDP's reducer hands over.

    Returns:
        A future of the bucket's gradients.
    """
    if state.release_after_backward is not None and not state.release_queued:
        # Runs once this backward has finished, after DDP's own end-of-backward callback (queued earlier).
        state.release_queued = True
        queue_backward_callback(state.release_after_backward)
    if state.all_reduce_gradients:
        return gradient_allreduce_hook(state.warmup, bucket)
    return local_gradient_hook(state, bucket)


class AsyncModelAverageImpl(AlgorithmImpl):
    """:class:`AsyncModelAverageAlgorithm` bound to one wrapped model: its hook, its thread and its communicator.

    Life cycle: averaging is *enabled* from construction (so plain PyTorch training averages after the warm-up
    without further calls); the thread starts at the first training forward pass after the warm-up, or at
    :meth:`resume` when the warm-up is over. :meth:`abort` stops it and disables averaging until :meth:`resume`.
    Every rank must make the same calls in the same order, as for any collective.

    The thread copies weights at this rank's step boundaries only, so while the training thread pauses between
    steps without aborting, this rank's rounds (and, through the collectives, its peers') pause with it; abort
    before a long pause, as the Lightning strategy does around validation.
    """

    def __init__(self, algorithm: "AsyncModelAverageAlgorithm", context: AlgorithmContext) -> None:
        super().__init__(algorithm, context)
        self.warmup_steps = algorithm.warmup_steps
        self.sync_interval = algorithm.sync_interval_ms / 1000
        self.average_on_abort = algorithm.average_on_abort
        if algorithm.sync_interval_ms == 0 and context.groups.rank == 0:
            log.warning(
                "Algorithm 'async' with sync_interval_ms=0 never averages the weights, as in Bagua: after %d warm-up"
                " steps every rank trains on its own. Pass sync_interval_ms=1 (or more) to average in the background.",
                algorithm.warmup_steps,
            )
        self.state = AsyncModelAverageState(
            warmup=GradientAllReduceState.from_context(context, average=True),
            device=context.device,
        )
        self.forward_passes = 0
        self.rounds = 0
        self._weights: list[FlatWeights] = group_by_dtype(
            [parameter for _, parameter in context.named_parameters], needs_receive_buffer=True
        )
        self._world_size = context.groups.world_size
        # Made by every rank, right after the engine's own groups (the wrapper's constructor is collective).
        self._group: dist.ProcessGroup | None = dist.new_group(
            ranks=context.groups.global_ranks, timeout=context.timeout
        )
        self._cuda = context.device.type == "cuda"
        self._side_stream = torch.cuda.Stream(context.device) if self._cuda else None
        self._training_stream = torch.cuda.current_stream(context.device) if self._cuda else None
        self._stop_code = torch.zeros(1, dtype=torch.int32, device=context.device)
        # The training side holds the weights from a forward pass to the end of its step, and between steps too
        # while averaging runs (see the module docstring).
        self._gate = _WeightsGate()
        self._held = False
        self._enabled = True
        self._active = False  # a loop was started and has not been aborted; identical on every rank
        self._thread: threading.Thread | None = None
        self._stop_request = _CONTINUE
        self._wake = threading.Event()
        self._outcome = _CONTINUE  # the stop code the loop agreed on when it ended
        self._error: BaseException | None = None
        self._failure_reported = False
        self._optimizers: list[Optimizer] = []
        self._hook_handles: list[RemovableHandle] = []
        self.state.release_after_backward = weakly_bound(self._release_after_backward)
        self._telemetry_mark = (0, time.monotonic())  # rounds and time at the last telemetry_phase call
        self._step_all_reduced = True

    # ------------------------------------------------------------------------------------------- public surface

    @property
    def in_warmup(self) -> bool:
        """Whether the next training forward pass still all-reduces gradients."""
        return self.forward_passes < self.warmup_steps

    @property
    def enabled(self) -> bool:
        """Whether averaging runs, or will start once the warm-up is over (not aborted)."""
        return self._enabled

    @property
    def started(self) -> bool:
        """Whether averaging was started and not aborted since: :attr:`enabled`."""
        return self._enabled

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def telemetry_phase(self) -> dict[str, float]:
        """Return ``warmup`` (1.0 if the step that ended all-reduced its gradients) and ``syncs_per_second``.

        ``syncs_per_second`` counts the averaging rounds completed since the previous call, over the time since it.
        """
        now = time.monotonic()
        rounds, since = self._telemetry_mark
        self._telemetry_mark = (self.rounds, now)
        elapsed = now - since
        return {
            "warmup": float(self._step_all_reduced),
            "syncs_per_second": (self.rounds - rounds) / elapsed if elapsed else 0.0,
        }

    def communication_hook(self) -> tuple[Any, CommunicationHook]:
        """Return the state and :func:`async_model_average_hook`."""
        return self.state, async_model_average_hook

    def on_forward_start(self, synchronizing: bool) -> None:
        """Hold the weights, count the pass, choose its phase and start averaging once the warm-up is over.

        Args:
            synchronizing: unused; an accumulating pass counts like any other.
        """
        self._raise_if_failed()
        self._hold()
        self.state.all_reduce_gradients = self.in_warmup
        self._step_all_reduced = self.state.all_reduce_gradients  # for telemetry, which asks after the step
        self.state.release_queued = False
        self.forward_passes += 1
        if not self.state.all_reduce_gradients and self._enabled and not self._active and self.sync_interval > 0:
            self._start()

    def bind_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Give the weights back to the averaging thread whenever one of ``optimizers`` finishes a step.

        Args:
            optimizers: the optimizers; none bound means the weights are given back at the end of backward.
        """
        for handle in self._hook_handles:
            handle.remove()
        self._optimizers = list(optimizers)
        self._hook_handles = [
            optimizer.register_step_post_hook(weakly_bound(self._release_after_step)) for optimizer in optimizers
        ]
        self.state.release_after_backward = None if self._optimizers else weakly_bound(self._release_after_backward)

    def start(self) -> None:
        """Start averaging in the background: :meth:`resume`."""
        self.resume()

    def stop(self, wait: bool = True) -> None:
        """Stop averaging: :meth:`abort` when ``wait`` (collective), :meth:`stop_on_failure` otherwise.

        Args:
            wait: whether every rank stops together, with a last exact average.
        """
        if wait:
            self.abort()
        else:
            self.stop_on_failure()

    def resume(self) -> None:
        """Enable averaging and, past the warm-up, start the background thread; a no-op when it runs already."""
        self._raise_if_failed()
        self._enabled = True
        if not self._active and not self.in_warmup and self.sync_interval > 0:
            self._start()

    def abort(self) -> None:
        """Stop the background averaging (collective), average once more, and disable averaging until resumed.

        Every rank must call it: each stops after the same round, then all average their weights (``x = a/n``)
        together, which is the barrier. A no-op when no averaging loop is active.

        Raises:
            RuntimeError: the loop failed, or another rank stopped because it failed.
        """
        self._enabled = False
        if self._active:
            # Asked before the weights are let go, so that a round waiting for them drops its update (see _apply).
            self._stop_request = _ABORT
        self._release()  # the caller is between steps, and the thread may be waiting for the weights
        if not self._active:
            self._raise_if_failed()
            return
        self._stop_thread(_ABORT, timeout=None)
        self._active = False
        if self._loop_failed:
            # Some rank will never join a final average: report the failure (once) and leave the weights as they are.
            self._raise_if_failed()
            log.warning("Async model averaging was aborted after a failure; the replicas were not averaged.")
            return
        if not self.average_on_abort:
            log.debug("async averaging stopped after %d rounds, without a last average", self.rounds)
            return
        if not process_group_exists(self._group):
            # The script's destroy_process_group() took the averaging group with it: no collective can run on it.
            if self.context.groups.rank == 0:
                log.warning(
                    "Async model averaging stopped after the process group was destroyed; the replicas were not"
                    " averaged a last time. Close the module (or let the strategy's teardown run) before"
                    " destroy_process_group()."
                )
            return
        # The loop has ended on every rank; only this thread touches the weights and the group now.
        self._snapshot()
        self._reduce()
        self._apply(exact=True)
        log.debug("async averaging aborted after %d rounds", self.rounds)

    def stop_on_failure(self) -> None:
        """Stop the background thread without waiting for other ranks, telling them that this rank failed.

        For error paths (the Lightning strategy calls it from ``on_exception``): no final averaging, no barrier.
        A thread that cannot leave its round within a few seconds (a peer is gone) is left behind as a daemon.
        """
        self._enabled = False
        if self._active:
            self._stop_request = _FAILED
        self._release()
        if self._active:
            self._stop_thread(_FAILED, timeout=_FAILURE_JOIN_SECONDS + 2 * self.sync_interval)
            self._active = False

    def state_dict(self) -> dict[str, Any]:
        """Return the warm-up counter (training forward passes so far) and the number of averaging rounds."""
        return {"forward_passes": self.forward_passes, "rounds": self.rounds}

    def resize_state(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Keep the most advanced rank's counters, so that no rank's progress (warm-up, rounds) is lost.

        Args:
            saved: each saved rank's :meth:`state_dict`.

        Returns:
            The largest ``forward_passes`` and ``rounds`` saved.
        """
        return {key: max(int(state[key]) for state in saved) for key in ("forward_passes", "rounds")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters, so that training resumes in the phase the checkpoint was taken in.

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            ValueError: the keys are not those of :meth:`state_dict`.
            RuntimeError: averaging is running; abort it first.
        """
        if set(state) != {"forward_passes", "rounds"}:
            raise ValueError(
                f"Algorithm 'async' expects state with keys ['forward_passes', 'rounds'], got {sorted(state)}."
                " Was the checkpoint written with another algorithm?"
            )
        if self._active:
            raise RuntimeError("Algorithm 'async': abort() the averaging on every rank before loading its state.")
        self.forward_passes = int(state["forward_passes"])
        self.rounds = int(state["rounds"])

    def close(self) -> None:
        """Abort averaging if it runs (collective, see :meth:`abort`) and destroy the averaging communicator."""
        try:
            self.abort()
        finally:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []
            group, self._group = self._group, None
            if self.running:
                log.warning("The async averaging thread is still blocked in a collective; its group is left alive.")
            elif process_group_exists(group):  # a script that destroyed the default group destroyed this one too
                destroy_process_group(group)

    # --------------------------------------------------------------------------------------- one averaging round

    def _sync_once(self) -> None:
        """Run one averaging round (snapshot, all-reduce, apply) on this rank; the loop's body, collective."""
        self._snapshot()
        self._reduce()
        self._apply()

    def _snapshot(self) -> None:
        with self._gate.averaging(), self._after_training():
            for weights in self._weights:
                weights.gather()

    def _reduce(self) -> None:
        assert self._group is not None, "the averaging communicator is closed"
        with self._on_side_stream():
            for weights in self._weights:
                assert weights.received is not None
                weights.received.copy_(weights.buffer)
                self.context.counter.record("all_reduce", weights.received)
                dist.all_reduce(weights.received, group=self._group)
            if self._side_stream is not None:
                # The host waits for the peers here, so the update queued next never makes training wait for them.
                self._side_stream.synchronize()

    def _apply(self, exact: bool = False) -> None:
        with self._gate.averaging(), self._after_training(), torch.no_grad():
            # The round's collective has run on every rank, so it counts on every rank, applied or not: a stop
            # request reaches the ranks at different moments, and the count is saved with the state.
            self.rounds += 1
            if not exact and self._stop_request != _CONTINUE:
                # Stopping: the round's update was taken from weights the caller may have rewritten since (a
                # callback's on_train_end: SWA's average, pruning made permanent). Adding it would undo that write,
                # so the weights stay as the caller left them, for the abort's exact average, if any.
                return
            for weights in self._weights:
                average = weights.received
                assert average is not None
                average.div_(self._world_size)
                if exact:
                    weights.scatter(average)
                    continue
                delta = average.sub_(weights.buffer)
                parameters: list[Tensor] = list(weights.parameters)
                torch._foreach_add_(parameters, views_like(delta, parameters))

    # ------------------------------------------------------------------------------------------------ the thread

    def _start(self) -> None:
        self._stop_request = _CONTINUE
        self._outcome = _CONTINUE
        self._error = None
        self._failure_reported = False
        self._wake.clear()
        # From now on the training thread lets the weights go at step boundaries only; it may be between steps now.
        self._hold()
        self._active = True
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()
        log.debug("async averaging started after %d forward passes", self.forward_passes)

    def _loop(self) -> None:
        device_context = torch.cuda.device(self.context.device) if self._cuda else nullcontext()
        try:
            with device_context:
                while True:
                    outcome = self._negotiate()
                    if outcome != _CONTINUE:
                        self._outcome = outcome
                        return
                    self._sync_once()
                    self._wake.wait(self.sync_interval)
        except BaseException as error:  # kept for the training thread, which raises it at its next call
            log.error("Async model averaging failed: %s", error)
            self._error = error

    def _negotiate(self) -> int:
        assert self._group is not None, "the averaging communicator is closed"
        with self._on_side_stream():
            self._stop_code.fill_(self._stop_request)
            self.context.counter.record("all_reduce", self._stop_code)
            dist.all_reduce(self._stop_code, op=dist.ReduceOp.MAX, group=self._group)
            return int(self._stop_code.item())

    def _stop_thread(self, code: int, timeout: float | None) -> None:
        self._stop_request = code
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("The async averaging thread did not stop within %.0f s; leaving it behind.", timeout)
                return
        self._thread = None

    @property
    def _loop_failed(self) -> bool:
        return self._error is not None or self._outcome == _FAILED

    def _raise_if_failed(self) -> None:
        # Reported once, to the training thread: the calls that follow (close() in a teardown) must not repeat it.
        if self._failure_reported:
            return
        if self._error is not None:
            self._failure_reported = True
            raise RuntimeError("Async model averaging failed in its background thread.") from self._error
        if self._outcome == _FAILED and self._stop_request != _FAILED:
            self._failure_reported = True
            raise RuntimeError(
                "Async model averaging stopped because another rank failed; see that rank's error. The replicas"
                " were not averaged."
            )

    # --------------------------------------------------------------------------------- the gate and the streams

    def _hold(self) -> None:
        if not self._held:
            self._gate.enter_step()
            self._held = True
            if self._cuda:
                self._training_stream = torch.cuda.current_stream(self.context.device)

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._gate.leave_step()

    def _step_boundary(self) -> None:
        if not self._active:
            self._release()  # nothing averages in the background: the weights are free until the next forward pass
            return
        # Let a waiting averaging thread take its copy now, then keep the weights until the next step ends, so
        # that nothing run between steps can read them halfway through a round's update.
        self._release()
        self._hold()

    def _release_after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._step_boundary()

    def _release_after_backward(self) -> None:
        self.state.release_queued = False
        self._step_boundary()

    @contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self._side_stream is None:
            yield
            return
        with torch.cuda.stream(self._side_stream):
            yield

    @contextmanager
    def _after_training(self) -> Iterator[None]:
        """Run the block after the training stream's queued work, and the training stream's next work after it."""
        if self._side_stream is None or self._training_stream is None:
            yield
            return
        self._side_stream.wait_stream(self._training_stream)
        with torch.cuda.stream(self._side_stream):
            yield
        self._training_stream.wait_stream(self._side_stream)


@register_algorithm("async")
class AsyncModelAverageAlgorithm(Algorithm):
    """Average weights in the background, asynchronously, after a warm-up of gradient all-reduce.

    Asynchronous model averaging is one of the algorithms of Bagua (Gan et al. 2021, https://arxiv.org/abs/2107.01499).
    With ``n`` ranks:

    1. The first ``warmup_steps`` training forward passes all-reduce (average) gradients, as
       ``gradient_allreduce``.
    2. From then on gradients stay local and each rank steps on its own. A background thread, on a communicator
       of its own, repeatedly snapshots the weights ``s``, all-reduces (sums) them into ``a``, applies
       ``x <- x + a/n - s`` (so the local steps taken meanwhile are kept), and sleeps ``sync_interval_ms``.

    Ranks may take different numbers of steps between two averaging rounds; the update lands between steps,
    never inside a forward, backward or optimizer step.

    :meth:`abort` stops the background averaging and :meth:`resume` restarts it; the Lightning strategy resumes it
    when fitting starts and aborts it when fitting ends. Both are idempotent.

    Args:
        peer_selection_mode: who averages with whom; ``"all"`` (every rank) is the only mode.
        sync_interval_ms: pause between two averaging rounds, in milliseconds. ``0`` never averages, as in Bagua:
            after the warm-up every rank trains on its own (rank zero logs this once).
        warmup_steps: training forward passes whose gradients are all-reduced before averaging starts.
        average_on_abort: when :meth:`abort` stops the averaging, average the replicas one last time, so that
            every rank ends (and checkpoints, validates) with the same weights. ``False`` just stops, as Bagua did.

    Raises:
        ValueError: ``peer_selection_mode`` is not ``"all"``, or a count is negative.
        TypeError: a keyword has the wrong type.
    """

    ranks_hold_different_weights = True
    resize_effect = "the largest counters are kept; every rank starts from the ranks' average weights"
    impl_class = AsyncModelAverageImpl

    def __init__(
        self,
        peer_selection_mode: str = "all",
        sync_interval_ms: int = 500,
        warmup_steps: int = 0,
        *,
        average_on_abort: bool = True,
    ) -> None:
        check_keyword_type(self.name, "peer_selection_mode", peer_selection_mode, str)
        check_keyword_type(self.name, "average_on_abort", average_on_abort, bool)
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"Algorithm {self.name!r}: `peer_selection_mode` must be one of"
                f" {', '.join(map(repr, PEER_SELECTION_MODES))} (asynchronous averaging always averages over every"
                f" rank), got {peer_selection_mode!r}."
            )
        for keyword, value in (("sync_interval_ms", sync_interval_ms), ("warmup_steps", warmup_steps)):
            check_keyword_type(self.name, keyword, value, int)
            if value < 0:
                raise ValueError(f"Algorithm {self.name!r}: `{keyword}` must be at least 0, got {value}.")
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        self.average_on_abort = average_on_abort

    def abort(self, bagua_ddp_module: Any) -> None:
        """Stop the background averaging of ``bagua_ddp_module``; a no-op when it is not running.

        Collective: every rank must call it. It returns once every rank has, with the replicas averaged a last time
        unless the algorithm was built with ``average_on_abort=False``.

        Args:
            bagua_ddp_module: a :class:`~lightning_bagua.engine.BaguaDistributedDataParallel` using this algorithm.
        """
        _async_impl_of(bagua_ddp_module).abort()

    def resume(self, bagua_ddp_module: Any) -> None:
        """Restart the background averaging of ``bagua_ddp_module``; a no-op when it is running.

        Every rank must call it. During the warm-up it only allows averaging to start once the warm-up is over.

        Args:
            bagua_ddp_module: a :class:`~lightning_bagua.engine.BaguaDistributedDataParallel` using this algorithm.
        """
        _async_impl_of(bagua_ddp_module).resume()


class _WeightsGate:
    """Who may touch the weights: the training thread during a step, or the averaging thread between steps.

    The training thread may also hold it between steps (the implementation does while averaging runs), leaving it
    only for a moment at each step boundary: a waiting averaging thread copies then.

    A plain lock would starve the averaging thread: the training thread gives the weights back at the end of a step
    and takes them again at the next forward pass, before a waiting thread gets scheduled. Here a waiting averaging
    thread goes first, so its copy lands at the very next step boundary; the training thread waits only for that
    copy, never for communication.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._in_step = False
        self._averaging = False
        self._averaging_waits = False

    def enter_step(self) -> None:
        """Wait until no averaging copy is due or running, then hold the weights for a step."""
        with self._condition:
            self._condition.wait_for(lambda: not (self._averaging or self._averaging_waits))
            self._in_step = True

    def leave_step(self) -> None:
        """Give the weights back at the end of a step."""
        with self._condition:
            self._in_step = False
            self._condition.notify_all()

    @contextmanager
    def averaging(self) -> Iterator[None]:
        """Hold the weights between two steps, for a copy into or out of them."""
        with self._condition:
            self._averaging_waits = True
            self._condition.wait_for(lambda: not self._in_step)
            self._averaging_waits = False
            self._averaging = True
        try:
            yield
        finally:
            with self._condition:
                self._averaging = False
                self._condition.notify_all()
