"""Planned moves: a vbucket's sequence goes on at its new owner, same epoch, next offset.

Theory of operation
-------------------
A vbucket's offsets count on the worker that accepts its publishes
(broky.server.shard.sequences). When a planned move (a node joins, or drains) gives
it to another worker, possibly on another node, the sequence continues
there: same epoch, the next offset. Nothing on the data path crosses from
one worker or node to another, so the one number that must travel, the
vbucket's next offset, travels through etcd with the map:

1. The old owner stops accepting the vbucket when it applies the commit (the
   map that gives it to the new owner); from then on a publish for it is
   refused (NOT_MY_VBUCKET). At that moment it knows its last offset, and
   says, once per move and worker, what it handed over
   (`Moves.follow`): a `Handed` record (its node and worker, the map
   version, and per vbucket the epoch, the next offset and the ts_broker of
   its last message). The worker sends it to its master (HANDED on the
   control channel), whose cluster agent writes it to etcd under
   <prefix>/handover/<node_id>/<worker> (broky.cluster.node); every node's
   agent reads it back through its watch and gives it to its workers
   (SEQUENCES), and the new owner resumes the sequence (`take_handed`).
2. The new owner already accepts the vbucket from the prepare map on (a
   client may adopt the commit before this worker has, schema/README.md
   6.3), and the old owner stamps it until it applies the commit: the two
   overlap, and only the old owner knows where it stopped. So the new owner
   stamps nothing of a vbucket that moves here until it has that vbucket's
   record: the vbucket *awaits its sequence* (`awaiting`). A publish for it
   is held (below), and so is a bounded Read or a Subscribe that starts
   from positions or a time and concerns it, once it is owned here
   (before, the old owner answers for it). Offsets thus stay consecutive, with no offset given
   twice in an epoch, and ts_broker does not go back either: the new owner
   stamps nothing earlier than the old owner's last stamp of the vbucket.
3. Bounded: once the vbucket is owned here (the commit), or a publish for it
   waited, its record is awaited at most --move-timeout seconds. Past that
   (the old owner is frozen, or died before it wrote the record; etcd was
   unreachable), or at once when a map no longer lists the old owner's node
   (it died: a failover moves its vbuckets without a prepare of its own),
   the sequence starts again here under a new epoch. A subscriber that
   resumes from a position of the old epoch is then told EPOCH_CHANGED
   (count unknown): what the old owner accepted after the last offset its
   subscribers received may be lost.
4. A worker's first map (its process starts: a node that joins, a worker
   restarted) gives the vbuckets it owns new epochs (broky.server.shard.sequences),
   and the ones a prepared map moves to it await their sequences like any
   that came. A node that starts only after its move was committed without
   it (past the move timeout) owns them from its first map: new epochs.

"Hold" keeps the one meaning it has in broky.server.shard.grace: a connection's
input waits, reads paused, in `rest` (`Connection.held`), and is fed again,
in order, when what it waited for is there. Here a connection is held at its
first frame that needs an awaited sequence, and every held connection is fed
again whenever a sequence arrives or starts again (one that still needs an
awaited one is held again). The read path pays nothing for it: a vbucket
that awaits its sequence has no route in the route cache (`Shard.route`
answers AWAITING, uncached), and the compiled twin leaves uncached routes to
Python.

The old owner keeps what it retained of a vbucket it handed over: the
vbucket becomes *former* here (`Sequences.former`: the epoch and next offset
H it was handed over with, the numbers of its Handed record) and its
Sequences entry keeps them, since the replay buffer counts a vbucket's
retained offsets back from its next offset (broky.server.shard.replay). Message
data never crosses nodes, so a reader whose position is before H reads
offsets up to H - 1 here, with a bounded Read that names the vbucket
(broky.server.shard.positions; ReadDone.moved), and the rest at the new owner. A
former vbucket is never accepted or awaited here: its retained messages go
like any others when evicted, and all at once (`forget_former`, counted in
`replay_dropped_messages`) when it comes back, before it awaits its
sequence again; then its sequence starts again here (until another comes).
A draining node lingers a little while it retains messages of former
vbuckets (--drain-linger, broky.server.master.process).

The part is an object the core builds (`Shard.moves`, broky.server.shard.part):
the core calls `follow` when it takes a map, `awaited` on a route cache miss,
`waits` and `hold` for a control frame while a sequence is awaited, and
`deadlines` from its tick; the worker gives it the records (`take_handed`)
and the channel they are reported on (`report`).

Records are kept per vbucket as they come (`known`, the latest of each), so
one that arrives before this worker applied the map it belongs to (an etcd
resync reads the keys in key order) is used when the vbucket starts
awaiting. A record counts for a vbucket only if it comes from the worker
that owned it when it started awaiting it here, for a map version after
that: a stale record of an earlier move never restarts a sequence that went
on elsewhere since.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from broky import fbs
from broky.protocol import VBUCKETS, Read, Subscribe, decode_frame
from broky.protocol.message import body_type
from broky.protocol.routing import to_ranges, vbucket_of
from broky.server.shard.connection import HELD_FOR_SEQUENCE, OPEN, Connection

if TYPE_CHECKING:
    from collections.abc import Callable

    from broky.protocol import VBucketMap
    from broky.server.shard.part import ShardCore

log = logging.getLogger("broky.worker")

_monotonic = time.monotonic


class Handed(NamedTuple):
    """What one worker handed over when it applied map `version`: per vbucket
    (vbucket, epoch, next offset, ts_broker of its last message or 0)."""

    node: str
    worker: int
    version: int
    sequences: list[tuple[int, int, int, int]]

    def encode(self) -> bytes:
        return json.dumps(
            {"node": self.node, "worker": self.worker, "version": self.version, "sequences": self.sequences},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Handed:
        """Raises ValueError for a value that is not a record."""
        try:
            raw = json.loads(data)
            handed = cls(
                str(raw["node"]),
                int(raw["worker"]),
                int(raw["version"]),
                [(int(vb), int(e), int(n), int(t)) for vb, e, n, t in raw["sequences"]],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a handover record: {exc!r}") from None
        if any(not 0 <= vb < VBUCKETS or n < 1 for vb, _, n, _ in handed.sequences):
            raise ValueError(f"not a handover record: {raw!r}")
        return handed


class Awaited:
    """A vbucket that awaits its sequence: who owned it when it started to move here
    (node id, worker), the map version from which this worker accepts it, and the
    monotonic time past which its sequence starts again here (0: not counting yet)."""

    __slots__ = ("node", "worker", "since", "deadline")

    def __init__(self, node: str, worker: int, since: int) -> None:
        self.node = node
        self.worker = worker
        self.since = since
        self.deadline = 0.0


class Moves:
    """The Shard's part that hands sequences over, and awaits them (`Shard.moves`), built with
    the core (broky.server.shard.part); the read path tests `awaiting` on a route cache miss."""

    __slots__ = ("core", "awaiting", "known", "held", "report", "timeout")

    def __init__(self, core: ShardCore, timeout: float) -> None:
        self.core = core
        self.awaiting: dict[int, Awaited] = {}
        # vbucket -> (node, worker, version, epoch, next offset, ts) of the latest record naming it
        self.known: dict[int, tuple[str, int, int, int, int, int]] = {}
        self.held: list[Connection] = []  # connections held until a sequence arrives
        self.report: Callable[[bytes], object] | None = None  # sends a Handed record to the master
        self.timeout = timeout  # --move-timeout

    def follow(self, old: VBucketMap, before: bytes, after: bytes) -> None:
        """The map changed from `old` to the core's; `before` and `after` say which
        vbuckets this worker accepted (see the header). A vbucket that went is handed
        over (it becomes a former vbucket: its retained messages stay); one that came
        awaits its sequence (at the start, `before` is what the first map gives this
        worker: a prepared move to it, a node that joins in the middle of its own move,
        comes)."""
        core = self.core
        vmap = core.map
        seqs, replay = core.seqs, core.replay
        former = seqs.former
        mine = (vmap.node_index(core.config.node_id), core.index)
        handed: list[tuple[int, int, int, int]] = []
        released = False
        for vb in range(VBUCKETS):
            if before[vb] == after[vb]:
                continue
            if after[vb]:  # came: from the worker that owns it now (or did, if this map is a commit)
                if vb in former:  # back: what it retained of its earlier stay goes
                    self.forget_former(vb)
                source, node, worker = vmap, *vmap.owners[vb]
                if (node, worker) == mine:
                    source, node, worker = old, *old.owners[vb]
                self.awaiting[vb] = Awaited(source.nodes[node].node_id, worker, vmap.version)
                self.take_known(vb)
                continue
            if self.awaiting.pop(vb, None) is not None:  # went before its sequence came: nothing to hand
                released = True
            else:
                last_ts = replay.last_ts(vb) if replay is not None else 0
                epoch, nxt = seqs.epoch_of(vb), seqs.next_of(vb)
                if nxt > 1 and not last_ts:
                    last_ts = seqs.last_ts_of(vb) or seqs.last_ts  # its last stamp here
                handed.append((vb, epoch, nxt, last_ts))
                # Former: its sequence stays (epoch, next) here, where the replay buffer counts
                # its retained offsets from (broky.server.shard.replay); it stamps nothing more.
                former[vb] = (epoch, nxt)
                continue
            seqs.restart(vb)  # should it come back, it awaits its sequence again
        core.stats.vbuckets_handed_over += len(handed)
        if handed and self.report is not None:
            self.report(Handed(core.config.node_id, core.index, vmap.version, handed).encode())
        if self.awaiting:
            listed = {n.node_id for n in vmap.nodes}
            now = _monotonic()
            orphans = []
            owned = core.owned
            for vb, w in self.awaiting.items():
                if w.node not in listed:  # its owner died: nobody will hand it over
                    orphans.append(vb)
                elif owned[vb] and not w.deadline:
                    w.deadline = now + self.timeout
            if orphans:
                self.restart_sequences(orphans, "their node left the map: a failover")
                released = True
        if released:
            self.release_held()

    def take_handed(self, data: bytes) -> None:
        """A handover record from etcd (the master's SEQUENCES): continue the sequences
        this worker awaits from that worker; keep the others in case they are awaited later."""
        index = self.core.index
        try:
            handed = Handed.decode(data)
        except ValueError as exc:
            log.error("worker %d: ignoring a handover record: %s", index, exc)
            return
        known = self.known
        resumed = 0
        for vb, epoch, nxt, ts in handed.sequences:
            entry = known.get(vb)
            if entry is None or entry[2] < handed.version:
                known[vb] = (handed.node, handed.worker, handed.version, epoch, nxt, ts)
            if vb in self.awaiting and self.take_known(vb):
                resumed += 1
        if resumed:
            log.info(
                "worker %d continues the sequences of %d vbuckets handed over by worker %d of node %s "
                "(map version %d)", index, resumed, handed.worker, handed.node, handed.version,
            )  # fmt: skip
            self.release_held()

    def take_known(self, vb: int) -> bool:
        """Continue vb's sequence if the latest record naming it is the one it awaits."""
        w = self.awaiting[vb]
        entry = self.known.get(vb)
        if entry is None:
            return False
        node, worker, version, epoch, nxt, ts = entry
        if node != w.node or worker != w.worker or version <= w.since:
            return False
        del self.awaiting[vb]
        core = self.core
        seqs = core.seqs
        seqs.resume(vb, epoch, nxt)
        if ts > seqs.last_ts:  # ts_broker of vb never goes back (broky.server.shard.core)
            seqs.last_ts = ts
        if core.replay is not None:
            core.replay.gone_ts[vb] = ts  # a message of vb up to ts is not retained here
        core.stats.vbuckets_continued += 1
        return True

    def restart_sequences(self, vbs: list[int], why: str) -> None:
        """`vbs` stop awaiting: their sequences start again here, under new epochs (one log line)."""
        if not vbs:
            return
        awaiting = self.awaiting
        core = self.core
        sources = sorted({f"worker {awaiting[vb].worker} of node {awaiting[vb].node}" for vb in vbs})
        for vb in vbs:
            del awaiting[vb]
            core.seqs.restart(vb)
        core.stats.vbuckets_restarted += len(vbs)
        log.warning(
            "worker %d: %d vbuckets start a new epoch here (vbuckets %s): their sequences did not "
            "come from %s (%s)", core.index, len(vbs), _ranges(vbs), ", ".join(sources), why,
        )  # fmt: skip

    def forget_former(self, vb: int) -> None:
        """vb is no longer a former vbucket: its retained messages are dropped (counted in
        `replay_dropped_messages`) and its sequence starts again (a new epoch, until another
        comes)."""
        core = self.core
        del core.seqs.former[vb]
        if core.replay is not None:
            core.stats.replay_dropped_messages += core.replay.drop_vbucket(vb)
        core.seqs.restart(vb)

    def awaited(self, vb: int) -> bool:
        """Route cache miss (broky.server.shard.core `Shard.route`): vb awaits its sequence
        (its publishes are held); starts counting the deadline."""
        w = self.awaiting.get(vb)
        if w is None:
            return False
        if not w.deadline:
            w.deadline = _monotonic() + self.timeout
        return True

    def hold(self, c: Connection) -> None:
        """c's next frame needs a sequence this worker awaits: read nothing more of it
        until one arrives (its input waits in `rest`, see the header)."""
        c.held = HELD_FOR_SEQUENCE
        self.held.append(c)
        c.transport.pause_reading()

    def waits(self, data: bytes, pos: int, end: int) -> bool:
        """The frame data[pos:end] is a Subscribe whose start (since, since_time, last), or
        a Read, concerns a vbucket owned here that awaits its sequence: it must wait for it."""
        kind = body_type(data, pos, end)
        owned = self.core.owned
        awaiting = self.awaiting
        if kind == fbs.Body.Subscribe:
            sub = decode_frame(data, pos, end)
            assert isinstance(sub, Subscribe)
            if not (sub.since or sub.since_time or sub.last):
                return False
            kp = sub.key_partition
        elif kind == fbs.Body.Read:
            read = decode_frame(data, pos, end)
            assert isinstance(read, Read)
            kp = read.key_partition
            if kp is None and read.vbuckets:  # only those (one past 1023 is refused: no wait)
                return any(vb < VBUCKETS and owned[vb] and vb in awaiting for vb in read.vbuckets)
        else:
            return False
        if kp is not None:
            vb = vbucket_of(kp)
            return bool(owned[vb]) and vb in awaiting
        return any(owned[vb] for vb in awaiting)

    def deadlines(self) -> None:
        """The tick: vbuckets whose sequence did not come in time start again here."""
        now = _monotonic()
        late = [vb for vb, w in self.awaiting.items() if w.deadline and now > w.deadline]
        if late:
            self.restart_sequences(late, f"not within --move-timeout, {self.timeout:g} s")
            self.release_held()

    def end(self, why: str) -> None:
        """Shutdown: nothing awaits any more; what was held is routed first."""
        self.restart_sequences(list(self.awaiting), why)
        self.release_held()

    def forget(self, c: Connection) -> None:
        """c is gone: no longer held here."""
        if c in self.held:
            self.held.remove(c)

    def release_held(self) -> None:
        """Feed the held connections again, in the order they were held (each is held
        again at its first frame that still needs an awaited sequence)."""
        held, self.held = self.held, []
        feed = self.core.feed
        for c in held:
            c.held = ""
            if c.state != OPEN:
                continue
            if not c.reads_stopped:
                c.transport.resume_reading()
            feed(c, b"")


def _ranges(vbs: list[int], most: int = 8) -> str:
    """Vbuckets for a log line: "3-9, 12, ..." (at most `most` ranges)."""
    ranges = to_ranges(sorted(vbs))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:most])
    return text + (", ..." if len(ranges) > most else "")


__all__ = ["Awaited", "Handed", "Moves"]
