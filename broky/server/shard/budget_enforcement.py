"""The memory budget kept: pending bytes charged, the worst connections cut, the heap trimmed.

broky.server.shard.budget keeps the numbers of a worker's share (what each kind
uses, the room left for the pending bytes). The core charges each connection
as it writes (`Shard.charge`) and notices a new peak once per read
(`Shard.new_peak`): that is the write path's edge. This part keeps the
connections within the share when a peak goes over it, and gives memory back
afterwards; it keeps no state beyond the Budget, and is a module of functions
the core calls with itself (broky.server.shard.part).

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
quarter of it, the tick (`trim_due`, `trim_heap`) shrinks the matcher's
tables that had an entry per pattern (`Matcher.compact`) and calls
malloc_trim(0) (broky.server.shard.heap), at most once per TRIM_INTERVAL
seconds: 53-64 MB after the same flood, for 20-40 ms of the worker's time.
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
    from broky.server.shard.budget import Budget
    from broky.server.shard.part import ShardCore


log = logging.getLogger("broky.worker")
_monotonic = time.monotonic

TRIM_AFTER_BYTES = 1 << 20  # subscription bytes freed before the heap is trimmed
TRIM_AFTER_PEAK = 64 << 20  # ... or pending bytes that fell from a peak over this to a quarter of it
TRIM_INTERVAL = 5.0  # seconds between two trims at least


def _charged(c: Connection) -> int:
    return c.charged


def refresh_pending(core: ShardCore, attention: list[Connection] | None = None) -> int:
    """Make every connection's charge, and their total, exact; return the total.
    `attention` (the tick's): gets the connections the tick has more to check of
    (stopped reads, losses to tell, over their bound, a frame in pieces), in the same
    pass (a second pass over every connection cost the tick 0.03 us a connection)."""
    total = 0
    for c in core.conns.values():
        c.base = buffered = c.transport.get_write_buffer_size()
        c.charged = pending = buffered + c.unflushed
        total += pending
        if attention is not None and (c.reads_stopped or c.dropped or c.over_since or c.rest):
            attention.append(c)
    core.budget.pending = total
    return total


def enforce_budget(core: ShardCore) -> None:
    """Over the budget's room (maybe: the total may be stale): made exact, and if
    still over, the connections with the most pending bytes are cut, worst first,
    until the total is under the low mark."""
    budget = core.budget
    total = refresh_pending(core)
    if total <= budget.room:
        return
    replay = core.replay
    if replay is not None and replay.bytes:
        # Owed bytes before an extra: the replay buffer makes room (down to the low mark).
        wanted = math.ceil(total / LOW_MARK) - budget.room
        replay.shrink(max(0, replay.bytes - wanted))
        core.stats.replay_shrinks += 1
        if total <= budget.room:
            return
    low = budget.low
    worst = sorted(core.conns.values(), key=_charged, reverse=True)
    cut_n = freed = 0
    largest = worst[0]
    largest_bytes = largest.charged
    for c in worst:
        if total <= low or not c.charged:
            break
        total -= c.charged
        freed += c.charged
        cut_n += 1
        cut(core, c)
    suppressed = core.warnings.allow("budget cuts")
    if suppressed is not None:
        more = f"; {suppressed} more cut since the last line" if suppressed else ""
        log.warning(
            "worker %d over its memory budget (%d bytes for pending bytes): cut %d connections "
            "with %d bytes pending, the most pending first (connection %d from %s: %d bytes); "
            "%d cut so far%s",
            core.index, budget.room, cut_n, freed, largest.conn_id, largest.peer, largest_bytes,
            core.stats.budget_cuts, more,
        )  # fmt: skip


def cut(core: ShardCore, c: Connection) -> None:
    """Close c at once, its buffers freed, to keep the worker within its budget. Its
    account says so: a client reconnecting in its place is told exactly what it
    lost, as SLOW_CONSUMER (broky.server.shard.arrivals `take_over`)."""
    stats = core.stats
    stats.budget_cuts += 1
    stats.budget_cut_bytes += c.charged
    core.book.mark_cut(c)
    c.transport.abort()
    core.lost(c, None)


def trim_due(budget: Budget, now: float) -> bool:
    """The tick asks: freed subscriptions or a fallen peak of pending bytes left heap
    behind (see "Memory" in the header), and the last trim was TRIM_INTERVAL ago."""
    return (
        budget.freed_sub_bytes >= TRIM_AFTER_BYTES
        or (budget.peak >= min(TRIM_AFTER_PEAK, budget.share >> 2) and budget.pending < budget.peak >> 2)
    ) and now - budget.trimmed_at >= TRIM_INTERVAL


def trim_heap(core: ShardCore, now: float) -> None:
    """Give the heap that freed subscriptions or pending bytes left behind back to the OS."""
    budget = core.budget
    freed, peak = budget.freed_sub_bytes, budget.peak
    budget.freed_sub_bytes = 0
    budget.peak = budget.pending
    budget.trimmed_at = now
    before = heap.rss_bytes()
    core.matcher.compact()
    if heap.trim():
        core.stats.memory_trims += 1
        after = heap.rss_bytes()
        log.debug(
            "heap trimmed (%d subscription bytes freed, pending bytes %d after a peak of %d): "
            "RSS %d -> %d bytes (%.1f ms)",
            freed, budget.pending, peak, before, after, (_monotonic() - now) * 1000,
        )  # fmt: skip


__all__ = ["cut", "enforce_budget", "refresh_pending", "trim_due", "trim_heap"]
