"""One results schema for every benchmark, the machine record, and the spread of repeated figures.

A results file is ``benchmarks/results/<stem>.json`` with the keys of :func:`new_report`: ``benchmark``,
``command``, ``date``, ``machine`` (with the versions), ``settings``, ``peers`` (the methods a user would pick
instead, measured in the same run) and ``rows``; a benchmark may add keys of its own beside them. Its table, when it
has one, is ``<stem>.md`` beside it. One file per benchmark is current: a new run replaces it, and git keeps the
old ones.
"""

import json
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


def new_report(
    benchmark: str,
    settings: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    peers: list[str] | tuple[str, ...] = (),
    device: Any = None,
    command: str | None = None,
) -> dict[str, Any]:
    """A report in the lab's schema: what ran (``command``, by default this process's), where, and what it measured."""
    record = stamp(command if command is not None else command_line(), device)
    return {"benchmark": benchmark, **record, "settings": settings, "peers": list(peers), "rows": rows}


def stamp(command: str, device: Any = None) -> dict[str, Any]:
    """Return what every report records of its run: ``command``, the date now and the :func:`machine`.

    Args:
        command: the command that reproduces the report.
        device: the device measured, for :func:`machine`.

    Returns:
        ``command``, ``date`` (UTC, to the second) and ``machine``, in that order.
    """
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {"command": command, "date": date, "machine": machine(device)}


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as a user would type it from the repository's root: ``python benchmarks/x.py ...``."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    root = Path(__file__).resolve().parents[2]
    if script.is_absolute() and script.is_relative_to(root):
        script = script.relative_to(root)
    return " ".join(["python", str(script), *argv[1:]])


def machine(device: Any = None) -> dict[str, Any]:
    """Python, torch, Lightning, the platform, the load, and the accelerator where ``device`` is a CUDA device."""
    import torch

    record: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # Other work on the machine slows the fastest runs most: recorded, not hidden.
        "load_average_1_5_15": os.getloadavg(),
    }
    try:
        import lightning

        record["lightning"] = lightning.__version__
    except ImportError:
        record["lightning"] = None
    from lightning_bagua.__about__ import __version__

    record["lightning_bagua"] = __version__
    if device is not None and torch.device(device).type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update(
            device=properties.name,
            devices=torch.cuda.device_count(),
            memory_gib=round(properties.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    else:
        record["device"] = "cpu"
    return record


def write_report(out: Path, stem: str, report: dict[str, Any], table: str | None = None) -> Path:
    """Write ``report`` to ``out/<stem>.json`` and, given, its table to ``out/<stem>.md``; return the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    if table is not None:
        (out / f"{stem}.md").write_text(table)
    return path


def spread(values: list[float]) -> dict[str, float]:
    """Mean, median, sample standard deviation (0 for one value), minimum, maximum and count of ``values``."""
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
