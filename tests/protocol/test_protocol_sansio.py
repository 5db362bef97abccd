"""The codec is sans-I/O: no module of broky/protocol/ can reach a socket, a file or a loop.

Checked on the source (ast), so an import hidden in a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import ROOT

PROTOCOL = ROOT / "broky" / "protocol"
MODULES = sorted(PROTOCOL.glob("*.py"))

# Top-level modules that do I/O, wait, or run concurrently.
FORBIDDEN = {
    "asyncio",
    "asyncore",
    "concurrent",
    "http",
    "io",
    "mmap",
    "multiprocessing",
    "pathlib",
    "select",
    "selectors",
    "shutil",
    "signal",
    "socket",
    "socketserver",
    "ssl",
    "subprocess",
    "tempfile",
    "threading",
    "trio",
    "urllib",
    "uvloop",
}
# Broky's own packages that do I/O.
FORBIDDEN_BROKY = {"broky.client", "broky.server", "broky.spark", "broky.cli"}
# Builtins that open files or read the terminal.
FORBIDDEN_CALLS = {"open", "input", "print", "breakpoint", "__import__"}
# os is imported for random bytes (KSUIDs) and fork safety only.
OS_ALLOWED = {"urandom", "register_at_fork"}


def imported_modules(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def violations(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    for name in imported_modules(tree):
        if name.split(".")[0] in FORBIDDEN or any(
            name == pkg or name.startswith(pkg + ".") for pkg in FORBIDDEN_BROKY
        ):
            found.append(f"imports {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"calls {node.func.id}() on line {node.lineno}")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr not in OS_ALLOWED
        ):
            found.append(f"uses os.{node.attr} on line {node.lineno}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found.extend(f"imports os.{a.name}" for a in node.names if a.name not in OS_ALLOWED)
    for name in imported_modules(tree):
        if name == "importlib" or name.startswith("importlib."):
            found.append(f"imports {name}")
    return found


def test_the_protocol_package_has_modules() -> None:
    assert {m.name for m in MODULES} >= {"__init__.py", "framing.py", "message.py", "frames.py", "table.py"}


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_no_io_in_the_codec(module: Path) -> None:
    assert violations(module.read_text()) == []


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "import socket as s",
        "from selectors import DefaultSelector",
        "def f():\n    import threading",
        "import concurrent.futures",
        "from broky.server.shard.core import Shard",
        "import broky.client",
        "data = open('x').read()",
        "import importlib",
        "import os\nos.write(1, b'x')",
        "from os import read",
    ],
)
def test_the_check_catches_io(source: str) -> None:
    assert violations(source) != []


def test_the_check_allows_what_the_codec_needs() -> None:
    source = (
        "import os\nimport struct\nimport time\nfrom broky.errors import ProtocolError\nimport flatbuffers"
    )
    assert violations(source) == []
