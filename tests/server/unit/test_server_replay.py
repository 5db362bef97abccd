"""The replay buffer (broky.server.shard.replay) against a plain model: what is retained,
in which order, what eviction and the age bound drop, lookups by offset and time."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.protocol import encode_message
from broky.protocol.layout import TS_BROKER_AT
from broky.server.shard import fastpath
from broky.server.shard.replay import LOG_BYTES, ReplayBuffer, Settle, gather_entries
from broky.server.shard.sequences import Sequences

# Both settles: the Python loop and its compiled twin (when built).
SETTLES = [
    pytest.param(None, id="python"),
    pytest.param(
        fastpath.compiled_settle,
        id="compiled",
        marks=pytest.mark.skipif(fastpath.compiled_settle is None, reason=fastpath.description),
    ),
]

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


@pytest.mark.parametrize("settle", SETTLES)
@settings(max_examples=150, deadline=None)
@given(reads=reads, limit=st.integers(0, 6000))
def test_the_buffer_keeps_the_newest_whole_segments_and_finds_every_retained_message(
    settle: Settle | None, reads: list[list[tuple[int, int]]], limit: int
) -> None:
    seqs = Sequences()
    rb = ReplayBuffer(limit, seqs, settle=settle)
    model: list[tuple[int, list[tuple[int, int]]]] = []  # (segment size, [(vb, offset)])
    ts = 1000
    for read in reads:
        parts, spots, pos = [], [], 0
        for vb, size in read:
            offset = seqs.take(vb)
            f = frame(vb, offset, ts, size)
            spots.append((vb, offset, pos))
            parts.append(f)
            pos += len(f)
            ts += 1
        segment = bytearray(b"".join(parts))
        seg_id = rb.retain(segment, ts - 1)
        for vb, _, at in spots:
            rb.record(vb, seg_id, at)
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


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    query=st.integers(0, 130),
)
def test_a_lookup_by_time_finds_the_first_retained_message_not_older(steps: list[int], query: int) -> None:
    # ts_broker never decreases (steps of 0 repeat a stamp); the answer is a linear scan's.
    seqs = Sequences()
    rb = ReplayBuffer(1 << 20, seqs)
    stamps, ts = [], 1
    for step in steps:
        ts += step
        offset = seqs.take(3)
        rb.record(3, rb.retain(bytearray(frame(3, offset, ts, 10)), ts), 0)
        stamps.append(ts)
    expected = next((i + 1 for i, t in enumerate(stamps) if t >= query), None)
    assert rb.offset_at_time(3, query) == expected


def test_lookups_by_time_and_the_age_bound() -> None:
    now = [0.0]
    seqs = Sequences()
    rb = ReplayBuffer(1 << 20, seqs, max_age=10.0, clock=lambda: now[0])
    for i in range(1, 11):  # ten reads, one second apart, one message each, ts 100 * i
        now[0] = float(i)
        assert seqs.take(7) == i
        seg = rb.retain(bytearray(frame(7, i, 100 * i, 10)), 100 * i)
        rb.record(7, seg, 0)
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
    seqs = Sequences()
    rb = ReplayBuffer(0, seqs)
    assert not rb.enabled
    seqs.take(1)
    a = rb.retain(bytearray(frame(1, 1, 1, 0)), 1)
    rb.record(1, a, 0)
    seqs.take(1)
    b = rb.retain(bytearray(frame(1, 2, 2, 0)), 2)
    rb.record(1, b, 0)
    assert [payload_of(*m) for m in rb.read(1, 0, 10)] == [(1, 2)]


def test_sequences_count_per_vbucket_from_one_under_one_epoch() -> None:
    from broky.server.shard.sequences import Sequences

    seqs = Sequences(epoch=42)
    assert [seqs.take(5) for _ in range(3)] == [1, 2, 3]
    assert seqs.take(6) == 1 and seqs.next_of(5) == 4
    assert {seqs.epoch_of(vb) for vb in range(1024)} == {42}
    seqs.restart(5)
    assert seqs.epoch_of(5) not in (0, 42) and seqs.take(5) == 1
    seqs.resume(6, 7, 100)
    assert (seqs.epoch_of(6), seqs.take(6)) == (7, 100)
    assert Sequences().epoch != Sequences().epoch  # a new incarnation, a new epoch


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), max_size=40),
    pending=st.lists(st.integers(0, 1200), max_size=40),
    share=st.integers(0, 1500),
)
def test_the_buffer_draws_on_the_memory_budget_and_gives_it_back(
    sizes: list[int], pending: list[int], share: int
) -> None:
    # Segment sizes arrive while the connections' pending bytes move: the buffer's bytes are
    # always what it took from the share, never more than the share leaves to it, and a
    # segment it could not keep is evicted at once (its messages counted, not found).
    from broky.server.shard.budget import Budget

    seqs = Sequences()
    budget = Budget(share)
    rb = ReplayBuffer(1000, seqs, budget=budget)
    for i, size in enumerate(sizes):
        budget.pending = pending[i] if i < len(pending) else 0
        offset = seqs.take(0)
        segment = frame(0, offset, 1000 + i, size)
        free_before = share - budget.pending - rb.bytes
        seg_id = rb.retain(segment, 1000 + i)
        rb.record(0, seg_id, 0)
        assert rb.bytes == budget.taken.get("replay", 0) == sum(len(s) for _, s, _, _ in rb.segments)
        assert rb.bytes <= 1000 and (rb.bytes == 0 or rb.bytes + budget.pending <= share)
        if len(segment) > share - budget.pending:  # no room even with everything evicted
            assert rb.segments_refused and not rb.segments
        elif len(segment) <= free_before:  # room without evicting anything else
            assert rb.segments[-1][1] is segment
        found = [payload_of(*hit)[1] for hit in rb.read(0, 1, offset + 1)]
        assert found == list(range(offset - len(found) + 1, offset + 1))  # the newest, consecutive
        assert len(found) == len(rb.segments)
    # Evicted and refused messages are counted once, when trimmed.
    rb.trim_all()
    assert rb.evicted_messages == len(sizes) - rb.count(0)
    # Shrinking for the pending bytes gives everything back to the share.
    given = rb.shrink(0)
    assert rb.bytes == 0 == budget.taken.get("replay", 0) and given >= 0
    assert budget.room == share


@pytest.mark.skipif(fastpath.compiled_settle is None, reason=fastpath.description)
@settings(max_examples=100, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.integers(0, 1023), st.integers(1, (1 << 31) - 1), st.integers(0, (1 << 32) - 1)),
        max_size=300,
    ),
    settle_every=st.integers(1, 50),
)
def test_the_compiled_settle_fills_the_indexes_as_the_python_loop_does(
    records: list[tuple[int, int, int]], settle_every: int
) -> None:
    # The same records (vbucket, segment id, position), settled now and then, by each loop:
    # the same bytes in every vbucket's index, and an empty log.
    both = [
        ReplayBuffer(1 << 30, Sequences()),
        ReplayBuffer(1 << 30, Sequences(), settle=fastpath.compiled_settle),
    ]
    for rb in both:
        for i, (vb, seg, pos) in enumerate(records):
            rb.record(vb, seg, pos)
            if i % settle_every == 0:
                rb.settle()
        rb.settle()
        assert not rb.log
    assert [bytes(ix) for ix in both[0].index] == [bytes(ix) for ix in both[1].index]
    for vb in {vb for vb, _, _ in records}:
        expected = b"".join(struct.pack("<Q", seg << 32 | pos) for v, seg, pos in records if v == vb)
        assert bytes(both[1].index[vb]) == expected


@pytest.mark.parametrize("settle", SETTLES)
def test_the_log_is_settled_before_it_grows_past_its_bound(settle: Settle | None) -> None:
    # 64 messages per read: the log (16 bytes a message) never holds much more than LOG_BYTES,
    # and whatever it holds, a lookup sees.
    seqs = Sequences()
    rb = ReplayBuffer(1 << 30, seqs, settle=settle)
    f = frame(5, 0, 1, 0)
    for _ in range(LOG_BYTES // (16 * 64) * 3):
        seg = rb.retain(bytearray(f * 64), 1)
        for j in range(64):
            seqs.take(5)
            rb.record(5, seg, j * len(f))
        assert len(rb.log) <= LOG_BYTES + 16 * 64
    assert rb.log  # some wait: a lookup settles them
    assert rb.count(5) == seqs.next_of(5) - 1
    assert not rb.log


def test_the_tick_trims_a_quarter_of_the_vbuckets_at_a_time_and_all_in_a_sweep() -> None:
    # `trim_some` (the tick) cuts the stale entries of every TRIM_PHASES-th vbucket per call;
    # after TRIM_PHASES calls every evicted message is counted, as `trim_all` counts them, and
    # the dropped segments' times are forgotten (their entries are all gone).
    from broky.server.shard.replay import TRIM_PHASES

    seqs = Sequences()
    rb = ReplayBuffer(4000, seqs)
    vbs = list(range(4 * TRIM_PHASES))  # 4 vbuckets in each phase
    for ts in range(1000, 1040):  # segments of one message per vbucket
        parts, spots, pos = [], [], 0
        for vb in vbs:
            f = frame(vb, seqs.take(vb), ts, 20)
            spots.append((vb, pos))
            parts.append(f)
            pos += len(f)
        seg_id = rb.retain(bytearray(b"".join(parts)), ts)
        for vb, at in spots:
            rb.record(vb, seg_id, at)
    gone = rb.live - 1  # segments evicted: each held one message of every vbucket
    assert gone > 0
    rb.trim_some()
    assert rb.evicted_messages == gone * 4  # the 4 vbuckets of phase 0 only
    assert [len(rb.index[vb]) // 8 for vb in vbs[:TRIM_PHASES]] == [40 - gone, 40, 40, 40]
    assert rb.dropped_ts and rb.trim_phase == 1
    for _ in range(TRIM_PHASES - 1):
        rb.trim_some()
    assert rb.trim_phase == 0 and not rb.dropped_ts and rb.trimmed_at == rb.live
    assert rb.evicted_messages == gone * len(vbs)
    assert all(len(rb.index[vb]) // 8 == 40 - gone for vb in vbs)
    assert all(rb.gone_ts[vb] == 1000 + gone - 1 for vb in vbs)  # the newest evicted message's time
    rb.trim_some()  # nothing went since: nothing to do
    assert rb.trim_phase == 0 and rb.evicted_messages == gone * len(vbs)


@st.composite
def gather_cases(draw: st.DrawFn) -> tuple[bytes, dict[int, Any], int, bool]:
    """Segments of size-prefixed frames (bytearray or bytes), index entries pointing at some
    of their frames in any order (a few of them broken: past a segment's end, or a segment not
    retained), a room and whether the first must be taken."""
    segments: dict[int, Any] = {}
    starts: list[tuple[int, int]] = []
    for seg_id in draw(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4, unique=True)):
        frames = draw(st.lists(st.binary(max_size=40), min_size=1, max_size=8))
        data, pos = bytearray(), 0
        for f in frames:
            starts.append((seg_id, pos))
            data += struct.pack("<I", len(f)) + f
            pos += 4 + len(f)
        segments[seg_id] = data if draw(st.booleans()) else bytes(data)
    picked = draw(st.lists(st.sampled_from(starts), max_size=20))
    if draw(st.integers(0, 9)) == 0:  # an entry past its segment's end
        seg_id = draw(st.sampled_from(sorted(segments)))
        picked.append((seg_id, len(segments[seg_id]) - draw(st.integers(0, 3))))
    if draw(st.integers(0, 9)) == 0:  # an entry of a segment no longer retained
        picked.append((max(segments) + 1, 0))
    entries = b"".join(struct.pack("<Q", seg << 32 | pos) for seg, pos in picked)
    return entries, segments, draw(st.integers(0, 400)), draw(st.booleans())


@pytest.mark.skipif(fastpath.compiled_gather is None, reason=fastpath.description)
@settings(max_examples=300, deadline=None)
@given(case=gather_cases())
def test_the_compiled_gather_joins_the_frames_as_the_python_reference_does(
    case: tuple[bytes, dict[int, Any], int, bool],
) -> None:
    entries, segments, room, first = case
    compiled = fastpath.compiled_gather
    assert compiled is not None
    try:
        expected: object = gather_entries(entries, segments, room, first)
    except ValueError as exc:
        expected = ("ValueError", str(exc))
    try:
        got: object = compiled(entries, segments, room, first)
    except ValueError as exc:
        got = ("ValueError", str(exc))
    assert got == expected


@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.skipif(fastpath.compiled_gather is None, reason="-"))],
)
def test_gather_reads_what_read_reads_within_its_room(compiled: bool) -> None:
    rb = ReplayBuffer(1 << 30, Sequences(), gather=fastpath.compiled_gather if compiled else None)
    seqs = rb.seqs
    frames = [struct.pack("<I", n) + bytes(n) for n in (5, 10, 15, 20)]
    seg = rb.retain(bytearray(b"".join(frames)), 1)
    pos = 0
    for f in frames:
        offset = seqs.take(3)
        assert offset >= 1
        rb.record(3, seg, pos)
        pos += len(f)
    assert rb.gather(3, 1, 5, 1 << 20, False) == (b"".join(frames), 4)
    assert rb.gather(3, 2, 4, 1 << 20, False) == (frames[1] + frames[2], 2)
    assert rb.gather(3, 1, 5, len(frames[0]) + len(frames[1]), False) == (frames[0] + frames[1], 2)
    assert rb.gather(3, 1, 5, 0, False) == (b"", 0)
    assert rb.gather(3, 1, 5, 0, True) == (frames[0], 1)  # the first, whatever its size
    assert rb.gather(4, 1, 5, 1 << 20, True) == (b"", 0)  # nothing retained there
