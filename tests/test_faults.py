"""Dead workers: a rank killed with SIGKILL mid-epoch ends the job, naming the rank, under every launcher; with
``--max_restarts=1`` and ``ckpt_path="last"`` the job restarts from its last checkpoint and ends where an
uninterrupted run ends.

The jobs are the death-to-exit benchmark's (``benchmarks/robustness.py dead-rank``):
``tests/strategies/scripts/fit_script.py`` on 2 Gloo processes, rank 1 killing itself at step 8 of 12.
"""

import re
import threading
import time

import pytest
import torch
from benchmarks.robustness import EXIT_DEADLINE_S, KILLED_RANK, run_job

# How each launcher's output names the dead rank: Lightning's child-process observer (or, when rank 0's collective
# fails first, the strategy's note), and torch elastic's failure summary for the other two.
_NAMES_THE_RANK = {
    "lightning": re.compile(
        rf"\[rank: {KILLED_RANK}\] Child process with PID \d+ terminated with code -9|Failed rank\(s\): {KILLED_RANK} "
    ),
    "lightning_bagua.launch": re.compile(rf"rank\s*: {KILLED_RANK} \(local_rank: {KILLED_RANK}\)\s+exitcode\s*: -9"),
    "torchrun": re.compile(rf"rank\s*: {KILLED_RANK} \(local_rank: {KILLED_RANK}\)\s+exitcode\s*: -9"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["lightning", "lightning_bagua.launch", "torchrun"])
def test_a_killed_rank_ends_the_job_and_is_named(tmp_path, launcher):
    result = run_job(launcher, tmp_path, timeout_s=180)
    assert result.death_to_exit_s is not None, f"rank {KILLED_RANK} never died:\n{result.output[-4000:]}"
    assert result.returncode != 0, result.output[-4000:]
    assert not result.leftover_pids, f"processes outlived the launcher: {result.leftover_pids}"
    # A bound on hanging, not a speed figure: the issue asks every process to be gone within 60 s.
    assert result.death_to_exit_s < EXIT_DEADLINE_S, result.output[-4000:]
    assert _NAMES_THE_RANK[launcher].search(result.output), result.output[-6000:]
    assert not (tmp_path / "out").exists(), "a rank finished although its peer died"


@pytest.mark.timeout(300)
def test_restart_resumes_from_the_last_checkpoint_and_matches_an_uninterrupted_run(tmp_path):
    checkpoints = ("--checkpoint-dir", str(tmp_path / "restarted" / "ckpt"), "--ckpt-path", "last")
    (tmp_path / "restarted").mkdir()
    restarted = run_job("lightning_bagua.launch", tmp_path / "restarted", max_restarts=1, extra_args=checkpoints)
    assert restarted.returncode == 0, restarted.output[-6000:]
    assert (tmp_path / "restarted" / "death.json").exists(), "rank 1 was never killed"
    assert "Restored all states from the checkpoint" in restarted.output
    assert re.search(r"last\.ckpt", restarted.output)

    (tmp_path / "uninterrupted").mkdir()
    uninterrupted = run_job("lightning_bagua.launch", tmp_path / "uninterrupted", kill=False)
    assert uninterrupted.returncode == 0, uninterrupted.output[-6000:]
    for rank in range(2):
        expected = torch.load(tmp_path / "uninterrupted" / "out" / f"rank{rank}.pt", weights_only=False)["state"]
        actual = torch.load(tmp_path / "restarted" / "out" / f"rank{rank}.pt", weights_only=False)["state"]
        # gradient_allreduce on CPU with Gloo is deterministic, and the replayed epoch sees the same batches.
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_failure_reports_tell_a_shared_error_from_one_raised_alone_and_a_failed_collective():
    from lightning_bagua.strategies._core.faults import FailureReport

    shared = FailureReport(0, 2, collective=False, reports={0: "ValueError: x", 1: "ValueError: x"}, window_s=20)
    assert not shared.alone
    assert shared.note() is None  # nothing to say: every rank goes on with its own error

    alone = FailureReport(1, 3, collective=False, reports={1: "ValueError: x"}, window_s=20)
    assert alone.alone
    assert alone.silent == [0, 2]
    assert "rank 1 of 3 raised alone: rank(s) 0, 2 reported no failure within 20 s" in alone.note()

    collective = FailureReport(0, 3, collective=True, reports={0: "RuntimeError: gloo", 2: "ValueError: y"}, window_s=5)
    assert not collective.alone
    assert "Failed rank(s): 1 (no report within 5 s" in collective.note()
    assert "Other ranks that raised: rank 2 (ValueError: y)." in collective.note()

    # Leaving the script, a rank does not wait for the others: it cannot tell, and has nothing to decide.
    leaving = FailureReport(0, 2, collective=False, reports={0: "ValueError: x"}, window_s=0)
    assert not leaving.alone
    assert leaving.note() is None

    # The store is gone (its host died): nobody can tell, and the job is failing anyway; only a collective says so.
    lost = FailureReport(1, 2, collective=False, reports={1: "ValueError: x"}, window_s=20, store_error="gone")
    assert not lost.alone
    assert lost.note() is None
    cut = FailureReport(0, 2, collective=True, reports={0: "RuntimeError: gloo"}, window_s=5, store_error="gone")
    assert "collecting the other ranks' reports was cut short (gone)" in cut.note()
    assert "torchrun and lightning_bagua.launch end every rank when one dies" in cut.note()


def _attempt(port: int, world_size: int, ranks: list[int], timeout_s: float = 20.0) -> dict[int, object]:
    """Run ``agree_on_attempt`` for ``ranks`` of one attempt, each on a store client of its own, in threads."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_bagua.strategies._core.faults import agree_on_attempt

    results: dict[int, object] = {}

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        try:
            results[rank] = agree_on_attempt(client, rank, world_size, timedelta(seconds=timeout_s))
        except Exception as error:
            results[rank] = error

    # Rank 0 last: the other ranks read the token an earlier attempt left, as restarted workers can.
    threads = [threading.Thread(target=join, args=(rank,)) for rank in sorted(ranks, key=lambda rank: rank == 0)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(60)
    return results


def test_the_ranks_of_each_attempt_agree_on_a_token_that_no_earlier_attempt_left():
    """Workers restarted by several agents carry different restart counts; the store tells their attempts apart."""
    from datetime import timedelta

    import torch.distributed as dist
    from benchmarks.lab.harness import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    first = _attempt(port, 3, [0, 1, 2])
    assert all(isinstance(token, str) for token in first.values()), first
    assert len(set(first.values())) == 1, first

    # An attempt cut short: rank 2 died before it registered; ranks 0 and 1 give up at their timeout.
    cut = _attempt(port, 3, [0, 1], timeout_s=2.0)
    assert all(isinstance(error, dist.DistNetworkError) for error in cut.values()), cut
    assert "waited for every rank" in str(cut[0])
    assert "waited for rank 0 to count every rank in" in str(cut[1])

    # The next attempt starts its ranks before rank 0, on the finished and the cut-short attempts' keys.
    second = _attempt(port, 3, [0, 1, 2])
    assert all(isinstance(token, str) for token in second.values()), second
    assert len(set(second.values())) == 1, second
    assert second[0] != first[0]
    del master
