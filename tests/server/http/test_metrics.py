"""Monitoring endpoints and Prometheus metrics of a real `broky serve`.

Every endpoint answers with the right shape, and the counters and drop
reasons move exactly as the traffic says they should.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest

from broky.errors import ErrorCode
from broky.protocol import Error, Goodbye, LossNotice, Message, Pause, Resume, encode_message
from broky.server import handoff
from broky.server.config import ServerConfig
from broky.server.master import process as master_module
from tests.support.http import get, get_json, scrape, value
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

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
    reasons = (
        "no_subscribers",
        "slow_consumer",
        "not_my_vbucket",
        "shutdown",
        "connection_lost",
        "worker_restart",
    )
    for reason in reasons:
        assert value(samples, "broky_messages_dropped_total", worker="0", reason=reason) == 0.0
    for result in ("connection_lost", "worker_restart", "unknown"):
        assert value(samples, "broky_resumes_total", worker="0", result=result) == 0.0
    assert value(samples, "broky_worker_up", worker="1") == 1.0
    # Latency buckets in seconds, from microseconds up, cumulative, ending with +Inf.
    bounds = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in samples.items()
        if name == "broky_broker_latency_seconds_bucket" and ("worker", "0") in labels
    )
    assert 5e-6 < bounds[0][0] < 5e-5 and bounds[-1][0] == float("inf") and len(bounds) >= 10
    # No label anywhere carries a key: only these label names exist.
    allowed = {"worker", "reason", "code", "le", "version", "result", "process", "method"}
    assert {k for _, labels in samples for k, _ in labels} <= allowed


def test_every_error_code_process_figure_and_answered_request_has_a_series(server: ServerProcess) -> None:
    from broky.errors import ErrorCode

    # Every code is there at 0 before its first event, as the drop reasons are: a dashboard
    # panel on them shows 0, not "No data".
    _, samples = scrape(server)
    codes = [code.name.lower() for code in ErrorCode if code is not ErrorCode.NONE]
    for code in codes:
        assert value(samples, "broky_handshakes_refused_total", code=code) == 0.0
        for worker in ("0", "1"):
            assert value(samples, "broky_errors_sent_total", worker=worker, code=code) == 0.0
    # Prometheus' process metrics, for the master and each worker (read from /proc by the master).
    stats = get_json(server, "/stats")
    started = stats["master"]["processes"]
    pids = {p["process"]: p["pid"] for p in started}
    assert pids == {
        "master": server.pid,
        **{f"worker-{i}": pid for i, pid in enumerate(stats["master"]["worker_pids"])},
    }
    for process in ("master", "worker-0", "worker-1"):
        assert value(samples, "process_cpu_seconds_total", process=process) > 0
        rss = value(samples, "process_resident_memory_bytes", process=process)
        assert 10 << 20 < rss < value(samples, "process_virtual_memory_bytes", process=process)
        assert (
            3
            <= value(samples, "process_open_fds", process=process)
            <= value(samples, "process_max_fds", process=process)
        )
        assert abs(value(samples, "process_start_time_seconds", process=process) - time.time()) < 600
    assert value(samples, "process_start_time_seconds", process="master") <= value(
        samples, "process_start_time_seconds", process="worker-0"
    )
    # HTTP requests by method and status (the scrapes above are answered requests too).
    assert get(server, "/nope")[0] == 404
    assert get(server, "/metrics", "POST")[0] == 405
    _, samples = scrape(server)
    assert value(samples, "broky_http_requests_total", method="get", code="404") == 1.0
    assert value(samples, "broky_http_requests_total", method="post", code="405") == 1.0
    assert value(samples, "broky_http_requests_total", method="get", code="200") >= 2.0


def test_health_ready_and_errors(server: ServerProcess) -> None:
    assert get(server, "/healthz")[::2] == (200, b"ok\n")
    assert get(server, "/readyz")[::2] == (200, b"ok\n")
    assert get(server, "/metrics", "HEAD")[::2] == (200, b"")
    assert get(server, "/nope")[0] == 404
    assert get(server, "/metrics", "POST")[0] == 405
    assert get(server, "/debug/stats")[0] == 404  # /stats says it all
    for bad in ("x", "0", "-3"):
        status, ctype, body = get(server, f"/connections?limit={bad}")
        assert (status, ctype) == (400, "application/json") and b"limit must be a positive integer" in body


def test_a_limit_not_a_positive_integer_is_a_400_and_a_huge_one_is_clamped(server: ServerProcess) -> None:
    # Unicode digits pass str.isdigit() but not int(), nor do 4,301 digits or more pass
    # int(): both used to answer 500 and log a multi-kilobyte traceback.
    bad = ["%C2%B2", "%D9%A3", "1%C2%B2", "%EF%BC%95", "", "0", "0000", "-3", "%2B5", "5.0", "0x10", "%FF"]
    for path in ("/connections", "/topics"):
        for value_ in bad:
            status, ctype, body = get(server, f"{path}?limit={value_}")
            assert (status, ctype) == (400, "application/json"), (path, value_, status, body)
            error = json.loads(body)  # JSON, as every error of the HTTP server
            assert error["status"] == 400 and error["error"].startswith("limit must be a positive integer")
            assert len(body) < 200, body
        for huge, expected in (("9" * 4301, 1000), ("1" * 6000, 1000), ("0" * 6000 + "7", 7)):
            assert get_json(server, f"{path}?limit={huge}")["limit"] == expected
    status, _, body = get(server, "/connections?limit=" + "x" * 6000)
    assert status == 400 and len(body) < 200  # the value is quoted, cut short
    assert get(server, "/healthz")[0] == 200
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert max(len(line) for line in log.splitlines()) < 500


def test_an_oversized_request_head_gets_431(server: ServerProcess) -> None:
    with socket.create_connection((server.host, server.metrics_port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\nX-Filler: " + b"a" * 20_000 + b"\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 431 Request Header Fields Too Large\r\n"), answer[:200]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])  # every HTTP error is JSON (issue 25)
    assert body == {"error": "request head over 8192 bytes", "status": 431}
    assert get(server, "/healthz")[0] == 200  # and the server keeps serving


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
        assert w["latency_seconds"]["deliveries"] == 0
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
            # One observation per delivered message, each well under a second.
            assert value(s, "broky_broker_latency_seconds_count", worker="0") == n
            assert 0 < value(s, "broky_broker_latency_seconds_sum", worker="0") < n

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


def test_topics_are_exact_per_pattern_and_worker_busiest_first_and_bounded(server: ServerProcess) -> None:
    w0 = [Wire.hello(server.address, worker=0) for _ in range(3)]
    w1 = [Wire.hello(server.address, worker=1) for _ in range(2)]
    try:
        for w in w0:
            w.subscribe(1, b"a")
        w0[0].subscribe(2, b"b")
        w0[0].subscribe(3, b"b")  # subscriptions count sids: two on one connection count 2
        w1[0].subscribe(1, b"a")
        for w in w1:
            w.subscribe(2, b"c")
        for w in w0 + w1:
            w.flush()
        topics = get_json(server, "/topics")
        assert topics["total"] == 4 and topics["limit"] == 100 and topics["workers_up"] == 2
        assert topics["topics"] == [
            {"pattern": "a", "worker": 0, "subscriptions": 3},
            {"pattern": "b", "worker": 0, "subscriptions": 2},
            {"pattern": "c", "worker": 1, "subscriptions": 2},
            {"pattern": "a", "worker": 1, "subscriptions": 1},
        ]
        # Bounded, and still exact: summing each worker's top 1 would have said "a": 3
        # (worker 1's "a" is not in its top 1) and hidden that it is not the node's count.
        assert get_json(server, "/topics?limit=1")["topics"] == [
            {"pattern": "a", "worker": 0, "subscriptions": 3}
        ]
        assert get_json(server, "/topics?limit=1")["total"] == 4
        _, s = scrape(server)
        assert value(s, "broky_topics", worker="0") + value(s, "broky_topics", worker="1") == 4
        assert get_json(server, "/stats")["totals"]["topics"] == 4
        assert value(s, "broky_subscriptions", worker="0") == 5
        assert len(get_json(server, "/connections?limit=3")["connections"]) == 3
        assert get_json(server, "/connections?limit=3")["total"] == 5
    finally:
        for w in w0 + w1:
            w.close()


def test_slow_consumer_drops_are_counted(start_server: Any) -> None:
    server = start_server("--max-pending-bytes", "64K", "--replay-bytes", "0")  # (with a buffer: it lags)
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


def test_latency_histogram_counts_every_delivered_message(server: ServerProcess) -> None:
    n, subscribers = 100, 3
    subs = [Wire.hello(server.address, worker=0) for _ in range(subscribers)]
    try:
        for sub in subs:
            sub.subscribe(1, b"fan")
            sub.flush()
        with Wire.hello(server.address, worker=0) as pub:
            pub.send(b"".join(encode_message(KP0, b"fan", b"%d" % i) for i in range(n)))  # few reads
            pub.flush()
        assert all(len(sub.messages()) == n for sub in subs)
        _, s = scrape(server)
        delivered = value(s, "broky_messages_delivered_total", worker="0")
        assert delivered == n * subscribers
        # A read weighs as many messages as it delivered (counting reads would give at most n).
        assert value(s, "broky_broker_latency_seconds_count", worker="0") == delivered
        assert value(s, "broky_broker_latency_seconds_bucket", worker="0", le="+Inf") == delivered
        assert 0 < value(s, "broky_broker_latency_seconds_sum", worker="0") < delivered
        summary = get_json(server, "/stats")["workers"][0]["latency_seconds"]
        assert summary["deliveries"] == delivered and 0 < summary["mean"] < 1
    finally:
        for sub in subs:
            sub.close()


def test_slow_consumer_disconnect_is_counted(start_server: Any) -> None:
    server = start_server(
        "--max-pending-bytes", "64K", "--slow-consumer-deadline", "0.5", "--frame-timeout", "30",
        "--replay-bytes", "0",
    )  # fmt: skip
    with (
        Wire.hello(server.address, worker=0, name="stalled", rcvbuf=4096) as stalled,
        Wire.hello(server.address, worker=0) as pub,
    ):
        stalled.subscribe(1, b"k")
        stalled.flush()
        batch = encode_message(KP0, b"k", b"x" * 1000) * 1000  # about 1 MB; it never reads
        for _ in range(16):  # more than the socket buffers hold, then 64 KiB more
            pub.sock.sendall(batch)
        pub.flush(timeout=30)
        deadline = time.monotonic() + 10
        while value(s := scrape(server)[1], "broky_slow_consumer_disconnects_total", worker="0") == 0:
            assert time.monotonic() < deadline, "the stalled subscriber was not disconnected"
            time.sleep(0.1)
        frames = stalled.expect_closed(timeout=30)
    error = frames[-1]
    assert isinstance(error, Error) and error.code == ErrorCode.SLOW_CONSUMER and error.fatal
    # The drops not yet told come after every delivery: the fatal Error counts them (a resume
    # would replay them, schema/README.md 7), and no LossNotice precedes it.
    untold = re.search(r"(\d+) deliveries dropped since the last LossNotice", error.message or "")
    lost = sum(f.dropped for f in frames if isinstance(f, LossNotice)) + (int(untold[1]) if untold else 0)
    got = sum(1 for f in frames if isinstance(f, Message))
    _, s = scrape(server)
    # Published after the disconnect (the deadline may pass while publishing): nobody listened.
    unheard = value(s, "broky_messages_dropped_total", worker="0", reason="no_subscribers")
    assert lost > 0 and got + lost + unheard == 16_000
    assert value(s, "broky_slow_consumer_disconnects_total", worker="0") == 1
    assert value(s, "broky_messages_dropped_total", worker="0", reason="slow_consumer") == lost
    assert value(s, "broky_messages_delivered_total", worker="0") == got
    assert value(s, "broky_errors_sent_total", worker="0", code="slow_consumer") == 1
    assert value(s, "broky_slow_consumer_disconnects_total", worker="1") == 0


def test_deliveries_lost_to_a_shutdown_are_counted_as_shutdown(start_server: Any) -> None:
    # Documented: messages that cannot be delivered because the server stops are
    # dropped and counted under reason="shutdown". Here: deliveries kept for a
    # paused subscriber. A subscriber that does not read keeps the worker in its
    # shutdown (up to 4 s, waiting for its bytes to leave), so /metrics still answers.
    server = start_server("--max-pending-bytes", "1M")
    kept = 25
    stuck = Wire.hello(server.address, worker=0, name="stuck", rcvbuf=4096)
    paused = Wire.hello(server.address, worker=0, name="paused")
    try:
        stuck.subscribe(1, b"fill")
        stuck.flush()
        paused.subscribe(1, b"kept")
        paused.send(Pause())
        paused.flush()
        with Wire.hello(server.address, worker=0) as pub:
            batch = encode_message(KP0, b"fill", b"x" * 1000) * 1000
            for _ in range(8):
                pub.sock.sendall(batch)
            pub.send(b"".join(encode_message(KP0, b"kept", b"%d" % i) for i in range(kept)))
            pub.flush(timeout=30)
        lazy = next(c for c in get_json(server, "/connections")["connections"] if c["name"] == "paused")
        assert lazy["messages_out"] == kept and lazy["dropped"] == 0
        _, s = scrape(server)
        assert value(s, "broky_messages_dropped_total", worker="0", reason="shutdown") == 0
        server.signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while (
            value(s := scrape(server)[1], "broky_messages_dropped_total", worker="0", reason="shutdown") == 0
        ):
            assert time.monotonic() < deadline, "no shutdown drop counted"
            time.sleep(0.05)
        assert value(s, "broky_messages_dropped_total", worker="0", reason="shutdown") == kept
        frames = paused.expect_closed()
        assert not any(isinstance(f, Message) for f in frames) and isinstance(frames[-1], Goodbye)
    finally:
        stuck.close()
        paused.close()
    assert server.wait(10) == 0


def test_readyz_reports_a_hung_worker(server: ServerProcess) -> None:
    victim = get_json(server, "/stats")["workers"][1]["pid"]
    assert get(server, "/readyz")[0] == 200
    os.kill(victim, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 6
        while (ready := get(server, "/readyz"))[0] != 503:
            assert time.monotonic() < deadline, "/readyz still 200 with worker 1 stopped"
            time.sleep(0.1)
        assert ready[2] == b"workers silent for over 2 s: [1]\n"
        _, s = scrape(server)
        assert value(s, "broky_worker_up", worker="1") == 0 and value(s, "broky_worker_up", worker="0") == 1
        assert get(server, "/healthz")[0] == 200  # the process is alive, just not ready
    finally:
        os.kill(victim, signal.SIGCONT)
    deadline = time.monotonic() + 6
    while get(server, "/readyz")[0] != 200:
        assert time.monotonic() < deadline, "/readyz not 200 again after SIGCONT"
        time.sleep(0.1)
    assert value(scrape(server)[1], "broky_worker_up", worker="1") == 1


def test_endpoints_answer_within_one_deadline_however_many_workers_hang(start_server: Any) -> None:
    # Four workers hang: one 2 s deadline for all their answers, or 8 s if each had its own.
    server = start_server(workers=5)
    kp0 = kp_for_worker(0, 5)
    with Wire.hello(server.address, worker=0) as pub:
        for _ in range(7):
            pub.publish(kp0, b"nobody", b"x")
        pub.flush()
    stopped = [w["pid"] for w in get_json(server, "/stats")["workers"][1:]]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        for path in ("/metrics", "/stats"):
            started = time.monotonic()
            status, _, body = get(server, path)
            # One 2 s deadline for all the answers, not 2 s per hung worker (8 s): a bound
            # three times the one deadline, for a loaded machine.
            assert status == 200 and time.monotonic() - started < 6, path
        stats = json.loads(body)
        assert stats["totals"]["workers_up"] == 1
        assert [w["up"] for w in stats["workers"]] == [True, False, False, False, False]
        assert stats["totals"]["messages_published"] == 7
        _, s = scrape(server)
        assert [value(s, "broky_worker_up", worker=w) for w in "01234"] == [1, 0, 0, 0, 0]
        assert value(s, "broky_messages_published_total", worker="0") == 7
        assert value(s, "broky_messages_dropped_total", worker="0", reason="no_subscribers") == 7
        assert ("broky_messages_published_total", frozenset({("worker", "1")})) not in s
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20  # late answers to the old requests are ignored
    while [value(s := scrape(server)[1], "broky_worker_up", worker=w) for w in "01234"] != [1] * 5:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert [value(s, "broky_messages_published_total", worker=w) for w in "01234"] == [7, 0, 0, 0, 0]


def test_worker_stats_forgets_the_requests_it_stopped_waiting_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(master_module, "STATS_TIMEOUT", 0.1)

    async def main() -> None:
        master = master_module.Master(ServerConfig(workers=2))
        channels = [handoff.channel_pair() for _ in range(2)]
        workers = [SimpleNamespace(index=i, ready=True, chan=chan[0]) for i, chan in enumerate(channels)]
        master.supervisor = SimpleNamespace(workers=workers)  # type: ignore[assignment]

        def worker_0_answers() -> None:
            kind, payload, _, _ = handoff.recv(channels[0][1])
            request_id, what = handoff.split_id(payload)
            assert kind == handoff.STATS and what == b"topics:5"
            answer = handoff.pack_id(request_id) + b'{"answered": true}'
            master._on_worker_message(workers[0], handoff.STATS, answer)  # type: ignore[arg-type]

        asyncio.get_running_loop().call_later(0.01, worker_0_answers)
        try:
            started = time.monotonic()
            assert await master.worker_stats(b"topics:5") == [{"answered": True}, None]
            assert time.monotonic() - started < 1
            assert master._stats_waiters == {}  # worker 1's request is not kept forever
        finally:
            for pair in channels:
                for end in pair:
                    end.close()

    asyncio.run(main())


def test_the_producer_latency_histogram_counts_comparable_ts_producers(server: ServerProcess) -> None:
    # broky.server.histogram: ts_broker - ts_producer of each read's first Message, when the
    # clocks are comparable (1 s ahead to 60 s behind), for each message of the read; the others
    # counted as not comparable; no ts_producer: neither.
    with Wire.hello(server.address, worker=0, name="pub") as pub:
        _, s = scrape(server)
        assert value(s, "broky_producer_latency_seconds_count", worker="0") == 0
        assert value(s, "broky_producer_latency_not_comparable_total", worker="0") == 0
        ages = [0.020, -0.5, 120.0, -5.0]  # seconds behind the broker's clock (negative: ahead)
        for age in ages:  # one read each: the Pong comes back before the next publish
            pub.publish(KP0, b"p.k", b"x", ts_producer=time.time_ns() - int(age * 1e9))
            pub.flush()
        pub.send(b"".join(encode_message(KP0, b"p.k", b"%d" % i, ts_producer=0) for i in range(3)))
        pub.flush()
        _, s = scrape(server)
        assert value(s, "broky_messages_published_total", worker="0") == 7
        assert value(s, "broky_producer_latency_not_comparable_total", worker="0") == 2  # 120 s, -5 s
        assert value(s, "broky_producer_latency_seconds_count", worker="0") == 2  # 20 ms; -0.5 s as 0
        bucket = {le: value(s, "broky_producer_latency_seconds_bucket", worker="0", le=le) for le in (
            "8.192e-06", "0.016777216", "0.033554432", "+Inf")}  # fmt: skip
        assert bucket == {"8.192e-06": 1, "0.016777216": 1, "0.033554432": 2, "+Inf": 2}
        assert 0.020 <= value(s, "broky_producer_latency_seconds_sum", worker="0") < 0.0336
        summary = get_json(server, "/stats")["workers"][0]["producer_latency_seconds"]
        assert (summary["messages"], summary["not_comparable"]) == (2, 2)
        assert summary["p99_le"] == 0.033554432
