import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"

# Variables a surrounding launcher may have set; inherited, they would make the example join that job instead of
# starting its own two processes.
LAUNCH_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "BAGUA_SERVICE_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_NAME",
)


def run_example(directory: Path, algorithm: str, *extra: str) -> tuple[float, str]:
    """Run the example on two CPU processes from ``directory``; return its test accuracy and its output."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, str(EXAMPLE), "--devices", "2", "--accelerator", "cpu", "--max-epochs", "5"]
    command += ["--algorithm", algorithm, *extra]
    result = subprocess.run(
        command,
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    # Only global rank zero reports, and it does so exactly once.
    accuracies = re.findall(r"^test accuracy: (\d+\.\d+)$", result.stdout, flags=re.MULTILINE)
    assert len(accuracies) == 1, output[-5000:]
    return float(accuracies[0]), output


@pytest.fixture(scope="module")
def gradient_allreduce_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    directory = tmp_path_factory.mktemp("gradient_allreduce")
    accuracy, output = run_example(directory, "gradient_allreduce")
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output, "the example should have run as two processes"
    # Run from an empty directory, so this sees anything the example leaves behind.
    assert list(directory.iterdir()) == [], "the example should not write logs or checkpoints"
    return accuracy


def test_train_example_learns_digits_on_two_cpu_processes(gradient_allreduce_accuracy):
    assert gradient_allreduce_accuracy >= 0.90


@pytest.mark.parametrize(
    ("algorithm", "kwargs"),
    [
        ("bytegrad", '{"hierarchical": false}'),
        ("decentralized", '{"hierarchical": false}'),
        ("decentralized", '{"hierarchical": false, "peer_selection_mode": "shift_one"}'),
        ("low_precision_decentralized", '{"hierarchical": false}'),
        # The example trains qadam with QAdamOptimizer (warm-up 100 steps of about 230), async with 20 warm-up steps.
        ("qadam", '{"hierarchical": false}'),
        ("async", '{"warmup_steps": 20, "sync_interval_ms": 50}'),
    ],
)
def test_every_algorithm_trains_the_example_within_two_points(tmp_path, gradient_allreduce_accuracy, algorithm, kwargs):
    accuracy, _ = run_example(tmp_path, algorithm, "--algorithm-kwargs", kwargs)
    assert accuracy >= gradient_allreduce_accuracy - 0.02, f"{algorithm}: {accuracy} vs {gradient_allreduce_accuracy}"
