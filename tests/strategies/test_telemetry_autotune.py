"""BaguaStrategy's telemetry and autotune flags in real Lightning runs (2 Gloo processes, CSVLogger)."""

import csv
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bagua import BaguaStrategy
from lightning_bagua.engine.autotune import DEFAULT_BUCKET_SIZES_MB
from tests.distributed import assert_ranks_identical, free_port, run_job
from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer
from tests.strategies.test_bagua import TOLERANCE, param_bytes

SCRIPT = Path(__file__).parent / "scripts" / "telemetry_fit_script.py"
TELEMETRY_COLUMNS = [
    "bagua/bytes_sent",
    "bagua/bytes_received",
    "bagua/bytes_uncompressed",
    "bagua/compression_ratio",
    "bagua/communication_wait_s",
    "bagua/collective_calls",
]
# Every default candidate plus nothing else (the strategy's 10 MiB is one of them): 1 warm-up and 3 timed steps each.
TUNING_STEPS = len(DEFAULT_BUCKET_SIZES_MB) * 4
AUTOTUNE_STEPS = TUNING_STEPS + 2


def run(out: Path, *args: str, autotune: bool) -> list[dict]:
    env = {"MASTER_PORT": str(free_port()), "BAGUA_AUTOTUNE": "1" if autotune else "0"}
    command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    completed = run_job(command, timeout=240, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def read_metrics(out: Path) -> list[dict]:
    with open(out / "csv" / "version_0" / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def reference_state(world_size: int, steps: int) -> dict:
    """One process trained on the union of the ranks' batches; Lightning's sampler reshuffles with seed = epoch."""
    dataset = make_dataset()
    model = make_network()
    optimizer = make_optimizer(model.parameters())
    per_step = BATCH * world_size
    done, epoch = 0, 0
    while done < steps:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist()
        for start in range(0, len(order), per_step):
            if done == steps:
                break
            inputs, targets = dataset[order[start : start + per_step]]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            done += 1
        epoch += 1
    return {f"net.{k}": v for k, v in model.state_dict().items()}


def test_telemetry_and_autotune_in_a_lightning_run(tmp_path):
    results = run(tmp_path, "--telemetry", "--max-steps", str(AUTOTUNE_STEPS), autotune=True)
    assert_ranks_identical(results)
    torch.testing.assert_close(results[0]["state"], reference_state(2, AUTOTUNE_STEPS), **TOLERANCE)
    # Every rank measured the same step times (the maximum over ranks) and made the same choice.
    assert results[0]["decision"] is not None
    assert results[0]["decision"].bucket_cap_mb in DEFAULT_BUCKET_SIZES_MB
    assert [r["decision"] for r in results] == [results[0]["decision"]] * 2
    assert results[0]["measurements"] == results[1]["measurements"]
    assert len(results[0]["measurements"]) == len(DEFAULT_BUCKET_SIZES_MB)
    assert results[0]["telemetry_after_fit"] is None  # the model is unwrapped after fitting
    rows = read_metrics(tmp_path)
    telemetry_rows = [row for row in rows if row.get("bagua/bytes_sent")]
    assert len(telemetry_rows) == AUTOTUNE_STEPS, "one record per step, logged by rank zero only"
    assert [int(row["step"]) for row in telemetry_rows] == list(range(AUTOTUNE_STEPS))
    for row in telemetry_rows:
        assert set(TELEMETRY_COLUMNS) <= set(row)
        # gradient_allreduce: every gradient byte goes out once per step and comes back reduced.
        assert int(float(row["bagua/bytes_sent"])) == param_bytes()
        assert int(float(row["bagua/bytes_received"])) == param_bytes()
        assert float(row["bagua/compression_ratio"]) == 1.0
        assert float(row["bagua/communication_wait_s"]) >= 0.0
    decisions = [row for row in rows if row.get("bagua/autotune/bucket_cap_mb")]
    assert len(decisions) == 1, "the choice is logged once"
    assert float(decisions[0]["bagua/autotune/bucket_cap_mb"]) == results[0]["decision"].bucket_cap_mb
    assert int(decisions[0]["step"]) == TUNING_STEPS
    assert results[0]["bytes_by_op"] == {"all_reduce": AUTOTUNE_STEPS * param_bytes()}


def test_nothing_is_logged_when_off(tmp_path):
    results = run(tmp_path, "--max-steps", "4", autotune=False)
    assert_ranks_identical(results)
    assert all(r["decision"] is None for r in results)
    rows = read_metrics(tmp_path)
    assert any(row.get("train_loss") for row in rows), "the logger did run"
    assert not any(column.startswith("bagua/") for column in rows[0])


def test_strategy_reads_the_environment_and_checks_its_flags(monkeypatch):
    monkeypatch.setenv("BAGUA_AUTOTUNE", "1")
    assert BaguaStrategy()._autotune is True
    assert BaguaStrategy(autotune=False)._autotune is False  # an explicit value wins
    monkeypatch.delenv("BAGUA_AUTOTUNE")
    assert BaguaStrategy()._autotune is False
    assert BaguaStrategy().telemetry is None
    assert BaguaStrategy().autotuner is None
    with pytest.raises(TypeError, match=r"`autotune` must be a bool or None, got 'yes' \(str\)"):
        BaguaStrategy(autotune="yes")
    with pytest.raises(TypeError, match=r"`telemetry` must be a bool, got 1 \(int\)"):
        BaguaStrategy(telemetry=1)
    monkeypatch.setenv("BAGUA_AUTOTUNE", "fast")
    with pytest.raises(ValueError, match=r"BAGUA_AUTOTUNE='fast' is not a valid autotune level"):
        BaguaStrategy()
