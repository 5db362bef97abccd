"""The tests' own layout: folders that mirror the package, shared code in tests/support only.

A test module imports no other test module (any `test_*` module): what two test files
share is in tests/support/, where a reader looks for it, and a test file can be moved,
renamed or run alone without breaking another. Every other module of tests/ (helpers,
fixtures, strategies, fakes) is in tests/support/, save the conftest.py files pytest
needs and the packages' __init__.py; and every folder of tests/ is a package, so two test
files of the same name in two folders stay two modules. docs/contributing/layout.md
draws the folders.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import ROOT

TESTS = ROOT / "tests"
SUPPORT = "support"
ALLOWED_OUTSIDE_SUPPORT = {"__init__.py", "conftest.py"}


def is_test_module(path: Path) -> bool:
    return path.name.startswith("test_") and path.suffix == ".py"


def python_files(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py") if "__pycache__" not in p.parts)


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every module an import may load, relative ones with leading dots.

    `from a.b import c` names both `a.b` and `a.b.c` (c may be a module).
    """
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if node.module:
                out.append((node.lineno, base))
            sep = "" if base.endswith(".") else "."
            out += [(node.lineno, f"{base}{sep}{alias.name}") for alias in node.names]
    return out


def imports_of_test_modules(tests: Path) -> list[str]:
    """`file:line: module` for each import line of tests/ that names a test module (a `test_*` one)."""
    found: dict[tuple[str, int], str] = {}
    for path in python_files(tests):
        for line, name in imported_names(ast.parse(path.read_text(), str(path))):
            if any(part.startswith("test_") for part in name.split(".")):
                found.setdefault((str(path.relative_to(tests)), line), name)
    return [f"{file}:{line}: {name}" for (file, line), name in sorted(found.items())]


def shared_code_outside_support(tests: Path) -> list[str]:
    """Modules of tests/ that are neither tests, conftest.py, __init__.py, nor in tests/support."""
    return [
        str(path.relative_to(tests))
        for path in python_files(tests)
        if not is_test_module(path)
        and path.name not in ALLOWED_OUTSIDE_SUPPORT
        and path.relative_to(tests).parts[0] != SUPPORT
    ]


def test_no_test_module_imports_another() -> None:
    assert imports_of_test_modules(TESTS) == [], "move what they share into tests/support/"


def test_shared_code_lives_in_tests_support() -> None:
    assert shared_code_outside_support(TESTS) == []
    # And tests/support holds no test: pytest would collect it where nobody looks for one.
    assert [p.name for p in python_files(TESTS / SUPPORT) if is_test_module(p)] == []


def test_every_folder_of_tests_is_a_package() -> None:
    folders = {p.parent for p in python_files(TESTS)}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    # The three ways to import a test module, and a helper beside the tests, are each found.
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "test_a.py").write_text(
        "from tests.server.test_b import helper\nimport tests.client.test_c\n"
        "from tests.client import test_c\nfrom . import test_d\nfrom tests.support.http import http_get\n"
    )
    (tmp_path / "server" / "helpers.py").write_text("X = 1\n")
    (tmp_path / "support").mkdir()
    (tmp_path / "support" / "kit.py").write_text("from tests.server.test_a import X\n")
    assert [f.split(": ")[1] for f in imports_of_test_modules(tmp_path)] == [
        "tests.server.test_b",
        "tests.client.test_c",
        "tests.client.test_c",
        ".test_d",
        "tests.server.test_a",
    ]
    assert shared_code_outside_support(tmp_path) == ["server/helpers.py"]


def test_the_layout_page_names_every_folder_of_tests() -> None:
    # docs/contributing/layout.md's table of tests/: each folder that holds modules, no other.
    page = (ROOT / "docs" / "contributing" / "layout.md").read_text()
    section = page.split("\n## The tests\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `(tests/[\w/]+)/` \|", section, flags=re.M))
    folders = {
        str(p.parent.relative_to(ROOT)) for p in python_files(TESTS) if p.name not in ALLOWED_OUTSIDE_SUPPORT
    }
    assert named == folders
