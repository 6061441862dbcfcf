"""SIGKILL the calling process in the middle of writing a checkpoint file; the killed-save scripts install it.

An audit hook sees every file the process opens for writing. At the chosen write of a file in the checkpoint
directory whose name contains a given part, a thread watches the file grow and, once it holds some bytes but (for a
large checkpoint) not all, records its size in a marker file and kills the process: nothing of Python's, no
``finally`` and no ``atexit`` handler, runs after that.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Enough written to be the middle of a checkpoint of a hundred megabytes or more.
KILL_AFTER_BYTES = 1 << 20


def kill_during_write(directory: Path, name_part: str, at_write: int, marker: Path) -> None:
    """Kill this process during its ``at_write``-th write (1-based) of a file in ``directory`` named with ``name_part``.

    Args:
        directory: the checkpoint directory.
        name_part: what the file's name contains (``"last"`` for ``last.ckpt`` and any temporary file named after it).
        at_write: which of those writes to kill.
        marker: where to record the size the file had when the process was killed.
    """
    directory_path = os.path.realpath(directory)
    writes = 0

    def hook(event: str, args: tuple[Any, ...]) -> None:
        nonlocal writes
        if event != "open" or not isinstance(args[0], str):
            return
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if mode is not None else bool(flags & (os.O_WRONLY | os.O_RDWR))
        full = os.path.realpath(path)
        if not writing or os.path.dirname(full) != directory_path or name_part not in os.path.basename(full):
            return
        writes += 1
        if writes == at_write:
            threading.Thread(target=_kill_when_written, args=(full, marker), daemon=True).start()

    sys.addaudithook(hook)


def _kill_when_written(path: str, marker: Path) -> None:
    # The audit event comes before the file is created: it is missing at first, and missing again once renamed.
    seen = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            size = os.path.getsize(path)
            seen = True
        except FileNotFoundError:  # not created yet, or renamed already (the save completed unseen: -1)
            size = -1 if seen else 0
        if size >= KILL_AFTER_BYTES or size < 0:
            marker.write_text(str(size))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0002)


def kill_at_link(directory: Path, at_link: int, marker: Path) -> None:
    """Kill this process as it makes its ``at_link``-th symbolic link (1-based) in ``directory``.

    The kill comes before the link is made: with ``ModelCheckpoint(save_last="link")``, after the callback has
    removed what it removes before linking.

    Args:
        directory: the checkpoint directory.
        at_link: which link to kill at.
        marker: where to record the checkpoint directory's entries at the kill.
    """
    directory_path = os.path.realpath(directory)
    links = 0

    def hook(event: str, args: tuple[Any, ...]) -> None:
        nonlocal links
        if event != "os.symlink" or os.path.dirname(os.path.realpath(os.fspath(args[1]))) != directory_path:
            return
        links += 1
        if links == at_link:
            marker.write_text("\n".join(sorted(os.listdir(directory_path))))
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
