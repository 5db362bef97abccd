"""Starts from positions against a real server (broky.server.shard.positions): a known
sequence is published, then subscriptions start `since` positions, `since_time`,
`last` N, and are answered with the retained messages, the live ones after them,
and exact notices of what is missing."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from broky.errors import ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import (
    Error,
    Frame,
    LossNotice,
    LossReason,
    Message,
    Pause,
    PreviousConnection,
    Replay,
    Resume,
    Subscribe,
    encode_message,
)
from broky.protocol.frames import Position
from broky.protocol.routing import vbucket_of
from tests.support.http import http_get
from tests.support.serverproc import ServerProcess, kill_worker
from tests.support.wire import Wire, kp_for_worker

KP = kp_for_worker(0, 1, "hist")
VB = vbucket_of(KP)


def publish(w: Wire, start: int, stop: int, key: bytes = b"h.k") -> None:
    for i in range(start, stop):
        w.publish(KP, key, b"%d" % i)
    assert w.flush() == []


def start(w: Wire, sub: Subscribe) -> tuple[Replay, list[Message], list[Frame]]:
    """Subscribe; the Replay, the messages it announced, and every other frame up to the Pong."""
    w.send(sub)
    frames = w.flush()
    head = [f for f in frames if isinstance(f, Replay)]
    assert len(head) == 1, frames
    at = frames.index(head[0])
    msgs = frames[at + 1 : at + 1 + head[0].messages]
    assert all(isinstance(m, Message) for m in msgs), frames
    others = frames[:at] + frames[at + 1 + head[0].messages :]
    return head[0], msgs, others  # type: ignore[return-value]


def payloads(msgs: list[Message]) -> list[int]:
    return [int(m.payload) for m in msgs]


def test_since_a_position_replays_the_rest_then_live_with_no_gap_or_duplicate(
    start_server: Any,
) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as first:
        first.subscribe(1, b"h.*")
        first.flush()
        publish(pub, 0, 50)
        got = first.messages()
        assert payloads(got) == list(range(50))
        offsets = [m.offset for m in got]
        assert offsets == list(range(offsets[0], offsets[0] + 50))  # consecutive, +1 each
        assert {m.vbucket for m in got} == {VB} and len({m.epoch for m in got}) == 1
        mid = got[19]
        with Wire.hello(server.address) as again:
            head, msgs, others = start(
                again, Subscribe(1, b"h.*", since=(Position(VB, mid.epoch, mid.offset),))
            )
            assert others == []
            assert payloads(msgs) == list(range(20, 50))
            assert [m.offset for m in msgs] == offsets[20:]
            assert bytes(msgs[0].uid or b"") == bytes(got[20].uid or b"")
            assert head.sid == 1 and head.ts > 0
            publish(pub, 50, 55)
            assert payloads(again.messages()) == list(range(50, 55))  # live, right after


def dispatch(frames: list[Frame], patterns: dict[int, bytes], waiting: set[int]) -> dict[int, list[int]]:
    """Each subscription's payloads, dispatched as schema/README.md 5 and 5.1 say: the
    messages after a Replay to its sid alone; a bare one to every matching subscription,
    except one in `waiting` (its Subscribe named a start) until its Replay has come."""
    got: dict[int, list[int]] = {sid: [] for sid in patterns}
    tokens = {sid: parse_pattern(p) for sid, p in patterns.items()}
    i = 0
    while i < len(frames):
        f = frames[i]
        if isinstance(f, Replay):
            waiting.discard(f.sid)
            got[f.sid] += payloads(frames[i + 1 : i + 1 + f.messages])  # type: ignore[arg-type]
            i += 1 + f.messages
            continue
        if isinstance(f, Message):
            for sid, t in tokens.items():
                if sid not in waiting and pattern_matches(t, f.key):
                    got[sid].append(int(f.payload))
        i += 1
    return got


def test_the_seam_a_started_subscription_takes_no_bare_message_before_its_replay(
    start_server: Any,
) -> None:
    # schema/README.md 5.1, "The seam, on the client": bare messages for the connection's
    # other subscriptions that arrive before a start's Replay are in that replay too.
    # Pause makes them certain: kept, they come out ahead of the Replay.
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as c:
        c.subscribe(1, b"h.*")
        assert c.flush() == []
        publish(pub, 0, 5)
        got = c.messages()
        c.send(Pause())
        assert c.flush() == []  # the Pong is not kept
        publish(pub, 5, 10)  # kept for sid 1
        c.send(Subscribe(2, b"h.>", since=(Position(VB, got[-1].epoch, got[-1].offset),)), Resume())
        frames = c.flush()
        publish(pub, 10, 15)
        frames += c.flush()
        assert [type(f).__name__ for f in frames] == ["Message"] * 5 + ["Replay"] + ["Message"] * 10
        patterns = {1: b"h.*", 2: b"h.>"}
        by_rule = dispatch(frames, patterns, waiting={2})
        assert by_rule == {1: list(range(5, 15)), 2: list(range(5, 15))}  # once each, in order
        literal = dispatch(frames, patterns, waiting=set())  # §5's rule alone: twice, out of order
        assert literal[2] == [*range(5, 10), *range(5, 15)]


def test_since_time_and_last_n_choose_from_the_retained(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        publish(pub, 0, 10, b"h.a")
        publish(pub, 10, 20, b"h.b")
        time.sleep(0.01)
        middle = time.time_ns()
        time.sleep(0.01)
        publish(pub, 20, 30, b"h.a")
        _, msgs, others = start(sub, Subscribe(1, b"h.*", since_time=middle))
        assert payloads(msgs) == list(range(20, 30)) and others == []
        assert all(m.ts_broker >= middle for m in msgs)
        _, msgs, _ = start(sub, Subscribe(2, b"h.b", last=4))  # the last 4 that match, oldest first
        assert payloads(msgs) == [16, 17, 18, 19]
        _, msgs, _ = start(sub, Subscribe(3, b"h.a", KP, last=100))
        assert payloads(msgs) == list(range(10)) + list(range(20, 30))
        publish(pub, 30, 31, b"h.b")  # one copy to the connection, whatever matches it
        live = sub.messages()
        assert payloads(live) == [30]


def test_evicted_positions_are_told_with_their_count(start_server: Any) -> None:
    # A 64 KiB buffer: each publish below is its own read, so its own segment.
    server: ServerProcess = start_server("--replay-bytes", "64K", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        sub.subscribe(1, b"h.*")
        sub.flush()
        pub.publish(KP, b"h.k", b"0")
        pub.flush()
        first = sub.messages()[0]
        for i in range(1, 200):
            pub.publish(KP, b"h.k", b"%d" % i + b"." * 1000)
            pub.flush()
        sub.messages()
        with Wire.hello(server.address) as late:
            _, msgs, others = start(
                late, Subscribe(1, b"h.*", since=(Position(VB, first.epoch, first.offset),))
            )
            assert msgs, "the newest are retained"
            oldest = msgs[0].offset
            assert oldest > first.offset + 1
            [notice] = others
            assert isinstance(notice, LossNotice)
            assert notice == LossNotice(
                oldest - first.offset - 1,
                LossReason.EVICTED,
                1,
                Position(VB, first.epoch, first.offset + 1),
                Position(VB, first.epoch, oldest - 1),  # through: the last one gone
            )
            assert len(msgs) + notice.dropped == 199  # every message after the position: replayed or told


def test_another_epoch_is_told_and_the_current_one_replayed_from_its_start(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        publish(pub, 0, 5)
        gone = Position(VB, 12345, 77)  # an epoch this worker never had
        _, msgs, others = start(sub, Subscribe(1, b"h.*", since=(gone,)))
        assert payloads(msgs) == list(range(5))
        current = msgs[0].epoch  # through: the current epoch, from its start
        assert others == [
            LossNotice(0, LossReason.EPOCH_CHANGED, 1, Position(VB, 12345, 78), Position(VB, current, 0))
        ]


def test_a_position_ahead_is_refused_but_the_subscription_stands(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        sub.subscribe(9, b"h.*")
        sub.flush()
        publish(pub, 0, 3)
        last = sub.messages()[-1]
        ahead = Position(VB, last.epoch, last.offset + 1)  # not accepted yet
        head, msgs, others = start(sub, Subscribe(1, b"h.*", since=(ahead,)))
        assert msgs == [] and head.messages == 0
        [err] = others
        assert (
            isinstance(err, Error) and err.code == ErrorCode.BAD_POSITION and not err.fatal and err.sid == 1
        )
        # The last one accepted: nothing to replay.
        head, msgs, others = start(sub, Subscribe(2, b"h.*", since=(Position(VB, last.epoch, last.offset),)))
        assert (head.messages, others) == (0, [])
        publish(pub, 3, 4)
        assert payloads(sub.messages()) == [3]  # live (one copy for sids 1, 2 and 9)


def test_without_a_replay_buffer_a_start_replays_nothing_and_tells_what_is_gone(start_server: Any) -> None:
    server: ServerProcess = start_server("--replay-bytes", "0", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        sub.subscribe(9, b"h.*")
        sub.flush()
        publish(pub, 0, 5)
        got = sub.messages()
        head, msgs, others = start(sub, Subscribe(1, b"h.*", last=10))
        assert (head.messages, msgs, others) == (0, [], [])
        since = (Position(VB, got[1].epoch, got[1].offset),)
        head, msgs, others = start(sub, Subscribe(2, b"h.*", since=since))
        assert (head.messages, msgs) == (0, [])
        assert others == [
            LossNotice(
                3,
                LossReason.EVICTED,
                2,
                Position(VB, got[1].epoch, got[2].offset),
                Position(VB, got[1].epoch, got[4].offset),
            )
        ]
        publish(pub, 5, 6)
        assert payloads(sub.messages()) == [5]


def test_a_replay_larger_than_the_pending_bound_is_cut_and_told_exactly(start_server: Any) -> None:
    server: ServerProcess = start_server("--max-pending-bytes", "64K", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        for i in range(100):
            pub.publish(KP, b"h.k", b"%d" % i + b"." * 2000)
        assert pub.flush() == []
        head, msgs, others = start(sub, Subscribe(1, b"h.*", last=1000))
        assert 0 < head.messages == len(msgs) < 100
        assert payloads_prefix(msgs) == list(range(len(msgs)))
        [notice] = others
        assert isinstance(notice, LossNotice)
        assert notice.reason == LossReason.SLOW_CONSUMER and notice.sid == 1
        assert notice.dropped == 100 - len(msgs)
        assert notice.at is not None and notice.at.offset == msgs[-1].offset + 1
        assert notice.through is not None and notice.through.offset == msgs[-1].offset + notice.dropped


def payloads_prefix(msgs: list[Message]) -> list[int]:
    return [int(m.payload.split(b".")[0]) for m in msgs]


def test_a_resume_by_positions_gets_the_undelivered_replayed_not_told_lost(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    # A subscriber that reads little: 3,000 deliveries of 1 KiB back up in TCP and in
    # the worker, then it goes away, having read 40 (as in test_server_resume).
    slow = Wire.hello(server.address, rcvbuf=16384)
    slow.subscribe(1, b"s.>")
    assert slow.flush() == []
    with Wire.hello(server.address) as pub:
        pub.send(*(encode_message(KP, b"s.x", b"%04d" % i + bytes(1020)) for i in range(3000)))
        assert pub.flush() == []
    got = [slow.expect(Message) for _ in range(40)]
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    slow.close()  # a reset: nothing more arrives
    time.sleep(0.3)
    assert slow.welcome is not None
    prev = PreviousConnection(slow.welcome.connection_id, 40, 0, slow.welcome.resume_token)
    with Wire.hello(server.address, previous=prev, positions=True) as again:
        assert again.welcome is not None and again.welcome.resumed is not None
        since = (Position(VB, got[-1].epoch, got[-1].offset),)
        again.send(Subscribe(1, b"s.>", since=since))
        head = again.expect(Replay)  # no CONNECTION_LOST before it: the replay gives them back
        assert head.messages == 2960
        rest = [again.expect(Message) for _ in range(2960)]
        assert [m.payload[:4] for m in got + rest] == [b"%04d" % i for i in range(3000)]
        assert again.flush() == []
    stats = json.loads(http_get(server, "/stats")[1])["workers"][0]
    assert stats["resumes_by_positions"] == 1 and stats["messages_replayed"] == 2960


def test_a_killed_worker_is_a_new_epoch_told_exactly(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub:
        sub = Wire.hello(server.address)
        sub.subscribe(1, b"k.>")
        sub.flush()
        publish(pub, 0, 10, b"k.x")
        got = sub.messages()
        assert payloads(got) == list(range(10))
        assert sub.welcome is not None
        prev = PreviousConnection(sub.welcome.connection_id, 10, 0, sub.welcome.resume_token)
    kill_worker(server, 0)
    sub.close()
    with Wire.hello(server.address) as pub:
        publish(pub, 10, 13, b"k.x")  # the new incarnation's first three
    with Wire.hello(server.address, previous=prev, positions=True) as again:
        since = (Position(VB, got[-1].epoch, got[-1].offset),)
        _, msgs, others = start(again, Subscribe(1, b"k.>", since=since))
        assert payloads(msgs) == [10, 11, 12]  # the new epoch from its first offset
        assert {m.epoch for m in msgs} != {got[-1].epoch} and [m.offset for m in msgs] == [1, 2, 3]
        assert others == [
            LossNotice(
                0,
                LossReason.EPOCH_CHANGED,
                1,
                Position(VB, got[-1].epoch, 11),
                Position(VB, msgs[0].epoch, 0),
            )
        ]


def test_a_start_from_a_time_counts_each_vbucket_on_its_own(start_server: Any) -> None:
    """Without a replay buffer, a start from a time T is told per vbucket: nothing for one
    that stamped nothing at or after T (before: any traffic of the worker after T made
    it "unknown"), an exact count for one whose whole sequence came after T, and an
    unknown count only for one with traffic on both sides of T; each in a notice of its
    own, so the unknown one does not turn the exact one into "unknown" (before: summed
    into one notice, dropped 0)."""
    server: ServerProcess = start_server("--replay-bytes", "0", workers=1)
    before, after, both = (kp_for_worker(0, 1, name) for name in ("early", "late", "both"))
    assert len({vbucket_of(kp) for kp in (before, after, both)}) == 3
    with Wire.hello(server.address) as pub:
        for kp in (before, both):
            for i in range(5):
                pub.publish(kp, b"t.k", b"%d" % i)
        assert pub.flush() == []
        time.sleep(0.01)
        t = time.time_ns()
        time.sleep(0.01)
        for kp in (after, both):
            for i in range(7):
                pub.publish(kp, b"t.k", b"%d" % i)
        assert pub.flush() == []
        with Wire.hello(server.address) as sub:
            head, msgs, others = start(sub, Subscribe(1, b"t.k", since_time=t))
    assert (head.messages, msgs) == (0, [])
    told = {n.at.vbucket: n for n in others if isinstance(n, LossNotice) and n.at is not None}
    assert len(told) == len(others) == 2 and vbucket_of(before) not in told
    exact, unknown = told[vbucket_of(after)], told[vbucket_of(both)]
    assert (exact.dropped, exact.reason, exact.sid) == (7, LossReason.EVICTED, 1)
    assert exact.at is not None and exact.through is not None
    assert (exact.at.offset, exact.through.offset) == (1, 7)
    assert (unknown.dropped, unknown.reason) == (0, LossReason.EVICTED)  # which of its 12 came after t?
    assert unknown.at is not None and unknown.through is not None
    assert (unknown.at.offset, unknown.through.offset) == (13, 12)  # right after; through its last
