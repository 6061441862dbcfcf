"""Load-balancing distributed samplers: in every step, all ranks get samples of similar complexity.

A :class:`~torch.utils.data.DistributedSampler` deals indices out at random, so when sample costs vary (sequences
of very different lengths, say) some rank gets the longest samples of a step and every other rank waits for it.
:class:`LoadBalancingDistributedSampler` sorts the samples by a user-given complexity, cuts the sorted order into
groups of ``num_replicas`` neighbours and gives each rank one member of every group, so the ranks' ``i``-th samples
always have about the same complexity. :class:`LoadBalancingDistributedBatchSampler` builds batches from that order
(for example up to a token budget) and keeps the ranks' batch counts equal.

Under Lightning, both keep their place in the ``DataLoader``: the sampler is a ``DistributedSampler`` subclass, which
the Trainer does not replace, and :class:`~lightning_bagua.BaguaStrategy` fills in ``num_replicas`` and ``rank`` when
they were not given. A ``batch_sampler`` loader looks undistributed to Lightning (its ``sampler`` attribute is a
``SequentialSampler``), so the Trainer and Fabric rebuild the batch sampler around a ``DistributedSampler`` of their
own; the batch sampler takes only that sampler's ``num_replicas`` and ``rank`` (where none were given) and keeps its
load-balancing order, so no ``use_distributed_sampler=False`` is needed.
"""

import logging
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]

log = logging.getLogger(__name__)


