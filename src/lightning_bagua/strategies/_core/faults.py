"""Joining the process group without long hangs, and failing with a message that names the ranks at fault."""

import atexit
import contextlib
import itertools
import logging
import os
import socket
import stat
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, NoReturn

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_bagua.engine._torch_compat import default_store, destroy_process_group, store_has_key

__all__ = [
    "CHILDREN_GRACE_S",
    "DIAGNOSIS_WINDOW_S",
    "SHARED_FAILURE_WINDOW_S",
    "TOLD_WINDOW_S",
    "FailureReport",
    "agree_on_attempt",
    "destroy_process_group_at_exit",
    "diagnose_failure",
    "end_children_when_the_script_fails",
    "end_launched_children",
    "fail_at_exit",
    "init_elastic_process_group",
    "install_failure_hook",
    "join_failed_message",
    "leave_the_job",
    "mark_told",
    "next_failure_scope",
    "under_torchelastic",
    "wait_for_store",
]

log = logging.getLogger(__name__)

DIAGNOSIS_WINDOW_S = 5.0
"""How long a rank whose collective failed waits for the others' reports before naming the silent ones."""

SHARED_FAILURE_WINDOW_S = 20.0
"""How long a rank whose own code raised waits for every other rank to report a failure too.

Ranks that raise the same error do so within a step of each other; a rank that is still silent after this long is
waiting for the failed one in a collective, so the failed rank raised alone.
"""

TOLD_WINDOW_S = DIAGNOSIS_WINDOW_S + 5.0
"""How long a rank that raised alone waits for its peers to print their notes: their diagnosis window, and some."""

CHILDREN_GRACE_S = 3.0
"""How long a failed script's main process lets the ranks it started exit on their own before it kills them."""

_FAILURE_KEY = "lightning_bagua/failure"
_ATTEMPT_KEY = "lightning_bagua/attempt"
_CURRENT_ATTEMPT = f"{_ATTEMPT_KEY}/current"
# One number per run (fit, validate, test, or a Fabric), counted alike on every rank since every rank starts the
# same runs in the same order; it tells one run's failure reports in the store from an earlier run's.
_SCOPES = itertools.count(1)


def wait_for_store(address: tuple[str, int], hosts_store: bool, timeout: timedelta | None) -> None:
    """Wait until the rendezvous store at ``address`` accepts connections, for at most ``timeout``.

    torch's store client tries to connect twice, each time for the whole timeout and with a random pause between,
    so an unreachable address fails only after two to three timeouts; probing first bounds it by one.

    Args:
        address: the store's host and port.
        hosts_store: this process hosts the store itself (rank 0 outside torchelastic): nothing to wait for.
        timeout: how long to wait; Lightning's default when ``None``.

    Raises:
        torch.distributed.DistNetworkError: nothing answered within the timeout.
    """
    if hosts_store:
        return
    timeout = timeout or default_pg_timeout
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(address, timeout=max(min(remaining, 5.0), 0.1)):
                return
        except OSError as error:
            if time.monotonic() + 0.5 >= deadline:
                raise dist.DistNetworkError(f"nothing answered within the timeout ({timeout}): {error}") from error
        time.sleep(0.5)  # rank 0 may still be starting


