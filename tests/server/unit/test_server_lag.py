"""A slow reader lags and catches up from the replay buffer (broky.server.shard.lag).

The real Shard over in-memory transports (tests/support/shardkit.py). A subscriber
that sends Pause (its client's queue is full) keeps what was queued to it; past its
bound it lags. After Resume it must receive every message it was routed, each once,
in offset order per vbucket, then live again; what the buffer evicted before it got
there is told once per vbucket and gap with the exact count.
"""

from __future__ import annotations

import asyncio
import struct
from collections import defaultdict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.protocol import LossNotice, LossReason, Message, Subscribe, encode_message
from broky.protocol.layout import EPOCH_AT
from broky.server.shard import fastpath
from broky.server.shard.connection import OPEN, Connection
from broky.server.shard.core import Shard
from broky.server.shard.lag import RANGE_BYTES, cut_below, note_missed
from broky.server.shard.stats import DropReason
from tests.support.shardkit import received, shard_with

TWINS = [False] + ([True] if fastpath.compiled_scan is not None else [])


def frames_of(kps: list[bytes], n: int, size: int, keys: list[bytes] | None = None) -> list[bytes]:
    """n Message frames, round robin over the key_partitions (and keys)."""
    keys = keys or [b"k.a"]
    payload = b"x" * size
    return [
        encode_message(kps[i % len(kps)], keys[(i // len(kps)) % len(keys)], payload, 1, 0, None)
        for i in range(n)
    ]


def publish(shard: Shard, publisher: Connection, frames: list[bytes], per_read: int = 50) -> None:
    for i in range(0, len(frames), per_read):
        shard.feed(publisher, b"".join(frames[i : i + per_read]))


def turns(loop: asyncio.AbstractEventLoop, c: Connection, most: int = 10_000) -> None:
    """Run the loop until c no longer lags (its batches are call_soon callbacks)."""
    for _ in range(most):
        loop.run_until_complete(asyncio.sleep(0))
        if c.lag is None:
            return
    raise AssertionError("still lagging")


def stalled(shard: Shard, c: Connection, bound: int) -> None:
    """c's client sent Pause (its queue is full) and c's bound is `bound` bytes."""
    c.limit = c.cap = bound
    c.paused = True


def resume(shard: Shard, c: Connection) -> None:
    shard.resume(c)
    shard.flush()


def by_vbucket(frames: Sequence[object]) -> tuple[dict[int, list[int]], list[LossNotice]]:
    got: dict[int, list[int]] = defaultdict(list)
    notices = []
    for f in frames:
        if isinstance(f, Message):
            got[f.vbucket].append(f.offset)
        elif isinstance(f, LossNotice):
            notices.append(f)
    return got, notices


@pytest.mark.parametrize("compiled", TWINS)
def test_a_paused_reader_past_its_bound_lags_then_gets_everything_once_in_order(
    loop: asyncio.AbstractEventLoop, compiled: bool
) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(b">", None)], node_id="lag", compiled=compiled)
    kps = [b"p%d" % i for i in range(64)]
    frames = frames_of(kps, 3000, 100)
    stalled(shard, sub, 20 * len(frames[0]))
    publish(shard, publisher, frames)
    assert sub.lag is not None and sub.state == OPEN  # lagging, not dropping
    assert shard.stats.dropped[DropReason.SLOW_CONSUMER] == 0
    # What it is owed is in its account (owed by this worker: told WORKER_RESTART should it die).
    assert sub.worker_owed == shard.lag.behind(sub) == 3000 - sub.msgs_out > 0
    resume(shard, sub)
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    assert notices == []
    assert sub.worker_owed == 0  # sent, all of it
    assert sum(len(v) for v in got.values()) == 3000
    for vb, offsets in got.items():
        assert offsets == list(range(1, len(offsets) + 1)), vb  # every offset once, in order
    assert shard.stats.lag_served > 0 and shard.stats.lagging == 0 and shard.stats.lag_entered == 1
    assert sub.cap == sub.limit and sub.dropped_total == 0
    assert sub.msgs_out == 3000
    # Live again: the next messages follow at once, their offsets next.
    before = len(received(sub))
    publish(shard, publisher, frames_of(kps, 64, 100), per_read=10)  # reads under its bound
    after = received(sub)[before:]
    assert len(after) == 64 and all(isinstance(f, Message) for f in after)
    assert sub.lag is None


@pytest.mark.parametrize("compiled", TWINS)
def test_messages_published_during_the_catch_up_meet_it_without_gap_or_duplicate(
    loop: asyncio.AbstractEventLoop, compiled: bool
) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(b">", None)], node_id="lag", compiled=compiled)
    kps = [b"p%d" % i for i in range(16)]
    stalled(shard, sub, 10 * len(frames_of(kps, 1, 200)[0]))
    publish(shard, publisher, frames_of(kps, 1000, 200))
    resume(shard, sub)
    for _ in range(40):  # publishing goes on while it catches up
        publish(shard, publisher, frames_of(kps, 25, 200), per_read=25)
        loop.run_until_complete(asyncio.sleep(0))
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    assert notices == []
    assert sum(len(v) for v in got.values()) == 2000
    for offsets in got.values():
        assert offsets == list(range(1, len(offsets) + 1))


