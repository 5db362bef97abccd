"""Run a benchmark module end to end, as its CI smoke tests do (tests/bench)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.support.paths import ROOT


def run_bench(module: str, *args: str, timeout: float) -> tuple[str, str]:
    """`python -m module args` from the repository, in a session of its own (killed whole on
    a timeout: the run and its readers; servers it starts have sessions of their own and are
    stopped by it). Fails the test past `timeout` seconds or on a non-zero exit; (stdout,
    stderr) otherwise."""
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"python -m {module} took over {timeout:g} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr.decode(errors="replace")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err[-4000:]}"
    return stdout.decode(errors="replace"), err
