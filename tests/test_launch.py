"""The launcher: Bagua's flags, the children's environment, and real runs on one and two "nodes"."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_bagua.launch import build_parser, child_environment, torchrun_arguments
from tests.distributed import assert_ranks_identical, free_port
from tests.strategies.test_bagua import SCRIPT, load_ranks, python_path, reference_state

ROOT = Path(__file__).parents[1]
CHILD_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "BAGUA_SERVICE_PORT",
)
# Variables of an enclosing launch that must not leak into the launcher under test.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
LAUNCH_VARIABLES += ("MASTER_PORT", "BAGUA_SERVICE_PORT", "TORCHELASTIC_RUN_ID", "BAGUA_DEFAULT_BUCKET_SIZE")


def parse(*argv: str):
    return build_parser().parse_args([*argv, "train.py", "--lr", "0.1"])


def test_bagua_flags_map_onto_torchrun():
    args = parse("--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "4", "--master_addr", "node0")
    assert torchrun_arguments(args) == [
        "--nnodes=2",
        "--nproc-per-node=4",
        "--max-restarts=0",
        "--node-rank=1",
        "--master-addr=node0",
        "--master-port=29500",
        "-m",
        "lightning_bagua._launch_child",
        "--",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_elastic_options_replace_the_static_rendezvous():
    args = parse("--nnodes", "1:4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "node0:29400", "--max_restarts", "3")
    arguments = torchrun_arguments(args)
    assert "--rdzv-backend=c10d" in arguments
    assert "--rdzv-endpoint=node0:29400" in arguments
    assert "--max-restarts=3" in arguments
    assert not any(argument.startswith("--node-rank") for argument in arguments)


def test_script_modes_reach_the_child_wrapper():
    assert "--module" in torchrun_arguments(parse("-m"))
    assert "--no-python" in torchrun_arguments(parse("--no_python"))
    assert "--set-local-rank-flag" in torchrun_arguments(parse("--set_additional_flag"))


def test_bucket_size_and_bagua_net_become_environment_variables():
    args = parse("--default_bucket_size", "4194304", "--enable_bagua_net", "--bagua_service_port", "30001")
    assert child_environment(args, environ={"NCCL_NSOCKS_PERTHREAD": "8"}) == {
        "BAGUA_SERVICE_PORT": "30001",
        "BAGUA_DEFAULT_BUCKET_SIZE": "4194304",
        "NCCL_SOCKET_NTHREADS": "4",  # NCCL_NSOCKS_PERTHREAD was set by the user and stays theirs
    }


def test_without_a_bucket_size_the_children_keep_the_engines_default():
    assert "BAGUA_DEFAULT_BUCKET_SIZE" not in child_environment(parse(), environ={})


def launch(*argv: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = python_path()
    command = [sys.executable, "-m", "lightning_bagua.launch", *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_fit_launched_by_the_bagua_launcher(tmp_path):
    port = str(free_port())
    completed = launch(
        *("--nproc_per_node", "2", "--master_port", port, "--default_bucket_size", "2097152"),
        *(str(SCRIPT), "--out", str(tmp_path), "--devices", "2", "--max-steps", "4"),
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    results = load_ranks(tmp_path, 2)
    assert_ranks_identical(results)
    assert results[0]["cluster_environment"] == "BaguaEnvironment"
    torch.testing.assert_close(results[0]["state"], reference_state(2), rtol=1e-5, atol=1e-6)


PROBE = textwrap.dedent(
    """
    import json, os, sys
    out = os.path.join(os.environ["PROBE_OUT"], "rank" + os.environ["RANK"] + ".json")
    with open(out, "w") as file:
        json.dump({"argv": sys.argv[1:], "env": {name: os.environ.get(name) for name in NAMES}}, file)
    """
)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE.replace("NAMES", repr(list(CHILD_VARIABLES))))
    return path


def read_probes(directory: Path, world_size: int) -> list[dict]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def test_children_get_bagua_environment_and_the_local_rank_flag(tmp_path, probe, monkeypatch):
    monkeypatch.setenv("PROBE_OUT", str(tmp_path))
    port = str(free_port())
    completed = launch(
        "--nproc_per_node", "2", "--master_port", port, "--set_additional_flag", str(probe), "--x", cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    for rank, seen in enumerate(read_probes(tmp_path, 2)):
        assert seen["argv"] == [f"--local_rank={rank}", "--x"]
        assert seen["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "BAGUA_SERVICE_PORT": "29501",
        }


def test_two_launchers_make_two_nodes(tmp_path, probe, monkeypatch):
    monkeypatch.setenv("PROBE_OUT", str(tmp_path))
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = python_path()
    nodes = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "lightning_bagua.launch", "--nnodes", "2", "--node_rank", str(node)),
                *("--nproc_per_node", "2", "--master_port", port, str(probe)),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(outputs)
    seen = read_probes(tmp_path, 4)
    assert [s["env"]["NODE_RANK"] for s in seen] == ["0", "0", "1", "1"]
    assert [s["env"]["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1"]
    assert {s["env"]["WORLD_SIZE"] for s in seen} == {"4"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc_per_node", "0"], "--nproc_per_node must be at least 1, got 0"),
        (["-m", "--no_python"], "--module and --no_python exclude each other"),
        (["--default_bucket_size", "0"], "--default_bucket_size must be a positive number of bytes, got 0"),
        (["--nnodes", "2:1"], "MIN:MAX with MIN <= MAX, got '2:1'"),
        (["--nnodes", "1:2"], "--nnodes 1:2 asks for an elastic job, which needs a rendezvous"),
        (["--rdzv_endpoint", "node0:29400"], "--rdzv_endpoint takes effect only with --rdzv_backend"),
        (["--master_port", "70000"], "--master_port must be a port number from 0 to 65535, got 70000"),
        (["--bagua_service_port", "-1"], "--bagua_service_port must be a port number from 0 to 65535, got -1"),
        (["--max_restarts", "-1"], "--max_restarts must be 0 or more restarts after a failure, got -1"),
        ([], "The training script 'train.py' does not exist"),
        (["--no_python"], "--no_python runs 'train.py' as an executable, but it is neither on PATH"),
    ],
)
def test_bad_flags_fail_before_anything_starts(tmp_path, argv, message):
    completed = launch(*argv, "train.py", cwd=tmp_path, timeout=60)
    assert completed.returncode != 0
    assert message in completed.stderr


def test_flags_without_effect_are_reported_once(tmp_path, probe, monkeypatch):
    monkeypatch.setenv("PROBE_OUT", str(tmp_path))
    port = str(free_port())
    completed = launch(
        "--master_port", port, "--autotune_max_samples", "10", "--report_metrics", str(probe), cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stderr.count("--autotune_max_samples, --report_metrics have no effect in this release") == 1
