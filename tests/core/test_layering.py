"""The layering rule of docs/DESIGN.md: the package's import graph, read from every module, is acyclic (between
packages and between modules), the core imports only the core modules before it, nothing imports the tooling
(bench, widgets, notebooks, claims), every module has a place in the module map, and no module sets an attribute
that a module below it probes for by name (a hook set from above)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llminfer"

# The core, in dependency order: a module may import only those before it.
CORE = ["device", "config", "costs", "attention", "kv_cache", "model", "tokenizer", "gguf_reader", "checkpoint",
        "generate", "instrument", "timing", "static_cache", "cuda_graphs"]
# Built on the core (may import it; the core never imports them).
ON_TOP = ["engine", "flash", "cpu", "quant", "fast", "speculative", "parallel", "serve"]
# Around everything: tooling and teaching aids, imported by nothing in the package but themselves.
AROUND = ["bench", "widgets", "notebooks", "claims"]


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


# --- no hooks set from above ------------------------------------------------------------------------------------

def _attribute_writes(tree: ast.AST) -> dict[str, int]:
    """Attribute names a module sets on objects other than its own `self`/`cls` (obj.name = ..., obj.name += ...,
    setattr(obj, "name", ...), object.__setattr__(obj, "name", ...)), with a line of each."""
    found: dict[str, int] = {}

    def foreign(node) -> bool:
        return not (isinstance(node, ast.Name) and node.id in ("self", "cls"))
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and foreign(item.value):
                    found.setdefault(item.attr, node.lineno)
        if isinstance(node, ast.Call) and len(node.args) >= 3 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and foreign(node.args[0]):
            func = node.func
            if (isinstance(func, ast.Name) and func.id == "setattr") or \
                    (isinstance(func, ast.Attribute) and func.attr == "__setattr__"):
                found.setdefault(node.args[1].value, node.lineno)
    return found


def _attribute_probes(tree: ast.AST) -> dict[str, int]:
    """Attribute names a module looks up by name, getattr(obj, "name"[, default]) or hasattr(obj, "name"):
    the reads of an attribute that someone else may or may not have set."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            found.setdefault(node.args[1].value, node.lineno)
    return found


# A module's own parameters: module transforms replace them by design (DESIGN.md's seams), and every layer reads
# them; they are the module's data, not a hook left for someone else to find.
MODULE_PARAMETERS = {"weight", "bias"}


def hooks_set_from_above(sources: dict[str, list[tuple[str, str]]], edges: dict[str, set[str]]) -> list[str]:
    """Each attribute a unit sets on a foreign object while a unit it imports (directly or not) probes for it.

    sources: unit -> [(file name, source text)]; edges: unit -> units it imports."""
    def below(unit, seen=None):
        seen = set() if seen is None else seen
        for target in edges.get(unit, ()):
            if target not in seen:
                seen.add(target)
                below(target, seen)
        return seen - {unit}

    writes = {unit: [(name, _attribute_writes(ast.parse(text))) for name, text in files]
              for unit, files in sources.items()}
    probes = {unit: [(name, _attribute_probes(ast.parse(text))) for name, text in files]
              for unit, files in sources.items()}
    problems = []
    for unit, files in writes.items():
        for lower in sorted(below(unit)):
            for file, written in files:
                for lower_file, probed in probes.get(lower, []):
                    for attr in sorted((set(written) & set(probed)) - MODULE_PARAMETERS):
                        problems.append(f"{file}:{written[attr]} sets .{attr}, which {lower_file}:{probed[attr]} "
                                        f"(llminfer.{lower}, below it) reads with getattr/hasattr: a hidden hook; pass "
                                        "the object where it is needed instead")
    return problems


def _package_sources() -> dict[str, list[tuple[str, str]]]:
    sources: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py" or "models" in path.relative_to(PACKAGE).parts[:1]:
            continue
        sources.setdefault(_unit(path), []).append((str(path.relative_to(PACKAGE)), path.read_text()))
    return sources


def test_no_module_sets_an_attribute_that_a_module_below_it_reads():
    """A transform returns the model and leaves no hook on it for the core to find (the gpt-fast rule)."""
    problems = hooks_set_from_above(_package_sources(), graph())
    assert not problems, "\n".join(problems)


def test_the_hook_rule_catches_compiled_decoder():
    """The pattern this rule forbids, as it was: fast set model.compiled_decoder, generate probed for it."""
    sources = {
        "generate": [("generate.py", "def generate(model, ids):\n"
                                     "    decoder = getattr(model, 'compiled_decoder', None)\n"
                                     "    return decoder.generate(ids) if decoder is not None else ids\n")],
        "fast": [("fast.py", "def compile_decode(model):\n"
                             "    decoder = object()\n"
                             "    model.compiled_decoder = decoder\n"
                             "    return decoder\n")],
    }
    edges = {"fast": {"generate"}, "generate": set()}
    problems = hooks_set_from_above(sources, edges)
    assert len(problems) == 1 and ".compiled_decoder" in problems[0] and "fast.py:3" in problems[0]
    # setattr() is the same write; the same names inside one class (self.x = ..., getattr(self, "x")) are not
    sources["fast"] = [("fast.py", "def compile_decode(model):\n    setattr(model, 'compiled_decoder', 1)\n")]
    assert len(hooks_set_from_above(sources, edges)) == 1
    assert hooks_set_from_above(sources, {"fast": set(), "generate": set()}) == []     # unrelated units
    sources["fast"] = [("fast.py", "class D:\n    def __init__(self):\n        self.compiled_decoder = 1\n")]
    assert hooks_set_from_above(sources, edges) == []
    # replacing a module's parameter is what a module transform does, not a hook
    sources["fast"] = [("fast.py", "def fuse(layer):\n    layer.weight = 1\n")]
    sources["generate"] = [("generate.py", "def head(model):\n    return getattr(model, 'weight', None)\n")]
    assert hooks_set_from_above(sources, edges) == []