class LoadBalancingDistributedSampler(DistributedSampler):
    """Give each rank a share of the dataset such that the ranks' ``i``-th samples have similar complexity.

    Every sample's complexity is computed once, here, with ``complexity_fn(dataset[index])``. Each epoch, the indices
    are sorted by complexity plus integer noise (drawn uniformly from ``[0, int((max - min) * random_level + 1))``,
    so ``random_level=0`` adds none), the sorted order is padded by wrap-around (its first indices are repeated, so
    the last group pairs the most with the least complex samples) or, with ``drop_last``, cut (its last, most complex
    indices are dropped: without noise, the same ones every epoch) to a multiple of ``num_replicas``, and cut into
    groups of ``num_replicas`` consecutive indices. Rank ``r`` takes the ``r``-th index of every group; with
    ``shuffle`` the groups are visited in a random order, otherwise from the least to the most complex.

    Randomness comes from one ``torch.Generator`` seeded with ``seed + epoch``: it first draws the noise (one value
    per index, when ``random_level > 0``), then the order of the groups (when ``shuffle``). All ranks therefore derive
    the same grouping without communicating, and a given ``seed`` and epoch always give the same order.

    ``num_replicas`` and ``rank`` may be left out: :class:`~lightning_bagua.BaguaStrategy` fills them in when the
    Trainer prepares the dataloader; elsewhere they are read from the default process group on first use.

    Args:
        dataset: a map-style dataset with ``len()``.
        complexity_fn: maps a sample to a real number (its cost: a sequence length, a pixel count, ...).
        num_replicas: the number of ranks; ``None`` to fill it in later.
        rank: this process's rank, in ``[0, num_replicas)``; ``None`` to fill it in later.
        shuffle: visit the groups in a random order that changes with the epoch.
        seed: the seed of the noise and the group order; must be the same on all ranks.
        drop_last: drop the tail of the sorted order instead of padding it to a multiple of ``num_replicas``.
        random_level: how much noise to add to the complexities, in ``[0, 1]``; a fraction of their range.

    Raises:
        TypeError: if ``dataset`` has no ``len()``, ``complexity_fn`` is not callable or returns something that is not
            a real number, or ``num_replicas``, ``rank`` or ``seed`` is not an int.
        ValueError: for a ``random_level`` outside ``[0, 1]``, a ``num_replicas`` below 1, a ``rank`` outside
            ``[0, num_replicas)``, or a complexity that is NaN or infinite.
    """

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Callable[[Any], Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ) -> None:
        # DistributedSampler.__init__ is not called: it resolves num_replicas and rank at once, which needs a process
        # group. Every attribute it would set is set or computed here.
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"`dataset` must be a map-style dataset with len(), got {type(dataset).__name__}.")
        if not callable(complexity_fn):
            raise TypeError(f"`complexity_fn` must be callable, got {complexity_fn!r}.")
        self._random_level = 0.0
        self.random_level = random_level  # validated by the property
        _check_int("seed", seed)
        self._given_num_replicas: int | None = None if num_replicas is None else _check_num_replicas(num_replicas)
        self._given_rank: int | None = None if rank is None else _check_rank(rank, self._given_num_replicas)
        self._filled: tuple[int, int] | None = None
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._complexities: Tensor = _compute_complexities(dataset, complexity_fn)
        self._spread = float(self._complexities.max() - self._complexities.min()) if len(self._complexities) else 0.0
        self._cache_key: tuple[Any, ...] | None = None
        self._cache_table: Tensor = torch.empty(0, 0, dtype=torch.long)

    @property
    def random_level(self) -> float:
        """How much noise is added to the complexities before sorting, as a fraction of their range."""
        return self._random_level

    @random_level.setter
    def random_level(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"`random_level` must be a number in [0, 1], got {value!r}.")
        if not 0 <= value <= 1:  # False for NaN too
            raise ValueError(f"`random_level` must be in [0, 1], got {value!r}.")
        self._random_level = float(value)

    @property
    def _noise_high(self) -> int:
        # Noise is drawn from [0, _noise_high): a draw of 0 only, i.e. none, at random_level=0.
        return int(self._spread * self._random_level + 1)

    # ------------------------------------------------------------------------------------------- ranks, lazily

    @property
    def num_replicas(self) -> int:
        """The number of ranks: as given, else as filled in by the strategy, else the default group's size."""
        if self._given_num_replicas is not None:
            return self._given_num_replicas
        if self._filled is not None:
            return self._filled[0]
        return _from_process_group("num_replicas")[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._given_num_replicas = _check_num_replicas(value)
        if self._given_rank is not None:
            _check_rank(self._given_rank, value)

    @property
    def rank(self) -> int:
        """This process's rank: as given, else as filled in by the strategy, else its rank in the default group."""
        if self._given_rank is not None:
            return self._given_rank
        if self._filled is not None:
            return self._filled[1]
        return _from_process_group("rank")[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._given_rank = _check_rank(value, self._given_num_replicas)

    @property
    def num_samples(self) -> int:
        """How many indices each rank gets per epoch."""
        return _samples_per_rank(len(self._complexities), self.num_replicas, self.drop_last)

    @num_samples.setter
    def num_samples(self, value: int) -> None:
        raise AttributeError("`num_samples` follows from the dataset size, num_replicas and drop_last; set those.")

    @property
    def total_size(self) -> int:
        """How many indices all ranks get together per epoch (with padding, without the dropped tail)."""
        return self.num_samples * self.num_replicas

    @total_size.setter
    def total_size(self, value: int) -> None:
        raise AttributeError("`total_size` follows from the dataset size, num_replicas and drop_last; set those.")

    @property
    def complexities(self) -> Tensor:
        """Every sample's complexity, by index, as computed at construction (a float64 copy)."""
        return self._complexities.clone()

    def _fill_distributed(self, num_replicas: int, rank: int) -> None:
        """Take the world size and rank from the strategy where none were given; warn where they disagree."""
        _check_rank(rank, _check_num_replicas(num_replicas))
        self._filled = (num_replicas, rank)
        given = (self._given_num_replicas, self._given_rank)
        if (given[0] is not None and given[0] != num_replicas) or (given[1] is not None and given[1] != rank):
            log.warning(
                f"{type(self).__name__} was given num_replicas={given[0]}, rank={given[1]}, but this process is rank"
                f" {rank} of {num_replicas}; keeping the given values. Leave them out to have them filled in."
            )

    # ------------------------------------------------------------------------------------------------ ordering

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the noise and the group order (``seed + epoch``); call it before each epoch.

        Args:
            epoch: the epoch number.
        """
        self.epoch = _check_int("epoch", epoch)

    def _place(self) -> tuple[int, int]:
        """Return ``(num_replicas, rank)``, checked together: they may have come from different places."""
        num_replicas = self.num_replicas
        return num_replicas, _check_rank(self.rank, num_replicas)

    def _groups(self) -> Tensor:
        """Return this epoch's ``[num_samples, num_replicas]`` table: row ``i`` is the ``i``-th group visited."""
        num_replicas = self.num_replicas
        key = (self.epoch, self.seed, self.shuffle, self.drop_last, num_replicas, self._noise_high)
        if key != self._cache_key:
            self._cache_table = _group_table(
                self._complexities, num_replicas, self.drop_last, self.shuffle, self.seed + self.epoch, self._noise_high
            )
            self._cache_key = key
        return self._cache_table

    def __iter__(self) -> Iterator[int]:
        rank = self._place()[1]
        return iter(self._groups()[:, rank].tolist())

    def __len__(self) -> int:
        return self.num_samples


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batch a :class:`LoadBalancingDistributedSampler`'s indices with ``batch_fn``, equally many batches per rank.

    ``batch_fn`` receives a rank's indices for the epoch, in the order the sampler yields them, and returns that
    rank's batches (lists of indices), for example by packing consecutive indices up to a token budget. Since the
    ranks' index lists differ, so may their batch counts; every rank needs the same count, or the ranks' collectives
    fall out of step. Each process therefore computes every rank's indices from the shared deterministic order (no
    communication) and calls ``batch_fn`` once per rank to learn the counts. Then a rank with fewer batches than the
    largest count repeats its own batches from the first on, or, with ``drop_last``, every rank keeps only as many
    batches as the smallest count.

    The batches are regenerated whenever the sampler's epoch changes: by :meth:`set_epoch`, or by a call of the
    sampler's own ``set_epoch`` (which is what Lightning calls each epoch).

    Args:
        sampler: the sampler whose order is batched.
        batch_fn: maps a list of indices to a list of non-empty batches (each a sequence of indices).
        drop_last: cut every rank to the smallest batch count instead of padding to the largest.

    Raises:
        TypeError: if ``sampler`` is not a :class:`LoadBalancingDistributedSampler` or ``batch_fn`` is not callable.
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], Sequence[Sequence[int]]],
        drop_last: bool = False,
    ) -> None:
        if isinstance(batch_fn, _RebuiltByLightning):
            sampler, batch_fn = batch_fn.rebind(sampler)
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(
                f"`sampler` must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}: the batch counts"
                " of all ranks are derived from its deterministic order."
            )
        if not callable(batch_fn):
            raise TypeError(f"`batch_fn` must be callable, got {batch_fn!r}.")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self._cache_key: tuple[Any, ...] | None = None
        self._batches: list[list[int]] = []
        # Lightning rebuilds a custom batch sampler from the arguments recorded under these names, putting its own
        # DistributedSampler in place of `sampler` (and drop_last=False when predicting). The recorded `batch_fn`
        # carries this sampler along, so the rebuilt batch sampler keeps it and only learns its place from theirs.
        setattr(self, "__pl_saved_args", (sampler, _RebuiltByLightning(sampler, batch_fn), drop_last))
        setattr(self, "__pl_saved_kwargs", {})
        setattr(self, "__pl_saved_arg_names", ("sampler", "batch_fn", "drop_last"))
        setattr(self, "__pl_saved_default_kwargs", {"drop_last": False})

    def set_epoch(self, epoch: int) -> None:
        """Set the sampler's epoch; the next iteration uses that epoch's batches.

        Args:
            epoch: the epoch number.
        """
        self.sampler.set_epoch(epoch)

    def _current(self) -> list[list[int]]:
        rank = self.sampler._place()[1]
        table = self.sampler._groups()
        key = (self.sampler._cache_key, rank, self.drop_last, self.batch_fn)
        if key != self._cache_key:
            self._batches = self._generate(table, rank)
            self._cache_key = key
        return self._batches

    def _generate(self, table: Tensor, rank: int) -> list[list[int]]:
        per_rank = [self._call_batch_fn(table[:, r].tolist(), r) for r in range(table.shape[1])]
        counts = [len(batches) for batches in per_rank]
        target = min(counts) if self.drop_last else max(counts)
        own = per_rank[rank]
        if target > len(own):
            if not own:
                raise ValueError(
                    f"`batch_fn` returned no batches for rank {rank} but {target} for another rank, so there is nothing"
                    " to pad with. Give every rank at least one batch, or pass drop_last=True."
                )
            own = [own[i % len(own)] for i in range(target)]
        log.debug(f"rank {rank}: {counts[rank]} batches from batch_fn, {target} used (counts per rank: {counts})")
        return own[:target]

    def _call_batch_fn(self, indices: list[int], rank: int) -> list[list[int]]:
        batches = self.batch_fn(indices)
        if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
            raise TypeError(f"`batch_fn` must return a list of batches, got {type(batches).__name__}.")
        result = []
        for number, batch in enumerate(batches):
            if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence) or not batch:
                raise ValueError(
                    f"`batch_fn` must return non-empty sequences of indices; batch {number} for rank {rank} is"
                    f" {batch!r}."
                )
            result.append([int(index) for index in batch])
        return result

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(batch) for batch in self._current()])

    def __len__(self) -> int:
        return len(self._current())


