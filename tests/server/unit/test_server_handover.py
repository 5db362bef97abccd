"""A vbucket's sequence across a planned move, worker to worker (broky.server.shard.moves).

Two real Shards stand for the old owner (node x) and the new one (node w),
each with in-memory transports; the maps and the handover record travel
between them as the cluster agent would carry them through etcd. Every test
runs on both read paths (the pure-Python reference and its compiled twin):
the twin must never stamp a vbucket whose sequence is on its way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from broky.errors import ErrorCode
from broky.protocol import (
    VBUCKETS,
    Error,
    LossNotice,
    LossReason,
    Message,
    NodeInfo,
    Read,
    ReadDone,
    Replay,
    Subscribe,
    VBucketMap,
    encode_frame,
    encode_message,
    vbucket_of,
)
from broky.protocol.frames import Position
from broky.protocol.routing import NO_OWNER
from broky.server.config import ServerConfig
from broky.server.shard import fastpath
from broky.server.shard.connection import Connection
from broky.server.shard.core import Shard
from broky.server.shard.moves import Handed
from tests.support.shardkit import Recorder

X, W = NodeInfo("x", "127.0.0.1", 1, 1), NodeInfo("w", "127.0.0.1", 2, 1)
HALF = VBUCKETS // 2
KP = next(kp for kp in (b"m-%d" % i for i in range(10_000)) if vbucket_of(kp) < HALF)  # x's, moves to w
STAY = next(kp for kp in (b"s-%d" % i for i in range(10_000)) if vbucket_of(kp) >= HALF)  # w's own
VB = vbucket_of(KP)
OWNERS = tuple((0 if vb < HALF else 1, 0) for vb in range(VBUCKETS))
MOVED = tuple((1, 0) if vb == VB else o for vb, o in enumerate(OWNERS))
BEFORE = VBucketMap(1, (X, W), OWNERS)
PREPARE = VBucketMap(2, (X, W), OWNERS, tuple((1, 0) if vb == VB else NO_OWNER for vb in range(VBUCKETS)))
COMMIT = VBucketMap(3, (X, W), MOVED)


class Held(Recorder):
    """A transport that also records whether its reads are paused."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


@pytest.fixture(params=[False, True], ids=["pure-python", "compiled"])
def compiled(request: pytest.FixtureRequest) -> Iterator[bool]:
    if request.param and fastpath.compiled_scan is None:
        pytest.skip(f"no compiled fast path: {fastpath.description}")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield request.param
    asyncio.set_event_loop(None)
    loop.close()


class Node:
    """One worker of one node: a Shard, its connections and what it reported."""

    def __init__(self, info: NodeInfo, compiled: bool, move_timeout: float = 10.0) -> None:
        config = ServerConfig(workers=1, node_id=info.node_id, move_timeout=move_timeout)
        self.shard = Shard(config, 0, asyncio.get_event_loop(), vmap=BEFORE, compiled=compiled)
        self.reported: list[bytes] = []
        self.shard.moves.report = self.reported.append
        self.next_id = 0

    def connection(self) -> Connection:
        self.next_id += 1
        c = Connection(self.shard, b"", self.next_id)
        c.transport = Held()  # type: ignore[assignment]
        self.shard.conns[self.next_id] = c
        return c

    def subscriber(self) -> Connection:
        c = self.connection()
        self.shard.subscribe(c, Subscribe(1, b"h.>", None))
        return c


def publish(node: Node, c: Connection, kp: bytes, first: int, count: int) -> None:
    node.shard.feed(c, b"".join(encode_message(kp, b"h.k", b"%d" % i) for i in range(first, first + count)))


def frames(c: Connection) -> list[object]:
    """Every frame written to c."""
    transport: Held = c.transport  # type: ignore[assignment]
    return transport.frames()


def errors(c: Connection) -> list[int]:
    return [f.code for f in frames(c) if isinstance(f, Error)]


def messages(c: Connection) -> list[Message]:
    return [f for f in frames(c) if isinstance(f, Message)]


def dones(c: Connection) -> list[ReadDone]:
    return [f for f in frames(c) if isinstance(f, ReadDone)]


def positions(c: Connection, vb: int = VB) -> list[tuple[int, int, int]]:
    """(epoch, offset, payload) of what c received of vb."""
    return [(m.epoch, m.offset, int(m.payload)) for m in messages(c) if m.vbucket == vb]


