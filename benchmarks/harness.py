"""What the benchmark labs share: method names, the interleaved order, the machine record, reports, a free port.

The labs are scripts, not a package: each puts ``benchmarks/`` on ``sys.path`` and imports this module, so that no
lab imports another for these pieces. It imports nothing heavy at load (torch and Lightning on first use).

- Method names: ``low_rank_r4`` is ``low_rank`` at rank 4 (:func:`split_rank`), and a method stem may stand for an
  algorithm with keywords of its own (:data:`ALGORITHM_VARIANTS`, :func:`resolve_algorithm`), in every lab alike.
- :func:`interleaved`: every method once per round, each round rotated by one.
- :func:`machine`: Python, torch, Lightning, the platform and the load, for a report.
- :func:`write_report`: ``<stem>.json`` and ``<stem>.md`` in the results folder.
"""

import json
import os
import platform
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

LOW_RANK_RANKS = (1, 4, 8)  # the ranks of ``low_rank`` and of DDP's PowerSGD that are compared
# Methods that run an algorithm with keywords of their own: method stem -> (algorithm, keywords).
ALGORITHM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"low_rank_alt": ("low_rank", {"alternate": True})}
# Ranks of ``low_rank`` (and its variants) accepted by name, ``low_rank_r16``, but not in the default list.
EXTRA_LOW_RANK_RANKS = (16,)


# ------------------------------------------------------------------------------------------------ method names


def split_rank(method: str) -> tuple[str, int | None]:
    """``"low_rank_r4"`` -> ``("low_rank", 4)``; a name without an ``_r<k>`` suffix -> ``(name, None)``."""
    stem, _, suffix = method.rpartition("_r")
    return (stem, int(suffix)) if stem and suffix.isdigit() else (method, None)


def resolve_algorithm(stem: str) -> tuple[str, dict[str, Any]]:
    """A method stem's algorithm and extra keywords: ``"low_rank_alt"`` -> ``("low_rank", {"alternate": True})``."""
    name, keywords = ALGORITHM_VARIANTS.get(stem, (stem, {}))
    return name, dict(keywords)


def extra_low_rank_methods() -> list[str]:
    """``low_rank``, its variants and DDP's PowerSGD at ``EXTRA_LOW_RANK_RANKS`` (PowerSGD only without ``low_rank``).

    PowerSGD comes at the same ranks, so that every ``low_rank`` rank has torch's hook at that rank to compare with.
    """
    from lightning_bagua.engine import available_algorithms

    powersgd = [f"ddp_powersgd_r{rank}" for rank in EXTRA_LOW_RANK_RANKS]
    if "low_rank" not in available_algorithms():
        return powersgd
    stems = ["low_rank", *(stem for stem, (name, _) in ALGORITHM_VARIANTS.items() if name == "low_rank")]
    return [*powersgd, *(f"{stem}_r{rank}" for stem in stems for rank in EXTRA_LOW_RANK_RANKS)]


# ------------------------------------------------------------------------------------------------ the order


def rotated(items: Sequence[T], index: int) -> list[T]:
    """Round ``index``'s order of ``items``: the list started ``index`` places later (wrapping round)."""
    shift = index % len(items)
    return [*items[shift:], *items[:shift]]


def interleaved(methods: list[str], rounds: int) -> list[tuple[int, str]]:
    """The measuring order: every method once per round, each round starting one method later than the last.

    Rotating the order keeps a method from always following the same neighbour (a slow one that heats the
    machine, or one whose sockets are still draining).
    """
    return [(index, method) for index in range(rounds) for method in rotated(methods, index)]


# ------------------------------------------------------------------------------------------------ the report


def machine() -> dict[str, Any]:
    """Python, torch, Lightning, the platform and the load when the report was written."""
    import lightning
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # Other work on the machine slows the unshaped and 10 Gbit/s runs most: recorded, not hidden.
        "load_average_1_5_15": os.getloadavg(),
    }


def write_report(out: Path, stem: str, report: dict[str, Any], table: str) -> None:
    """Write ``report`` to ``out/<stem>.json`` and its table to ``out/<stem>.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)


def free_port() -> int:
    """Return a TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
