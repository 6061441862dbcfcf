"""The README's promises: its figures are the ones ``python benchmarks/suite.py --readme`` writes from the results
files (a figure typed by hand fails here), its install line cannot pick up 0.1.0, and it stays short."""

import re
from pathlib import Path

from benchmarks import readme_figures

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _block(text: str) -> str:
    start, end = text.index(readme_figures.START), text.index(readme_figures.END)
    return text[start : end + len(readme_figures.END)]


def test_the_figures_are_what_the_suite_writes_from_the_results():
    expected = readme_figures.markdown(readme_figures.load_results(readme_figures.RESULTS))
    assert _block(README.read_text(encoding="utf-8")) == expected, (
        "README.md's figures differ from the results: run `python benchmarks/suite.py --readme`"
    )


def test_the_chart_it_shows_is_committed():
    block = _block(README.read_text(encoding="utf-8"))
    assert f"]({readme_figures.CHART})" in block
    assert (ROOT / readme_figures.CHART).is_file()


def test_methods_the_lab_has_not_run_say_so():
    # The rows of algorithms without results read "not measured yet" rather than a figure from elsewhere.
    loaded = readme_figures.load_results(readme_figures.RESULTS)
    assert readme_figures.headline(loaded, "diloco") == "not measured yet"
    assert readme_figures.headline(loaded, None) == "not measured yet"


def test_rewriting_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{readme_figures.START}\nstale | 1 s\n{readme_figures.END}\nafter\n")
    block = readme_figures.write_readme(readme=readme, draw=False)
    assert readme.read_text() == f"before\n{block}\nafter\n"


def test_install_line_and_length():
    text = README.read_text(encoding="utf-8")
    assert re.search(r'pip install "lightning-bagua>=0\.2"', text)
    assert "make test" in text  # .ci/run's check
    assert len(text.splitlines()) <= 130
