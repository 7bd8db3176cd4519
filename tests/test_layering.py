"""The package's import graph: acyclic, the core in dependency order, nothing in the core importing what is
built on top of it (DESIGN.md's module map)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llminfer"

# The core, in dependency order: a module may import only those before it.
CORE = ["device", "config", "costs", "attention", "kv_cache", "model", "tokenizer", "checkpoint", "generate",
        "instrument", "timing", "static_cache", "cuda_graphs"]
# Built on the core (may import it; the core never imports them).
ON_TOP = ["engine", "kernels", "quant", "fast", "speculative", "parallel", "serve"]
# Around everything: tooling and teaching aids, imported by nothing in the package but themselves.
AROUND = ["bench", "widgets", "notebooks"]


def _unit(path: Path) -> str:
    """Top-level unit a file belongs to: 'model' for model.py, 'engine' for engine/x.py."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """Top-level llminfer units a file imports (absolute or relative)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    depth = len(path.relative_to(PACKAGE).parts) - 1          # 0 for llminfer/x.py, 1 for llminfer/pkg/x.py
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level - 1 == depth:                       # relative to the package root
                names = ["llminfer." + node.module] if node.module else \
                        ["llminfer." + alias.name for alias in node.names]
            elif node.level - 1 < depth:                        # inside its own subpackage
                names = []
            else:
                raise AssertionError(f"{path}: relative import climbs above the package")
        else:
            continue
        for name in names:
            if name == "llminfer" and isinstance(node, ast.ImportFrom):
                found |= {alias.name for alias in node.names}
            elif name.startswith("llminfer."):
                found.add(name.split(".")[1])
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py" or "models" in path.relative_to(PACKAGE).parts[:1]:
            continue
        unit = _unit(path)
        edges.setdefault(unit, set()).update(_imports(path) - {unit, "__version__"})
    return edges


def test_the_core_imports_only_what_comes_before_it():
    edges = graph()
    for i, unit in enumerate(CORE):
        later = edges.get(unit, set()) - set(CORE[:i])
        assert not later, f"llminfer.{unit} imports {sorted(later)}, which come after it (or sit on top of the core)"


def test_nothing_imports_the_tooling_and_the_graph_is_acyclic():
    edges = graph()
    for unit, targets in edges.items():
        if unit not in AROUND:
            assert not targets & set(AROUND), f"llminfer.{unit} imports tooling {sorted(targets & set(AROUND))}"
    for unit in ON_TOP:
        assert not (edges.get(unit, set()) & set(AROUND)), unit
    seen, stack = set(), []

    def visit(unit):
        assert unit not in stack, f"import cycle: {' -> '.join(stack[stack.index(unit):] + [unit])}"
        if unit in seen:
            return
        stack.append(unit)
        for target in edges.get(unit, ()):
            visit(target)
        stack.pop()
        seen.add(unit)
    for unit in edges:
        visit(unit)


def test_every_module_is_placed_in_the_map():
    placed = set(CORE) | set(ON_TOP) | set(AROUND)
    assert set(graph()) <= placed, f"modules missing from the map: {sorted(set(graph()) - placed)}"
