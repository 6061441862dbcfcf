"""A rank killed in the middle of writing a checkpoint leaves the previous checkpoint or the new one, each whole.

Rank 0 of a two-process job (Trainer and Fabric, each under Lightning's own launcher) is SIGKILLed once its second
``last`` checkpoint of about 128 MB has its first megabyte on disk. The system's temporary directory is put on
another file system than the checkpoints where the machine has one (``/dev/shm``): there a save that goes through
the system's temporary directory ends in a copy into the checkpoint itself, which such a kill tears. A restart with
``ckpt_path="last"`` must then resume from a whole checkpoint, whatever the killed save left behind.
"""

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_bagua.strategies._core.checkpoint_io import AtomicTorchCheckpointIO, LastCheckpointLinks, save_atomically
from tests.distributed import free_port
from tests.strategies.scripts.kill_during_save import KILL_AFTER_BYTES
from tests.strategies.scripts.killed_save_script import BALLAST_VALUES, LINK_BALLAST_VALUES

ROOT = Path(__file__).parents[2]
TRAINER_SCRIPT = Path(__file__).parent / "scripts" / "killed_save_script.py"
FABRIC_SCRIPT = Path(__file__).parent / "scripts" / "fabric_lifecycle_script.py"


def run(script: Path, *args: str, tmp_path: Path) -> tuple[int, str]:
    """Run ``script`` in a session of its own; return its exit code and output, with no process of it left."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "MASTER_PORT": str(free_port())}
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        env["TMPDIR"] = str(shm)
    command = [sys.executable, str(script), *args]
    process = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        _end_session(process.pid)
    return process.returncode, output


def _end_session(session: int) -> None:
    # The rank the killed process started loses its peer and exits on its own; what is left after 30 s is ended.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(session, signal.SIGKILL)


def assert_killed_mid_write(code: int, output: str, out: Path) -> None:
    assert code == -signal.SIGKILL, output[-6000:]
    # Killed with part of the file written, not before or after the write.
    assert int((out / "killed_at_size").read_text()) >= KILL_AFTER_BYTES


def test_trainer_save_killed_midway_leaves_a_whole_last_checkpoint_and_ckpt_path_last_resumes_from_it(tmp_path):
    checkpoints, first, second = tmp_path / "checkpoints", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    arguments = ["--dir", str(checkpoints), "--max-epochs", "3"]
    code, output = run(TRAINER_SCRIPT, *arguments, "--out", str(first), "--kill-at", "2", tmp_path=tmp_path)
    assert_killed_mid_write(code, output, first)

    # The first epoch's checkpoint, or the second's, whole.
    on_disk = torch.load(checkpoints / "last.ckpt", weights_only=False, mmap=True)
    assert on_disk["epoch"] in (0, 1)
    assert on_disk["ballast"].numel() == BALLAST_VALUES
    assert bool((on_disk["ballast"] == on_disk["epoch"] + 1).all())
    # The killed save's partial file is left, newer than last.ckpt, under a name no lookup takes for a checkpoint.
    leftovers = [path for path in checkpoints.iterdir() if path.name.startswith(".last.ckpt.")]
    assert leftovers
    assert all(path.stat().st_mtime >= (checkpoints / "last.ckpt").stat().st_mtime for path in leftovers)

    code, output = run(TRAINER_SCRIPT, *arguments, "--out", str(second), "--resume", tmp_path=tmp_path)
    assert code == 0, output[-6000:]
    for rank in range(2):
        result = torch.load(second / f"rank{rank}.pt", weights_only=False)
        assert Path(result["ckpt_path"]) == checkpoints / "last.ckpt"
        assert result["loaded"] == {"epoch": on_disk["epoch"], "ballast_values": BALLAST_VALUES, "ballast_whole": True}
        assert result["epoch"] == 3
    # The resumed run's first complete save of last.ckpt removed what the killed one left.
    assert not [path for path in checkpoints.iterdir() if path.name.startswith(".last.ckpt.")]


def test_trainer_killed_as_it_links_last_keeps_last_naming_a_whole_checkpoint_and_resumes_from_it(tmp_path):
    # ModelCheckpoint(save_last="link", save_top_k=1): at epoch 1's link Lightning has removed epoch 0's checkpoint
    # (the one last.ckpt names) and, in its own linking, the old link itself. The kill lands at that link.
    checkpoints, first, second = tmp_path / "checkpoints", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    arguments = ["--dir", str(checkpoints), "--max-epochs", "3", "--link"]
    code, output = run(TRAINER_SCRIPT, *arguments, "--out", str(first), "--kill-at", "2", tmp_path=tmp_path)
    assert code == -signal.SIGKILL, output[-6000:]
    entries = (first / "entries_at_kill").read_text().split()
    assert "last.ckpt" in entries, entries
    assert "epoch=0-step=12.ckpt" in entries, entries

    last = checkpoints / "last.ckpt"
    assert last.is_symlink()
    on_disk = torch.load(last, weights_only=False)  # follows the link: epoch 0's checkpoint, kept for it
    assert on_disk["epoch"] == 0
    assert bool((on_disk["ballast"] == 1).all())

    code, output = run(TRAINER_SCRIPT, *arguments, "--out", str(second), "--resume", tmp_path=tmp_path)
    assert code == 0, output[-6000:]
    for rank in range(2):
        result = torch.load(second / f"rank{rank}.pt", weights_only=False)
        assert Path(result["ckpt_path"]) == last
        assert result["loaded"] == {"epoch": 0, "ballast_values": LINK_BALLAST_VALUES, "ballast_whole": True}
        assert result["epoch"] == 3
    # Epoch 0's checkpoint holds no `last_model_path` yet, so the resumed callback links a new name (Lightning's
    # version counter); the next `ckpt_path="last"` takes the newest, the final checkpoint.
    newest = max(checkpoints.glob("last*.ckpt"), key=lambda path: path.stat().st_mtime)
    assert newest.is_symlink()
    assert newest.resolve() == checkpoints / "epoch=2-step=36.ckpt"
    assert not [path for path in checkpoints.iterdir() if path.name.endswith(".partial")]


class _Strategy:
    def __init__(self) -> None:
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1


class _Trainer:
    is_global_zero = True

    def __init__(self) -> None:
        self.strategy = _Strategy()


def _lightnings_link(trainer: _Trainer, filepath: Path, linkpath: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ModelCheckpoint._link_checkpoint(trainer, str(filepath), str(linkpath))  # type: ignore[arg-type]


def test_last_link_is_renamed_over_the_old_one_where_lightning_removes_the_old_one_first(tmp_path, monkeypatch):
    old, new, last = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    torch.save({"epoch": 0}, old)
    torch.save({"epoch": 1}, new)
    last.symlink_to(old.name)
    seen_at_symlink: list[bool] = []
    symlink = os.symlink

    def watching_symlink(*args, **kwargs):
        seen_at_symlink.append(last.exists())
        symlink(*args, **kwargs)

    monkeypatch.setattr(os, "symlink", watching_symlink)
    # Lightning's own linking: a kill at its symlink would find no last.ckpt.
    _lightnings_link(_Trainer(), new, last)
    assert seen_at_symlink == [False]
    last.unlink()
    symlink(old.name, last)

    trainer = _Trainer()
    LastCheckpointLinks().link(trainer, str(new), str(last))
    assert seen_at_symlink == [False, True]  # ours: last.ckpt names the old checkpoint while the new link is made
    assert os.readlink(last) == new.name
    assert torch.load(last) == {"epoch": 1}
    assert trainer.strategy.barriers == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]


def test_a_checkpoint_the_last_link_names_is_removed_only_once_the_link_names_another(tmp_path):
    first, second, third = (tmp_path / f"epoch={epoch}.ckpt" for epoch in range(3))
    last = tmp_path / "last.ckpt"
    from lightning.pytorch.callbacks import ModelCheckpoint

    links, removed = LastCheckpointLinks(), []
    links.install([ModelCheckpoint(save_last="link")])

    def remove(path: str) -> None:
        removed.append(Path(path).name)
        os.remove(path)

    for path in (first, second, third):
        torch.save({"path": path.name}, path)
    links.link(_Trainer(), str(first), str(last))
    links.remove(str(first), remove)  # top-k drops it while last.ckpt still names it: kept
    assert first.exists()
    assert removed == []
    links.remove(str(third), remove)  # named by no link: removed at once
    assert removed == ["epoch=2.ckpt"]
    links.link(_Trainer(), str(second), str(last))
    assert not first.exists()
    assert removed == ["epoch=2.ckpt", "epoch=0.ckpt"]  # the kept one too goes through the strategy's removal
    assert torch.load(last) == {"path": "epoch=1.ckpt"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=1.ckpt", "last.ckpt"]

    # With no callback linking through it, nothing would remove what it kept: a removal is a removal.
    alone = LastCheckpointLinks()
    alone.remove(str(second), remove)
    assert not second.exists()


def test_last_link_falls_back_to_a_whole_copy_without_symbolic_links_and_refuses_a_directory(tmp_path, monkeypatch):
    checkpoint, last = tmp_path / "epoch=0.ckpt", tmp_path / "last.ckpt"
    torch.save({"epoch": 0}, checkpoint)

    def no_symlinks(*args, **kwargs):
        raise OSError("symbolic links are not permitted here")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    LastCheckpointLinks().link(_Trainer(), str(checkpoint), str(last))
    assert not last.is_symlink()
    assert torch.load(last) == {"epoch": 0}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=0.ckpt", "last.ckpt"]

    last.unlink()
    last.mkdir()
    with pytest.raises(IsADirectoryError, match=r"last\.ckpt' is a directory\. Remove it"):
        LastCheckpointLinks().link(_Trainer(), str(checkpoint), str(last))


def test_the_strategy_makes_each_checkpoint_callback_link_through_it_alone():
    from lightning.pytorch.callbacks import ModelCheckpoint

    class OwnLinks(ModelCheckpoint):
        @staticmethod
        def _link_checkpoint(trainer, filepath, linkpath):  # a user's own linking
            pass

    ours, other, own = ModelCheckpoint(save_last="link"), ModelCheckpoint(save_last="link"), OwnLinks()
    LastCheckpointLinks().install([ours, own])
    assert ours._link_checkpoint is not ModelCheckpoint._link_checkpoint
    assert other._link_checkpoint is ModelCheckpoint._link_checkpoint
    assert own._link_checkpoint is OwnLinks._link_checkpoint


def test_fabric_save_killed_midway_leaves_the_previous_or_the_new_checkpoint_whole(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, output = run(FABRIC_SCRIPT, "--out", str(out), "--mode", "kill_save", tmp_path=tmp_path)
    assert_killed_mid_write(code, output, out)
    on_disk = torch.load(out / "last.ckpt", weights_only=False, mmap=True)
    assert on_disk["step"] in (1, 2)
    assert on_disk["ballast"].numel() == BALLAST_VALUES
    assert bool((on_disk["ballast"] == on_disk["step"]).all())
    # gradient_allreduce keeps no state that the weights and optimizer state do not hold: no entry, as under DDP.
    assert "bagua_algorithm_state" not in on_disk


def test_a_save_that_raises_keeps_the_previous_checkpoint_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicTorchCheckpointIO()
    io.save_checkpoint({"step": 1}, path)
    with pytest.raises((AttributeError, pickle.PicklingError)):  # a lambda cannot be pickled
        io.save_checkpoint({"step": 2, "unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [child.name for child in tmp_path.iterdir()] == ["last.ckpt"]
    with pytest.raises(TypeError, match=r"takes no `storage_options` \(got \{'x': 1\}\)"):
        io.save_checkpoint({"step": 3}, path, storage_options={"x": 1})


def test_a_complete_save_removes_what_killed_saves_to_its_target_left_and_nothing_else(tmp_path):
    killed = tmp_path / ".last.ckpt.0badc0de.partial"
    in_progress = tmp_path / ".last.ckpt.5ca1ab1e.partial"  # another writer, still writing
    other_target = tmp_path / ".epoch=0.ckpt.0badc0de.partial"
    for path in (killed, in_progress, other_target):
        path.write_bytes(b"half a checkpoint")
    os.utime(killed, (time.time() - 60, time.time() - 60))
    os.utime(in_progress, (time.time() + 60, time.time() + 60))

    save_atomically({"step": 3}, tmp_path / "last.ckpt")

    assert torch.load(tmp_path / "last.ckpt") == {"step": 3}
    assert not killed.exists()
    assert in_progress.exists()
    assert other_target.exists()


def test_every_bagua_strategy_saves_through_the_atomic_plugin_by_default():
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_bagua import BaguaStrategy, lightning_fabric, pytorch_lightning
    from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy

    assert type(BaguaStrategy().checkpoint_io) is AtomicTorchCheckpointIO
    assert type(FabricBaguaStrategy().checkpoint_io) is AtomicTorchCheckpointIO
    for strategy in (lightning_fabric.BaguaStrategy(), pytorch_lightning.BaguaStrategy()):
        assert type(strategy.checkpoint_io) is lightning_fabric.AtomicTorchCheckpointIO
    # A plugin the user passes is used as it is.
    own = TorchCheckpointIO()
    assert BaguaStrategy(checkpoint_io=own).checkpoint_io is own
