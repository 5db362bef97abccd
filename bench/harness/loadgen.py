"""The load generator: raw sockets, pre-encoded publishes, counting subscribers.

Theory of operation
-------------------
The same generator drives Broky, nats-server and redis-server, so that what
differs between the figures is the server. Per run there are two generator
processes besides the server's: one publisher process (all publishing
connections) and one subscriber process (all subscribing connections).

* Publishes are encoded once, before the clock starts: a batch of about
  64 KiB of ready frames per connection (`Driver.publish`), written with one
  `sendall` per batch.
* A delivery of one run always has the same length: keys and key_partitions
  of a run are of equal length, and every system forwards a fixed-size
  record (Broky: the publisher's frame, NATS: a `MSG` line plus payload,
  Redis: a RESP `message`/`pmessage` push). So a subscriber counts whole
  records of that length and checks only the first and the last record head
  of each read; if the check fails (a PING, an Error frame, ...) it walks the
  read record by record and hands anything else to `Driver.foreign`.
* Throughput runs are closed-loop with a bounded window: the publisher never
  has more than `window` messages published but not yet delivered to every
  subscriber (delivered counts are shared memory written by the subscriber
  process), so the server is saturated but its outbound buffers stay far
  below every system's slow-consumer limit.
* Broky publishers are shard-aware: one connection per worker
  (Hello.worker = w) and each message goes to the owner of its key_partition
  (`VBucketMap.owner`). Subscriptions to one key are partition-scoped on the
  owner; wildcard subscriptions are all-partition, one per worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import selectors
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness import tlsclient
from broky.protocol import (
    Error,
    FrameReader,
    Goodbye,
    Hello,
    LossNotice,
    Ping,
    Pong,
    Subscribe,
    VBucketMap,
    Welcome,
    decode_frame,
    encode_frame,
    encode_message,
    layout,
)

BATCH_BYTES = 64 * 1024
WINDOW_BYTES = 2 * 1024 * 1024
RECV_BYTES = 1 << 20

# run phases, in a shared integer
SETUP, RUN, STOP = 0, 1, 2

Key = tuple[bytes, bytes]  # (key_partition, key)


class LoadError(RuntimeError):
    """The generator could not drive a server (handshake failed, protocol error, ...)."""


def make_keys(count: int) -> list[Key]:
    """`count` distinct (key_partition, key) pairs, all of the same length."""
    return [(b"p%04d" % i, b"bench.k%04d" % i) for i in range(count)]


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_until(sock: socket.socket, buf: bytearray, done: Callable[[bytearray], bool]) -> None:
    while not done(buf):
        data = sock.recv(65536)
        if not data:
            raise LoadError(f"connection closed during set-up; got {bytes(buf[:200])!r}")
        buf += data


@dataclass
class Record:
    """Shape of one delivery on a subscriber's stream."""

    length: int
    head: bytes  # its first bytes, the same in every delivery of the run
    payload_offset: int  # where the payload starts inside the record


@dataclass
class Counters:
    """What a subscriber saw besides deliveries."""

    errors: int = 0
    lost: int = 0  # losses the server reported (Broky LossNotice)
    notes: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.notes) < 5:
            self.notes.append(text)


