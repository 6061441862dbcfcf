"""The table of bad inputs: each gives a clear error (its type and what the message says), none hangs, and a run
that fails leaves nothing half-written.

Three kinds of case: checks in this process (the strategy's, the algorithms', the optimizer's and the launcher's
arguments, all before any process group exists), the engine on three real Gloo processes (one process pair for
all its cases), and Lightning runs of ``tests/strategies/scripts/bad_input_script.py`` in their own processes.
"""

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.lab.jobs import JOB_VARIABLE, job_pids
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_bagua import BaguaStrategy, QAdamOptimizer
from lightning_bagua.engine import Algorithm, BaguaDistributedDataParallel, MinMaxUInt8Codec
from lightning_bagua.engine.algorithms.decentralized import check_state_keys
from lightning_bagua.engine.algorithms.qadam import check_qadam_configuration
from lightning_bagua.engine.data_parallel import default_bucket_cap_mb
from lightning_bagua.launch import main as launch_main
from tests.distributed import free_port, run_processes

ROOT = Path(__file__).resolve().parents[1]
BAD_INPUT_SCRIPT = ROOT / "tests" / "strategies" / "scripts" / "bad_input_script.py"


def _params() -> list[nn.Parameter]:
    return list(nn.Linear(2, 1).parameters())


def _strategy(**kwargs: Any) -> Callable[[], object]:
    return lambda: BaguaStrategy(**kwargs)


def _launch(*argv: str) -> Callable[[], None]:
    def run() -> None:
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            try:
                launch_main(list(argv))
            except SystemExit as error:
                # argparse prints its message and exits with status 2; the launcher's own checks exit with theirs.
                raise SystemExit(error.code if isinstance(error.code, str) else stderr.getvalue()) from None

    return run


def _with_variable(name: str, value: str, call: Callable[[], object]) -> Callable[[], object]:
    """``call``, run with the environment variable ``name`` set to ``value``."""

    def run() -> object:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(name, value)
            return call()

    return run


