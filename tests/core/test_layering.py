"""The layering rule of docs/DESIGN.md: the package's import graph, read from every module, is acyclic (between
packages and between modules), the core imports only the core modules before it, nothing imports the tooling
(bench, widgets, notebooks, claims), every module has a place in the module map, and no module sets an attribute
that a module below it probes for by name (a hook set from above)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llminfer"

# The core, in dependency order: a module may import only those before it.
CORE = ["device", "checks", "config", "costs", "attention", "kv_cache", "moe", "model", "tokenizer", "gguf_reader",
        "checkpoint", "sampling", "structured", "generate", "instrument", "timing", "static_cache", "cuda_graphs"]
# Built on the core (may import it; the core never imports them).
ON_TOP = ["engine", "flash", "cpu", "quant", "fast", "speculative", "parallel", "serve", "moe_balance"]
# Around everything: tooling and teaching aids, imported by nothing in the package but themselves.
AROUND = ["bench", "widgets", "notebooks", "claims", "exercises"]


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name ('llminfer.bench.decode'; a package by its own name)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] == "models":
            continue
        name = ".".join((root.name, *parts)).removesuffix(".__init__")
        files[name] = path
    return files


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file (inside functions too): `import a.b`,
    `from a.b import c` (the module a.b.c where there is one, else a.b), relative imports at any depth,
    `from llminfer import x`. An import names the module it reaches, not the packages above it."""
    files = module_files(root)
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:
                    base = package.split(".")
                    if node.level - 1 >= len(base):
                        raise AssertionError(f"{path}:{node.lineno}: relative import climbs above the package")
                    origin = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in files else origin
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in files and "." in target:     # a name inside a module: that module
                    target = target.rpartition(".")[0]
                if target in files and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (strongly connected, of two or more), each
    as one cycle through them: ['a', 'b', 'a']."""
    order, low, stack, cycles = {}, {}, [], []

    def visit(node):
        order[node] = low[node] = len(order)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1:
                cycles.append(_cycle_through(sorted(group), edges))
    for node in sorted(edges):
        if node not in order:
            visit(node)
    return cycles


def _cycle_through(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One path from group[0] back to itself inside group (breadth first: the shortest)."""
    start, inside = group[0], set(group)
    paths = {target: [start, target] for target in sorted(edges[start] & inside)}
    queue = list(paths)
    while start not in paths:
        node = queue.pop(0)
        for target in sorted(edges[node] & inside):
            if target not in paths:
                paths[target] = paths[node] + [target]
                queue.append(target)
    return paths[start]


def _unit(module: str) -> str:
    """Top-level unit a module belongs to: 'model' for llminfer.model, 'engine' for llminfer.engine.x."""
    return module.split(".")[1] if "." in module else module


def graph() -> dict[str, set[str]]:
    """Unit -> the units it imports: the module graph seen from the top-level packages and modules."""
    edges: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        if module == PACKAGE.name:                                  # llminfer/__init__.py: the public names
            continue
        unit = _unit(module)
        edges.setdefault(unit, set()).update({_unit(target) for target in targets} - {unit})
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


def test_no_module_imports_a_module_that_imports_it_back():
    cycles = import_cycles(module_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "llminfer" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "llminfer"


def test_the_module_graph_sees_every_kind_of_import(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "from .model import forward\n",
        "model.py": "import torch\nfrom . import costs\n",
        "costs.py": "",
        "bench/__init__.py": "",
        "bench/decode.py": "from .measure import interleave\nfrom ..model import forward\n",
        "bench/measure.py": "def run():\n    from llminfer import costs\n    import llminfer.serve.peer\n",
        "serve/__init__.py": "from . import bench\n",
        "serve/bench.py": "from llminfer.serve import peer\n",
        "serve/peer.py": "def main():\n    from .bench import summarize\n    from llminfer.bench.decode import x\n",
    })
    edges = module_graph(package)
    assert edges == {
        "llminfer": {"llminfer.model"}, "llminfer.model": {"llminfer.costs"}, "llminfer.costs": set(),
        "llminfer.bench": set(), "llminfer.bench.decode": {"llminfer.bench.measure", "llminfer.model"},
        "llminfer.bench.measure": {"llminfer.costs", "llminfer.serve.peer"},
        "llminfer.serve": {"llminfer.serve.bench"}, "llminfer.serve.bench": {"llminfer.serve.peer"},
        "llminfer.serve.peer": {"llminfer.serve.bench", "llminfer.bench.decode"}}
    # serve.bench <-> serve.peer, through imports inside functions; and bench.decode -> measure -> serve.peer
    # -> bench.decode, three modules round
    assert import_cycles(edges) == [
        ["llminfer.bench.decode", "llminfer.bench.measure", "llminfer.serve.peer", "llminfer.bench.decode"]]
    edges["llminfer.serve.peer"].discard("llminfer.bench.decode")
    assert import_cycles(edges) == [["llminfer.serve.bench", "llminfer.serve.peer", "llminfer.serve.bench"]]
    edges["llminfer.serve.peer"] = set()
    assert import_cycles(edges) == []


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
    for module, path in module_files().items():
        if module != PACKAGE.name:
            sources.setdefault(_unit(module), []).append((str(path.relative_to(PACKAGE)), path.read_text()))
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


# --- no class swapped in place ------------------------------------------------------------------------------------

def class_assignments(tree: ast.AST) -> list[int]:
    """Lines that assign an object's __class__ (obj.__class__ = ..., setattr(obj, "__class__", ...))."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__class__"):
            lines.append(node.lineno)
    return lines


def test_no_module_swaps_an_objects_class():
    """A transform replaces modules or returns new ones; none changes an object's class in place."""
    assert class_assignments(ast.parse("m.layers.__class__ = Other\nsetattr(m, '__class__', Other)\n")) == [1, 2]
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in class_assignments(ast.parse(path.read_text()))]
    assert not found, f"__class__ assigned at {', '.join(found)}; replace the module instead"