def test_a_filtered_reader_is_owed_only_its_messages(loop: asyncio.AbstractEventLoop) -> None:
    shard, publisher, (sub, everyone) = shard_with(loop, [(b"a.>", None), (b">", None)], node_id="lag")
    shard.subscribe(sub, Subscribe(2, b"b.c", b"p3"))  # and one key_partition's b.c
    kps = [b"p%d" % i for i in range(8)]
    frames = frames_of(kps, 2000, 100, keys=[b"a.x", b"b.c", b"c.d"])
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    assert sub.lag is not None and sub.lag.open_from is None  # filtered: its owed offsets noted
    resume(shard, sub)
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    assert notices == []
    every, _ = by_vbucket(received(everyone))
    want: dict[int, list[int]] = defaultdict(list)
    for f in received(everyone):
        if isinstance(f, Message) and (
            f.key.startswith(b"a.") or (f.key == b"b.c" and f.key_partition == b"p3")
        ):
            want[f.vbucket].append(f.offset)
    assert dict(got) == dict(want)
    assert sum(len(v) for v in every.values()) == 2000


@pytest.mark.parametrize("compiled", TWINS)
def test_what_the_buffer_evicted_first_is_told_once_per_vbucket_with_the_exact_count(
    loop: asyncio.AbstractEventLoop, compiled: bool
) -> None:
    shard, publisher, (sub,) = shard_with(
        loop, [(b">", None)], node_id="lag", compiled=compiled, replay_bytes=64 << 10
    )
    kps = [b"p%d" % i for i in range(8)]
    frames = frames_of(kps, 4000, 200)
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    resume(shard, sub)
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    assert notices, "the stall outlasted the buffer"
    told: dict[int, int] = defaultdict(int)
    for n in notices:
        assert n.reason == LossReason.EVICTED and n.sid == 0
        assert n.at is not None and n.through is not None
        assert n.through.offset - n.at.offset + 1 == n.dropped
        told[n.at.vbucket] += n.dropped
    published: dict[int, int] = defaultdict(int)
    for offsets in got.values():
        assert len(set(offsets)) == len(offsets)
        assert offsets == sorted(offsets)
    for n in notices:  # what follows a notice starts right after its gap
        vb = n.at.vbucket  # type: ignore[union-attr]
        after = [o for o in got[vb] if o > n.through.offset]  # type: ignore[union-attr]
        assert not after or after[0] == n.through.offset + 1  # type: ignore[union-attr]
    last = shard.seqs
    for vb in set(got) | set(told):
        published[vb] = last.next_of(vb) - 1
        assert len(got[vb]) + told[vb] == published[vb], vb  # received + told == published
    assert sum(published.values()) == 4000
    assert sub.dropped_total == sum(told.values()) == shard.stats.dropped[DropReason.EVICTED]
    assert shard.stats.lag_evicted == sum(told.values())
    assert sub.worker_owed == 0  # sent or told


