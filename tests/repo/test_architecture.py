"""The server's packages import each other only as broky/server/__init__.py says.

One package per process (master, worker), the shard inside a worker, the HTTP
side the master serves, security, and a few modules both processes share. The
rule is read off the code's own import statements, type-only ones (under
TYPE_CHECKING) included: a part that knows another only for its types still
depends on it.

Inside the shard, the same for its core and parts (broky.server.shard.part): a
part imports the Protocol and the shard's state modules, never the core or
another part, and does not reach another through the core's attributes.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

SERVER = ROOT / "broky" / "server"
PACKAGES = ("master", "worker", "shard", "http", "security")
SHARED = "shared"  # the modules at broky/server's top: config, logs, accounts, handoff, histogram

# Who may import whom (besides its own package and the shared modules).
ALLOWED: dict[str, set[str]] = {
    "master": {"http", "security", "shard.fastpath"},  # (fastpath: the master says which one runs)
    "worker": {"shard", "security"},
    "shard": {"security"},
    "http": {"security", "shard.stats"},  # (stats: the names of the counters it renders)
    "security": set(),
    SHARED: set(),
}
# Named exceptions, each with its reason.
EXCEPTIONS = {
    # config parses --http-allow-origin with the sans-IO origin rules, in the master only
    # (a function-level import: a worker never parses flags).
    ("config", "http.origins"),
    # a type of the TLS handshake's counters, under TYPE_CHECKING
    ("security.tls", "shard.stats"),
    # the monitoring endpoints' view of the master's supervisor, under TYPE_CHECKING
    ("http.monitor", "master.supervisor"),
}


def place(module: str) -> tuple[str, str]:
    """(package, module name inside broky.server) of a dotted broky.server module."""
    rest = module.removeprefix("broky.server.")
    head = rest.split(".")[0]
    return (head if head in PACKAGES else SHARED), rest


def imports_of(path: Path) -> set[str]:
    """The broky.server modules a file imports (from X import Y: Y when it is a module)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("broky.server"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_path = SERVER.parent.parent / (candidate.replace(".", "/") + ".py")
                found.add(candidate if as_path.exists() else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("broky.server."))
    return {m for m in found if m != "broky.server"}


def test_every_import_between_the_server_packages_is_allowed() -> None:
    wrong = []
    for path in sorted(SERVER.rglob("*.py")):
        module = ".".join(path.relative_to(SERVER.parent.parent).with_suffix("").parts)
        if module.endswith("__init__"):
            continue
        package, name = place(module)
        for target in imports_of(path):
            other, target_name = place(target)
            if other in (package, SHARED) or other in ALLOWED[package] or target_name in ALLOWED[package]:
                continue
            if (name, target_name) in EXCEPTIONS:
                continue
            wrong.append(f"{name} -> {target_name}")
    assert wrong == []


def test_the_rule_catches_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from broky.server.http.server import HttpServer\nfrom broky.server.shard import core\n")
    assert imports_of(bad) == {"broky.server.http.server", "broky.server.shard.core"}
    package, _ = place("broky.server.worker.process")
    assert "http" not in ALLOWED[package] and place("broky.server.http.server")[0] == "http"


# The Shard is a core and parts (broky.server.shard.part): the core (core.py) builds the
# parts; a part knows the core only through the `ShardCore` Protocol (part.py) and never
# another part. Parts with state are objects (the core's attributes below); parts without
# are modules of functions the core calls with itself. Both read the shard's state modules.
SHARD = SERVER / "shard"
PART_OBJECTS = {
    "arrivals",
    "moves",
    "grace",
    "positions",
    "groups",
    "lag",
}  # the core's attributes of those names
PART_FUNCTIONS = {"control", "backpressure", "closing", "budget_enforcement", "monitoring"}
STATE = {"part", "connection", "sequences", "replay", "budget", "stats", "heap", "fastpath"}


def shard_imports(path: Path) -> set[str]:
    """The broky.server.shard modules a file imports (by name inside the package)."""
    return {
        m.removeprefix("broky.server.shard.") for m in imports_of(path) if m.startswith("broky.server.shard.")
    }


def core_parts_reached(path: Path) -> list[str]:
    """`core.<part>` or `self.core.<part>` in a file: a part reaching another through the core."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PART_OBJECTS:
            inner = node.value
            if (isinstance(inner, ast.Name) and inner.id == "core") or (
                isinstance(inner, ast.Attribute) and inner.attr == "core"
            ):
                found.append(f"{path.stem}: core.{node.attr} (line {node.lineno})")
    return found


def test_every_module_of_the_shard_is_the_core_a_part_or_its_state() -> None:
    modules = {p.stem for p in SHARD.glob("*.py")} - {"__init__"}
    assert modules == {"core"} | PART_OBJECTS | PART_FUNCTIONS | STATE


def test_a_part_imports_no_other_part_and_not_the_core() -> None:
    wrong = []
    for name in sorted(PART_OBJECTS | PART_FUNCTIONS | STATE):
        path = SHARD / f"{name}.py"
        for target in sorted(shard_imports(path)):
            if target not in STATE:
                wrong.append(f"{name} -> {target}")
        wrong.extend(core_parts_reached(path))
    assert wrong == []


def test_no_class_of_the_shard_declares_what_it_uses_of_another() -> None:
    # (the mixins' `if TYPE_CHECKING:` declarations: ShardCore says it once)
    declaring = []
    for path in sorted(SHARD.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != "ShardCore":
                for stmt in node.body:
                    if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                        declaring.append(f"{path.stem}.{node.name}")
    assert declaring == []


def test_the_shard_rule_catches_a_part_that_reaches_another(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from broky.server.shard.groups import Groups\n"
        "from broky.server.shard.part import ShardCore\n"
        "def f(core: ShardCore) -> None:\n"
        "    core.groups.emit()\n"
    )
    assert shard_imports(bad) == {"groups", "part"}
    assert core_parts_reached(bad) == ["bad: core.groups (line 4)"]