class _RebuiltByLightning:
    """The ``batch_fn`` recorded for Lightning's rebuild, holding the load-balancing sampler to keep."""

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn: Callable[[list[int]], Any]) -> None:
        self.sampler = sampler
        self.batch_fn = batch_fn

    def rebind(self, offered: object) -> tuple[LoadBalancingDistributedSampler, Callable[[list[int]], Any]]:
        """Return the sampler and ``batch_fn`` to use, placing the sampler like the one Lightning ``offered``."""
        if offered is not self.sampler and isinstance(offered, DistributedSampler):
            self.sampler._fill_distributed(offered.num_replicas, offered.rank)
        return self.sampler, self.batch_fn


def _group_table(
    complexities: Tensor, num_replicas: int, drop_last: bool, shuffle: bool, seed: int, noise_high: int
) -> Tensor:
    count = len(complexities)
    num_samples = _samples_per_rank(count, num_replicas, drop_last)
    generator = torch.Generator().manual_seed(seed)
    keys = complexities
    if noise_high > 1:
        keys = keys + torch.randint(noise_high, (count,), generator=generator, dtype=torch.int64).to(keys.dtype)
    # Stable, so that equal keys stay in index order and every rank derives the same order.
    order = torch.sort(keys, stable=True).indices
    total = num_samples * num_replicas
    if total > count:
        order = order.repeat(math.ceil(total / count))
    table = order[:total].view(num_samples, num_replicas)
    if shuffle:
        table = table[torch.randperm(num_samples, generator=generator)]
    return table


