"""A slow reader catches up from the replay buffer instead of losing.

Theory of operation
-------------------
A connection whose pending outbound bytes reach its bound (--max-pending-bytes)
used to lose what did not fit (SLOW_CONSUMER). With a replay buffer the worker
has those messages anyway: it stamped each one and recorded it in the buffer
before queuing it (broky.server.shard.core, `feed`). So the connection *lags*
instead: nothing more is queued to it live (`cap` is -1, so every delivery to it
goes to `Shard.squeeze`, which hands it here), and it is sent, as it drains,
every message it was refused, read back from the buffer, in offset order per
vbucket; when it has caught up it is live again. A lag is the connection's,
not a subscription's: the pending bound and the routes are a connection's
(the client dispatches bare deliveries to its subscriptions locally, as live
ones).

What it is owed. Two forms (connection.LagCursor):

- *every key*: the connection has a plain subscription to `>`, so it is owed
  every message of every vbucket from the first it was refused on. Its cursor
  is one offset per vbucket (`open_from`), set by `seal` in a callback of the
  loop's next turn: until then (`open_from` None) the refused messages are
  noted one by one (`missed`), because the compiled read path stamps a whole
  read before Python queues it (a vbucket's offset counter is ahead of what
  was queued). At the seal, vbucket vb is owed from its first refused offset,
  or from its next offset if none was refused: every message of vb before that
  was queued to the connection (before it lagged), and every one after goes
  through `squeeze` (a callback runs outside any read, so no message is half
  way). After the seal a refused delivery costs one attribute test.
- *filtered* (any other): it is owed only what was routed to it, so each
  refused message is noted (`missed`): per vbucket, ranges of offsets, one per
  run of consecutive offsets. It costs about 144 bytes per range and, per
  refused message, a look at its position (compiled with the read path:
  `note_missed` is the reference); its catch-up reads exactly those offsets, no
  scan, and what the buffer evicted of them is counted exactly. What the buffer
  evicts of a reader's ranges is trimmed at the worker's tick (`trim`) and kept
  as a count per vbucket until it is told, so a reader that reads nothing holds
  ranges only for what is still retained.

Catching up (`pump`), paced by the connection's drain as a bounded read is
(broky.server.shard.positions): a batch queues at most LAG_SCAN messages and at
most up to the connection's window (LAG_WINDOW, or its bound if smaller), as
bare Message frames (joined from the buffer's index by `ReplayBuffer.gather`,
compiled with the read path), going down the list of the vbuckets it is behind
in (found once per pass over them: `behind_vbuckets`); the next batch follows on
the loop's next turn while there is room, else when the transport drains to
its low-water mark (`Shard.drained`), or on Resume (a paused client).
While it lags the transport's water marks are the window's: a reader that
does not read holds at most a window of copies, besides what was queued when
it began lagging.

The seam. A batch that finds nothing more owed sets the connection live
(`cap` = its bound) in the same callback: no message is accepted between the
last read from the buffer and the switch (the worker is one thread, and a
batch never runs inside a read), so the next live delivery is the next offset
of each vbucket: no gap, no duplicate.

Evicted first. Offsets owed that the buffer no longer holds are told, once per
vbucket and gap, ahead of what follows them:
`LossNotice{dropped, EVICTED, sid 0, at: the first, through: the last}`,
counted in the connection's account (`dropped_total`, as a drop) and in
DropReason.EVICTED. The count is exact in both forms: every key's are all the
offsets of the gap, a filtered one's the noted offsets the gap holds. A vbucket
whose sequence restarted under a new epoch while it lagged (a failover, a move
that timed out) is told EPOCH_CHANGED with how many it was owed of the old
epoch (every key: from its cursor to where the old sequence ended here; a
filtered one: its noted offsets), and read on from the new epoch's first
offset.

A reader that never reads costs, besides what was queued to it before it
began to lag (up to its bound, as before), its cursor: no further copies. It
is cut (fatal SLOW_CONSUMER, as a slow consumer is without a replay buffer)
only when it can no longer catch up from here: it has made no progress for
--slow-consumer-deadline *and* the buffer has evicted, in every vbucket it
is behind in, the oldest message it is owed (`tick`). A client that resumes
by positions is then told exactly what is gone (schema/README.md 5.1); one
that does not is told by the connection's account, which counts what it was
still owed when it ended (`Shard.lost`).

Owed, counted. A lagging connection's `LagCursor.count` is how many messages
it is owed: each refused message counts (`missed`: the run's count, one add),
each sent or told one no longer does (`settle`). The same count is in its
account's owed word (broky.server.accounts, via `worker_owed`), committed with
every read and batch: should the worker die, a client that claims the account
is told those as WORKER_RESTART; on a live worker they go into its drops when
the connection ends (`Shard.lost`). A vbucket whose sequence restarted while
it lagged is told with what it was owed of the old epoch (`Sequences.ended`
says where that one ended here). Anything still counted when it is live again
(a vbucket whose history left this worker meanwhile) is told then, as
SLOW_CONSUMER: what it received and was told always add up.

Replay off (--replay-bytes 0): nothing lags; `squeeze` drops and tells
SLOW_CONSUMER as before.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

from broky.errors import ErrorCode
from broky.protocol import VBUCKETS, LossNotice, LossReason, Position, encode_frame
from broky.protocol.layout import EPOCH_AT, OFFSET_AT, VBUCKET_AT
from broky.server.shard.connection import OPEN, Connection, LagCursor
from broky.server.shard.sequences import ENTRY_WORDS
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    from broky.server.shard.fastpath import Note
    from broky.server.shard.part import ShardCore

_u32 = struct.Struct("<I").unpack_from
_u64 = struct.Struct("<Q").unpack_from
_u16 = struct.Struct("<H").unpack_from
_monotonic = time.monotonic
# Messages one batch queues at most (about a millisecond of work, as a bounded read's).
LAG_SCAN = 1024
# Bytes of history a lagging connection is sent ahead of its reading, at most (its
# bound if that is smaller): its transport's high-water mark is half of it.
LAG_WINDOW = 4 << 20
# Index entries taken from the replay buffer at once.
LAG_CHUNK = 512
_EVICTED = DropReason.EVICTED
# What a filtered reader's range of owed offsets costs in CPython (a list of two ints and
# its slot in its vbucket's list; measured): held in the memory budget as kind LAG_KIND.
RANGE_BYTES = 144
LAG_KIND = "lag"


def _bytes_held(held: tuple[int, Connection]) -> int:
    return held[0]


def every_key(c: Connection) -> bool:
    """Whether c has a plain subscription to every key of every key_partition."""
    return any(s.pattern == b">" and s.key_partition is None and s.member is None for s in c.subs.values())


def note_missed(
    buf: bytearray, start: int, end: int, owed: dict[int, list[list[int]]], epochs: dict[int, int]
) -> None:
    """Note the offsets of the stamped Messages buf[start:end] in `owed` (see LagCursor), and
    a vbucket's epoch in `epochs` with its first range: the reference of the compiled `note`."""
    pos = start
    while pos < end:
        vb = _u16(buf, pos + VBUCKET_AT)[0]
        offset = _u64(buf, pos + OFFSET_AT)[0]
        ranges = owed.get(vb)
        if ranges is None:
            owed[vb] = [[offset, offset + 1]]
            epochs[vb] = _u64(buf, pos + EPOCH_AT)[0]
        else:
            last = ranges[-1]
            if last[1] == offset:
                last[1] = offset + 1
            else:
                ranges.append([offset, offset + 1])
        pos += 4 + _u32(buf, pos)[0]


