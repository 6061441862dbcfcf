"""Two hosts on one machine: network namespaces joined by a veth pair, one launcher per host.

Each host has its own network stack and an address of its own (in 127.80.0.0/16, routed over the veth with
``route_localnet``), so rendezvous and every collective cross a real link, as between two machines.
"""

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.distributed import assert_ranks_identical
from tests.strategies.test_bagua import MAX_STEPS, SCRIPT, load_ranks, param_bytes, python_path, reference_state
from tests.test_launch import LAUNCH_VARIABLES

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2 (CI runs as root with both)",
)


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


@contextmanager
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Create two namespaces joined by a veth pair; yield (namespace, interface, address) per host."""
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    subnet = random.randrange(1, 250)
    hosts = [(f"lbns{tag}h{i}", f"lbv{tag}h{i}", f"127.80.{subnet}.{i + 1}") for i in range(2)]
    try:
        for namespace, _, _ in hosts:
            run("ip", "netns", "add", namespace)
        run("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for namespace, interface, address in hosts:
            run("ip", "link", "set", interface, "netns", namespace)
            for scope in ("all", interface):
                run("ip", "netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.conf.{scope}.route_localnet=1")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            run("ip", "-n", namespace, "link", "set", interface, "up")
        yield hosts
    finally:
        for namespace, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def launch_on_two_hosts(out: Path, *script_args: str) -> None:
    with two_hosts() as hosts:
        master = hosts[0][2]
        processes = []
        for node, (namespace, interface, _) in enumerate(hosts):
            env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
            # Gloo must use the host's own link, not the loopback device it would find by hostname.
            env.update({"PYTHONPATH": python_path(), "GLOO_SOCKET_IFNAME": interface})
            command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "lightning_bagua.launch"]
            command += ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2"]
            command += ["--master_addr", master, "--master_port", "29560"]
            command += [str(SCRIPT), "--out", str(out), "--devices", "2", "--num-nodes", "2"]
            command += ["--max-steps", str(MAX_STEPS), *script_args]
            processes.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        try:
            outputs = [process.communicate(timeout=300)[0] for process in processes]
        finally:
            for process in processes:
                process.kill()
        assert all(process.returncode == 0 for process in processes), "\n".join(o[-4000:] for o in outputs)


def test_gradient_allreduce_across_two_hosts(tmp_path):
    launch_on_two_hosts(tmp_path)
    results = load_ranks(tmp_path, 4)
    assert_ranks_identical(results)
    assert {result["cluster_environment"] for result in results} == {"BaguaEnvironment"}
    torch.testing.assert_close(results[0]["state"], reference_state(4), rtol=1e-5, atol=1e-6)


def test_hierarchical_bytegrad_across_two_hosts_of_two_processes(tmp_path):
    launch_on_two_hosts(tmp_path, "--algorithm", "bytegrad", "--kwargs", '{"hierarchical": true}')
    results = load_ranks(tmp_path, 4)
    assert_ranks_identical(results)
    total = MAX_STEPS * param_bytes()
    for rank, result in enumerate(results):
        # Full precision inside each host; only the two leaders exchange 8-bit codes over the link.
        assert result["bytes_by_op"]["reduce"] == total
        assert ("all_to_all" in result["bytes_by_op"]) == (rank % 2 == 0), f"rank {rank}"
    torch.testing.assert_close(results[0]["state"], reference_state(4), rtol=0.05, atol=0.01)
