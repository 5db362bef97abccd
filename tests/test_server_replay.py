"""The replay buffer (broky.server.replay) against a plain model: what is retained,
in which order, what eviction and the age bound drop, lookups by offset and time."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from broky.protocol import encode_message
from broky.protocol.layout import TS_BROKER_AT
from broky.server.replay import ReplayBuffer

_ts = struct.Struct("<q")


def frame(vb: int, offset: int, ts: int, size: int) -> bytes:
    """A canonical Message whose payload names (vb, offset), ts_broker set to ts."""
    out = bytearray(encode_message(b"kp", b"k", b"%d:%d:" % (vb, offset) + bytes(size)))
    _ts.pack_into(out, TS_BROKER_AT, ts)
    return bytes(out)


def payload_of(segment: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    from broky.protocol import decode_message

    vb, offset, _ = decode_message(bytes(segment[pos:end])).payload.split(b":", 2)
    return int(vb), int(offset)


# A read: several messages, each (vbucket among a few, padding size).
reads = st.lists(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 300)), min_size=1, max_size=6), max_size=30
)


@settings(max_examples=150, deadline=None)
@given(reads=reads, limit=st.integers(0, 6000))
def test_the_buffer_keeps_the_newest_whole_segments_and_finds_every_retained_message(
    reads: list[list[tuple[int, int]]], limit: int
) -> None:
    rb = ReplayBuffer(limit)
    next_offset = [1] * 4
    model: list[tuple[int, list[tuple[int, int]]]] = []  # (segment size, [(vb, offset)])
    ts = 1000
    for read in reads:
        parts, spots, pos = [], [], 0
        for vb, size in read:
            f = frame(vb, next_offset[vb], ts, size)
            spots.append((vb, next_offset[vb], pos))
            next_offset[vb] += 1
            parts.append(f)
            pos += len(f)
            ts += 1
        segment = bytearray(b"".join(parts))
        seg_id = rb.retain(segment)
        for vb, offset, at in spots:
            rb.record(vb, offset, seg_id, at)
        model.append((len(segment), [(vb, o) for vb, o, _ in spots]))
    # The model: the newest segments whose sizes fit the limit (the newest always stays).
    kept: list[tuple[int, list[tuple[int, int]]]] = []
    total = 0
    for size, msgs in reversed(model):
        if kept and total + size > limit:
            break
        kept.append((size, msgs))
        total += size
    kept.reverse()
    assert rb.bytes == total
    for vb in range(4):
        expected = [o for _, msgs in kept for v, o in msgs if v == vb]
        got = [payload_of(*m) for m in rb.read(vb, 0, 1 << 62)]
        assert got == [(vb, o) for o in expected]
        assert rb.first(vb) == (expected[0] if expected else None)
        assert rb.count(vb) == len(expected)
        if expected:  # a window inside what is retained, and offsets before it left out
            lo, hi = expected[0] + 1, expected[-1]
            assert [o for _, o in (payload_of(*m) for m in rb.read(vb, lo, hi))] == list(range(lo, hi))
            assert [payload_of(*m) for m in rb.read(vb, 0, expected[0] + 1)] == [(vb, expected[0])]


def test_lookups_by_time_and_the_age_bound() -> None:
    now = [0.0]
    rb = ReplayBuffer(1 << 20, max_age=10.0, clock=lambda: now[0])
    for i in range(1, 11):  # ten reads, one second apart, one message each, ts 100 * i
        now[0] = float(i)
        seg = rb.retain(bytearray(frame(7, i, 100 * i, 10)))
        rb.record(7, i, seg, 0)
    assert rb.offset_at_time(7, 0) == 1
    assert rb.offset_at_time(7, 450) == 5
    assert rb.offset_at_time(7, 500) == 5
    assert rb.offset_at_time(7, 1001) is None
    assert rb.offset_at_time(8, 0) is None
    now[0] = 15.5  # segments added at 1..5 are older than 10 s
    rb.expire()
    assert rb.first(7) == 6 and rb.count(7) == 5
    assert rb.evicted_messages == 5
    assert rb.drop_vbucket(7) == 5 and rb.first(7) is None


def test_a_zero_limit_keeps_only_the_newest_segment_until_the_next() -> None:
    rb = ReplayBuffer(0)
    assert not rb.enabled
    a = rb.retain(bytearray(frame(1, 1, 1, 0)))
    rb.record(1, 1, a, 0)
    b = rb.retain(bytearray(frame(1, 2, 2, 0)))
    rb.record(1, 2, b, 0)
    assert [payload_of(*m) for m in rb.read(1, 0, 10)] == [(1, 2)]


def test_sequences_count_per_vbucket_from_one_under_one_epoch() -> None:
    from broky.server.sequences import Sequences

    seqs = Sequences(epoch=42)
    assert [seqs.take(5) for _ in range(3)] == [1, 2, 3]
    assert seqs.take(6) == 1 and seqs.next_of(5) == 4
    assert {seqs.epoch_of(vb) for vb in range(1024)} == {42}
    seqs.restart(5)
    assert seqs.epoch_of(5) not in (0, 42) and seqs.take(5) == 1
    seqs.resume(6, 7, 100)
    assert (seqs.epoch_of(6), seqs.take(6)) == (7, 100)
    assert Sequences().epoch != Sequences().epoch  # a new incarnation, a new epoch
