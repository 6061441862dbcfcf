"""Joining the process group without long hangs, and failing with a message that names the ranks at fault."""

import atexit
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_bagua.engine._torch_compat import default_store, store_has_key

__all__ = [
    "DIAGNOSIS_WINDOW_S",
    "destroy_process_group_at_exit",
    "diagnose_failure",
    "end_launched_children",
    "init_restarted_process_group",
    "install_failure_hook",
    "join_failed_message",
    "restart_count",
    "wait_for_store",
]

log = logging.getLogger(__name__)

DIAGNOSIS_WINDOW_S = 5.0
"""How long a rank whose collective failed waits for the others' reports before naming the silent ones."""

_FAILURE_KEY = "lightning_bagua/failure"


def restart_count() -> int:
    """Return how often torch's elastic agent restarted this job's workers (0 outside torchelastic)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


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


def init_restarted_process_group(
    address: tuple[str, int], backend: str, rank: int, world_size: int, timeout: timedelta | None
) -> None:
    """Join the default process group of a restarted torchelastic attempt, under store keys of its own.

    torch's elastic agent keeps one store for all attempts, and the process group's keys (each rank's address)
    carry no attempt number: a restarted rank can read the address of a rank that died in the last attempt and
    fail to connect. Keys under a prefix of their own per attempt cannot be stale; the frameworks then find the
    group initialised and keep it.

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
    log.info("Joining the process group of restart %d under its own store prefix", restart_count())
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_bagua/restart_{restart_count()}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


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


def end_launched_children(launcher: Any) -> None:
    """Kill the processes a Lightning launcher started from this one, which cannot go on without it.

    Under Lightning's own launcher this process is rank 0 and hosts the rendezvous store; the other ranks are its
    children, and Lightning ends them only on KeyboardInterrupt. Otherwise a child still joining the group, or
    blocked in a collective that the dead store cannot fail, waits out the whole timeout as an orphan.

    Args:
        launcher: the strategy's launcher, or ``None``.
    """
    children = [proc for proc in getattr(launcher, "procs", None) or () if isinstance(proc, subprocess.Popen)]
    for child in children:
        if child.poll() is None:
            log.error("Ending rank process %d, started by this one, since this one is failing", child.pid)
            child.kill()


def diagnose_failure(exception: BaseException, rank: int, world_size: int, scope: int, window_s: float) -> str | None:
    """Report this rank's failure to the store; after a failed collective, return a note naming the silent ranks.

    Every failing rank writes its error to the rendezvous store. A rank whose error looks like a failed collective
    then waits up to ``window_s`` for the others' reports and names the ranks that raised (with their errors) and
    those that never reported: dead (killed, out of memory) or hung.

    Args:
        exception: what this rank raised.
        rank: this process's rank.
        world_size: the number of processes.
        scope: a number that tells this run's reports from an earlier run's in the same store (the fit, say).
        window_s: how long to wait for the others' reports.

    Returns:
        The note, or ``None`` when the error was not a failed collective.
    """
    # Keys are per restart (the agent's store outlives its workers) and per scope, so old reports never count.
    prefix = f"{_FAILURE_KEY}/{restart_count()}/{scope}"
    summary = f"{type(exception).__name__}: {str(exception).strip().splitlines()[0] if str(exception).strip() else ''}"
    collective = _looks_like_failed_collective(exception)
    try:
        store = default_store()
        # A store that stopped answering must not hold the failing process for the whole collective timeout.
        store.set_timeout(timedelta(seconds=max(window_s, 1.0)))
        store.set(f"{prefix}/{rank}", summary[:500])
        if not collective:
            return None
        reports: dict[int, str] = {}
        deadline = time.monotonic() + window_s
        while True:
            for other in range(world_size):
                if other not in reports and store_has_key(store, f"{prefix}/{other}"):
                    reports[other] = store.get(f"{prefix}/{other}").decode(errors="replace")
            if len(reports) == world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except Exception as error:  # the original error is re-raised either way; this one goes into its note
        # The store dies with the process hosting it, and a launcher's SIGTERM can interrupt the wait.
        if not collective:
            return None
        return (
            f"lightning_bagua: rank {rank} of {world_size} saw a collective fail; collecting the other ranks'"
            f" reports failed too ({type(error).__name__}: {error}). If the rendezvous store is gone, the process"
            " hosting it died: rank 0 under Lightning's own launcher; under torchrun or lightning_bagua.launch the"
            " agent, whose summary names the failed rank."
        )
    silent = [other for other in range(world_size) if other not in reports]
    raised = [f"rank {other} ({reports[other]})" for other in sorted(reports) if other != rank]
    parts = [f"lightning_bagua: rank {rank} of {world_size} saw a collective fail."]
    if silent:
        parts.append(
            f"Failed rank(s): {', '.join(map(str, silent))} (no report within {window_s:g} s: the process died,"
            " was killed or hangs)."
        )
    if raised:
        parts.append(f"Other ranks that raised: {'; '.join(raised)}.")
    return " ".join(parts)


def install_failure_hook(on_failure: Callable[[BaseException], None]) -> Callable[[], None]:
    """Call ``on_failure`` with an exception that ends the script, before Python prints it.

    For frameworks without an exception hook of their own (Fabric runs the user's loop): the note
    ``on_failure`` adds to the exception is printed with its traceback, and its clean-up runs before the
    ``atexit`` handlers, which could otherwise wait on a dead peer.

    Args:
        on_failure: called once, with the uncaught exception; its own errors are logged, never raised.

    Returns:
        A function that removes the hook again (a no-op if another hook replaced it since).
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        if not isinstance(value, KeyboardInterrupt):
            try:
                on_failure(value)
            except Exception:  # the user's error is what must reach the screen
                log.exception("lightning_bagua: handling the failure failed too")
        previous(kind, value, traceback)

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
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
