"""The modules of the broky package import each other without a cycle.

Every import counts, those under TYPE_CHECKING and those inside functions
too: a module that needs another's type gets a Protocol rather than an import
back (the client's `LinkOwner`, `RouterOwner`, `SubscriptionOwner`; the
server's connection.Shard and monitor.Observed). Importing a parent package
(`from broky import __version__`) is not counted: a package's __init__ is
where its modules' names are gathered.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "broky"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the broky modules it imports (parent packages left out)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in imported if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of its modules, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            cycle = visit(imported, [*path, module])
            if cycle is not None:
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module, [])
        if cycle is not None:
            return cycle
    return None


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    # the graph is real: edges that exist are seen
    assert "broky.client.routing" in graph["broky.client.client"]
    assert "broky.server.http.monitor" in graph["broky.server.master.process"]
    assert "broky.cluster.planner" in graph["broky.cluster.node"]
    assert find_cycle(graph) is None


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