def test_a_filtered_readers_evicted_count_is_its_own_messages(loop: asyncio.AbstractEventLoop) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(b"a.>", None)], node_id="lag", replay_bytes=64 << 10)
    kps = [b"p%d" % i for i in range(4)]
    frames = frames_of(kps, 4000, 200, keys=[b"a.x", b"b.x", b"b.y"])  # a third of them its own
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    resume(shard, sub)
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    assert notices
    mine = sum(1 for i in range(4000) if (i // 4) % 3 == 0)
    received_n = sum(len(v) for v in got.values())
    assert received_n + sum(n.dropped for n in notices) == mine  # exact: only its messages counted
    # p0..p3 are in four vbuckets, so the n-th message of a key_partition has offset n + 1, and
    # its key is a.x when n % 3 == 0: each notice starts at a message that was the reader's.
    assert all(n.at is not None and n.at.offset % 3 == 1 for n in notices)
    assert all(
        isinstance(f, Message) and f.key.startswith(b"a.") for f in received(sub) if isinstance(f, Message)
    )


def test_without_a_replay_buffer_a_slow_reader_still_loses_and_is_told(
    loop: asyncio.AbstractEventLoop,
) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(b">", None)], node_id="lag", replay_bytes=0)
    frames = frames_of([b"p1"], 100, 100)
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    assert sub.lag is None
    resume(shard, sub)
    got = received(sub)
    assert [type(f) for f in got] == [Message] * 10 + [LossNotice]
    assert got[-1] == LossNotice(90, LossReason.SLOW_CONSUMER)
    assert shard.stats.dropped[DropReason.SLOW_CONSUMER] == 90


def test_a_lagging_connection_that_ends_leaves_no_lag_behind(loop: asyncio.AbstractEventLoop) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(b">", None)], node_id="lag")
    frames = frames_of([b"p1", b"p2"], 200, 100)
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    assert shard.stats.lagging == 1
    shard.lost(sub, None)
    loop.run_until_complete(asyncio.sleep(0))  # its seal finds it gone
    assert shard.stats.lagging == 0 and not shard.lag.lagging


@pytest.mark.parametrize("pattern", [b">", b"k.>"])
def test_a_reader_that_resumes_after_its_lag_was_sealed_catches_up_with_no_drain_to_wake_it(
    loop: asyncio.AbstractEventLoop, pattern: bytes
) -> None:
    # The seal (and a first batch) ran while it was paused: nothing is scheduled then. Resume
    # must start the batches again by itself: a transport that takes everything at once
    # (as the kernel may) never calls resume_writing.
    shard, publisher, (sub,) = shard_with(loop, [(pattern, None)], node_id="lag")
    frames = frames_of([b"p%d" % i for i in range(8)], 2000, 100)
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    for _ in range(5):
        loop.run_until_complete(asyncio.sleep(0))  # sealed while paused: no batch, none scheduled
    assert sub.lag is not None and not sub.lag.scheduled
    resume(shard, sub)
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    assert notices == [] and sum(len(v) for v in got.values()) == 2000


# ---------------------------------------------------------------- a stalled filtered reader


