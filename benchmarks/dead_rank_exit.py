"""Measure how long a job takes to exit after one of its ranks is killed with SIGKILL, per launcher.

The job is ``tests/strategies/scripts/fit_script.py`` (a small regression model, ``BaguaStrategy``, Gloo on CPU, 2
processes) started by Lightning's own launcher (``python script.py`` with ``devices=2``), by
``python -m lightning_bagua.launch`` and by ``torchrun``. Rank 1 kills itself with SIGKILL in the middle of an
epoch, after writing the time of its death; the figure is the time from that moment until the launching command
has exited and no process of the job is left. Results go to ``benchmarks/results/dead_rank_exit.json``.

Run with the project's interpreter: ``.venv/bin/python benchmarks/dead_rank_exit.py [--repeats N]``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab.harness import free_port
from lab.jobs import REPO, job_env, kill_all, live_processes, torchrun
from lab.results import RESULTS, new_report, write_report

SCRIPT = REPO / "tests" / "strategies" / "scripts" / "fit_script.py"
LAUNCHERS = ("lightning", "lightning_bagua.launch", "torchrun")
KILLED_RANK = 1
# Epochs of 3 steps and 4 epochs; rank 1 dies at step 8, in the middle of the third epoch.
TRAINING_ARGS = ["--max-steps", "-1", "--max-epochs", "4", "--limit-train-batches", "3"]
KILL_AT_STEP = 8
# A job still alive this long after the death counts as hung (the bound).
EXIT_DEADLINE_S = 60.0
_JOB_VARIABLE = "LIGHTNING_BAGUA_FAULT_JOB"


@dataclass
class JobResult:
    """One job's outcome: its exit status, output, and the seconds from the rank's death to the last exit."""

    returncode: int
    output: str
    death_to_exit_s: float | None
    leftover_pids: list[int]


def launcher_command(launcher: str, port: int, max_restarts: int = 0) -> list[str]:
    """Return the command that starts the 2-process job under ``launcher``, up to the script."""
    if launcher == "lightning":
        if max_restarts:
            raise ValueError("Lightning's own launcher does not restart failed processes.")
        return [sys.executable]
    if launcher == "lightning_bagua.launch":
        return [sys.executable, "-m", "lightning_bagua.launch", "--nproc_per_node", "2", "--master_port", str(port),
                "--max_restarts", str(max_restarts)]  # fmt: skip
    if launcher == "torchrun":
        return torchrun("--nproc-per-node", "2", "--master-port", str(port), "--max-restarts", str(max_restarts))
    raise ValueError(f"Unknown launcher {launcher!r}; choose from {LAUNCHERS}.")


def job_pids(job_id: str) -> list[int]:
    """Return the processes whose environment carries this job's id (the launcher and everything it started)."""
    return [pid for pid, _, env in live_processes() if env.get(_JOB_VARIABLE) == job_id]


def run_job(
    launcher: str,
    workdir: Path,
    kill: bool = True,
    max_restarts: int = 0,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 240.0,
    script: Path = SCRIPT,
    training_args: tuple[str, ...] = tuple(TRAINING_ARGS),
) -> JobResult:
    """Run the job under ``launcher`` in ``workdir``; rank 1 kills itself once at step 8 when ``kill``.

    The marker file rank 1 writes before dying keeps a restarted rank 1 alive, so ``max_restarts=1`` finishes.
    ``script`` may be another job taking the same ``--out``, ``--devices`` and ``--kill-*`` options (the Fabric
    job of the tests), with its own ``training_args``.
    """
    port = free_port()
    marker = workdir / "death.json"
    job_id = uuid.uuid4().hex
    command = [*launcher_command(launcher, port, max_restarts), str(script), "--out", str(workdir / "out"),
               "--devices", "2", *training_args, *extra_args]  # fmt: skip
    if kill:
        command += ["--kill-rank", str(KILLED_RANK), "--kill-at-step", str(KILL_AT_STEP), "--kill-marker", str(marker)]
    env = job_env(MASTER_PORT=str(port), **{_JOB_VARIABLE: job_id})
    log_path = workdir / "output.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
        exited = time.time()
    # The launcher is gone; wait briefly for any process it left behind, then name the survivors.
    deadline = time.monotonic() + 5
    while job_pids(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = job_pids(job_id)
    kill_all(leftovers)  # never leave a stray job running, whatever the result
    death = json.loads(marker.read_text())["time"] if marker.exists() else None
    return JobResult(
        returncode=returncode,
        output=log_path.read_text(errors="replace"),
        death_to_exit_s=None if death is None or max_restarts else exited - death,
        leftover_pids=leftovers,
    )


def main() -> None:
    """Run every launcher ``--repeats`` times and write the death-to-exit figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for launcher in LAUNCHERS:
        seconds = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as directory:
                result = run_job(launcher, Path(directory), timeout_s=EXIT_DEADLINE_S + 120)
            if result.death_to_exit_s is None or result.returncode == 0 or result.leftover_pids:
                raise RuntimeError(f"{launcher}: the job did not fail as expected:\n{result.output[-4000:]}")
            seconds.append(round(result.death_to_exit_s, 3))
            print(f"{launcher}: {seconds[-1]:.2f} s from rank {KILLED_RANK}'s death to the job's exit", flush=True)
        rows.append(
            {"launcher": launcher, "death_to_exit_s": seconds, "median_s": round(statistics.median(seconds), 3),
             "max_s": max(seconds)}
        )  # fmt: skip
    settings = {
        "job": f"tests/strategies/scripts/fit_script.py {' '.join(TRAINING_ARGS)}, gradient_allreduce, gloo, CPU",
        "killed_rank": KILLED_RANK,
        "kill_at_step": KILL_AT_STEP,
        "repeats": args.repeats,
    }
    benchmark = "seconds from one rank's SIGKILL (mid-epoch) to the exit of the whole 2-process job"
    report = new_report(benchmark, settings, rows, command="python benchmarks/dead_rank_exit.py")
    print(f"wrote {write_report(RESULTS, 'dead_rank_exit', report)}")


if __name__ == "__main__":
    main()
