"""Neither package has an import circle: each module can be read, moved or split alone.

The graph is built from the source with ``ast``, not from ``sys.modules``, so
it sees every import a module states:

- module-level imports;
- imports inside functions: a lazy import is how a circle hides (``cli`` and
  ``workers`` each imported the other inside functions, which Python allows
  and no import-time error reveals);
- imports under ``if TYPE_CHECKING:``: they never run, but a module that
  needs another's types to be checked still depends on it, and a circle
  through them still ties the two modules together for every reader, type
  checker and refactoring (the issue's ``effects``/``errors`` circle was one).

An edge ``a -> b`` means module ``a`` names module ``b`` (``from . import b``
is an edge to ``b``; ``from .b import X`` also to ``b``; ``from . import X``
with ``X`` defined in the package's ``__init__`` is an edge to the package).
The generated ``leasekeeper.v1`` stubs are left out: they import nothing of
ours. A submodule's implicit import of its parent package is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "leasekeeper": ROOT / "client" / "leasekeeper",
    "leasekeeper_server": ROOT / "server" / "leasekeeper_server",
}

Graph = dict[str, dict[str, list[int]]]


def _modules(package: str, root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (generated stubs left out)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[0] == "v1":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([package, *parts])] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names ``node`` may import: modules, or a module plus a name from it."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names] + [source]


def import_graph(package: str, root: Path) -> Graph:
    """module -> {module it imports: the lines}, within the package, at any depth of the source."""
    modules = _modules(package, root)
    graph: Graph = {}
    for module, path in modules.items():
        edges: dict[str, list[int]] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = _imported(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                # from X import a: the submodule X.a when it is one, else X itself.
                *submodules, source = names
                targets = [name if name in modules else source for name in submodules]
            else:
                targets = names
            for target in targets:
                if target in modules and target != module:
                    edges.setdefault(target, []).append(node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _describe(graph: Graph, component: list[str]) -> str:
    members = set(component)
    return "; ".join(
        f"{a} -> {b} (line {', '.join(map(str, lines))})"
        for a in component
        for b, lines in sorted(graph[a].items())
        if b in members
    )


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Module-level, function-local, TYPE_CHECKING and package imports are all edges."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\nA = 1\n"
    )
    (package / "b.py").write_text("def f():\n    from .c import C\n    return C\n")
    (package / "c.py").write_text("from pkg import A\nimport pkg.a\nC = A\n")
    graph = import_graph("pkg", package)
    assert graph == {
        "pkg": {"pkg.a": [1]},
        "pkg.a": {"pkg.b": [3]},
        "pkg.b": {"pkg.c": [2]},
        "pkg.c": {"pkg": [1], "pkg.a": [2]},
    }
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package: str) -> None:
    graph = import_graph(package, PACKAGES[package])
    assert len(graph) > 10, "the package's modules were not found"
    found = cycles(graph)
    assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)
