"""Micro-benchmarks of the codec and the matcher (pytest-benchmark).

Not part of the test suite (pytest runs only tests/, with --benchmark-disable).
Run them with:

    .venv/bin/pytest bench/test_micro.py --benchmark-enable \\
        --benchmark-json=bench/results/micro.json

Results and the machine they ran on: bench/results/micro.md.

The message is the one the pub/sub benchmarks send: a 100-byte payload, an
8-byte key_partition, a 3-token key, ts_producer set and a KSUID. The
flatbuffers.Builder and generated-accessor cases are the baseline the fast
path exists to avoid.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import flatbuffers
import pytest

from broky import fbs
from broky.fbs import Body
from broky.matching import Matcher
from broky.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    NEED_DATA,
    RESUME_TOKEN_BYTES,
    FrameReader,
    Ping,
    decode_frame,
    decode_message,
    encode_frame,
    encode_message,
    ksuid_text,
    new_ksuid,
    route_message,
    vbucket_of,
)
from broky.protocol.layout import TS_BROKER_AT
from broky.protocol.message import message_size

KP = b"tenant-7"
KEY = b"orders.eu.created"
PAYLOAD = bytes(range(100))
UID = new_ksuid()
TS = time.time_ns()
FRAME = encode_message(KP, KEY, PAYLOAD, TS, 0, UID)
SCAN_BYTES = 1 << 20

_u32 = struct.Struct("<I").unpack_from
_stamp = struct.Struct("<q").pack_into


# ---------------------------------------------------------------- Message frames


def test_encode_message(benchmark) -> None:  # type: ignore[no-untyped-def]
    out = benchmark(encode_message, KP, KEY, PAYLOAD, TS, 0, UID)
    assert out == FRAME


def test_encode_message_no_uid(benchmark) -> None:  # type: ignore[no-untyped-def]
    out = benchmark(encode_message, KP, KEY, PAYLOAD, TS)
    assert len(out) == message_size(len(KP), len(KEY), len(PAYLOAD), False)


def test_encode_message_new_uid(benchmark) -> None:  # type: ignore[no-untyped-def]
    # What the SDK does per publish: a fresh KSUID and the current time.
    def publish() -> bytes:
        return encode_message(KP, KEY, PAYLOAD, time.time_ns(), 0, new_ksuid())

    assert len(benchmark(publish)) == len(FRAME)


def test_sdk_encode_new_uid(benchmark) -> None:  # type: ignore[no-untyped-def]
    # What the SDK's publish does: a cached template, a new KSUID and ts_producer.
    from broky.client.encoder import PublishEncoder

    encoder = PublishEncoder(DEFAULT_MAX_FRAME_BYTES)
    frame, _ = benchmark(encoder.encode, KP, KEY, PAYLOAD, None)
    assert decode_message(frame).payload == PAYLOAD


def test_decode_message(benchmark) -> None:  # type: ignore[no-untyped-def]
    msg = benchmark(decode_message, FRAME, 0, len(FRAME))
    assert msg.payload == PAYLOAD and msg.uid == UID


def test_decode_frame_message(benchmark) -> None:  # type: ignore[no-untyped-def]
    msg = benchmark(decode_frame, FRAME)
    assert msg.payload == PAYLOAD


def test_route_message(benchmark) -> None:  # type: ignore[no-untyped-def]
    kp, key, ts_pos = benchmark(route_message, FRAME, 0, len(FRAME))
    assert (kp, key, ts_pos) == (KP, KEY, TS_BROKER_AT)


# ---------------------------------------------------------------- the client's publish path


class _NullProto:
    """Just enough of a WorkerProtocol for a Link that is up: writes go nowhere."""

    write_paused = False

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, chunks: list[bytes]) -> None:
        pass

    def close(self) -> None:
        pass


def _publishing_client(loop: Any) -> Any:
    """A Client whose every vbucket routes to one Link that is up (no server)."""
    from broky.client.client import Client, Link
    from broky.protocol import VBUCKETS

    client = Client("127.0.0.1:1")
    client.loop = loop
    client._open = client._connected = True
    client._encoder.set_limit(DEFAULT_MAX_FRAME_BYTES)
    link = Link(client, "n", 0)
    link.proto = _NullProto()  # type: ignore[assignment]
    client.router.route = [link] * VBUCKETS
    return client


def test_client_publish(benchmark) -> None:  # type: ignore[no-untyped-def]
    # Client.publish's fast path (via publish_nowait): the cached template and
    # Link, a new KSUID and ts_producer, appended to the Link's batch (64 KiB
    # batches written to a null transport).
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        client = _publishing_client(loop)
        publish = client.publish_nowait
        publish(KEY, PAYLOAD)
        publish(KEY, PAYLOAD)  # the second time a shape comes, it gets a template
        benchmark(publish, KEY, PAYLOAD)
        assert client.stats.published > 2
    finally:
        loop.close()


def test_client_deliver_1000(benchmark) -> None:  # type: ignore[no-untyped-def]
    # The SDK's read of deliveries: 1000 canonical deliveries over 256 key_partitions in
    # one read, WorkerProtocol.data_received -> Link.on_message -> an inline callback
    # (each delivery's position written for the resume, and kept per vbucket for
    # sub.positions()).
    import asyncio

    from broky.client.client import Client, Link
    from broky.client.connection import WorkerProtocol
    from broky.client.subscription import Subscription

    loop = asyncio.new_event_loop()
    try:

        async def setup() -> tuple[Any, bytes]:
            client = Client("127.0.0.1:1")
            link = Link(client, "n", 0)
            got = []
            sub = Subscription(client, 1, b"orders.>", None, got.append, 65536, 1 << 26)
            got_clear = got.clear
            link.subs[1] = sub
            link.matcher.add(b"orders.>", sub)
            proto = WorkerProtocol()
            proto.attach(link, (link.pos_epoch, link.pos_offset, link.pos_ts), link.on_replayed)
            frames = b"".join(
                encode_message(b"tenant-%d" % (i % 256), KEY, PAYLOAD, TS, 0, UID) for i in range(1000)
            )

            def read() -> None:
                proto.data_received(frames)
                got_clear()

            return read, frames

        read, _ = loop.run_until_complete(setup())
        benchmark(read)
    finally:
        loop.close()


def _delivering_link(client: Any, callback: Any) -> tuple[Any, Any, bytes]:
    """A Link of `client` (no server) carrying one subscription to `orders.>` with
    `callback` (None: its bounded queue), its WorkerProtocol, and 1000 canonical
    deliveries over 256 key_partitions in one read."""
    from broky.client.client import Link
    from broky.client.connection import WorkerProtocol
    from broky.client.subscription import Subscription

    link = Link(client, "n", 0)
    sub = Subscription(client, 1, b"orders.>", None, callback, 65536, 1 << 26)
    link.subs[1] = sub
    link.matcher.add(b"orders.>", sub)
    proto = WorkerProtocol()
    proto.attach(link, (link.pos_epoch, link.pos_offset, link.pos_ts), link.on_replayed)
    frames = b"".join(encode_message(b"tenant-%d" % (i % 256), KEY, PAYLOAD, TS, 0, UID) for i in range(1000))
    return sub, proto, frames


def test_client_deliver_queued_1000(benchmark) -> None:  # type: ignore[no-untyped-def]
    # The bounded queue of an asyncio Subscription (no callback): one read of 1000
    # deliveries as in test_client_deliver_1000, each queued, then taken by next_msg.
    import asyncio

    from broky.client.client import Client

    loop = asyncio.new_event_loop()
    try:

        async def setup() -> Any:
            client = Client("127.0.0.1:1")
            sub, proto, frames = _delivering_link(client, None)
            take = sub.next_msg

            async def read_and_take() -> None:
                proto.data_received(frames)
                for _ in range(1000):
                    await take()

            return client, sub, read_and_take

        client, sub, read_and_take = loop.run_until_complete(setup())
        benchmark.extra_info["messages"] = 1000
        benchmark(lambda: loop.run_until_complete(read_and_take()))
        assert sub.delivered >= 1000 and sub.pending == 0 and client.stats.errors == 0
    finally:
        loop.close()


def test_sync_deliver_1000(benchmark) -> None:  # type: ignore[no-untyped-def]
    # The blocking client's subscription queue: one read of 1000 deliveries handed by the
    # reader to SyncSubscription's queue (under its lock), then taken by `next` (no
    # other thread: the I/O thread's side and the caller's side, one after the other).
    import asyncio

    from broky.client.client import Client
    from broky.client.sync import SyncSubscription

    loop = asyncio.new_event_loop()
    try:

        async def setup() -> Any:
            client = Client("127.0.0.1:1")
            sync_sub = SyncSubscription(client, lambda coro: coro.close(), 65536, 1 << 26)
            sub, proto, frames = _delivering_link(client, sync_sub.push)
            sync_sub.attach(sub)
            return client, sync_sub, proto, frames

        client, sync_sub, proto, frames = loop.run_until_complete(setup())
        take = sync_sub.next

        def read_and_take() -> None:
            proto.data_received(frames)
            for _ in range(1000):
                take()

        benchmark.extra_info["messages"] = 1000
        benchmark(read_and_take)
        assert sync_sub.delivered >= 1000 and sync_sub.pending == 0 and client.stats.errors == 0
    finally:
        loop.close()


def test_client_publish_rows_1000(benchmark) -> None:  # type: ignore[no-untyped-def]
    # The Spark sink's bulk path (Client.publish_rows): 1000 rows, 64 key_partitions.
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        client = _publishing_client(loop)
        kps = [b"tenant-%d" % (i & 63) for i in range(1000)]
        keys = [KEY] * 1000
        payloads = [PAYLOAD] * 1000
        rows = client.publish_rows
        for _ in range(2):  # every shape gets its template
            loop.run_until_complete(rows(kps, keys, payloads, None, None))
        benchmark.extra_info["messages"] = 1000
        benchmark(lambda: loop.run_until_complete(rows(kps, keys, payloads, None, None)))
        assert client.stats.published >= 3000
    finally:
        loop.close()


# ---------------------------------------------------------------- the Spark source's read


@pytest.mark.parametrize("decoder", ["compiled", "reference", "per-message"])
def test_spark_read_1000(benchmark, decoder) -> None:  # type: ignore[no-untyped-def]
    # The Spark source's decoding of one read of 1000 retained messages (as stamped by a
    # worker) into an Arrow record batch of its nine columns: the compiled decoder and its
    # reference (broky.spark.readcols), and the per-message loop they replaced (the
    # connection's Message tuples, a list per column, pa.array of each).
    import pyarrow as pa

    from broky.client.connection import WorkerProtocol
    from broky.spark import readcols
    from broky.spark.source import arrow_schema

    frames = b"".join(
        encode_message(b"tenant-%d" % (i % 256), KEY, PAYLOAD, TS, TS + 5, UID, i % 1024, 1 << 62, i + 1)
        for i in range(1000)
    )
    schema = arrow_schema(pa)
    mask = b"\x01" * 1024
    benchmark.extra_info["messages"] = 1000
    if decoder != "per-message":
        if decoder == "compiled":
            assert readcols.compiled is not None, readcols.description
            dec = readcols.compiled.Decoder(8192, 1 << 26)
        else:
            dec = readcols.PyDecoder(8192, 1 << 26)

        def columns() -> Any:
            dec.scan(frames, 0, len(frames), mask, 1 << 20)
            return readcols.arrow_batch(pa, schema, dec.take())

        assert benchmark(columns).num_rows == 1000
        return
    got: list[Any] = []

    class Answer:  # (what the source's read handed it: Message tuples)
        on_message = got.append

    import asyncio

    async def connection() -> WorkerProtocol:
        proto = WorkerProtocol()
        proto.attach(Answer())  # type: ignore[arg-type]
        return proto

    loop = asyncio.new_event_loop()
    try:
        proto = loop.run_until_complete(connection())
    finally:
        loop.close()

    def messages() -> Any:
        proto.data_received(frames)
        cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [], [])
        kps, keys, pays, tsp, tsb, uids, vbs, epochs, offsets = cols
        for msg in got:
            kps.append(msg.key_partition)
            keys.append(msg.key)
            pays.append(msg.payload)
            tsp.append(msg.ts_producer // 1000 if msg.ts_producer else None)
            tsb.append(msg.ts_broker // 1000 if msg.ts_broker else None)
            uids.append(msg.uid_text)
            vbs.append(msg.vbucket)
            epochs.append(str(msg.epoch))
            offsets.append(msg.offset)
        got.clear()
        arrays = [pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    assert benchmark(messages).num_rows == 1000


# ---------------------------------------------------------------- the server's scan loop


def _scan_buffer() -> tuple[bytes, int]:
    count = SCAN_BYTES // len(FRAME)
    return FRAME * count, count


def scan_route(data: bytes) -> int:
    """Frame boundaries and the routing read of every frame of one read."""
    n = len(data)
    pos = 0
    count = 0
    limit = DEFAULT_MAX_FRAME_BYTES
    route = route_message
    u32 = _u32
    while n - pos >= 4:
        size = u32(data, pos)[0]
        if size > limit:
            raise ValueError("frame too large")
        end = pos + 4 + size
        if end > n:
            break
        route(data, pos, end)
        count += 1
        pos = end
    return count


def scan_route_stamp(data: bytes) -> int:
    """As scan_route, plus the vbucket check and stamping ts_broker in a mutable copy."""
    out = bytearray(data)
    n = len(data)
    pos = 0
    count = 0
    limit = DEFAULT_MAX_FRAME_BYTES
    route = route_message
    u32 = _u32
    stamp = _stamp
    vb = vbucket_of
    now = time.time_ns()
    owned = range(0, 512)
    while n - pos >= 4:
        size = u32(data, pos)[0]
        if size > limit:
            raise ValueError("frame too large")
        end = pos + 4 + size
        if end > n:
            break
        kp, _key, ts_pos = route(data, pos, end)
        if vb(kp) in owned:
            stamp(out, ts_pos, now)
        count += 1
        pos = end
    return count


@pytest.mark.parametrize("loop", [scan_route, scan_route_stamp], ids=["route", "route+vbucket+stamp"])
def test_scan_1mib(benchmark, loop) -> None:  # type: ignore[no-untyped-def]
    data, count = _scan_buffer()
    benchmark.extra_info["messages"] = count
    benchmark.extra_info["frame_bytes"] = len(FRAME)
    assert benchmark(loop, data) == count


def test_scan_1mib_frame_reader(benchmark) -> None:  # type: ignore[no-untyped-def]
    # The same through FrameReader, which copies every frame out of its buffer.
    data, count = _scan_buffer()
    benchmark.extra_info["messages"] = count

    def loop() -> int:
        reader = FrameReader()
        reader.feed(data)
        n = 0
        while (frame := reader.next_frame()) is not NEED_DATA:
            route_message(frame, 0, len(frame))
            n += 1
        return n

    assert benchmark(loop) == count


# ---------------------------------------------------------------- the worker's read handler


class _NullTransport:
    """Just enough of a transport for Shard.feed: writes go nowhere."""

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: object) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # a lagging connection's (broky.server.shard.lag)


def _shard_and_read(subscribe: bool, loop: object) -> tuple[object, object, bytes, int]:
    """A one-worker Shard, a publisher connection and 1 MiB of SDK-style publishes:
    64 key_partitions in turn, each message with its own KSUID and timestamp."""
    from broky.client.encoder import PublishEncoder
    from broky.protocol import Subscribe
    from broky.server.config import ServerConfig
    from broky.server.shard.connection import Connection
    from broky.server.shard.core import Shard

    shard = Shard(ServerConfig(workers=1), 0, loop)  # type: ignore[arg-type]
    conn = Connection(shard, b"", 1)
    conn.transport = _NullTransport()  # type: ignore[assignment]
    if subscribe:
        shard.subscribe(conn, Subscribe(1, b"orders.>", None))
    encoder = PublishEncoder(DEFAULT_MAX_FRAME_BYTES)
    frames = []
    size = 0
    while size < SCAN_BYTES - 256:
        frame = encoder.encode(b"tenant-%d" % (len(frames) & 63), KEY, PAYLOAD, None)[0]
        frames.append(frame)
        size += len(frame)
    return shard, conn, b"".join(frames), len(frames)


@pytest.mark.parametrize("subscribe", [False, True], ids=["no-subscriber", "one-subscriber"])
def test_shard_feed_1mib(benchmark, subscribe) -> None:  # type: ignore[no-untyped-def]
    # The server's real per-read path (broky.server.shard.core.Shard.feed): framing,
    # the canonical routing read with every bound checked, the route cache,
    # stamping and queueing. Runs of one route are broken at every message here.
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        shard, conn, data, count = _shard_and_read(subscribe, loop)
        benchmark.extra_info["messages"] = count

        def feed() -> None:
            shard.feed(conn, data)  # type: ignore[attr-defined]
            conn.out.clear()  # type: ignore[attr-defined]
            conn.unflushed = 0  # type: ignore[attr-defined]

        benchmark(feed)
        stats = shard.stats  # type: ignore[attr-defined]
        assert stats.messages_published >= count
        assert stats.messages_delivered == (stats.messages_published if subscribe else 0)
    finally:
        loop.close()


def test_shard_feed_1mib_limited_user(benchmark) -> None:  # type: ignore[no-untyped-def]
    # test_shard_feed_1mib[one-subscriber] for a publisher whose user (--users) may publish
    # some keys only (broky.server.security.users): its publishes go through its own route cache,
    # so once a key is checked it costs what it costs anyone. Compare the two.
    import asyncio

    from broky.server.security.users import Users, WorkerUsers

    loop = asyncio.new_event_loop()
    try:
        shard, conn, data, count = _shard_and_read(True, loop)
        users = Users(
            {
                "users": {
                    "u": {
                        "password": "pbkdf2-sha256$1$AA==$AA==",
                        "publish": {"allow": ["orders.>"], "deny": ["x.>"]},
                    }
                }
            }
        )
        shard.users = WorkerUsers(users)  # type: ignore[attr-defined]
        conn.user = "u"  # type: ignore[attr-defined]
        conn.perms = shard.users.permissions("u")  # type: ignore[attr-defined]
        benchmark.extra_info["messages"] = count

        def feed() -> None:
            shard.feed(conn, data)  # type: ignore[attr-defined]
            conn.out.clear()  # type: ignore[attr-defined]
            conn.unflushed = 0  # type: ignore[attr-defined]

        benchmark(feed)
        stats = shard.stats  # type: ignore[attr-defined]
        assert stats.messages_delivered == stats.messages_published >= count
        assert not stats.permission_denied
    finally:
        loop.close()


def test_shard_feed_one_message(benchmark) -> None:  # type: ignore[no-untyped-def]
    # A read holding one message (a publisher at a low rate): the per-read costs
    # show here, among them committing the read's counters to the accounts table
    # (broky.server.accounts) before writing. One subscriber; per read.
    import asyncio

    from broky.client.encoder import PublishEncoder
    from broky.server.shard.connection import Connection

    loop = asyncio.new_event_loop()
    try:
        shard, conn, _, _ = _shard_and_read(True, loop)
        encoder = PublishEncoder(DEFAULT_MAX_FRAME_BYTES)
        frames = [encoder.encode(b"tenant-%d" % i, KEY, PAYLOAD, None)[0] for i in range(64)]
        publisher = Connection(shard, b"", 2)  # type: ignore[arg-type]
        publisher.transport = _NullTransport()  # type: ignore[assignment]
        for c in (publisher, conn):  # each has its secret (Arrivals.new_connection gives one)
            c.token = bytes(RESUME_TOKEN_BYTES)  # type: ignore[attr-defined]
        shard.book.open(publisher)  # type: ignore[attr-defined]
        shard.book.open(conn)  # type: ignore[attr-defined]
        benchmark.extra_info["messages"] = len(frames)

        def feed() -> None:
            for frame in frames:
                shard.feed(publisher, frame)  # type: ignore[attr-defined]
            conn.out.clear()  # type: ignore[attr-defined]
            conn.unflushed = 0  # type: ignore[attr-defined]

        benchmark(feed)
        assert shard.stats.messages_delivered >= len(frames)  # type: ignore[attr-defined]
    finally:
        loop.close()


BURST_READ = 128 << 10  # what a worker reads at once from an SDK publisher in a burst
TICK_EVERY = 64  # reads between two ticks' worth of replay work (trim_some): a tick is 0.25 s


def _burst_read(encoder: Any, names: list[bytes]) -> tuple[bytes, int]:
    """A read of SDK publishes in a burst (BURST_READ bytes, round robin over the key_partitions
    `names`), and how many messages it holds."""
    frames, size, i = [], 0, 0
    while size < BURST_READ - 256:
        frame = encoder.encode(names[i % len(names)], KEY, PAYLOAD, None)[0]
        frames.append(frame)
        size += len(frame)
        i += 1
    return b"".join(frames), len(frames)


@pytest.mark.parametrize("partitions", [1, 256, 4096])
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_shard_feed_burst_read(benchmark, replay, partitions) -> None:  # type: ignore[no-untyped-def]
    # A read of SDK publishes in a burst (128 KiB, over `partitions` key_partitions, one
    # subscriber on all), as the worker gets it: the copy that is stamped and, with the replay
    # buffer on (the default, 64 MiB), that copy retained, the oldest evicted once it is full,
    # each message's index entry, and every TICK_EVERY reads the tick's trim. Per read.
    import asyncio

    from broky.client.encoder import PublishEncoder
    from broky.protocol import Subscribe
    from broky.server.config import ServerConfig
    from broky.server.shard.connection import Connection
    from broky.server.shard.core import Shard

    loop = asyncio.new_event_loop()
    try:
        config = ServerConfig(workers=1) if replay else ServerConfig(workers=1, replay_bytes=0)
        shard = Shard(config, 0, loop)
        conn = Connection(shard, b"", 1)
        conn.transport = _NullTransport()  # type: ignore[assignment]
        shard.subscribe(conn, Subscribe(1, b"orders.>", None))
        encoder = PublishEncoder(DEFAULT_MAX_FRAME_BYTES)
        names = [b"tenant-%d" % i for i in range(partitions)]
        for i in range(0, partitions, 256):  # every route cached, as in a burst that goes on
            shard.feed(conn, b"".join(encoder.encode(kp, KEY, PAYLOAD, None)[0] for kp in names[i : i + 256]))
        data, count = _burst_read(encoder, names)
        benchmark.extra_info["messages"] = count
        reads = [0]

        def feed() -> None:
            shard.feed(conn, data)
            conn.out.clear()
            conn.unflushed = 0
            reads[0] += 1
            if shard.replay is not None and reads[0] % TICK_EVERY == 0:
                shard.replay.trim_some()

        benchmark(feed)
        assert shard.stats.messages_delivered == shard.stats.messages_published
        assert (shard.replay is not None) == replay
    finally:
        loop.close()


def _subscriber_and_publisher(loop: Any, pattern: bytes) -> tuple[Any, Any, Any, Any]:
    """A one-worker Shard with a subscriber to `pattern` (connection 1) and a publisher
    (connection 2), both on transports that write nowhere, and an SDK encoder."""
    from broky.client.encoder import PublishEncoder
    from broky.protocol import Subscribe
    from broky.server.config import ServerConfig
    from broky.server.shard.connection import Connection
    from broky.server.shard.core import Shard

    shard = Shard(ServerConfig(workers=1), 0, loop)
    conn = Connection(shard, b"", 1)
    conn.transport = _NullTransport()  # type: ignore[assignment]
    shard.subscribe(conn, Subscribe(1, pattern, None))
    publisher = Connection(shard, b"", 2)
    publisher.transport = _NullTransport()  # type: ignore[assignment]
    return shard, conn, publisher, PublishEncoder(DEFAULT_MAX_FRAME_BYTES)


@pytest.mark.parametrize("pattern", [b">", b"orders.>"], ids=["every-key", "filtered"])
def test_shard_feed_burst_read_lagging(benchmark, pattern) -> None:  # type: ignore[no-untyped-def]
    # The same read as test_shard_feed_burst_read (256 key_partitions, replay on), to a subscriber
    # that lags (broky.server.shard.lag): each refused message is noted as owed, one offset per
    # vbucket for `>` once sealed, ranges of offsets for any other pattern (compiled with the read
    # path). Per read: against the "replay-256" case of that benchmark, the cost of lagging.
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        shard, conn, publisher, encoder = _subscriber_and_publisher(loop, pattern)
        names = [b"tenant-%d" % i for i in range(256)]
        shard.feed(publisher, b"".join(encoder.encode(kp, KEY, PAYLOAD, None)[0] for kp in names))
        data, count = _burst_read(encoder, names)
        benchmark.extra_info["messages"] = count
        conn.limit = conn.cap = 64 << 10
        conn.paused = True  # its client's Pause: it never drains, so it lags from the first read on
        shard.feed(publisher, data)
        assert conn.lag is not None
        loop.run_until_complete(asyncio.sleep(0))  # (its seal, for `>`)
        reads = [0]

        def feed() -> None:
            shard.feed(publisher, data)
            reads[0] += 1
            if reads[0] % TICK_EVERY == 0:
                assert shard.replay is not None
                shard.replay.trim_some()

        benchmark(feed)
        assert conn.lag is not None and conn.lag.count > 0
    finally:
        loop.close()


LAG_BURST_READS = 16  # reads of BURST_READ a lagging subscriber is owed (about 2 MiB)


@pytest.mark.parametrize("partitions", [1, 256])
@pytest.mark.parametrize("pattern", [b">", b"orders.>"], ids=["every-key", "filtered"])
def test_lag_catch_up(benchmark, pattern, partitions) -> None:  # type: ignore[no-untyped-def]
    # A subscriber past its bound (broky.server.shard.lag) is owed LAG_BURST_READS burst reads
    # of SDK publishes; timed: its catch-up from the replay buffer, batch after batch (each
    # queued and written), until it is live again. Per message served: the "messages" below.
    # A subscriber to `>` is owed every offset from a point on; any other pattern notes the
    # offsets it was refused (the cost of that noting is in the setup, on the read path).
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        shard, conn, publisher, encoder = _subscriber_and_publisher(loop, pattern)
        data, count = _burst_read(encoder, [b"tenant-%d" % i for i in range(partitions)])
        benchmark.extra_info["messages"] = count * LAG_BURST_READS

        def lagging() -> tuple[tuple[()], dict[str, object]]:
            conn.limit = conn.cap = 64 << 10
            conn.paused = True  # its client's Pause: what it is sent stays queued, up to its bound
            for _ in range(LAG_BURST_READS):
                shard.feed(publisher, data)
            assert conn.lag is not None
            conn.out.clear()
            conn.unflushed = 0
            conn.paused = False
            if conn.lag.every_key:
                conn.lag.scheduled = False
                shard.lag.seal(conn)  # (its first batch too)
            return (), {}

        def catch_up() -> None:
            while conn.lag is not None:
                shard.lag.pump(conn)
                shard.flush()

        benchmark.pedantic(catch_up, setup=lagging, rounds=30)
        assert shard.stats.lag_evicted == 0 and shard.stats.lag_served > 0
    finally:
        loop.close()


# ---------------------------------------------------------------- baseline: generated code


def _builder_encode() -> bytes:
    b = flatbuffers.Builder(256)
    pay = b.CreateByteVector(PAYLOAD)
    key = b.CreateByteVector(KEY)
    kp = b.CreateByteVector(KP)
    fbs.MessageStart(b)
    fbs.MessageAddKeyPartition(b, kp)
    fbs.MessageAddKey(b, key)
    fbs.MessageAddPayload(b, pay)
    fbs.MessageAddStamps(b, fbs.CreateStamps(b, TS, 0, 0, 0, 0))
    fbs.MessageAddUid(b, fbs.CreateKsuid(b, UID))
    body = fbs.MessageEnd(b)
    fbs.FrameStart(b)
    fbs.FrameAddBodyType(b, Body.Message)
    fbs.FrameAddBody(b, body)
    b.FinishSizePrefixed(fbs.FrameEnd(b), b"BRKY")
    return bytes(b.Output())


def test_baseline_builder_encode(benchmark) -> None:  # type: ignore[no-untyped-def]
    assert decode_message(benchmark(_builder_encode)).payload == PAYLOAD


def _generated_route(frame: bytes) -> tuple[bytes, bytes]:
    root = fbs.Frame.GetRootAs(frame, 4)
    tab = root.Body()
    msg = fbs.Message()
    msg.Init(tab.Bytes, tab.Pos)
    return msg.KeyPartitionAsNumpy().tobytes(), msg.KeyAsNumpy().tobytes()


def test_baseline_generated_route(benchmark) -> None:  # type: ignore[no-untyped-def]
    assert benchmark(_generated_route, FRAME) == (KP, KEY)


# ---------------------------------------------------------------- control frames, KSUID


def test_encode_ping(benchmark) -> None:  # type: ignore[no-untyped-def]
    benchmark(encode_frame, Ping(7))


def test_decode_ping(benchmark) -> None:  # type: ignore[no-untyped-def]
    raw = encode_frame(Ping(7))
    assert benchmark(decode_frame, raw) == Ping(7)


def test_new_ksuid(benchmark) -> None:  # type: ignore[no-untyped-def]
    assert len(benchmark(new_ksuid)) == 20


def test_ksuid_text(benchmark) -> None:  # type: ignore[no-untyped-def]
    assert len(benchmark(ksuid_text, UID)) == 27


def test_vbucket_of(benchmark) -> None:  # type: ignore[no-untyped-def]
    assert 0 <= benchmark(vbucket_of, KP) < 1024


# ---------------------------------------------------------------- matcher


def _matcher(cache_size: int) -> Matcher[int, list[int]]:
    """1,000 subscriptions: 900 literal keys, 50 `*` and 50 `>` patterns."""
    m: Matcher[int, list[int]] = Matcher(list, cache_size=cache_size)
    regions = [b"eu", b"us", b"ap", b"sa", b"af"]
    item = 0
    for i in range(900):
        m.add(b"orders.%s.k%d" % (regions[i % 5], i), item)
        item += 1
    for i in range(50):
        m.add(b"orders.*.k%d" % i, item)
        m.add(b"orders.%s.>" % regions[i % 5], item + 1)
        item += 2
    return m


def test_match_warm_cache(benchmark) -> None:  # type: ignore[no-untyped-def]
    m = _matcher(65536)
    m.match(b"orders.eu.k0")
    assert len(benchmark(m.match, b"orders.eu.k0")) == 12


def test_match_cold(benchmark) -> None:  # type: ignore[no-untyped-def]
    # A cache of one entry and two alternating keys: every call walks the trie.
    m = _matcher(1)
    keys = [b"orders.eu.k0", b"orders.us.k1"]
    state = [0]

    def cold() -> list[int]:
        state[0] ^= 1
        return m.match(keys[state[0]])

    benchmark(cold)
    assert m.cache_hits == 0