class Driver:
    """How the generator speaks to one system. One subclass per protocol."""

    name = ""

    def prepare(self, address: tuple[str, int]) -> None:
        """Learn what the forked processes need (Broky: the vbucket map)."""

    def subscribe(self, address: tuple[str, int], keys: Sequence[Key], wildcard: bool) -> list[socket.socket]:
        """Connections of one subscriber, subscribed (confirmed by the server).

        wildcard=False: a subscription to keys[0] only; True: to every key.
        """
        raise NotImplementedError

    def record(self, key: Key, payload: bytes, wildcard: bool) -> Record:
        """The delivery of (key, payload) to a subscriber made by `subscribe`."""
        raise NotImplementedError

    def publish(self, key: Key, payload: bytes) -> tuple[bytes, int]:
        """The pre-encoded publish and the offset of the payload in it."""
        raise NotImplementedError

    def publishers(
        self, address: tuple[str, int], keys: Sequence[Key]
    ) -> list[tuple[socket.socket, list[Key]]]:
        """Connections of one publisher and the keys each one publishes."""
        return [(_connect(address), list(keys))]

    def handshake_publisher(self, sock: socket.socket) -> None:
        """Anything a publisher sends before its first publish."""

    def foreign(self, sock: socket.socket, buf: bytearray, pos: int, end: int, c: Counters) -> int | None:
        """Consume one unit at buf[pos:end] that is not a delivery.

        Returns the position after it, or None if it is not complete yet.
        """
        raise NotImplementedError

    def publisher_data(self, sock: socket.socket, data: bytes, c: Counters) -> None:
        """Bytes a publishing connection received (replies, errors, pings)."""
        if data:
            c.error(f"unexpected bytes to a publisher: {data[:80]!r}")

    PING = b""
    PONG = b""

    def sync(self, sock: socket.socket, c: Counters) -> None:
        """Ping and wait for the answer: the server has read every publish before it.

        Closing a publisher with unread replies would reset the connection and
        lose publishes the server has not read yet.
        """
        sock.sendall(self.PING)
        buf = bytearray()
        _recv_until(sock, buf, lambda b: b.endswith(self.PONG))
        self.publisher_data(sock, bytes(buf[: -len(self.PONG)]), c)


# ---------------------------------------------------------------- Broky


class BrokyDriver(Driver):
    """Broky frames via broky.protocol: Hello(worker=w), Welcome, Subscribe, Message."""

    name = "broky"

    def __init__(self) -> None:
        self.map: VBucketMap | None = None
        self.workers = 1

    def connect(self, address: tuple[str, int], worker: int) -> tuple[socket.socket, Welcome]:
        sock = _connect(address)
        sock.sendall(encode_frame(Hello(worker=worker, client_name="bench")))
        frame = self._next_frame(sock, FrameReader())
        if not isinstance(frame, Welcome):
            raise LoadError(f"broky answered Hello with {frame!r}")
        return sock, frame

    def _next_frame(self, sock: socket.socket, reader: FrameReader) -> Any:
        try:
            return decode_frame(tlsclient.next_frame(sock, reader))
        except EOFError:
            raise LoadError("broky closed the connection during set-up") from None

    def prepare(self, address: tuple[str, int]) -> None:
        sock, welcome = self.connect(address, -1)
        sock.close()
        self.map = welcome.map
        self.workers = welcome.map.nodes[0].workers

    def owner(self, key_partition: bytes) -> int:
        assert self.map is not None, "prepare() first"
        return self.map.owner(key_partition)[1]

    def _confirm(self, sock: socket.socket, frames: bytes) -> None:
        """Send frames then a Ping; every frame is processed once the Pong is in."""
        sock.sendall(frames + encode_frame(Ping(7)))
        reader = FrameReader()
        while True:
            frame = self._next_frame(sock, reader)
            if isinstance(frame, Pong):
                return
            raise LoadError(f"broky answered a subscription with {frame!r}")

    def subscribe(self, address: tuple[str, int], keys: Sequence[Key], wildcard: bool) -> list[socket.socket]:
        socks = []
        if wildcard:
            for w in range(self.workers):
                sock, _ = self.connect(address, w)
                self._confirm(sock, encode_frame(Subscribe(1, b"bench.>")))
                socks.append(sock)
        else:
            kp, key = keys[0]
            sock, _ = self.connect(address, self.owner(kp))
            self._confirm(sock, encode_frame(Subscribe(1, key, kp)))
            socks.append(sock)
        return socks

    def publish(self, key: Key, payload: bytes) -> tuple[bytes, int]:
        kp, k = key
        frame = encode_message(kp, k, payload)
        offset = layout.shape(False, len(kp), len(k), len(payload)).payload_at + 4
        if frame[offset : offset + len(payload)] != payload:
            raise LoadError("unexpected Message layout; update BrokyDriver.publish")
        return frame, offset

    def record(self, key: Key, payload: bytes, wildcard: bool) -> Record:
        frame, offset = self.publish(key, payload)
        return Record(len(frame), frame[:4], offset)

    def publishers(
        self, address: tuple[str, int], keys: Sequence[Key]
    ) -> list[tuple[socket.socket, list[Key]]]:
        by_worker: dict[int, list[Key]] = {}
        for key in keys:
            by_worker.setdefault(self.owner(key[0]), []).append(key)
        return [(self.connect(address, w)[0], ks) for w, ks in sorted(by_worker.items())]

    def foreign(self, sock: socket.socket, buf: bytearray, pos: int, end: int, c: Counters) -> int | None:
        if end - pos < 4:
            return None
        stop = pos + 4 + int.from_bytes(buf[pos : pos + 4], "little")
        if stop > end:
            return None
        try:
            frame = decode_frame(bytes(buf[pos:stop]))
        except Exception as exc:
            raise LoadError(f"broky sent an unreadable frame: {exc}") from exc
        if isinstance(frame, LossNotice):
            c.lost += frame.dropped
        elif isinstance(frame, Error | Goodbye):
            c.error(repr(frame))
        elif not isinstance(frame, Pong):
            c.error(f"unexpected {type(frame).__name__} frame")
        return stop

    def sync(self, sock: socket.socket, c: Counters) -> None:
        sock.sendall(encode_frame(Ping(9)))
        reader = FrameReader()
        while not isinstance(frame := self._next_frame(sock, reader), Pong):
            c.error(repr(frame))

    def publisher_data(self, sock: socket.socket, data: bytes, c: Counters) -> None:
        reader = FrameReader()
        reader.feed(data)
        for raw in reader.frames():  # a partial frame at the end is rare and only a note
            frame = decode_frame(raw)
            c.error(repr(frame))