# id: (what to call, the exception type, a regular expression its message must match)
IN_PROCESS: dict[str, tuple[Callable[[], object], type[BaseException], str]] = {
    "unknown algorithm name": (
        _strategy(algorithm="gradient_allreduse"),
        ValueError,
        r"gradient_allreduse.*gradient_allreduce",
    ),
    "unknown algorithm keyword": (_strategy(algorithm="bytegrad", hierarchcal=True), TypeError, r"hierarchcal"),
    "keyword of the wrong type": (
        _strategy(algorithm="decentralized", communication_interval="2"),
        TypeError,
        r"communication_interval.*'2'",
    ),
    "communication interval below 1": (
        _strategy(algorithm="low_precision_decentralized", communication_interval=0),
        ValueError,
        r"communication_interval.*0",
    ),
    "unknown peer selection mode": (
        _strategy(algorithm="decentralized", peer_selection_mode="ring"),
        ValueError,
        r"'all', 'shift_one'.*'ring'",
    ),
    "algorithm instance with keywords": (
        _strategy(algorithm=Algorithm.init("bytegrad"), hierarchical=False),
        TypeError,
        r"\['hierarchical'\].*Algorithm instance",
    ),
    "flatten not a bool": (_strategy(flatten="yes"), TypeError, r"`flatten` must be a bool, got 'yes'"),
    "negative bucket size": (_strategy(bucket_cap_mb=-1), ValueError, r"bucket_cap_mb.*-1"),
    "timeout not a timedelta": (_strategy(timeout=60), TypeError, r"timedelta.*got 60.*timedelta\(seconds=60\)"),
    "average_before_save not a bool": (
        _strategy(average_before_save="yes"),
        TypeError,
        r"average_before_save.*'yes'",
    ),
    "qadam warm-up of 0 steps": (lambda: QAdamOptimizer(_params(), warmup_steps=0), ValueError, r"warmup_steps: 0"),
    "qadam beta of 1": (lambda: QAdamOptimizer(_params(), betas=(0.9, 1.0)), ValueError, r"beta.*index 1: 1.0"),
    "qadam negative learning rate": (lambda: QAdamOptimizer(_params(), lr=-1.0), ValueError, r"learning rate: -1"),
    "qadam algorithm with SGD": (
        lambda: check_qadam_configuration([torch.optim.SGD(_params(), lr=0.1)], []),
        ValueError,
        r"one QAdamOptimizer.*\['SGD'\]",
    ),
    "qadam with two schedulers": (
        lambda: check_qadam_configuration([QAdamOptimizer(_params())], [object(), object()]),
        ValueError,
        r"2 LR scheduler",
    ),
    "unknown reduce op": (
        lambda: BaguaStrategy().reduce(torch.ones(1), reduce_op="median"),
        ValueError,
        r"'median'.*'sum'",
    ),
    "bucket size variable not a number": (
        _with_variable("BAGUA_DEFAULT_BUCKET_SIZE", "ten", default_bucket_cap_mb),
        ValueError,
        r"BAGUA_DEFAULT_BUCKET_SIZE='ten'",
    ),
    "gloo scheduling variable neither 0 nor 1": (
        _with_variable("LIGHTNING_BAGUA_GLOO_SCHED_BATCH", "yes", BaguaStrategy),
        ValueError,
        r"LIGHTNING_BAGUA_GLOO_SCHED_BATCH='yes' must be 1 .*or 0",
    ),
    "saved algorithm state with a missing key": (
        lambda: check_state_keys("decentralized", {"forward_passes": 3}, {"forward_passes": int, "rounds": int}),
        ValueError,
        r"keys \['forward_passes', 'rounds'\], got \['forward_passes'\]",
    ),
    "saved algorithm state of the wrong type": (
        lambda: check_state_keys("decentralized", {"due": 1}, {"due": bool}),
        ValueError,
        r"'due' must be bool, got 1 \(int\)",
    ),
    "launcher: no processes": (
        _launch("--nproc_per_node", "0", "train.py"),
        SystemExit,
        r"--nproc_per_node must be at least 1",
    ),
    "launcher: module and no_python": (_launch("--module", "--no_python", "x"), SystemExit, r"exclude each other"),
    "launcher: bucket size 0": (_launch("--default_bucket_size", "0", "train.py"), SystemExit, r"positive number"),
    "launcher: unknown flag": (_launch("--nproc-per-nod", "2", "train.py"), SystemExit, r"unrecognized arguments"),
    "launcher: flag value not a number": (
        _launch("--nproc_per_node", "two", "train.py"),
        SystemExit,
        r"--nproc_per_node: invalid int value: 'two'",
    ),
    "launcher: node rank outside the nodes": (
        _launch("--nnodes", "2", "--node_rank", "2", "train.py"),
        SystemExit,
        r"--node_rank must be in \[0, 2\).*got 2",
    ),
    "launcher: no nodes": (_launch("--nnodes", "0", "train.py"), SystemExit, r"--nnodes must be a positive.*'0'"),
    "engine: not a module": (
        lambda: BaguaDistributedDataParallel("model"),  # type: ignore[arg-type]
        TypeError,
        r"`module` must be a torch.nn.Module, got 'model' \(str\)",
    ),
    "engine: one optimizer, not a list": (
        lambda: BaguaDistributedDataParallel(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)),
        TypeError,
        r"`optimizers` must be a list of torch.optim.Optimizer.*optimizers=\[optimizer\]",
    ),
    "engine: bucket size not a number": (
        lambda: BaguaDistributedDataParallel(nn.Linear(2, 1), bucket_cap_mb=float("nan")),
        ValueError,
        r"`bucket_cap_mb` must be a positive number of MiB, got nan",
    ),
    "engine: ranks per node as text": (
        lambda: BaguaDistributedDataParallel(nn.Linear(2, 1), ranks_per_node="2"),  # type: ignore[arg-type]
        ValueError,
        r"`ranks_per_node` must be a positive int, got '2'",
    ),
    "engine: zero timeout": (
        lambda: BaguaDistributedDataParallel(nn.Linear(2, 1), timeout=timedelta(0)),
        ValueError,
        r"`timeout` must be positive",
    ),
    "engine: an algorithm keyword given to the wrapper": (
        lambda: BaguaDistributedDataParallel(nn.Linear(2, 1), algorithm="bytegrad", hierarchical=False),
        TypeError,
        r"hierarchical configures the algorithm 'bytegrad', not the wrapper: pass"
        r" algorithm=Algorithm.init\('bytegrad', hierarchical=False\)",
    ),
    "engine: an unknown keyword": (
        lambda: BaguaDistributedDataParallel(nn.Linear(2, 1), static_graf=True),
        TypeError,
        r"Unknown keyword argument\(s\) 'static_graf' for BaguaDistributedDataParallel.*static_graph",
    ),
    "qadam: an optimizer setting given to the algorithm": (
        lambda: BaguaStrategy(algorithm="qadam", warmup_steps=10),
        TypeError,
        r"Unknown keyword argument\(s\) 'warmup_steps' for algorithm 'qadam'.*"
        r"`warmup_steps` is set on the optimizer: QAdamOptimizer\(params, warmup_steps=...\)",
    ),
    "codec: chunks not an int": (
        lambda: MinMaxUInt8Codec().compress(torch.ones(8), num_chunks=2.5),  # type: ignore[arg-type]
        TypeError,
        r"`num_chunks` must be an int, got 2.5 \(float\)",
    ),
    "qadam: learning rate as text": (
        lambda: QAdamOptimizer(nn.Linear(2, 1).parameters(), lr="0.1"),  # type: ignore[arg-type]
        TypeError,
        r"Invalid lr: '0.1' \(str\); it must be a number >= 0",
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(IN_PROCESS))
def test_checked_in_this_process(case):
    call, error, message = IN_PROCESS[case]
    with pytest.raises(error) as raised:
        call()
    text = str(raised.value.code) if isinstance(raised.value, SystemExit) else str(raised.value)
    assert re.search(message, text, re.DOTALL), text


