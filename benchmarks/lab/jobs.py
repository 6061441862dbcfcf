"""Jobs launched as subprocesses and disturbed from outside: their environment, their processes, their end.

The robustness benchmarks (``chaos.py``, ``dead_rank_exit.py``) start a training job under a launcher
(:func:`torchrun`, :func:`job_env`), find its workers among the machine's processes (:func:`live_processes`), kill
some of them (:func:`kill_all`), and make sure that nothing of the job outlives it.
"""

import contextlib
import os
import signal
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a launcher sets for its workers: a job started from a worker must not inherit its parent's.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME")  # fmt: skip


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
