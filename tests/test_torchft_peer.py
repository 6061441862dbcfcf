"""benchmarks/torchft_peer.py: torchft's DiLoCo as the labs' peer. The fragment split and the checks of bad input run
everywhere; the two-rank run needs torchft, which is not a dependency (requirements/benchmarks-torchft.txt)."""

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


def peer() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("torchft_peer", BENCHMARKS / "torchft_peer.py")
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
        [sys.executable, str(BENCHMARKS / "torchft_peer_check.py")], capture_output=True, text=True, timeout=240
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "torchft_peer_check: PASS" in completed.stdout
