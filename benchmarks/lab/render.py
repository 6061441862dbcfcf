"""Markdown tables and charts of results, for the benchmarks' ``.md`` files and for the documentation alike.

A benchmark computes its table once, as a header and rows of strings; :func:`markdown_table` writes it into the
``.md`` beside the results, and the documentation's extension builds the same rows into its pages.
"""

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as a GitHub-flavoured markdown table, one line each, ending in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


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