# ---------------------------------------------------------------- NATS


class NatsDriver(Driver):
    """The NATS text protocol: CONNECT, SUB, PUB subj n; deliveries `MSG subj sid n`."""

    name = "nats"
    PING = b"PING\r\n"
    PONG = b"PONG\r\n"
    CONNECT = b'CONNECT {"verbose":false,"pedantic":false,"echo":false,"name":"bench"}\r\n'

    def _open(self, address: tuple[str, int]) -> socket.socket:
        sock = _connect(address)
        buf = bytearray()
        _recv_until(sock, buf, lambda b: b"\r\n" in b)
        if not buf.startswith(b"INFO "):
            raise LoadError(f"nats-server greeted with {bytes(buf[:80])!r}")
        return sock

    def _confirm(self, sock: socket.socket, data: bytes) -> None:
        sock.sendall(data + b"PING\r\n")
        buf = bytearray()
        _recv_until(sock, buf, lambda b: b"PONG\r\n" in b or b"-ERR" in b)
        if b"-ERR" in buf:
            raise LoadError(f"nats-server: {bytes(buf)!r}")

    def subscribe(self, address: tuple[str, int], keys: Sequence[Key], wildcard: bool) -> list[socket.socket]:
        sock = self._open(address)
        subject = b"bench.>" if wildcard else keys[0][1]
        self._confirm(sock, self.CONNECT + b"SUB " + subject + b" 1\r\n")
        return [sock]

    def handshake_publisher(self, sock: socket.socket) -> None:
        buf = bytearray()
        _recv_until(sock, buf, lambda b: b"\r\n" in b)
        self._confirm(sock, self.CONNECT)

    def publish(self, key: Key, payload: bytes) -> tuple[bytes, int]:
        head = b"PUB %s %d\r\n" % (key[1], len(payload))
        return head + payload + b"\r\n", len(head)

    def record(self, key: Key, payload: bytes, wildcard: bool) -> Record:
        head = b"MSG %s 1 %d\r\n" % (key[1], len(payload))
        return Record(len(head) + len(payload) + 2, b"MSG ", len(head))

    def _line(self, sock: socket.socket, buf: bytearray, pos: int, end: int, c: Counters) -> int | None:
        nl = buf.find(b"\r\n", pos, end)
        if nl < 0:
            return None
        line = bytes(buf[pos:nl])
        if line == b"PING":
            sock.sendall(b"PONG\r\n")
        elif line.startswith(b"-ERR"):
            c.error(line.decode(errors="replace"))
        elif line not in (b"PONG", b"+OK") and not line.startswith(b"INFO "):
            c.error(f"unexpected line from nats-server: {line[:80]!r}")
        return nl + 2

    def foreign(self, sock: socket.socket, buf: bytearray, pos: int, end: int, c: Counters) -> int | None:
        return self._line(sock, buf, pos, end, c)

    def publisher_data(self, sock: socket.socket, data: bytes, c: Counters) -> None:
        buf = bytearray(data)
        pos = 0
        while pos < len(buf):
            nxt = self._line(sock, buf, pos, len(buf), c)
            if nxt is None:
                break
            pos = nxt


