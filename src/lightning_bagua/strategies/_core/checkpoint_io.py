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

``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symbolic link outside the checkpoint plugin, in steps
that a kill can part; :class:`LastCheckpointLinks` keeps ``last.ckpt`` whole through them.
"""

import glob
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

__all__ = [
    "TEMPORARY_SUFFIX",
    "AtomicTorchCheckpointIO",
    "LastCheckpointLinks",
    "save_atomically",
]

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
    _write_atomically(path, lambda file: torch.save(checkpoint, file))


def _write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    started = time.time()
    temporary = _temporary_name(directory, name)
    # O_EXCL: a name another writer holds is never shared; 0o666 lets the umask decide, as for any new file.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
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


def _temporary_name(directory: str, name: str) -> str:
    # A leading dot and a suffix of its own: neither Lightning's "last" lookup nor a glob for *.ckpt picks it up.
    return os.path.join(directory, f".{name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")


_LIGHTNING_CALLBACK_MODULES = ("lightning.pytorch.", "pytorch_lightning.")


class LastCheckpointLinks:
    """Link ``last.ckpt`` to the newest checkpoint so that a kill at any moment leaves it naming a whole checkpoint.

    ``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symbolic link outside the checkpoint plugin, in two
    steps that a kill can part, each of which leaves no checkpoint under ``last.ckpt`` (``ckpt_path="last"`` then
    finds none, and the restart starts afresh):

    - it removes the old link before it makes the new one;
    - with ``save_top_k=1`` it removes the previous checkpoint, the one the link still names, before it links the
      new one.

    :meth:`install` has the callbacks link through :meth:`link`, which renames a new link over the old one, and the
    strategy removes checkpoints through :meth:`remove`, which keeps a checkpoint that a link still names until the
    link names another.
    """

    def __init__(self) -> None:
        # Each checkpoint kept for a link, with what `remove` was given to remove it: the removal is only put off.
        self._kept: dict[str, Callable[[Any], None]] = {}
        self._linking = False  # whether any callback links through `link`, which removes what is kept

    def install(self, callbacks: Any) -> None:
        """Make every checkpoint callback among ``callbacks`` that links as Lightning does link through :meth:`link`.

        Args:
            callbacks: the Trainer's checkpoint callbacks.
        """
        for callback in callbacks:
            owner = next((klass for klass in type(callback).__mro__ if "_link_checkpoint" in vars(klass)), None)
            # Only Lightning's own linking: a subclass that links its own way is left to it.
            if owner is None or not owner.__module__.startswith(_LIGHTNING_CALLBACK_MODULES):
                continue
            # Lightning calls `self._link_checkpoint(trainer, filepath, linkpath)`, a static method: an attribute
            # of the instance takes its place for this callback alone.
            callback._link_checkpoint = self._linking_locally(type(callback)._link_checkpoint)
            self._linking = True

    def link(self, trainer: Any, filepath: str, linkpath: str) -> None:
        """Point the link ``linkpath`` at ``filepath`` on global rank zero, then meet every rank at a barrier.

        The new link is made under a temporary name beside ``linkpath`` and renamed over it: ``linkpath`` names the
        previous checkpoint until the rename, and the new one after it. Checkpoints kept for the old link are then
        removed, each by what :meth:`remove` was given to remove it (the strategy's ``remove_checkpoint``, through
        its checkpoint plugin). Where the file system refuses symbolic links, the checkpoint is copied instead, as
        Lightning does, and the copy renamed over ``linkpath`` too.

        Args:
            trainer: the Trainer whose checkpoint callback links.
            filepath: the checkpoint just saved.
            linkpath: the link to point at it (``last.ckpt``).

        Raises:
            IsADirectoryError: ``linkpath`` is a directory.
        """
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            directory, name = os.path.split(os.path.abspath(linkpath))
            os.makedirs(directory, exist_ok=True)
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                raise IsADirectoryError(
                    f"ModelCheckpoint(save_last='link') cannot link {linkpath!r} to {filepath!r}: {linkpath!r} is a"
                    " directory. Remove it, or give the callback another `dirpath`."
                )
            temporary = _temporary_name(directory, name)
            try:
                os.symlink(os.path.relpath(filepath, directory), temporary)
            except OSError:  # no symbolic links here (Windows without the privilege): a whole copy, as Lightning's
                with open(filepath, "rb") as source:
                    _write_atomically(linkpath, lambda file: shutil.copyfileobj(source, file))
            else:
                os.replace(temporary, linkpath)
                _sync_directory(directory)
            for kept in sorted(self._kept):
                if not _linked(kept):
                    remove = self._kept.pop(kept)
                    if os.path.exists(kept):
                        remove(kept)
        trainer.strategy.barrier()

    def remove(self, filepath: Any, remove: Callable[[Any], None]) -> None:
        """Remove the checkpoint ``filepath`` with ``remove``, unless a link beside it names it: then at the next link.

        Args:
            filepath: the checkpoint to remove.
            remove: what removes it (the strategy's own ``remove_checkpoint``).
        """
        local = self._linking and isinstance(get_filesystem(filepath), LocalFileSystem)
        if local and _linked(path := _local_path(filepath)):
            self._kept[os.path.realpath(path)] = remove
            log.debug("Keeping %s until last.ckpt links to another checkpoint", path)
        else:
            remove(filepath)

    def _linking_locally(self, lightnings: Callable[[Any, str, str], None]) -> Callable[[Any, str, str], None]:
        # On object stores there are no links to rename: Lightning's own linking says what it makes of those paths.
        def link(trainer: Any, filepath: str, linkpath: str) -> None:
            if isinstance(get_filesystem(linkpath), LocalFileSystem):
                self.link(trainer, _local_path(filepath), _local_path(linkpath))
            else:
                lightnings(trainer, filepath, linkpath)

        return link


def _linked(path: str) -> bool:
    # Whether a symbolic link in the checkpoint's directory names it: only links there are Lightning's `last` ones.
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return False
    return any(entry.is_symlink() and os.path.realpath(entry.path) == target for entry in entries)


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