# ------------------------------------------------------------------------------ the engine on three processes


class _SkipsAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.used(inputs)


def _train(wrapped: BaguaDistributedDataParallel, inputs: torch.Tensor, steps: int = 3) -> None:
    optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=0.1)
    wrapped.bind_optimizers([optimizer])
    for _ in range(steps):
        optimizer.zero_grad()
        wrapped(inputs).sum().backward()
        optimizer.step()


def _engine_cases(rank: int, world_size: int) -> dict[str, str]:
    """Run each case on every rank; return ``"<type>: <message>"`` of what each raised (or ``"no error"``)."""
    cases: dict[str, Callable[[], object]] = {
        "sparse gradients": lambda: _train(
            BaguaDistributedDataParallel(nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True), nn.Linear(4, 1))),
            torch.ones(2, 4, dtype=torch.long),
        ),
        "shift_one with an odd number of ranks": lambda: BaguaDistributedDataParallel(
            nn.Linear(4, 1),
            algorithm=Algorithm.init("decentralized", peer_selection_mode="shift_one", hierarchical=False),
        ),
        "unused parameters without find_unused_parameters": lambda: _train(
            BaguaDistributedDataParallel(_SkipsAParameter()), torch.ones(2, 4)
        ),
        # Last: the ranks disagree about the model, so what follows could not share their process group.
        "a different number of parameters on one rank": lambda: BaguaDistributedDataParallel(
            nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + (rank == world_size - 1))])
        ),
    }
    outcomes = {}
    for name, case in cases.items():
        try:
            case()
            outcomes[name] = "no error"
        except Exception as error:  # the test asserts on what each rank raised
            outcomes[name] = f"{type(error).__name__}: {error}"
    return outcomes


ENGINE_EXPECTED = {
    "sparse gradients": r"^ValueError: .*dense gradients.*0 produce\(s\) sparse gradients.*sparse=False",
    "shift_one with an odd number of ranks": r"^ValueError: .*shift_one.*even number.*3 ranks.*'all'",
    "unused parameters without find_unused_parameters": r"^RuntimeError: .*find_unused_parameters=True",
    "a different number of parameters on one rank": r"^RuntimeError: DDP expects same model across all ranks",
}


@pytest.fixture(scope="module")
def engine_outcomes() -> list[dict[str, str]]:
    return run_processes(_engine_cases, 3, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(ENGINE_EXPECTED))
def test_engine_refuses_on_every_rank(engine_outcomes, case):
    for rank, outcomes in enumerate(engine_outcomes):
        assert re.search(ENGINE_EXPECTED[case], outcomes[case], re.DOTALL), f"rank {rank}: {outcomes[case]}"


# ------------------------------------------------------------------------------------------ Lightning runs


