"""A worker's replay buffer: the most recent messages of its vbuckets, bounded in bytes.

Theory of operation
-------------------
Every message a worker accepts gets the next offset of its vbucket (and the
vbucket's epoch) stamped in place, in the copy of the read the worker makes
anyway to stamp ts_broker (broky.server.shard.core). The replay buffer keeps
those copies, not the messages one by one: a *segment* is one stamped copy
(a bytearray, usually one read), retained whole, and the index says where in
which segment each retained message of a vbucket starts. Storing a message
therefore costs no copy and no object: 16 bytes appended to the log.

    segments   oldest first: (segment id, bytes, when added, ts_broker of its
               messages); ids only grow
    index[vb]  a bytearray of little-endian u64, one per retained message of
               vb in offset order: segment id << 32 | position of the frame's
               first byte in that segment
    log        one bytearray of (index entry, vbucket) pairs of u64, in the
               order the messages were accepted: those not yet in their
               vbucket's index

The read path appends to the log (`record`, and the compiled read path,
broky.server.shard._feedscan), one place in memory after the other; the compiled
path appends an entry straight to its vbucket's index instead while the log
is empty and its messages so far are all of that vbucket (a read of one
key_partition never uses the log: the extra step cost it a tenth). `settle` moves
the log's entries into their vbuckets' indexes, many at a time: before any
lookup, at the worker's tick (`trim_all`) and whenever the log reaches
LOG_BYTES. Appending to each message's vbucket's bytearray as it came missed
the cache on most of them once a worker's reads spread over all its
vbuckets, between copies of the reads (bench/README.md, "The replay
buffer's cost": a tenth of the server's CPU per message over 4096
key_partitions); batched, the same appends hit it. Every method that reads
an index settles first, so the indexes are always complete when read.

Offsets are consecutive per vbucket (every accepted message gets one, and
every one is recorded here), so the retained messages of vb are the offsets
next - count .. next - 1, where next is the vbucket's next offset
(broky.server.shard.sequences) and count its index's entries: the message with
offset o is entry o - (next - count). A lookup by position is an index, a
lookup by time a binary search over ts_broker, read from the frames
themselves (`ts_at`). `settle` has a compiled twin (broky.server.shard._feedscan),
which the worker uses when the read path's twin runs.

Bounds. `limit` bytes of segments (`--replay-bytes`, per worker). When a new
segment takes the total over it, the oldest segments go first, whole; their
index entries are left behind and dropped lazily (`_trim`: a vbucket's stale
prefix is cut when it is next read, and by `trim_some`, which the worker's
tick calls for a quarter of the vbuckets at a time, a sweep over all of them
taking a second; `trim_all` at a scrape), so eviction costs nothing per
message either. An age bound
(`max_age`, seconds) evicts segments older than that the same way.

The retained bytes are drawn from the worker's share of --memory-budget
(broky.server.shard.budget, kind "replay"): every segment is taken from it when it
is kept and given back when it goes, so `budget.taken["replay"]` is always
`bytes`. When the share has no room for a new segment the oldest go until it
has; when nothing is left to evict, the new segment is not kept either (its
messages are evicted at once). And when the connections' pending bytes need
the room, the worker shrinks the buffer before it cuts any connection
(`shrink`, from broky.server.shard.budget): what a subscriber is owed comes
before what one might ask for later. Every message that leaves the buffer is
counted (`evicted_messages`), and a subscriber that asks for it is told
(LossReason EVICTED).

Epochs. The buffer holds messages of the current epoch of each vbucket only:
`drop_vbucket` forgets a vbucket whose sequence ends here (it came back after
a planned move took it away, broky.server.shard.moves; or a new epoch starts),
and its entries; the caller restarts its sequence. A vbucket that moved away
keeps its entries (and its Sequences entry, from which they count) until then.

The buffer is sans-I/O: the worker appends (`retain`, `record`) on its read
path and reads (`read`, `first`, `offset_at_time`) when a subscription asks
for positions. It never blocks and never allocates per message but the 16
log bytes and the 8 index bytes (amortised: bytearrays grow by a fraction of
their size).
"""

from __future__ import annotations

import bisect
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broky.protocol import VBUCKETS
from broky.protocol.layout import TS_BROKER_AT
from broky.server.shard.sequences import Sequences

if TYPE_CHECKING:
    from broky.server.shard.budget import Budget

