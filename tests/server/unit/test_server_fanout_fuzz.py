"""Fuzzing the worker's read handler, `Shard.feed`, which parses publishes by hand.

The Shard is the real one (broky.server.shard.core); only its transports are
in-memory recorders (tests/support/shardkit.py). Whatever bytes a publisher sends, in whatever chunks:
feed raises nothing, every frame a subscriber receives decodes as a valid
Message (or a LossNotice), and a publisher either stays open or receives one
fatal Error and is closed. Unmutated streams are delivered exactly, and read
back exactly by a bounded read (broky.server.shard.positions), which mutated streams
may carry too. Every
test runs on both implementations of the fast path: the pure-Python reference
and its compiled twin (broky.server.shard.fastpath; tests/server/unit/test_server_feed_twin.py
holds the two to each other).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broky.errors import ErrorCode, ProtocolError
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import (
    VBUCKETS,
    Error,
    LossNotice,
    Message,
    Ping,
    Read,
    ReadDone,
    Replay,
    Subscribe,
    decode_frame,
    encode_frame,
    encode_message,
    new_ksuid,
    vbucket_of,
)
from broky.protocol.frames import Position
from broky.server.shard import fastpath
from broky.server.shard.connection import CLOSING, OPEN, Connection
from broky.server.shard.core import Shard
from tests.support.shardkit import attach, chunked, shard_with


@pytest.fixture(params=[False, True], ids=["pure-python", "compiled"])
def compiled(request: pytest.FixtureRequest) -> bool:
    """The fast path a test runs: the pure-Python reference, then its compiled twin."""
    if request.param and fastpath.compiled_scan is None:
        pytest.skip(f"no compiled fast path: {fastpath.description}")
    return bool(request.param)


def fuzz_shard(loop: asyncio.AbstractEventLoop, compiled: bool) -> tuple[Shard, Connection, list[Connection]]:
    return shard_with(loop, [(b"k.>", None), (b"k.a", b"p1")], node_id="fuzz", compiled=compiled)


KEYS = st.sampled_from([b"k.a", b"k.b", b"k.a.c", b"other"])
PARTS = st.sampled_from([b"p1", b"p2", b"p" * 40])
PART_VBUCKETS = sorted({vbucket_of(kp) for kp in (b"p1", b"p2", b"p" * 40)})
MESSAGES = st.lists(
    st.tuples(PARTS, KEYS, st.binary(max_size=40), st.booleans()), min_size=1, max_size=30
).map(
    lambda ms: [
        encode_message(kp, key, pay, ts_producer=7, uid=new_ksuid() if u else None) for kp, key, pay, u in ms
    ]
)


def check_outputs(subs: list[Connection], publisher: Connection) -> list[list[Message]]:
    got = []
    for s in subs:
        frames = s.transport.frames()  # type: ignore[attr-defined]
        assert all(isinstance(f, Message | LossNotice) for f in frames), frames
        got.append([f for f in frames if isinstance(f, Message)])
    replies = publisher.transport.frames()  # type: ignore[attr-defined]
    fatal = [f for f in replies if isinstance(f, Error) and f.fatal]
    if publisher.state == OPEN:
        assert not fatal
    else:
        assert publisher.state == CLOSING and len(fatal) == 1 and replies[-1] is fatal[0]
    return got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=MESSAGES, cuts=st.lists(st.integers(0, 1 << 16), max_size=6))
def test_valid_streams_are_delivered_exactly(
    loop: asyncio.AbstractEventLoop, compiled: bool, frames: list[bytes], cuts: list[int]
) -> None:
    shard, publisher, subs = fuzz_shard(loop, compiled)
    data = b"".join(frames)
    for chunk in chunked(data, cuts):
        shard.feed(publisher, chunk)
    got = check_outputs(subs, publisher)
    assert publisher.state == OPEN
    sent = [m for m in (decode_frame(f) for f in frames) if isinstance(m, Message)]
    want_all = [m for m in sent if m.key.startswith(b"k.")]
    want_one = [m for m in sent if m.key == b"k.a" and m.key_partition == b"p1"]
    for received, wanted in zip(got, (want_all, want_one)):
        assert [(m.key_partition, m.key, m.payload, m.uid) for m in received] == [
            (m.key_partition, m.key, m.payload, m.uid) for m in wanted
        ]
        assert all(m.ts_broker > 0 and m.ts_producer == 7 for m in received)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=MESSAGES,
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=4),
    ping=st.booleans(),
    read=st.none() | st.sampled_from([(), (vbucket_of(b"p1"), VBUCKETS - 1)]),  # a Read, its vbuckets
    shrink=st.one_of(st.none(), st.tuples(st.integers(0, 1 << 16), st.integers(1, 64))),
)
def test_mutated_streams_never_escape_the_protocol(
    loop: asyncio.AbstractEventLoop,
    compiled: bool,
    frames: list[bytes],
    edits: list[tuple[int, int]],
    cuts: list[int],
    ping: bool,
    read: tuple[int, ...] | None,
    shrink: tuple[int, int] | None,
) -> None:
    shard, publisher, subs = fuzz_shard(loop, compiled)
    if shrink is not None:  # one frame's size prefix claims fewer bytes than it has
        i, by = shrink[0] % len(frames), shrink[1]
        size = int.from_bytes(frames[i][:4], "little")
        frames[i] = max(size - by, 0).to_bytes(4, "little") + frames[i][4:]
    tail = (encode_frame(Read(1, b"k.>", vbuckets=read)) if read is not None else b"") + (
        encode_frame(Ping(1)) if ping else b""
    )
    data = bytearray(b"".join(frames) + tail)
    for at, value in edits:
        data[at % len(data)] = value
    for chunk in chunked(bytes(data), cuts):
        shard.feed(publisher, chunk)  # must not raise
    for _ in range(3):  # what follows a Read waits for a turn of the loop (broky.server.shard.positions)
        loop.run_until_complete(asyncio.sleep(0))
    try:
        check_outputs(subs, publisher)
    except ProtocolError as exc:  # pragma: no cover - the failure this test looks for
        raise AssertionError(f"a subscriber or the publisher got an undecodable frame: {exc}") from exc


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=MESSAGES,
    pattern=st.sampled_from([b">", b"k.>", b"k.a", b"*.b"]),
    kp=st.none() | PARTS,
    vbuckets=st.lists(st.sampled_from([*PART_VBUCKETS, 0, VBUCKETS - 1]), unique=True, max_size=3),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=4),
)
def test_a_bounded_read_returns_what_was_accepted(
    loop: asyncio.AbstractEventLoop,
    compiled: bool,
    frames: list[bytes],
    pattern: bytes,
    kp: bytes | None,
    vbuckets: list[int],
    cuts: list[int],
) -> None:
    # Whichever path stamped and retained them, the messages a publisher sent are read
    # back as they were delivered: those that match, in offset order per vbucket.
    shard, publisher, subs = fuzz_shard(loop, compiled)
    for chunk in chunked(b"".join(frames), cuts):
        shard.feed(publisher, chunk)
    delivered = check_outputs(subs, publisher)[0]  # `k.>` on every key_partition
    reader = attach(shard, 9)
    shard.feed(reader, encode_frame(Read(5, pattern, kp, vbuckets=tuple(vbuckets))))
    for _ in range(10):  # the batches after the first one run on call_soon
        loop.run_until_complete(asyncio.sleep(0))
    got = reader.transport.frames()  # type: ignore[attr-defined]
    if kp is not None and vbuckets and vbucket_of(kp) not in vbuckets:  # refused, nothing else
        assert [(f.code, f.rid, f.fatal) for f in got if isinstance(f, Error)] == [
            (ErrorCode.BAD_POSITION, 5, False)
        ]
        assert len(got) == 1
        return
    covers = {vbucket_of(kp)} if kp is not None else set(vbuckets or range(VBUCKETS))
    dones = [f for f in got if isinstance(f, ReadDone)]
    assert [d.remaining for d in dones] == list(range(len(dones) - 1, -1, -1))
    assert [d.vbucket for d in dones] == sorted(covers) and all(d.rid == 5 for d in dones)
    read = [f for f in got if isinstance(f, Message)]
    assert sum(f.messages for f in got if isinstance(f, Replay)) == len(read)
    sent = [decode_frame(f) for f in frames]
    tokens = parse_pattern(pattern)
    want = [
        m
        for m in sent
        if isinstance(m, Message)
        and pattern_matches(tokens, m.key)
        and kp in (None, m.key_partition)
        and vbucket_of(m.key_partition) in covers
    ]
    want.sort(key=lambda m: vbucket_of(m.key_partition))  # stable: publish order within a vbucket
    assert [(m.key_partition, m.key, m.payload, m.uid) for m in read] == [
        (m.key_partition, m.key, m.payload, m.uid) for m in want
    ]
    stamped = {(m.vbucket, m.offset): m for m in delivered}
    for m in read:  # byte for byte what was delivered (those `k.>` got), stamps included
        assert m.vbucket == vbucket_of(m.key_partition)
        if (m.vbucket, m.offset) in stamped:
            assert m == stamped[m.vbucket, m.offset]


def test_the_shape_cache_is_bounded_and_every_shape_routes(
    loop: asyncio.AbstractEventLoop, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shapes (size, offsets, key_partition length) are cached per worker; a publisher
    # cycling through more shapes than the cache holds only costs it refills.
    import broky.server.shard.core as fanout

    monkeypatch.setattr(fanout, "SHAPE_CACHE_SIZE", 16)
    shard, publisher, subs = fuzz_shard(loop, compiled)
    sent = [
        encode_message(b"p1", b"k.a", bytes(n), ts_producer=7, uid=new_ksuid() if n % 2 else None)
        for n in range(100)
    ]
    shard.feed(publisher, b"".join(sent) * 2)
    assert all(len(shapes) <= 16 for shapes in shard.shapes)
    got = check_outputs(subs, publisher)
    assert publisher.state == OPEN
    want = [decode_frame(f) for f in sent] * 2
    for received in got:
        assert [(m.payload, m.uid) for m in received] == [(m.payload, m.uid) for m in want]  # type: ignore[union-attr]


POSITIONS = st.lists(
    st.builds(Position, st.integers(0, 65535), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    max_size=6,
).map(tuple)
STARTS = st.builds(
    lambda *fields: Subscribe(*fields),  # these fields only (builds would draw the others too)
    st.integers(1, 5),
    st.sampled_from([b"k.>", b">", b"k.*", b"other"]),
    st.none() | PARTS,
    POSITIONS,
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 2**32 - 1),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=MESSAGES,
    starts=st.lists(STARTS, min_size=1, max_size=3),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=3),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=4),
)
def test_starts_from_any_position_never_escape_the_protocol(
    loop: asyncio.AbstractEventLoop,
    compiled: bool,
    frames: list[bytes],
    starts: list[Subscribe],
    edits: list[tuple[int, int]],
    cuts: list[int],
) -> None:
    # Publishes, then Subscribes naming any positions, times and counts (valid or not,
    # of vbuckets that exist or not), some bytes changed: the worker answers with frames
    # a client can read, or one fatal Error, and serves the other connections on.
    shard, publisher, subs = fuzz_shard(loop, compiled)
    data = bytearray(b"".join(frames) + b"".join(encode_frame(s) for s in starts))
    for at, value in edits:
        data[at % len(data)] = value
    for chunk in chunked(bytes(data), cuts):
        shard.feed(publisher, chunk)  # must not raise
    for _ in range(3):  # what follows a Read waits for a turn of the loop (broky.server.shard.positions)
        loop.run_until_complete(asyncio.sleep(0))
    try:
        check_outputs(subs, publisher)
    except ProtocolError as exc:  # pragma: no cover - the failure this test looks for
        raise AssertionError(f"a connection got an undecodable frame: {exc}") from exc
    other = subs[0]
    shard.feed(subs[1], encode_message(b"p2", b"k.after", b"still", ts_producer=7))
    assert [m.payload for m in other.transport.frames() if isinstance(m, Message)][-1:] == [b"still"]  # type: ignore[attr-defined]
