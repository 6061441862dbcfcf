"""Load-balancing samplers: coverage, balance, randomness, batch counts; and kept and used by a real Trainer."""

import importlib
import logging
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader, DistributedSampler

from lightning_bagua import BaguaStrategy, LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from tests.data.scripts import fit_sampler_script as script
from tests.distributed import free_port, run_job

SCRIPT = Path(__file__).parent / "scripts" / "fit_sampler_script.py"


def skewed_lengths(count: int, seed: int = 0) -> list[int]:
    """Mostly short, a few very long: the length distribution of text or speech corpora."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.empty(count).log_normal_(mean=3.0, std=1.0, generator=generator).clamp(max=2000) + 1).long().tolist()


def identity(sample: int) -> int:
    return sample


def ranks_of(dataset, world_size: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    samplers = [
        LoadBalancingDistributedSampler(dataset, identity, num_replicas=world_size, rank=rank, **kwargs)
        for rank in range(world_size)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


def sorted_order(complexities: list[int]) -> list[int]:
    return sorted(range(len(complexities)), key=lambda index: complexities[index])  # stable, like the sampler


# ----------------------------------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("count", [37, 40])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_index_once_per_epoch_with_wrap_around_padding(world_size, count, shuffle):
    dataset = skewed_lengths(count)
    per_rank = ranks_of(dataset, world_size, epoch=3, shuffle=shuffle)
    per_rank_count = math.ceil(count / world_size)
    assert [len(indices) for indices in per_rank] == [per_rank_count] * world_size
    counts = Counter(index for indices in per_rank for index in indices)
    assert set(counts) == set(range(count))
    # The padding repeats the start of the sorted order (the least complex samples), each once.
    padding = per_rank_count * world_size - count
    repeated = sorted(index for index, seen in counts.items() if seen == 2)
    assert repeated == sorted(sorted_order(dataset)[:padding])
    assert max(counts.values()) <= 2


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("count", [37, 40])
def test_drop_last_drops_the_most_complex_tail(world_size, count):
    dataset = skewed_lengths(count)
    per_rank = ranks_of(dataset, world_size, drop_last=True)
    assert [len(indices) for indices in per_rank] == [count // world_size] * world_size
    seen = [index for indices in per_rank for index in indices]
    assert len(seen) == len(set(seen))
    dropped = set(range(count)) - set(seen)
    assert dropped == set(sorted_order(dataset)[count - count % world_size :])


def test_ranks_take_the_members_of_groups_of_consecutive_sorted_indices():
    dataset = skewed_lengths(23)
    order = sorted_order(dataset)
    order += order[: 24 - 23]
    per_rank = ranks_of(dataset, 3, shuffle=False)
    for step in range(8):
        assert [indices[step] for indices in per_rank] == order[3 * step : 3 * step + 3]
    # With shuffle, the same groups are visited in another order.
    shuffled = ranks_of(dataset, 3, shuffle=True)
    groups = {tuple(order[3 * step : 3 * step + 3]) for step in range(8)}
    assert {tuple(indices[step] for indices in shuffled) for step in range(8)} == groups
    assert [indices[0] for indices in shuffled] != [indices[0] for indices in per_rank]


def test_len_and_attributes_match_distributed_sampler():
    dataset = skewed_lengths(37)
    for drop_last in (False, True):
        ours = LoadBalancingDistributedSampler(dataset, identity, num_replicas=4, rank=1, drop_last=drop_last)
        theirs = DistributedSampler(dataset, num_replicas=4, rank=1, drop_last=drop_last)
        assert isinstance(ours, DistributedSampler)
        assert (len(ours), ours.num_samples, ours.total_size) == (len(theirs), theirs.num_samples, theirs.total_size)
        assert len(list(ours)) == len(ours)


def test_complexity_is_computed_once_per_sample():
    calls = Counter()

    def counting(sample: int) -> int:
        calls[sample] += 1
        return sample % 7

    sampler = LoadBalancingDistributedSampler(list(range(30)), counting, num_replicas=2, rank=0, random_level=0.5)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        list(sampler)
    assert calls == Counter(range(30))
    assert sampler.complexities.tolist() == [float(i % 7) for i in range(30)]


# ------------------------------------------------------------------------------------------------------ balance


def mean_step_spread(per_rank: list[list[int]], complexities: list[int], batch: int) -> float:
    """Mean over steps of (max - min) over ranks of the summed complexity of the rank's batch in that step."""
    steps = min(len(indices) for indices in per_rank) // batch
    spreads = []
    for step in range(steps):
        loads = [sum(complexities[i] for i in indices[step * batch : (step + 1) * batch]) for indices in per_rank]
        spreads.append(max(loads) - min(loads))
    return sum(spreads) / len(spreads)


