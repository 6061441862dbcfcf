"""The engine is the bottom layer: torch only, usable from plain PyTorch without Lightning installed."""

import subprocess
import sys

LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def test_importing_the_engine_imports_no_lightning_module():
    probe = (
        "import sys, lightning_bagua.engine, lightning_bagua.engine.algorithms;"
        f" print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING_PACKAGES!r}))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]", completed.stdout


def test_the_probe_sees_lightning_when_it_is_imported():
    # The check above can fail: the same probe after importing a strategy lists Lightning's modules.
    probe = (
        "import sys, lightning_bagua.strategies.bagua;"
        f" print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING_PACKAGES!r}))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "'lightning'" in completed.stdout


def _engine_imports() -> dict[str, set[str]]:
    """Every engine module's imports of other engine modules, lazy and TYPE_CHECKING ones included."""
    import ast
    from pathlib import Path

    import lightning_bagua.engine

    root = Path(lightning_bagua.engine.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(("lightning_bagua", "engine", *parts)).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets.update(candidate for candidate in candidates if candidate in modules and candidate != name)
        graph[name] = targets
    return graph


def test_no_engine_module_imports_one_that_imports_it_back():
    # Package __init__ modules re-export their children, so edges into a package count from its children only.
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in _engine_imports().items()}
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)}
    graph = {name: targets - packages for name, targets in graph.items() if name not in packages}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for target in graph.get(node, ()):
                if target == start:
                    cycles.append([*path, start])
                elif target not in path and len(path) < len(graph):
                    stack.append((target, [*path, target]))
    assert not cycles, f"import circles: {cycles[:3]}"


def test_the_circle_check_sees_the_telemetry_import():
    # The check above can fail: it sees base's import of telemetry (an edge of the circle this release removed).
    graph = _engine_imports()
    assert "lightning_bagua.engine.telemetry" in graph["lightning_bagua.engine.algorithms.base"]
