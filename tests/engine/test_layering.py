"""The engine is the bottom layer: torch only, usable from plain PyTorch without Lightning installed."""

import subprocess
import sys

LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def test_importing_the_engine_imports_no_lightning_module():
    probe = (
        "import sys, lightning_bagua.engine, lightning_bagua.engine.algorithms;"
        f" print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING_PACKAGES!r}))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]", completed.stdout


def test_the_probe_sees_lightning_when_it_is_imported():
    # The check above can fail: the same probe after importing a strategy lists Lightning's modules.
    probe = (
        "import sys, lightning_bagua.strategies.bagua;"
        f" print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING_PACKAGES!r}))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "'lightning'" in completed.stdout
