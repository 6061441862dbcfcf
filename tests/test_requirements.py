"""The declared version window: the floor `make floor` tests is the one the requirements declare, the window is
open up to the next major version, the Supported versions page names what ran, and installing the package keeps the
user's torch."""

import importlib.util
import json
import re
import subprocess
import sys
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
REQUIREMENTS = ROOT / "requirements"
# The packages whose window the compatibility modules bridge (engine/_torch_compat.py, _lightning_compat.py).
WINDOWED = ("torch", "lightning", "pytorch-lightning")


def specifiers(*files: str) -> dict[str, str]:
    found = {}
    for name in files:
        for line in (REQUIREMENTS / name).read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9_.-]+)\s*([<>=!~][^#;]*)", line)
            if match:
                found[match.group(1).lower()] = match.group(2).replace(" ", "")
    return found


def lower_bounds(*files: str) -> dict[str, str]:
    bounds = {}
    for package, spec in specifiers(*files).items():
        match = re.search(r">=([0-9.]+)", spec)
        if match:
            bounds[package] = match.group(1)
    return bounds


def pins(name: str) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([0-9.]+)$", (REQUIREMENTS / name).read_text(), flags=re.MULTILINE)
    return {package.lower(): version for package, version in found}


def padded(version: str) -> tuple[int, ...]:
    parts = tuple(int(part) for part in version.split("."))
    return parts + (0,) * (3 - len(parts))


def test_the_floor_pins_the_declared_lower_bounds():
    declared = lower_bounds("base.txt", "test.txt")
    floor = pins("floor.txt")
    assert set(floor) == set(WINDOWED)
    for package, version in floor.items():
        assert padded(version) == padded(declared[package]), f"{package}: floor {version}, declared {declared[package]}"


def test_both_lightning_packages_share_one_floor():
    floor = pins("floor.txt")
    assert floor["lightning"] == floor["pytorch-lightning"]


def test_the_window_stays_open_until_the_next_major_version():
    # A bound below the next major version needs a release that failed, named in the requirement's comment.
    declared = specifiers("base.txt", "test.txt")
    for package in WINDOWED:
        spec = declared[package]
        floor_major = padded(lower_bounds("base.txt", "test.txt")[package])[0]
        assert f"<{floor_major + 1}" in spec.split(","), f"{package} {spec}: the upper bound is not <{floor_major + 1}"


def test_the_support_table_names_the_floor_that_ran():
    floor = pins("floor.txt")
    page = (ROOT / "docs" / "source" / "support.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("|") and "make floor" in line]
    assert len(rows) == 1, rows
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[1].startswith(floor["torch"] + " "), cells
    assert cells[2] == floor["lightning"], cells


def test_installing_the_package_keeps_the_installed_torch_and_lightning():
    # `pip install lightning-bagua` resolves the package's runtime requirements against what is installed. With no
    # index pip can only keep what is there: a requirement the installed torch or Lightning does not meet shows up
    # as something to install, or as a resolver conflict. The standalone package joins in where it is installed.
    standalone = ["pytorch-lightning"] if importlib.util.find_spec("pytorch_lightning") else []
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet", "--report", "-"]
    result = subprocess.run(
        [*pip, "-r", str(REQUIREMENTS / "base.txt"), *standalone],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    to_install = {item["metadata"]["name"].lower() for item in json.loads(result.stdout)["install"]}
    assert not to_install & set(WINDOWED), f"pip would install {sorted(to_install)}"


@pytest.mark.parametrize("package", WINDOWED)
def test_the_installed_versions_are_inside_the_window(package):
    # `pip install --no-deps -e .` (the GPU machine's preinstalled torch) checks nothing: this does.
    if importlib.util.find_spec(package.replace("-", "_")) is None:
        pytest.skip(f"{package} is not installed here")
    requirement = Requirement(package + specifiers("base.txt", "test.txt")[package])
    assert requirement.specifier.contains(installed_version(package), prereleases=True), (
        package,
        installed_version(package),
    )
