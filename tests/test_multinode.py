"""Two hosts on one machine, one launcher per host, in two modes.

``namespaces``: each host is a network namespace with a network stack and an address of its own (in
127.80.0.0/16, routed over a veth pair with ``route_localnet``), so rendezvous and every collective cross a real
link, as between two machines. This needs root and iproute2; the CI workflow runs it with sudo and sets
``LIGHTNING_BAGUA_REQUIRE_NAMESPACES=1``, which turns the skip into a failure where they are missing.

``loopback``: both launchers share the loopback device; this needs no privileges and runs everywhere, so the
two-launcher path is never left untested. It cannot give the hosts addresses of their own, so the engine's
host detection is tested across namespaces only (and with simulated hosts in tests/engine/test_communication.py).
"""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.distributed import assert_ranks_identical, free_port
from tests.strategies.test_bagua import MAX_STEPS, SCRIPT, load_ranks, param_bytes, python_path, reference_state
from tests.test_launch import LAUNCH_VARIABLES

ROOT = Path(__file__).parents[1]

HOST_LAYOUT_WORKER = Path(__file__).parent / "scripts" / "host_layout_worker.py"
MODES = ["namespaces", "loopback"]


def require_namespaces() -> None:
    """Skip, loudly, where namespaces cannot be made; fail instead where the environment says they must be."""
    missing = [what for what, ok in (("root", os.geteuid() == 0), ("iproute2", shutil.which("ip"))) if not ok]
    if not missing:
        return
    reason = (
        f"network namespaces need {' and '.join(missing)}: run as root (the CI workflow runs this file with sudo);"
        " the loopback mode of these tests ran instead"
    )
    if os.environ.get("LIGHTNING_BAGUA_REQUIRE_NAMESPACES") == "1":
        pytest.fail(f"LIGHTNING_BAGUA_REQUIRE_NAMESPACES=1, but {reason}")
    pytest.skip(reason)


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


@contextmanager
def two_hosts(mode: str = "namespaces") -> Iterator[list[tuple[str | None, str, str]]]:
    """Yield (namespace, interface, address) per host: two namespaces joined by a veth pair, or the loopback."""
    if mode == "loopback":
        yield [(None, "lo", "127.0.0.1"), (None, "lo", "127.0.0.1")]
        return
    require_namespaces()
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


def on_host(namespace: str | None, *command: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *command] if namespace else list(command)


def launch_on_two_hosts(out: Path, mode: str, *script_args: str) -> None:
    with two_hosts(mode) as hosts:
        master = hosts[0][2]
        # A namespace has its ports to itself; the loopback is shared with whatever else runs here.
        port = 29560 if mode == "namespaces" else free_port()
        processes = []
        for node, (namespace, interface, _) in enumerate(hosts):
            env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
            # Gloo must use the host's own link, not the loopback device it would find by hostname.
            env.update({"PYTHONPATH": python_path(), "GLOO_SOCKET_IFNAME": interface})
            command = on_host(namespace, sys.executable, "-m", "lightning_bagua.launch")
            command += ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2"]
            command += ["--master_addr", master, "--master_port", str(port)]
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


@pytest.mark.parametrize("mode", MODES)
def test_gradient_allreduce_across_two_hosts(tmp_path, mode):
    launch_on_two_hosts(tmp_path, mode)
    results = load_ranks(tmp_path, 4)
    assert_ranks_identical(results)
    assert {result["cluster_environment"] for result in results} == {"BaguaEnvironment"}
    torch.testing.assert_close(results[0]["state"], reference_state(4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_hierarchical_bytegrad_across_two_hosts_of_two_processes(tmp_path, mode):
    launch_on_two_hosts(tmp_path, mode, "--algorithm", "bytegrad", "--kwargs", '{"hierarchical": true}')
    results = load_ranks(tmp_path, 4)
    assert_ranks_identical(results)
    total = MAX_STEPS * param_bytes()
    for rank, result in enumerate(results):
        # Full precision inside each host; only the two leaders exchange 8-bit codes over the link.
        assert result["bytes_by_op"]["reduce"] == total
        assert ("all_to_all" in result["bytes_by_op"]) == (rank % 2 == 0), f"rank {rank}"
    torch.testing.assert_close(results[0]["state"], reference_state(4), rtol=0.05, atol=0.01)


def run_host_layout_workers(ranks_per_host: int) -> list[dict]:
    """Start 2 x ``ranks_per_host`` engine processes as a plain env:// launcher would (no LOCAL_WORLD_SIZE)."""
    world_size = 2 * ranks_per_host
    with two_hosts("namespaces") as hosts:
        processes = []
        for rank in range(world_size):
            namespace, interface, _ = hosts[rank // ranks_per_host]
            env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
            env.update({"PYTHONPATH": python_path(), "GLOO_SOCKET_IFNAME": interface, "MASTER_ADDR": hosts[0][2]})
            env.update({"MASTER_PORT": "29561", "RANK": str(rank), "WORLD_SIZE": str(world_size)})
            command = on_host(namespace, sys.executable, str(HOST_LAYOUT_WORKER))
            processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        try:
            outputs = [process.communicate(timeout=180)[0] for process in processes]
        finally:
            for process in processes:
                process.kill()
    assert all(process.returncode == 0 for process in processes), "\n".join(outputs)
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_the_engine_finds_two_namespaces_sharing_a_host_name_without_local_world_size(ranks_per_host):
    results = run_host_layout_workers(ranks_per_host)
    hosts = results[0]["hosts"]
    # One host name (namespaces share it), told apart by the address each routes to the rendezvous from.
    assert {host.split("/")[0] for host in hosts} == {socket.gethostname()}
    assert len(set(hosts)) == 2
    for rank, result in enumerate(results):
        assert result["layout"] == [2, ranks_per_host, "hosts"], f"rank {rank}"
        # bytegrad's 8-bit exchange runs between the hosts: on every rank that leads its host.
        assert ("all_to_all" in result["ops"]) == (rank % ranks_per_host == 0), f"rank {rank}: {result['ops']}"
        assert result["warnings"] == []


def test_without_root_the_namespace_tests_skip_with_the_reason_or_fail_where_required(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("LIGHTNING_BAGUA_REQUIRE_NAMESPACES", raising=False)
    with pytest.raises(pytest.skip.Exception, match="network namespaces need root"):
        require_namespaces()
    monkeypatch.setenv("LIGHTNING_BAGUA_REQUIRE_NAMESPACES", "1")
    with pytest.raises(pytest.fail.Exception, match="REQUIRE_NAMESPACES=1, but network namespaces need root"):
        require_namespaces()
