"""The documentation's promises: every public name is in the API reference, and every example runs.

Examples are doctests: ``>>>`` lines in docstrings of ``src/lightning_bagua``, in ``benchmarks/lab/traffic.py``
(the traffic model behind the "which algorithm when" tables), and in the Markdown pages inside ```` ```pycon ````
fences (the pages' convention for runnable examples; ```` ```python ```` fences show code that is not run).
Nothing here builds the site: ``make docs`` does that, with warnings as errors.
"""

import doctest
import importlib
import importlib.util
import io
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "lightning_bagua"
DOCS = ROOT / "docs" / "source"
API_PAGE = DOCS / "api.md"
BENCHMARKS = ROOT / "benchmarks"

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Modules whose import needs what a CPU test machine lacks; their examples, if any, cannot run here.
NEEDS_CUDA = {
    "lightning_bagua.engine.codec._triton": "imports triton, which exists only with CUDA",
    "lightning_bagua.engine.algorithms._dcd_triton": "imports triton, which exists only with CUDA",
}
# Modules with examples today: if one of these stops running any, the examples were lost, not fixed.
MODULES_WITH_EXAMPLES = {
    "lightning_bagua.engine.codec",
    "lightning_bagua.engine._counter",
    "lightning_bagua.engine.algorithms.decentralized",
}

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_DIRECTIVE = re.compile(r"^\.\. (?P<kind>auto\w+|py:\w+):: +(?P<target>\S+)")
_OPTION = re.compile(r"^ +:(?P<name>[\w-]+):(?P<value>.*)$")


def _module_names() -> list[str]:
    """Every module of the package, found from the file tree, without importing anything."""
    names = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _is_public(module_name: str) -> bool:
    return not any(part.startswith("_") for part in module_name.split("."))


PUBLIC_MODULES = [name for name in _module_names() if _is_public(name)]


def _fences(text: str) -> list[tuple[str, int, str]]:
    """Return ``(info string, first line number, body)`` for every fenced block of a Markdown text."""
    blocks = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        body, start = [], index + 1
        index += 1
        while index < len(lines) and not lines[index].strip().startswith(fence):
            body.append(lines[index][indent:])
            index += 1
        blocks.append((match["info"].strip(), start + 1, "\n".join(body)))
        index += 1
    return blocks


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_"))


def _documented_names() -> set[str]:
    """Fully qualified names the API page documents, from its autodoc and ``py:`` directives."""
    documented: set[str] = set()
    lines = API_PAGE.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if match is None:
            continue
        kind, target = match["kind"], match["target"]
        options = {}
        for option_line in lines[index + 1 :]:
            option = _OPTION.match(option_line)
            if option is None:
                break
            options[option["name"]] = option["value"].strip()
        if kind != "automodule":
            documented.add(target)
            continue
        if "members" not in options:
            continue
        if options["members"]:
            members = {name.strip() for name in options["members"].split(",")}
        else:
            # Plain `:members:` documents the module's __all__, as autodoc does.
            members = set(importlib.import_module(target).__all__)
        members -= {name.strip() for name in options.get("exclude-members", "").split(",") if name.strip()}
        documented |= {f"{target}.{name}" for name in members}
    return documented


def _import(module_name: str) -> ModuleType:
    return importlib.import_module(module_name)


def _exporters(name: str) -> list[str]:
    return [other for other in PUBLIC_MODULES if name in getattr(_import(other), "__all__", ())]


def test_public_modules_found() -> None:
    for expected in ("lightning_bagua", "lightning_bagua.engine", "lightning_bagua.launch", "lightning_bagua.data"):
        assert expected in PUBLIC_MODULES


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"public module {module_name} has no __all__"
    documented = _documented_names()
    missing = []
    for name in exported:
        value = getattr(module, name)
        candidates = {f"{module_name}.{name}"}
        # A re-exported class or function is documented once, where it is defined.
        home, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if isinstance(home, str) and isinstance(qualname, str):
            candidates.add(f"{home}.{qualname}")
        # A re-exported constant has no home of its own: any public module exporting the same object will do.
        candidates |= {f"{other}.{name}" for other in _exporters(name) if getattr(_import(other), name) is value}
        if not candidates & documented:
            missing.append(name)
    assert not missing, (
        f"{module_name}.__all__ names missing from docs/source/api.md: {missing}. Add an automodule (with"
        " :members:) for the module that defines them, or an explicit directive."
    )


def test_top_level_names_have_their_import_path_listed() -> None:
    import lightning_bagua

    page = API_PAGE.read_text(encoding="utf-8")
    missing = [name for name in lightning_bagua.__all__ if f"| `{name}` |" not in page]
    assert not missing, f"add these to the import-path table of docs/source/api.md: {missing}"


def _run(test: doctest.DocTest) -> doctest.TestResults:
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    runner.run(test, out=out.write, clear_globs=False)
    assert runner.failures == 0, out.getvalue()
    return doctest.TestResults(runner.failures, runner.tries)


def _run_module(module: ModuleType) -> int:
    tries = 0
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, module.__name__):
        tries += _run(test).attempted
    return tries


@pytest.mark.parametrize("module_name", [name for name in _module_names() if name not in NEEDS_CUDA])
def test_docstring_examples(module_name: str) -> None:
    tries = _run_module(importlib.import_module(module_name))
    if module_name in MODULES_WITH_EXAMPLES:
        assert tries > 0, f"{module_name} had examples and now runs none"


def test_traffic_model_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("lab.traffic", BENCHMARKS / "lab" / "traffic.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lab.traffic", module)
    spec.loader.exec_module(module)
    assert _run_module(module) >= 5


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pages import the traffic model as `lab.traffic`, with `benchmarks/` on the path as the documentation build has.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    text = page.read_text(encoding="utf-8")
    globs: dict[str, object] = {"__name__": "__docs__"}
    parser = doctest.DocTestParser()
    for info, line, body in _fences(text):
        language = info.split()[0] if info else ""
        if language != "pycon":
            assert ">>> " not in body or language.startswith("{"), (
                f"{page.name}:{line}: a ```{language} block has >>> prompts; fence runnable examples as ```pycon"
            )
            continue
        # One namespace per page: later examples build on earlier ones, as a reader would run them.
        test = parser.get_doctest(body, globs, f"{page.name}:{line}", str(page), line - 1)
        assert test.examples, f"{page.name}:{line}: a ```pycon block without >>> examples"
        _run(test)
        globs = test.globs  # DocTest copied them; the run added the block's names


def test_pages_with_examples_are_found() -> None:
    with_examples = {p.name for p in _pages() if any(i.startswith("pycon") for i, _, _ in _fences(p.read_text()))}
    assert {"choosing.md", "launching.md", "migration.md", "system_optimizations.md"} <= with_examples
