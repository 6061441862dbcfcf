import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_train_example_learns_digits_on_two_cpu_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    command = [
        sys.executable,
        str(EXAMPLE),
        "--devices",
        "2",
        "--accelerator",
        "cpu",
        "--max-epochs",
        "5",
        "--algorithm",
        "gradient_allreduce",
    ]
    # Run from an empty directory, so the check below sees anything the example leaves behind.
    result = subprocess.run(
        command,
        cwd=tmp_path,
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
    assert float(accuracies[0]) >= 0.90
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output, "the example should have run as two processes"
    assert list(tmp_path.iterdir()) == [], "the example should not write logs or checkpoints"
