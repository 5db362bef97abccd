"""Monitoring endpoints and Prometheus metrics of a real `broky serve`.

Every endpoint answers with the right shape, and the counters and drop
reasons move exactly as the traffic says they should.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broky.errors import ErrorCode
from broky.protocol import Error, Pause, Resume
from tests.serverproc import ServerProcess
from tests.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)
KP1 = kp_for_worker(1, 2)

REQUIRED = {
    "broky_messages_published_total": "counter",
    "broky_messages_delivered_total": "counter",
    "broky_messages_dropped_total": "counter",
    "broky_bytes_received_total": "counter",
    "broky_bytes_sent_total": "counter",
    "broky_connections": "gauge",
    "broky_subscriptions": "gauge",
    "broky_topics": "gauge",
    "broky_slow_consumer_disconnects_total": "counter",
    "broky_worker_restarts_total": "counter",
    "broky_broker_latency_seconds": "histogram",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(server: ServerProcess, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    url = f"http://{server.host}:{server.metrics_port}{path}"
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def get_json(server: ServerProcess, path: str) -> Any:
    status, ctype, body = get(server, path)
    assert status == 200 and ctype == "application/json", (status, body)
    return json.loads(body)


def scrape(server: ServerProcess) -> tuple[dict[str, str], Samples]:
    """(metric family -> type, (sample name, labels) -> value) of one /metrics scrape."""
    status, ctype, body = get(server, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4"), (status, ctype)
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def test_every_required_metric_has_its_type_and_a_worker_label(server: ServerProcess) -> None:
    types, samples = scrape(server)
    for name, kind in REQUIRED.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert types.get(family) == kind, (name, types.get(family))
        for worker in ("0", "1"):
            sample = name if kind != "histogram" else name + "_count"
            labels = {"worker": worker}
            if name == "broky_messages_dropped_total":
                labels["reason"] = "no_subscribers"
            assert value(samples, sample, **labels) == 0.0
    for reason in ("no_subscribers", "slow_consumer", "not_my_vbucket", "shutdown"):
        assert value(samples, "broky_messages_dropped_total", worker="0", reason=reason) == 0.0
    assert value(samples, "broky_worker_up", worker="1") == 1.0
    # Latency buckets in seconds, from microseconds up, cumulative, ending with +Inf.
    bounds = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in samples.items()
        if name == "broky_broker_latency_seconds_bucket" and ("worker", "0") in labels
    )
    assert 5e-6 < bounds[0][0] < 5e-5 and bounds[-1][0] == float("inf") and len(bounds) >= 10
    # No label anywhere carries a key: only these label names exist.
    assert {k for _, labels in samples for k, _ in labels} <= {"worker", "reason", "code", "le", "version"}


def test_health_ready_and_errors(server: ServerProcess) -> None:
    assert get(server, "/healthz")[::2] == (200, b"ok\n")
    assert get(server, "/readyz")[::2] == (200, b"ok\n")
    assert get(server, "/metrics", "HEAD")[::2] == (200, b"")
    assert get(server, "/nope")[0] == 404
    assert get(server, "/metrics", "POST")[0] == 405
    for bad in ("x", "0", "-3"):
        status, _, body = get(server, f"/connections?limit={bad}")
        assert status == 400 and b"limit must be a positive integer" in body


def test_stats_shape(server: ServerProcess) -> None:
    stats = get_json(server, "/stats")
    assert stats["node_id"] and stats["version"]
    assert stats["master"]["pid"] == server.pid
    assert sorted(stats["master"]["worker_pids"]) == sorted(server.worker_pids())
    workers = stats["workers"]
    assert [w["worker"] for w in workers] == [0, 1]
    assert workers[0]["vbuckets"] == [[0, 511]] and workers[1]["vbuckets"] == [[512, 1023]]
    for w in workers:
        assert w["up"] is True and w["pid"] in server.worker_pids()
        for key in ("connections", "subscriptions", "topics", "messages_published", "messages_delivered"):
            assert w[key] == 0, key
        assert set(w["dropped"]) >= {"no_subscribers", "slow_consumer", "not_my_vbucket", "shutdown"}
        assert w["latency_seconds"]["reads"] == 0
    assert stats["totals"]["workers_up"] == 2 and stats["totals"]["dropped"]["no_subscribers"] == 0


def test_counters_and_drop_reasons_follow_the_traffic(server: ServerProcess) -> None:
    n = 50
    with Wire.hello(server.address, worker=0, name="pub") as pub:
        for i in range(n):  # nobody listens yet
            pub.publish(KP0, b"orders.eu", b"%d" % i)
        pub.flush()
        _, s = scrape(server)
        assert value(s, "broky_messages_published_total", worker="0") == n
        assert value(s, "broky_messages_dropped_total", worker="0", reason="no_subscribers") == n
        assert value(s, "broky_messages_delivered_total", worker="0") == 0
        assert value(s, "broky_broker_latency_seconds_count", worker="0") == 0

        with Wire.hello(server.address, worker=0, name="sub") as sub:
            sub.subscribe(1, b"orders.*")
            sub.subscribe(2, b"orders.eu")  # two matching subscriptions: still one delivery
            sub.flush()
            received_before = value(scrape(server)[1], "broky_bytes_received_total", worker="0")
            for i in range(n):
                pub.publish(KP0, b"orders.eu", b"%d" % i)
            pub.flush()
            assert len(sub.messages()) == n
            pub.publish(KP1, b"orders.eu", b"wrong worker")  # NOT_MY_VBUCKET
            errors = pub.flush()
            assert [ErrorCode(f.code) for f in errors if isinstance(f, Error)] == [ErrorCode.NOT_MY_VBUCKET]
            assert len(errors) == 1

            _, s = scrape(server)
            assert value(s, "broky_messages_published_total", worker="0") == 2 * n + 1
            assert value(s, "broky_messages_delivered_total", worker="0") == n
            assert value(s, "broky_messages_dropped_total", worker="0", reason="no_subscribers") == n
            assert value(s, "broky_messages_dropped_total", worker="0", reason="not_my_vbucket") == 1
            assert value(s, "broky_errors_sent_total", worker="0", code="not_my_vbucket") == 1
            assert value(s, "broky_messages_published_total", worker="1") == 0
            assert value(s, "broky_connections", worker="0") == 2
            assert value(s, "broky_subscriptions", worker="0") == 2
            assert value(s, "broky_topics", worker="0") == 2
            assert value(s, "broky_bytes_received_total", worker="0") > received_before
            assert value(s, "broky_bytes_sent_total", worker="0") > 0
            reads = value(s, "broky_broker_latency_seconds_count", worker="0")
            assert 1 <= reads <= n  # one observation per read that delivered
            assert 0 < value(s, "broky_broker_latency_seconds_sum", worker="0") < reads

            conns = get_json(server, "/connections")
            by_name = {c["name"]: c for c in conns["connections"]}
            assert conns["total"] == 2 and set(by_name) == {"pub", "sub"}
            assert by_name["pub"]["messages_in"] == 2 * n + 1 and by_name["pub"]["messages_out"] == 0
            assert by_name["sub"]["messages_out"] == n and by_name["sub"]["subscriptions"] == 2
            assert sorted(by_name["sub"]["patterns"]) == ["orders.*", "orders.eu"]
            assert conns["connections"][0]["name"] == "pub"  # busiest first
            for c in conns["connections"]:
                assert c["worker"] == 0 and c["remote"].startswith("127.0.0.1:") and c["dropped"] == 0
                assert c["pending_bytes"] == 0

        deadline = time.monotonic() + 5  # the subscriber left: its interest goes with it
        while value(s := scrape(server)[1], "broky_connections", worker="0") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert value(s, "broky_subscriptions", worker="0") == 0 and value(s, "broky_topics", worker="0") == 0


def test_topics_busiest_first_and_bounded(server: ServerProcess) -> None:
    wires = [Wire.hello(server.address, worker=w % 2) for w in range(4)]
    try:
        for i, w in enumerate(wires):
            w.subscribe(1, b"all.>")
            if i < 2:
                w.subscribe(2, b"half")
            w.subscribe(3, b"own.%d" % i)
            w.flush()
        topics = get_json(server, "/topics")
        assert topics["total"] == 2 + 2 + 4  # patterns per worker: all.>, half on both; own.i on one
        listed = topics["topics"]
        assert listed[0] == {"pattern": "all.>", "subscriptions": 4, "workers": [0, 1]}
        assert listed[1] == {"pattern": "half", "subscriptions": 2, "workers": [0, 1]}
        assert {t["pattern"] for t in listed[2:]} == {f"own.{i}" for i in range(4)}
        assert all(t["subscriptions"] == 1 for t in listed[2:])
        assert [t["pattern"] for t in get_json(server, "/topics?limit=1")["topics"]] == ["all.>"]
        assert len(get_json(server, "/connections?limit=3")["connections"]) == 3
        assert get_json(server, "/connections?limit=3")["total"] == 4
    finally:
        for w in wires:
            w.close()


def test_slow_consumer_drops_are_counted(start_server: Any) -> None:
    server = start_server("--max-pending-bytes", "64K")
    with (
        Wire.hello(server.address, worker=0, name="lazy") as sub,
        Wire.hello(server.address, worker=0) as pub,
    ):
        sub.subscribe(1, b"k")
        sub.send(Pause())
        sub.flush()
        n = 2000  # about 100 bytes each: 200 KB > 64 KiB
        for i in range(n):
            pub.publish(KP0, b"k", b"%d" % i)
        pub.flush()
        lazy = next(c for c in get_json(server, "/connections")["connections"] if c["name"] == "lazy")
        assert lazy["paused"] is True and 0 < lazy["pending_bytes"] <= 64 * 1024
        assert lazy["dropped"] > 0 and lazy["messages_out"] + lazy["dropped"] == n
        _, s = scrape(server)
        assert value(s, "broky_messages_dropped_total", worker="0", reason="slow_consumer") == lazy["dropped"]
        assert value(s, "broky_messages_delivered_total", worker="0") == lazy["messages_out"]
        sub.send(Resume())
        sub.flush()


def test_worker_restart_is_counted_and_readyz_follows(server: ServerProcess) -> None:
    victim = get_json(server, "/stats")["workers"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        _, s = scrape(server)
        restarted = value(s, "broky_worker_restarts_total", worker="1") == 1
        if restarted and value(s, "broky_worker_up", worker="1") == 1 and get(server, "/readyz")[0] == 200:
            break
        assert time.monotonic() < deadline, "worker 1 not restarted and counted within 10 s"
        time.sleep(0.05)
    assert value(s, "broky_worker_restarts_total", worker="0") == 0
    assert get_json(server, "/stats")["workers"][1]["pid"] not in (victim, None)
    assert get(server, "/healthz")[0] == 200


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_bad_input_logs_one_warning_without_traceback(start_server: Any, fmt: str) -> None:
    server = start_server("--log-format", fmt)
    with Wire.hello(server.address, worker=0) as bad:
        bad.send(b"\x08\x00\x00\x00" + b"\xff" * 8)  # a frame of garbage
        bad.expect_closed()
    with Wire(server.address) as rude:  # not a Hello: refused by the master
        rude.send(b"\x10\x00\x00\x00" + b"\x00" * 16)
        rude.expect_closed()
    deadline = time.monotonic() + 5
    while len([ln for ln in server.log().splitlines() if "WARNING" in ln.upper()]) < 2:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    lines = server.log().splitlines()
    warnings = [ln for ln in lines if "warning" in ln.lower()]
    assert len(warnings) == 2, lines
    assert "Traceback" not in server.log()
    if fmt == "json":
        records = [json.loads(ln) for ln in lines]  # every line is one JSON object
        warned = [r for r in records if r["level"] == "warning"]
        assert {r["process"] for r in warned} == {"master", "worker-0"}
        assert any("MALFORMED_FRAME" in r["msg"] for r in warned)
        assert any("EXPECTED_HELLO" in r["msg"] or "MALFORMED_FRAME" in r["msg"] for r in warned)
        assert all("exc" not in r for r in warned)
    else:
        assert any("MALFORMED_FRAME" in ln and "worker-0" in ln for ln in warnings)
