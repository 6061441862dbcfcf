"""Communication telemetry on real Gloo processes: per-step bytes against the theory of each algorithm, and off."""

import math
import time

import pytest
import torch
from torch import nn

from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, QAdamOptimizer, telemetry
from lightning_bagua.engine.communication import CommunicationCounter
from lightning_bagua.engine.telemetry import TELEMETRY_KEYS
from tests.distributed import run_processes
from tests.engine.algorithms.test_low_rank import RANK, SHAPES, message_bytes
from tests.engine.test_data_parallel import batch_for, make_model

STEPS = 4
WORLD_SIZE = 2
BUCKET_CAP_MB = 0.004  # several buckets on the small model
HEADER = 32  # MinMaxUInt8 header bytes per encoded chunk
QADAM_WARMUP = 3
LOW_RANK_WARMUP = 2


def train(rank: int, name: str, kwargs: dict, telemetry_on: bool) -> dict:
    """Train STEPS steps; return each step's record, the bucket sizes DDP handed over, and what was registered."""
    clock_reads = []
    real_clock = time.perf_counter

    def counting_clock() -> float:
        clock_reads.append(1)
        return real_clock()

    telemetry._clock = counting_clock
    bucket_numels: list[list[int]] = []
    registered = []
    original_register = BaguaDistributedDataParallel.register_comm_hook

    def spying_register(self, state, hook):
        registered.append(hook)

        def spy(state, bucket):
            bucket_numels[-1].append(bucket.buffer().numel())
            return hook(state, bucket)

        return original_register(self, state, spy)

    BaguaDistributedDataParallel.register_comm_hook = spying_register
    model = make_model()
    if name == "qadam":
        optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=QADAM_WARMUP)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = BaguaDistributedDataParallel(
        model, [optimizer], Algorithm.init(name, **kwargs), bucket_cap_mb=BUCKET_CAP_MB, telemetry=telemetry_on
    )
    records, second_calls = [], []
    for step in range(STEPS):
        bucket_numels.append([])
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        if telemetry_on:
            records.append(ddp.telemetry.end_step())
            second_calls.append(ddp.telemetry.end_step())
    result = {
        "records": records,
        "second_calls": second_calls,
        "bucket_numels": bucket_numels,
        "telemetry_is_none": ddp.telemetry is None,
        # The outermost hook: telemetry's measuring hook when on; without it, the bucket-layout recorder that calls
        # the algorithm's own hook (closures name their defining function in __qualname__).
        "registered_hook": registered[0].__qualname__.rsplit(".", 1)[-1],
        "clock_reads": len(clock_reads),
        "bytes_by_op": ddp.communication_counter.bytes_by_op,
    }
    ddp.close()
    BaguaDistributedDataParallel.register_comm_hook = original_register
    return result


def parameter_numel() -> int:
    return sum(p.numel() for p in make_model().parameters())


def full_precision_step(numels: list[int]) -> dict:
    nbytes = 4 * sum(numels)
    return {"bytes_sent": nbytes, "bytes_received": nbytes, "bytes_uncompressed": nbytes, "calls": len(numels)}