@pytest.mark.parametrize(("world_size", "batch"), [(2, 1), (4, 1), (4, 8)])
def test_per_step_spread_is_far_below_a_distributed_samplers(world_size, batch):
    complexities = skewed_lengths(2000, seed=1)
    balanced = mean_step_spread(ranks_of(complexities, world_size, shuffle=True), complexities, batch)
    random_deal = [
        list(DistributedSampler(complexities, num_replicas=world_size, rank=rank, shuffle=True, seed=0))
        for rank in range(world_size)
    ]
    baseline = mean_step_spread(random_deal, complexities, batch)
    assert balanced < baseline / 5, (balanced, baseline)
    # Some noise costs balance but keeps most of it.
    noisy = mean_step_spread(ranks_of(complexities, world_size, random_level=0.05), complexities, batch)
    assert balanced <= noisy < baseline / 2, (balanced, noisy, baseline)


# ------------------------------------------------------------------------------------------------- randomness


def test_same_seed_and_epoch_give_the_same_order_and_other_epochs_another():
    dataset = skewed_lengths(50)
    first = ranks_of(dataset, 2, epoch=1, shuffle=True, random_level=0.3)
    assert ranks_of(dataset, 2, epoch=1, shuffle=True, random_level=0.3) == first
    assert ranks_of(dataset, 2, epoch=2, shuffle=True, random_level=0.3) != first
    assert ranks_of(dataset, 2, epoch=1, shuffle=True, random_level=0.3, seed=5) != first
    # The generator is seeded with seed + epoch.
    assert ranks_of(dataset, 2, epoch=0, shuffle=True, random_level=0.3, seed=1) == first


def test_without_shuffle_or_noise_the_epoch_changes_nothing():
    dataset = skewed_lengths(50)
    assert ranks_of(dataset, 2, epoch=0, shuffle=False) == ranks_of(dataset, 2, epoch=9, shuffle=False)
    # The noise is drawn per epoch even without shuffle.
    assert ranks_of(dataset, 2, epoch=0, shuffle=False, random_level=1) != ranks_of(
        dataset, 2, epoch=1, shuffle=False, random_level=1
    )


@pytest.mark.parametrize("random_level", [0.0, 0.1, 0.5, 1.0])
def test_noise_only_swaps_samples_closer_than_its_range(random_level):
    dataset = skewed_lengths(300, seed=2)
    noise_range = int((max(dataset) - min(dataset)) * random_level + 1)  # noise is drawn from [0, noise_range)
    sampler = LoadBalancingDistributedSampler(
        dataset, identity, num_replicas=1, rank=0, shuffle=False, random_level=random_level
    )
    order = list(sampler)
    positions = {index: position for position, index in enumerate(order)}
    for i in range(0, 300, 7):
        for j in range(0, 300, 5):
            if dataset[j] - dataset[i] >= noise_range:
                assert positions[i] < positions[j], (i, j)
    if random_level == 0:
        assert order == sorted_order(dataset)
    else:
        assert order != sorted_order(dataset)
        assert sorted(order) == list(range(300))


def test_random_level_can_be_changed_later_and_is_checked():
    dataset = skewed_lengths(200)
    sampler = LoadBalancingDistributedSampler(dataset, identity, num_replicas=1, rank=0, shuffle=False)
    assert list(sampler) == sorted_order(dataset)
    sampler.random_level = 0.5
    assert sampler._noise_high == int((max(dataset) - min(dataset)) * 0.5 + 1)
    assert list(sampler) != sorted_order(dataset)
    with pytest.raises(ValueError, match=r"`random_level` must be in \[0, 1\], got 2"):
        sampler.random_level = 2