# ---------------------------------------------------------------- Redis


def _resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class RedisDriver(Driver):
    """RESP: PUBLISH ch payload; SUBSCRIBE ch (or PSUBSCRIBE bench.* for wildcards)."""

    name = "redis"
    PING = _resp(b"PING")
    PONG = b"+PONG\r\n"
    PATTERN = b"bench.*"

    def subscribe(self, address: tuple[str, int], keys: Sequence[Key], wildcard: bool) -> list[socket.socket]:
        sock = _connect(address)
        if wildcard:
            command, expect = _resp(b"PSUBSCRIBE", self.PATTERN), b"psubscribe"
            reply = b"*3\r\n$10\r\npsubscribe\r\n$%d\r\n%s\r\n:1\r\n" % (len(self.PATTERN), self.PATTERN)
        else:
            channel = keys[0][1]
            command, expect = _resp(b"SUBSCRIBE", channel), b"subscribe"
            reply = b"*3\r\n$9\r\nsubscribe\r\n$%d\r\n%s\r\n:1\r\n" % (len(channel), channel)
        sock.sendall(command)
        buf = bytearray()
        _recv_until(sock, buf, lambda b: len(b) >= len(reply) or b.startswith(b"-"))
        if bytes(buf) != reply:
            raise LoadError(f"redis answered {expect.decode()} with {bytes(buf[:120])!r}")
        return [sock]

    def publish(self, key: Key, payload: bytes) -> tuple[bytes, int]:
        data = _resp(b"PUBLISH", key[1], payload)
        return data, len(data) - 2 - len(payload)

    def record(self, key: Key, payload: bytes, wildcard: bool) -> Record:
        if wildcard:
            data = _resp(b"pmessage", self.PATTERN, key[1], payload)
        else:
            data = _resp(b"message", key[1], payload)
        return Record(len(data), data[:4], len(data) - 2 - len(payload))

    def foreign(self, sock: socket.socket, buf: bytearray, pos: int, end: int, c: Counters) -> int | None:
        raise LoadError(f"unexpected push from redis: {bytes(buf[pos : min(end, pos + 120)])!r}")

    def publisher_data(self, sock: socket.socket, data: bytes, c: Counters) -> None:
        # one ":<receivers>\r\n" per PUBLISH; errors start with "-"
        if data.startswith(b"-") or b"\n-" in data:
            c.error(f"redis error: {data[:120]!r}")


class BrokySdkDriver(BrokyDriver):
    """Broky with the SDK publishing (`sdk_publisher_main`; every message gets a KSUID
    and ts_producer, the SDK's defaults); subscribers are the same raw counting ones."""

    name = "broky_sdk"

    def record(self, key: Key, payload: bytes, wildcard: bool) -> Record:
        kp, k = key
        frame = encode_message(kp, k, payload, 1, 0, bytes(20))
        offset = layout.shape(True, len(kp), len(k), len(payload)).payload_at + 4
        if frame[offset : offset + len(payload)] != payload:
            raise LoadError("unexpected Message layout; update BrokySdkDriver.record")
        return Record(len(frame), frame[:4], offset)


DRIVERS: dict[str, Callable[[], Driver]] = {
    "broky": BrokyDriver,
    "nats": NatsDriver,
    "redis": RedisDriver,
    "broky_sdk": BrokySdkDriver,
}


# ---------------------------------------------------------------- the run


@dataclass
class Load:
    """One run's shape, for any system."""

    publishers: int
    subscribers: int
    payload: int
    keys: int = 1
    wildcard: bool = False  # subscribers subscribe to every key (needed when keys > 1)

    def key_list(self) -> list[Key]:
        return make_keys(self.keys)