def _run_bad_fit(tmp_path: Path, case: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    job = uuid.uuid4().hex
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        JOB_VARIABLE: job,
        **(env or {}),
    }
    command = [sys.executable, str(BAD_INPUT_SCRIPT), case, "--out", str(tmp_path / "out"), *args]
    completed = subprocess.run(command, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    deadline = time.monotonic() + 10
    while job_pids(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_pids(job), "processes of the failed run were left behind"
    assert not (tmp_path / "out").exists(), "the failed run wrote its output"
    return completed.returncode, completed.stdout + completed.stderr


@pytest.mark.timeout(200)
def test_parameters_that_differ_between_ranks_fail_naming_the_rank(tmp_path):
    returncode, output = _run_bad_fit(tmp_path, "params_differ_between_ranks", "--devices", "2")
    assert returncode != 0
    # Rank 1 says what differs; rank 0, whose collective failed when rank 1 left, names rank 1 and its error.
    assert re.search(r"params\[0\] in this process with sizes \[9, 16\] appears not to match", output), output[-5000:]
    assert re.search(r"Other ranks that raised: rank 1 \(RuntimeError: .*appears not to match", output), output[-5000:]


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl", "cpu:nccl,cuda:nccl"])
@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_nccl_on_cpu_is_refused_when_the_trainer_is_built(framework, backend):
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy

    build = Trainer if framework == "trainer" else Fabric
    strategy_cls = BaguaStrategy if framework == "trainer" else FabricBaguaStrategy
    with pytest.raises(MisconfigurationException, match=f"process_group_backend={backend!r} needs CUDA devices"):
        build(accelerator="cpu", devices=2, strategy=strategy_cls(process_group_backend=backend))


@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_qadam_refuses_a_gradient_scaler_when_the_trainer_is_built(framework):
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy

    build, strategy_cls, precision_cls = {
        "trainer": (Trainer, BaguaStrategy, MixedPrecision),
        "fabric": (Fabric, FabricBaguaStrategy, FabricMixedPrecision),
    }[framework]
    # On CPU Lightning gives 16-mixed no scaler; on GPUs it does. The plugin the GPU run would get:
    precision = precision_cls("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    with pytest.raises(MisconfigurationException, match="gradient scaler of precision='16-mixed' leaves scaled"):
        build(accelerator="cpu", devices=2, plugins=[precision], strategy=strategy_cls(algorithm="qadam"))
    build(accelerator="cpu", devices=2, plugins=[precision], strategy=strategy_cls(algorithm="bytegrad"))


def test_qadam_refuses_gradient_clipping():
    from types import SimpleNamespace

    from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy

    clipping = "clipping `.grad` would change nothing from then on"
    with pytest.raises(MisconfigurationException, match=clipping):
        BaguaStrategy(algorithm="qadam").setup(SimpleNamespace(gradient_clip_val=1.0))
    model = nn.Linear(2, 1)
    optimizer = QAdamOptimizer(model.parameters())
    with pytest.raises(MisconfigurationException, match=clipping):
        FabricBaguaStrategy(algorithm="qadam").clip_gradients_norm(model, optimizer, max_norm=1.0)
    with pytest.raises(MisconfigurationException, match=clipping):
        FabricBaguaStrategy(algorithm="qadam").clip_gradients_value(model, optimizer, clip_val=1.0)
    # Where the optimizer steps from `.grad`, clipping goes through as with Fabric's DDP strategy.
    model(torch.ones(1, 2)).sum().backward()
    FabricBaguaStrategy(algorithm="bytegrad").clip_gradients_value(model, optimizer, clip_val=1e-3)
    assert model.weight.grad.abs().max().item() == pytest.approx(1e-3)


def test_a_per_device_backend_with_gloo_for_cpu_is_taken_on_cpu():
    from lightning.pytorch import Trainer

    strategy = BaguaStrategy(process_group_backend="cpu:gloo,cuda:nccl")
    Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy.process_group_backend == "cpu:gloo,cuda:nccl"


@pytest.mark.timeout(200)
def test_a_port_in_use_fails_and_ends_every_process(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        returncode, output = _run_bad_fit(tmp_path, "port_in_use", "--devices", "2", env={"MASTER_PORT": port})
    assert returncode != 0
    # torch 2.13 calls it EADDRINUSE, torch 2.2 "errno: 98 - Address already in use".
    in_use = r"(EADDRINUSE|Address already in use)"
    assert re.search(rf"DistNetworkError: Rank 0 of 2 could not join .* 127\.0\.0\.1:{port} .*{in_use}", output)


@pytest.mark.timeout(200)
def test_an_unreachable_master_fails_within_the_timeout(tmp_path):
    # 192.0.2.1 is reserved for documentation (RFC 5737): nothing answers there. The script's timeout is 10 s.
    env = {
        "BAGUA_SERVICE_PORT": "29501", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "NODE_RANK": "1", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500",
    }  # fmt: skip
    returncode, output = _run_bad_fit(tmp_path, "unreachable_master", "--num-nodes", "2", env=env)
    assert returncode != 0
    assert re.search(r"DistNetworkError: Rank 1 of 2 could not join the process group .* 192\.0\.2\.1:29500", output)
    assert str(timedelta(seconds=10)) in output