# ------------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"random_level": 1.5}, ValueError, r"`random_level` must be in \[0, 1\], got 1\.5"),
        ({"random_level": -0.1}, ValueError, r"`random_level` must be in \[0, 1\], got -0\.1"),
        ({"random_level": float("nan")}, ValueError, r"got nan"),
        ({"random_level": "high"}, TypeError, r"`random_level` must be a number in \[0, 1\], got 'high'"),
        ({"num_replicas": 0}, ValueError, r"`num_replicas` must be at least 1, got 0"),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"`rank` must be in \[0, 2\), got 2"),
        ({"rank": -1}, ValueError, r"`rank` must be in \[0, num_replicas\), got -1"),
        ({"num_replicas": 2.0}, TypeError, r"`num_replicas` must be an int, got 2\.0"),
        ({"complexity_fn": "len"}, TypeError, r"`complexity_fn` must be callable, got 'len'"),
        ({"complexity_fn": str}, TypeError, r"must return a real number, got '3' \(str\) for index 0"),
        ({"complexity_fn": lambda x: float("inf")}, ValueError, r"returned inf for index 0"),
        ({"dataset": iter([1])}, TypeError, r"map-style dataset with len\(\), got list_iterator"),
    ],
)
def test_bad_input_fails_at_construction(kwargs, error, message):
    arguments = {"dataset": [3, 1, 2], "complexity_fn": identity, **kwargs}
    with pytest.raises(error, match=message):
        LoadBalancingDistributedSampler(**arguments)


def test_missing_ranks_fail_on_first_use_without_a_process_group():
    sampler = LoadBalancingDistributedSampler([3, 1, 2], identity)  # fine: a strategy may fill them in later
    with pytest.raises(RuntimeError, match="no `num_replicas`: none was given, no strategy filled it in"):
        list(sampler)
    sampler = LoadBalancingDistributedSampler([3, 1, 2], identity, rank=3)
    sampler._fill_distributed(2, 1)
    with pytest.raises(ValueError, match=r"`rank` must be in \[0, 2\), got 3"):
        list(sampler)


def test_tensor_complexities_are_accepted():
    sampler = LoadBalancingDistributedSampler([torch.tensor(3), torch.tensor([1.5])], identity, num_replicas=1, rank=0)
    assert sampler.complexities.tolist() == [3.0, 1.5]


# ------------------------------------------------------------------------------------------------ batch sampler


def token_batches(complexities: list[int], budget: int):
    def batch_fn(indices: list[int]) -> list[list[int]]:
        batches, current, used = [], [], 0
        for index in indices:
            if current and used + complexities[index] > budget:
                batches.append(current)
                current, used = [], 0
            current.append(index)
            used += complexities[index]
        return [*batches, current] if current else batches

    return batch_fn


