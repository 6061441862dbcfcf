"""benchmarks/lab/torchft_peer.py: torchft's DiLoCo as the labs' peer. The fragment split and the checks of bad input
run everywhere; the two-rank run needs torchft, which is not a dependency (requirements/benchmarks-torchft.txt)."""

import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
TORCHFT_MISSING = importlib.util.find_spec("torchft") is None
NO_TORCHFT = "torchft is not installed (pip install -r requirements/benchmarks-torchft.txt)"


def peer() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("lab.torchft_peer", BENCHMARKS / "lab" / "torchft_peer.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for inputs, outputs in itertools.pairwise(widths):
        layers += [nn.Linear(inputs, outputs), nn.Tanh()]
    return nn.Sequential(*layers)


def test_fragments_are_contiguous_cover_the_model_and_share_its_parameters():
    model = mlp([8, 8, 8, 8, 8, 8, 8])  # six equal layers
    fragments = peer().split_fragments(model, 3)
    layers = [module for module in model if isinstance(module, nn.Linear)]
    assert [list(fragment) for fragment in fragments] == [layers[0:2], layers[2:4], layers[4:6]]
    parameters = [p for fragment in fragments for p in fragment.parameters()]
    assert [id(p) for p in parameters] == [id(p) for p in model.parameters()]


def test_fragments_balance_parameters_but_never_leave_a_fragment_empty():
    split = peer().split_fragments
    # Layers of 20, 20, 1280 and 1028 parameters: the halves are cut after the third (1320 against 1028).
    model = mlp([4, 4, 4, 256, 4])
    sizes = [sum(p.numel() for p in fragment.parameters()) for fragment in split(model, 2)]
    assert sizes == [20 + 20 + 1280, 1028]
    assert [len(fragment) for fragment in split(model, 4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"fragments=5: the model has 4 modules with parameters.*between 1 and 4"):
        split(model, 5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sync_every": 0}, r"sync_every=0: must be at least 1"),
        ({"sync_every": 6, "fragments": 4}, r"fragments=4 with sync_every=6: .*positive divisor"),
        ({"sync_every": 8, "fragments": 2, "fragment_sync_delay": 4}, r"fragment_sync_delay=4: must be in \[0, 4\)"),
        ({"sync_every": 4, "fragment_update_alpha": 1.5}, r"fragment_update_alpha=1.5: must be in \[0, 1\]"),
    ],
)
def test_bad_settings_fail_before_anything_starts(settings, message, monkeypatch):
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)  # nothing may be read or started before the check
    model = mlp([4, 4, 4])
    with pytest.raises(ValueError, match=message):
        peer().torchft_diloco(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings)


def test_missing_torchft_names_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # importing it fails, installed or not
    model = mlp([4, 4, 4])
    with pytest.raises(ImportError, match=r"torchft is not installed.*requirements/benchmarks-torchft.txt"):
        peer().torchft_diloco(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, fragments=2)


@pytest.mark.skipif(
    TORCHFT_MISSING, reason="torchft is not installed (pip install -r requirements/benchmarks-torchft.txt)"
)
def test_two_gloo_ranks_agree_after_every_sync_and_match_a_single_process_diloco():
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "scripts" / "torchft_peer_check.py")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "torchft_peer_check: PASS" in completed.stdout


LIGHTNING_SCRIPT = """
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, {benchmarks!r})
from lab.torchft_peer import lightning_callback


class Regression(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.network = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.network(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


callback = lightning_callback(sync_every=4, fragments=2, outer_momentum=0.0)
module = Regression()
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 4, generator=generator), torch.randn(256, 1, generator=generator))
trainer = Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_steps=10, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
)
trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
last = module.network[2]  # fragment 1, synced at step 8, with two local steps since
first = module.network[0]  # fragment 0, synced at step 10, the last step
agree = []
for fragment in (first, last):
    weights = torch.cat([p.detach().flatten() for p in fragment.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(2)]
    torch.distributed.all_gather(gathered, weights)
    agree.append(bool(torch.equal(*gathered)))
if trainer.is_global_zero:
    print("SYNCS", callback.peer.syncs, "AGREE", *agree, flush=True)
"""


@pytest.mark.skipif(
    TORCHFT_MISSING, reason="torchft is not installed (pip install -r requirements/benchmarks-torchft.txt)"
)
def test_lightning_callback_trains_under_torchft_with_ddp_allreduce_off(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_SCRIPT.format(benchmarks=str(BENCHMARKS)))
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    # 10 steps, a fragment every 2: 5 syncs. The fragment synced at the last step is identical on both ranks; the
    # other one took two local steps since its sync, on each rank's own batches: DDP did not average them.
    assert "SYNCS 5 AGREE True False" in completed.stdout, completed.stdout[-4000:]


def benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module; the labs put ``benchmarks/`` on the path themselves."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lab_method_names_take_diloco_defaults_and_any_period():
    from lightning_bagua.engine.algorithms.diloco import DiLoCoAlgorithm

    harness = benchmark("lab/methods")
    ours = DiLoCoAlgorithm()
    assert harness.torchft_settings("torchft_diloco_h8") == {
        "sync_every": 8,
        "fragments": ours.fragments,
        "fragment_sync_delay": ours.fragment_sync_delay,
        "fragment_update_alpha": ours.fragment_update_alpha,
    }
    assert harness.torchft_settings("torchft_diloco")["sync_every"] == ours.sync_every
    # Streaming by name, the same keywords for ours and the peer.
    assert harness.resolve_algorithm("diloco_h20_f2_d5") == (
        "diloco",
        {"sync_every": 20, "fragments": 2, "fragment_sync_delay": 5},
    )
    streaming = harness.torchft_settings("torchft_diloco_h20_f2_d5")
    assert (streaming["sync_every"], streaming["fragments"], streaming["fragment_sync_delay"]) == (20, 2, 5)
    assert harness.diloco_keywords("diloco_h20_d5") == {"sync_every": 20, "fragment_sync_delay": 5}
    # The outer SGD by name: a learning rate, a momentum, or both; what is left out is the algorithm's default.
    from lightning_bagua.engine.algorithms.diloco import _PAPER_OUTER_KWARGS

    assert harness.diloco_keywords("diloco_h20_lr0.1")["outer_optimizer_kwargs"] == _PAPER_OUTER_KWARGS | {"lr": 0.1}
    plain = harness.diloco_keywords("diloco_h20_f2_lr1_m0")
    assert plain == {
        "sync_every": 20,
        "fragments": 2,
        "outer_optimizer_kwargs": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
    }
    peer = harness.torchft_settings("torchft_diloco_h20_lr1_m0")
    assert (peer["outer_lr"], peer["outer_momentum"]) == (1.0, 0.0)
    assert "outer_optimizer_kwargs" not in peer
    # The outer gradients' precision by name; the peer sends full precision only.
    assert harness.diloco_keywords("diloco_h20_lr1_m0_fp32")["quantization"] is None
    assert harness.diloco_keywords("diloco_h20_u4")["quantization"] == "uint4"
    assert "quantization" not in harness.torchft_settings("torchft_diloco_h20_fp32")
    assert harness.torchft_settings("torchft_diloco_h20_u4") is None
    for bad in (
        "diloco_h20_f0",
        "diloco_h20_d",
        "diloco_h20_d5_f2",
        "diloco_h0_f2",
        "diloco_h20_lr0",
        "diloco_h20_m0_lr1",
    ):
        assert harness.diloco_keywords(bad) is None, bad
    for other in ("diloco_h8", "torchft_diloco_h0", "torchft_diloco_hx", "torchft_diloco_h8:flat", "torchft"):
        assert harness.torchft_settings(other) is None, other
    lab = benchmark("network_lab")
    assert {"torchft_diloco", "torchft_diloco_h20"} <= set(lab.known_methods())
    convergence = benchmark("convergence")
    assert convergence.is_accepted("torchft_diloco_h8")
    assert convergence.is_accepted("diloco_h8")
    assert not convergence.is_accepted("torchft_diloco_h8:flat")
    assert convergence.baseline_of("torchft_diloco_h8") == "ddp"
    with pytest.raises(SystemExit):
        convergence.parse_args(["--methods", "torchft_diloco_hx"])


def test_labs_fail_a_torchft_method_with_the_install_hint_when_torchft_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # importing it fails, installed or not
    lab = benchmark("network_lab")
    model = mlp([4, 8, 1])
    # The lab's worker reports what wrap raises as the method's failure and the lab goes on with the others.
    with pytest.raises(ImportError, match=r"torchft is not installed.*requirements/benchmarks-torchft.txt"):
        lab.wrap("torchft_diloco_h8", model, 3)
    # convergence.py's job refuses before Lightning starts its second process; run_job records that as a failure.
    convergence = benchmark("convergence")
    args = convergence.parse_args(["--job", "--task", "digits", "--method", "torchft_diloco_h8", "--steps", "4"])
    with pytest.raises(ImportError, match=r"torchft is not installed"):
        convergence.job(args)
