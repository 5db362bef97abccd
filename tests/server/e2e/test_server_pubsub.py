"""Pub/sub through a real `broky serve`, on the wire (tests/support/wire.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from broky.errors import ErrorCode
from broky.protocol import Error, LossNotice, Message, Pause, Ping, Pong, Resume, encode_message, new_ksuid
from tests.support.http import debug_stats, http_get
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)
KP1 = kp_for_worker(1, 2)


def test_ready_line_healthz_and_welcome(server: ServerProcess) -> None:
    assert server.ready_line.startswith(b"broky ready: listening on 127.0.0.1:")
    assert f"workers 2, pid {server.pid}".encode() in server.ready_line
    assert http_get(server, "/healthz") == (200, b"ok\n")
    assert http_get(server, "/nope")[0] == 404
    ids = set()
    for worker in (0, 1, -1):
        with Wire.hello(server.address, worker=worker) as w:
            welcome = w.welcome
            assert welcome is not None
            assert welcome.worker == worker or worker == -1
            assert welcome.map.version == 1
            assert welcome.map.owners[0] == (0, 0) and welcome.map.owners[1023] == (0, 1)
            assert welcome.map.nodes[0].port == server.port
            assert welcome.max_frame_bytes == 1 << 20
            assert welcome.max_pending_bytes == 4 << 20
            ids.add(welcome.connection_id)
    assert len(ids) == 3


def test_exact_and_wildcard_matches_travel_once(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as other:
        sub.subscribe(1, b"orders.eu")
        sub.subscribe(2, b"orders.*")
        sub.subscribe(3, b"orders.>")
        other.subscribe(9, b"*.eu.*")
        assert sub.flush() == [] and other.flush() == []
        with Wire.hello(server.address, worker=0) as pub:
            for key in (b"orders.eu", b"orders.us", b"orders.eu.paris", b"orders", b"trades.eu", b"x.eu.y"):
                pub.publish(KP0, key, b"p:" + key)
            assert pub.flush() == []
        assert [m.key for m in sub.messages()] == [b"orders.eu", b"orders.us", b"orders.eu.paris"]
        assert [m.key for m in other.messages()] == [b"orders.eu.paris", b"x.eu.y"]


def test_delivery_is_the_published_message_with_ts_broker(server: ServerProcess) -> None:
    uid = new_ksuid()
    with Wire.hello(server.address, worker=1) as sub, Wire.hello(server.address, worker=1) as pub:
        sub.subscribe(1, b"k")
        sub.flush()
        before = time.time_ns()
        pub.publish(KP1, b"k", b"\x00payload\xff" * 10, ts_producer=123, uid=uid)
        pub.publish(KP1, b"k", b"")
        pub.flush()
        after = time.time_ns()
        first, second = sub.messages()
    assert (first.key_partition, first.key, first.payload) == (KP1, b"k", b"\x00payload\xff" * 10)
    assert first.ts_producer == 123 and first.uid == uid
    assert before <= first.ts_broker <= after
    assert second.payload == b"" and second.uid is None and second.ts_broker >= first.ts_broker


def test_partition_scoped_and_all_partition(server: ServerProcess) -> None:
    kp_a = kp_for_worker(0, 2, "a")
    kp_b = kp_for_worker(0, 2, "b")
    with (
        Wire.hello(server.address, worker=0) as scoped,
        Wire.hello(server.address, worker=0) as everyone,
        Wire.hello(server.address, worker=0) as both,
        Wire.hello(server.address, worker=0) as pub,
    ):
        scoped.subscribe(1, b"t.>", kp_a)
        everyone.subscribe(1, b"t.>")
        both.subscribe(1, b"t.>", kp_a)
        both.subscribe(2, b"t.*")
        for w in (scoped, everyone, both):
            assert w.flush() == []
        pub.publish(kp_a, b"t.1", b"a")
        pub.publish(kp_b, b"t.1", b"b")
        pub.publish(kp_a, b"t.1.2", b"a2")
        pub.flush()
        assert [m.payload for m in scoped.messages()] == [b"a", b"a2"]
        assert [m.payload for m in everyone.messages()] == [b"a", b"b", b"a2"]
        assert [m.payload for m in both.messages()] == [b"a", b"b", b"a2"]  # once each


def test_all_partition_subscription_covers_its_worker_only(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as sub0, Wire.hello(server.address, worker=1) as sub1:
        sub0.subscribe(1, b"k")
        sub1.subscribe(1, b"k")
        sub0.flush()
        sub1.flush()
        with Wire.hello(server.address, worker=1) as pub:
            pub.publish(KP1, b"k", b"one")
            pub.flush()
        assert [m.payload for m in sub1.messages()] == [b"one"]
        assert sub0.messages() == []


def test_order_per_key_partition(server: ServerProcess) -> None:
    kps = [kp_for_worker(0, 2, f"p{i}") for i in range(3)]
    n = 3000
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as pub:
        sub.subscribe(1, b"seq.>")
        sub.flush()
        from broky.protocol import encode_message

        batch = b"".join(
            encode_message(kps[i % 3], b"seq.%d" % (i % 7), b"%d" % i) for i in range(n)
        )  # several frames per TCP write, split anywhere
        for start in range(0, len(batch), 1000):
            pub.sock.sendall(batch[start : start + 1000])
        pub.flush()
        got = sub.messages()
    assert len(got) == n
    for i, kp in enumerate(kps):
        assert [int(m.payload) for m in got if m.key_partition == kp] == list(range(i, n, 3))


def test_not_my_vbucket_on_publish_and_scoped_subscribe(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as w:
        w.subscribe(5, b"k", KP1)
        w.subscribe(6, b"k")  # all-partition: fine on any worker
        w.publish(KP1, b"k", b"lost")
        w.publish(KP0, b"k", b"kept")
        frames = w.flush()
    assert isinstance(frames[0], Error) and frames[0].code == ErrorCode.NOT_MY_VBUCKET
    assert frames[0].sid == 5 and frames[0].map_version == 1 and not frames[0].fatal
    assert isinstance(frames[1], Error) and frames[1].code == ErrorCode.NOT_MY_VBUCKET
    assert frames[1].sid == 0 and not frames[1].fatal
    assert frames[0].refused is None  # a subscription is not returned, a publish is, byte for byte:
    assert frames[1].refused == encode_message(KP1, b"k", b"lost", 0, 0, None)
    assert isinstance(frames[2], Message) and frames[2].payload == b"kept"  # still open
    assert len(frames) == 3
    stats = debug_stats(server)["workers"][0]
    assert stats["dropped"]["not_my_vbucket"] == 1


def test_subscription_errors_are_not_fatal(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as w:
        w.subscribe(1, b"a")
        w.subscribe(1, b"b")
        w.subscribe(2, b"a.>.b")
        w.subscribe(3, b"a..b")
        w.subscribe(0, b"a")  # sid 0 is reserved: an Error's sid 0 means "no subscription"
        w.unsubscribe(42)
        codes = [(f.code, f.sid) for f in w.flush() if isinstance(f, Error)]
        assert codes == [
            (ErrorCode.DUPLICATE_SID, 1),
            (ErrorCode.BAD_PATTERN, 2),
            (ErrorCode.BAD_PATTERN, 3),
            (ErrorCode.BAD_SID, 0),
            (ErrorCode.UNKNOWN_SID, 42),
        ]
        w.publish(KP0, b"a")
        w.unsubscribe(1)
        w.publish(KP0, b"a")
        assert len(w.messages()) == 1


def test_unmatched_messages_are_counted(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=1) as pub:
        for _ in range(5):
            pub.publish(KP1, b"nobody.listens")
        pub.flush()
    stats = debug_stats(server)
    w1 = stats["workers"][1]
    assert w1["dropped"]["no_subscribers"] == 5
    assert w1["messages_published"] == 5 and w1["messages_delivered"] == 0
    assert stats["workers"][0]["dropped"]["no_subscribers"] == 0


def test_pause_keeps_and_resume_delivers(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as pub:
        sub.subscribe(1, b"k")
        sub.send(Pause())
        assert sub.flush() == []  # Pong is not kept back
        for i in range(3):
            pub.publish(KP0, b"k", b"%d" % i)
        pub.flush()
        sub.expect_silence()
        sub.send(Resume())
        assert [m.payload for m in sub.messages()] == [b"0", b"1", b"2"]


def test_a_pong_queued_before_a_pause_in_the_same_read_is_not_kept_back(server: ServerProcess) -> None:
    """Ping then Pause in one write: the Pong was queued before the Pause and is a reply,
    so it goes out (kept back, a client flushing before it pauses would wait for ever)."""
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as pub:
        sub.subscribe(1, b"k")
        assert sub.flush() == []
        sub.send(Ping(7), Pause())  # one sendall: one read on the server
        assert sub.expect(Pong, timeout=2).id == 7
        pub.publish(KP0, b"k", b"kept")
        pub.flush()
        sub.expect_silence()
        sub.send(Resume())
        assert [m.payload for m in sub.messages()] == [b"kept"]


@pytest.mark.parametrize("limit", ["64K"])
def test_paused_subscriber_over_the_bound_is_told_what_it_lost(start_server: Any, limit: str) -> None:
    server = start_server("--max-pending-bytes", limit, "--replay-bytes", "0")  # (with a buffer: it lags)
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as pub:
        sub.subscribe(1, b"k")
        sub.send(Pause())
        sub.flush()
        n = 2000  # ~ 100 bytes each: 200 KB > 64 KiB
        for i in range(n):
            pub.publish(KP0, b"k", b"%d" % i)
        pub.flush()
        sub.send(Resume())
        frames = sub.flush()
    msgs = [f for f in frames if isinstance(f, Message)]
    notices = [f for f in frames if isinstance(f, LossNotice)]
    assert len(notices) == 1 and frames[-1] == notices[0]
    assert len(msgs) + notices[0].dropped == n
    assert [int(m.payload) for m in msgs] == list(range(len(msgs)))  # the first ones, in order
    assert sum(len(b"") + 104 for _ in msgs) <= 64 * 1024
    assert debug_stats(server)["workers"][0]["dropped"]["slow_consumer"] == notices[0].dropped