def batch_samplers(complexities, world_size, drop_last=False, **kwargs):
    return [
        LoadBalancingDistributedBatchSampler(
            LoadBalancingDistributedSampler(complexities, identity, num_replicas=world_size, rank=rank, **kwargs),
            token_batches(complexities, 400),
            drop_last=drop_last,
        )
        for rank in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_number_of_batches(world_size, drop_last):
    complexities = skewed_lengths(301, seed=3)
    samplers = batch_samplers(complexities, world_size, drop_last=drop_last, random_level=0.3)
    own_counts = []
    for batch_sampler in samplers:
        own_counts.append(len(token_batches(complexities, 400)(list(batch_sampler.sampler))))
        batches = list(batch_sampler)
        assert len(batches) == len(batch_sampler)
        indices = list(batch_sampler.sampler)
        if drop_last:
            # Cut to the smallest count: a prefix of the rank's own batches.
            assert batches == token_batches(complexities, 400)(indices)[: len(batches)]
        else:
            # Padded to the largest count by repeating the rank's own batches from the first on.
            own = token_batches(complexities, 400)(indices)
            assert batches[: len(own)] == own
            assert batches[len(own) :] == [own[i % len(own)] for i in range(len(batches) - len(own))]
    assert len({len(batch_sampler) for batch_sampler in samplers}) == 1
    assert len(samplers[0]) == (min(own_counts) if drop_last else max(own_counts))
    if world_size > 1:
        assert len(set(own_counts)) > 1, "the test should make batch_fn give the ranks different counts"


def test_batch_sampler_regenerates_on_either_set_epoch():
    complexities = skewed_lengths(120, seed=4)
    (batch_sampler,) = batch_samplers(complexities, 1, shuffle=True)
    first = list(batch_sampler)
    batch_sampler.set_epoch(1)
    assert batch_sampler.sampler.epoch == 1
    second = list(batch_sampler)
    assert second != first
    batch_sampler.sampler.set_epoch(0)  # what Lightning calls: the sampler's own set_epoch
    assert list(batch_sampler) == first


def test_batch_sampler_errors():
    with pytest.raises(TypeError, match="must be a LoadBalancingDistributedSampler, got DistributedSampler"):
        LoadBalancingDistributedBatchSampler(DistributedSampler([1, 2], num_replicas=1, rank=0), list)
    sampler = LoadBalancingDistributedSampler([5, 1, 2, 9], identity, num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="`batch_fn` must be callable"):
        LoadBalancingDistributedBatchSampler(sampler, None)
    with pytest.raises(ValueError, match=r"non-empty sequences of indices; batch 1 for rank 0 is \[\]"):
        list(LoadBalancingDistributedBatchSampler(sampler, lambda indices: [indices, []]))
    with pytest.raises(ValueError, match="returned no batches for rank 0 but 1 for another rank"):
        list(LoadBalancingDistributedBatchSampler(sampler, lambda indices: [indices] if 3 in indices else []))
    with pytest.raises(TypeError, match="must return a list of batches, got int"):
        list(LoadBalancingDistributedBatchSampler(sampler, len))


# ----------------------------------------------------------------------------------------- Lightning, in-process


def strategy_at(world_size: int, rank: int, package: str = "lightning") -> BaguaStrategy:
    if package == "lightning":
        environment, strategy_cls = LightningEnvironment(), BaguaStrategy
    else:
        from lightning_fabric.plugins.environments import LightningEnvironment as FabricEnvironment

        from lightning_bagua.pytorch_lightning import BaguaStrategy as PLBaguaStrategy

        environment, strategy_cls = FabricEnvironment(), PLBaguaStrategy
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    return strategy_cls(cluster_environment=environment)


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_strategy_fills_in_missing_ranks_for_samplers_and_batch_samplers(package):
    strategy = strategy_at(4, 2, package)
    sampler = LoadBalancingDistributedSampler(list(range(10)), identity)
    loader = DataLoader(list(range(10)), sampler=sampler, batch_size=2)
    assert strategy.process_dataloader(loader) is loader
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (4, 2, 3)

    inner = LoadBalancingDistributedSampler(list(range(10)), identity)
    loader = DataLoader(list(range(10)), batch_sampler=LoadBalancingDistributedBatchSampler(inner, lambda i: [i]))
    strategy.process_dataloader(loader)
    assert (inner.num_replicas, inner.rank, len(loader)) == (4, 2, 1)


def test_given_ranks_are_kept_with_a_warning_where_they_disagree(caplog):
    sampler = LoadBalancingDistributedSampler(list(range(10)), identity, num_replicas=2, rank=1)
    with caplog.at_level(logging.WARNING, logger="lightning_bagua.data.samplers"):
        strategy_at(4, 2).process_dataloader(DataLoader(list(range(10)), sampler=sampler))
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert "was given num_replicas=2, rank=1, but this process is rank 2 of 4" in caplog.text


@pytest.mark.parametrize(
    ("package", "predicting"),
    [
        ("lightning.pytorch", False),
        ("lightning.pytorch", True),
        ("lightning.fabric", False),
        ("pytorch_lightning", False),
        ("lightning_fabric", False),
    ],
)
def test_lightnings_rebuild_keeps_the_batch_sampler_and_places_it(package, predicting):
    """Lightning rebuilds a batch-sampler loader around its own DistributedSampler; ours survives, placed like it."""
    update_dataloader = importlib.import_module(f"{package}.utilities.data")._update_dataloader
    inner = LoadBalancingDistributedSampler(list(range(10)), identity)
    batch_fn = lambda indices: [indices[i : i + 2] for i in range(0, len(indices), 2)]  # noqa: E731
    original = LoadBalancingDistributedBatchSampler(inner, batch_fn, drop_last=True)
    loader = DataLoader(list(range(10)), batch_sampler=original)
    offered = DistributedSampler(loader.dataset, num_replicas=2, rank=1)
    if predicting:
        from lightning.pytorch.trainer.states import RunningStage

        rebuilt = update_dataloader(loader, offered, mode=RunningStage.PREDICTING)
        batch_sampler = rebuilt.batch_sampler._batch_sampler  # Lightning's index-recording wrapper
    else:
        rebuilt = update_dataloader(loader, offered)
        batch_sampler = rebuilt.batch_sampler
    assert isinstance(batch_sampler, LoadBalancingDistributedBatchSampler)
    assert batch_sampler is not original
    assert batch_sampler.sampler is inner
    assert batch_sampler.batch_fn is batch_fn
    assert batch_sampler.drop_last is not predicting  # Lightning asks for every sample when predicting
    assert (inner.num_replicas, inner.rank) == (2, 1)
    expected = LoadBalancingDistributedBatchSampler(
        LoadBalancingDistributedSampler(list(range(10)), identity, num_replicas=2, rank=1), batch_fn, drop_last=True
    )
    assert [batch.tolist() for batch in rebuilt] == list(expected)


# ------------------------------------------------------------------------------------- Lightning, two processes


def run_fit(out: Path, mode: str, *extra: str) -> list[dict]:
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--mode", mode, *extra]
    completed = run_job(command, timeout=240, env={"MASTER_PORT": str(free_port())})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def expected_sampler(rank: int, epoch: int) -> LoadBalancingDistributedSampler:
    dataset = script.IndexedDataset()
    sampler = LoadBalancingDistributedSampler(
        dataset, script.complexity, num_replicas=2, rank=rank, shuffle=True, seed=script.SEED, random_level=0.2
    )
    sampler.set_epoch(epoch)
    return sampler


def assert_kept_and_set_epoch_called(results: list[dict], loader_kept: bool = True) -> None:
    for rank, result in enumerate(results):
        assert result["kept"], f"rank {rank}: Lightning replaced the sampler"
        assert result["loader_kept"] is loader_kept, f"rank {rank}: dataloader rebuilt: {not result['loader_kept']}"
        assert (result["num_replicas"], result["sampler_rank"]) == (2, rank)
        assert result["filled_by_strategy"] == (2, rank)  # by BaguaStrategy.process_dataloader
        # Lightning calls set_epoch at the start of every epoch (and may repeat a call); epochs in order.
        calls = result["set_epoch_calls"]
        assert sorted(set(calls)) == list(range(script.EPOCHS)), calls
        assert calls == sorted(calls), calls


def test_trainer_keeps_and_uses_the_sampler(tmp_path):
    results = run_fit(tmp_path, "sampler")
    assert_kept_and_set_epoch_called(results)
    for rank, result in enumerate(results):
        for epoch in range(script.EPOCHS):
            order = list(expected_sampler(rank, epoch))
            batches = [order[i : i + script.BATCH] for i in range(0, len(order), script.BATCH)]
            assert result["seen"][epoch] == batches, f"rank {rank}, epoch {epoch}"
    # Between them, the ranks saw every sample in every epoch.
    for epoch in range(script.EPOCHS):
        assert {i for result in results for batch in result["seen"][epoch] for i in batch} == set(range(45))


@pytest.mark.parametrize("use_distributed_sampler", ["true", "false"])
def test_trainer_keeps_and_uses_the_batch_sampler_and_fuse_step(tmp_path, use_distributed_sampler):
    """The batch-sampler loader, rebuilt by Lightning or left alone; the run also uses the fuse_step recipe."""
    results = run_fit(tmp_path, "batch_sampler", "--use-distributed-sampler", use_distributed_sampler)
    assert_kept_and_set_epoch_called(results, loader_kept=use_distributed_sampler == "false")
    dataset = script.IndexedDataset()
    steps = []
    for epoch in range(script.EPOCHS):
        per_rank = []
        for rank, result in enumerate(results):
            expected = list(
                LoadBalancingDistributedBatchSampler(expected_sampler(rank, epoch), script.make_batch_fn(dataset))
            )
            assert result["seen"][epoch] == expected, f"rank {rank}, epoch {epoch}"
            per_rank.append(expected)
        assert len(per_rank[0]) == len(per_rank[1])
        steps += list(zip(*per_rank, strict=True))
    # Every optimizer step went through fuse_step, and the result is what averaging the two ranks' gradients and
    # stepping an unfused AdamW gives.
    assert results[0]["global_step"] == len(steps)
    assert [result["fuse_steps"] for result in results] == [len(steps)] * 2
    network = script.make_network()
    optimizer = script.make_optimizer(network.parameters())
    for step_batches in steps:
        optimizer.zero_grad()
        for batch in step_batches:
            index = torch.tensor(batch)
            (script.loss_of(network, dataset.inputs[index], dataset.lengths[index]) / 2).backward()
        optimizer.step()
    for result in results:
        torch.testing.assert_close(result["state"], network.state_dict(), rtol=1e-5, atol=1e-6)


def test_fabric_keeps_the_sampler_and_it_takes_the_ranks_from_the_process_group(tmp_path):
    fabric_script = Path(__file__).parent / "scripts" / "fabric_sampler_script.py"
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(name, None)
    command = [sys.executable, str(fabric_script), "--out", str(tmp_path)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["sampler_kept"]
        assert result["ranks"] == (2, rank)
        for epoch in range(script.EPOCHS):
            expected = LoadBalancingDistributedSampler(
                script.IndexedDataset(), script.complexity, num_replicas=2, rank=rank, seed=script.SEED
            )
            expected.set_epoch(epoch)
            assert result["seen"][epoch] == list(expected), f"rank {rank}, epoch {epoch}"
