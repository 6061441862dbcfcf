"""Checkpoint files that a kill cannot tear: written to a temporary file, synced, then renamed over the target.

Lightning's ``TorchCheckpointIO`` serialises into memory and lets fsspec move a temporary file from the system's
temporary directory onto the target. Where that directory is on another file system than the checkpoint (a tmpfs
``/tmp``, a network volume for checkpoints) the move is a copy into the target itself, so a process killed during it
leaves a truncated file under the checkpoint's name, the previous checkpoint gone; and nothing is synced to disk,
so a machine that goes down can leave a file that exists but holds nothing.

:func:`save_atomically` writes next to the target instead, under a name that Lightning never takes for a checkpoint
(``ckpt_path="last"`` picks names that start with ``last`` and end in ``.ckpt``), syncs the file, renames it over
the target (atomic within a directory) and syncs the directory, so the rename itself survives a crash. Until the
rename the target is the previous checkpoint, complete; after it, the new one, complete. A save that completes
removes what killed saves to the same target left behind.
"""

import glob
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

__all__ = ["TEMPORARY_SUFFIX", "AtomicTorchCheckpointIO", "save_atomically"]

log = logging.getLogger(__name__)

TEMPORARY_SUFFIX = ".partial"
"""How the name of a checkpoint still being written ends; a leftover one is from a save that was killed."""

if TYPE_CHECKING:  # the logic, mixed into one class per Fabric package, type-checks as `lightning`'s class
    _IOBase = TorchCheckpointIO
else:
    _IOBase = object


def save_atomically(checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``checkpoint`` to the local ``path`` so that, whenever the process dies, ``path`` is whole.

    Args:
        checkpoint: what ``torch.save`` writes.
        path: the checkpoint's file; its directory is created if missing.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    started = time.time()
    # A leading dot and a suffix of its own: neither Lightning's "last" lookup nor a glob for *.ckpt picks it up.
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")
    # O_EXCL: a name another writer holds is never shared; 0o666 lets the umask decide, as for any new file.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        # The save failed here (the error propagates): the partial file is of no use to anyone.
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    _sync_directory(directory)
    _remove_killed_saves(directory, name, started)


def _sync_directory(directory: str) -> None:
    # The rename lives in the directory's entries: until they reach the disk, a crash could bring back the old name.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class _AtomicTorchCheckpointIOLogic(_IOBase):
    """``TorchCheckpointIO`` whose local saves go through :func:`save_atomically`; shared by both Fabric packages."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save the checkpoint; on a local file system, atomically (see :func:`save_atomically`).

        Remote paths (``s3://``, ...) are written as Lightning's ``TorchCheckpointIO`` writes them: renames are not
        atomic on object stores, which expose an object only once its upload completes.

        Args:
            checkpoint: what ``torch.save`` writes.
            path: where to write it.
            storage_options: not supported, as in ``TorchCheckpointIO``.

        Raises:
            TypeError: ``storage_options`` was given.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes no `storage_options` (got {storage_options!r}). Pass a"
                " CheckpointIO of your own to the strategy to use them."
            )
        if isinstance(get_filesystem(path), LocalFileSystem):
            save_atomically(checkpoint, _local_path(path))
        else:
            super().save_checkpoint(checkpoint, path)


def _local_path(path: Any) -> str:
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


class AtomicTorchCheckpointIO(_AtomicTorchCheckpointIOLogic, TorchCheckpointIO):
    """The checkpoint plugin the Bagua strategies use by default: Lightning's, with saves a kill cannot tear.

    See :func:`save_atomically`. Loading and removing are Lightning's ``TorchCheckpointIO``'s.
    """


def _remove_killed_saves(directory: str, name: str, started: float) -> None:
    # Temporary files of earlier saves to the same target, killed mid-write. One untouched since this save began is
    # no live writer's file in progress: a writer that is alive keeps writing to its file.
    pattern = os.path.join(glob.escape(directory), f".{glob.escape(name)}.*{TEMPORARY_SUFFIX}")
    for leftover in glob.glob(pattern):
        try:
            if os.stat(leftover).st_mtime < started:
                os.remove(leftover)
                log.debug("Removed %s, left by a save that was killed", leftover)
        except FileNotFoundError:  # another process removed it meanwhile
            pass