def test_a_planned_move_continues_the_sequence_and_holds_what_needs_it(compiled: bool) -> None:
    x, w = Node(X, compiled), Node(W, compiled)
    x_sub, w_sub = x.subscriber(), w.subscriber()
    x_pub, w_pub = x.connection(), w.connection()
    publish(x, x_pub, KP, 0, 5)  # offsets 1..5 at x
    epoch = x.shard.seqs.epoch_of(VB)
    for node in (x, w):
        node.shard.apply_map(PREPARE)
    assert w.shard.accepts[VB] and not w.shard.owned[VB]
    # A client that adopted the commit early publishes to w: w holds it (its own vbucket's
    # message, before it in the same read, is routed), while x still stamps the vbucket.
    w.shard.feed(w_pub, encode_message(STAY, b"h.k", b"0") + encode_message(KP, b"h.k", b"7"))
    assert w_pub.held and w_pub.transport.paused  # type: ignore[attr-defined]
    assert positions(w_sub) == [] and [m.key_partition for m in messages(w_sub)] == [STAY]
    publish(w, w_pub, KP, 8, 1)  # a read that raced with the pause waits behind it
    publish(x, x_pub, KP, 5, 2)  # offsets 6, 7 at x
    # x applies the commit: it refuses the vbucket from now on, and hands its sequence over
    x.shard.apply_map(COMMIT)
    publish(x, x_pub, KP, 99, 1)
    assert errors(x_pub) == [ErrorCode.NOT_MY_VBUCKET]
    (record,) = x.reported
    handed = Handed.decode(record)
    assert (handed.node, handed.worker, handed.version) == ("x", 0, COMMIT.version)
    assert [(vb, e, n) for vb, e, n, _ in handed.sequences] == [(VB, epoch, 8)]
    assert positions(x_sub) == [(epoch, o, o - 1) for o in range(1, 8)]
    # w applies the commit: still nothing stamped; a start from positions waits too
    w.shard.apply_map(COMMIT)
    w_new = w.connection()
    w.shard.feed(w_new, encode_frame(Subscribe(2, b"h.>", None, (Position(VB, epoch, 5),))))
    assert w_new.held and frames(w_new) == []
    # A Read waits only when it covers the vbucket: one narrowed to others is answered now.
    w_other, w_read = w.connection(), w.connection()
    w.shard.feed(w_other, encode_frame(Read(1, b">", vbuckets=(vbucket_of(STAY),))))
    assert w_other not in w.shard.moves.held
    assert [(d.vbucket, d.next) for d in dones(w_other)] == [(vbucket_of(STAY), 2)]
    w.shard.feed(w_read, encode_frame(Read(1, b">", vbuckets=(vbucket_of(STAY), VB))))
    assert w_read.held and frames(w_read) == []
    w.shard.moves.take_handed(record)  # through etcd, from x's agent to w's
    assert not w_pub.held and not w_new.held and not w.shard.moves.held and not w.shard.moves.awaiting
    assert sorted((d.vbucket, d.next) for d in dones(w_read)) == sorted([(vbucket_of(STAY), 2), (VB, 10)])
    assert positions(w_sub) == [(epoch, 8, 7), (epoch, 9, 8)]  # the sequence goes on, in order
    answer = frames(w_new)
    (head,) = [f for f in answer if isinstance(f, Replay)]
    assert head.messages == 2  # 8, 9 replayed: w retains what it stamped
    (evicted,) = [f for f in answer if isinstance(f, LossNotice)]
    # 6 and 7 were x's, w never had them: told, with their count and where they start
    assert (evicted.reason, evicted.dropped, evicted.at) == (LossReason.EVICTED, 2, Position(VB, epoch, 6))
    stats = w.shard.stats
    assert (stats.vbuckets_continued, stats.vbuckets_restarted, x.shard.stats.vbuckets_handed_over) == (
        1,
        0,
        1,
    )
    # ts_broker of the vbucket never went back across the move
    ts = [m.ts_broker for m in messages(x_sub) + messages(w_sub) if m.vbucket == VB]
    assert ts == sorted(ts)