def scatter_gather_step(numels: list[int], n: int = WORLD_SIZE) -> dict:
    """Bytes of bytegrad's compressed scatter-gather of each bucket, from the codec's layout (one header per row)."""
    sent = received = uncompressed = 0
    for numel in numels:
        chunk = -(-numel // n)
        row = HEADER + chunk
        # all-to-all: n rows out, the n - 1 rows of the others in; they encode the padded bucket (n * chunk floats).
        sent += n * row
        received += (n - 1) * row
        uncompressed += 4 * n * chunk
        # all-gather of the reduced chunk: one row out, n - 1 rows in; it encodes chunk floats.
        sent += row
        received += (n - 1) * row
        uncompressed += 4 * chunk
    return {
        "bytes_sent": sent,
        "bytes_received": received,
        "bytes_uncompressed": uncompressed,
        "calls": 2 * len(numels),
    }


def theory(name: str, kwargs: dict, step: int, numels: list[int]) -> dict:
    weights = parameter_numel()
    if name == "gradient_allreduce":
        return full_precision_step(numels)
    if name == "bytegrad":
        return scatter_gather_step(numels)
    if name == "qadam":
        # Gradients at full precision while the optimizer's step count s = step + 1 is below the warm-up, then momenta
        # (as many elements as the bucket's gradients) by the compressed scatter-gather.
        return full_precision_step(numels) if step + 1 < QADAM_WARMUP else scatter_gather_step(numels)
    if name == "decentralized":
        # One fp32 group: all-reduce of the weights ("all"), or the weights sent to and received from the partner.
        return {"bytes_sent": 4 * weights, "bytes_received": 4 * weights, "bytes_uncompressed": 4 * weights, "calls": 1}
    if name == "low_precision_decentralized":
        # The compressed difference (one chunk per bucket-sized piece, as Bagua compresses per bucket) goes to the
        # one peer that is both neighbours on a ring of two, and one code of the same size comes back.
        assert WORLD_SIZE == 2
        pieces = math.ceil(4 * weights / (BUCKET_CAP_MB * 1024**2))
        code = pieces * (HEADER + math.ceil(weights / pieces))
        return {"bytes_sent": code, "bytes_received": code, "bytes_uncompressed": 4 * weights, "calls": 1}
    if name == "low_rank":
        if step < LOW_RANK_WARMUP:
            return full_precision_step(numels)
        return low_rank_step(numels)
    raise AssertionError(name)


def low_rank_step(numels: list[int]) -> dict:
    """Two all-gathers per bucket with factors (one without), from test_low_rank's message layout."""
    by_numel = {}  # the model's buckets, told apart by size: all in one, and the two of the rebuilt layout
    names = list(SHAPES)
    for bucket in (names, ["4.bias", "4.weight", "2.bias", "2.weight"], ["0.bias", "0.weight"]):
        by_numel[sum(SHAPES[name][0] * SHAPES[name][1] for name in bucket)] = bucket
    sent = calls = 0
    for numel in numels:
        first, second = message_bytes(by_numel[numel])
        sent += first + second
        calls += 2 if second else 1
    received = (WORLD_SIZE - 1) * sent
    return {"bytes_sent": sent, "bytes_received": received, "bytes_uncompressed": 4 * sum(numels), "calls": calls}


CASES = [
    ("gradient_allreduce", {}),
    ("bytegrad", {"hierarchical": False}),
    ("decentralized", {"hierarchical": False}),
    ("decentralized", {"hierarchical": False, "peer_selection_mode": "shift_one"}),
    ("low_precision_decentralized", {"hierarchical": False}),
    ("qadam", {"hierarchical": False}),
    ("low_rank", {"hierarchical": False, "warmup_steps": LOW_RANK_WARMUP, "rank": RANK}),
]
OFF_CASE = ("bytegrad", {"hierarchical": False})


def train_every_case(rank: int, world_size: int) -> dict:
    # One pair of processes for every case: starting processes costs more than these few steps.
    results = {index: train(rank, name, kwargs, True) for index, (name, kwargs) in enumerate(CASES)}
    results["off"] = train(rank, *OFF_CASE, False)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_processes(train_every_case, WORLD_SIZE)


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{n}-{k.get('peer_selection_mode', 'all')}" for n, k in CASES]
)
def test_byte_counts_per_step_match_the_theory(runs, index):
    name, kwargs = CASES[index]
    results = [run[index] for run in runs]
    for rank, result in enumerate(results):
        assert not result["telemetry_is_none"]
        assert result["registered_hook"] == "measured_hook"  # the measuring hook wraps the algorithm's
        assert result["second_calls"] == [None] * STEPS, "a step closes once"
        for step, record in enumerate(result["records"]):
            expected = theory(name, kwargs, step, result["bucket_numels"][step])
            assert record["step"] == step
            assert set(TELEMETRY_KEYS) <= set(record)
            assert record["bytes_sent"] == expected["bytes_sent"], (rank, step)
            assert record["bytes_received"] == expected["bytes_received"], (rank, step)
            assert record["bytes_uncompressed"] == expected["bytes_uncompressed"], (rank, step)
            assert record["collective_calls"] == expected["calls"], (rank, step)
            ratio = expected["bytes_uncompressed"] / expected["bytes_sent"]
            assert record["compression_ratio"] == pytest.approx(ratio, rel=1e-12)
            assert record["communication_wait_s"] >= 0.0
            if name == "qadam":
                assert record["phase/compressed"] == float(step + 1 >= QADAM_WARMUP)
            elif name == "low_rank":
                assert record["phase/compressed"] == float(step >= LOW_RANK_WARMUP)
            else:
                assert not any(key.startswith("phase/") for key in record)
        assert result["clock_reads"] > 0
    if name in ("bytegrad", "low_precision_decentralized"):
        assert results[0]["records"][-1]["compression_ratio"] > 3.0  # 8-bit codes: about a quarter of fp32
    if name == "low_rank":
        assert results[0]["records"][-1]["compression_ratio"] > 4.0  # 8-bit factors: fewer than 8-bit gradients


