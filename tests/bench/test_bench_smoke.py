"""CI smoke test of the benchmark harness: `python -m bench --quick` end to end.

It starts real broky serve, nats-server and redis-server processes and checks
that the run finished and wrote well-formed results. No timing assertion: the
figures depend on the machine; only their presence and shape are checked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import requires
from tests.support.paths import ROOT

SYSTEMS = ("broky", "nats", "redis")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_quick_runs_end_to_end(tmp_path: Path) -> None:
    requires.program("nats-server")
    requires.program("redis-server")
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
    sdk_run = next(s for s in results["throughput"] if s["id"] == "1to1_100")["results"]["broky_sdk"]
    assert "error" not in sdk_run and sdk_run["deliveries_per_s"] > 0 and sdk_run["not_delivered"] == 0, (
        sdk_run
    )
    # The client-side SDK publish rates ran (an exception there is reported as "error" in the
    # results, not by the exit status): every client published.
    sdk = results["sdk"]
    assert "error" not in sdk and "skipped" not in sdk, sdk
    assert set(sdk["rates"]) == {"broky SDK", "nats.py", "redis-py (pipelined)"}, sdk
    assert all(rate > 0 for rate in sdk["rates"].values()) and sdk["broky_over_nats_py"] > 0, sdk
    for name in SYSTEMS:
        lat = results["latency"]["results"][name]
        assert lat["samples"] > 0
        p = lat["percentiles_us"]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["p99.9"] <= lat["max_us"]
    assert any(t["target"].startswith("p99 latency") for t in results["targets"])
    s2s = results["sdk_to_sdk"]
    assert [r["id"] for r in s2s["rows"]] == ["p256_100", "p1_1024"]
    for row in s2s["rows"]:
        for name in SYSTEMS:
            summary = row["summary"][name]
            assert "error" not in summary and not summary["errors"], (row["id"], name, summary)
            assert summary["received_worst"] > 0 and summary["server_peak_rss_mb"] > 0, (row["id"], name)
        assert row["summary"]["broky"]["lost_worst"] == 0, row["results"]["broky"]
    assert any(t["target"].startswith("SDK to SDK, 256 key_partitions") for t in results["targets"])

    table = (out / "bench.md").read_text()
    assert "| Scenario | Broky | NATS | Redis | Broky/NATS | Broky/Redis |" in table
    assert (
        machine["cpu_model"] in table and machine["nats_server"] in table and machine["redis_server"] in table
    )
    assert table.count("\n| 1 → 4 fan-out, 16 B |") == 4  # deliveries/s, CPU, RSS and SDK tables
    assert "## SDK to SDK: a burst through the client libraries" in table
    assert table.count("\n| 256 key_partitions, 100 B |") == 4  # CPU, deliveries/s, loss and RSS tables
    for png in ("latency.png", "throughput.png", "cpu.png", "sdk_cpu.png", "sdk_rate.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC), png
    assert stdout.decode().startswith("# Broky benchmark")


def _stream(driver_name: str, wildcard: bool = False) -> tuple[Any, Any, Any, socket.socket]:
    from bench.harness import loadgen

    driver = loadgen.DRIVERS[driver_name]()
    key = loadgen.make_keys(1)[0]
    rec = driver.record(key, b"y" * 100, wildcard)
    ours, theirs = socket.socketpair()
    counters = loadgen.Counters()
    return loadgen.SubscriberStream(driver, ours, rec, counters), counters, rec, theirs


def _deliver(stream: Any, peer: socket.socket, data: bytes, chunk: int) -> None:
    for i in range(0, len(data), chunk):
        peer.sendall(data[i : i + chunk])
        assert stream.read()


@pytest.mark.parametrize("chunk", [1, 7, 100, 4096, 1 << 20])
def test_counting_subscriber_broky_records_and_foreign_frames(chunk: int) -> None:
    """Deliveries are counted across any split of the stream; other frames are read, not counted."""
    from broky.errors import ErrorCode
    from broky.protocol import LossNotice, Pong, encode_frame, encode_message
    from broky.protocol.frames import error_frame

    stream, counters, rec, peer = _stream("broky")
    with stream.sock, peer:
        msg = encode_message(b"p0000", b"bench.k0000", b"y" * 100)
        assert len(msg) == rec.length
        data = msg * 5 + encode_frame(Pong(3)) + msg * 3 + encode_frame(LossNotice(4)) + msg
        data += error_frame(ErrorCode.NOT_MY_VBUCKET, "not mine", fatal=False, map_version=1) + msg * 2
        _deliver(stream, peer, data, chunk)
        assert stream.n == 11
        assert counters.lost == 4
        assert counters.errors == 1 and "code=10" in counters.notes[0], counters.notes


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_counting_subscriber_nats_answers_ping_and_counts_errors(chunk: int) -> None:
    stream, counters, rec, peer = _stream("nats")
    with stream.sock, peer:
        msg = b"MSG bench.k0000 1 100\r\n" + b"y" * 100 + b"\r\n"
        assert len(msg) == rec.length
        data = msg * 3 + b"PING\r\n" + msg + b"-ERR 'Slow Consumer'\r\n" + msg * 2
        _deliver(stream, peer, data, chunk)
        assert stream.n == 6
        assert counters.errors == 1
        peer.settimeout(5)
        assert peer.recv(100) == b"PONG\r\n"


def test_counting_subscriber_redis_pattern_records() -> None:
    stream, counters, rec, peer = _stream("redis", wildcard=True)
    with stream.sock, peer:
        msg = (
            b"*4\r\n$8\r\npmessage\r\n$7\r\nbench.*\r\n$11\r\nbench.k0000\r\n$100\r\n" + b"y" * 100 + b"\r\n"
        )
        assert len(msg) == rec.length
        _deliver(stream, peer, msg * 10, 333)
        assert stream.n == 10 and counters.errors == 0


def _fake_results() -> dict[str, Any]:
    def run(rate: float, cpu: float) -> dict[str, Any]:
        return {
            "deliveries_per_s": rate,
            "server_cpu_us_per_delivery": cpu,
            "generator_cpu_us_per_delivery": 0.1,
            "server_peak_rss_bytes": 50 << 20,
            "errors": 0,
            "not_delivered": 0,
            "notes": [],
        }

    def lat(p99: float) -> dict[str, Any]:
        pct = {"p50": p99 / 4, "p90": p99 / 2, "p99": p99, "p99.9": p99 * 2, "p99.99": p99 * 3}
        dist = [(0.0, 1.0), (50.0, p99 / 4), (90.0, p99 / 2), (99.0, p99), (99.9, p99 * 2), (100.0, p99 * 4)]
        return {"percentiles_us": pct, "max_us": p99 * 4, "samples": 1000, "distribution": dist}

    machine = {
        "cpu_model": "Test CPU",
        "cores": 2,
        "memory_bytes": 2**31,
        "os": "Linux",
        "python": "CPython 3.11",
        "broky": "0.1.0",
        "nats_server": "2.9.10",
        "redis_server": "7.0.15",
        "load_average_at_start": 0.1,
    }
    return {
        "mode": "quick",
        "command": "python -m bench --quick",
        "started": "2026-01-01 00:00 UTC",
        "machine": machine,
        "settings": {"broky_workers": 2, "warmup_s": 0.1, "duration_s": 0.2},
        "throughput": [
            {
                "id": "1to1_100",
                "title": "1 → 1, 100 B",
                "results": {"broky": run(500e3, 1.0), "nats": run(1e6, 0.9), "redis": run(400e3, 1.25)},
            },
            {
                "id": "1to4_16",
                "title": "1 → 4 fan-out, 16 B",
                "results": {"broky": run(1e6, 0.5), "nats": run(3e6, 0.25), "redis": {"error": "boom"}},
            },
        ],
        "latency": {
            "rate_per_s": 5000,
            "payload": 100,
            "warmup_s": 0.1,
            "duration_s": 1,
            "results": {"broky": lat(300.0), "nats": lat(100.0), "redis": lat(150.0)},
        },
        "sdk": {
            "messages": 10,
            "runs": 1,
            "rates": {"broky SDK": 300e3, "nats.py": 100e3},
            "broky_over_nats_py": 3.0,
        },
    }


def test_report_targets_tables_and_plots(tmp_path: Path) -> None:
    from bench.harness import report

    results = _fake_results()
    paths = report.write(results, tmp_path)
    met = {t["target"]: (t["ratio"], t["met"]) for t in results["targets"]}
    cpu = met["server CPU per delivery, 1to1_100: Broky <= Redis"]
    assert cpu[0] == pytest.approx(0.8) and cpu[1] is True
    assert met["deliveries/s, 1to1_100: Broky >= Redis"][1] is True
    assert met["deliveries/s, 1to4_16: Broky >= Redis"] == (None, None)  # Redis failed: no verdict
    p99 = met["p99 latency at 5,000 msgs/s (100 B): Broky <= 1.5x NATS"]
    assert p99[0] == pytest.approx(3.0) and p99[1] is False
    assert met["SDK publish rate >= 3x nats.py"] == (3.0, True)
    table = (tmp_path / "bench.md").read_text()
    assert "| 1 → 1, 100 B | 500.0 k | 1.00 M | 400.0 k | 0.50x | 1.25x |" in table
    assert "| 1 → 4 fan-out, 16 B | 1.00 M | 3.00 M | failed | 0.33x | - |" in table
    assert "| Broky/NATS | 3.00x | 3.00x | 3.00x | 3.00x | 3.00x | |" in table
    assert "Test CPU, 2 cores, 2.0 GiB" in table and "nats-server 2.9.10" in table
    assert "1to4_16 / Redis" not in table and "1 → 4 fan-out, 16 B / Redis: boom" in table
    assert json.loads((tmp_path / "bench.json").read_text())["targets"] == results["targets"]
    assert {p.name for p in paths} == {"bench.json", "bench.md", "latency.png", "throughput.png", "cpu.png"}
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes().startswith(PNG_MAGIC)


def test_only_a_full_run_writes_into_the_committed_results() -> None:
    """A quick or partial run must not replace bench/results (the docs quote those)."""
    from bench.__main__ import _full_run, _scratch

    assert _full_run([])
    for argv in (
        ["--quick"],
        ["--only", "1to1_100"],
        ["--duration=1"],
        ["--no-latency"],
        ["--systems", "broky"],
    ):
        assert not _full_run(argv), argv
    scratch = _scratch("quick")
    try:
        assert (
            scratch.is_dir() and scratch.name.startswith("broky-bench-quick-") and not any(scratch.iterdir())
        )
    finally:
        scratch.rmdir()


def test_bar_plots_use_a_log_axis_only_past_a_decade() -> None:
    from bench.harness.report import log_axis

    assert not log_axis([0.30, 0.40, 0.60, 0.75])  # 2.5x within a decade: linear, gaps as they are
    assert log_axis([0.04, 0.13, 0.56])  # 14x: log
    assert not log_axis([])