def test_a_record_of_another_worker_or_an_earlier_move_is_not_taken(compiled: bool) -> None:
    w = Node(W, compiled)
    w.shard.apply_map(PREPARE)
    stale = Handed("x", 0, PREPARE.version, [(VB, 42, 100, 0)])  # not after the prepare
    other = Handed("y", 0, COMMIT.version, [(VB, 43, 200, 0)])  # not the owner it waits for
    for record in (stale, other):
        w.shard.moves.take_handed(record.encode())
    w.shard.apply_map(COMMIT)
    assert VB in w.shard.moves.awaiting
    # Known early (an etcd resync reads the handover keys before the map): used once awaited.
    w2 = Node(W, compiled)
    w2.shard.moves.take_handed(Handed("x", 0, COMMIT.version, [(VB, 44, 300, 0)]).encode())
    w2.shard.apply_map(PREPARE)
    assert not w2.shard.moves.awaiting
    assert (w2.shard.seqs.epoch_of(VB), w2.shard.seqs.next_of(VB)) == (44, 300)


def test_past_the_deadline_or_without_the_old_owner_the_sequence_starts_a_new_epoch(compiled: bool) -> None:
    w = Node(W, compiled, move_timeout=0.0)
    sub, pub = w.subscriber(), w.connection()
    w.shard.apply_map(PREPARE)
    w.shard.apply_map(COMMIT)
    publish(w, pub, KP, 0, 1)
    assert pub.held
    before = w.shard.seqs.epoch_of(VB)
    w.shard.tick()  # past --move-timeout (0 here): a failover
    assert not pub.held and w.shard.stats.vbuckets_restarted == 1
    ((epoch, offset, _),) = positions(sub)
    assert offset == 1 and epoch != before
    # A failover's commit no longer lists the dead owner's node: no waiting at all.
    alone = Node(W, compiled)
    alone.shard.apply_map(PREPARE)
    alone.shard.apply_map(VBucketMap(3, (W,), tuple((0, 0) for _ in range(VBUCKETS))))
    assert not alone.shard.moves.awaiting and alone.shard.stats.vbuckets_restarted == HALF


def test_a_cancelled_move_releases_what_it_held(compiled: bool) -> None:
    w = Node(W, compiled)
    pub = w.connection()
    w.shard.apply_map(PREPARE)
    publish(w, pub, KP, 0, 1)
    assert pub.held
    w.shard.apply_map(VBucketMap(3, (X, W), OWNERS))  # cancelled: x keeps it
    assert not pub.held and not w.shard.moves.awaiting
    assert errors(pub) == [ErrorCode.NOT_MY_VBUCKET]
    assert w.reported == []  # it never had the sequence: nothing to hand over


def test_a_worker_that_starts_with_a_prepared_map_awaits_what_moves_to_it(compiled: bool) -> None:
    # A node that joins once its move is prepared (or a worker restarted meanwhile)
    # starts with that map: its own vbuckets start new epochs, the incoming ones wait.
    config = ServerConfig(workers=1, node_id="w")
    shard = Shard(config, 0, asyncio.get_event_loop(), vmap=PREPARE, compiled=compiled)
    assert list(shard.moves.awaiting) == [VB]
    waited = shard.moves.awaiting[VB]
    assert (waited.node, waited.worker, waited.since) == ("x", 0, PREPARE.version)
    shard.moves.take_handed(Handed("x", 0, COMMIT.version, [(VB, 45, 400, 0)]).encode())
    assert (shard.seqs.epoch_of(VB), shard.seqs.next_of(VB)) == (45, 400)


# Another vbucket of x's that stays at x.
HOME = next(
    kp for kp in (b"h-%d" % i for i in range(10_000)) if vbucket_of(kp) < HALF and vbucket_of(kp) != VB
)
BACK = VBucketMap(4, (X, W), OWNERS)  # VB comes back to x (a failover-like commit: no prepare)


def read(node: Node, rd: Read) -> Connection:
    """A new connection of node's that sent `rd`, and got its answer."""
    c = node.connection()
    node.shard.feed(c, encode_frame(rd))
    pump()  # its batches after the first one
    return c


