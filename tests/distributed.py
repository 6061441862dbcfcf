"""Run a function on several real processes joined by a Gloo process group, and collect what each returns."""

import contextlib
import io
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_bagua.engine._torch_compat import destroy_process_group

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
ROOT = Path(__file__).resolve().parents[1]


# Ports are taken below Linux's ephemeral range (32768-60999), where the kernel hands out the ports that NCCL's and
# Gloo's own sockets bind: a port the OS just picked as free could be taken by them before the store listens on it.
# Processes that run tests side by side (``tests/run_gpu_tests.py``'s shards) each get a block of their own through
# ``BAGUA_TEST_PORT_BLOCK``; one process walks its block, so it never hands out a port twice.
PORT_BLOCK_SIZE = 2000
PORTS_FROM = 12000
_BLOCK_START = PORTS_FROM + PORT_BLOCK_SIZE * int(os.environ.get("BAGUA_TEST_PORT_BLOCK", "0"))
_next_offset = [os.getpid() % 500]  # where in the block this process looks next


def free_port() -> int:
    """A port no other socket of this machine has bound, from this process's block (see above)."""
    for _ in range(PORT_BLOCK_SIZE):
        port = _BLOCK_START + _next_offset[0]
        _next_offset[0] = (_next_offset[0] + 1) % PORT_BLOCK_SIZE
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(
        f"No free port in {_BLOCK_START}-{_BLOCK_START + PORT_BLOCK_SIZE - 1}: is an earlier test hanging?"
    )


def run_torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 240) -> None:
    """Run ``script`` with ``args`` under torchrun on ``nproc`` local processes, from the repository root.

    Raises an ``AssertionError`` with the end of the job's output unless every process exits with 0.
    """
    completed = torchrun(script, *args, nproc=nproc, timeout=timeout)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` under torchrun on ``nproc`` local processes through :func:`run_job`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(script), *args]  # fmt: skip
    return run_job(command, timeout=timeout)


def run_job(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root, with the repository importable and ``env`` set, capturing its output.

    A job still running after ``timeout`` seconds fails the test with what a hang needs to be found: whether the
    launcher itself had exited (a process it left behind may hold the output pipes open), the processes left, and
    the Python stack of every thread of each of them. ``PYTHONFAULTHANDLER`` makes each Python process print its
    stacks to the captured stderr when it is sent ``SIGABRT``; the rest are then killed.
    """
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONFAULTHANDLER": "1", **(env or {})}
    with subprocess.Popen(
        command, env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launcher = "had exited" if process.poll() is not None else "was still running"
            left = _process_tree(process.pid)
            listing = "\n".join(f"  {pid} {_command_line(pid)}" for pid in left)
            # Workers first, so that their stacks are dumped before the launcher reacts to their end.
            for signal_number in (signal.SIGABRT, signal.SIGKILL):
                for pid in reversed(left):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal_number)
                time.sleep(2)
            try:
                stdout, stderr = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                stdout, stderr = "", "(the output pipes stayed open after the job was killed)"
            raise AssertionError(
                f"{command} timed out after {timeout} s; the launcher {launcher}. Processes left:\n{listing}\n"
                f"--- stdout (end) ---\n{stdout[-3000:]}\n--- stderr (end, with the stacks) ---\n{stderr[-20000:]}"
            ) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _process_tree(root: int) -> list[int]:
    """``root`` and its live descendants, parents before children (Linux: read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The command name, in parentheses, may hold spaces: the fields after its closing one are fixed.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, index = [root], 0
    while index < len(tree):
        tree.extend(children.get(tree[index], []))
        index += 1
    return tree


def _command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _child(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    env: dict[str, str],
    args: tuple,
    results: Any,
) -> None:
    # A forkserver's child starts with the server's environment: take the test's, as a spawned child would.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        try:
            # Serialised to bytes: tensors sent as such travel as shared-memory handles that die with the child.
            buffer = io.BytesIO()
            torch.save(target(rank, world_size, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            if dist.is_initialized():  # the target may have destroyed it
                # Not torch's function: on torch 2.2 to 2.7 freeing a group can deadlock (see _torch_compat).
                destroy_process_group(dist.GroupMember.WORLD)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


# What every test process imports: the forkserver imports it once; each process is a fork of it.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "pytest", "lightning_bagua.engine", "tests.distributed"]


def _context() -> multiprocessing.context.BaseContext:
    """Start processes from a forkserver that has imported torch and the engine, each a fresh fork of it.

    A spawned process imports torch and the engine anew, seconds on a busy two-core machine, for every process of
    every test. A fork of the server gets them loaded and still shares no state with any other test's processes:
    the server only imports, it never runs a test or touches a device.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_processes(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    timeout: float = 180,
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    With ``backend="nccl"`` rank r uses GPU r. ``target`` must be importable (a module-level function). A failure
    on any rank fails the call with that rank's traceback; a hang fails it after ``timeout`` seconds with every
    process killed.
    """
    context = _context()
    results = context.Queue()
    port = free_port()
    child_env = {**os.environ, **(env or {})}
    processes = [
        context.Process(target=_child, args=(target, rank, world_size, port, backend, child_env, args, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size and not errors:
            # Taken before the wait: whatever a rank wrote before it died is in the queue by then, and read first.
            dead = _died_silently(processes, collected)
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if not dead and time.monotonic() > deadline:
                    waiting = [rank for rank in range(world_size) if rank not in collected]
                    dead = [f"ranks {waiting} reported nothing within {timeout} s: killed"]
                errors.extend(dead)
                continue
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
            else:
                collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=5 if errors else timeout)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[rank] for rank in range(world_size)]


def _died_silently(processes: list[multiprocessing.process.BaseProcess], collected: dict[int, Any]) -> list[str]:
    """The ranks that exited with an error code and have not reported (a rank that reported exits with 0)."""
    return [
        f"rank {rank} exited with code {process.exitcode} before reporting"
        for rank, process in enumerate(processes)
        if rank not in collected and process.exitcode not in (None, 0)
    ]


def assert_ranks_identical(results: list[dict]) -> None:
    """Assert that every rank's ``results[rank]["state"]`` equals rank 0's, bit for bit."""
    for rank, result in enumerate(results[1:], start=1):
        for name, tensor in result["state"].items():
            assert torch.equal(tensor, results[0]["state"][name]), f"rank {rank} differs from rank 0 in {name}"
