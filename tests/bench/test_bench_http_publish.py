"""bench.http_publish, tiny: every case end to end on a real `broky serve` (HTTP POSTs, the
SDK's per-call publish, `Client.positions`, GET /healthz).

No timing assertion: only that every case ran and counted what it did. The positions() case
opens a connection per worker per call, faster than the server's default handshake limit
lets one address (3 s of it outlasts its burst of 1,000 and the SDK's retries); the benchmark's servers run
without that limit (it is not what it measures).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

CASES = (
    "sdk per call",
    "http 1 client, 1 msg/POST",
    "http 8 clients, 1 msg/POST",
    "http 1 client, 1000 msgs/POST",
    "positions() (bounded read)",
    "http 1 client, GET /healthz",
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_http_publish_runs_every_case(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "bench.http_publish", "--runs", "1", "--messages", "2000",
        "--seconds", "3", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("python -m bench.http_publish took over 100 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr.decode(errors="replace")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err[-4000:]}"
    doc = json.loads((tmp_path / "http.json").read_text())
    assert sorted(doc["summary"]) == sorted(CASES)
    for case in CASES:
        (run,) = doc["runs"][case]
        assert run["count"] > 0 and run["rate"] > 0, (case, run)
