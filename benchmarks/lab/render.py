"""Markdown tables and charts of results, for the benchmarks' ``.md`` files and for the documentation alike.

A benchmark computes its table once, as a header and rows of strings; :func:`markdown_table` writes it into the
``.md`` beside the results, and the documentation's extension builds the same rows into its pages.
"""

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as a GitHub-flavoured markdown table, one line each, ending in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def milliseconds(seconds: float | None, digits: int = 1) -> str:
    """``0.0123`` -> ``"12.3"``; ``None`` -> ``"-"``."""
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``"0.52x"``, or ``"-"`` where either is missing."""
    return "-" if value is None or not base else f"{value / base:.2f}x"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (and a warning) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart")
        return None
    return plt


def line_chart(
    series: dict[str, list[tuple[float, float]]],
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    log_x: bool = False,
    log_y: bool = False,
    xticks: Sequence[tuple[float, str]] = (),
) -> bool:
    """Draw one line per series of (x, y) points into ``path``; ``False`` where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(9, 5))
    for label, points in series.items():
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", label=label)
    if log_x:
        axes.set_xscale("log")
    if log_y:
        axes.set_yscale("log")
    if xticks:
        axes.set_xticks([x for x, _ in xticks], [label for _, label in xticks])
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
