"""A script that catches an error and runs again behaves as with Lightning's DDP; a rank that raises alone still
ends the job.

The jobs are ``tests/strategies/scripts/recover_script.py`` on 2 Gloo processes, started by the framework's own launcher
through the dead-rank benchmark's runner (``benchmarks/robustness.py dead-rank``), which also finds any process left
behind.
"""

import json
import re
from pathlib import Path

import pytest
from benchmarks.robustness import EXIT_DEADLINE_S, run_job

from lightning_bagua.engine import available_algorithms

SCRIPT = Path(__file__).parent / "scripts" / "recover_script.py"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_every_algorithm_recovers_from_an_error_every_rank_raises(tmp_path, framework):
    result = run_job(
        "lightning", tmp_path, kill=False, script=SCRIPT, training_args=("--framework", framework), timeout_s=540
    )
    assert result.returncode == 0, result.output[-6000:]
    assert not result.leftover_pids, f"processes outlived the launcher: {result.leftover_pids}"
    assert "Ending rank process" not in result.output, result.output[-6000:]
    for rank in range(2):
        rounds = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())["rounds"]
        assert [r["algorithm"] for r in rounds] == available_algorithms()
        for outcome in rounds:
            assert outcome["caught"] is not None, outcome
            assert outcome["caught"].startswith(f"{outcome['place']} failed"), outcome
            # The second run went through all its batches (limit_train_batches=5), and validation after it.
            assert outcome["second_fit_steps"] == 5, outcome
            assert outcome["validated"], outcome
            # Nothing left between runs: the default group only, and no thread of an algorithm or its engine.
            assert outcome["groups"] == 1, outcome
            assert outcome["threads"] == rounds[0]["threads"], outcome
            assert not any(name.startswith("bagua") for name in outcome["threads"]), outcome


_RAISED_ALONE = "lightning_bagua: rank {rank} of 2 raised alone: rank(s) {other} reported no failure"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_raises_alone_ends_the_job_naming_itself(tmp_path, rank):
    # The script catches the error and would fit again; the other rank waits for this one in a collective. It learns
    # of the error before the raising rank exits, so no launcher's kill can cut its note off.
    marker = tmp_path / "death.json"
    result = run_job(
        "lightning",
        tmp_path,
        kill=False,
        script=SCRIPT,
        training_args=("--framework", "trainer", "--only-rank", str(rank), "--marker", str(marker)),
        timeout_s=240,
    )
    assert marker.exists(), f"rank {rank} never raised:\n{result.output[-4000:]}"
    assert result.returncode != 0, result.output[-4000:]
    assert not result.leftover_pids, f"processes outlived the launcher: {result.leftover_pids}"
    assert result.death_to_exit_s is not None
    assert result.death_to_exit_s < EXIT_DEADLINE_S, result.output[-4000:]
    assert _RAISED_ALONE.format(rank=rank, other=1 - rank) in result.output, result.output[-6000:]
    assert re.search(r"InjectedError: training_step failed at batch 2", result.output), result.output[-6000:]
    peer_note = rf"rank {1 - rank} of 2 saw a collective fail\. Other ranks that raised: rank {rank} \(InjectedError"
    assert re.search(peer_note, result.output), result.output[-6000:]
    assert not (tmp_path / "out").exists(), "the job went on after a rank raised alone"