def test_the_old_owner_serves_what_it_retained_of_a_vbucket_it_handed_over(compiled: bool) -> None:
    x = Node(X, compiled)
    pub = x.connection()
    publish(x, pub, KP, 0, 7)  # offsets 1..7 at x
    publish(x, pub, HOME, 0, 2)
    epoch = x.shard.seqs.epoch_of(VB)
    x.shard.apply_map(PREPARE)
    x.shard.apply_map(COMMIT)  # handed over: VB is former here, its 7 messages stay
    assert x.shard.seqs.former == {VB: (epoch, 8)}
    snap = x.shard.snapshot()
    assert (snap["former_vbuckets"], snap["former_messages"], snap["replay_dropped_messages"]) == (1, 7, 0)
    # Named in `vbuckets`: its range up to the handover, and ReadDone.moved.
    c = read(x, Read(1, b">", vbuckets=(VB,)))
    assert positions(c) == [(epoch, o, o - 1) for o in range(1, 8)]
    assert dones(c) == [ReadDone(1, VB, epoch, 8, 0, False, 0, True)]
    # With key_partition too, and a stop past the handover: the range ends at it.
    c = read(x, Read(2, b">", KP, (Position(VB, epoch, 3),), 0, (Position(VB, epoch, 99),), (VB,)))
    assert positions(c) == [(epoch, o, o - 1) for o in range(4, 8)]
    assert dones(c) == [ReadDone(2, VB, epoch, 8, 0, False, 0, True)]
    # A start of another epoch: from offset 1, epoch_changed (the rules of section 5.2).
    c = read(x, Read(3, b">", start=(Position(VB, epoch + 1, 3),), vbuckets=(VB,)))
    assert len(positions(c)) == 7 and dones(c) == [ReadDone(3, VB, epoch, 8, 0, True, 0, True)]
    # A whole read, or key_partition's alone, covers owned vbuckets only.
    c = read(x, Read(4, b">"))
    assert positions(c) == [] and VB not in {d.vbucket for d in dones(c)}
    assert not any(d.moved for d in dones(c)) and len(dones(c)) == HALF - 1
    c = read(x, Read(5, b">", KP))
    assert errors(c) == [ErrorCode.NOT_MY_VBUCKET] and positions(c) == []
    # Neither owned nor former: NOT_MY_VBUCKET; a start past the handover: BAD_POSITION.
    c = read(x, Read(6, b">", vbuckets=(vbucket_of(STAY),)))
    assert errors(c) == [ErrorCode.NOT_MY_VBUCKET]
    c = read(x, Read(7, b">", start=(Position(VB, epoch, 8),), vbuckets=(VB, vbucket_of(HOME))))
    assert errors(c) == [ErrorCode.BAD_POSITION] and dones(c) == []
    # Named with an owned one: both answered, in vbucket order, moved only for VB.
    c = read(x, Read(8, b">", vbuckets=(vbucket_of(HOME), VB, vbucket_of(STAY))))
    assert [(d.vbucket, d.next, d.moved) for d in dones(c)] == sorted(
        [(VB, 8, True), (vbucket_of(HOME), 3, False)]
    )
    # It comes back: what x retained of it goes (counted), before it awaits its sequence.
    x.shard.apply_map(BACK)
    assert x.shard.seqs.former == {} and x.shard.stats.replay_dropped_messages == 7
    assert x.shard.replay is not None and x.shard.replay.count(VB) == 0
    assert x.shard.seqs.epoch_of(VB) != epoch


def pump(steps: int = 200) -> None:
    """Run the loop's pending callbacks (a bounded read's next batches)."""
    loop = asyncio.get_event_loop()
    for _ in range(steps):
        loop.run_until_complete(asyncio.sleep(0))


def test_a_read_in_progress_reads_on_when_its_vbucket_moves_away_and_not_when_it_comes_back(
    compiled: bool,
) -> None:
    x = Node(X, compiled)
    pub = x.connection()
    publish(x, pub, KP, 0, 20)
    epoch = x.shard.seqs.epoch_of(VB)
    slow = x.connection()
    slow.limit = slow.cap = 300  # a message or two per batch
    x.shard.feed(slow, encode_frame(Read(1, b">", KP)))
    assert 0 < len(positions(slow)) < 20 and slow.bounded_read is not None
    x.shard.apply_map(PREPARE)
    x.shard.apply_map(COMMIT)  # moved away mid-read: its messages stay, the read goes on
    pump()
    assert slow.bounded_read is None
    assert positions(slow) == [(epoch, o, o - 1) for o in range(1, 21)]
    assert dones(slow) == [ReadDone(1, VB, epoch, 21, 0, False, 0, True)]
    # A read of the former vbucket when it comes back: the rest of its range is gone.
    again = x.connection()
    again.limit = again.cap = 300
    x.shard.feed(again, encode_frame(Read(2, b">", vbuckets=(VB,))))
    got = len(positions(again))
    assert 0 < got < 20
    x.shard.apply_map(BACK)
    pump()
    assert len(positions(again)) == got
    assert dones(again) == [ReadDone(2, VB, epoch, 21, 20 - got, False, 0, False)]
