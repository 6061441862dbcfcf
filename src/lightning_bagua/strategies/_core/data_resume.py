"""Exact resume in the middle of an epoch with a plain ``DataLoader``: the data's position and the generators' states.

Lightning restarts an epoch's data from its first batch when it resumes from a checkpoint taken in the middle of
that epoch, unless the dataloader can save its position. The strategy knows the distributed sampler the framework
put into the training dataloader, so it keeps that position itself:

- When the training dataloader is prepared, the sampler of its ``BatchSampler`` is replaced by a
  :class:`PositionedSampler`, which yields the same indices and notes the global torch generator's state before the
  dataloader's iterator drew its base seed (the seed of its worker processes).
- A checkpoint written while fitting gets, in its ``"bagua"`` entry, a ``"data"`` entry (:func:`data_entry`): the
  epoch, how many of its batches were trained on, the sampler's seed, and, for every rank, the states of the random
  number generators (torch's CPU and CUDA generators, Python's ``random``, NumPy's if NumPy is loaded) and that
  pre-draw state.
- Resuming (:class:`DataResume`), the sampler gets the saved seed and epoch and skips the indices of the batches
  already trained on, so none of them is loaded; the resumed iterator draws the same base seed; and the generators
  are put back in their saved states just before the first batch.
"""

import itertools
import random
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, IterableDataset, Sampler

from lightning_bagua.strategies._core.checkpoint import gather_to_rank_zero

__all__ = [
    "DATA_KEY",
    "DataResume",
    "DataState",
    "PositionedSampler",
    "capture_rng_states",
    "data_entry",
    "positioned_sampler",
    "restore_rng_states",
]

DATA_KEY = "data"
"""Where the data's position is saved inside the checkpoint's ``"bagua"`` entry."""


def capture_rng_states() -> dict[str, Any]:
    """Return the states of every random number generator a training step may draw from, on this process."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    # Only where the script loaded NumPy: importing it here would cost every user who does not use it.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
        # As a tensor and plain numbers: checkpoints load with `weights_only=True`, which refuses NumPy arrays.
        states["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Put every generator saved by :func:`capture_rng_states` back in its saved state.

    Args:
        states: what :func:`capture_rng_states` returned.
    """
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        saved = states["numpy"]
        keys = saved["keys"].numpy().astype(numpy.uint32)
        numpy.random.set_state((saved["name"], keys, saved["position"], saved["has_gauss"], saved["cached_gaussian"]))


def _after_one_seed_draw(state: Tensor) -> Tensor:
    """Return the CPU generator state that follows ``state`` once a dataloader iterator has drawn its base seed."""
    generator = torch.Generator()
    generator.set_state(state)
    # The draw torch's dataloader iterators make for their base seed (one 64-bit integer).
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return generator.get_state()


