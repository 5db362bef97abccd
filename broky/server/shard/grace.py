"""The restart grace: publishes held until the subscribers of a dead worker are back.

Theory of operation
-------------------
A worker that replaced a dead one holds every Message frame (`feed_held`: a
connection's reads pause at its first publish) until each of the dead
worker's subscribing connections has reconnected and restored its
subscriptions, or --restart-grace seconds pass (`start_grace`, `end_grace`);
then it routes what it held, in order. Control frames before a connection's
first publish are handled as usual, so the subscribers can come back.

A server (or node) that restarted under its clients does the same in every
worker for --restart-grace seconds, once a client names a connection of the
earlier process (`start_node_grace`): nobody knows which of that process's
connections had subscriptions, so whoever comes back meanwhile counts.

The read handler (broky.server.shard.core `Shard.feed`) tests one flag per read,
`Shard.holding`; the rest of the grace's state lives in a `Grace` of its own
(`Shard.grace`), so that the Shard stays within SHARD_ATTRIBUTES.

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
from broky.server.shard.connection import OPEN, Connection

if TYPE_CHECKING:
    from broky.errors import ErrorCode
    from broky.server.config import ServerConfig
    from broky.server.shard.moves import Handovers
    from broky.server.shard.stats import WorkerStats

log = logging.getLogger("broky.worker")

_u32 = struct.Struct("<I").unpack_from
_monotonic = time.monotonic
_SUBSCRIPTION_FRAMES = (fbs.Body.Subscribe, fbs.Body.Unsubscribe)


class Grace:
    """The state of a restart grace (see `Shard.start_grace`); `Shard.holding` is its flag."""

    __slots__ = ("expected", "held", "started", "timer", "until", "node_until")

    def __init__(self) -> None:
        self.expected: set[int] = set()  # ids of the dead worker's subscribers, until each is back
        self.held: list[Connection] = []  # connections whose input waits for the grace to end
        self.started = 0.0  # monotonic time it began
        self.timer: asyncio.TimerHandle | None = None
        self.until = 0.0  # monotonic time it ends at the latest
        self.node_until = 0.0  # monotonic end of a server restart grace (`start_node_grace`)


class RestartGrace:
    """The Shard's part that runs the restart grace (a mixin of broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        config: ServerConfig
        index: int
        loop: asyncio.AbstractEventLoop
        stats: WorkerStats
        closing: bool
        holding: bool
        grace: Grace
        handover: Handovers
        _touched: list[Connection]

        def feed(self, c: Connection, data: bytes) -> None: ...
        def control(self, c: Connection, data: bytes, pos: int, end: int, t0: int = 0) -> None: ...
        def fatal(self, c: Connection, code: ErrorCode, message: str) -> None: ...
        def flush(self) -> None: ...
        def subscribe_waits(self, data: bytes, pos: int, end: int) -> bool: ...
        def hold_for_sequence(self, c: Connection) -> None: ...

    def start_grace(self, expected: set[int], seconds: float) -> None:
        """This worker replaces one that died; `expected` are the ids of the dead
        worker's connections that had subscriptions. Until each of them has
        reconnected naming it (Hello.previous) and restored its subscriptions, or
        `seconds` pass, Message frames are held, not routed: a publish must not be
        dropped as no_subscribers merely because its subscribers are not back yet.
        Holding a connection pauses its reads, so memory stays bounded (TCP keeps
        the rest) and its frames keep their order."""
        if not expected or seconds <= 0:
            return
        grace = self.grace
        self.holding = True
        grace.expected = set(expected)
        grace.started = _monotonic()
        grace.until = grace.started + seconds
        self.stats.restart_subscribers_expected = len(expected)
        grace.timer = self.loop.call_later(seconds, self.end_grace, f"{seconds:g} s passed")
        log.info(
            "worker %d replaces a dead worker: holding publishes until its %d subscribing "
            "connections are back (at most %g s)", self.index, len(expected), seconds,
        )  # fmt: skip

    def start_node_grace(self, seconds: float) -> None:
        """The whole server (or node) restarted under its clients: a client named a
        connection of an earlier server process (broky.server.master.process `_note_restart`).
        Nobody knows which of that process's connections had subscriptions, so
        Message frames are held for `seconds`, whoever comes back meanwhile; then
        what was held is routed, in order. (A worker restart grace under way lasts
        at least as long.)"""
        if seconds <= 0 or self.closing:
            return
        now = _monotonic()
        grace = self.grace
        grace.node_until = max(grace.node_until, now + seconds)
        self.stats.node_restart_graces += 1
        if not self.holding:
            self.holding = True
            grace.started = now
            grace.until = now
        if grace.node_until > grace.until:
            grace.until = grace.node_until
            if grace.timer is not None:
                grace.timer.cancel()
            grace.timer = self.loop.call_later(
                grace.until - now, self.end_grace, "the server restart grace passed"
            )
        log.info(
            "worker %d: this server restarted under its clients; holding publishes %g s for the "
            "subscribers of the previous process to subscribe again", self.index, seconds,
        )  # fmt: skip

    def feed_held(self, c: Connection, data: bytes) -> None:
        """`feed` during the restart grace: control frames are handled as usual; the
        first Message frame stops this connection's input until the grace ends. A
        resuming subscriber is back at its first frame other than (Un)Subscribe."""
        if c.held:  # a read that raced with pause_reading: it waits with the rest
            c.rest += data
            return
        if c.rest:
            data = c.rest + data
            c.rest = b""
        pos, n = 0, len(data)
        max_frame = self.config.max_frame_bytes
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
                    if not self.holding:
                        break  # that was the last one: the normal path takes the rest
                if kind == BODY_MESSAGE:
                    c.held = True
                    self.grace.held.append(c)
                    c.transport.pause_reading()
                    break
                if self.handover.awaiting and self.subscribe_waits(data, pos, end):
                    self.hold_for_sequence(c)  # a start from positions waits for them
                    break
                self.control(c, data, pos, end, time.time_ns())
                pos = end
                if c.state != OPEN or c.held:  # held: after a Read (broky.server.shard.reads)
                    break
        except RemoteProtocolError as exc:
            self.fatal(c, exc.code, str(exc))
        if pos < n and c.state == OPEN:
            c.rest = data[pos:]
            c.partial_since = _monotonic()
        if self._touched:
            self.flush()
        if not self.holding and c.rest and c.state == OPEN:
            self.feed(c, b"")

    def came_back(self, c: Connection) -> None:
        """A subscriber of the dead worker has restored its subscriptions."""
        grace = self.grace
        grace.expected.discard(c.resuming)
        c.resuming = 0
        if not grace.expected and _monotonic() >= grace.node_until:
            self.end_grace("every subscribing connection is back")

    def end_grace(self, why: str) -> None:
        """Route what was held, in order per connection; from now on nothing is held."""
        if not self.holding:
            return
        self.holding = False
        grace = self.grace
        if grace.timer is not None:
            grace.timer.cancel()
            grace.timer = None
        held, grace.held = grace.held, []
        missing = len(grace.expected)
        grace.expected.clear()
        stats = self.stats
        stats.restart_grace_seconds = _monotonic() - grace.started
        stats.restart_subscribers_missing = missing
        stats.restart_connections_held = len(held)
        (log.warning if missing else log.info)(
            "worker %d: restart grace over after %.2f s (%s); %d of %d subscribing connections back, "
            "%d publishing connections held", self.index, stats.restart_grace_seconds, why,
            stats.restart_subscribers_expected - missing, stats.restart_subscribers_expected, len(held),
        )  # fmt: skip
        for c in held:
            c.held = False
            if c.state != OPEN:
                continue
            if not c.reads_stopped:
                c.transport.resume_reading()
            self.feed(c, b"")