@dataclass
class Shared:
    """Counters and the phase shared by the orchestrator and the generator processes."""

    phase: Any
    sent: Any  # one slot per publisher
    delivered: Any  # one slot per subscriber
    published: Any  # set by the publisher once the server has read its last publish

    @classmethod
    def create(cls, load: Load) -> Shared:
        ctx = multiprocessing.get_context("fork")
        return cls(
            ctx.RawValue("i", SETUP),
            ctx.RawArray("q", load.publishers),
            ctx.RawArray("q", load.subscribers),
            ctx.RawValue("i", 0),
        )


class SubscriberStream:
    """Counts (and optionally inspects) the deliveries on one connection."""

    __slots__ = ("buf", "counters", "driver", "fill", "mv", "n", "rec", "sock")

    def __init__(self, driver: Driver, sock: socket.socket, rec: Record, counters: Counters) -> None:
        self.driver = driver
        self.sock = sock
        self.rec = rec
        self.counters = counters
        self.buf = bytearray(max(RECV_BYTES, 4 * rec.length))
        self.mv = memoryview(self.buf)
        self.fill = 0
        self.n = 0

    def read(self, on_record: Callable[[bytearray, int], None] | None = None) -> bool:
        """Read once and count whole records; False when the server closed."""
        got = self.sock.recv_into(self.mv[self.fill :])
        if not got:
            return False
        end = self.fill + got
        buf = self.buf
        length = self.rec.length
        head = self.rec.head
        hl = len(head)
        pos = 0
        whole = end // length
        if (
            on_record is None
            and whole
            and buf.startswith(head)
            and buf.startswith(head, (whole - 1) * length)
            and (whole * length == end or end - whole * length < hl or buf.startswith(head, whole * length))
        ):
            self.n += whole
            pos = whole * length
        else:
            while pos < end:
                if end - pos >= hl and buf.startswith(head, pos):
                    if end - pos < length:
                        break
                    if on_record is not None:
                        on_record(buf, pos)
                    self.n += 1
                    pos += length
                elif end - pos < hl and head.startswith(bytes(buf[pos:end])):
                    break
                else:
                    nxt = self.driver.foreign(self.sock, buf, pos, end, self.counters)
                    if nxt is None:
                        break
                    pos = nxt
        rest = end - pos
        if rest:
            if pos:
                buf[:rest] = buf[pos:end]
            if rest == len(buf):
                raise LoadError("a unit larger than the receive buffer")
        self.fill = rest
        return True


def subscriber_main(
    driver: Driver,
    address: tuple[str, int],
    load: Load,
    shared: Shared,
    conn: multiprocessing.connection.Connection,
    make_observer: Callable[[Record], tuple[Callable[[bytearray, int], None], Callable[[], dict[str, Any]]]]
    | None = None,
) -> None:
    """Body of the subscriber process: subscribe, count until told to stop and drained."""
    try:
        keys = load.key_list()
        payload = bytes(load.payload)
        counters = Counters()
        streams: list[tuple[int, SubscriberStream]] = []
        observer = finish = None
        for s in range(load.subscribers):
            for sock in driver.subscribe(address, keys, load.wildcard):
                rec = driver.record(keys[0], payload, load.wildcard)
                if make_observer is not None and observer is None:
                    observer, finish = make_observer(rec)
                streams.append((s, SubscriberStream(driver, sock, rec, counters)))
        sel = selectors.DefaultSelector()
        for item in streams:
            item[1].sock.setblocking(False)
            sel.register(item[1].sock, selectors.EVENT_READ, item)
        conn.send({"ready": True})
        delivered = shared.delivered
        counts = [0] * load.subscribers
        last_progress = time.monotonic()
        stopped_at = 0.0
        closed = 0
        while True:
            events = sel.select(0.05)
            for key, _ in events:
                s, stream = key.data
                before = stream.n
                try:
                    alive = stream.read(observer)
                except BlockingIOError:
                    continue
                if not alive:
                    sel.unregister(stream.sock)
                    closed += 1
                    counters.error("the server closed a subscriber connection")
                    continue
                counts[s] += stream.n - before
                delivered[s] = counts[s]
            if events:
                last_progress = time.monotonic()
            if shared.phase.value == STOP:
                # every publish counted, or nothing more for 0.5 s; both only once the
                # publisher is done, else its last batch could still be on its way
                now = time.monotonic()
                stopped_at = stopped_at or now
                done = shared.published.value
                if (
                    (done and sum(counts) >= sum(shared.sent) * load.subscribers)
                    or (done and now - last_progress > 0.5)
                    or now - stopped_at > 10
                    or closed == len(streams)
                ):
                    break
        result: dict[str, Any] = {
            "delivered": sum(counts),
            "errors": counters.errors,
            "server_reported_lost": counters.lost,
            "notes": counters.notes,
        }
        if finish is not None:
            result.update(finish())
        for _, stream in streams:
            stream.sock.close()
        conn.send(result)
    except Exception:
        conn.send({"error": traceback.format_exc()})


