"""The server's packages import each other only as broky/server/__init__.py says.

One package per process (master, worker), the shard inside a worker, the HTTP
side the master serves, security, and a few modules both processes share. The
rule is read off the code's own import statements, type-only ones (under
TYPE_CHECKING) included: a part that knows another only for its types still
depends on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "broky" / "server"
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
