"""bench.http_publish, tiny: every case end to end on a real `broky serve` (HTTP POSTs, the
SDK's per-call publish, `Client.positions`, GET /healthz).

No timing assertion: only that every case ran and counted what it did. The positions() case
opens a connection per worker per call, faster than the server's default handshake limit
lets one address (3 s of it outlasts its burst of 1,000 and the SDK's retries); the benchmark's servers run
without that limit (it is not what it measures).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchrun import run_bench

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
    run_bench(
        "bench.http_publish",
        "--runs",
        "1",
        "--messages",
        "2000",
        "--seconds",
        "3",
        "--out",
        str(tmp_path),
        timeout=100,
    )
    doc = json.loads((tmp_path / "http.json").read_text())
    assert sorted(doc["summary"]) == sorted(CASES)
    for case in CASES:
        (run,) = doc["runs"][case]
        assert run["count"] > 0 and run["rate"] > 0, (case, run)
