"""The wheel and the sdist: `python -m build` makes both (the wheel from the sdist, so the
sdist holds what a build needs: the C sources, _layout.h, console.html); the wheel holds
both compiled modules; installed into a fresh virtual environment with its dependencies
(pip, from the package index or its cache), it runs `broky serve`, `broky pub` and the
SDK from a directory outside the checkout, with the compiled fan-out and publish paths.
Without the compiled modules (deleted from that environment) the same round trip runs on
the pure-Python fallbacks, and the server says so.

Cost: about 20 s here (the build 7 s, the environment and its three dependencies 8 s,
the two servers a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)  # (about 20 s: not marked slow)

COMPILED = ("broky/server/shard/_feedscan", "broky/client/_pubpack", "broky/spark/_readcols")

# Run by the fresh environment's python from outside the checkout: subscribe with the SDK,
# publish with the installed `broky pub`, receive; print where broky and its compiled
# publish path came from.
ROUND_TRIP = """
import subprocess, sys, sysconfig
import broky
from broky.client import pubpack

server = sys.argv[1]
with broky.connect_sync(server) as client:
    sub = client.subscribe("wheel.>")
    done = subprocess.run(
        [sysconfig.get_path("scripts") + "/broky", "pub", "wheel.test", "from the wheel", "--server", server],
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, done.stderr
    msg = sub.next(timeout=10)
    print(msg.key.decode(), msg.payload.decode(), sep="|")
print(broky.__file__)
print(pubpack.description)
"""


def run(*args: str | Path, cwd: Path) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=180, env=environment()
    )
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


def environment() -> dict[str, str]:
    """This process's environment without what would let a child import the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def round_trip(venv: Path, where: Path) -> tuple[str, list[str]]:
    """Serve from `venv`, publish and subscribe through it; the server's log and the script's lines."""
    server = ServerProcess(program=[str(venv / "bin" / "broky")], cwd=where, env={"PYTHONPATH": ""})
    server.start()
    try:
        lines = run(venv / "bin" / "python", "-c", ROUND_TRIP, server.url, cwd=where).splitlines()
        server.wait_log("serving on")
        return server.log(), lines
    finally:
        server.stop()


def test_the_wheel_installs_into_a_fresh_environment_and_serves(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, ROOT, cwd=tmp_path)
    (sdist,) = dist.glob("broky-*.tar.gz")
    (wheel,) = dist.glob("broky-*.whl")

    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "pyproject.toml", "setup.py", "README.md", "broky/protocol/_layout.h",
        "broky/server/shard/_feedscan.c", "broky/client/_pubpack.c", "broky/spark/_readcols.c",
        "broky/server/http/console.html",
    ):  # fmt: skip
        assert needed in names, needed
    with zipfile.ZipFile(wheel) as whl:
        inside = whl.namelist()
    for module in COMPILED:
        assert any(n.startswith(module + ".") and n.endswith(".so") for n in inside), (module, inside)
    assert "broky/server/http/console.html" in inside
    assert not any(n.startswith(("tests/", "bench/", "scripts/", "examples/")) for n in inside), inside

    venv = tmp_path / "venv"
    outside = tmp_path / "elsewhere"  # no broky/ here: what runs is the installed package
    outside.mkdir()
    run(sys.executable, "-m", "venv", venv, cwd=outside)
    run(venv / "bin" / "pip", "install", "--disable-pip-version-check", wheel, cwd=outside)
    site = Path(run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                    cwd=outside).strip())  # fmt: skip

    log, lines = round_trip(venv, outside)
    assert lines == ["wheel.test|from the wheel", str(site / "broky" / "__init__.py"), "compiled"], lines
    assert "with 2 workers (fan-out: compiled)" in log, log

    # The pure-Python fallbacks: the same package without its compiled modules.
    for module in COMPILED:
        (so,) = site.glob(module + ".*.so")
        so.unlink()
    log, lines = round_trip(venv, outside)
    assert lines[:2] == ["wheel.test|from the wheel", str(site / "broky" / "__init__.py")], lines
    assert lines[2].startswith("pure Python: the compiled publish path is not built"), lines
    assert "(fan-out: pure Python: the compiled fast path is not built" in log, log
