"""The docs' example pipeline (docs/spark/sink.md), examples/clickstream.py, end to end, with its defaults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.spark

EXAMPLE = ROOT / "examples" / "clickstream.py"


def test_without_java_it_says_what_to_install() -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # no java on it
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, env=env, timeout=60)
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr.decode() == (
        "clickstream.py: no Java runtime (java is not on PATH and JAVA_HOME is not set). ./run test installs "
        "what Spark needs; after ./run serve alone: .venv/bin/pip install -e '.[spark]' and a Java runtime "
        "(Debian: apt-get install openjdk-17-jre-headless)\n"
    )


@pytest.mark.timeout(240)
def test_clickstream_example_delivers_every_event(tmp_path: Path) -> None:
    """With its defaults (1M events, its own server), as the docs' first line runs it: about 25 s
    on 2 cores, most of it Spark's start."""
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the example's own broky serve and Spark share its group
    )
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = out.decode()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "spark wrote 1,000,000 events" in text
    assert "subscriber received 1,000,000 events" in text
    counts = [
        int(line.split()[-1].replace(",", "")) for line in text.splitlines() if line.startswith("  clicks.")
    ]
    assert len(counts) == 4 and sum(counts) == 1_000_000
