"""`./run`, the README's two commands: what the docs say `./run test` installs
(docs/getting-started.md) is what it installs, and it installs every program the tests require;
`./run serve` installs the server's dependencies alone, saying so, and only the first time."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

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


def test_run_serve_installs_the_server_alone_and_says_so_the_first_time(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("BROKY_CLUSTER", "VIRTUAL_ENV")}
    env["BROKY_VENV"] = str(venv)

    def serve_help() -> str:
        done = subprocess.run(
            [str(ROOT / "run"), "serve", "--help"], env=env, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    first = serve_help()
    assert first.startswith(
        f"setting up {venv} for the server (about 10 s the first time): pip install -e '.'\n"
    ), first
    assert "Successfully installed" in first  # pip's own output: the progress
    assert re.search(rf"^set up {re.escape(str(venv))} for the server in \d+ s$", first, re.M), first
    assert "usage: broky serve" in first
    freeze = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    names = {line.split("==")[0].lower() for line in freeze.split()} - {"pip", "setuptools"}
    assert names == {"broky", "flatbuffers", "uvloop", "xxhash"}, names  # no dev, cluster or spark extra
    again = serve_help()
    assert again.startswith("usage: broky serve"), again  # installed: nothing said, nothing done
