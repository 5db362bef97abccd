"""Starts from positions: a subscription that asks for retained messages first.

A Subscribe may name where it starts (schema/README.md, section 5.1): `since`
positions (per vbucket, the last one the client has), `since_time` (a
ts_broker, ns) for the vbuckets `since` does not name, `last` N for the
vbuckets neither names. Without any of them it starts live, as it always did.

Theory of operation
-------------------
`start_subscription` runs right after the subscription joined the table
(broky.server.shard.control), inside the read that carried the Subscribe. The
worker is one thread: no message of its vbuckets is accepted between the
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
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from broky.errors import ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import VBUCKETS, LossNotice, LossReason, Replay, Subscribe, encode_frame, route_message
from broky.protocol.frames import Position
from broky.protocol.routing import vbucket_of
from broky.server.shard.connection import Connection, Subscription
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    from broky.server.accounts import AccountBook
    from broky.server.shard.replay import ReplayBuffer
    from broky.server.shard.sequences import Sequences
    from broky.server.shard.stats import WorkerStats

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


class History:
    """The Shard's part that starts subscriptions from positions (a mixin of
    broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        owned: bytes
        seqs: Sequences
        replay: ReplayBuffer | None
        stats: WorkerStats
        book: AccountBook
        _touched: list[Connection]

        def error(
            self,
            c: Connection,
            code: ErrorCode,
            message: str,
            sid: int = 0,
            refused: bytes | None = None,
            rid: int = 0,
        ) -> None: ...

    def start_subscription(self, c: Connection, s: Subscription, sub: Subscribe, t0: int) -> None:
        """Queue to c the retained messages subscription s asks for (see the header),
        then the notices of what is missing."""
        if not t0:  # not from a read's stamp (a held frame): the clock, as the read path takes it
            t0 = max(time.time_ns(), self.seqs.last_ts)
        replay = self.replay
        owned = self.owned
        if sub.key_partition is not None:  # at the owner; a worker it moves to answers after the commit
            vb = vbucket_of(sub.key_partition)
            vbs = [vb] if owned[vb] else []
        else:
            vbs = [vb for vb in range(VBUCKETS) if owned[vb]]
        since: dict[int, Position] = {}
        for named in sub.since:
            if named.vbucket in since:
                self.error(c, ErrorCode.BAD_POSITION, f"vbucket {named.vbucket} is named twice", s.sid)
                since[named.vbucket] = Position(named.vbucket, 0, 0)  # marked: starts live
            else:
                since[named.vbucket] = named
        tokens = parse_pattern(s.pattern)
        kp = s.key_partition
        losses = Losses()
        chosen: list[Chosen] = []
        seqs = self.seqs
        for vb in vbs:
            epoch = seqs.epoch_of(vb)
            nxt = seqs.next_of(vb)
            p: Position | None = since.get(vb)
            if p is not None:
                if p.epoch == 0 and p.offset == 0:
                    continue  # named twice: live
                if p.epoch == epoch:
                    if p.offset >= nxt:
                        self.error(
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
                self.from_offset(replay, vb, epoch, start, nxt, losses)
                if replay is not None:
                    self.pick(replay, vb, start, nxt, tokens, kp, chosen)
            elif sub.since_time:
                start = self.since_time(replay, vb, epoch, nxt, sub.since_time, losses)
                if replay is not None:
                    self.pick(replay, vb, start, nxt, tokens, kp, chosen)
            elif sub.last and replay is not None:
                self.pick_last(replay, vb, nxt, sub.last, tokens, kp, chosen)
        self.queue_replay(c, s.sid, t0, chosen, losses)

    def since_time(
        self, replay: ReplayBuffer | None, vb: int, epoch: int, nxt: int, t: int, losses: Losses
    ) -> int:
        """Note what of vb's current sequence stamped at or after t is no longer retained
        (all of it without a replay buffer), exactly where it can be known; return the
        first offset to replay."""
        seqs = self.seqs
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

    @staticmethod
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

    @staticmethod
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

    @staticmethod
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
        if lost:
            seqs = self.seqs
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
            self.stats.dropped[DropReason.SLOW_CONSUMER] += lost
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
        self.stats.messages_replayed += kept
        self.stats.messages_delivered += kept
        self.book.commit((c,))  # accounted before it leaves (broky.server.accounts)
        if not c.touched:
            c.touched = True
            self._touched.append(c)


__all__ = ["History"]