def under_torchelastic() -> bool:
    """Return whether torch's elastic agent (torchrun, ``lightning_bagua.launch``) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def init_elastic_process_group(
    address: tuple[str, int], backend: str, rank: int, world_size: int, timeout: timedelta | None
) -> None:
    """Join the default process group of a torchelastic attempt, under store keys of that attempt's own.

    torch's elastic agent keeps one store for all attempts, and the process group's keys (each rank's address)
    carry no attempt number: a restarted rank can read the address of a rank that died in the last attempt and
    fail to connect. ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt either: with several agents, only the
    agent whose worker failed counts a restart, while the others restart their workers at 0. So the ranks agree
    on the attempt through the store (:func:`agree_on_attempt`), and the group's keys go under its token; the
    frameworks then find the group initialised and keep it.

    Args:
        address: the store's host and port.
        backend: the process group backend.
        rank: this process's rank.
        world_size: the number of processes.
        timeout: the group's timeout; Lightning's default when ``None``.
    """
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    timeout = timeout or default_pg_timeout
    store = dist.TCPStore(*address, world_size, is_master=not use_agent_store and rank == 0, timeout=timeout)
    attempt = agree_on_attempt(store, rank, world_size, timeout)
    log.info("Joining the process group of attempt %s under its own store prefix", attempt)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{_ATTEMPT_KEY}/{attempt}/group", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """Agree with the other ranks of this attempt on a token that no earlier attempt used, through the store.

    1. Rank 0 draws a fresh token ``t`` and publishes it as the current attempt.
    2. Every rank draws a nonce ``n_r`` of its own, reads the current attempt ``t'`` and registers ``n_r`` under
       it. A rank of this attempt may read the token of an earlier one, before rank 0 publishes ``t``.
    3. Rank 0 waits until every rank ``r < world_size`` has registered under ``t``, then publishes the members
       ``[n_0, ..., n_{w-1}]`` of ``t``.
    4. A rank whose own nonce stands at its rank in the members of ``t'`` is in: ``t' = t``. A rank that finds
       members without its nonce, or sees the current attempt change, registered under an earlier attempt's
       token: it waits for the next token and registers again (step 2).

    Only ranks of this attempt can know ``t`` and their nonces, so no rank of an earlier attempt, finished or
    cut short at any step, can make a rank of this one join the wrong group.

    Args:
        store: the store every attempt of the job shares.
        rank: this process's rank.
        world_size: the number of processes.
        timeout: how long to wait for the other ranks.

    Returns:
        The attempt's token.

    Raises:
        torch.distributed.DistNetworkError: the ranks did not all register within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    nonce = uuid.uuid4().hex
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(_CURRENT_ATTEMPT, token)
        registered = [f"{_ATTEMPT_KEY}/{token}/member/{other}" for other in range(world_size)]
        store.set(registered[0], nonce)
        while not all(store_has_key(store, key) for key in registered):
            _pause_until(deadline, "every rank")
        store.set(f"{_ATTEMPT_KEY}/{token}/members", ",".join(store.get(key).decode() for key in registered))
        return token
    stale: str | None = None
    while True:
        while (current := _read(store, _CURRENT_ATTEMPT)) is None or current == stale:
            _pause_until(deadline, "rank 0 to start the attempt")
        token = current
        store.set(f"{_ATTEMPT_KEY}/{token}/member/{rank}", nonce)
        while (members := _read(store, f"{_ATTEMPT_KEY}/{token}/members")) is None:
            if _read(store, _CURRENT_ATTEMPT) != token:
                break
            _pause_until(deadline, "rank 0 to count every rank in")
        if members is not None and members.split(",")[rank : rank + 1] == [nonce]:
            return token
        stale = token


def _read(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store_has_key(store, key) else None


def _pause_until(deadline: float, waiting_for: str) -> None:
    if time.monotonic() >= deadline:
        raise dist.DistNetworkError(f"waited for {waiting_for} to join this attempt past the timeout")
    time.sleep(0.05)


def join_failed_message(rank: int, world_size: int, address: tuple[str, int], timeout: Any, error: Exception) -> str:
    """Say why a rank could not join the process group, and what to check.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        address: the store's host and port.
        timeout: the strategy's timeout.
        error: what torch raised.

    Returns:
        The message.
    """
    return (
        f"Rank {rank} of {world_size} could not join the process group through the store at"
        f" {address[0]}:{address[1]} ({error}). Check that MASTER_ADDR and MASTER_PORT name the main node and a port"
        " that is free there and reachable from here, and that rank 0 runs; joining waits at most the strategy's"
        f" `timeout` ({timeout})."
    )


_EXIT_HANDLER_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, while it is still whole.

    Lightning leaves the default process group alive when a run ends, and a script that exits with it alive can
    abort in interpreter shutdown: Gloo's worker threads still hold tensors whose release needs the GIL
    ("terminate called without an active exception", SIGABRT after a successful fit). A user who destroyed it
    already is left alone.
    """
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_destroy_default_process_group)
        _EXIT_HANDLER_REGISTERED = True


def end_launched_children(launcher: Any, reason: str, grace_s: float = 0.0) -> None:
    """Kill the processes a Lightning launcher started from this one, which cannot go on without it.

    Under Lightning's own launcher this process is rank 0 and hosts the rendezvous store; the other ranks are its
    children, and Lightning ends them only on KeyboardInterrupt. Otherwise a child still joining the group, or
    blocked in a collective that the dead store cannot fail, waits out the whole timeout as an orphan.

    Args:
        launcher: the strategy's launcher, or ``None``.
        reason: why the job ends, for the message.
        grace_s: how long children may take to exit on their own first (they raised the same error, say).
    """
    children = [proc for proc in getattr(launcher, "procs", None) or () if isinstance(proc, subprocess.Popen)]
    deadline = time.monotonic() + grace_s
    while any(child.poll() is None for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Lightning's launcher starts local rank 1, 2, ... in this order.
    for local_rank, child in enumerate(children, start=1):
        if child.poll() is None:
            log.error(
                "Ending rank process %d (local rank %d), started by this one, since %s", child.pid, local_rank, reason
            )
            child.kill()


def end_children_when_the_script_fails(launcher: Any) -> None:
    """Kill ``launcher``'s child processes if an exception ends this script, once it is printed.

    An exception the script catches leaves them alone. Installed once per process; each launcher is kept until the
    process exits.

    Args:
        launcher: the strategy's launcher, or ``None``.
    """
    global _EXIT_HOOK_INSTALLED
    if launcher is None or not hasattr(launcher, "procs"):
        return
    if not any(launcher is known for known in _WATCHED_LAUNCHERS):
        _WATCHED_LAUNCHERS.append(launcher)
    if not _EXIT_HOOK_INSTALLED:
        install_failure_hook(_end_watched_children, after_printing=True)
        _EXIT_HOOK_INSTALLED = True


_WATCHED_LAUNCHERS: list[Any] = []
_EXIT_HOOK_INSTALLED = False


def _end_watched_children(exception: BaseException) -> None:
    reason = f"this one's script ended with {type(exception).__name__}"
    for launcher in _WATCHED_LAUNCHERS:
        end_launched_children(launcher, reason, grace_s=CHILDREN_GRACE_S)


def next_failure_scope() -> int:
    """Return a new number for a run's failure reports (see :func:`diagnose_failure`); call it once per run."""
    return next(_SCOPES)


def leave_the_job(exception: BaseException, rank: int, waiting: list[int], scope: int, launcher: Any) -> NoReturn:
    """Print ``exception`` (with its notes), let the other ranks learn of it, and end this process (exit code 1).

    For a rank that raised alone: its peers wait for it in a collective that cannot fail while this process lives,
    so a script that caught the error and went on would leave them waiting for the whole timeout.

    1. Print the error: it is the job's cause, so it comes first, and a launcher may kill this process later.
    2. Shut down this rank's connections but the store's: the peers' collectives fail now, while the store is still
       up to take their reports.
    3. Wait, for at most :data:`TOLD_WINDOW_S`, until every rank in ``waiting`` has said in the store that it
       printed its note (:func:`mark_told`), which names this rank and its error. A launcher that ends the job as
       soon as one process exits (Lightning's kills every process within 5 s; torchrun's agent sooner) would
       otherwise cut the peers off before they say it.
    4. End the ranks ``launcher`` started that are still alive, and this process.

    Args:
        exception: what this rank raised, with a note that says why the process ends.
        rank: this process's rank.
        waiting: the ranks that reported no failure (:attr:`FailureReport.silent`): they wait for this one.
        scope: this run's number (:func:`next_failure_scope`).
        launcher: the strategy's launcher, or ``None``.
    """
    _print_exception(exception)
    store = default_store() if dist.is_available() and dist.is_initialized() else None
    _close_peer_connections(keep_port=_store_port(store))
    if store is not None:
        told = [f"{_FAILURE_KEY}/{scope}/{other}/told" for other in waiting]
        deadline = time.monotonic() + TOLD_WINDOW_S
        with contextlib.suppress(Exception):  # a store that died with its host has nobody left to wait for
            store.set_timeout(timedelta(seconds=TOLD_WINDOW_S))
            while not all(store_has_key(store, key) for key in told) and time.monotonic() < deadline:
                time.sleep(0.05)
    end_launched_children(launcher, f"rank {rank} raised alone", grace_s=CHILDREN_GRACE_S)
    _exit_now()


def mark_told(rank: int, scope: int) -> None:
    """Say in the store that this rank printed its note on a failure of run ``scope`` (see :func:`leave_the_job`).

    Args:
        rank: this process's rank.
        scope: the run's number, as given to :func:`diagnose_failure`.
    """
    with contextlib.suppress(Exception):  # nobody waits for it if the store is gone
        default_store().set(f"{_FAILURE_KEY}/{scope}/{rank}/told", "1")


def fail_at_exit(exception: BaseException, rank: int, launcher: Any) -> NoReturn:
    """End this process with exit code 1 for ``exception``, raised while the interpreter exits; print it first.

    Python prints an exception that an ``atexit`` handler raises and ignores it: the process would exit with 0, and
    its launcher or job scheduler would count the run as a success. A failure that surfaces only then (async
    averaging that learns of a dead peer when the engines are closed at exit) must end the job like any other. The
    ``atexit`` handlers registered before the caller's do not run; the ranks ``launcher`` started are ended.

    Args:
        exception: what closing the engines raised, with a note naming the ranks at fault where one was found.
        rank: this process's rank.
        launcher: the strategy's launcher, or ``None``.
    """
    _end_process(exception, launcher, f"rank {rank} failed while its script exited")


def _end_process(exception: BaseException, launcher: Any, reason: str) -> NoReturn:
    end_launched_children(launcher, reason)
    _print_exception(exception)
    _exit_now()


def _print_exception(exception: BaseException) -> None:
    sys.stdout.flush()
    traceback.print_exception(exception)
    sys.stderr.flush()


def _store_port(store: dist.Store | None) -> int | None:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port if isinstance(store, dist.TCPStore) else None


def _close_peer_connections(keep_port: int | None) -> None:
    # Destroying the process group closes nothing while the model (its reducer) and the failed call's frames still
    # hold it, and Gloo's abort leaves its sockets open: shutting the sockets down is what makes the peers' pending
    # receives fail. The store's connections stay up for the peers' reports. Shut down on a duplicate descriptor,
    # so that no descriptor of the process is freed for reuse under the threads that still own the original.
    for entry in os.scandir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError, ValueError):
            fd = int(entry.name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as duplicate:
                if duplicate.family not in (socket.AF_INET, socket.AF_INET6) or duplicate.type != socket.SOCK_STREAM:
                    continue
                local, remote = duplicate.getsockname()[1], duplicate.getpeername()[1]  # unconnected: OSError
                if keep_port not in (local, remote):
                    duplicate.shutdown(socket.SHUT_RDWR)


def _exit_now() -> NoReturn:
    logging.shutdown()
    os._exit(1)


@dataclass(frozen=True)
class FailureReport:
    """What :func:`diagnose_failure` learnt about a failure from the other ranks' reports.

    Attributes:
        rank: this process's rank.
        world_size: the number of processes.
        collective: this rank's error was a failed collective.
        reports: the ranks that reported a failure within the window (this one included), with their errors.
        window_s: how long this rank waited for the reports.
        store_error: why reading the reports failed, or ``None``.
    """

    rank: int
    world_size: int
    collective: bool
    reports: dict[int, str]
    window_s: float
    store_error: str | None = None

    @property
    def silent(self) -> list[int]:
        """The ranks that reported no failure within the window."""
        return [other for other in range(self.world_size) if other not in self.reports]

    @property
    def alone(self) -> bool:
        """This rank's own code raised and some ranks reported nothing in the window: they wait for this one.

        Never when no window was given (the script ends anyway): then nothing was waited for.
        """
        return not self.collective and self.store_error is None and self.window_s > 0 and bool(self.silent)

    def note(self) -> str | None:
        """Return the message naming the ranks at fault, or ``None`` for an error every rank raised."""
        head = f"lightning_bagua: rank {self.rank} of {self.world_size}"
        if self.store_error is not None:
            if not self.collective:
                return None
            return (
                f"{head} saw a collective fail; collecting the other ranks' reports was cut short ({self.store_error})."
                " Either the process hosting the rendezvous store died (rank 0 under Lightning's own launcher or"
                " SLURM), or the launcher ended this process while it waited: torchrun and lightning_bagua.launch end"
                " every rank when one dies, and their summary names the failed rank."
            )
        silent = ", ".join(map(str, self.silent))
        if self.alone:
            return (
                f"{head} raised alone: rank(s) {silent} reported no failure within {self.window_s:g} s, so they are"
                " waiting for this rank in a collective and cannot learn of the error. This process closes its"
                " connections and ends (exit code 1), so that their collectives fail at once instead of waiting out"
                " the timeout."
            )
        if not self.collective:
            return None
        raised = [f"rank {other} ({self.reports[other]})" for other in sorted(self.reports) if other != self.rank]
        parts = [f"{head} saw a collective fail."]
        if self.silent:
            parts.append(
                f"Failed rank(s): {silent} (no report within {self.window_s:g} s: the process died, was killed or"
                " hangs)."
            )
        if raised:
            parts.append(f"Other ranks that raised: {'; '.join(raised)}.")
        return " ".join(parts)


def diagnose_failure(
    exception: BaseException,
    rank: int,
    world_size: int,
    scope: int,
    timeout_s: float | None = None,
    decide_alone: bool = True,
) -> FailureReport:
    """Report this rank's failure to the store and collect the other ranks' reports of the same run.

    Every failing rank writes its error to the rendezvous store, then waits for the others' reports: up to
    :data:`DIAGNOSIS_WINDOW_S` after a failed collective (to name the ranks that raised and those that went
    silent: dead, killed or hung), and up to :data:`SHARED_FAILURE_WINDOW_S` after an error of its own when
    ``decide_alone`` (to tell an error every rank raised from one only this rank raised). Neither wait is longer
    than the collective timeout.

    Args:
        exception: what this rank raised.
        rank: this process's rank.
        world_size: the number of processes.
        scope: this run's number (:func:`next_failure_scope`), which tells its reports from an earlier run's.
        timeout_s: the collective timeout in seconds, or ``None``.
        decide_alone: wait for the reports after an error that is not a failed collective too.

    Returns:
        What the reports say.
    """
    # Keys are per scope, and the default group's store is prefixed per attempt under torchelastic (the agent's
    # store outlives its workers), so old reports never count.
    prefix = f"{_FAILURE_KEY}/{scope}"
    summary = f"{type(exception).__name__}: {str(exception).strip().splitlines()[0] if str(exception).strip() else ''}"
    collective = _looks_like_failed_collective(exception)
    window_s = DIAGNOSIS_WINDOW_S if collective else SHARED_FAILURE_WINDOW_S if decide_alone else 0.0
    if timeout_s is not None:
        window_s = min(window_s, timeout_s)
    reports: dict[int, str] = {rank: summary[:500]}
    try:
        store = default_store()
        # A store that stopped answering must not hold the failing process for the whole collective timeout.
        store.set_timeout(timedelta(seconds=max(window_s, 1.0)))
        store.set(f"{prefix}/{rank}", summary[:500])
        deadline = time.monotonic() + window_s
        while window_s > 0:
            for other in range(world_size):
                if other not in reports and store_has_key(store, f"{prefix}/{other}"):
                    reports[other] = store.get(f"{prefix}/{other}").decode(errors="replace")
            if len(reports) == world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except Exception as error:  # the original error is re-raised either way; this one goes into its note
        # The store dies with the process hosting it, and a launcher's SIGTERM can interrupt the wait.
        return FailureReport(rank, world_size, collective, reports, window_s, f"{type(error).__name__}: {error}")
    return FailureReport(rank, world_size, collective, reports, window_s)


def install_failure_hook(
    on_failure: Callable[[BaseException], None], after_printing: bool = False
) -> Callable[[], None]:
    """Call ``on_failure`` with an exception that ends the script, before (or after) Python prints it.

    For frameworks without an exception hook of their own (Fabric runs the user's loop): the note
    ``on_failure`` adds to the exception is printed with its traceback, and its clean-up runs before the
    ``atexit`` handlers, which could otherwise wait on a dead peer.

    Args:
        on_failure: called once, with the uncaught exception; its own errors are logged, never raised.
        after_printing: call it once the exception is printed (for clean-up that may take a while).

    Returns:
        A function that removes the hook again (a no-op if another hook replaced it since).
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        if after_printing:
            previous(kind, value, trace)
        if not isinstance(value, KeyboardInterrupt):
            try:
                on_failure(value)
            except Exception:  # the user's error is what must reach the screen
                log.exception("lightning_bagua: handling the failure failed too")
        if not after_printing:
            previous(kind, value, trace)

    sys.excepthook = hook

    def remove() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    return remove


def _looks_like_failed_collective(exception: BaseException) -> bool:
    # The error or one of its causes: background work (async averaging) re-raises its collective's failure from a
    # RuntimeError of its own.
    seen: BaseException | None = exception
    while seen is not None:
        if isinstance(seen, getattr(dist, "DistError", ())):
            return True
        text = str(seen).lower()
        if isinstance(seen, RuntimeError) and any(
            marker in text for marker in ("gloo", "nccl", "connection", "timed out", "timeout", "peer")
        ):
            return True
        seen = seen.__cause__
    return False


def _destroy_default_process_group() -> None:
    world = dist.GroupMember.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is not None:
        # The default group (every group with it) through the bridge that frees its backend without the GIL on
        # torch 2.2 to 2.7, where freeing it with the GIL held can deadlock against a Gloo worker.
        destroy_process_group(world)