def test_a_stalled_filtered_readers_evicted_ranges_are_trimmed_at_the_tick_and_told_exactly(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # A filtered reader that reads nothing notes the offsets it is refused; what the buffer
    # evicts of them is trimmed at the worker's tick, kept as a count per vbucket, so its ranges
    # never name an evicted offset, and told with the exact count when it reads on.
    shard, publisher, (sub,) = shard_with(loop, [(b"a.>", None)], node_id="lag", replay_bytes=64 << 10)
    kps = [b"p%d" % i for i in range(4)]
    frames = frames_of(kps, 8000, 200, keys=[b"a.x", b"b.x", b"b.y"])  # a third of them its own
    stalled(shard, sub, 10 * len(frames[0]))
    replay = shard.replay
    assert replay is not None
    for i in range(0, len(frames), 400):
        publish(shard, publisher, frames[i : i + 400])
        lag = sub.lag
        assert lag is not None and lag.open_from is None
        shard.lag.tick(lag.progress)  # no cut: within --slow-consumer-deadline
        for vb, ranges in lag.owed.items():
            first = replay.first(vb)
            assert first is not None and ranges[0][0] >= first, "an evicted offset is still noted"
    lag = sub.lag
    assert lag is not None and lag.gone, "the stall outlasted the buffer"
    retained_mine = sum(stop - start for ranges in lag.owed.values() for start, stop in ranges)
    assert retained_mine <= sum(replay.count(vb) for vb in lag.owed)
    resume(shard, sub)
    turns(loop, sub)
    got, notices = by_vbucket(received(sub))
    mine = sum(1 for i in range(8000) if (i // 4) % 3 == 0)
    told = sum(n.dropped for n in notices)
    assert sum(len(v) for v in got.values()) + told == mine  # exact: only its messages, once
    assert all(n.reason == LossReason.EVICTED and n.at is not None and n.at.offset % 3 == 1 for n in notices)
    assert len({n.at.vbucket for n in notices if n.at is not None}) == len(notices)  # once per vbucket
    through: dict[int, int] = {}
    for f in received(sub):  # what follows a notice comes after its gap
        if isinstance(f, LossNotice) and f.through is not None:
            through[f.through.vbucket] = f.through.offset
        elif isinstance(f, Message):
            assert f.offset > through.get(f.vbucket, -1)
    assert len(through) == len(notices)
    assert sub.dropped_total == told == shard.stats.dropped[DropReason.EVICTED]
    assert sub.worker_owed == 0


def test_a_stalled_filtered_reader_that_ends_counts_its_trimmed_ranges_in_its_account(
    loop: asyncio.AbstractEventLoop,
) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(b"a.>", None)], node_id="lag", replay_bytes=64 << 10)
    frames = frames_of([b"p%d" % i for i in range(4)], 8000, 200, keys=[b"a.x", b"b.x", b"b.y"])
    stalled(shard, sub, 10 * len(frames[0]))
    for i in range(0, len(frames), 400):
        publish(shard, publisher, frames[i : i + 400])
        assert sub.lag is not None
        shard.lag.tick(sub.lag.progress)
    assert sub.lag is not None and sub.lag.gone
    shard.lost(sub, None)
    mine = sum(1 for i in range(8000) if (i // 4) % 3 == 0)
    # Queued and kept: counted when it ended paused; owed, retained or trimmed: counted too.
    assert sub.dropped_total == mine


def _stamped(vb: int, epoch: int, offset: int, size: int) -> bytes:
    frame = bytearray(encode_message(b"kp", b"k", b"x" * size, 1, 0, None))
    struct.pack_into("<QQH", frame, EPOCH_AT, epoch, offset, vb)
    return bytes(frame)


_runs = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 6), st.integers(0, 40)),
    min_size=1,
    max_size=30,
)


@pytest.mark.skipif(fastpath.compiled_note is None, reason=fastpath.description)
@settings(max_examples=300, deadline=None)
@given(before=_runs, runs=_runs, cut=st.integers(0, 3))
def test_the_compiled_note_keeps_the_ranges_the_python_reference_keeps(
    before: list[tuple[int, int, int, int]], runs: list[tuple[int, int, int, int]], cut: int
) -> None:
    # (vbucket, gap before the run, run length, payload size): runs of consecutive offsets per
    # vbucket, with gaps, over an owed state left by an earlier call.
    note = fastpath.compiled_note
    assert note is not None

    def frames(spec: list[tuple[int, int, int, int]], nexts: dict[int, int]) -> bytearray:
        out = bytearray()
        for vb, gap, n, size in spec:
            at = nexts.get(vb, 10) + gap
            for offset in range(at, at + n):
                out += _stamped(vb, 7 + vb, offset, size)
            nexts[vb] = at + n
        return out

    nexts: dict[int, int] = {}
    first, then = frames(before, nexts), frames(runs, nexts)
    ref_owed: dict[int, list[list[int]]] = {}
    ref_epochs: dict[int, int] = {}
    c_owed: dict[int, list[list[int]]] = {}
    c_epochs: dict[int, int] = {}
    note_missed(first, 0, len(first), ref_owed, ref_epochs)
    note(first, 0, len(first), c_owed, c_epochs)
    for owed, epochs in ((ref_owed, ref_epochs), (c_owed, c_epochs)):  # a tick trimmed some (`trim`)
        for vb, ranges in list(owed.items()):
            cut_below(ranges, ranges[0][0] + cut)
            if not ranges:
                del owed[vb], epochs[vb]
    note_missed(then, 0, len(then), ref_owed, ref_epochs)
    note(then, 0, len(then), c_owed, c_epochs)
    assert c_owed == ref_owed and c_epochs == ref_epochs


