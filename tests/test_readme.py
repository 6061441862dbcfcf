"""The README's promises: its figures are the ones ``python benchmarks/suite.py --readme`` writes from the results
files (a figure typed by hand fails here), its install line cannot pick up 0.1.0, and it stays short."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as the suite runs: its lab package

from lab import gpu_report  # noqa: E402

README = ROOT / "README.md"


def _block(text: str) -> str:
    start, end = text.index(gpu_report.README_START), text.index(gpu_report.README_END)
    return text[start : end + len(gpu_report.README_END)]


def test_the_figures_are_what_the_suite_writes_from_the_results():
    expected = gpu_report.readme_markdown(gpu_report.load_results(gpu_report.RESULTS))
    assert _block(README.read_text(encoding="utf-8")) == expected, (
        "README.md's figures differ from the results: run `python benchmarks/suite.py --readme`"
    )


def test_the_chart_it_shows_is_committed():
    block = _block(README.read_text(encoding="utf-8"))
    assert f"]({gpu_report.README_CHART})" in block
    assert (ROOT / gpu_report.README_CHART).is_file()


def test_methods_the_lab_has_not_run_say_so():
    # The rows of algorithms without results read "not measured yet" rather than a figure from elsewhere.
    loaded = gpu_report.load_results(gpu_report.RESULTS)
    assert gpu_report.headline(loaded, "diloco") == "not measured yet"
    assert gpu_report.headline(loaded, None) == "not measured yet"
    # and the reader is sent to the CPU labs that did measure them
    pointer = next(line for line in gpu_report.readme_markdown(loaded).splitlines() if "no two-GPU run" in line)
    assert "`diloco`" in pointer
    assert gpu_report.CPU_LABS_POINTER in pointer


def test_rewriting_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{gpu_report.README_START}\nstale | 1 s\n{gpu_report.README_END}\nafter\n")
    block = gpu_report.write_readme(readme=readme, draw=False)
    assert readme.read_text() == f"before\n{block}\nafter\n"


def test_install_line_and_length():
    text = README.read_text(encoding="utf-8")
    assert re.search(r'pip install "lightning-bagua>=0\.2"', text)
    assert "make test" in text  # .ci/run's check
    assert len(text.splitlines()) <= 130
