"""What a subscriber receives is what was published, with only its stamps set.

The worker's read handler (a real broky.server.shard.core.Shard, with in-memory
transports from tests/support/shardkit.py) stamps canonical Message
frames in place and forwards a canonical copy of any other layout. For every
Message frame it accepts, in any layout (the codec's, flatbuffers.Builder's
with drawn choices, mutated ones, a frame crafted against stamp probes), each
subscriber must decode exactly the publisher's message with ts_broker set to
the read's time and its position (its vbucket, the vbucket's epoch, the next
offset of that vbucket) set, in publish order.
"""

from __future__ import annotations

import asyncio
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broky.errors import ProtocolError
from broky.protocol import (
    Error,
    Frame,
    LossNotice,
    LossReason,
    Message,
    decode_frame,
    encode_message,
)
from broky.protocol.routing import vbucket_of
from broky.server.shard.connection import OPEN, Connection
from broky.server.shard.core import Shard
from broky.server.shard.stats import DropReason
from tests.support.generated import builder_frames, messages
from tests.support.mutations import OVERLAP_MESSAGE, mutate, mutation, overlap_frame
from tests.support.shardkit import received, shard_with


def forwarding_shard(
    loop: asyncio.AbstractEventLoop, replay_bytes: int | None = None
) -> tuple[Shard, Connection, Connection]:
    """One worker owning every vbucket, a publisher and a subscriber to every key."""
    shard, publisher, (subscriber,) = shard_with(
        loop, [(b">", None)], node_id="forwarding", replay_bytes=replay_bytes
    )
    return shard, publisher, subscriber


def outcome(raw: bytes) -> Frame | None:
    """What the publisher's frame says, or None if it is not a valid frame."""
    try:
        return decode_frame(raw)
    except ProtocolError:
        return None


def fix_prefix(frame: bytearray) -> bytes:
    """The frame with a size prefix matching its length (mutations may change it)."""
    if len(frame) >= 4:
        frame[:4] = (len(frame) - 4).to_bytes(4, "little")
    return bytes(frame)


layouts = st.one_of(
    messages.map(lambda m: (m, encode_message(*m))),
    builder_frames(messages),
    st.just((OVERLAP_MESSAGE, overlap_frame())),
)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=layouts, ops=st.lists(mutation, max_size=3))
def test_every_accepted_message_is_delivered_as_published(
    loop: asyncio.AbstractEventLoop,
    case: tuple[Frame, bytes],
    ops: list[tuple],  # type: ignore[type-arg]
) -> None:
    _, raw = case
    frame = bytearray(raw)
    for op in ops:
        frame = mutate(frame, op)
    middle = fix_prefix(frame)
    if len(middle) < 12:
        return  # no frame at all (a size prefix under 12 is refused before any parsing)
    first = encode_message(b"p0", b"first", b"1", 1, 0, None)
    last = encode_message(b"p0", b"last", b"3", 3, 0, bytes(20))
    shard, publisher, subscriber = forwarding_shard(loop)
    before = time.time_ns()
    shard.feed(publisher, first + middle + last)
    after = time.time_ns()

    got = received(subscriber)  # every frame decodes, or this raises
    assert all(isinstance(m, Message) for m in got)
    stamps = {m.ts_broker for m in got if isinstance(m, Message)}
    assert len(stamps) == 1 and before <= stamps.pop() <= after  # one time per read
    messages = [m for m in got if isinstance(m, Message)]
    assert all(m.vbucket == vbucket_of(m.key_partition) for m in messages)
    assert len({m.epoch for m in messages}) == 1
    offsets: dict[int, list[int]] = {}
    for m in messages:
        offsets.setdefault(m.vbucket, []).append(m.offset)
    assert all(o == list(range(1, len(o) + 1)) for o in offsets.values())  # nothing else was accepted
    unstamped = [m._replace(ts_broker=0, vbucket=0, epoch=0, offset=0) for m in messages]
    published = outcome(middle)
    refused = [f for f in received(publisher) if isinstance(f, Error) and f.fatal]
    if isinstance(published, Message):
        # A valid Message is always accepted, and delivered between its neighbours.
        assert not refused and publisher.state == OPEN
        assert unstamped == [
            decode_frame(first),
            published._replace(ts_broker=0, vbucket=0, epoch=0, offset=0),
            decode_frame(last),
        ]
    elif refused:
        assert unstamped == [decode_frame(first)]  # nothing after the refused frame
    else:  # a valid control frame
        assert unstamped == [decode_frame(first), decode_frame(last)]


def test_the_crafted_overlap_frame_reaches_subscribers_intact(loop: asyncio.AbstractEventLoop) -> None:
    # The audit's frame: stamped in place it would read as key x.y (or not at
    # all) once the real time is stamped. The server forwards a canonical copy.
    raw = overlap_frame()
    shard, publisher, subscriber = forwarding_shard(loop)
    canonical = encode_message(b"p1", b"a.b", b"canonical", 0, 0, None)
    before = time.time_ns()
    shard.feed(publisher, canonical + raw + raw + canonical)
    after = time.time_ns()
    got = received(subscriber)
    assert [m.payload for m in got if isinstance(m, Message)] == [
        b"canonical",
        b"hello",
        b"hello",
        b"canonical",
    ]
    for m in got:
        assert isinstance(m, Message) and m.key == b"a.b" and before <= m.ts_broker <= after
    assert [m.offset for m in got] == [1, 2, 3, 4]  # type: ignore[union-attr]
    m = got[1]
    assert isinstance(m, Message)
    assert m == Message(b"p1", b"a.b", b"hello", 7, m.ts_broker, None, vbucket_of(b"p1"), m.epoch, 2)
    assert received(publisher) == [] and publisher.state == OPEN
    assert shard.stats.messages_published == 4 and shard.stats.messages_delivered == 4


def test_copied_messages_respect_the_pending_bound(loop: asyncio.AbstractEventLoop) -> None:
    # The copies go through the same queueing as stamped runs: over the
    # subscriber's bound they are dropped and counted (without a replay buffer: with
    # one it lags, tests/server/unit/test_server_lag.py).
    raw = overlap_frame()
    copy_size = len(encode_message(b"p1", b"a.b", b"hello", 7, 0, None))
    shard, publisher, subscriber = forwarding_shard(loop, replay_bytes=0)
    subscriber.limit = subscriber.cap = 3 * copy_size
    shard.feed(publisher, raw * 5)
    got = received(subscriber)
    assert [type(f) for f in got] == [Message, Message, Message, LossNotice]
    assert got[-1] == LossNotice(2, LossReason.SLOW_CONSUMER)  # the write drained: the loss is told
    assert shard.stats.messages_delivered == 3
    assert shard.stats.dropped[DropReason.SLOW_CONSUMER] == 2
    assert subscriber.dropped_total == 2
