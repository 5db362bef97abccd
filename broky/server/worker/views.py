"""What a worker answers the master's STATS requests with (the views behind the
monitoring endpoints of broky.server.http.monitor, which the master serves).

A worker never talks to the master on its own; when an endpoint is asked, the
master sends each ready worker a STATS request over its control channel
(broky.server.handoff) naming the view it wants, and the worker answers with
`answer(shard, what)`:

    b""                       the shard's counter snapshot (Shard.snapshot)
    b"connections:LIMIT"      its LIMIT busiest connections
    b"topics:LIMIT"           its LIMIT patterns with the most subscriptions
    b"ready:VERSION"          whether it applied the map VERSION (Shard.map_ready)

Every list is bounded (at most MAX_LIMIT) and trimmed to fit one control
message. This module is the worker's; it imports nothing of the HTTP side.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from broky.server import handoff

if TYPE_CHECKING:
    from broky.server.shard.core import Shard

DEFAULT_LIMIT, MAX_LIMIT = handoff.DEFAULT_LIMIT, handoff.MAX_LIMIT
MAX_SUBS_LISTED = 8  # patterns listed per connection (the count is always exact)
MAX_PATTERN_CHARS = 256
_ANSWER_BUDGET = handoff.MAX_MESSAGE - (64 << 10)  # leaves room for the header


def answer(shard: Shard, what: bytes) -> dict[str, Any]:
    """The worker's answer to a STATS request for the view `what`."""
    view, _, arg = what.partition(b":")
    limit = _clamp(int(arg) if arg.isdigit() else DEFAULT_LIMIT)
    if view == b"connections":
        return _fit(connections_view(shard, limit), "connections")
    if view == b"topics":
        return _fit(topics_view(shard, limit), "topics")
    if view == b"ready":
        return shard.map_ready(int(arg) if arg.isdigit() else 0)
    return shard.snapshot()


def connections_view(shard: Shard, limit: int) -> dict[str, Any]:
    """The `limit` busiest connections of a shard (messages in + out)."""
    conns = sorted(shard.conns.values(), key=lambda c: c.msgs_in + c.msgs_out, reverse=True)
    now = time.time()
    listed = []
    for c in conns[:limit]:
        transport = c.transport
        pending = c.unflushed + (transport.get_write_buffer_size() if transport is not None else 0)
        patterns = [_text(s.pattern) for s in list(c.subs.values())[:MAX_SUBS_LISTED]]
        listed.append(
            {
                "id": c.conn_id,
                "worker": shard.index,
                "remote": c.peer,
                "name": c.client_name,
                "user": c.user,  # --users: its user (None: none, or the server's token)
                "uptime_seconds": round(now - c.connected_at, 3),
                "subscriptions": len(c.subs),
                "subscription_bytes": c.sub_bytes,
                "patterns": patterns,
                "pending_bytes": pending,
                "paused": c.paused,
                "reads_stopped": c.reads_stopped,
                "bounded_read": c.bounded_read.rid if c.bounded_read is not None else 0,  # its rid, 0: none
                "messages_in": c.msgs_in,
                "messages_out": c.msgs_out,
                "dropped": c.dropped_total,
                "lag": shard.lag.view(c),  # None: live (broky.server.shard.lag)
            }
        )
    return {"worker": shard.index, "total": len(conns), "connections": listed}


def topics_view(shard: Shard, limit: int) -> dict[str, Any]:
    """The `limit` patterns of a shard with the most subscriptions (ties: by pattern)."""
    patterns = sorted(shard.matcher.patterns.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "worker": shard.index,
        "total": len(patterns),
        "topics": [
            {"pattern": _text(p), "worker": shard.index, "subscriptions": n} for p, n in patterns[:limit]
        ],
    }


def _fit(view: dict[str, Any], key: str) -> dict[str, Any]:
    """Halve the list until the JSON fits in one control message."""
    while len(view[key]) > 1 and len(json.dumps(view)) > _ANSWER_BUDGET:
        view[key] = view[key][: len(view[key]) // 2]
    return view


def _text(pattern: bytes) -> str:
    text = pattern.decode("utf-8", "backslashreplace")
    return text if len(text) <= MAX_PATTERN_CHARS else text[: MAX_PATTERN_CHARS - 1] + "…"


def _clamp(limit: int) -> int:
    return max(1, min(limit, MAX_LIMIT))