class PositionedSampler(Sampler[int]):
    """Stand in for a ``BatchSampler``'s sampler: yield its indices, skipping those of batches already trained on.

    It also keeps the global torch generator's state from before the current dataloader iterator drew its base seed,
    so that a resumed iterator can draw the same one. That state is only known where it can be checked: the
    strategy (or :meth:`set_epoch`) notes a candidate before the iterator is created, and :meth:`__iter__`, which
    the iterator calls after its draw, keeps the candidate only if exactly one draw separates it from the current
    state (or none, for persistent workers, which keep their seed). Otherwise something else drew from the
    generator in between (an ``on_train_epoch_start`` hook, say) and the base seed is not resumed.

    Args:
        sampler: the sampler it stands in for (the framework's ``DistributedSampler``).
        batch_size: the batch sampler's batch size.
    """

    def __init__(self, sampler: Iterable[int], batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self._skip_batches = 0
        self._candidate: Tensor | None = None
        self._pending_rng: Mapping[str, Any] | None = None
        # A resumed epoch: the epoch the framework's next `set_epoch` means, and what it adds to the later ones
        # (Fabric's loader counts its epochs from 0 again in a new process).
        self._pinned_epoch: int | None = None
        self._epoch_offset = 0
        # A finished epoch resumed, the generator states at its end, and whether the framework set it again.
        self._finished: tuple[int, Mapping[str, Any], bool] | None = None
        self.seed_state: Tensor | None = None
        """The torch CPU generator's state before the current iterator drew its base seed; ``None`` if unknown."""

    def note_generator(self) -> None:
        """Note the global torch generator's state: a dataloader iterator may draw its base seed from it next."""
        self._candidate = torch.get_rng_state()

    def resume_at(
        self, epoch: int, batches: int, rng: Mapping[str, Any] | None, framework_counts_epochs: bool = False
    ) -> None:
        """Resume at a saved position: the next iteration is of ``epoch``, without its first ``batches`` batches.

        Args:
            epoch: the epoch to resume.
            batches: how many of its batches were already trained on.
            rng: the generator states to restore once the resumed iterator has drawn its base seed, if any.
            framework_counts_epochs: the framework's ``set_epoch`` numbers are the run's own (the Trainer restores
                its epoch count, and may set a finished epoch again before the next); otherwise its next
                ``set_epoch`` means ``epoch``, whatever number it passes (Fabric's loop counts from 0 again).
        """
        self._set_inner_epoch(epoch)
        self._pinned_epoch = None if framework_counts_epochs else epoch
        self._epoch_offset = 0
        self._finished = None
        self._skip_batches = batches
        self._pending_rng = rng

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the sampler it stands in for; a new iterator may draw its base seed next.

        Args:
            epoch: the epoch number, as the framework counts it.
        """
        if self._pinned_epoch is not None:
            self._epoch_offset, self._pinned_epoch = self._pinned_epoch - epoch, None
        self._set_inner_epoch(epoch + self._epoch_offset)
        if self._finished is not None:
            finished, rng, set_again = self._finished
            if epoch == finished:
                self._finished = (finished, rng, True)
            elif epoch == finished + 1 and set_again:
                # The framework went through the finished epoch again, after making an iterator for it when it
                # prepared the data: the next epoch's iterator draws its base seed next, as in the undisturbed run
                # right after the checkpoint.
                restore_rng_states(rng)
                self._finished = None
        self.note_generator()

    def resume_after_finished_epoch(self, epoch: int, rng: Mapping[str, Any]) -> None:
        """Note that the resumed checkpoint was written once ``epoch`` had all its batches, with generators ``rng``.

        If the framework sets ``epoch`` again (the Trainer does when the checkpoint was written before the epoch's
        end, by a validation at its last batch), the generators are restored once more when it sets the next.

        Args:
            epoch: the finished epoch, as the framework counts it.
            rng: the generator states at the checkpoint.
        """
        self._finished = (epoch, rng, False)

    def _set_inner_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the sampler it stands in for (0 for one without epochs)."""
        return int(getattr(self.sampler, "epoch", 0))

    def __iter__(self) -> Iterator[int]:
        current = torch.get_rng_state()
        if self._candidate is not None and torch.equal(_after_one_seed_draw(self._candidate), current):
            self.seed_state = self._candidate
        elif self._candidate is None or not torch.equal(self._candidate, current):
            self.seed_state = None
        # Otherwise no draw happened: persistent workers keep the base seed of the iterator that started them.
        self._candidate = None
        rng, self._pending_rng = self._pending_rng, None
        if rng is not None:
            # The resumed iterator has drawn its base seed: the next draws are those after the checkpoint.
            restore_rng_states(rng)
        skip, self._skip_batches = self._skip_batches * self.batch_size, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


def positioned_sampler(dataloader: object) -> PositionedSampler | None:
    """Put a :class:`PositionedSampler` into a dataloader's ``BatchSampler`` (once) and return it.

    Args:
        dataloader: the training dataloader the framework prepared.

    Returns:
        The dataloader's positioned sampler; ``None`` where its batches do not come from a torch ``BatchSampler``
        over a map-style dataset (a loader without automatic batching, a custom batch sampler, an
        ``IterableDataset``, which ignores the indices), whose position is not resumed.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if isinstance(getattr(dataloader, "dataset", None), IterableDataset):
        return None
    if type(batch_sampler) is not BatchSampler:
        # A subclass or another batch sampler may batch differently: skipping `batch_size` indices per batch would
        # not skip its batches.
        return None
    if isinstance(batch_sampler.sampler, PositionedSampler):
        return batch_sampler.sampler
    positioned = PositionedSampler(batch_sampler.sampler, batch_sampler.batch_size)
    batch_sampler.sampler = positioned
    return positioned


def data_entry(
    positioned: PositionedSampler,
    rng: dict[str, Any],
    epoch: int,
    batches: int,
    epoch_done: bool,
    world_size: int,
) -> dict[str, Any] | None:
    """Gather the data's position and every rank's generator states to rank 0 (collective: every rank calls it).

    Args:
        positioned: the training dataloader's positioned sampler.
        rng: this rank's generator states at the checkpoint (:func:`capture_rng_states`).
        epoch: the current epoch.
        batches: how many batches of it were trained on.
        epoch_done: whether the epoch's batches are all trained on (the next one starts afresh).
        world_size: the number of processes.

    Returns:
        The ``"data"`` entry on rank 0, ``None`` on the other ranks.
    """
    own = {"rng": rng, "seed_state": positioned.seed_state}
    gathered = gather_to_rank_zero(own, world_size)
    if gathered is None:
        return None
    return {
        "epoch": epoch,
        "batches": batches,
        "epoch_done": epoch_done,
        "sampler_seed": getattr(positioned.sampler, "seed", None),
        "world_size": world_size,
        "ranks": gathered,
    }


class DataResume:
    """One rank's part of a checkpoint's ``"data"`` entry, applied to the training dataloader when it is prepared.

    Args:
        entry: the checkpoint's ``"data"`` entry.
        rank: this process's rank.
        framework_counts_epochs: see :meth:`PositionedSampler.resume_at` (the Trainer: ``True``).
    """

    def __init__(self, entry: Mapping[str, Any], rank: int, framework_counts_epochs: bool = False) -> None:
        self.framework_counts_epochs = framework_counts_epochs
        self.epoch_done = bool(entry["epoch_done"])
        # A finished epoch resumes at the start of the next one.
        self.epoch = int(entry["epoch"]) + (1 if self.epoch_done else 0)
        self.batches = 0 if self.epoch_done else int(entry["batches"])
        self.sampler_seed: int | None = entry.get("sampler_seed")
        own = entry["ranks"][rank]
        self.rng: dict[str, Any] = own["rng"]
        self.seed_state: Tensor | None = own["seed_state"]
        self._rng_pending = True

    def apply(self, positioned: PositionedSampler) -> None:
        """Place the sampler at the saved position; call it before the resumed iterator is created.

        Args:
            positioned: the training dataloader's positioned sampler.
        """
        sampler = positioned.sampler
        if self.sampler_seed is not None and hasattr(sampler, "seed"):
            sampler.seed = self.sampler_seed
        if self.epoch_done:
            # The undisturbed run drew the next iterator's base seed after the checkpoint, from these states.
            self.restore_rng()
            positioned.resume_at(self.epoch, 0, None, self.framework_counts_epochs)
            if self.framework_counts_epochs:
                positioned.resume_after_finished_epoch(self.epoch - 1, self.rng)
        else:
            if self.seed_state is not None:
                # The undisturbed run's iterator for this epoch drew its base seed from this state; so does the
                # resumed one, whose next checkpoint saves it again.
                torch.set_rng_state(self.seed_state)
                positioned.seed_state = self.seed_state
            # The epoch is set now, not only when the framework does at the epoch's start: worker processes take
            # their first indices when the iterator is created.
            positioned.resume_at(self.epoch, self.batches, self.rng, self.framework_counts_epochs)
        positioned.note_generator()

    def restore_rng(self) -> None:
        """Put the generators back in their states at the checkpoint (once)."""
        if self._rng_pending:
            self._rng_pending = False
            restore_rng_states(self.rng)


class DataState:
    """The training data's position, for ``fabric.save`` and ``fabric.load``: put it in the saved state.

    Get it from :meth:`lightning_bagua.strategies.fabric.BaguaStrategy.data_state`. Before ``fabric.save``, set
    :attr:`batches` to the number of batches of the current epoch trained on; ``fabric.save`` stores the epoch,
    that number and every process's generator states. ``fabric.load`` puts the sampler at that position: the next
    iteration of the dataloader continues the saved epoch at the next batch (the batches before it are not
    loaded), with the generators as they were at the save; :attr:`epoch` and :attr:`batches` tell where.

    Args:
        positioned: the dataloader's positioned sampler.
        world_size: the number of processes.
        rank: this process's rank.
        batches_per_epoch: the dataloader's length: a save after this many batches resumes at the next epoch.
    """

    def __init__(self, positioned: PositionedSampler, world_size: int, rank: int, batches_per_epoch: int) -> None:
        self._positioned = positioned
        self._world_size = world_size
        self._rank = rank
        self._batches_per_epoch = batches_per_epoch
        self._gathered: dict[str, Any] | None = None
        self._gathered_for_save = False
        self.batches = 0
        """Batches of the current epoch trained on: set it before saving; after loading, those skipped."""

    @classmethod
    def of(cls, dataloader: Any, world_size: int, rank: int) -> "DataState":
        """Position ``dataloader``'s sampler (see :func:`positioned_sampler`) and return the state of its position.

        Raises:
            ValueError: the dataloader's batches do not come from a torch ``BatchSampler`` over a map-style dataset.
        """
        positioned = positioned_sampler(dataloader)
        if positioned is None:
            raise ValueError(
                f"The batches of {dataloader!r} do not come from a torch `BatchSampler` over a map-style dataset (it"
                " has a custom batch sampler, `batch_size=None` or an `IterableDataset`), so their position cannot be"
                " resumed. Give the DataLoader a `batch_size` and a dataset with `__getitem__` and `__len__`."
            )
        return cls(positioned, world_size, rank, len(dataloader))

    @property
    def epoch(self) -> int:
        """The sampler's epoch: after loading, the epoch the next iteration of the dataloader belongs to."""
        return self._positioned.epoch

    def gather(self) -> None:
        """Collect every process's part on rank 0 for the next :meth:`state_dict` (collective: every rank calls it)."""
        batches = int(self.batches)
        if not 0 <= batches <= self._batches_per_epoch:
            raise ValueError(
                f"`batches` must be the number of batches of the current epoch trained on, in [0,"
                f" {self._batches_per_epoch}], got {self.batches!r}. Set it before `fabric.save`, for example to"
                " `batch_idx + 1`."
            )
        epoch_done = batches == self._batches_per_epoch
        self._gathered = data_entry(
            self._positioned, capture_rng_states(), self.epoch, batches, epoch_done, self._world_size
        )
        self._gathered_for_save = True

    def state_dict(self) -> dict[str, Any]:
        """Return what :meth:`gather` collected: every process's part on rank 0, which writes it; nothing elsewhere."""
        if not self._gathered_for_save:
            raise RuntimeError(
                "The data position was not gathered from the processes: save it with `fabric.save` under"
                " lightning_bagua's BaguaStrategy, which gathers it."
            )
        gathered, self._gathered, self._gathered_for_save = self._gathered, None, False
        return {} if gathered is None else gathered

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the sampler at the saved position and pend the saved generator states for the next iteration.

        Args:
            state: what :meth:`state_dict` returned when saving.

        Raises:
            ValueError: the state was saved by another number of processes.
        """
        if state["world_size"] != self._world_size:
            raise ValueError(
                f"The data position was saved by {state['world_size']} processes, but this run has"
                f" {self._world_size}: each process's share of the data differs. Resume with"
                f" {state['world_size']} processes, or leave the data position out of the state to load."
            )
        resume = DataResume(state, self._rank)
        resume.apply(self._positioned)
        self.batches = resume.batches
