"""A reader that stops reading lags and catches up from the replay buffer (schema/README.md 7).

A real `broky serve`, a publisher at a steady 20,000 msgs/s (the SDK, in a thread) and a
raw-socket subscriber to `>` that stops reading for a while, then reads on: it must
receive every message once, in order per key_partition, with nothing told, when the
buffer held what it missed; and be told exactly what the buffer evicted (EVICTED, sid 0,
per vbucket), then get the rest and live messages, when it did not.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import defaultdict
from typing import Any

import pytest

import broky
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
    encode_message,
    vbucket_of,
)
from tests.support.http import debug_stats
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire

SEQ = struct.Struct(">II")  # key_partition index, sequence number within it
PARTITIONS = 16


class PacedPublisher(threading.Thread):
    """Publishes `rate` messages a second for `seconds`, sequence-numbered per key_partition."""

    def __init__(self, server: ServerProcess, rate: int, seconds: float, size: int = 100) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.rate = rate
        self.seconds = seconds
        self.padding = bytes(size)
        self.sent = [0] * PARTITIONS
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with broky.connect_sync(self.server.url) as client:
                start = time.monotonic()
                total = int(self.rate * self.seconds)
                for i in range(total):
                    k = i % PARTITIONS
                    client.publish(
                        b"lag.k", SEQ.pack(k, self.sent[k]) + self.padding, partition=b"lag-%d" % k
                    )
                    self.sent[k] += 1
                    if i % 200 == 199:  # paced in steps of 10 ms
                        ahead = start + (i + 1) / self.rate - time.monotonic()
                        if ahead > 0:
                            time.sleep(ahead)
                client.flush()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def by_vbucket(self) -> dict[int, int]:
        counts: dict[int, int] = defaultdict(int)
        for k, n in enumerate(self.sent):
            counts[vbucket_of(b"lag-%d" % k)] += n
        return counts


def read_all(
    w: Wire, until: Any, timeout: float = 60.0
) -> tuple[list[Message], list[LossNotice], list[Pong]]:
    """Read frames until `until(messages, notices)` holds."""
    messages: list[Message] = []
    notices: list[LossNotice] = []
    pongs: list[Pong] = []
    deadline = time.monotonic() + timeout
    while not until(messages, notices):
        frame = w.next(max(0.1, deadline - time.monotonic()))
        if isinstance(frame, Message):
            messages.append(frame)
        elif isinstance(frame, LossNotice):
            notices.append(frame)
        elif isinstance(frame, Pong):
            pongs.append(frame)
        else:
            raise AssertionError(f"unexpected {frame!r}")
    return messages, notices, pongs


def in_order(messages: list[Message]) -> dict[int, list[int]]:
    seqs: dict[int, list[int]] = defaultdict(list)
    for m in messages:
        k, n = SEQ.unpack_from(m.payload)
        seqs[k].append(n)
    return seqs


@pytest.mark.timeout(90)
def test_a_reader_that_stops_for_5_s_at_20000_msgs_a_second_gets_everything(start_server: Any) -> None:
    server: ServerProcess = start_server("--workers", "1", "--max-pending-bytes", "1M")
    with Wire.hello(server.address, rcvbuf=16384) as w:
        w.send(Subscribe(1, b">"))
        w.flush()
        publisher = PacedPublisher(server, 20_000, 7.0)
        publisher.start()
        time.sleep(5.0)  # reads nothing meanwhile
        w.send(Ping(999))
        total = 140_000
        messages, notices, pongs = read_all(w, lambda m, n: len(m) + sum(x.dropped for x in n) >= total)
        publisher.join(30)
        assert publisher.error is None
        assert sum(publisher.sent) == total
    assert notices == []  # nothing lost
    assert len(messages) == total
    for k, seqs in in_order(messages).items():
        assert seqs == list(range(publisher.sent[k])), k  # each once, in order
    assert any(p.id == 999 and p.behind > 0 for p in pongs)  # it was told it is behind
    stats = debug_stats(server)["totals"]
    assert stats["lag_entered"] >= 1 and stats["lag_served"] > 0
    assert stats["dropped"]["slow_consumer"] == 0 and stats["dropped"]["evicted"] == 0


@pytest.mark.timeout(90)
def test_a_reader_that_stops_for_longer_than_the_buffer_is_told_exactly_then_is_live(
    start_server: Any,
) -> None:
    server: ServerProcess = start_server(
        "--workers", "1", "--max-pending-bytes", "256K", "--replay-bytes", "1M"
    )
    with Wire.hello(server.address, rcvbuf=16384) as w:
        w.send(Subscribe(1, b">"))
        w.flush()
        publisher = PacedPublisher(server, 20_000, 3.0)
        publisher.start()
        publisher.join(30)  # it reads nothing meanwhile: 60,000 messages, the buffer holds ~4,000
        assert publisher.error is None
        total = sum(publisher.sent)
        messages, notices, _ = read_all(w, lambda m, n: len(m) + sum(x.dropped for x in n) >= total)
        assert notices, "the stall outlasted the buffer"
        told: dict[int, int] = defaultdict(int)
        for n in notices:
            assert n.reason == LossReason.EVICTED and n.sid == 0 and n.dropped > 0
            assert n.at is not None and n.through is not None
            assert n.through.offset - n.at.offset + 1 == n.dropped  # a `>` reader: every offset of the gap
            told[n.at.vbucket] += n.dropped
        got: dict[int, int] = defaultdict(int)
        for m in messages:
            got[m.vbucket] += 1
        for vb, published in publisher.by_vbucket().items():
            assert got[vb] + told[vb] == published, vb  # received + told == published, per vbucket
        for seqs in in_order(messages).values():
            assert seqs == sorted(set(seqs))  # in order, no copy
        # Live again: what is published now comes at once, nothing more told.
        live = PacedPublisher(server, 5_000, 0.2)
        live.start()
        live.join(30)
        after, more, _ = read_all(w, lambda m, n: len(m) >= sum(live.sent) or bool(n), timeout=20)
        assert more == [] and len(after) == sum(live.sent)
    stats = debug_stats(server)["totals"]
    assert stats["dropped"]["evicted"] == sum(told.values()) == stats["lag_evicted"]
    assert stats["lagging"] == 0


@pytest.mark.timeout(90)
def test_a_reader_that_never_reads_is_cut_once_it_cannot_catch_up_and_its_account_tells_the_rest(
    start_server: Any,
) -> None:
    # It lags, costs its position and what its socket holds, and once the buffer has
    # evicted the oldest it was owed and it read nothing for the deadline, it is cut. A
    # client that comes back without positions is told exactly what it never got.
    server: ServerProcess = start_server(
        "--workers",
        "1",
        "--max-pending-bytes",
        "256K",
        "--replay-bytes",
        "1M",
        "--slow-consumer-deadline",
        "1",
    )
    n = 20_000
    with Wire.hello(server.address, rcvbuf=4096) as stalled, Wire.hello(server.address) as pub:
        stalled.send(Subscribe(1, b"t.>"))
        stalled.flush()
        for i in range(0, n, 1000):
            pub.send(
                b"".join(encode_message(b"kp", b"t.x", b"%08d" % j + bytes(200)) for j in range(i, i + 1000))
            )
        pub.flush(timeout=30)
        deadline = time.monotonic() + 30
        while debug_stats(server)["totals"]["slow_consumer_disconnects"] == 0:
            assert time.monotonic() < deadline, "the stalled reader was not cut"
            time.sleep(0.1)
        frames = stalled.expect_closed(timeout=30)
        got = [int(f.payload[:8]) for f in frames if isinstance(f, Message)]
        error = frames[-1]
        assert isinstance(error, Error) and error.code == ErrorCode.SLOW_CONSUMER and error.fatal
        assert "can no longer catch up" in (error.message or "")
        assert got == list(range(len(got)))  # in order, from the first
        assert stalled.welcome is not None
        previous = PreviousConnection(
            stalled.welcome.connection_id, len(got), 0, stalled.welcome.resume_token
        )
        with Wire.hello(server.address, previous=previous) as again:
            told = again.expect(LossNotice)
            assert (told.dropped, told.reason) == (n - len(got), LossReason.SLOW_CONSUMER)
    stats = debug_stats(server)["totals"]
    assert stats["lagging"] == 0
