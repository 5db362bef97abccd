"""Per-connection limits against a real `broky serve`: subscriptions (count and
bytes), unread replies, and the worker's memory after a subscription flood."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broky.errors import ErrorCode
from broky.protocol import (
    NEED_DATA,
    Error,
    FrameReader,
    Ping,
    Pong,
    Subscribe,
    decode_frame,
    encode_frame,
    encode_message,
)
from tests.support.http import debug_stats, get_json, scrape, value
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP0 = kp_for_worker(0, 2)
MB = 1 << 20


def rss(pid: int) -> int:
    """Resident bytes of a process (/proc/<pid>/statm)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096


def worker0(server: ServerProcess) -> dict[str, Any]:
    return debug_stats(server)["workers"][0]  # type: ignore[no-any-return]


def limit_error(frames: list[Any], sid: int) -> Error:
    """The one frame, a non-fatal SUBSCRIPTION_LIMIT Error for `sid`."""
    assert len(frames) == 1, frames
    err = frames[0]
    assert isinstance(err, Error), err
    assert (err.code, err.fatal, err.sid) == (ErrorCode.SUBSCRIPTION_LIMIT, False, sid), err
    return err


def test_over_the_subscription_count_a_subscribe_is_refused_and_the_connection_stays(
    start_server: Any,
) -> None:
    server = start_server("--max-subscriptions", "3")
    with Wire.hello(server.address, worker=0) as w, Wire.hello(server.address, worker=0) as pub:
        for sid in (1, 2, 3):
            w.subscribe(sid, b"lim.%d" % sid)
        assert w.flush() == []
        w.subscribe(4, b"lim.4")
        message = limit_error(w.flush(), 4).message or ""
        assert "holds 3 subscriptions, max_subscriptions is 3" in message, message
        # Nothing was created for sid 4; the others still deliver.
        pub.publish(KP0, b"lim.4", b"no")
        pub.publish(KP0, b"lim.1", b"yes")
        assert pub.flush() == []
        assert [m.payload for m in w.messages()] == [b"yes"]
        # Room again after an Unsubscribe: the same sid is accepted.
        w.unsubscribe(1)
        w.subscribe(4, b"lim.4")
        assert w.flush() == []
        pub.publish(KP0, b"lim.4", b"now")
        assert pub.flush() == []
        assert [m.payload for m in w.messages()] == [b"now"]
        stats = worker0(server)
        assert stats["subscriptions"] == 3
        assert stats["errors"]["SUBSCRIPTION_LIMIT"] == 1
        assert stats["subscriptions_refused"] == {"count": 1, "bytes": 0}
        _, samples = scrape(server)
        assert value(samples, "broky_subscriptions_refused_total", worker="0", reason="count") == 1
        assert value(samples, "broky_subscriptions_refused_total", worker="0", reason="bytes") == 0
        assert value(samples, "broky_errors_sent_total", worker="0", code="subscription_limit") == 1
    warnings = [line for line in server.log().splitlines() if "SUBSCRIPTION_LIMIT" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings


def test_over_the_subscription_bytes_a_subscribe_is_refused(start_server: Any) -> None:
    server = start_server("--max-subscription-bytes", "1000")
    big = b"b." + b"x" * 400  # 402 bytes, 2 tokens: 402 + 2 * 64 = 530
    first = 530 + len(KP0)  # the key_partition counts too
    with Wire.hello(server.address, worker=0) as w, Wire.hello(server.address, worker=0) as pub:
        w.subscribe(1, big, key_partition=KP0)
        assert w.flush() == []
        w.subscribe(2, b"c." + b"y" * 400)
        message = limit_error(w.flush(), 2).message or ""
        assert f"holds {first} subscription bytes, this one is 530" in message, message
        assert "max_subscription_bytes is 1000" in message
        w.subscribe(3, b"small")  # 5 + 64 still fits
        assert w.flush() == []
        pub.publish(KP0, b"c." + b"y" * 400, b"refused")
        pub.publish(KP0, big, b"big")
        pub.publish(KP0, b"small", b"small")
        assert pub.flush() == []
        assert [m.payload for m in w.messages()] == [b"big", b"small"]
        stats = worker0(server)
        assert stats["subscription_bytes"] == first + 69
        assert stats["subscriptions_refused"] == {"count": 0, "bytes": 1}
        conn = next(c for c in get_json(server, "/connections")["connections"] if c["subscriptions"])
        assert conn["subscription_bytes"] == first + 69
        w.unsubscribe(1)  # frees its bytes: the refused one fits now
        w.subscribe(2, b"c." + b"y" * 400)
        assert w.flush() == []
        assert worker0(server)["subscription_bytes"] == 530 + 69
    deadline = time.monotonic() + 5
    while (stats := worker0(server))["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["subscription_bytes"] == 0 and stats["subscriptions"] == 0


class Replies(threading.Thread):
    """Reads a connection until the Pong with `pong_id`: counts Error codes and the
    Errors' sids (a raw FrameReader, so that the reader keeps up with the server)."""

    def __init__(self, wire: Wire, pong_id: int) -> None:
        super().__init__(daemon=True)
        self.wire = wire
        self.pong_id = pong_id
        self.codes: dict[int, int] = {}
        self.sids: list[int] = []
        self.fatal = 0
        self.ponged = threading.Event()

    def run(self) -> None:
        reader = FrameReader(max_frame_bytes=1 << 30)
        self.wire.sock.settimeout(120)
        while True:
            data = self.wire.sock.recv(1 << 20)
            if not data:
                return
            reader.feed(data)
            while (raw := reader.next_frame()) is not NEED_DATA:
                frame = decode_frame(raw)
                if isinstance(frame, Error):
                    self.codes[frame.code] = self.codes.get(frame.code, 0) + 1
                    self.sids.append(frame.sid)
                    self.fatal += frame.fatal
                elif isinstance(frame, Pong) and frame.id == self.pong_id:
                    self.ponged.set()
                    return


def flood_frames(n: int, size: int) -> bytes:
    """n Subscribe frames, sids 1..n, each with its own pattern of `size` bytes (two tokens)."""
    # Encoded once, then patched: the sid and the pattern's first token are at fixed places.
    template = encode_frame(Subscribe(0x5EED5EED, b"%08d." % 0 + b"p" * (size - 9)))
    sid_at = template.index(struct.pack("<I", 0x5EED5EED))
    token_at = template.index(b"00000000.")
    frames = bytearray(template * n)
    step = len(template)
    for i in range(n):
        struct.pack_into("<I", frames, i * step + sid_at, i + 1)
        frames[i * step + token_at : i * step + token_at + 8] = b"%08d" % (i + 1)
    return bytes(frames)


# What may stay after the close: 6-9 MB measured (pymalloc arenas kept by a few live
# objects, allocator state), with room for a busy machine.
RETURNED = 20 * MB

FLOODS = {
    # 50,000 Subscribes of 4 KB (the report): the limits keep about 2 MiB of them.
    "default limits": ((), 50_000),
    # The unbounded case: every one accepted (about 9.4 KB of worker memory each).
    "limits raised": (("--max-subscriptions", "1000000", "--max-subscription-bytes", "1G"), 20_000),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FLOODS))
def test_a_subscription_flood_is_bounded_and_its_memory_returns(start_server: Any, case: str) -> None:
    args, n = FLOODS[case]
    server = start_server(*args, workers=1)
    frames = flood_frames(n, 4096)
    pid = server.worker_pids()[0]
    with Wire.hello(server.address, timeout=60) as w:
        assert w.flush() == []
        before = rss(pid)
        replies = Replies(w, pong_id=999)
        replies.start()
        peak = before
        chunk = 256 << 10
        for start in range(0, len(frames), chunk):
            w.send(frames[start : start + chunk])
            peak = max(peak, rss(pid))
        w.send(Ping(999))
        assert replies.ponged.wait(120), "no Pong"
        peak = max(peak, rss(pid))
        stats = worker0(server)
    deadline = time.monotonic() + 10
    while (after := rss(pid)) > before + RETURNED and time.monotonic() < deadline:
        time.sleep(0.1)  # the worker trims its heap at its next tick (every 0.25 s)
    print(
        f"\n{case}: {n} Subscribes of 4 KB, {stats['subscriptions']} accepted: worker RSS "
        f"before {before / MB:.1f} MB, peak {peak / MB:.1f} MB, after close {after / MB:.1f} MB"
    )
    assert replies.fatal == 0
    if case == "default limits":
        accepted = (2 << 20) // (4096 + 2 * 64)
        assert stats["subscriptions"] == accepted
        assert replies.codes == {ErrorCode.SUBSCRIPTION_LIMIT: n - accepted}
        assert replies.sids == list(range(accepted + 1, n + 1))
        assert stats["subscriptions_refused"]["bytes"] == n - accepted
        assert peak - before < 32 * MB, (before, peak)  # unbounded, it would be about 450 MB
    else:
        assert stats["subscriptions"] == n and replies.codes == {}
        assert peak - before > 100 * MB, (before, peak)  # the flood did take memory
    # Near the baseline again: without the heap trim this flood left about 95 MB.
    assert after - before < RETURNED, (before, peak, after)
    final = worker0(server)
    assert final["subscriptions"] == final["subscription_bytes"] == 0 and final["matcher_empty"]


def test_a_client_that_pings_without_reading_is_read_no_more_at_the_reply_bound(start_server: Any) -> None:
    server = start_server("--max-reply-bytes", "128K", "--slow-consumer-deadline", "30")
    ping = encode_frame(Ping(7))
    chunk = ping * ((64 << 10) // len(ping))
    with Wire.hello(server.address, worker=0, rcvbuf=4096) as w:
        w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)  # less in flight
        w.sock.setblocking(False)
        sent = 0
        while sent < 256 * MB:  # until the socket stays full for a second: TCP back-pressure
            if not select.select([], [w.sock], [], 1.0)[1]:
                break
            try:
                sent += w.sock.send(chunk[sent % len(chunk) :])  # whole Pings, but for the last
            except BlockingIOError:
                continue
        assert sent < 256 * MB, "the server kept reading"
        # Read no more with its unread Pongs over 128 KiB, far below the 8 MiB pending bound
        # (what one read of Pings could add on top: 256 KiB). Until the kernel's buffers are
        # full the stopped connection's buffer drains, it is read again, and so on: wait for that.
        deadline = time.monotonic() + 10
        while True:
            [conn] = get_json(server, "/connections")["connections"]
            if (conn["reads_stopped"] and conn["pending_bytes"] > 128 << 10) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert conn["reads_stopped"] is True and worker0(server)["reads_stopped"] >= 1
        assert 128 << 10 < conn["pending_bytes"] < (128 + 256 + 64) << 10, conn
        # It reads now: every Ping it sent is answered, and it is read again.
        w.sock.setblocking(True)
        w.sock.settimeout(30)
        # Every Pong is one size (its ts is the server's clock, different each read).
        pong_size = len(encode_frame(Pong(7, 1)))
        count = sent // len(ping)
        got = bytearray()
        while len(got) < count * pong_size:
            data = w.sock.recv(1 << 20)
            assert data
            got += data
        reader = FrameReader(max_frame_bytes=1 << 20)
        reader.feed(bytes(got))
        pongs = []
        while (raw := reader.next_frame()) is not NEED_DATA:
            pongs.append(decode_frame(raw))
        assert len(pongs) == count
        assert all(type(p) is Pong and p.id == 7 and p.ts > 0 for p in pongs)
        w.sock.sendall(ping[sent % len(ping) :])  # the rest of the last Ping, cut by send
        [last] = w.flush()
        assert type(last) is Pong and last.id == 7 and last.ts > 0
    assert worker0(server)["slow_consumer_disconnects"] == 0


def test_a_delivery_backlog_never_stops_reading_that_clients_publishes(start_server: Any) -> None:
    # A subscriber that reads nothing, at its pending bound, still publishes and pings:
    # only unread replies stop a connection's reads, never its deliveries.
    server = start_server(
        "--max-pending-bytes", "1M", "--max-reply-bytes", "64K", "--slow-consumer-deadline", "30",
        "--replay-bytes", "0",  # it drops at its bound (with a replay buffer it would lag: no matter here)
    )  # fmt: skip
    with (
        Wire.hello(server.address, worker=0, rcvbuf=4096) as lazy,
        Wire.hello(server.address, worker=0) as pub,
        Wire.hello(server.address, worker=0) as other,
    ):
        lazy.subscribe(1, b"backlog")
        lazy.flush()
        other.subscribe(1, b"from.lazy")
        other.flush()
        pub.sock.sendall(encode_message(KP0, b"backlog", b"x" * 1000) * 4000)  # 4 MB for 1 MiB
        assert pub.flush(timeout=30) == []
        assert worker0(server)["dropped"]["slow_consumer"] > 0  # it is at its bound
        n = 2000
        lazy.send(*(Ping(i) for i in range(10)))  # a few replies, unread, behind the backlog
        lazy.sock.sendall(b"".join(encode_message(KP0, b"from.lazy", b"%d" % i) for i in range(n)))
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            got += [m.payload for m in other.messages()]
        assert got == [b"%d" % i for i in range(n)]
        stats = worker0(server)
        assert stats["reads_stopped"] == 0
        assert stats["messages_published"] == 4000 + n
