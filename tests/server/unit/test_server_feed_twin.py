"""The compiled twin of the fan-out fast path is held to the pure-Python reference.

`Shard.feed` runs the canonical Messages with a cached route through
`broky.server.shard._feedscan` when it is built (broky.server.shard.fastpath) and through
its own Python loop otherwise. Two Shards, one of each, get the same reads
(valid and mutated publishes in both layouts, Pings, subscription changes
between reads, vbuckets this worker does not own, pending bounds small enough
to drop, arbitrary cuts) at the same clock. Every connection must receive the
same bytes and end in the same state, and every counter must agree.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broky.protocol import (
    RESUME_TOKEN_BYTES,
    Ack,
    FrameReader,
    Message,
    Ping,
    Subscribe,
    Unsubscribe,
    decode_frame,
    decode_message,
    encode_frame,
    encode_message,
    new_ksuid,
)
from broky.protocol.frames import Position
from broky.protocol.routing import vbucket_of
from broky.server.config import ServerConfig
from broky.server.shard import fastpath
from broky.server.shard.connection import Connection
from broky.server.shard.core import Shard
from broky.server.shard.sequences import ENTRY_WORDS
from tests.support.shardkit import Recorder, chunked

if fastpath.compiled_scan is None and fastpath.pure_requested():
    pytest.skip(f"{fastpath.ENV_PURE} is set: no compiled twin to compare", allow_module_level=True)


def test_the_compiled_twin_is_built() -> None:
    # `pip install -e .` builds it wherever there is a C compiler (CI has one); the
    # server would run several times slower without it (and say so).
    assert fastpath.compiled_scan is not None, fastpath.description
    assert fastpath.description == "compiled"


# Partitions on both workers of a two-worker node: worker 0 refuses some (NOT_MY_VBUCKET).
PARTS = [b"p1", b"p2", b"tenant-7", b"tenant-8", b"p" * 40, b""]
KEYS = [b"k.a", b"k.b", b"k.a.c", b"other", b"k." + b"x" * 300]
PATTERNS = [(b"k.>", None), (b"k.a", b"p1"), (b"k.*", b"tenant-7"), (b"other", None), (b">", b"p2")]

message = st.tuples(
    st.sampled_from(PARTS), st.sampled_from(KEYS), st.binary(max_size=40), st.booleans(), st.booleans()
).map(
    lambda m: (
        encode_message(m[0], m[1], m[2], ts_producer=7, uid=new_ksuid() if m[3] else None)
        if m[4]  # the canonical layout (what the SDK writes), else the generic encoder's
        else encode_frame(Message(m[0], m[1], m[2], ts_producer=7, uid=new_ksuid() if m[3] else None))
    )
)
control = st.one_of(
    st.builds(lambda i: encode_frame(Ping(i)), st.integers(0, 1 << 32)),
    st.builds(lambda i: encode_frame(Subscribe(100 + i, *PATTERNS[i])), st.integers(0, len(PATTERNS) - 1)),
    st.builds(lambda i: encode_frame(Unsubscribe(100 + i)), st.integers(0, len(PATTERNS) - 1)),
    # Consumer groups (broky.server.shard.groups): their routes take the Python loop, which both run.
    st.builds(
        lambda i, shared: encode_frame(Subscribe(200 + i, *PATTERNS[i], group="g", key_shared=shared)),
        st.integers(0, len(PATTERNS) - 1),
        st.booleans(),
    ),
    st.builds(lambda i: encode_frame(Unsubscribe(200 + i)), st.integers(0, len(PATTERNS) - 1)),
    st.builds(
        lambda i: encode_frame(Subscribe(300 + i, *PATTERNS[i], group="a", ack=True, max_in_flight=3)),
        st.integers(0, len(PATTERNS) - 1),
    ),
    # Acks of positions that may or may not be in flight (offsets count from 1 in epoch 0x5EED).
    st.builds(
        lambda i, kind, vb, offset, delay: encode_frame(
            Ack(300 + i, kind, (Position(vb, 0x5EED, offset),), delay)
        ),
        st.integers(0, len(PATTERNS) - 1),
        st.integers(0, 3),
        st.sampled_from([vbucket_of(p) for p in PARTS]),
        st.integers(0, 4),
        st.sampled_from([-1, 0, 5]),
    ),
)
stream = st.lists(st.one_of(message, message, message, control), min_size=1, max_size=60)


def build(loop: asyncio.AbstractEventLoop, compiled: bool, pending: int) -> tuple[Shard, list[Connection]]:
    config = ServerConfig(workers=2, node_id="twin", max_pending_bytes=pending)
    shard = Shard(config, 0, loop, compiled=compiled)
    for vb in range(1024):  # one epoch for both shards (each incarnation draws its own)
        shard.seqs.view[ENTRY_WORDS * vb] = 0x5EED

    def connection(i: int) -> Connection:
        c = Connection(shard, b"", i)
        c.transport = Recorder()  # type: ignore[assignment]
        c.token = bytes(RESUME_TOKEN_BYTES)  # its secret (Arrivals.new_connection gives a random one)
        shard.conns[i] = c
        shard.book.open(c)
        return c

    subs = [connection(1), connection(2), connection(3)]
    shard.subscribe(subs[0], Subscribe(1, b"k.>", None))
    shard.subscribe(subs[1], Subscribe(1, b"k.a", b"p1"))
    shard.subscribe(subs[1], Subscribe(2, b">", b"tenant-7"))
    # Two groups on k.>, each over connections 1 and 2 (3 watches everything in one test).
    for c in subs[:2]:
        shard.subscribe(c, Subscribe(5, b"k.>", group="lb"))
        shard.subscribe(c, Subscribe(6, b"k.>", group="ks", key_shared=True))
    return shard, [*subs, connection(4)]  # the last one publishes (and subscribes in the stream)


def outcome(shard: Shard, conns: list[Connection]) -> dict[str, Any]:
    snap = shard.snapshot()
    for volatile in ("rss_bytes", "pid"):
        snap.pop(volatile)
    assert shard.replay is not None
    shard.replay.settle()  # each shard's own settle: the Python loop or its compiled twin
    return {
        "stats": snap,
        "sequences": bytes(shard.seqs.state),  # every vbucket's epoch, next offset and last stamp
        "replay": [bytes(ix) for ix in shard.replay.index],  # where each retained message lies
        "segments": [(seg_id, bytes(seg)) for seg_id, seg, _, _ in shard.replay.segments],
        "conns": [
            (
                bytes(c.transport.data),  # type: ignore[attr-defined]
                c.state,
                c.msgs_in,
                c.msgs_out,
                c.dropped,
                c.rest,
            )
            for c in conns
        ],
    }


def run_both(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch, reads: list[bytes], pending: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    import broky.server.shard.core as fanout

    monkeypatch.setattr(fanout, "_time_ns", lambda: 1_700_000_000_123_456_789)
    monkeypatch.setattr(fanout, "_monotonic", lambda: 1000.0)
    results = []
    for compiled in (False, True):
        shard, conns = build(loop, compiled, pending)
        for read in reads:
            shard.feed(conns[-1], read)
        results.append(outcome(shard, conns))
    return results[0], results[1]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=stream,
    cuts=st.lists(st.integers(0, 1 << 16), max_size=6),
    pending=st.sampled_from([64 << 20, 4096, 700]),
)
def test_valid_streams_give_the_same_deliveries_drops_and_replies(
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    frames: list[bytes],
    cuts: list[int],
    pending: int,
) -> None:
    reads = chunked(b"".join(frames), cuts)
    reference, twin = run_both(loop, monkeypatch, reads, pending)
    assert twin == reference


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=stream,
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=4),
    pending=st.sampled_from([64 << 20, 2048]),
)
def test_mutated_streams_give_the_same_outcome(
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    frames: list[bytes],
    edits: list[tuple[int, int]],
    cuts: list[int],
    pending: int,
) -> None:
    data = bytearray(b"".join(frames))
    for at, value in edits:
        data[at % len(data)] = value
    reference, twin = run_both(loop, monkeypatch, chunked(bytes(data), cuts), pending)
    assert twin == reference


def test_a_large_read_of_many_partitions_agrees(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK's traffic: thousands of uid'd messages over 256 key_partitions in 64 KiB reads.
    frames = [
        encode_message(
            b"tenant-%d" % (i & 255), KEYS[i % 3], b"x" * (i % 120), ts_producer=i, uid=new_ksuid()
        )
        for i in range(5000)
    ]
    reads = chunked(b"".join(frames), list(range(0, 1 << 20, 65536)))
    reference, twin = run_both(loop, monkeypatch, reads, 64 << 20)
    assert twin == reference
    shard, _ = build(loop, False, 64 << 20)
    owned = sum(1 for i in range(5000) if shard.accepts[vbucket_of(b"tenant-%d" % (i & 255))])
    assert 0 < owned < 5000
    assert reference["stats"]["messages_published"] == 5000
    assert reference["stats"]["dropped"]["not_my_vbucket"] == 5000 - owned


def test_the_pure_python_choice_is_honoured() -> None:
    import subprocess
    import sys

    probe = (
        "from broky.server.shard import fastpath; print(fastpath.compiled_scan is None, fastpath.description)"
    )
    env = {**os.environ, fastpath.ENV_PURE: "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"True pure Python ({fastpath.ENV_PURE} is set)"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=stream, cuts=st.lists(st.integers(0, 1 << 16), max_size=6), compiled=st.booleans())
def test_every_accepted_message_gets_the_next_offset_of_its_vbucket_and_is_retained(
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    frames: list[bytes],
    cuts: list[int],
    compiled: bool,
) -> None:
    """Per vbucket, the offsets a worker stamps count its accepted messages from 1, with
    no gap, under one epoch; a subscriber on everything receives them in that order; and
    the replay buffer holds exactly those messages, stamped as delivered."""
    import broky.server.shard.core as fanout

    monkeypatch.setattr(fanout, "_time_ns", lambda: 1_700_000_000_123_456_789)
    shard, conns = build(loop, compiled, 64 << 20)
    watcher = conns[2]  # subscribes to every key here: sid 3, pattern ">"
    shard.subscribe(watcher, Subscribe(3, b">", None))
    for read in chunked(b"".join(frames), cuts):
        shard.feed(conns[-1], read)
    reader = FrameReader()
    reader.feed(bytes(watcher.transport.data))  # type: ignore[attr-defined]
    delivered: dict[int, list[Message]] = {}
    for raw in reader.frames():
        frame = decode_frame(raw)
        if isinstance(frame, Message):
            delivered.setdefault(frame.vbucket, []).append(frame)
    assert shard.replay is not None
    for vb in range(1024):
        msgs = delivered.get(vb, [])
        assert vbucket_of_all(msgs, vb)
        assert [m.offset for m in msgs] == list(range(1, len(msgs) + 1))
        assert {m.epoch for m in msgs} <= {0x5EED}
        assert shard.seqs.next_of(vb) == len(msgs) + 1  # nothing accepted that it did not get
        retained = [decode_frame(bytes(seg[a:b])) for seg, a, b in shard.replay.read(vb, 1, 1 << 62)]
        assert retained == msgs


def vbucket_of_all(msgs: list[Message], vb: int) -> bool:
    return all(vbucket_of(m.key_partition) == vb for m in msgs)


def test_a_read_of_one_key_partition_goes_straight_to_the_index_and_a_mixed_one_to_the_log(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # The compiled path's shortcut (broky.server.shard.replay, "log"): while nothing waits in the log,
    # the messages of one vbucket go straight to its index; any other vbucket sends the rest of
    # the read to the log. Either way the index holds every message, in offset order.
    shard, conns = build(loop, True, 64 << 20)  # ("other": no group's key, the compiled path's)
    assert shard.replay is not None
    a, b = [kp for kp in (b"tenant-%d" % i for i in range(100)) if shard.accepts[vbucket_of(kp)]][:2]
    va, vb = vbucket_of(a), vbucket_of(b)
    one = [encode_message(a, b"other", b"%d" % i, ts_producer=7) for i in range(40)]
    shard.feed(conns[-1], one[0])  # the route is met first here: the Python path (logged)
    shard.replay.settle()
    shard.feed(conns[-1], b"".join(one[1:]))
    assert va != vb and not shard.replay.log
    assert len(shard.replay.index[va]) == 8 * 40
    mixed = [encode_message((a, b)[i % 2], b"other", b"m%d" % i, ts_producer=7) for i in range(20)]
    shard.feed(conns[-1], mixed[1])  # b's route is met first: the Python path (logged)
    shard.replay.settle()
    shard.feed(conns[-1], b"".join(mixed[2:]))
    assert len(shard.replay.log) == 16 * 17  # the first went to a's index, then b: the log
    got = [decode_message(bytes(seg[x:y])).payload for seg, x, y in shard.replay.read(va, 1, 1 << 62)]
    assert got == [b"%d" % i for i in range(40)] + [b"m%d" % i for i in range(2, 20, 2)]
    assert shard.replay.count(vb) == 10 and not shard.replay.log