def cut_below(ranges: list[list[int]], oldest: int) -> int:
    """Cut the offsets below `oldest` (evicted) from `ranges`; how many they were."""
    count = 0
    while ranges and ranges[0][0] < oldest:
        start, stop = ranges[0]
        if stop <= oldest:
            count += stop - start
            ranges.pop(0)
        else:
            count += oldest - start
            ranges[0][0] = oldest
    return count


def window(c: Connection) -> int:
    return min(c.limit, LAG_WINDOW)


class Lag:
    """The Shard's part that keeps lagging connections and feeds them from the replay
    buffer (`Shard.lag`), built with the core (broky.server.shard.part)."""

    __slots__ = ("core", "lagging", "note")

    def __init__(self, core: ShardCore, note: Note | None = None) -> None:
        self.core = core
        self.lagging: dict[int, Connection] = {}  # conn_id -> a lagging connection
        # The compiled twin of `missed`'s loop (broky.server.shard.fastpath), or None.
        self.note = note

    # ------------------------------------------------------------ beginning

    def enter(self, c: Connection, buf: bytearray, start: int, end: int, count: int) -> None:
        """c met its bound at buf[start:end] (`count` stamped messages, refused): it lags from
        here."""
        now = _monotonic()
        lag = c.lag = LagCursor(every_key(c), now)
        c.cap = -1  # every delivery to it goes to `squeeze`, which hands it here
        self.lagging[c.conn_id] = c
        stats = self.core.stats
        stats.lagging += 1
        stats.lag_entered += 1
        self.missed(c, buf, start, end, count)
        w = window(c)
        c.transport.set_write_buffer_limits(high=max(w // 2, 1), low=w // 4)
        lag.scheduled = True
        self.core.loop.call_soon(self.seal if lag.every_key else self.next_batch, c)

    def missed(self, c: Connection, buf: bytearray, start: int, end: int, count: int) -> int:
        """Note the `count` refused messages buf[start:end] as owed to c (see the header);
        0 queued."""
        lag = c.lag
        assert lag is not None
        lag.count += count
        c.worker_owed += count  # its account: owed by this worker ("Owed", in the header)
        if not c.touched:  # (committed with the read)
            c.touched = True
            self.core.touched.append(c)
        if lag.open_from is not None:  # sealed, every key: its cursor says it all
            return 0
        (self.note or note_missed)(buf, start, end, lag.owed, lag.owed_epochs)
        return 0

    def settle(self, c: Connection, lag: LagCursor, n: int) -> None:
        """n messages c was owed were sent or told: no longer owed (its account too)."""
        n = min(n, lag.count)  # (a subscription changed during the lag: never below nothing)
        lag.count -= n
        c.worker_owed -= n

    def seal(self, c: Connection) -> None:
        """The loop's next turn after c began lagging, every key: its cursor per vbucket."""
        lag = c.lag
        if lag is None or c.state != OPEN:
            return
        core = self.core
        seqs = core.seqs
        former = seqs.former
        accepts = core.accepts
        open_from = [0] * VBUCKETS
        epochs = [0] * VBUCKETS
        tracked = bytearray(VBUCKETS)
        owed = lag.owed
        for vb in range(VBUCKETS):
            if accepts[vb] or vb in former or vb in owed:
                tracked[vb] = 1
                ranges = owed.get(vb)
                if ranges is not None:
                    open_from[vb] = ranges[0][0]
                    epochs[vb] = lag.owed_epochs[vb]
                else:
                    open_from[vb] = seqs.next_of(vb)
                    epochs[vb] = seqs.epoch_of(vb)
        lag.open_from = open_from
        lag.epochs = epochs
        lag.tracked = bytes(tracked)
        owed.clear()
        lag.owed_epochs.clear()
        self.next_batch(c)

    # ------------------------------------------------------------ catching up

    def next_batch(self, c: Connection) -> None:
        """A batch for c outside any read of the worker's (call_soon, drained, Resume): queued
        and written."""
        lag = c.lag
        if lag is None:
            return
        lag.scheduled = False
        self.pump(c)
        core = self.core
        if core.touched:
            core.flush()
        lag = c.lag
        if lag is not None and not lag.scheduled and c.state == OPEN and not c.paused and not c.write_paused:
            # Written and not over the high-water mark: the kernel took it, and no drain
            # will call; the next batch on the loop's next turn.
            lag.scheduled = True
            core.loop.call_soon(self.next_batch, c)

    def pump(self, c: Connection) -> None:
        """Queue c's next batch from the replay buffer (see the header); live again when
        nothing more is owed."""
        lag = c.lag
        if lag is None or c.state != OPEN or c.paused or c.write_paused:
            return
        if lag.every_key and lag.open_from is None:
            return  # the seal follows
        core = self.core
        room = window(c) - c.transport.get_write_buffer_size() - c.unflushed
        if room <= 0:
            return
        out = c.out
        budget = LAG_SCAN
        queued = sent = 0
        # The vbuckets it is behind in, as of the batch that found them; the batches after it
        # go on down that list (finding them costs a pass over every vbucket: once a list).
        behind = lag.pending
        fresh = behind is None
        if behind is None:
            behind = lag.pending = self.behind_vbuckets(c)
            lag.next_vb = 0
            if not behind:
                self.live(c)
                return
        full = False
        n = len(behind)
        i = lag.next_vb
        while i < n:
            q, s, room, full = self.serve(c, lag, behind[i], room, budget, out)
            queued += q
            sent += s
            budget -= s
            if full or budget <= 0:
                break
            i += 1  # (served to where it stood: nothing was accepted meanwhile)
        lag.next_vb = i
        done = i >= n
        if done:
            lag.pending = None
        if queued:
            c.unflushed += queued
            lag.progress = _monotonic()
            if sent:
                c.msgs_out += sent
                self.settle(c, lag, sent)
                lag.served += sent
                stats = core.stats
                stats.lag_served += sent
                stats.messages_delivered += sent
            core.book.commit((c,))  # accounted before it leaves (broky.server.accounts)
            if not c.touched:
                c.touched = True
                core.touched.append(c)
        if done and fresh:
            # Every vbucket it was behind in when this batch began is served up to where it
            # stood, and no message was accepted since (a batch runs outside any read).
            self.live(c)

    def serve(
        self, c: Connection, lag: LagCursor, vb: int, room: int, budget: int, out: list[bytes | bytearray]
    ) -> tuple[int, int, int, bool]:
        """Queue what c is owed of vb, within `room` bytes and `budget` messages:
        (bytes queued, messages sent, room left, full)."""
        core = self.core
        replay = core.replay
        assert replay is not None
        seqs = core.seqs
        queued = sent = 0
        if lag.open_from is not None:  # every key: open_from[vb] .. next
            assert lag.epochs is not None
            at = lag.open_from[vb]
            epoch = seqs.epoch_of(vb)
            if epoch != lag.epochs[vb]:
                at = self.epoch_changed(c, vb, lag.epochs[vb], at, epoch)
                lag.epochs[vb] = epoch
            stop = seqs.next_of(vb)
            first = replay.first(vb)
            oldest = stop if first is None else first
            if oldest > at:
                notice = self.evicted(c, vb, epoch, at, oldest - at)
                out.append(notice)
                queued += len(notice)
                room -= len(notice)
                at = oldest
            q, sent, room, full = self.read_into(vb, at, stop, room, budget, out)
            lag.open_from[vb] = at + sent
            return queued + q, sent, room, full
        ranges = lag.owed.get(vb)
        told = lag.gone.pop(vb, None)  # evicted, trimmed at a tick (`trim`), not told yet
        if ranges is None:
            if told is None:  # served already (a list of an earlier batch names it)
                return 0, 0, room, False
            notice = self.tell_gone(c, vb, told, out)
            return len(notice), 0, room - len(notice), False
        epoch = lag.owed_epochs[vb]
        if told is not None and told[3] != epoch:  # of an epoch before the one it is owed now
            notice = self.tell_gone(c, vb, told, out)
            queued += len(notice)
            room -= len(notice)
            told = None
        now = seqs.epoch_of(vb)
        if now != epoch:  # its sequence restarted: what it was owed of the old one is gone
            gone = sum(stop - start for start, stop in ranges) + (told[0] if told else 0)
            at = told[1] if told else ranges[0][0]
            notice = self.notice(c, gone, LossReason.EPOCH_CHANGED, vb, epoch, at, now, 0)
            out.append(notice)
            del lag.owed[vb], lag.owed_epochs[vb]
            return queued + len(notice), 0, room - len(notice), False
        first = replay.first(vb)
        oldest = seqs.next_of(vb) if first is None else first
        gone, lost_from, through = (told[0], told[1], told[2]) if told else (0, ranges[0][0], 0)
        if ranges[0][0] < oldest:
            gone += cut_below(ranges, oldest)
            through = oldest - 1
        if gone:
            notice = self.evicted(c, vb, epoch, lost_from, gone, through=through)
            out.append(notice)
            queued += len(notice)
            room -= len(notice)
        full = False
        while ranges and budget > 0 and not full:
            start, stop = ranges[0]
            q, s, room, full = self.read_into(vb, start, stop, room, budget, out)
            queued += q
            sent += s
            budget -= s
            if start + s >= stop:
                ranges.pop(0)
            else:
                ranges[0][0] = start + s
                if not s:
                    break  # (nothing read at a retained offset: cannot happen)
        if not ranges:
            del lag.owed[vb], lag.owed_epochs[vb]
        return queued, sent, room, full

    def read_into(
        self, vb: int, at: int, stop: int, room: int, budget: int, out: list[bytes | bytearray]
    ) -> tuple[int, int, int, bool]:
        """Queue the retained messages of vb from offset `at` (retained) up to `stop`, within
        `room` bytes and `budget` messages, as one joined chunk per LAG_CHUNK (the replay
        buffer's `gather`, compiled with the read path): (bytes, messages, room left, full)."""
        replay = self.core.replay
        assert replay is not None
        queued = sent = 0
        full = False
        while at < stop and budget > 0:
            want = min(stop, at + min(budget, LAG_CHUNK)) - at
            chunk, n = replay.gather(vb, at, at + want, room, not out)
            if not n:
                full = bool(out)  # the next one does not fit (or nothing is retained here)
                break
            out.append(chunk)
            room -= len(chunk)
            queued += len(chunk)
            sent += n
            budget -= n
            at += n
            if n < want:
                full = True
                break
        return queued, sent, room, full

    def behind_vbuckets(self, c: Connection) -> list[int]:
        """The vbuckets c is still owed messages of, in order."""
        lag = c.lag
        assert lag is not None
        if lag.open_from is None:
            return sorted(lag.owed.keys() | lag.gone.keys())
        assert lag.epochs is not None
        core = self.core
        seqs = core.seqs
        accepts = core.accepts
        tracked = lag.tracked
        if tracked != accepts and any(a and not t for a, t in zip(accepts, tracked, strict=True)):
            # Came here after the seal (a planned move): owed from the sequence's first offset
            # here on (every message of it routed to c went through `squeeze`).
            fresh = bytearray(tracked)
            for vb, (a, t) in enumerate(zip(accepts, tracked, strict=True)):
                if a and not t:
                    fresh[vb] = 1
                    lag.open_from[vb] = seqs.begun_offset[vb]
                    lag.epochs[vb] = seqs.epoch_of(vb)
            tracked = lag.tracked = bytes(fresh)
        view = seqs.view
        nexts = view[1::ENTRY_WORDS].tolist()  # (one copy in C: a batch compares them all)
        epochs = view[0::ENTRY_WORDS].tolist()
        former = seqs.former
        return [
            vb
            for vb, (t, at, nxt, epoch, mine) in enumerate(
                zip(tracked, lag.open_from, nexts, epochs, lag.epochs, strict=True)
            )
            if t and (at < nxt or epoch != mine) and (accepts[vb] or vb in former)
        ]

    # ------------------------------------------------------------ telling

    def evicted(
        self, c: Connection, vb: int, epoch: int, at: int, gone: int, through: int | None = None
    ) -> bytes:
        """The notice of `gone` messages owed to c from (vb, epoch, at) that the buffer
        evicted first; counted."""
        lag = c.lag
        assert lag is not None
        lag.evicted += gone
        last = at + gone - 1 if through is None else through
        return self.notice(c, gone, LossReason.EVICTED, vb, epoch, at, epoch, last)

    def tell_gone(self, c: Connection, vb: int, told: list[int], out: list[bytes | bytearray]) -> bytes:
        """The notice of a count `trim` kept for vb ([count, first, last, epoch]), queued."""
        notice = self.evicted(c, vb, told[3], told[1], told[0], through=told[2])
        out.append(notice)
        return notice

    def epoch_changed(self, c: Connection, vb: int, old: int, at: int, new: int) -> int:
        """Every key: vb's sequence restarted under `new` while c lagged. Told how many of
        the old epoch it was owed (from `at` to where the old sequence ended here; 0 if it
        restarted twice meanwhile: then `live` tells them with what else is left), and read
        on from the new epoch's first offset here; returns it."""
        seqs = self.core.seqs
        ended = seqs.ended.get(vb)
        count = ended[1] - at if ended is not None and ended[0] == old and ended[1] > at else 0
        notice = self.notice(c, count, LossReason.EPOCH_CHANGED, vb, old, at, new, 0)
        c.out.append(notice)
        c.unflushed += len(notice)
        return seqs.begun_offset[vb]

    def notice(
        self,
        c: Connection,
        count: int,
        reason: int,
        vb: int,
        epoch: int,
        at: int,
        through_epoch: int,
        through: int,
    ) -> bytes:
        if count:
            c.dropped_total += count  # in its account, as a drop (its client counts it told)
            lag = c.lag
            if lag is not None:
                self.settle(c, lag, count)
            stats = self.core.stats
            stats.dropped[_EVICTED] += count
            stats.lag_evicted += count
        return encode_frame(
            LossNotice(count, reason, 0, Position(vb, epoch, at), Position(vb, through_epoch, through))
        )

    # ------------------------------------------------------------ the end of a lag

    def live(self, c: Connection) -> None:
        """c has caught up: deliveries go to it live again (see "The seam")."""
        lag = c.lag
        if lag is None:
            return
        if lag.count:
            # Owed, yet neither sent nor told: of vbuckets whose history left this worker
            # while it lagged (a move completed), or an old epoch's count not known at its
            # notice. Told now, so that what it was told and received add up.
            self.tell_left(c, lag)
        c.lag = None
        c.cap = c.limit
        c.transport.set_write_buffer_limits(high=max(c.limit // 2, 1), low=c.limit // 4)
        self.lagging.pop(c.conn_id, None)
        core = self.core
        core.stats.lagging -= 1
        core.drained(c)  # room again: its groups' waiting messages, its bounded read

    def tell_left(self, c: Connection, lag: LagCursor) -> None:
        count = lag.count
        self.settle(c, lag, count)
        c.dropped_total += count
        self.core.stats.dropped[DropReason.SLOW_CONSUMER] += count
        notice = encode_frame(LossNotice(count, LossReason.SLOW_CONSUMER))
        c.out.append(notice)
        c.unflushed += len(notice)
        if not c.touched:
            c.touched = True
            self.core.touched.append(c)

    def left(self, c: Connection) -> None:
        """c is gone: its lag with it."""
        if c.lag is not None:
            c.lag = None
            if self.lagging.pop(c.conn_id, None) is not None:
                self.core.stats.lagging -= 1

    def wake(self, c: Connection) -> None:
        """c may take a batch again (Resume): the next one on the loop's next turn (from a
        read, nothing is queued to it there: the batches that follow schedule themselves)."""
        lag = c.lag
        if lag is not None and not lag.scheduled:
            lag.scheduled = True
            self.core.loop.call_soon(self.next_batch, c)

    def drained(self, c: Connection) -> None:
        """c's transport drained to its low-water mark: its next batch."""
        lag = c.lag
        if lag is not None and not lag.scheduled:
            self.next_batch(c)

    def behind(self, c: Connection) -> int:
        """How many messages c is behind: those it is owed (0 when live)."""
        lag = c.lag
        return 0 if lag is None else lag.count

    def view(self, c: Connection) -> dict[str, float | int] | None:
        """c's lag for /connections (None: live): messages and seconds behind (the age of
        the oldest message it is owed that is still retained), for how long, served, evicted."""
        lag = c.lag
        if lag is None:
            return None
        replay = self.core.replay
        oldest = 0
        if replay is not None:
            for vb in self.behind_vbuckets(c):
                first = replay.first(vb)
                if first is None or (lag.open_from is None and vb not in lag.owed):
                    continue
                at = max(first, lag.open_from[vb] if lag.open_from is not None else lag.owed[vb][0][0])
                if at >= self.core.seqs.next_of(vb):
                    continue
                ts = replay.ts_at(vb, at)
                oldest = ts if not oldest else min(oldest, ts)
        return {
            "behind_messages": self.behind(c),
            "behind_seconds": round(max(0, time.time_ns() - oldest) / 1e9, 3) if oldest else 0.0,
            "since_seconds": round(_monotonic() - lag.since, 3),
            "served": lag.served,
            "evicted": lag.evicted,
        }

    def tick(self, now: float) -> None:
        """A lagging connection that made no progress for --slow-consumer-deadline while
        the buffer evicted everything it was owed is cut (see the header). The filtered
        readers' ranges are trimmed of what the buffer evicted, and held in the budget."""
        core = self.core
        replay = core.replay
        if replay is None:
            return
        if not self.lagging:
            if core.budget.taken.get(LAG_KIND):
                self.hold([])
            return
        deadline = core.config.slow_consumer_deadline
        held: list[tuple[int, Connection]] = []
        for c in list(self.lagging.values()):
            lag = c.lag
            if lag is None or c.state != OPEN:
                continue
            if lag.open_from is None and lag.owed:
                self.trim(c, lag)
                held.append((RANGE_BYTES * sum(len(ranges) for ranges in lag.owed.values()), c))
            if now - lag.progress <= deadline or c.transport.get_write_buffer_size() <= window(c) >> 2:
                continue
            if any(self.readable(c, vb) for vb in self.behind_vbuckets(c)):
                continue
            core.stats.slow_consumer_disconnects += 1
            core.fatal(
                c,
                ErrorCode.SLOW_CONSUMER,
                f"lagging, {self.behind(c)} messages behind, read nothing for more than {deadline:g} s, "
                "and the replay buffer evicted the oldest it was owed: it can no longer catch up (a resume "
                "by positions is told exactly what is gone, one without by the connection's account)",
            )
        self.hold([(n, c) for n, c in held if c.state == OPEN])

    def hold(self, held: list[tuple[int, Connection]]) -> None:
        """The filtered readers' ranges (`held`: their bytes, each reader) in the memory
        budget, as kind "lag": when the share has no room for them, the readers whose
        ranges take the most are cut, told as SLOW_CONSUMER (their accounts count what they
        were owed), until the rest fit. The pending bytes come first: they are owed too,
        and a cut reader's ranges are what it would have been sent."""
        core = self.core
        budget = core.budget
        total = sum(n for n, _ in held)
        was = budget.taken.get(LAG_KIND, 0)
        if total <= was:
            budget.give(LAG_KIND, was - total)
            return
        if budget.take(LAG_KIND, total - was):
            return
        room = budget.share - budget.used() + was  # what the ranges may hold
        stats = core.stats
        for n, c in sorted(held, key=_bytes_held, reverse=True):
            if total <= room:
                break
            total -= n
            stats.budget_cuts += 1
            stats.budget_cut_bytes += n
            core.fatal(
                c,
                ErrorCode.SLOW_CONSUMER,
                f"lagging, {self.behind(c)} messages behind, and the offsets it is owed take {n} bytes: "
                "more than the memory budget has room for (a resume by positions is told exactly what "
                "is gone, one without by the connection's account)",
            )
        budget.give(LAG_KIND, was)
        budget.take(LAG_KIND, min(total, max(0, budget.share - budget.used())))

    def readable(self, c: Connection, vb: int) -> bool:
        """Whether the buffer still holds the oldest message c is owed of vb (the eviction
        has not overtaken it there)."""
        lag = c.lag
        assert lag is not None
        replay = self.core.replay
        assert replay is not None
        first = replay.first(vb)
        if first is None:
            return False
        if lag.open_from is not None:
            return lag.open_from[vb] >= first
        if vb in lag.gone:
            return False
        ranges = lag.owed.get(vb)
        return not ranges or ranges[0][0] >= first

    def trim(self, c: Connection, lag: LagCursor) -> None:
        """A filtered reader's ranges the buffer evicted are forgotten here, at the tick, and
        kept as a count per vbucket (`gone`) until they are told (`serve`): a reader that
        reads nothing holds ranges for what is still retained only. A vbucket whose sequence
        restarted is left to `serve` (EPOCH_CHANGED)."""
        core = self.core
        replay = core.replay
        assert replay is not None
        seqs = core.seqs
        owed = lag.owed
        gone = lag.gone
        for vb in list(owed):
            ranges = owed[vb]
            epoch = lag.owed_epochs[vb]
            if seqs.epoch_of(vb) != epoch:
                continue
            first = replay.first(vb)
            oldest = seqs.next_of(vb) if first is None else first
            if ranges[0][0] >= oldest:
                continue
            told = gone.get(vb)
            if told is not None and told[3] != epoch:
                continue  # (an older epoch's count waits for `serve` to tell it first)
            lost_from = ranges[0][0]
            count = cut_below(ranges, oldest)
            if told is None:
                gone[vb] = [count, lost_from, oldest - 1, epoch]
            else:
                told[0] += count
                told[2] = oldest - 1
            if not ranges:
                del owed[vb], lag.owed_epochs[vb]


__all__ = ["LAG_SCAN", "LAG_WINDOW", "Lag", "cut_below", "every_key", "note_missed"]