def test_nothing_is_measured_when_telemetry_is_off(runs):
    measured_index = CASES.index(OFF_CASE)
    for run in runs:
        result, measured = run["off"], run[measured_index]
        assert result["telemetry_is_none"]
        assert result["registered_hook"] == "layout_hook", "with telemetry off no measuring hook is registered"
        assert result["clock_reads"] == 0
        assert result["records"] == []
        # The communication itself is the same either way.
        assert result["bytes_by_op"] == measured["bytes_by_op"]


def test_counter_reports_received_and_uncompressed_bytes():
    counter = CommunicationCounter()
    counter.record("all_reduce", torch.zeros(10))
    counter.record("all_gather", torch.zeros(8, dtype=torch.uint8), received=24, uncompressed=32)
    assert counter.bytes_sent == 48
    assert counter.bytes_received == 64
    assert counter.bytes_uncompressed == 72
    assert counter.received_by_op == {"all_reduce": 40, "all_gather": 24}
    totals = counter.totals()
    assert (totals.bytes_sent, totals.bytes_received, totals.bytes_uncompressed, totals.calls) == (48, 64, 72, 2)
    counter.reset()
    assert counter.totals().calls == 0
    assert counter.bytes_uncompressed == 0


def test_step_without_communication_has_no_ratio():
    # A record taken while nothing was sent reports NaN, not a division error.
    counter = CommunicationCounter()

    class NoPhase:
        def telemetry_phase(self) -> dict:
            return {}

    measured = telemetry.CommunicationTelemetry(counter, NoPhase(), torch.device("cpu"))
    assert measured.end_step() is None  # no synchronizing backward yet
    measured._backward_finished()
    record = measured.end_step()
    assert record["bytes_sent"] == 0
    assert math.isnan(record["compression_ratio"])
    assert measured.last_step is record


def train_async_with_telemetry(rank: int, world_size: int) -> list[dict | None]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = Algorithm.init("async", warmup_steps=2, sync_interval_ms=1)
    ddp = BaguaDistributedDataParallel(model, [optimizer], algorithm, telemetry=True)
    records = []
    for step in range(5):
        inputs, targets = batch_for(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
        if step >= 2:
            time.sleep(0.2)  # let the background rounds run between steps
        records.append(ddp.telemetry.end_step())
    algorithm.abort(ddp)
    ddp.close()
    return records


def test_async_reports_its_warmup_and_averaging_rate():
    for records in run_processes(train_async_with_telemetry, WORLD_SIZE):
        phases = [(r["phase/warmup"], r["phase/syncs_per_second"]) for r in records if r is not None]
        assert [warmup for warmup, _ in phases[:2]] == [1.0, 1.0], records
        assert all(warmup == 0.0 for warmup, _ in phases[2:]), records
        assert phases[2:], "no record after the warm-up"
        # Rounds copy the weights at step boundaries, so a step's record may close before its round lands: some
        # record after the warm-up counts rounds, none during it.
        assert any(rate > 0 for _, rate in phases[2:]), f"no averaging rounds counted after the warm-up: {records}"
        assert all(rate == 0 for _, rate in phases[:2]), records
