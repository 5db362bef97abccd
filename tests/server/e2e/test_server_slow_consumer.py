"""Slow consumers and the topic table, against a real `broky serve`."""

from __future__ import annotations

import re
import select
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broky.errors import ErrorCode
from broky.protocol import (
    Error,
    LossNotice,
    LossReason,
    Message,
    Ping,
    Pong,
    PreviousConnection,
    Subscribe,
    Unsubscribe,
    encode_frame,
    encode_message,
)
from tests.support.http import debug_stats
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)
KP1 = kp_for_worker(1, 2)


def rss(pid: int) -> int:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * 4096


class ByteCounter(threading.Thread):
    """Reads a socket as fast as it can and counts bytes, until `target` or EOF."""

    def __init__(self, wire: Wire, target: int) -> None:
        super().__init__(daemon=True)
        self.wire = wire
        self.target = target
        self.count = 0
        self.head = b""

    def run(self) -> None:
        self.wire.sock.settimeout(60)
        while self.count < self.target:
            data = self.wire.sock.recv(1 << 20)
            if not data:
                return
            if len(self.head) < 4096:
                self.head += data[:4096]
            self.count += len(data)


# Ten times what publishing the test's million messages takes (half a second on an idle 2-core
# machine), so that the stalled subscriber is still subscribed when the last one is routed.
STALL_DEADLINE = 5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stalled_subscriber_is_bounded_told_and_disconnected(start_server: Any) -> None:
    server: ServerProcess = start_server(
        "--max-pending-bytes", "4M", "--slow-consumer-deadline", str(STALL_DEADLINE), "--frame-timeout", "60",
        "--replay-bytes", "0",  # it drops (with a replay buffer it lags: tests/server/e2e/test_server_lag.py)
    )  # fmt: skip
    n = 1_000_000
    frame = encode_message(KP0, b"t.x", b"p" * 8 + bytes(8))
    at = frame.index(b"p" * 8) + 8  # the payload's last 8 bytes carry a sequence number
    head, tail = frame[:at], frame[at + 8 :]
    with (
        Wire.hello(server.address, worker=0) as fast,
        Wire.hello(server.address, worker=0, rcvbuf=8192) as slow,
    ):
        fast.subscribe(1, b"t.*")
        slow.subscribe(1, b"t.>")
        fast.flush()
        slow.flush()
        worker = debug_stats(server)["workers"][0]["pid"]
        baseline = rss(worker)
        peak = baseline
        counter = ByteCounter(fast, n * len(frame))
        counter.start()
        started = time.monotonic()
        with Wire.hello(server.address, worker=0) as pub:
            for i in range(n // 1000):
                pub.sock.sendall(
                    b"".join(head + j.to_bytes(8, "big") + tail for j in range(i * 1000, i * 1000 + 1000))
                )
                if i % 50 == 0:
                    peak = max(peak, rss(worker))
                # The fast reader (a thread of this process) keeps up: never 2 MiB behind the
                # publisher, half its bound, however loaded the machine (a drop would be right).
                sent = (i + 1) * 1000 * len(frame)
                while sent - counter.count > 2 << 20 and counter.is_alive():
                    time.sleep(0.001)
            pub.flush(timeout=120)
        published_in = time.monotonic() - started
        print(f"\npublished {n} messages in {published_in:.1f} s")
        # Every message was routed to the stalled subscriber too: it was not cut off yet.
        assert debug_stats(server)["workers"][0]["slow_consumer_disconnects"] == 0, (
            f"publishing took {published_in:.1f} s, past the {STALL_DEADLINE} s deadline"
        )
        counter.join(60)
        peak = max(peak, rss(worker))

        # Every message reached the fast subscriber, in full and nothing else.
        assert counter.count == n * len(frame)
        assert counter.head.startswith(frame[:60])
        # The server's memory stayed bounded (120 MB were published to each subscriber).
        assert peak - baseline < 48 << 20, (baseline, peak)

        # The stalled one stays stalled past the deadline: reading it earlier would let it
        # drain and stop its clock.
        deadline = time.monotonic() + STALL_DEADLINE + 30
        while debug_stats(server)["workers"][0]["slow_consumer_disconnects"] == 0:
            assert time.monotonic() < deadline, "the stalled subscriber was not disconnected"
            time.sleep(0.1)
        # What was pending, then the fatal error, which counts the drops. They came after
        # everything it was sent (nothing is queued from a drop until it is told), so no
        # LossNotice precedes the Error: a resume by positions would replay them.
        frames = slow.expect_closed(timeout=30)
        notices = [f for f in frames if isinstance(f, LossNotice)]
        seqs = [int.from_bytes(f.payload[-8:], "big") for f in frames if isinstance(f, Message)]
        got = len(seqs)
        error = frames[-1]
        assert isinstance(error, Error) and error.code == ErrorCode.SLOW_CONSUMER and error.fatal
        assert notices == []
        found = re.search(r"(\d+) deliveries dropped since the last LossNotice", error.message or "")
        assert found is not None, error.message
        dropped = int(found[1])
        assert dropped > 0
        assert got * len(frame) <= (4 << 20) + (4 << 20)  # the bound plus what the kernel buffers held
        assert seqs == sorted(set(seqs)) and seqs[-1] < n  # in order, no copies, nothing made up
        # The drops are one run after the last delivery: the sequence numbers it missed.
        assert seqs == list(range(got)) and got + dropped == n
        stats = debug_stats(server)["workers"][0]
        assert stats["slow_consumer_disconnects"] == 1
        assert stats["dropped"]["slow_consumer"] == dropped
        assert stats["messages_delivered"] == n + got
        # A client that reconnects without positions is told them, exactly, by the account.
        assert slow.welcome is not None
        previous = PreviousConnection(slow.welcome.connection_id, got, 0, slow.welcome.resume_token)
        with Wire.hello(server.address, worker=0, previous=previous) as again:
            told = again.expect(LossNotice)
            assert (told.dropped, told.reason) == (dropped, LossReason.SLOW_CONSUMER)


@pytest.mark.slow
def test_topic_table_is_empty_after_100k_subscribe_unsubscribe_cycles(server: ServerProcess) -> None:
    template = encode_frame(Subscribe(1, b"topic.000000.*"))
    unsubscribe = encode_frame(Unsubscribe(1))

    def cycles(start: int, stop: int) -> bytes:
        return b"".join(
            template.replace(b"topic.000000.*", b"topic.%06d.*" % i) + unsubscribe for i in range(start, stop)
        )

    kp_topic = encode_message(KP0, b"topic.000001.x", b"m")
    with Wire.hello(server.address, worker=0) as w:
        w.send(cycles(0, 10_000))  # warm up the allocator
        w.flush(timeout=60)
        before = debug_stats(server)["workers"][0]
        for start in range(0, 100_000, 10_000):
            w.send(cycles(start, start + 10_000))
            w.send(template.replace(b"topic.000000.*", b"topic.000001.*"), kp_topic, unsubscribe)
            assert [m.payload for m in w.messages(timeout=60)] == [b"m"]
        during = debug_stats(server)["workers"][0]
        # Many subscriptions on one connection, then a disconnect: also leaves no trace.
        w.send(*(Subscribe(sid, b"conn.%d.>" % sid) for sid in range(1, 2001)))
        w.flush()
        assert debug_stats(server)["workers"][0]["topics"] == 2000
    deadline = time.monotonic() + 5
    while (after := debug_stats(server)["workers"][0])["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    for snap in (during, after):
        assert snap["topics"] == 0 and snap["subscriptions"] == 0 and snap["matcher_empty"]
    assert after["connections"] == 0
    assert after["rss_bytes"] - before["rss_bytes"] < 8 << 20, (before["rss_bytes"], after["rss_bytes"])


def test_a_subscriber_that_falls_behind_is_told_what_it_lost_and_stays(start_server: Any) -> None:
    server = start_server("--max-pending-bytes", "64K", "--replay-bytes", "0")  # (with a buffer: it lags)
    n = 20_000  # 20 MB for a subscriber that reads nothing meanwhile: most are dropped
    with (
        Wire.hello(server.address, worker=0, rcvbuf=4096) as sub,
        Wire.hello(server.address, worker=0) as pub,
    ):
        sub.subscribe(1, b"k")
        sub.flush()
        pub.sock.sendall(b"".join(encode_message(KP0, b"k", b"%06d" % i + b"x" * 994) for i in range(n)))
        assert pub.flush(timeout=60) == []
        # It reads now: what was queued, then (once drained) how many it lost.
        got: list[int] = []
        lost = 0
        while len(got) + lost < n:
            frame = sub.next(timeout=10)
            if isinstance(frame, LossNotice):
                lost += frame.dropped
            else:
                assert isinstance(frame, Message), frame
                got.append(int(frame.payload[:6]))
        assert isinstance(frame, LossNotice)  # the last word
        assert 0 < len(got) < n and got == sorted(set(got))  # in order, no duplicates
        stats = debug_stats(server)["workers"][0]
        assert stats["dropped"]["slow_consumer"] == lost == n - len(got)
        assert stats["slow_consumer_disconnects"] == 0
        # Still connected, and caught up: the next message arrives and nothing else.
        pub.publish(KP0, b"k", b"after")
        assert pub.flush() == []
        assert [m.payload for m in sub.messages()] == [b"after"]


@pytest.mark.parametrize("flood", ["pings", "misrouted publishes"])
def test_a_client_that_never_reads_its_replies_is_read_no_more(start_server: Any, flood: str) -> None:
    server = start_server(
        "--max-pending-bytes", "1M", "--slow-consumer-deadline", "2", "--frame-timeout", "30"
    )
    # A misrouted publish gets a NOT_MY_VBUCKET Error, larger than the publish.
    chunk = encode_frame(Ping(7)) * 10_000 if flood == "pings" else encode_message(KP1, b"k", b"x") * 3_000
    worker = debug_stats(server)["workers"][0]["pid"]
    baseline = rss(worker)
    limit = 64 << 20
    with Wire.hello(server.address, worker=0, rcvbuf=4096) as w:
        w.sock.setblocking(False)
        sent = at = 0  # `at`: where in `chunk` a partial send stopped (frames stay whole)
        view = memoryview(chunk)
        while sent < limit:  # until the socket stays full for a second: TCP back-pressure
            if not select.select([], [w.sock], [], 1.0)[1]:
                break
            try:
                n = w.sock.send(view[at:])
            except BlockingIOError:
                continue
            sent += n
            at = (at + n) % len(chunk)
        grown = rss(worker) - baseline
        assert sent < limit, "the server kept reading"
        assert grown < 16 << 20, (baseline, grown)
        # Everyone else is served meanwhile.
        with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as pub:
            sub.subscribe(1, b"other")
            sub.flush()
            pub.publish(KP0, b"other", b"fine")
            assert pub.flush() == []
            assert [m.payload for m in sub.messages()] == [b"fine"]
        # Over the bound past the deadline (2 s): closed as a slow consumer, after its replies.
        deadline = time.monotonic() + 10
        while debug_stats(server)["workers"][0]["slow_consumer_disconnects"] == 0:
            assert time.monotonic() < deadline, "not closed"
            time.sleep(0.1)
        frames = w.expect_closed(timeout=30)
    last = frames[-1]
    assert isinstance(last, Error) and last.code == ErrorCode.SLOW_CONSUMER and last.fatal
    assert frames[:-1] and all(isinstance(f, Pong | Error) for f in frames[:-1])


def test_large_unique_keys_do_not_stay_in_the_route_caches(start_server: Any) -> None:
    server = start_server("--replay-bytes", "4M", workers=1)
    kp = kp_for_worker(0, 1)
    filler = b"x" * 200_000

    def publish_unique(pub: Wire, start: int, count: int) -> None:
        for i in range(start, start + count):
            pub.publish(kp, b"big.%06d." % i + filler)
        assert pub.flush(timeout=30) == []

    with Wire.hello(server.address) as sub, Wire.hello(server.address) as pub:
        sub.subscribe(1, b"wide.*")
        sub.subscribe(2, b"big.*")  # matches none of them (three tokens): the matcher is asked
        sub.flush()
        worker = debug_stats(server)["workers"][0]["pid"]
        publish_unique(pub, 0, 20)  # warm up the allocator
        before = rss(worker)
        publish_unique(pub, 20, 250)  # 50 MB of distinct keys
        after = rss(worker)
        assert after - before < (20 + 4) << 20, (before, after)  # and the replay buffer's 4 MiB
        stats = debug_stats(server)["workers"][0]
        assert stats["match_cache_entries"] == 0 and stats["dropped"]["no_subscribers"] == 270
        # Big keys are still routed (each time anew).
        for _ in range(2):
            pub.publish(kp, b"wide." + filler, b"big one")
        assert pub.flush() == []
        assert [m.payload for m in sub.messages()] == [b"big one"] * 2
