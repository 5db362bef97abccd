"""Starts from positions against a model (broky.server.shard.positions, in process).

A Shard gets random reads of publishes (some key_partitions, keys that match or
not, a replay buffer small enough to evict) while a watcher subscribed to `>`
sees every accepted message with its position: that is the model of what the
worker accepted. Then a random start (since a position of the model, of another
epoch, ahead of it, or twice; since_time; last N; with or without a
key_partition) must be answered with exactly the retained messages the rules of
schema/README.md 5.1 choose, byte for byte as the watcher got them, and notices
that account for every offset after a position: replayed, or counted EVICTED.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broky.errors import ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import (
    RESUME_TOKEN_BYTES,
    Error,
    LossNotice,
    LossReason,
    Message,
    Replay,
    Subscribe,
    encode_message,
    new_ksuid,
)
from broky.protocol.frames import Position
from broky.protocol.routing import vbucket_of
from broky.server.config import ServerConfig
from broky.server.shard.connection import Connection
from broky.server.shard.core import Shard
from tests.support.shardkit import Recorder

PARTS = [b"a", b"b", b"tenant-7", b"tenant-8", b"z" * 30]
KEYS = [b"k.a", b"k.b", b"k.a.c", b"other"]
PATTERNS = [(b"k.>", None), (b"k.a", b"a"), (b"k.*", None), (b">", b"tenant-7"), (b"other", None)]


def connection(shard: Shard, i: int) -> Connection:
    c = Connection(shard, b"", i)
    c.transport = Recorder()  # type: ignore[assignment]
    c.token = bytes(RESUME_TOKEN_BYTES)
    shard.conns[i] = c
    shard.book.open(c)
    return c


def frames_of(c: Connection) -> list[Any]:
    out: list[Any] = c.transport.frames()  # type: ignore[attr-defined]
    c.transport.data.clear()  # type: ignore[attr-defined]
    return out


publish = st.tuples(st.sampled_from(PARTS), st.sampled_from(KEYS), st.binary(max_size=300), st.booleans())
reads = st.lists(st.lists(publish, min_size=1, max_size=8), min_size=1, max_size=30)


@st.composite
def starts(draw: st.DrawFn, watched: list[Message]) -> Subscribe:
    pattern, kp = draw(st.sampled_from(PATTERNS))
    kind = draw(st.sampled_from(["since", "since", "time", "last"]))
    if kind == "since" and watched:
        picked = draw(st.lists(st.sampled_from(watched), min_size=1, max_size=4))
        since = []
        for m in picked:
            change = draw(st.sampled_from(["same", "same", "epoch", "ahead", "zero"]))
            if change == "epoch":
                since.append(Position(m.vbucket, m.epoch ^ 1, m.offset))
            elif change == "ahead":
                since.append(Position(m.vbucket, m.epoch, m.offset + 1000))
            elif change == "zero":
                since.append(Position(m.vbucket, m.epoch, 0))
            else:
                since.append(Position(m.vbucket, m.epoch, m.offset))
        return Subscribe(1, pattern, kp, tuple(since))
    if kind == "time" and watched:
        t = draw(st.sampled_from([m.ts_broker for m in watched] + [1]))
        return Subscribe(1, pattern, kp, since_time=t)
    return Subscribe(1, pattern, kp, last=draw(st.integers(1, 20)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reads=reads, limit=st.sampled_from([2048, 8192, 1 << 20]), data=st.data())
def test_a_start_replays_exactly_what_the_rules_choose(
    loop: asyncio.AbstractEventLoop,
    reads: list[list[tuple[bytes, bytes, bytes, bool]]],
    limit: int,
    data: Any,
) -> None:
    config = ServerConfig(workers=1, node_id="model", replay_bytes=limit)
    shard = Shard(config, 0, loop)
    watcher, pub, sub = connection(shard, 1), connection(shard, 2), connection(shard, 3)
    shard.subscribe(watcher, Subscribe(1, b">"))
    for read in reads:
        shard.feed(
            pub, b"".join(encode_message(kp, k, p, 7, 0, new_ksuid() if u else None) for kp, k, p, u in read)
        )
    watched = [f for f in frames_of(watcher) if isinstance(f, Message)]
    assert len(watched) == sum(map(len, reads))
    by_vb: dict[int, list[Message]] = {}
    for m in watched:  # per vbucket, offsets 1, 2, 3 ... under one epoch
        by_vb.setdefault(m.vbucket, []).append(m)
    for ms in by_vb.values():
        assert [m.offset for m in ms] == list(range(1, len(ms) + 1)) and len({m.epoch for m in ms}) == 1
    assert frames_of(pub) == []

    start = data.draw(starts(watched))
    shard.subscribe(sub, start)
    shard.flush()
    got = frames_of(sub)
    errors = [f for f in got if isinstance(f, Error)]
    head = [f for f in got if isinstance(f, Replay)]
    assert len(head) == 1 and head[0].sid == 1
    replayed = [f for f in got if isinstance(f, Message)]
    assert head[0].messages == len(replayed)
    notices = [f for f in got if isinstance(f, LossNotice)]
    assert all(f.sid == 1 and f.at is not None and f.through is not None for f in notices)
    # One notice per vbucket and reason, in vbucket order; each names the last position it
    # accounts for, in the vbucket's current epoch (a resume goes on after it).
    keys = [(f.at.vbucket, f.reason) for f in notices]  # type: ignore[union-attr]
    assert len(set(keys)) == len(keys) and [vb for vb, _ in keys] == sorted(vb for vb, _ in keys)

    # The model's answer, vbucket by vbucket (the replay buffer retains a suffix of each).
    tokens = parse_pattern(start.pattern)
    kp = start.key_partition

    def matches(m: Message) -> bool:
        return (kp is None or m.key_partition == kp) and pattern_matches(tokens, m.key)

    retained = {vb: shard.replay.first(vb) for vb in by_vb}  # type: ignore[union-attr]
    vbs = [vbucket_of(kp)] if kp is not None else sorted(by_vb)
    named: dict[int, Position] = {}
    twice: set[int] = set()
    for p in start.since:
        if p.vbucket in named:
            twice.add(p.vbucket)  # BAD_POSITION for each repeat; the vbucket starts live
        else:
            named[p.vbucket] = p
    expected: list[Message] = []
    evicted = 0
    bad = 0
    epoch_changed = 0
    for vb in vbs:
        ms = by_vb.get(vb, [])
        first = retained.get(vb) or (len(ms) + 1)
        if vb in named:
            p = named[vb]
            if vb in twice:
                continue
            if ms and p.epoch != ms[0].epoch:
                epoch_changed += 1
                after = 0
            elif p.offset > len(ms):
                bad += 1
                continue
            else:
                after = p.offset
            evicted += max(0, first - (after + 1))
            expected += [m for m in ms if m.offset > after and m.offset >= first and matches(m)]
        elif start.since_time:
            expected += [
                m for m in ms if m.ts_broker >= start.since_time and m.offset >= first and matches(m)
            ]
        elif start.last:
            expected += [m for m in ms if m.offset >= first and matches(m)][-start.last :]
    event(f"replayed {'some' if replayed else 'none'}; evicted {'some' if evicted else 'none'}")
    event(f"epoch changed {bool(epoch_changed)}; bad {bool(bad)}; twice {bool(twice)}")
    assert replayed == expected
    assert len(errors) == bad + len(start.since) - len(named)
    assert all(e.code == ErrorCode.BAD_POSITION and not e.fatal and e.sid == 1 for e in errors)
    if start.since:
        told = [f for f in notices if f.reason == LossReason.EVICTED]
        assert sum(f.dropped for f in told) == evicted
        for f in told:  # a start from a position: exact, offsets at .. through
            assert f.dropped and f.through == Position(f.at.vbucket, f.at.epoch, f.at.offset + f.dropped - 1)  # type: ignore[union-attr]
        changed = [f for f in notices if f.reason == LossReason.EPOCH_CHANGED]
        assert len(changed) == epoch_changed
        for f in changed:  # the old epoch's end is not known; the current epoch goes on from its start
            current = by_vb[f.at.vbucket][0].epoch  # type: ignore[union-attr]
            assert f.dropped == 0 and f.through == Position(f.at.vbucket, current, 0)  # type: ignore[union-attr]