_u32 = struct.Struct("<I").unpack_from
_i64 = struct.Struct("<q").unpack_from
_entry = struct.Struct("<Q")
_logged = struct.Struct("<QQ")  # a log item: the index entry, the vbucket
SEGMENT_SHIFT = 32  # an index entry: segment id << 32 | position
# The log is settled when it reaches this many bytes (16 per message), besides before every
# lookup and at the tick: at most 16,384 messages wait, whatever the rate.
LOG_BYTES = 256 << 10
# The tick trims every TRIM_PHASES-th vbucket's stale index entries (`trim_some`): all of
# them at once held a worker's loop up to 0.6 ms (bench/README.md, "Tail sources").
TRIM_PHASES = 4
# settle(log, index): the compiled twin of ReplayBuffer.settle's loop (broky.server.shard._feedscan).
Settle = Callable[[bytearray, list[bytearray]], None]
# gather(entries, segments, room, first): the compiled twin of `gather_entries`.
Gather = Callable[[bytes, dict[int, Any], int, bool], tuple[bytes, int]]


class ReplayBuffer:
    """The retained messages of one worker's vbuckets (see the module's header)."""

    def __init__(
        self,
        limit: int,
        seqs: Sequences,
        max_age: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        budget: Budget | None = None,
        settle: Settle | None = None,
        gather: Gather | None = None,
    ) -> None:
        """settle: the compiled twin of `settle`'s loop (broky.server.shard.fastpath), or None for
        the Python one."""
        if limit < 0:
            raise ValueError(f"replay limit must be >= 0 bytes, not {limit}")
        self.limit = limit
        self.seqs = seqs
        self.max_age = max_age
        self.clock = clock
        self.budget = budget  # the worker's share of --memory-budget, or None: `limit` alone bounds it
        # (id, bytes, added at (monotonic), ts_broker of its messages)
        self.segments: deque[tuple[int, bytearray | bytes, float, int]] = deque()
        self.by_id: dict[int, bytearray | bytes] = {}
        self.bytes = 0  # bytes of the retained segments
        self.next_id = 1
        self.live = 1  # the oldest segment id still retained (ids below it are evicted)
        self.index = [bytearray() for _ in range(VBUCKETS)]
        self.log = bytearray()  # (index entry, vbucket) of messages not yet in the index
        self.settle_with = settle
        self.gather_with = gather  # the compiled `gather_entries`, or None
        self.evicted_messages = 0  # messages whose segment was evicted (counted when trimmed)
        self.trimmed_at = 1  # `live` when every index was last trimmed
        self.segments_refused = 0  # new segments not kept: the memory budget had no room at all
        # Per vbucket: the ts_broker of its newest evicted message (0: none since its epoch
        # began): a start from a time at or before it has lost something.
        self.gone_ts = [0] * VBUCKETS
        self.dropped_ts: dict[int, int] = {}  # ids of segments dropped, not yet trimmed -> their ts
        self.trim_phase = 0  # the tick's sweep (`trim_some`): the next phase, 0 .. TRIM_PHASES - 1
        self.sweep_live = 1  # `live` when the sweep in progress began

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    # ---------------------------------------------------------------- the read path

    def retain(self, segment: bytearray | bytes, ts: int) -> int:
        """Keep `segment` (a stamped copy of a read, its messages stamped with ts_broker
        `ts`); its id, for `record`. Evicts the
        oldest segments while the total is over the limit (never the new one), or while
        the memory budget has no room for it (then the new one too, if it must)."""
        seg_id = self.next_id
        self.next_id = seg_id + 1
        n = len(segment)
        budget = self.budget
        if budget is not None and not budget.take("replay", n):
            while True:
                if not self.segments:  # nothing left to give back: not kept
                    self.live = seg_id + 1
                    self.dropped_ts[seg_id] = ts
                    self.segments_refused += 1
                    return seg_id
                self._drop_oldest()
                if budget.take("replay", n):
                    break
        self.segments.append((seg_id, segment, self.clock(), ts))
        self.by_id[seg_id] = segment
        self.bytes += n
        if self.bytes > self.limit:
            self._evict_to(self.limit)
        if len(self.log) >= LOG_BYTES:
            self.settle()
        return seg_id

    def record(self, vb: int, seg_id: int, pos: int) -> None:
        """The message of vbucket `vb` that just got its offset (the one before the
        vbucket's next) starts at `pos` in segment `seg_id`."""
        self.log += _logged.pack(seg_id << SEGMENT_SHIFT | pos, vb)

    def settle(self) -> None:
        """Move every entry of the log into its vbucket's index, in the log's order."""
        log = self.log
        if not log:
            return
        if self.settle_with is not None:
            self.settle_with(log, self.index)
        else:
            index = self.index
            with memoryview(log) as raw, raw.cast("Q") as items:
                pairs = items.tolist()
            for i in range(0, len(pairs), 2):
                index[pairs[i + 1]] += _entry.pack(pairs[i])
        log.clear()

    def base(self, vb: int) -> int:
        """The offset of vb's first index entry."""
        self.settle()
        return self.seqs.next_of(vb) - len(self.index[vb]) // 8

    # ---------------------------------------------------------------- bounds

    def _drop_oldest(self) -> None:
        seg_id, segment, _, ts = self.segments.popleft()
        del self.by_id[seg_id]
        self.dropped_ts[seg_id] = ts
        n = len(segment)
        self.bytes -= n
        self.live = seg_id + 1
        if self.budget is not None:
            self.budget.give("replay", n)

    def _evict_to(self, target: int) -> None:
        """Drop the oldest segments until their bytes are at most `target` (the newest stays)."""
        segments = self.segments
        while self.bytes > target and len(segments) > 1:
            self._drop_oldest()

    def expire(self, now: float | None = None) -> None:
        """Drop the segments older than `max_age` (the worker's tick)."""
        if self.max_age is None:
            return
        now = self.clock() if now is None else now
        segments = self.segments
        while segments and now - segments[0][2] > self.max_age:
            self._drop_oldest()

    def shrink(self, target: int) -> int:
        """Give memory back: at most `target` bytes retained, the newest segment too if it
        must (the memory budget asked); the bytes given back."""
        before = self.bytes
        while self.bytes > target and self.segments:
            self._drop_oldest()
        return before - self.bytes

    def _trim(self, vb: int) -> None:
        """Cut vb's index entries whose segments were evicted (the log settled first)."""
        if self.log:
            self.settle()
        index = self.index[vb]
        if not index:
            return
        with memoryview(index) as raw, raw.cast("Q") as entries:
            if entries[0] >> SEGMENT_SHIFT >= self.live:
                return
            stale = bisect.bisect_left(entries, self.live << SEGMENT_SHIFT)
            gone = self.dropped_ts.get(entries[stale - 1] >> SEGMENT_SHIFT, 0)
        if gone > self.gone_ts[vb]:
            self.gone_ts[vb] = gone
        del index[: 8 * stale]
        self.evicted_messages += stale

    def trim_all(self) -> None:
        """Cut every vbucket's stale index entries (a scrape, for exact counts; nothing to
        do unless a segment went since the last time)."""
        self.settle()
        self.trim_phase = 0  # a sweep in progress (`trim_some`) is complete with this one
        if self.live == self.trimmed_at:
            return
        self.trimmed_at = self.live
        for vb in range(VBUCKETS):
            self._trim(vb)
        self.dropped_ts.clear()  # every stale entry is gone: no segment id below `live` is met again

    def trim_some(self) -> None:
        """The worker's tick: cut the stale index entries of one TRIM_PHASES-th of the
        vbuckets (every TRIM_PHASES-th one, so that each worker's share is spread
        evenly), a sweep over all of them taking TRIM_PHASES ticks (see "Bounds")."""
        self.settle()
        phase = self.trim_phase
        if phase == 0:  # a sweep starts: nothing to do unless a segment went since the last one
            if self.live == self.trimmed_at:
                return
            self.sweep_live = self.live
        for vb in range(phase, VBUCKETS, TRIM_PHASES):
            self._trim(vb)
        if phase + 1 < TRIM_PHASES:
            self.trim_phase = phase + 1
            return
        self.trim_phase = 0
        live = self.trimmed_at = self.sweep_live
        dropped = self.dropped_ts  # no entry of a segment older than the sweep is left
        for seg_id in list(dropped):  # (ids in the order they went)
            if seg_id >= live:
                break
            del dropped[seg_id]

    def drop_vbucket(self, vb: int) -> int:
        """Forget vb's retained messages (its sequence ends here); how many there were."""
        self._trim(vb)
        n = len(self.index[vb]) // 8
        self.index[vb] = bytearray()
        self.gone_ts[vb] = 0
        return n

    def snapshot(self) -> dict[str, int]:
        """For /stats and the metrics (trims every vbucket first: exact counts)."""
        self.trim_all()
        return {
            "replay_bytes": self.bytes,
            "replay_limit": self.limit,
            "replay_segments": len(self.segments),
            "replay_messages": sum(len(index) for index in self.index) // 8,
            "replay_evicted_messages": self.evicted_messages,
            "replay_segments_refused": self.segments_refused,
        }

    # ---------------------------------------------------------------- lookups

    def first(self, vb: int) -> int | None:
        """The oldest retained offset of vb, or None when none is retained."""
        self._trim(vb)
        return self.base(vb) if self.index[vb] else None

    def last_ts(self, vb: int) -> int:
        """ts_broker of the newest message of vb's epoch this buffer held (retained, or
        evicted since), 0 for none: what a planned move hands over with the sequence."""
        self._trim(vb)
        if self.index[vb]:
            return self.ts_at(vb, self.seqs.next_of(vb) - 1)
        return self.gone_ts[vb]

    def count(self, vb: int) -> int:
        self._trim(vb)
        return len(self.index[vb]) // 8

    def _locate(self, entry: int) -> tuple[bytearray | bytes, int]:
        return self.by_id[entry >> SEGMENT_SHIFT], entry & 0xFFFFFFFF

    def read(self, vb: int, start: int, stop: int) -> list[tuple[bytearray | bytes, int, int]]:
        """The retained messages of vb with offsets start <= offset < stop, in order, as
        (segment, first byte, end); offsets before `first(vb)` are left out (the caller
        counts them as evicted)."""
        self._trim(vb)
        index = self.index[vb]
        if not index:
            return []
        base = self.base(vb)
        lo = max(start, base) - base
        hi = min(stop - base, len(index) // 8)
        if lo >= hi:
            return []
        with memoryview(index) as raw, raw.cast("Q") as entries:
            chosen = entries[lo:hi].tolist()
        out = []
        for entry in chosen:
            segment, pos = self._locate(entry)
            out.append((segment, pos, pos + 4 + _u32(segment, pos)[0]))
        return out

    def gather(self, vb: int, start: int, stop: int, room: int, first: bool) -> tuple[bytes, int]:
        """The retained messages of vb with offsets start <= offset < stop, in order, joined
        while they fit in `room` bytes (the first one whatever its size if `first`), and how
        many: a lagging reader's batch (broky.server.shard.lag). Offsets before `first(vb)` are
        left out, as `read` leaves them."""
        self._trim(vb)
        index = self.index[vb]
        if not index:
            return b"", 0
        base = self.base(vb)
        lo = max(start, base) - base
        hi = min(stop - base, len(index) // 8)
        if lo >= hi:
            return b"", 0
        entries = bytes(index[8 * lo : 8 * hi])
        if self.gather_with is not None:
            return self.gather_with(entries, self.by_id, room, first)
        return gather_entries(entries, self.by_id, room, first)

    def ts_at(self, vb: int, offset: int) -> int:
        """ts_broker of the retained message `offset` of vb."""
        self.settle()
        with memoryview(self.index[vb]) as raw, raw.cast("Q") as entries:
            entry = entries[offset - self.base(vb)]
        segment, pos = self._locate(entry)
        return int(_i64(segment, pos + TS_BROKER_AT)[0])

    def offset_at_time(self, vb: int, ts: int) -> int | None:
        """The first retained offset of vb whose ts_broker >= ts (ns), or None if every
        retained message of vb is older."""
        self._trim(vb)
        n = len(self.index[vb]) // 8
        if n == 0:
            return None
        base = self.base(vb)
        if self.ts_at(vb, base + n - 1) < ts:
            # Every retained message is older (ts_broker never decreases): the common case of
            # a start from now on, e.g. the HTTP gateway's position probes.
            return None
        lo, hi = 0, n - 1  # (the last one is not older)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.ts_at(vb, base + mid) < ts:
                lo = mid + 1
            else:
                hi = mid
        return base + lo


def gather_entries(
    entries: bytes, segments: dict[int, bytearray | bytes], room: int, first: bool
) -> tuple[bytes, int]:
    """The reference of the compiled `gather` (broky.server.shard._feedscan): the frames the u64
    index entries point at, joined while they fit in `room` (the first whatever its size if
    `first`), and how many."""
    parts: list[bytes | bytearray] = []
    total = 0
    for (entry,) in struct.iter_unpack("<Q", entries):
        segment = segments.get(entry >> SEGMENT_SHIFT)
        if segment is None:
            raise ValueError("gather(): an entry names a segment that is not retained")
        pos = entry & 0xFFFFFFFF
        if pos + 4 > len(segment) or pos + 4 + _u32(segment, pos)[0] > len(segment):
            raise ValueError("gather(): an entry points past its segment")
        size = 4 + _u32(segment, pos)[0]
        if total + size > room and not (first and not parts):
            break
        parts.append(segment[pos : pos + size])
        total += size
    return b"".join(parts), len(parts)


__all__ = ["ReplayBuffer", "gather_entries"]