def _drain(driver: Driver, socks: Sequence[socket.socket], c: Counters) -> None:
    for sock in socks:
        while True:
            try:
                data = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not data:
                raise LoadError(f"{driver.name} closed a publisher connection")
            driver.publisher_data(sock, data, c)


def publisher_main(
    driver: Driver,
    address: tuple[str, int],
    load: Load,
    shared: Shared,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Body of the throughput publisher process: closed loop, bounded window."""
    try:
        keys = load.key_list()
        payload = b"x" * load.payload
        counters = Counters()
        conns = []
        for p in range(load.publishers):
            for sock, ks in driver.publishers(address, keys):
                driver.handshake_publisher(sock)
                one = [driver.publish(k, payload)[0] for k in ks]
                n = max(1, BATCH_BYTES // len(one[0]))
                batch = b"".join(one[i % len(one)] for i in range(n))
                conns.append((p, sock, batch, n))
        socks = [c[1] for c in conns]
        for sock in socks:
            sock.settimeout(None)  # blocking: sendall waits, MSG_DONTWAIT reads return at once
        record_len = driver.record(keys[0], payload, load.wildcard).length
        fan = load.subscribers
        window = max(2 * max(c[3] for c in conns), WINDOW_BYTES // record_len) * fan
        conn.send({"ready": True})
        while shared.phase.value == SETUP:
            time.sleep(0.001)
        sent_arr, delivered, phase = shared.sent, shared.delivered, shared.phase
        sent = [0] * load.publishers
        total = 0
        i = 0
        while phase.value == RUN:
            p, sock, batch, n = conns[i]
            i = (i + 1) % len(conns)
            while (total + n) * fan - sum(delivered) > window and phase.value == RUN:
                _drain(driver, socks, counters)
                time.sleep(0.0001)
            sock.sendall(batch)
            sent[p] += n
            sent_arr[p] = sent[p]
            total += n
            if i == 0:
                _drain(driver, socks, counters)
        for sock in socks:
            driver.sync(sock, counters)
            sock.close()
        shared.published.value = 1
        conn.send({"sent": total, "errors": counters.errors, "notes": counters.notes})
    except Exception:
        conn.send({"error": traceback.format_exc()})


def sdk_publisher_main(
    driver: Driver,
    address: tuple[str, int],
    load: Load,
    shared: Shared,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Body of the throughput publisher process that publishes through the asyncio SDK.

    Same closed loop and window as `publisher_main`; every message is one
    `await client.publish(...)`, the SDK's documented way to publish.
    """
    import asyncio

    import uvloop

    from broky.client import connect

    async def run() -> dict[str, Any]:
        keys = load.key_list()
        payload = b"x" * load.payload
        client = await connect(f"broky://{address[0]}:{address[1]}", name="bench-sdk")
        try:
            publish = client.publish
            fan = load.subscribers
            record_len = driver.record(keys[0], payload, load.wildcard).length
            window = max(512, WINDOW_BYTES // record_len) * fan
            step = 256
            conn.send({"ready": True})
            while shared.phase.value == SETUP:
                await asyncio.sleep(0.001)
            delivered, phase = shared.delivered, shared.phase
            total = 0
            nkeys = len(keys)
            while phase.value == RUN:
                while (total + step) * fan - sum(delivered) > window and phase.value == RUN:
                    await asyncio.sleep(0.0001)
                for j in range(step):
                    kp, key = keys[(total + j) % nkeys]
                    await publish(key, payload, partition=kp)
                total += step
                shared.sent[0] = total
            await client.flush()
            shared.published.value = 1
            return {"sent": total, "errors": 0, "notes": [], "sdk_stats": repr(client.stats)}
        finally:
            await client.close()

    try:
        conn.send(uvloop.run(run()))
    except Exception:
        conn.send({"error": traceback.format_exc()})


@dataclass
class Generator:
    """The two generator processes of one run and their pipes."""

    procs: list[multiprocessing.process.BaseProcess]
    conns: list[multiprocessing.connection.Connection]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def expect(self, index: int, timeout: float) -> dict[str, Any]:
        conn = self.conns[index]
        if not conn.poll(timeout):
            raise LoadError(f"generator process {index} did not answer within {timeout:.0f} s")
        reply: dict[str, Any] = conn.recv()
        if "error" in reply:
            raise LoadError(f"generator process {index} failed:\n{reply['error']}")
        return reply

    def stop(self) -> None:
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        for conn in self.conns:
            conn.close()


def start_generator(
    sub_target: Callable[..., None],
    pub_target: Callable[..., None],
    args: tuple[Any, ...],
    sub_extra: tuple[Any, ...] = (),
) -> Generator:
    """Fork the subscriber process, wait until it is subscribed, then the publisher."""
    ctx = multiprocessing.get_context("fork")
    gen = Generator([], [])
    try:
        for target, extra in ((sub_target, sub_extra), (pub_target, ())):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*args, child, *extra), daemon=True)
            proc.start()
            child.close()
            gen.procs.append(proc)
            gen.conns.append(parent)
            gen.expect(len(gen.procs) - 1, 20)
    except BaseException:
        gen.stop()
        raise
    return gen


