"""`./run`, the README's two commands: what the docs say `./run test` installs
(docs/getting-started.md) is what it installs, and it installs every program the tests require."""

from __future__ import annotations

import re

from tests.support import requires
from tests.support.paths import ROOT


def apt_installs() -> dict[str, str]:
    """program -> Debian package, from `./run`'s apt_install."""
    run = (ROOT / "run").read_text()
    return dict(re.findall(r"command -v (\S+) >/dev/null \|\| missing\+=\((\S+)\)", run))


def test_the_docs_name_every_package_run_test_installs() -> None:
    installs = apt_installs()
    assert {"flatc", "etcd", "java"} <= set(installs), installs
    page = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())  # one line: it wraps
    listed = re.search(r"`\./run test` also installs the Debian packages the tests start \(([^)]*)\)", page)
    assert listed is not None
    named = [name.strip() for name in listed.group(1).split(",")]
    assert sorted(named) == sorted("a Java runtime for Spark" if p == "java" else p for p in installs), named


def test_run_test_installs_every_program_a_test_requires() -> None:
    packages = set(apt_installs().values())
    assert set(requires.PACKAGES.values()) <= packages
