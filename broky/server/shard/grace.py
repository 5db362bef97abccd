"""The restart grace: publishes held until the subscribers of a dead worker are back.

Theory of operation
-------------------
A worker that replaced a dead one holds every Message frame (`Grace.feed`: a
connection's reads pause at its first publish) until each of the dead
worker's subscribing connections has reconnected and restored its
subscriptions, or --restart-grace seconds pass (`start`, `end`);
then it routes what it held, in order. Control frames before a connection's
first publish are handled as usual, so the subscribers can come back.

A server (or node) that restarted under its clients does the same in every
worker for --restart-grace seconds, once a client names a connection of the
earlier process (`start_node`): nobody knows which of that process's
connections had subscriptions, so whoever comes back meanwhile counts.

The read handler (broky.server.shard.core `Shard.feed`) tests one flag per read,
`Shard.holding`, and hands the read to this part while it is set (`Grace.feed`);
the rest of the grace's state lives in the part (`Shard.grace`, an object
built with the core: broky.server.shard.part). A reconnecting client's claim
(broky.server.shard.arrivals) says which connection it resumes, and the core
tells the grace (`arrived`).

"Hold" means this and nothing else in Broky: a connection's input waits,
reads paused, in `rest` (`Connection.held`), to be fed again in order once
what it waits for is there. The restart grace holds at a connection's first
Message frame; a vbucket moving here holds the frames that need its sequence
until it arrives (broky.server.shard.moves), the same way. Other mechanisms have
words of their own: the reply bound stops reading a connection
(broky.server.shard.backpressure), a paused connection's deliveries are kept, other
kinds of memory take bytes of the budget (broky.server.shard.budget), and in the
SDK a full queue pauses its connections while a vbucket that moves fences its
new owner's Link (broky.client.routing).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import TYPE_CHECKING

from broky import fbs
from broky.errors import RemoteProtocolError
from broky.protocol.framing import MIN_FRAME_SIZE, check_size
from broky.protocol.message import BODY_MESSAGE, body_type
from broky.server.shard.connection import HELD_BY_GRACE, OPEN, Connection

if TYPE_CHECKING:
    from broky.server.shard.part import ShardCore

log = logging.getLogger("broky.worker")

_u32 = struct.Struct("<I").unpack_from
_monotonic = time.monotonic
_SUBSCRIPTION_FRAMES = (fbs.Body.Subscribe, fbs.Body.Unsubscribe)


class Grace:
    """The Shard's part that runs the restart grace (`Shard.grace`), built with the core
    (broky.server.shard.part); `ShardCore.holding` is its flag on the read path."""

    __slots__ = ("core", "expected", "held", "started", "timer", "until", "node_until")

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        self.expected: set[int] = set()  # ids of the dead worker's subscribers, until each is back
        self.held: list[Connection] = []  # connections whose input waits for the grace to end
        self.started = 0.0  # monotonic time it began
        self.timer: asyncio.TimerHandle | None = None
        self.until = 0.0  # monotonic time it ends at the latest
        self.node_until = 0.0  # monotonic end of a server restart grace (`start_node`)

    def start(self, expected: set[int], seconds: float) -> None:
        """This worker replaces one that died; `expected` are the ids of the dead
        worker's connections that had subscriptions. Until each of them has
        reconnected naming it (Hello.previous) and restored its subscriptions, or
        `seconds` pass, Message frames are held, not routed: a publish must not be
        dropped as no_subscribers merely because its subscribers are not back yet.
        Holding a connection pauses its reads, so memory stays bounded (TCP keeps
        the rest) and its frames keep their order."""
        if not expected or seconds <= 0:
            return
        core = self.core
        core.holding = True
        self.expected = set(expected)
        self.started = _monotonic()
        self.until = self.started + seconds
        core.stats.restart_subscribers_expected = len(expected)
        self.timer = core.loop.call_later(seconds, self.end, f"{seconds:g} s passed")
        log.info(
            "worker %d replaces a dead worker: holding publishes until its %d subscribing "
            "connections are back (at most %g s)", core.index, len(expected), seconds,
        )  # fmt: skip

    def start_node(self, seconds: float) -> None:
        """The whole server (or node) restarted under its clients: a client named a
        connection of an earlier server process (broky.server.master.process `_note_restart`).
        Nobody knows which of that process's connections had subscriptions, so
        Message frames are held for `seconds`, whoever comes back meanwhile; then
        what was held is routed, in order. (A worker restart grace under way lasts
        at least as long.)"""
        core = self.core
        if seconds <= 0 or core.closing:
            return
        now = _monotonic()
        self.node_until = max(self.node_until, now + seconds)
        core.stats.node_restart_graces += 1
        if not core.holding:
            core.holding = True
            self.started = now
            self.until = now
        if self.node_until > self.until:
            self.until = self.node_until
            if self.timer is not None:
                self.timer.cancel()
            self.timer = core.loop.call_later(self.until - now, self.end, "the server restart grace passed")
        log.info(
            "worker %d: this server restarted under its clients; holding publishes %g s for the "
            "subscribers of the previous process to subscribe again", core.index, seconds,
        )  # fmt: skip

    def feed(self, c: Connection, data: bytes) -> None:
        """`Shard.feed` during the restart grace: control frames are handled as usual; the
        first Message frame stops this connection's input until the grace ends. A
        resuming subscriber is back at its first frame other than (Un)Subscribe."""
        if c.held:  # a read that raced with pause_reading: it waits with the rest
            c.rest += data
            return
        if c.rest:
            data = c.rest + data
            c.rest = b""
        core = self.core
        pos, n = 0, len(data)
        max_frame = core.config.max_frame_bytes
        try:
            while n - pos >= 4:
                size = _u32(data, pos)[0]
                if size > max_frame or size < MIN_FRAME_SIZE:
                    check_size(size, max_frame)
                end = pos + 4 + size
                if end > n:
                    break
                kind = body_type(data, pos, end)
                if c.resuming and kind not in _SUBSCRIPTION_FRAMES:
                    self.came_back(c)
                    if not core.holding:
                        break  # that was the last one: the normal path takes the rest
                if kind == BODY_MESSAGE:
                    c.held = HELD_BY_GRACE
                    self.held.append(c)
                    c.transport.pause_reading()
                    break
                if not core.control(c, data, pos, end, time.time_ns()):
                    break  # a start from positions waits for its sequence (c is held)
                pos = end
                if c.state != OPEN or c.held:  # held: after a Read (broky.server.shard.positions)
                    break
        except RemoteProtocolError as exc:
            core.fatal(c, exc.code, str(exc))
        if pos < n and c.state == OPEN:
            c.rest = data[pos:]
            c.partial_since = _monotonic()
        if core.touched:
            core.flush()
        if not core.holding and c.rest and c.state == OPEN:
            core.feed(c, b"")

    def arrived(self, c: Connection, previous: int) -> None:
        """c resumes connection `previous` with its account: if that was one of the dead
        worker's subscribers, c is back once its subscriptions are in (`feed`)."""
        if previous in self.expected:
            c.resuming = previous

    def came_back(self, c: Connection) -> None:
        """A subscriber of the dead worker has restored its subscriptions."""
        self.expected.discard(c.resuming)
        c.resuming = 0
        if not self.expected and _monotonic() >= self.node_until:
            self.end("every subscribing connection is back")

    def forget(self, c: Connection) -> None:
        """c is gone: no longer held here."""
        if c in self.held:
            self.held.remove(c)

    def end(self, why: str) -> None:
        """Route what was held, in order per connection; from now on nothing is held."""
        core = self.core
        if not core.holding:
            return
        core.holding = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        held, self.held = self.held, []
        missing = len(self.expected)
        self.expected.clear()
        stats = core.stats
        stats.restart_grace_seconds = _monotonic() - self.started
        stats.restart_subscribers_missing = missing
        stats.restart_connections_held = len(held)
        (log.warning if missing else log.info)(
            "worker %d: restart grace over after %.2f s (%s); %d of %d subscribing connections back, "
            "%d publishing connections held", core.index, stats.restart_grace_seconds, why,
            stats.restart_subscribers_expected - missing, stats.restart_subscribers_expected, len(held),
        )  # fmt: skip
        for c in held:
            c.held = ""
            if c.state != OPEN:
                continue
            if not c.reads_stopped:
                c.transport.resume_reading()
            core.feed(c, b"")
