"""bench/test_micro.py still runs: each micro-benchmark once, in a process of its own.

Its own process because one of its baselines reads the generated accessors'
numpy views, and in the suite's process flatbuffers may have been imported
with broky's numpy placeholder (broky/__init__.py) before numpy itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import ROOT


@pytest.mark.timeout(120)
def test_every_micro_benchmark_runs_once() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/test_micro.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
