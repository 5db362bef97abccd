"""The monitoring view of a worker's shard: its counters and its sizes, for /stats.

The master's /stats and /metrics ask each worker over the control channel (a
STATS request, answered by broky.server.worker.views `answer`). `snapshot`
copies the counters (broky.server.shard.stats) and adds what is read only
then: the matcher's sizes, RSS, the memory budget's use, the replay buffer's,
the former vbuckets'. It is a part of the Shard without state of its own,
called by the core with itself (broky.server.shard.part); the core adds its
groups' view (`Shard.snapshot`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from broky.server.shard import heap

if TYPE_CHECKING:
    from broky.server.shard.part import ShardCore

# The replay buffer's fields of a snapshot when there is none (--replay-bytes 0).
REPLAY_OFF = {
    "replay_bytes": 0,
    "replay_limit": 0,
    "replay_segments": 0,
    "replay_messages": 0,
    "replay_evicted_messages": 0,
    "replay_segments_refused": 0,
}


def snapshot(core: ShardCore) -> dict[str, Any]:
    """Every counter, and what is read only now (see the header): the core's part of the
    master's /stats and the metrics exporter (`Shard.snapshot` adds its groups')."""
    s = core.stats
    data = dict(vars(s))
    data["dropped"] = dict(s.dropped)
    data["resumes"] = dict(s.resumes)
    data["errors"] = dict(s.errors)
    data["tls_failures"] = dict(s.tls_failures)
    data["subscriptions_refused"] = dict(s.subscriptions_refused)
    data["permission_denied"] = dict(s.permission_denied)
    data["latency_us"] = list(s.latency_us)
    data["producer_us"] = list(s.producer_us)
    matcher = core.matcher
    replay = core.replay
    former = core.seqs.former
    data.update(
        worker=core.index,
        pid=os.getpid(),
        topics=len(matcher.patterns),
        match_cache_entries=matcher.cache_len,
        match_cache_hits=matcher.cache_hits,
        match_cache_misses=matcher.cache_misses,
        matcher_empty=matcher.is_empty(),
        rss_bytes=heap.rss_bytes(),
        map_version=core.map.version,
        accounts_unavailable=core.book.unavailable,
        accounts_closed_kept=len(core.book.closed),
        pending_bytes=core.budget.pending,
        memory_budget=core.budget.share,
        budget=core.budget.snapshot(),
        **(replay.snapshot() if replay is not None else REPLAY_OFF),
        # Vbuckets handed over whose retained messages stay (broky.server.shard.moves), and
        # those messages: a draining node lingers while there are some (broky.server.master.process).
        former_vbuckets=len(former),
        former_messages=0 if replay is None else sum(replay.count(vb) for vb in former),
    )
    return data


__all__ = ["snapshot"]
