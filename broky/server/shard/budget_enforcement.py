"""The memory budget kept: pending bytes charged, the worst connections cut, the heap trimmed.

broky.server.shard.budget keeps the numbers of a worker's share (what each kind
uses, the room left for the pending bytes); this module is the Shard's part
that keeps its connections within it, and gives memory back afterwards.

Theory of operation
-------------------
Memory budget: every worker keeps the pending bytes of all its connections
together under its share of --memory-budget (broky.server.shard.budget), however
many connections there are and whatever their --max-pending-bytes allows.
`flush` charges each connection it touched (`charged` := its pending bytes
now: O(1) per touched connection, where `base` and `unflushed` change
anyway; nothing for one that had and has nothing pending) and adds the
difference to the worker's running total, `budget.pending`; a new peak of it
over the budget's room calls `enforce_budget` once the read is written
(`budget.peaked`: one test per read). That first makes the total exact
(`refresh_pending`: every transport's write buffer, as `tick` does four
times a second), since buffers drain unseen between writes; if still over,
the replay buffer gives room back first (broky.server.shard.replay, `shrink`: as
much of what it retains as it takes to bring the total under the low mark),
and if that is not enough, it cuts the connections with the most pending bytes first, until the total
is under the low mark (a quarter below the room): `cut` aborts the transport
(its buffer freed at once), closes the connection as if lost, and marks its
account (broky.server.accounts, `cut`). The client is not told then (its
socket is full or stalled): when it reconnects naming the connection
(Hello.previous), the LossNotice after its Welcome carries exactly what it
lost (deliveries queued minus received) with reason SLOW_CONSUMER, counted
under dropped{slow_consumer}; each cut counts in `budget_cuts` and
`budget_cut_bytes`, and the worker logs at most one line per
WARNING_INTERVAL. The check runs after a read's deliveries are queued, so
the budget is overshot by at most one read's deliveries (at most about 256
KB read times the targets of its messages), until that read's flush ends.

Memory: what a closed connection's subscriptions or pending bytes used goes
back to the allocators, but glibc keeps freed heap below its top
(fragmentation), so a worker's RSS stayed far above its baseline after a
subscription flood (50,000 Subscribes of 4 KB, limits raised: 44 MB before,
490 MB at the peak, 100-290 MB after the close), and after a burst queued for
stalled subscribers. Once closed connections or Unsubscribes freed
TRIM_AFTER_BYTES subscription bytes, or the pending bytes fell from a peak
over TRIM_AFTER_PEAK (or a quarter of the budget's room, if less) to under a
quarter of it, `tick` shrinks the matcher's tables that had an entry per
pattern (`Matcher.compact`) and calls malloc_trim(0) (broky.server.shard.heap),
at most once per TRIM_INTERVAL seconds: 53-64 MB after the same flood, for
20-40 ms of the worker's time.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from broky.server.shard import heap
from broky.server.shard.budget import LOW_MARK
from broky.server.shard.connection import Connection

if TYPE_CHECKING:
    from broky.server.accounts import AccountBook
    from broky.server.logs import Throttle
    from broky.server.shard.budget import Budget
    from broky.server.shard.groups import SubscriptionTable
    from broky.server.shard.replay import ReplayBuffer
    from broky.server.shard.stats import WorkerStats


log = logging.getLogger("broky.worker")
_monotonic = time.monotonic

TRIM_AFTER_BYTES = 1 << 20  # subscription bytes freed before the heap is trimmed
TRIM_AFTER_PEAK = 64 << 20  # ... or pending bytes that fell from a peak over this to a quarter of it
TRIM_INTERVAL = 5.0  # seconds between two trims at least


def _charged(c: Connection) -> int:
    return c.charged


class BudgetEnforcement:
    """The Shard's part that keeps it within its memory budget (a mixin of
    broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        index: int
        book: AccountBook
        matcher: SubscriptionTable
        stats: WorkerStats
        conns: dict[int, Connection]
        warnings: Throttle
        budget: Budget
        replay: ReplayBuffer | None

        def lost(self, c: Connection, exc: Exception | None) -> None: ...

    def charge(self, c: Connection, pending: int) -> None:
        """c has `pending` bytes pending now: the budget's running total follows."""
        budget = self.budget
        budget.pending += pending - c.charged
        c.charged = pending
        if budget.pending > budget.peak:
            budget.peaked = True  # `flush` calls new_peak once the read is written

    def new_peak(self) -> None:
        """The pending bytes reached a new peak: over the room, enforce the budget."""
        budget = self.budget
        budget.peaked = False
        if budget.pending > budget.room:
            budget.peak = budget.room  # at most the room: every read past it checks again
            self.enforce_budget()
        else:
            budget.peak = budget.pending

    def refresh_pending(self, attention: list[Connection] | None = None) -> int:
        """Make every connection's charge, and their total, exact; return the total.
        `attention` (the tick's): gets the connections the tick has more to check of
        (stopped reads, losses to tell, over their bound, a frame in pieces), in the same
        pass (a second pass over every connection cost the tick 0.03 us a connection)."""
        total = 0
        for c in self.conns.values():
            c.base = buffered = c.transport.get_write_buffer_size()
            c.charged = pending = buffered + c.unflushed
            total += pending
            if attention is not None and (c.reads_stopped or c.dropped or c.over_since or c.rest):
                attention.append(c)
        self.budget.pending = total
        return total

    def enforce_budget(self) -> None:
        """Over the budget's room (maybe: the total may be stale): made exact, and if
        still over, the connections with the most pending bytes are cut, worst first,
        until the total is under the low mark."""
        budget = self.budget
        total = self.refresh_pending()
        if total <= budget.room:
            return
        replay = self.replay
        if replay is not None and replay.bytes:
            # Owed bytes before an extra: the replay buffer makes room (down to the low mark).
            wanted = math.ceil(total / LOW_MARK) - budget.room
            replay.shrink(max(0, replay.bytes - wanted))
            self.stats.replay_shrinks += 1
            if total <= budget.room:
                return
        low = budget.low
        worst = sorted(self.conns.values(), key=_charged, reverse=True)
        cut = freed = 0
        largest = worst[0]
        largest_bytes = largest.charged
        for c in worst:
            if total <= low or not c.charged:
                break
            total -= c.charged
            freed += c.charged
            cut += 1
            self.cut(c)
        suppressed = self.warnings.allow("budget cuts")
        if suppressed is not None:
            more = f"; {suppressed} more cut since the last line" if suppressed else ""
            log.warning(
                "worker %d over its memory budget (%d bytes for pending bytes): cut %d connections "
                "with %d bytes pending, the most pending first (connection %d from %s: %d bytes); "
                "%d cut so far%s",
                self.index, budget.room, cut, freed, largest.conn_id, largest.peer, largest_bytes,
                self.stats.budget_cuts, more,
            )  # fmt: skip

    def cut(self, c: Connection) -> None:
        """Close c at once, its buffers freed, to keep the worker within its budget. Its
        account says so: a client reconnecting in its place is told exactly what it
        lost, as SLOW_CONSUMER (`take_over`)."""
        stats = self.stats
        stats.budget_cuts += 1
        stats.budget_cut_bytes += c.charged
        self.book.mark_cut(c)
        c.transport.abort()
        self.lost(c, None)

    def trim_heap(self, now: float) -> None:
        """Give the heap that freed subscriptions or pending bytes left behind back to the OS."""
        budget = self.budget
        freed, peak = budget.freed_sub_bytes, budget.peak
        budget.freed_sub_bytes = 0
        budget.peak = budget.pending
        budget.trimmed_at = now
        before = heap.rss_bytes()
        self.matcher.compact()
        if heap.trim():
            self.stats.memory_trims += 1
            after = heap.rss_bytes()
            log.debug(
                "heap trimmed (%d subscription bytes freed, pending bytes %d after a peak of %d): "
                "RSS %d -> %d bytes (%.1f ms)",
                freed, budget.pending, peak, before, after, (_monotonic() - now) * 1000,
            )  # fmt: skip
