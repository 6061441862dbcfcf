"""Jobs launched as subprocesses and disturbed from outside: their environment, their processes, their end.

The robustness lab (``robustness.py``) starts a training job under a launcher (:class:`Job`, :func:`torchrun`,
:func:`job_env`), finds its workers among the machine's processes (:func:`live_processes`, :func:`job_pids`), kills
some of them (:func:`kill_all`), and makes sure that nothing of the job outlives it (:meth:`Job.finish`).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a launcher sets for its workers: a job started from a worker must not inherit its parent's.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME")  # fmt: skip
# Every process of a job inherits this variable from its launcher: how the job is found whole, whatever its parents.
JOB_VARIABLE = "LIGHTNING_BAGUA_FAULT_JOB"
# Often enough to catch a 0.3 s save and a step of ~10 ms, rarely enough to leave the CPUs to the job.
POLL_S = 0.005


def job_env(paths: Sequence[Path] = (REPO,), **variables: str) -> dict[str, str]:
    """This environment without :data:`LAUNCH_VARIABLES`, ``paths`` ahead on ``PYTHONPATH``, and ``variables``."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths), env.get("PYTHONPATH", "")]))
    env.update(variables)
    return env


def torchrun(*options: str) -> list[str]:
    """``python -m torch.distributed.run OPTIONS`` with this interpreter; the script and its arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", *options]


def live_processes() -> Iterator[tuple[int, int, dict[str, str]]]:
    """``(pid, parent pid, environment)`` of every live process that can be read, zombies and this one left out."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            # The command name, in parentheses, may hold spaces: the fields after its closing parenthesis are fixed.
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if state == "Z":  # killed, not yet reaped: no longer a process to find or to kill
            continue
        variables = dict(item.decode(errors="replace").partition("=")[::2] for item in environ if b"=" in item)
        yield int(entry.name), int(parent), variables


def kill_all(pids: Iterable[int], group: bool = False) -> None:
    """SIGKILL each of ``pids`` (with ``group``, each one's process group); those already gone are skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def job_pids(job_id: str) -> list[int]:
    """Return the live processes whose environment carries ``job_id`` as :data:`JOB_VARIABLE`."""
    return [pid for pid, _, env in live_processes() if env.get(JOB_VARIABLE) == job_id]


class Job:
    """Commands launched side by side (a launcher per node, say), each in a session of its own, all writing to
    ``log``, with ``env`` (by default :func:`job_env`'s) and the job's id in :data:`JOB_VARIABLE`."""

    def __init__(self, commands: list[list[str]], log: Path, env: dict[str, str] | None = None) -> None:
        self.id, self.log_path, self.log = uuid.uuid4().hex, log, log.open("w")
        env = {**(job_env() if env is None else env), JOB_VARIABLE: self.id}
        self.processes = [
            subprocess.Popen(
                command, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
            )
            for command in commands
        ]
        self.started = time.monotonic()
        self.exited = 0.0  # the wall-clock time when every command had exited, or been killed as a hang
        self.leftovers: list[int] = []  # the job's processes that outlived the commands and the grace

    @property
    def returncodes(self) -> list[int | None]:
        """Return the commands' exit codes, ``None`` for one still running."""
        return [process.returncode for process in self.processes]

    def output(self) -> str:
        """Return what the commands wrote so far."""
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        """Return whether any command is still running."""
        return any(process.poll() is None for process in self.processes)

    def wait_for(self, condition: Callable[[], bool], deadline: float) -> bool:
        """Poll ``condition`` until it holds (True), or the job ends or ``deadline`` passes (False)."""
        while time.monotonic() < deadline and self.running():
            if condition():
                return True
            time.sleep(POLL_S)
        return False

    def kill(self) -> None:
        """SIGKILL every process of the job: the commands' sessions, then whatever else carries the job's id."""
        kill_all([process.pid for process in self.processes], group=True)
        kill_all(job_pids(self.id))

    def finish(self, deadline: float, grace_s: float = 0.0) -> bool:
        """Wait for the commands until ``deadline``, then end the job whole; return whether they hung.

        Args:
            deadline: the :func:`time.monotonic` time after which a command still running is killed as a hang.
            grace_s: how long the processes the commands started may take to exit after them before they count
                as left behind (:attr:`leftovers`).
        """
        try:
            for process in self.processes:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            hang = False
        except subprocess.TimeoutExpired:
            hang = True
            self.kill()
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
        self.exited = time.time()
        grace = time.monotonic() + grace_s
        while job_pids(self.id) and time.monotonic() < grace:
            time.sleep(0.1)
        self.leftovers = job_pids(self.id)
        # Processes a launcher left behind (it should leave none) would hold ports and CPUs for the next job.
        self.kill()
        self.log.close()
        return hang
