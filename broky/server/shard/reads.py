"""Bounded reads: a closed range of retained messages per vbucket, then its end, nothing live.

A Read frame (schema/README.md, section 5.2) asks a worker for the retained
messages of its vbuckets (or of one key_partition's vbucket) between two
positions, and ends each vbucket with a ReadDone saying where its range
stopped and what of it was gone. The Spark source reads micro-batches this
way: from committed positions to positions fixed when the batch was planned.
Names here say "bounded read": "read" alone is a connection's socket read in
the other parts of the Shard.

Theory of operation
-------------------
Which vbuckets (`bounded_read`). A Read covers the vbuckets this worker
owns, narrowed to its `vbuckets` when that is present (not empty), and to
key_partition's vbucket when that is present. Besides, a `vbuckets` covers
the *former* vbuckets it names: those this worker handed over in a planned
move, whose retained messages it keeps (broky.server.shard.moves) until they
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
the connection's stream (broky.server.shard.control), and every vbucket's range is
fixed at once, as offsets of its current epoch (broky.server.shard.sequences),
first <= offset < stop:

  first  after `start`'s position for the vbucket (its epoch: offset + 1;
         another epoch: 1, and epoch_changed); else the first retained
         message with ts_broker >= `start_time` (a message at or after it
         evicted: 1; what an earlier epoch held is not known here, as for
         a subscription's since_time, broky.server.shard.history); else the
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
what is queued, counted as in broky.server.shard.history) stay under its bound
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
mid-read drops its cursor (broky.server.shard.closing); one closing (a fatal
Error, Goodbye) is sent nothing more of it.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

from broky.errors import BadPatternError, ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import VBUCKETS, Read, ReadDone, Replay, encode_frame, route_message
from broky.protocol.frames import Position
from broky.protocol.layout import HEADER_AT, HEADER_NO_UID, HEADER_UID, KEY_UOFFSET_AT, VECTORS_AT
from broky.protocol.routing import vbucket_of
from broky.server.shard.connection import OPEN, Connection, ReadCursor, ReadRange

if TYPE_CHECKING:
    import asyncio

    from broky.server.accounts import AccountBook
    from broky.server.shard.grace import Grace
    from broky.server.shard.moves import Handovers
    from broky.server.shard.replay import ReplayBuffer
    from broky.server.shard.sequences import Sequences
    from broky.server.shard.stats import WorkerStats

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


class Reads:
    """The Shard's part that serves bounded reads (a mixin of broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        loop: asyncio.AbstractEventLoop
        owned: bytes
        seqs: Sequences
        replay: ReplayBuffer | None
        handover: Handovers
        stats: WorkerStats
        book: AccountBook
        _touched: list[Connection]
        grace: Grace

        def feed(self, c: Connection, data: bytes) -> None: ...
        def error(
            self,
            c: Connection,
            code: ErrorCode,
            message: str,
            sid: int = 0,
            refused: bytes | None = None,
            rid: int = 0,
        ) -> None: ...
        def flush(self) -> None: ...

    def bounded_read(self, c: Connection, rd: Read, t0: int) -> None:
        """A Read of c: fix its ranges (see the header) and send the first batch."""
        rid = rd.rid
        if not rid:
            self.error(c, ErrorCode.READ_REFUSED, "rid 0 is reserved (an Error's rid 0 means no read)")
            return
        if c.bounded_read is not None:
            why = f"read {c.bounded_read.rid} is in progress on this connection (one at a time)"
            self.error(c, ErrorCode.READ_REFUSED, why, rid=rid)
            return
        try:
            tokens = parse_pattern(rd.pattern)
        except BadPatternError as exc:
            self.error(c, ErrorCode.BAD_PATTERN, str(exc), rid=rid)
            return
        kp = rd.key_partition
        owned = self.owned
        former = self.handover.former
        try:  # which vbuckets: see "Which vbuckets" in the header
            named = narrowed_to(rd.vbuckets)
            if kp is not None:
                vb = vbucket_of(kp)
                if named is not None and vb not in named:
                    raise ValueError(f"key_partition {kp!r} is in vbucket {vb}, not among `vbuckets`")
                named = {vb}
        except ValueError as exc:
            self.error(c, ErrorCode.BAD_POSITION, f"read {rid} refused: {exc}", rid=rid)
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
            self.error(c, ErrorCode.NOT_MY_VBUCKET, why, rid=rid)
            return
        try:
            start = by_vbucket(rd.start, "start")
            stop = by_vbucket(rd.stop, "stop")
            ranges = [self.fix_range(vb, start.get(vb), stop.get(vb), rd.start_time) for vb in vbs]
        except ValueError as exc:
            self.error(c, ErrorCode.BAD_POSITION, f"read {rid} refused: {exc}", rid=rid)
            return
        if not t0:  # not from a read's stamp (a held frame): the clock, as the read path takes it
            t0 = max(time.time_ns(), self.seqs.last_ts)
        c.bounded_read = ReadCursor(rid, tokens, kp, t0, ranges)
        self.stats.bounded_reads += 1
        self.pump_read(c)
        self.hold_for_turn(c)  # the rest of c's input: see "Turns of the loop" in the header

    def hold_for_turn(self, c: Connection) -> None:
        """c's input after this Read waits in `rest`, its reads paused, until the loop's
        next turn (the read path stops at `c.held`)."""
        c.held = True
        c.transport.pause_reading()
        self.loop.call_soon(self.release_turn, c)

    def release_turn(self, c: Connection) -> None:
        """The loop turned: c's input goes on where it stopped."""
        if not c.held or c.state != OPEN or c in self.handover.held or c in self.grace.held:
            return  # closed meanwhile, or held for something else since (released by that)
        c.held = False
        if not c.reads_stopped:
            c.transport.resume_reading()
        self.feed(c, b"")

    def fix_range(self, vb: int, p: Position | None, q: Position | None, start_time: int) -> ReadRange:
        """vb's range of a read from after p (or start_time) up to q (see the header).

        Raises:
            ValueError: p or q is an offset past the last one accepted in vb's epoch.
        """
        seqs = self.seqs
        replay = self.replay
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
            if vb not in self.handover.former:
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
        replay = self.replay
        seqs = self.seqs
        former = self.handover.former
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
                stats = self.stats
                stats.bounded_read_messages += sent
                stats.messages_delivered += sent
                self.book.commit((c,))  # accounted before it leaves (broky.server.accounts)
            if not c.touched:
                c.touched = True
                self._touched.append(c)
        if r.done == len(ranges):
            c.bounded_read = None
        elif not r.scheduled:
            r.scheduled = True
            self.loop.call_soon(self.continue_read, c)

    def continue_read(self, c: Connection) -> None:
        """The next batch of c's read, outside any read of the worker's (call_soon, or the
        transport drained): queued and written."""
        r = c.bounded_read
        if r is None:
            return
        r.scheduled = False
        self.pump_read(c)
        if self._touched:
            self.flush()


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


__all__ = ["Reads", "routing_of", "wants"]