@pytest.mark.skipif(fastpath.compiled_note is None, reason=fastpath.description)
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), start=st.integers(0, 50))
def test_the_compiled_note_refuses_what_is_not_whole_stamped_frames(data: bytes, start: int) -> None:
    note = fastpath.compiled_note
    assert note is not None
    good = _stamped(3, 1, 5, 20)
    buf = bytearray(good + data)
    owed: dict[int, list[list[int]]] = {}
    epochs: dict[int, int] = {}
    try:
        note(buf, 0, len(buf), owed, epochs)
    except ValueError:
        pass
    assert owed[3][0] == [5, 6] and epochs == {3: 1}  # the whole frame before it is noted
    with pytest.raises(ValueError):
        note(buf, start + len(buf) + 1, len(buf), owed, epochs)
    with pytest.raises(ValueError):
        note(buf, 0, len(good) - 1, {}, {})


def test_a_filtered_readers_ranges_count_in_the_memory_budget_and_past_its_room_it_is_cut(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # Two stalled filtered readers whose messages interleave with others' (a range per message);
    # the ranges are held in the budget as kind "lag"; with a share too small for both, the one
    # whose ranges take the most is cut (SLOW_CONSUMER), its account exact; the other stays.
    shard, publisher, (big, small) = shard_with(
        loop, [(b"a.>", None), (b"a.x", None)], node_id="lag", replay_bytes=4 << 20
    )
    frames = frames_of([b"p0"], 6000, 50, keys=[b"a.x", b"b.x", b"a.y"])  # big: 2 of 3, small: 1 of 3
    for c in (big, small):
        stalled(shard, c, 4 * len(frames[0]))
    publish(shard, publisher, frames)
    assert big.lag is not None and small.lag is not None
    shard.lag.tick(big.lag.progress)
    budget = shard.budget
    ranges = [sum(len(r) for r in c.lag.owed.values()) for c in (big, small) if c.lag is not None]
    assert budget.taken["lag"] == RANGE_BYTES * sum(ranges) > 0
    budget.give("lag", budget.taken["lag"])  # (as if nothing were held yet: the next tick takes)
    assert budget.take("other", budget.share - budget.used() - RANGE_BYTES * ranges[1] - 1)  # room: small's
    shard.lag.tick(small.lag.progress)
    assert big.state != OPEN and small.state == OPEN
    assert shard.stats.budget_cuts == 1
    assert budget.taken["lag"] == RANGE_BYTES * ranges[1]
    behind = shard.lag.behind(big)
    shard.lost(big, None)  # (its transport closes)
    assert behind == 4000 - 4 and big.dropped_total == behind  # what it was owed: in its account
    resume(shard, small)
    turns(loop, small)
    shard.lag.tick(0.0)
    assert budget.taken["lag"] == 0  # nothing lags: given back
    got = [f for f in received(small) if isinstance(f, Message)]
    assert len(got) == 2000 and not [f for f in received(small) if isinstance(f, LossNotice)]


@pytest.mark.parametrize("pattern", [b">", b"k.>"])
def test_a_vbucket_restarted_during_the_lag_is_told_with_what_it_was_owed_of_the_old_epoch(
    loop: asyncio.AbstractEventLoop, pattern: bytes
) -> None:
    shard, publisher, (sub,) = shard_with(loop, [(pattern, None)], node_id="lag")
    frames = frames_of([b"p1", b"p2"], 400, 100, keys=[b"k.a"])
    stalled(shard, sub, 10 * len(frames[0]))
    publish(shard, publisher, frames)
    loop.run_until_complete(asyncio.sleep(0))  # (its seal, for `>`)
    owed = shard.lag.behind(sub)
    restarted = next(v for v in range(1024) if shard.seqs.next_of(v) > 1)
    old_epoch, old_next = shard.seqs.epoch_of(restarted), shard.seqs.next_of(restarted)
    shard.seqs.restart(restarted)  # (a failover took it over without its history)
    resume(shard, sub)
    turns(loop, sub)
    messages = [f for f in received(sub) if isinstance(f, Message)]
    notices = [f for f in received(sub) if isinstance(f, LossNotice)]
    had = sum(1 for m in messages if m.vbucket == restarted and m.epoch == old_epoch)  # queued before
    (notice,) = notices
    assert notice.reason == LossReason.EPOCH_CHANGED and notice.dropped == old_next - 1 - had > 0
    assert notice.at is not None and notice.at.offset == had + 1  # the first it was owed
    assert len(messages) + notice.dropped == 400
    assert owed == 400 - 10  # all but the 10 its bound held when it began to lag
    assert sub.worker_owed == 0 and sub.dropped_total == notice.dropped
