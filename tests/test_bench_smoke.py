"""CI smoke test of the benchmark harness: `python -m bench --quick` end to end.

It starts real broky serve, nats-server and redis-server processes and checks
that the run finished and wrote well-formed results. No timing assertion: the
figures depend on the machine; only their presence and shape are checked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("broky", "nats", "redis")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.skipif(
    not (shutil.which("nats-server") and shutil.which("redis-server")),
    reason="nats-server and redis-server are installed by ./run test",
)
def test_bench_quick_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", "--quick", "--out", str(out)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=75)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness stops its servers on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=15)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(
            f"python -m bench --quick took over 75 s; stderr:\n{stderr.decode(errors='replace')[-3000:]}"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = stderr.decode(errors="replace")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err[-4000:]}"
    assert "[1/" in err, "no progress line on stderr"

    results = json.loads((out / "bench.json").read_text())
    machine = results["machine"]
    for field in ("cpu_model", "cores", "memory_bytes", "python", "broky", "nats_server", "redis_server"):
        assert machine[field], field
    assert results["mode"] == "quick"
    ids = {s["id"] for s in results["throughput"]}
    assert {"1to1_100", "1to4_16", "4to1_100", "keys256_100", "1to1_16", "1to1_16384"} <= ids
    for scenario in results["throughput"]:
        for name in SYSTEMS:
            run = scenario["results"][name]
            assert "error" not in run and "skipped" not in run, (scenario["id"], name, run)
            assert run["deliveries_per_s"] > 0
            assert run["server_cpu_us_per_delivery"] is None or run["server_cpu_us_per_delivery"] >= 0
            assert run["server_peak_rss_bytes"] > 0
            assert run["delivered_total"] > 0
            assert run["errors"] == 0, run["notes"]
            assert run["not_delivered"] == 0, (scenario["id"], name, run)
    for name in SYSTEMS:
        lat = results["latency"]["results"][name]
        assert lat["samples"] > 0
        p = lat["percentiles_us"]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["p99.9"] <= lat["max_us"]
    assert any(t["target"].startswith("p99 latency") for t in results["targets"])

    table = (out / "bench.md").read_text()
    assert "| Scenario | Broky | NATS | Redis | Broky/NATS | Broky/Redis |" in table
    assert (
        machine["cpu_model"] in table and machine["nats_server"] in table and machine["redis_server"] in table
    )
    assert table.count("\n| 1 → 4 fan-out, 16 B |") == 3  # deliveries/s, CPU and RSS tables
    for png in ("latency.png", "throughput.png", "cpu.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC), png
    assert stdout.decode().startswith("# Broky benchmark")
