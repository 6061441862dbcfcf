"""The pieces of mid-epoch resume, in one process: the positioned sampler, the generator states, Fabric's DataState."""

import io
import random
from collections.abc import Iterator
from types import SimpleNamespace

import numpy
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lightning_bagua.strategies._core.data_resume import (
    DataResume,
    DataState,
    PositionedSampler,
    capture_rng_states,
    positioned_sampler,
    restore_rng_states,
)

SAMPLES, BATCH = 40, 4


def _loader(**kwargs: object) -> DataLoader:
    dataset = list(range(SAMPLES))
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, 2, 0, shuffle=True), **kwargs)


def _batches(loader: DataLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


@pytest.mark.timeout(20)
def test_generator_states_survive_a_weights_only_checkpoint():
    states = capture_rng_states()
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # how Lightning loads checkpoints
    expected = (torch.rand(3), random.random(), numpy.random.rand(3))
    torch.rand(5), random.random(), numpy.random.rand(7)
    restore_rng_states(loaded)
    actual = (torch.rand(3), random.random(), numpy.random.rand(3))
    assert torch.equal(actual[0], expected[0])
    assert actual[1] == expected[1]
    assert (actual[2] == expected[2]).all()


@pytest.mark.timeout(20)
def test_the_positioned_sampler_skips_the_trained_batches_once_and_yields_the_same_indices_otherwise():
    plain = _loader()
    plain.sampler.set_epoch(3)
    expected = _batches(plain)
    loader = _loader()
    positioned = positioned_sampler(loader)
    assert positioned is not None
    assert positioned_sampler(loader) is positioned
    assert loader.batch_sampler.sampler is positioned
    assert isinstance(loader.sampler, DistributedSampler)
    assert len(loader) == len(plain)
    positioned.resume_at(epoch=3, batches=2, rng=None)
    assert _batches(loader) == expected[2:]
    assert _batches(loader) == expected  # the skip is for the resumed epoch only


@pytest.mark.timeout(20)
def test_a_resumed_epoch_keeps_its_number_whatever_the_framework_counts():
    loader = _loader()
    positioned = positioned_sampler(loader)
    positioned.resume_at(epoch=5, batches=0, rng=None)
    positioned.set_epoch(0)  # Fabric's loader counts from 0 in a new process
    assert loader.sampler.epoch == 5
    positioned.set_epoch(1)
    assert loader.sampler.epoch == 6


@pytest.mark.timeout(20)
def test_the_state_before_the_base_seed_draw_is_kept_only_when_checked():
    loader = _loader()
    positioned = positioned_sampler(loader)
    positioned.set_epoch(0)
    before = torch.get_rng_state()
    iterator = iter(loader)
    next(iterator)
    assert positioned.seed_state is not None
    assert torch.equal(positioned.seed_state, before)
    # Drawing from that state again gives the iterator's base seed: a resumed iterator gets the same workers' seeds.
    torch.set_rng_state(before)
    assert iter(loader)._base_seed == iterator._base_seed
    # Something else drew in between: unknown, not guessed.
    positioned.set_epoch(1)
    torch.rand(1)
    next(iter(loader))
    assert positioned.seed_state is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resuming_restores_the_generators_after_the_resumed_iterators_draw(num_workers):
    # With workers, the sampler is iterated when the iterator is created; without, at the first batch.
    loader = _loader(num_workers=num_workers)
    positioned = positioned_sampler(loader)
    positioned.set_epoch(2)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    entry = {
        "epoch": 2,
        "batches": 2,
        "epoch_done": False,
        "sampler_seed": 0,
        "world_size": 2,
        "ranks": [{"rng": capture_rng_states(), "seed_state": positioned.seed_state}, None],
    }
    expected_draws = torch.rand(4)
    expected_rest = [batch.tolist() for batch in iterator]

    resumed = _loader(num_workers=num_workers)
    positioned = positioned_sampler(resumed)
    DataResume(entry, rank=0).apply(positioned)
    resumed_iterator = iter(resumed)
    assert resumed_iterator._base_seed == iterator._base_seed
    assert [batch.tolist() for batch in resumed_iterator] == expected_rest
    # Restored when the first batch was taken (nothing drew since): the next draws are those after the checkpoint.
    assert torch.equal(torch.rand(4), expected_draws)


@pytest.mark.timeout(20)
def test_fabric_data_state_checks_what_it_is_given():
    loader = _loader()
    state = DataState(positioned_sampler(loader), world_size=1, rank=0, batches_per_epoch=len(loader))
    state.batches = len(loader) + 1
    with pytest.raises(ValueError, match=r"`batches` must be the number of batches .* in \[0, 5\], got 6"):
        state.gather()
    with pytest.raises(RuntimeError, match="not gathered"):
        state.state_dict()
    state.batches = 3
    state.gather()
    saved = state.state_dict()
    assert (saved["epoch"], saved["batches"], saved["epoch_done"], saved["world_size"]) == (0, 3, False, 1)
    with pytest.raises(ValueError, match=r"saved by 1 processes, but this run has 2: .* Resume with 1 processes"):
        DataState(positioned_sampler(_loader()), world_size=2, rank=0, batches_per_epoch=5).load_state_dict(saved)
    fresh = DataState(positioned_sampler(_loader()), world_size=1, rank=0, batches_per_epoch=5)
    fresh.load_state_dict(saved)
    assert (fresh.epoch, fresh.batches) == (0, 3)


@pytest.mark.timeout(20)
def test_loaders_without_a_torch_batch_sampler_are_not_positioned():
    dataset = list(range(SAMPLES))
    assert positioned_sampler(DataLoader(dataset, batch_size=None)) is None
    # Fabric's `data_state` asks for a position it cannot resume: refused, naming the loader and the fix.
    with pytest.raises(ValueError, match=r"do not come from a torch `BatchSampler`.*Give the DataLoader"):
        DataState.of(DataLoader(dataset, batch_size=None), world_size=1, rank=0)
    assert DataState.of(DataLoader(dataset, batch_size=BATCH), world_size=1, rank=0).epoch == 0

    class Custom(BatchSampler):
        pass

    custom = Custom(DistributedSampler(dataset, 2, 0), BATCH, drop_last=False)
    assert positioned_sampler(DataLoader(dataset, batch_sampler=custom)) is None

    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[int]:
            return iter(range(SAMPLES))

    assert positioned_sampler(DataLoader(Stream(), batch_size=BATCH)) is None


class _SavesItsPosition(DataLoader):
    """A loader with its own ``state_dict``, as torchdata's ``StatefulDataLoader`` has; Lightning restores it."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("loader_class", "positioned"), [(DataLoader, True), (_SavesItsPosition, False)])
def test_the_trainer_strategy_positions_the_training_loader_unless_it_saves_its_own_position(loader_class, positioned):
    from lightning_bagua import BaguaStrategy

    strategy = BaguaStrategy()
    # The hook reads only whether the Trainer is training; the process group is not needed.
    strategy._lightning_module = SimpleNamespace(_trainer=SimpleNamespace(training=True))
    dataset = list(range(SAMPLES))
    loader = loader_class(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, 2, 0))
    assert strategy.process_dataloader(loader) is loader
    assert isinstance(loader.batch_sampler.sampler, PositionedSampler) is positioned
    assert (strategy._positioned is not None) is positioned

    strategy._lightning_module = SimpleNamespace(_trainer=SimpleNamespace(training=False))
    validation = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, 2, 0))
    strategy.process_dataloader(validation)
    assert isinstance(validation.batch_sampler.sampler, DistributedSampler)
