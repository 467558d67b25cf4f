"""The package's shape: floors that import only downwards, no import cycle, no giant class.

Every import statement counts: at module level, inside functions and under `TYPE_CHECKING` (a
type-only import still couples two files). A new module must be given a floor in `FLOORS`
(see docs/architecture.md for what each floor may hold).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "backpack"

#: module prefix -> floor; the longest matching prefix decides. A module may import modules of
#: its own floor (without a cycle) and of the floors below, never of a floor above.
FLOORS = {
    # 0 foundations: thread state, the extension declarations, leaf modules, plain math
    "backpack._version": 0,
    "backpack.context": 0,
    "backpack.extensions": 0,
    "backpack.custom_module": 0,
    "backpack.core": 0,
    "backpack.utils": 0,
    "backpack.hessianfree": 0,
    # 1 tensors and records
    "backpack.recording": 1,
    # 2 rules: per-layer math
    "backpack.rules": 2,
    "backpack.variance": 2,
    # 3 graph analysis
    "backpack.samples": 3,
    "backpack.functional_calls": 3,
    "backpack.custom_module.graph_utils": 3,
    "backpack.grads_from_samples": 3,
    # 4 passes: each receives one backward's state as plain data
    "backpack.passes": 4,
    "backpack.secondorder": 4,
    "backpack.kfra": 4,
    # 5 the engine
    "backpack.engine": 5,
    # 6 the user API
    "backpack.api": 6,
    # 7 integrations
    "backpack.distributed": 7,
    # 8 tools
    "backpack.reference": 8,
    "backpack.verification": 8,
    "backpack.plotting": 8,
    "backpack.tour": 8,
    "backpack.__main__": 8,
    # the data-set layer: built on the user API only (extend, backpack(...), extensions)
    "backpack.curvature": 8,
    "backpack": 8,
    # 9 applications of the data-set layer
    "backpack.influence": 9,
    "backpack.laplace": 9,
}

MAX_CLASS_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Package modules that `module` imports anywhere in its file."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for name in names:
            if name.split(".")[0] != "backpack":
                continue
            target = _resolve(name)
            # a submodule importing its own package's __init__ runs it anyway
            if target and target != module and not module.startswith(target + "."):
                targets.add(target)
    return targets


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def floor_of(module: str) -> int:
    """The floor of a package module (longest matching prefix of `FLOORS`)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in FLOORS:
            return FLOORS[prefix]
    raise KeyError(module)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_every_module_has_a_floor():
    missing = []
    for module in MODULES:
        try:
            floor_of(module)
        except KeyError:
            missing.append(module)
    assert missing == [], "give these modules a floor in tests/test_architecture.py::FLOORS"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    upward = sorted(t for t in GRAPH[module] if floor_of(t) > floor_of(module))
    assert upward == [], f"{module} (floor {floor_of(module)}) imports a floor above it"


def test_no_class_over_500_lines():
    big = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{module}.{node.name}: {lines} lines")
    assert big == []


def test_passes_never_see_the_engine():
    """Passes, rules, recording and graph analysis receive plain data, not the Engine class."""
    below_engine = [m for m in MODULES if floor_of(m) < floor_of("backpack.engine")]
    assert all("backpack.engine" not in GRAPH[m] for m in below_engine)