def _samples_per_rank(count: int, num_replicas: int, drop_last: bool) -> int:
    return count // num_replicas if drop_last else math.ceil(count / num_replicas)


def _compute_complexities(dataset: Any, complexity_fn: Callable[[Any], Any]) -> Tensor:
    values = []
    for index in range(len(dataset)):
        value = complexity_fn(dataset[index])
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise TypeError(
                f"`complexity_fn` must return a real number, got {value!r} ({type(value).__name__}) for index {index}."
            )
        if not math.isfinite(value):
            raise ValueError(f"`complexity_fn` returned {value!r} for index {index}; complexities must be finite.")
        values.append(float(value))
    return torch.tensor(values, dtype=torch.float64)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r}.")
    return int(value)


def _check_num_replicas(value: Any) -> int:
    if _check_int("num_replicas", value) < 1:
        raise ValueError(f"`num_replicas` must be at least 1, got {value!r}.")
    return int(value)


def _check_rank(value: Any, num_replicas: int | None) -> int:
    rank = _check_int("rank", value)
    if rank < 0 or (num_replicas is not None and rank >= num_replicas):
        upper = "num_replicas" if num_replicas is None else str(num_replicas)
        raise ValueError(f"`rank` must be in [0, {upper}), got {value!r}.")
    return rank


def _from_process_group(what: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"LoadBalancingDistributedSampler has no `{what}`: none was given, no strategy filled it in, and"
            " torch.distributed is not initialized. Pass num_replicas and rank, or use the sampler in a DataLoader"
            " given to a Trainer with BaguaStrategy."
        )
    return dist.get_world_size(), dist.get_rank()
