"""The supported-version floor that `make floor` tests is the one the requirements declare."""

import re
from pathlib import Path

REQUIREMENTS = Path(__file__).parents[1] / "requirements"


def lower_bounds(*files: str) -> dict[str, str]:
    bounds = {}
    for name in files:
        for line in (REQUIREMENTS / name).read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", line)
            if match:
                bounds[match.group(1).lower()] = match.group(2)
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
    assert set(floor) == {"torch", "lightning", "pytorch-lightning"}
    for package, version in floor.items():
        assert padded(version) == padded(declared[package]), f"{package}: floor {version}, declared {declared[package]}"
