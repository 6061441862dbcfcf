"""Measure what the wheel's start-up hook adds to an unrelated ``python -c pass``.

Builds the wheel from a copy of the working tree, makes two fresh virtual environments from the same base
interpreter (one empty, one with the wheel installed, which brings ``lightning_bagua_registration.pth``), and
times many alternating ``python -c pass`` runs in each. The difference of the medians is the hook's cost. A
``-X importtime`` run in the hooked environment breaks the cost down per module, and a ``sys.modules`` comparison
shows that the hook imports neither torch nor Lightning. Results go to ``benchmarks/results/startup_time.json``.

Run with the project's interpreter: ``.venv/bin/python benchmarks/micro/startup_time.py [--runs N]``.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.results import RESULTS, new_report, write_report

REPO = Path(__file__).resolve().parents[2]
PTH_NAME = "lightning_bagua_registration.pth"
SOURCE_ITEMS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in", "requirements", "src")
HEAVY_MODULES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
MODULES_PROBE = "import sys, json; print(json.dumps(sorted(sys.modules)))"


def base_interpreter() -> str:
    # The fresh environments must not inherit this venv's site-packages, so they are built from its base Python.
    return str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())


def clean_env() -> dict[str, str]:
    # PYTHONPATH or PYTHONSTARTUP from the caller would be timed along with the hook.
    return {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}


def build_wheel(workdir: Path) -> Path:
    """Build the wheel from a copy of the tree (stale build/ output and concurrent builds stay out of it)."""
    source = workdir / "source"
    source.mkdir()
    for item in SOURCE_ITEMS:
        origin = REPO / item
        if origin.is_dir():
            shutil.copytree(origin, source / item, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif origin.exists():
            shutil.copy2(origin, source / item)
    dist = workdir / "dist"
    command = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check", "-o", str(dist)]
    result = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"building the wheel failed:\n{result.stdout}{result.stderr}")
    (wheel,) = dist.glob("*.whl")
    return wheel


def make_venv(path: Path, wheel: Path | None) -> Path:
    subprocess.run([base_interpreter(), "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    if wheel is not None:
        install = ["install", "--no-deps", "--no-index", "-q", str(wheel)]
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *install], check=True, env=clean_env())
    return python


def time_runs(pythons: dict[str, Path], runs: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {name: [] for name in pythons}
    env = clean_env()
    for _ in range(runs):
        # Alternating the environments spreads any drift in machine load evenly over both.
        for name, python in pythons.items():
            start = time.perf_counter_ns()
            subprocess.run([str(python), "-c", "pass"], check=True, env=env)
            timings[name].append((time.perf_counter_ns() - start) / 1e6)
    return timings


def summarize(samples: list[float]) -> dict[str, float]:
    quartiles = statistics.quantiles(samples, n=4)
    return {
        "median_ms": round(statistics.median(samples), 3),
        "mean_ms": round(statistics.fmean(samples), 3),
        "q1_ms": round(quartiles[0], 3),
        "q3_ms": round(quartiles[2], 3),
        "min_ms": round(min(samples), 3),
    }


def import_breakdown(python: Path, repeats: int) -> dict[str, int]:
    """Return the median self time (µs, from ``-X importtime``) of every module imported before ``-c`` runs."""
    per_module: dict[str, list[int]] = {}
    for _ in range(repeats):
        result = subprocess.run(
            [str(python), "-X", "importtime", "-c", "pass"], check=True, capture_output=True, text=True, env=clean_env()
        )
        for line in result.stderr.splitlines():
            fields = line.removeprefix("import time:").split("|")
            if len(fields) == 3 and fields[0].strip().isdigit():
                per_module.setdefault(fields[2].strip(), []).append(int(fields[0]))
    return {name: round(statistics.median(values)) for name, values in per_module.items()}


def loaded_modules(python: Path) -> set[str]:
    result = subprocess.run(
        [str(python), "-c", MODULES_PROBE], check=True, capture_output=True, text=True, env=clean_env()
    )
    return set(json.loads(result.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="timed `python -c pass` runs per environment")
    parser.add_argument("--output", type=Path, default=RESULTS / "startup_time.json", help="the JSON results file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lightning-bagua-startup-") as tmp:
        workdir = Path(tmp)
        wheel = build_wheel(workdir)
        pythons = {
            "baseline": make_venv(workdir / "baseline", wheel=None),
            "with_hook": make_venv(workdir / "with_hook", wheel=wheel),
        }
        site_packages = next((workdir / "with_hook" / "lib").glob("python*/site-packages"))
        if not (site_packages / PTH_NAME).is_file():
            raise SystemExit(f"the wheel did not install {PTH_NAME}")
        time_runs(pythons, runs=10)  # warm the page cache and write nothing that the timed runs would
        timings = time_runs(pythons, runs=args.runs)
        baseline_modules = loaded_modules(pythons["baseline"])
        hooked_modules = loaded_modules(pythons["with_hook"])
        breakdown = import_breakdown(pythons["with_hook"], repeats=25)

    added = sorted(hooked_modules - baseline_modules)
    baseline, hooked = summarize(timings["baseline"]), summarize(timings["with_hook"])
    rows = [{"environment": "baseline", **baseline}, {"environment": "with_hook", **hooked}]
    benchmark = "python -c pass, fresh venv without vs with the lightning-bagua wheel (start-up hook .pth)"
    report = new_report(benchmark, {"runs_per_environment": args.runs}, rows,
                        command="python benchmarks/micro/startup_time.py")  # fmt: skip
    report.update(
        overhead_median_ms=round(hooked["median_ms"] - baseline["median_ms"], 3),
        overhead_mean_ms=round(hooked["mean_ms"] - baseline["mean_ms"], 3),
        modules_added_by_hook=added,
        heavy_modules_imported=sorted(name for name in added if name.split(".")[0] in HEAVY_MODULES),
        # The .pth imports run inside `site`, so self times (not cumulative ones) are what add up to the hook's cost.
        importtime_self_us_of_added_modules={name: breakdown.get(name) for name in added},
        importtime_self_us_total_of_added_modules=sum(breakdown.get(name, 0) for name in added),
    )
    write_report(args.output.parent, args.output.stem, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
