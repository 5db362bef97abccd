"""Positions: a subscription that starts from positions, and bounded reads.

Both read the worker's retained messages (broky.server.shard.replay) by
position (vbucket, epoch, offset: broky.server.shard.sequences), and tell
exactly what of what was asked for is gone. The part is an object the core
builds (`Shard.positions`, broky.server.shard.part): the core hands it a
Subscribe that names a start (`start_subscription`) and a Read
(`bounded_read`), and the turns of a bounded read (`pump_read` on Resume,
`continue_read` when its connection drained).

Starts from positions
=====================
A Subscribe may name where it starts (schema/README.md, section 5.1): `since`
positions (per vbucket, the last one the client has), `since_time` (a
ts_broker, ns) for the vbuckets `since` does not name, `last` N for the
vbuckets neither names. Without any of them it starts live, as it always did.

Theory of operation
-------------------
`start_subscription` runs right after the subscription joined the table
(broky.server.shard.core `Shard.subscribe`), inside the read that carried the
Subscribe. The worker is one thread: no message of its vbuckets is accepted between the
moment it reads the replay buffer (broky.server.shard.replay) and the moment the
subscription is in the table. So the retained messages up to each vbucket's
last accepted offset, queued now, and the live ones routed to it from the
next message on, meet with no gap and no duplicate, and both go through the
connection's one `out` list in that order.

Per vbucket this worker owns (of them, the one of the subscription's
key_partition, if it has one; a worker that a prepared map moves that
vbucket to starts it live: its owner answers for it until the commit, and
a start that concerns a vbucket whose sequence is still on its way here
waits for it, broky.server.shard.moves):

  since (E, o)   E is the vbucket's epoch: from o + 1. Offsets before the
                 oldest retained are gone: EVICTED, with their count (exact
                 for a subscription that matches every message; at most that
                 for others: evicted messages cannot be matched any more).
                 E is another epoch: EPOCH_CHANGED (count unknown), and the
                 current epoch from its first offset, EVICTED for any of it
                 that is gone. An offset past the last accepted one, or a
                 vbucket named twice, gets a non-fatal BAD_POSITION and that
                 vbucket starts live. Positions of vbuckets this worker does
                 not own are ignored (they are another worker's start).
  since_time T   the retained messages with ts_broker >= T (ts_broker never
                 decreases on a worker: broky.server.shard.core takes the larger
                 of the clock and the last stamp). A message with ts_broker
                 >= T was evicted (`gone_ts`): EVICTED, exact when the whole
                 sequence came after T (its first stamp is at or after T:
                 broky.server.shard.sequences), else with its count unknown.
                 (Not what an earlier epoch held: whether there was one, the
                 worker does not know; a client that was connected to it is
                 told by its connection's account,
                 WORKER_RESTART or UNACCOUNTED.)
  last N         the last N retained messages that match.

The answer is a Replay frame {sid, count, ts}, then `count` Message frames
(stamped as they were when first delivered), then one LossNotice per vbucket
and reason, in vbucket order, carrying the sid, that vbucket's count and its
first missing position (for a count that is not known, dropped 0 and the
position right after the missing ones): a vbucket whose count is not known
never hides the exact counts of the others, and a client can move its
position past what it was told (nothing is told twice). The replay counts
against the connection's pending bound like any delivery: what does not fit
is not queued, and is told exactly per vbucket (SLOW_CONSUMER, with the sid),
so a resume never drowns the connection it resumes on.

With the replay buffer off (--replay-bytes 0) nothing is retained, and the
same rules answer with an empty Replay and what is gone: every offset after a
`since` position (EVICTED, exact count), and for a `since_time` the vbuckets
that stamped a message at or after the time (the last stamp of each is kept
in the sequences): exact when the whole sequence came after the time (its
first stamp too), else without a count (which of its offsets came after the
time is not known).
`last` gets nothing. So a client resuming by positions is told exactly what
a reconnect cost it even then (its connection's CONNECTION_LOST, suppressed
for such a client, is among those offsets: broky.server.shard.arrivals).

Bounded reads
=============
A closed range of retained messages per vbucket, then its end, nothing live.
A Read frame (schema/README.md, section 5.2) asks a worker for the retained
messages of its vbuckets (or of one key_partition's vbucket) between two
positions, and ends each vbucket with a ReadDone saying where its range
stopped and what of it was gone. The Spark source reads micro-batches this
way: from committed positions to positions fixed when the batch was planned.
Names here say "bounded read": "read" alone is a connection's socket read in
the rest of the Shard.

Theory of operation
-------------------
Which vbuckets (`bounded_read`). A Read covers the vbuckets this worker
owns, narrowed to its `vbuckets` when that is present (not empty), and to
key_partition's vbucket when that is present. Besides, a `vbuckets` covers
the *former* vbuckets it names: those this worker handed over in a planned
move, whose retained messages it keeps (`Sequences.former`,
broky.server.shard.moves) until they
are evicted, the vbucket comes back, or the process ends. A Read that does
not name a former vbucket in `vbuckets` never covers it, so a whole read
gets each vbucket from its owner alone. The ones of `vbuckets` neither
owned nor former here get nothing, no ReadDone either: the client asks
their owner, as for a vbucket that moved. A `vbuckets` that names a vbucket
past 1023, or one twice, or leaves out key_partition's, refuses the Read
(BAD_POSITION); a Read that covers nothing here (no vbucket owned or former
among those named, not key_partition's) is refused with NOT_MY_VBUCKET. A
refusal is one non-fatal Error with the rid, and nothing else of the read.

Fixing the ranges (`bounded_read`). The Read frame is handled in its place in
the connection's stream (broky.server.shard.core `Shard.control`), and every
vbucket's range is fixed at once, as offsets of its current epoch (broky.server.shard.sequences),
first <= offset < stop:

  first  after `start`'s position for the vbucket (its epoch: offset + 1;
         another epoch: 1, and epoch_changed); else the first retained
         message with ts_broker >= `start_time` (a message at or after it
         evicted: 1; what an earlier epoch held is not known here, as for
         a subscription's since_time, above); else the
         oldest retained.
  stop   after `stop`'s position for the vbucket (its epoch: offset + 1,
         at least `first`; another epoch: `first`, an empty range: what it
         named is gone); else the vbucket's next offset now, so nothing
         accepted after the Read is read.

A former vbucket's "current epoch" and "next offset" are the ones it was
handed over with, E and H (its Sequences entry keeps them: the replay
buffer counts its retained offsets from there, and nothing is stamped
there any more), and a `stop` at or past H ends its range at H instead of
refusing the Read: what came after the handover is read at the vbucket's
owner. Its ReadDone says `moved`.

A range never depends on what is accepted later: two reads of it return the
same messages as long as they are retained. What of it is no longer retained
is counted in `evicted` (`first` .. the oldest retained), exact for a start
given as a position; after a start_time whose messages were partly evicted,
which evicted offsets were at or after it is no longer known, and `evicted`
counts every gone offset of the epoch (an upper bound). Without a replay
buffer (--replay-bytes 0) every range is empty at once. A bad position (an
offset past the last accepted, a vbucket named twice) refuses the whole Read:
a read's positions come from an earlier read, and reading around a bad one
would hide the client's mistake.

The cursor. A read in progress is a `ReadCursor` on its connection
(`Connection.bounded_read`: one read at a time per connection; another Read
meanwhile is refused, READ_REFUSED). It holds per vbucket its range and how
far it got; the messages stay in the replay buffer (broky.server.shard.replay)
until they go out.

Pacing (`pump_read`). A batch takes, vbucket after vbucket in ascending
order, the next messages of the range that match the pattern (and
key_partition), while the connection's pending bytes (its write buffer and
what is queued, counted as for a start from positions) stay under its bound
`c.limit`; when nothing was queued yet, one message goes even if it does not
fit, so every batch moves. It looks at READ_SCAN index entries at most (a
ReadDone counts as READ_DONE_COST entries), so a long read never holds the
worker for long (about a millisecond a batch). A vbucket's messages of a batch
go as Replay{rid, n} and n Message frames (adjacent ones as one slice); a
vbucket whose range is done gets its ReadDone, `remaining` counting those
still to come. The next batch runs on `call_soon` while the transport is
under its high-water mark, else when it drains (`resume_writing` ->
Shard.drained); a connection the client paused (Pause) waits for Resume. So
a read of the whole buffer never has more than c.limit bytes (plus one
message) pending on its connection in the worker; the kernel's socket
buffers take what they take, as for any delivery.

Between batches the worker accepts and evicts messages, and may apply a
map. Before it takes messages of a vbucket, the cursor checks the vbucket's
epoch (its sequence restarted, or it came back after it moved away: its
retained messages were dropped, the rest of the range is gone) and the
buffer's oldest retained offset (messages evicted meanwhile are skipped),
and counts what it skips in that vbucket's `evicted`. A vbucket that moved
away during the read became former with the same epoch: its messages stay,
the range (which ends at or before the handover) is read on, and its
ReadDone says `moved`.

Turns of the loop. Fixing the ranges of every vbucket of a worker (512 of
a 2-worker server) and a batch each take a millisecond or more, so a Read
ends its turn of the worker's loop: it fixes its ranges and queues its first
batch, and the rest of the connection's input after it waits for the next
turn (`hold_for_turn`: held in `rest`, reads paused, as
broky.server.shard.moves holds a connection). A client that sends 40 Reads in
one write therefore no longer holds the worker for 40 Reads at once: live
deliveries and Pings of other connections go out between them
(bench/README.md, "Tail sources"). Replies keep their order: a next batch
scheduled by this Read runs before the held input is fed again.

The messages of a read are Message frames queued to the connection like any
delivery: they count in `messages_delivered` and the connection's `msgs_out`
(broky.server.accounts), and in `bounded_read_messages`. A connection lost
mid-read drops its cursor (broky.server.shard.core `Shard.lost`); one closing (a fatal
Error, Goodbye) is sent nothing more of it.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

from broky.errors import BadPatternError, ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import (
    VBUCKETS,
    LossNotice,
    LossReason,
    Read,
    ReadDone,
    Replay,
    Subscribe,
    encode_frame,
    route_message,
)
from broky.protocol.frames import Position
from broky.protocol.layout import HEADER_AT, HEADER_NO_UID, HEADER_UID, KEY_UOFFSET_AT, VECTORS_AT
from broky.protocol.routing import vbucket_of
from broky.server.shard.connection import HELD_FOR_TURN, OPEN, Connection, ReadCursor, ReadRange, Subscription
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    from broky.server.shard.part import ShardCore
    from broky.server.shard.replay import ReplayBuffer

U64_MAX = (1 << 64) - 1
# A retained message chosen for a replay: (segment, first byte, end, vbucket, offset).
Chosen = tuple["bytearray | bytes", int, int, int, int]


class Losses:
    """What one start found missing, per vbucket and reason: the count (None: not known),
    the first missing position (for a count not known, the position right after the
    missing ones: the first retained offset, or the next one), and the last position
    the notice accounts for (`through`: the client's start goes on after it)."""

    def __init__(self) -> None:
        self.by_vbucket: dict[tuple[int, int], tuple[int | None, Position, Position]] = {}

    def add(self, reason: int, count: int | None, at: Position, through: Position) -> None:
        self.by_vbucket[at.vbucket, reason] = (count, at, through)

    def notices(self, sid: int) -> list[bytes]:
        """One LossNotice per vbucket and reason, in vbucket order (dropped 0: not known)."""
        return [
            encode_frame(LossNotice(count or 0, reason, sid, at, through))
            for (_, reason), (count, at, through) in sorted(self.by_vbucket.items())
        ]


_u32 = struct.Struct("<I").unpack_from
# Index entries one batch looks at, at most, a ReadDone counting as READ_DONE_COST of them:
# about a millisecond of work (bench/README.md, "Tail sources").
READ_SCAN = 1024
READ_DONE_COST = 4
# Index entries taken from the replay buffer at once.
READ_CHUNK = 512
# Keys whose match with a read's pattern is remembered (per read; cleared when full).
MATCH_CACHE_SIZE = 4096
_REPLAY_SIZE = len(encode_frame(Replay(0, 1, 1, 1)))  # every Replay of a read has this size


def routing_of(segment: bytes | bytearray, pos: int, end: int) -> tuple[bytes, bytes]:
    """(key_partition, key) of the retained Message at segment[pos:end]."""
    if segment.startswith(HEADER_UID, pos + HEADER_AT):
        kp_at = pos + VECTORS_AT[True]
    elif segment.startswith(HEADER_NO_UID, pos + HEADER_AT):
        kp_at = pos + VECTORS_AT[False]
    else:  # not laid out canonically (not written by this server): the checked read
        kp, key, _ = route_message(bytes(segment[pos:end]), 0, end - pos)
        return kp, key
    key_at = pos + KEY_UOFFSET_AT
    key_at += _u32(segment, key_at)[0]
    kp = bytes(segment[kp_at + 4 : kp_at + 4 + _u32(segment, kp_at)[0]])
    key = bytes(segment[key_at + 4 : key_at + 4 + _u32(segment, key_at)[0]])
    return kp, key


def wants(r: ReadCursor, segment: bytes | bytearray, pos: int, end: int) -> bool:
    """Whether the retained message at segment[pos:end] matches read r."""
    if r.tokens is None and r.kp is None:
        return True
    kp, key = routing_of(segment, pos, end)
    if r.kp is not None and kp != r.kp:
        return False
    if r.tokens is None:
        return True
    matches = r.matches
    hit = matches.get(key)
    if hit is None:
        if len(matches) >= MATCH_CACHE_SIZE:
            matches.clear()
        hit = matches[key] = pattern_matches(r.tokens, key)
    return hit


class Positions:
    """The Shard's part that starts subscriptions from positions and serves bounded reads
    (`Shard.positions`), built with the core (broky.server.shard.part)."""

    __slots__ = ("core",)

    def __init__(self, core: ShardCore) -> None:
        self.core = core

    # ------------------------------------------------------------ starts from positions

    def start_subscription(self, c: Connection, s: Subscription, sub: Subscribe, t0: int) -> None:
        """Queue to c the retained messages subscription s asks for (see the header),
        then the notices of what is missing."""
        core = self.core
        if not t0:  # not from a read's stamp (a held frame): the clock, as the read path takes it
            t0 = max(time.time_ns(), core.seqs.last_ts)
        replay = core.replay
        owned = core.owned
        if sub.key_partition is not None:  # at the owner; a worker it moves to answers after the commit
            vb = vbucket_of(sub.key_partition)
            vbs = [vb] if owned[vb] else []
        else:
            vbs = [vb for vb in range(VBUCKETS) if owned[vb]]
        since: dict[int, Position] = {}
        for named in sub.since:
            if named.vbucket in since:
                core.error(c, ErrorCode.BAD_POSITION, f"vbucket {named.vbucket} is named twice", s.sid)
                since[named.vbucket] = Position(named.vbucket, 0, 0)  # marked: starts live
            else:
                since[named.vbucket] = named
        tokens = parse_pattern(s.pattern)
        kp = s.key_partition
        losses = Losses()
        chosen: list[Chosen] = []
        seqs = core.seqs
        for vb in vbs:
            epoch = seqs.epoch_of(vb)
            nxt = seqs.next_of(vb)
            p: Position | None = since.get(vb)
            if p is not None:
                if p.epoch == 0 and p.offset == 0:
                    continue  # named twice: live
                if p.epoch == epoch:
                    if p.offset >= nxt:
                        core.error(
                            c,
                            ErrorCode.BAD_POSITION,
                            f"vbucket {vb}: offset {p.offset} of epoch {epoch} is past the last "
                            f"accepted ({nxt - 1}); live from now",
                            s.sid,
                        )
                        continue
                    start = p.offset + 1
                else:
                    after = min(p.offset + 1, U64_MAX)  # (any offset of an epoch gone may be named)
                    losses.add(
                        LossReason.EPOCH_CHANGED, None, Position(vb, p.epoch, after), Position(vb, epoch, 0)
                    )
                    start = 1
                from_offset(replay, vb, epoch, start, nxt, losses)
                if replay is not None:
                    pick(replay, vb, start, nxt, tokens, kp, chosen)
            elif sub.since_time:
                start = self.since_time(replay, vb, epoch, nxt, sub.since_time, losses)
                if replay is not None:
                    pick(replay, vb, start, nxt, tokens, kp, chosen)
            elif sub.last and replay is not None:
                pick_last(replay, vb, nxt, sub.last, tokens, kp, chosen)
        self.queue_replay(c, s.sid, t0, chosen, losses)

    def since_time(
        self, replay: ReplayBuffer | None, vb: int, epoch: int, nxt: int, t: int, losses: Losses
    ) -> int:
        """Note what of vb's current sequence stamped at or after t is no longer retained
        (all of it without a replay buffer), exactly where it can be known; return the
        first offset to replay."""
        seqs = self.core.seqs
        # All of the sequence came after t: its first offset here is 1 and its first stamp >= t.
        fresh = seqs.begun_offset[vb] == 1 and seqs.first_ts_of(vb) >= t
        if replay is None:
            if seqs.last_ts_of(vb) >= t and nxt > seqs.begun_offset[vb]:
                through = Position(vb, epoch, nxt - 1)
                if fresh:
                    losses.add(LossReason.EVICTED, nxt - 1, Position(vb, epoch, 1), through)
                else:  # which of its offsets came after t is not known
                    losses.add(LossReason.EVICTED, None, Position(vb, epoch, nxt), through)
            return nxt
        first = replay.first(vb)
        oldest = nxt if first is None else first
        if replay.gone_ts[vb] >= t and oldest > 1:
            through = Position(vb, epoch, oldest - 1)
            if fresh:
                losses.add(LossReason.EVICTED, oldest - 1, Position(vb, epoch, 1), through)
            else:
                losses.add(LossReason.EVICTED, None, Position(vb, epoch, oldest), through)
        found = replay.offset_at_time(vb, t)
        return nxt if found is None else found

    def queue_replay(self, c: Connection, sid: int, t0: int, chosen: list[Chosen], losses: Losses) -> None:
        """Queue the Replay frame, the chosen messages that fit in c's pending bound,
        and the notices: what did not fit is told exactly (SLOW_CONSUMER)."""
        room = c.limit - c.transport.get_write_buffer_size() - c.unflushed
        kept = 0
        for _, pos, end, _, _ in chosen:
            room -= end - pos
            if room < 0:
                break
            kept += 1
        lost = len(chosen) - kept
        core = self.core
        stats = core.stats
        if lost:
            seqs = core.seqs
            first: dict[int, int] = {}  # vbucket -> the first offset not sent
            last: dict[int, int] = {}
            count: dict[int, int] = {}
            for _, _, _, vb, offset in chosen[kept:]:
                first.setdefault(vb, offset)
                last[vb] = offset
                count[vb] = count.get(vb, 0) + 1
            for vb, n in count.items():
                epoch = seqs.epoch_of(vb)
                losses.add(
                    LossReason.SLOW_CONSUMER, n, Position(vb, epoch, first[vb]), Position(vb, epoch, last[vb])
                )
            c.dropped_total += lost
            stats.dropped[DropReason.SLOW_CONSUMER] += lost
        out = c.out
        header = encode_frame(Replay(sid, kept, t0))
        out.append(header)
        size = len(header)
        for segment, pos, end, _, _ in chosen[:kept]:
            out.append(segment[pos:end])
            size += end - pos
        for notice in losses.notices(sid):
            out.append(notice)
            size += len(notice)
        c.unflushed += size
        c.msgs_out += kept
        stats.messages_replayed += kept
        stats.messages_delivered += kept
        core.book.commit((c,))  # accounted before it leaves (broky.server.accounts)
        if not c.touched:
            c.touched = True
            core.touched.append(c)

    # ------------------------------------------------------------ bounded reads

    def bounded_read(self, c: Connection, rd: Read, t0: int) -> None:
        """A Read of c: fix its ranges (see the header) and send the first batch."""
        rid = rd.rid
        core = self.core
        if not rid:
            core.error(c, ErrorCode.READ_REFUSED, "rid 0 is reserved (an Error's rid 0 means no read)")
            return
        if c.bounded_read is not None:
            why = f"read {c.bounded_read.rid} is in progress on this connection (one at a time)"
            core.error(c, ErrorCode.READ_REFUSED, why, rid=rid)
            return
        try:
            tokens = parse_pattern(rd.pattern)
        except BadPatternError as exc:
            core.error(c, ErrorCode.BAD_PATTERN, str(exc), rid=rid)
            return
        kp = rd.key_partition
        owned = core.owned
        former = core.seqs.former
        try:  # which vbuckets: see "Which vbuckets" in the header
            named = narrowed_to(rd.vbuckets)
            if kp is not None:
                vb = vbucket_of(kp)
                if named is not None and vb not in named:
                    raise ValueError(f"key_partition {kp!r} is in vbucket {vb}, not among `vbuckets`")
                named = {vb}
        except ValueError as exc:
            core.error(c, ErrorCode.BAD_POSITION, f"read {rid} refused: {exc}", rid=rid)
            return
        if named is None:
            vbs = [vb for vb in range(VBUCKETS) if owned[vb]]
        elif rd.vbuckets:  # the ones named that another worker owns are answered by it, not here
            vbs = sorted(vb for vb in named if owned[vb] or vb in former)
        else:  # key_partition's (a former vbucket only when `vbuckets` names it)
            vbs = sorted(vb for vb in named if owned[vb])
        if not vbs:
            if kp is not None:
                why = f"key_partition {kp!r} is owned by another worker"
            elif rd.vbuckets:
                why = "this worker owns none of the vbuckets the read names, nor retains any it handed over"
            else:
                why = "this worker owns no vbucket"
            core.error(c, ErrorCode.NOT_MY_VBUCKET, why, rid=rid)
            return
        try:
            start = by_vbucket(rd.start, "start")
            stop = by_vbucket(rd.stop, "stop")
            ranges = [self.fix_range(vb, start.get(vb), stop.get(vb), rd.start_time) for vb in vbs]
        except ValueError as exc:
            core.error(c, ErrorCode.BAD_POSITION, f"read {rid} refused: {exc}", rid=rid)
            return
        if not t0:  # not from a read's stamp (a held frame): the clock, as the read path takes it
            t0 = max(time.time_ns(), core.seqs.last_ts)
        c.bounded_read = ReadCursor(rid, tokens, kp, t0, ranges)
        core.stats.bounded_reads += 1
        self.pump_read(c)
        self.hold_for_turn(c)  # the rest of c's input: see "Turns of the loop" in the header

    def hold_for_turn(self, c: Connection) -> None:
        """c's input after this Read waits in `rest`, its reads paused, until the loop's
        next turn (the read path stops at `c.held`)."""
        c.held = HELD_FOR_TURN
        c.transport.pause_reading()
        self.core.loop.call_soon(self.release_turn, c)

    def release_turn(self, c: Connection) -> None:
        """The loop turned: c's input goes on where it stopped."""
        if c.held != HELD_FOR_TURN or c.state != OPEN:
            return  # closed meanwhile, or held for something else since (released by that)
        c.held = ""
        if not c.reads_stopped:
            c.transport.resume_reading()
        self.core.feed(c, b"")

    def fix_range(self, vb: int, p: Position | None, q: Position | None, start_time: int) -> ReadRange:
        """vb's range of a read from after p (or start_time) up to q (see the header).

        Raises:
            ValueError: p or q is an offset past the last one accepted in vb's epoch.
        """
        seqs = self.core.seqs
        replay = self.core.replay
        epoch = seqs.epoch_of(vb)
        nxt = seqs.next_of(vb)  # a former vbucket's: the one it was handed over with
        first = replay.first(vb) if replay is not None else None
        oldest = nxt if first is None else first
        changed = False
        if p is not None:
            if p.epoch == epoch:
                if p.offset >= nxt:
                    raise ValueError(past(vb, "start", p.offset, epoch, nxt))
                begin = p.offset + 1
            else:
                changed = True
                begin = 1
        elif start_time:
            if replay is not None and replay.gone_ts[vb] >= start_time:
                begin = 1  # some of it is gone, which is not known: counted as all (an upper bound)
            else:
                found = replay.offset_at_time(vb, start_time) if replay is not None else None
                begin = nxt if found is None else found
        else:
            begin = oldest
        if q is None:
            end = nxt
        elif q.epoch != epoch:
            end = begin  # what it named is gone with its epoch
        elif q.offset >= nxt:
            if vb not in seqs.former:
                raise ValueError(past(vb, "stop", q.offset, epoch, nxt))
            end = nxt  # what came after the handover is read at the vbucket's owner
        else:
            end = max(q.offset + 1, begin)
        at = max(begin, min(oldest, end))
        return ReadRange(vb, epoch, at, end, at - begin, changed)

    def pump_read(self, c: Connection) -> None:
        """Queue c's read's next batch (see "Pacing" in the header); schedule the one after."""
        r = c.bounded_read
        if r is None or c.state != OPEN or c.paused or c.write_paused:
            return  # Resume, resume_writing (Shard.drained) or the connection's end follow
        core = self.core
        replay = core.replay
        seqs = core.seqs
        former = seqs.former
        room = c.limit - c.transport.get_write_buffer_size() - c.unflushed
        out = c.out
        queued = sent = 0
        scan = READ_SCAN
        ranges = r.ranges
        rid = r.rid
        while r.done < len(ranges) and scan > 0:
            v = ranges[r.done]
            if v.at < v.stop:  # what went since the last batch is skipped, and counted
                first = replay.first(v.vb) if replay is not None else None
                if first is None or seqs.epoch_of(v.vb) != v.epoch:
                    first = v.stop
                if first > v.at:
                    gone = min(first, v.stop) - v.at
                    v.evicted += gone
                    v.at += gone
            if v.at < v.stop:
                assert replay is not None
                chunk = replay.read(v.vb, v.at, min(v.stop, v.at + min(scan, READ_CHUNK)))
                if not chunk:  # cannot happen (the entries from `first` on are there): as gone
                    v.evicted += v.stop - v.at
                    v.at = v.stop
                    continue
                slices: list[bytes | bytearray] = []
                n = size = 0
                run: bytearray | bytes | None = None
                run_start = run_end = 0
                full = False
                for segment, pos, end in chunk:
                    if not wants(r, segment, pos, end):
                        v.at += 1
                        scan -= 1
                        continue
                    need = end - pos + (0 if n else _REPLAY_SIZE)
                    if need > room and (queued or n):
                        full = True
                        break
                    v.at += 1
                    scan -= 1
                    room -= need
                    size += end - pos
                    n += 1
                    if segment is run and pos == run_end:
                        run_end = end
                    else:
                        if run is not None:
                            slices.append(run[run_start:run_end])
                        run, run_start, run_end = segment, pos, end
                if n:
                    assert run is not None
                    slices.append(run[run_start:run_end])
                    out.append(encode_frame(Replay(0, n, r.ts, rid)))
                    out.extend(slices)
                    queued += _REPLAY_SIZE + size
                    sent += n
                if full:
                    break
                continue
            went = former.get(v.vb)  # moved away: before the read, or during it (same epoch)
            done = encode_frame(
                ReadDone(
                    rid, v.vb, v.epoch, v.stop, v.evicted, v.epoch_changed, len(ranges) - r.done - 1,
                    went is not None and went[0] == v.epoch,
                )
            )  # fmt: skip
            if len(done) > room and queued:
                break
            out.append(done)
            room -= len(done)
            queued += len(done)
            scan -= READ_DONE_COST
            r.done += 1
        if queued:
            c.unflushed += queued
            if sent:
                c.msgs_out += sent
                stats = core.stats
                stats.bounded_read_messages += sent
                stats.messages_delivered += sent
                core.book.commit((c,))  # accounted before it leaves (broky.server.accounts)
            if not c.touched:
                c.touched = True
                core.touched.append(c)
        if r.done == len(ranges):
            c.bounded_read = None
        elif not r.scheduled:
            r.scheduled = True
            core.loop.call_soon(self.continue_read, c)

    def continue_read(self, c: Connection) -> None:
        """The next batch of c's read, outside any read of the worker's (call_soon, or the
        transport drained): queued and written."""
        r = c.bounded_read
        if r is None:
            return
        r.scheduled = False
        self.pump_read(c)
        if self.core.touched:
            self.core.flush()


def from_offset(
    replay: ReplayBuffer | None, vb: int, epoch: int, start: int, nxt: int, losses: Losses
) -> None:
    """Note the offsets start .. nxt - 1 of vb's current epoch that are no longer retained
    (all of them without a replay buffer)."""
    first = None if replay is None else replay.first(vb)
    oldest = nxt if first is None else first
    if start < oldest:
        losses.add(
            LossReason.EVICTED,
            oldest - start,
            Position(vb, epoch, start),
            Position(vb, epoch, oldest - 1),
        )


def pick(
    replay: ReplayBuffer,
    vb: int,
    start: int,
    stop: int,
    tokens: list[bytes],
    kp: bytes | None,
    chosen: list[Chosen],
) -> None:
    """Append the retained messages of vb with start <= offset < stop that match."""
    offset = max(start, replay.first(vb) or stop)
    for segment, pos, end in replay.read(vb, start, stop):
        m_kp, key, _ = route_message(bytes(segment[pos:end]), 0, end - pos)
        if (kp is None or m_kp == kp) and pattern_matches(tokens, key):
            chosen.append((segment, pos, end, vb, offset))
        offset += 1


def pick_last(
    replay: ReplayBuffer,
    vb: int,
    stop: int,
    n: int,
    tokens: list[bytes],
    kp: bytes | None,
    chosen: list[Chosen],
) -> None:
    """Append the last n retained messages of vb that match, oldest first."""
    first = replay.first(vb)
    if first is None:
        return
    found: list[Chosen] = []
    offset = stop - 1
    for segment, pos, end in reversed(replay.read(vb, first, stop)):
        m_kp, key, _ = route_message(bytes(segment[pos:end]), 0, end - pos)
        if (kp is None or m_kp == kp) and pattern_matches(tokens, key):
            found.append((segment, pos, end, vb, offset))
            if len(found) == n:
                break
        offset -= 1
    chosen.extend(reversed(found))


def narrowed_to(vbuckets: tuple[int, ...]) -> set[int] | None:
    """The vbuckets a Read's `vbuckets` names (None: absent or empty, no narrowing).

    Raises:
        ValueError: one is not a vbucket (1024 or more), or is named twice.
    """
    if not vbuckets:
        return None
    named: set[int] = set()
    for vb in vbuckets:
        if vb >= VBUCKETS:
            raise ValueError(f"vbucket {vb} in `vbuckets` is not a vbucket (0 .. {VBUCKETS - 1})")
        if vb in named:
            raise ValueError(f"vbucket {vb} is named twice in `vbuckets`")
        named.add(vb)
    return named


def by_vbucket(positions: tuple[Position, ...], what: str) -> dict[int, Position]:
    """The positions of a Read's `start` or `stop` by vbucket.

    Raises:
        ValueError: a vbucket is named twice.
    """
    named: dict[int, Position] = {}
    for p in positions:
        if p.vbucket in named:
            raise ValueError(f"vbucket {p.vbucket} is named twice in {what}")
        named[p.vbucket] = p
    return named


def past(vb: int, what: str, offset: int, epoch: int, nxt: int) -> str:
    return f"vbucket {vb}: {what} offset {offset} of epoch {epoch} is past the last accepted ({nxt - 1})"


__all__ = ["Losses", "Positions", "routing_of", "wants"]
