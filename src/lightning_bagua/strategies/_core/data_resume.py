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
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import BatchSampler, Sampler

__all__ = [
    "DATA_KEY",
    "DataResume",
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
        self.seed_state: Tensor | None = None
        """The torch CPU generator's state before the current iterator drew its base seed; ``None`` if unknown."""

    def note_generator(self) -> None:
        """Note the global torch generator's state: a dataloader iterator may draw its base seed from it next."""
        self._candidate = torch.get_rng_state()

    def skip_next_epoch(self, batches: int) -> None:
        """Leave out the first ``batches`` batches the next time the indices are iterated.

        Args:
            batches: how many batches of the epoch were already trained on.
        """
        self._skip_batches = batches

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the sampler it stands in for; a new iterator may draw its base seed next.

        Args:
            epoch: the epoch number.
        """
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.note_generator()

    def __iter__(self) -> Iterator[int]:
        current = torch.get_rng_state()
        if self._candidate is not None and torch.equal(_after_one_seed_draw(self._candidate), current):
            self.seed_state = self._candidate
        elif self._candidate is None or not torch.equal(self._candidate, current):
            self.seed_state = None
        # Otherwise no draw happened: persistent workers keep the base seed of the iterator that started them.
        self._candidate = None
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
        (a loader without automatic batching, a custom batch sampler), whose position is not resumed.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
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
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] | None = [None] * world_size if dist.get_rank() == 0 else None
        dist.gather_object(own, gathered, dst=0)
    else:
        gathered = [own]
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
    """

    def __init__(self, entry: Mapping[str, Any], rank: int) -> None:
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
        """Place the sampler at the saved position; call it just before the resumed iterator is created.

        Args:
            positioned: the training dataloader's positioned sampler.
        """
        sampler = positioned.sampler
        if self.sampler_seed is not None and hasattr(sampler, "seed"):
            sampler.seed = self.sampler_seed
        # Set now, not only when the framework does at the epoch's start: worker processes take their first
        # indices when the iterator is created.
        positioned.set_epoch(self.epoch)
        positioned.skip_next_epoch(self.batches)
        if self.epoch_done:
            # The undisturbed run drew the next iterator's base seed after the checkpoint, from these states.
            self.restore_rng()
        elif self.seed_state is not None:
            # The undisturbed run's iterator for this epoch drew its base seed from this state; the generators get
            # their states at the checkpoint before the first batch (`restore_rng`).
            torch.set_rng_state(self.seed_state)
        positioned.note_generator()

    def restore_rng(self) -> None:
        """Put the generators back in their states at the checkpoint (once)."""
        if self._rng_pending:
            self._rng_pending = False
            restore_rng_states(self.rng)
