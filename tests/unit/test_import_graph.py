"""The module import graph of eagle3/, infra/, flows/ and tasks/ is acyclic, counting every import in the source.

An import inside a function still ties two modules together (the cycle only hides until that function runs),
so the graph is built from every ``import`` and ``from ... import`` in each file, nested ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("eagle3", "infra", "flows", "tasks")


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (a package's __init__ is its name)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The known module that ``name`` (a module or a name inside one) refers to: its longest known prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import node may load: ``from a import b`` names both a.b (a submodule?) and a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: drop (level - 1) packages from this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of the same packages it imports anywhere in its source (functions included)."""
    modules = module_names(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _targets(node, module, path.name == "__init__.py"):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each is one or more cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (a -> ... -> a) through the first module of each tangle."""
    return [cycle_in(graph, component) for component in tangles(graph)]


def cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, found by breadth-first search inside it."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_import_graph_is_acyclic():
    """No module of eagle3/, infra/, flows/ or tasks/ reaches itself through imports (nested imports count)."""
    graph = import_graph()
    found = [
        f"{' -> '.join(cycle_in(graph, t))} (modules in this tangle: {', '.join(sorted(t))})" for t in tangles(graph)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_graph_covers_every_package():
    """Each of the four packages has modules in the graph and modules that import others of them."""
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == set(PACKAGES)
    assert {m.split(".")[0] for m, targets in graph.items() if targets} == set(PACKAGES)


def test_cycle_checker_finds_a_cycle_held_by_a_nested_import(tmp_path):
    """A two-module cycle closed by an import inside a function, and a three-module one, are both reported."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": "def f():\n    import pkg.a\n",
        "sub/__init__.py": "",
        "sub/c.py": "from . import d\n",
        "sub/d.py": "from ..sub import e\n",
        "sub/e.py": "from pkg.sub.c import y\n",
        "ok.py": "import pkg.a\nimport os\n",
    }.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.ok"] == {"pkg.a"} and graph["pkg.sub.c"] == {"pkg.sub.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.sub.c", "pkg.sub.d", "pkg.sub.e", "pkg.sub.c"]]