def kill_generator(gen: Generator) -> None:
    for proc in gen.procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, 9)
    gen.stop()


def run_throughput(
    driver: Driver,
    address: tuple[str, int],
    server_pids: Callable[[], list[int]],
    load: Load,
    warmup: float,
    duration: float,
    publisher: Callable[..., None] = publisher_main,
) -> dict[str, Any]:
    """One closed-loop run: deliveries/s, server CPU per delivery, peak RSS, generator CPU."""
    from bench.harness import procstat

    shared = Shared.create(load)
    pids = server_pids()
    rss_reset = all([procstat.reset_peak_rss(pid) for pid in pids])
    gen = start_generator(subscriber_main, publisher, (driver, address, load, shared))
    try:
        shared.phase.value = RUN
        time.sleep(warmup)
        pids = server_pids()
        d0, t0 = sum(shared.delivered), time.monotonic()
        s0, g0 = procstat.total_cpu_seconds(pids), procstat.total_cpu_seconds(gen.pids)
        time.sleep(duration)
        d1, t1 = sum(shared.delivered), time.monotonic()
        s1, g1 = procstat.total_cpu_seconds(pids), procstat.total_cpu_seconds(gen.pids)
        peak_rss = sum(procstat.peak_rss_bytes(pid) for pid in pids)
        shared.phase.value = STOP
        pub = gen.expect(1, 15)
        sub = gen.expect(0, 15)
    except BaseException:
        kill_generator(gen)
        raise
    gen.stop()
    delivered = d1 - d0
    expected = pub["sent"] * load.subscribers
    return {
        "deliveries_per_s": delivered / (t1 - t0),
        "server_cpu_us_per_delivery": (s1 - s0) * 1e6 / delivered if delivered else None,
        "server_cpu_s": s1 - s0,
        "generator_cpu_us_per_delivery": (g1 - g0) * 1e6 / delivered if delivered else None,
        "server_peak_rss_bytes": peak_rss,
        "peak_rss_since": "scenario start" if rss_reset else "server start",
        "server_processes": len(pids),
        "measured_s": t1 - t0,
        "published": pub["sent"],
        "delivered_total": sub["delivered"],
        "not_delivered": max(0, expected - sub["delivered"]),
        "server_reported_lost": sub["server_reported_lost"],
        "errors": pub["errors"] + sub["errors"],
        "notes": pub["notes"] + sub["notes"],
    }
