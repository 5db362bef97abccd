"""Replies and slow consumers: what the shard does for a client that reads less than it is sent.

The read path (broky.server.shard.core) queues deliveries under each connection's
pending bound and drops what does not fit (`Shard.squeeze`); this module
tells the subscriber what it lost, closes it when it stays behind, bounds the
control replies it leaves unread, and runs the worker's periodic `tick`.

Theory of operation
-------------------
Slow consumers: the first drop starts a clock (`over_since`), and from a drop
on nothing is queued to the connection before the LossNotice that tells it
(`cap` is -1 meanwhile): the drops one notice counts come after every
delivery queued before it, so the ones a connection lost untold are always
after its last delivery (a resume by positions replays them:
broky.server.shard.arrivals). The notice goes ahead of the next delivery that fits
under the bound again (`reopen`: the subscriber loses no more than without
it), or, if none comes, once the pending bytes are down to the low-water mark
(a quarter of the bound: seen after a write, on resume_writing, or by `tick`
when the buffer drained without ever reaching the high-water mark), or, for a
paused connection, when it resumes. The clock stops when the pending bytes
are down to a quarter. The periodic `tick` closes a connection whose clock
ran past --slow-consumer-deadline with a fatal SLOW_CONSUMER error (no
LossNotice before it: `slow_disconnect`). A paused connection keeps its
deliveries in `out` under the same bound.

Replies: control replies (Pong, Error) count in the pending bytes but are
never dropped, and they have a bound of their own, --max-reply-bytes (at most
the pending bound): a connection with more unread replies than that is read no
more (`stop_reading`) until they are down to a quarter of it, and its clock
runs meanwhile. Only replies count here, never deliveries: a subscriber's
backlog must not stop that client's publishes. The write buffer is a FIFO, so
a connection counts the bytes it ever handed to its transport (`sent`) and,
for writes that carried replies, marks where they end (`reply_marks`: stream
position, replies written so far). Bytes that left the buffer = sent minus its
size; every mark at or before that point is popped, and the replies not known
to have left are the unread ones, except that the writes up to the first mark
left count at most their bytes still in the buffer (an upper bound, exact when
those writes carried only replies). This runs only on rare paths: a flush
whose read queued a reply, and a connection whose reads are stopped (`flush`,
`drained`, and `tick` for a buffer that never reached the high-water mark).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from broky.errors import ErrorCode
from broky.protocol import LossNotice, LossReason, encode_frame
from broky.protocol.frames import error_frame
from broky.server.shard.budget_enforcement import TRIM_AFTER_BYTES, TRIM_AFTER_PEAK, TRIM_INTERVAL
from broky.server.shard.connection import OPEN, Connection

if TYPE_CHECKING:
    import asyncio

    from broky.protocol import VBucketMap
    from broky.server.config import ServerConfig
    from broky.server.logs import Throttle
    from broky.server.shard.budget import Budget
    from broky.server.shard.groups import Group, Member
    from broky.server.shard.moves import Handovers
    from broky.server.shard.replay import ReplayBuffer
    from broky.server.shard.stats import WorkerStats

log = logging.getLogger("broky.worker")

_monotonic = time.monotonic
MAX_REPLY_MARKS = 64  # per connection; past it the newest mark moves forward (counts replies longer)


class Backpressure:
    """The Shard's part for replies and slow consumers (a mixin of broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        loop: asyncio.AbstractEventLoop

        def room(self, g: Group, m: Member, now: float) -> None: ...

        config: ServerConfig
        map: VBucketMap
        stats: WorkerStats
        conns: dict[int, Connection]
        warnings: Throttle
        budget: Budget
        replay: ReplayBuffer | None
        handover: Handovers
        _touched: list[Connection]

        def fatal(self, c: Connection, code: ErrorCode, message: str) -> None: ...
        def handover_deadlines(self) -> None: ...
        def refresh_pending(self, attention: list[Connection] | None = None) -> int: ...
        def new_peak(self) -> None: ...
        def trim_heap(self, now: float) -> None: ...
        def continue_read(self, c: Connection) -> None: ...

    def reply(self, c: Connection, frame: bytes) -> None:
        """Queue a control frame to c behind what this read already queued for it.

        Replies are never dropped; they count in the pending bytes, and a connection
        with more than --max-reply-bytes of them unread is read no more until they drain.
        """
        if c.paused:
            transport = c.transport
            transport.write(frame)  # not kept: only deliveries wait for Resume
            c.sent += len(frame)
            c.reply_out += len(frame)
            self.stats.bytes_sent += len(frame)
            self.check_replies(c, transport.get_write_buffer_size())
            return
        c.out.append(frame)
        c.unflushed += len(frame)
        c.reply_out += len(frame)
        if not c.touched:
            c.touched = True
            self._touched.append(c)

    def error(
        self,
        c: Connection,
        code: ErrorCode,
        message: str,
        sid: int = 0,
        refused: bytes | None = None,
        rid: int = 0,
    ) -> None:
        """A non-fatal Error frame, and a warning (at most one per connection and code per 10 s)."""
        self.stats.count_error(code)
        suppressed = self.warnings.allow((c.conn_id, code))
        if suppressed is not None:
            more = f" ({suppressed} more since the last warning)" if suppressed else ""
            log.warning("connection %d from %s: %s: %s%s", c.conn_id, c.peer, code.name, message, more)
        version = self.map.version
        self.reply(
            c, error_frame(code, message, fatal=False, map_version=version, sid=sid, refused=refused, rid=rid)
        )

    def notify_loss(self, c: Connection) -> None:
        """Tell c how many deliveries it lost since the last notice; stop its clock."""
        frame = encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER))
        c.dropped = c.group_untold = 0
        c.cap = c.limit  # deliveries again
        c.over_since = 0.0
        c.transport.write(frame)
        c.sent += len(frame)
        self.stats.bytes_sent += len(frame)

    def reopen(self, c: Connection, need: int) -> bool:
        """c has drops not yet told, and `need` more bytes would fit under its bound: tell
        them now, ahead of what comes next (the drops come after every delivery queued
        before them), and queue to it again; False while it has no room yet."""
        notice = encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER))
        if c.base + c.unflushed + len(notice) + need > c.limit:
            return False
        c.out.append(notice)
        c.unflushed += len(notice)
        c.dropped = c.group_untold = 0
        c.cap = c.limit
        if not c.touched:
            c.touched = True
            self._touched.append(c)
        return True

    def drained(self, c: Connection) -> None:
        """c's write buffer fell to its low-water mark (a quarter of the bound)."""
        if c.state != OPEN:
            return
        if c.reads_stopped:
            self.check_replies(c, c.transport.get_write_buffer_size())
        if c.dropped and not c.paused:
            c.base = c.transport.get_write_buffer_size()
            self.notify_loss(c)
        elif not c.paused and not c.reads_stopped:
            c.over_since = 0.0  # told already (`reopen`): its clock stops here
        if c.bounded_read is not None:  # a bounded read waits for room (broky.server.shard.reads)
            self.continue_read(c)
        for s in c.subs.values():  # an ack group's messages may wait for room (broky.server.shard.groups)
            m = s.member
            if m is not None and m.group.ack:
                self.room(m.group, m, self.loop.time())

    def check_replies(self, c: Connection, buffered: int) -> None:
        """Rare path: mark the replies just written (c.reply_out) and stop or restart
        c's reads by its unread replies; `buffered` is its write buffer's size now."""
        if c.reply_out:
            c.reply_sent += c.reply_out
            c.reply_out = 0
            marks = c.reply_marks
            if marks is None:
                marks = c.reply_marks = deque()
            if len(marks) < MAX_REPLY_MARKS:
                marks.append((c.sent, c.reply_sent))
            else:  # merged with the newest: those replies count until this write left
                marks[-1] = (c.sent, c.reply_sent)
        unread = self.unread_replies(c, buffered)
        limit = self.config.max_reply_bytes  # at most max_pending_bytes (ServerConfig.from_args)
        if unread > limit:
            self.stop_reading(c)
        elif c.reads_stopped and unread <= limit >> 2:
            self.read_again(c)

    def unread_replies(self, c: Connection, buffered: int) -> int:
        """Reply bytes written to c that may still be in its write buffer (an upper bound)."""
        marks = c.reply_marks
        if not marks:
            return c.reply_sent - c.reply_left
        left = c.sent - buffered  # bytes that left the buffer (it is a FIFO)
        while marks and marks[0][0] <= left:
            c.reply_left = marks.popleft()[1]
        if not marks:
            return c.reply_sent - c.reply_left
        # The writes up to the first mark left in part: their replies still buffered are
        # at most what of them is still buffered. Later writes' replies all count.
        end, upto = marks[0]
        return min(upto - c.reply_left, end - left) + c.reply_sent - upto

    def stop_reading(self, c: Connection) -> None:
        """c's unread replies are over the reply bound: read nothing more from it until
        they drain (`check_replies`), so its own sends back up; the slow-consumer clock runs."""
        if c.reads_stopped or c.state != OPEN:
            return
        c.reads_stopped = True
        c.transport.pause_reading()
        self.stats.reads_stopped += 1
        if not c.over_since:
            c.over_since = _monotonic()
        log.debug("connection %d from %s does not read its replies; reading paused", c.conn_id, c.peer)

    def read_again(self, c: Connection) -> None:
        c.reads_stopped = False
        if not c.held:  # held (the restart grace, a sequence on its way): resumed when that ends
            c.transport.resume_reading()
        if not c.dropped:
            c.over_since = 0.0

    def slow_disconnect(self, c: Connection) -> None:
        """Close c, over its bound for longer than the deadline. Its drops not yet told
        are not told here: they came after every delivery queued to it (`cap`), so a
        client that resumes by positions gets them again from the replay buffer (or is
        told exactly what is gone), and one that does not is told them by the
        connection's account when it reconnects (broky.server.shard.arrivals); the Error's
        message counts them for a client that does neither."""
        self.stats.slow_consumer_disconnects += 1
        deadline = self.config.slow_consumer_deadline
        if c.reads_stopped:
            why = f"over {self.config.max_reply_bytes} bytes of unread replies for more than {deadline:g} s"
        else:
            why = f"over {c.limit} pending bytes for more than {deadline:g} s"
        if c.dropped:
            why += f"; {c.dropped} deliveries dropped since the last LossNotice (told on a resume)"
        self.fatal(c, ErrorCode.SLOW_CONSUMER, why)

    def tick(self) -> None:
        """Periodic: slow consumer and truncated frame deadlines, stopped reads, the memory
        budget made exact (and enforced), the replay buffer's age bound and stale index
        entries, sequences awaited too long (broky.server.shard.moves), heap trim."""
        now = _monotonic()
        budget = self.budget
        attention: list[Connection] = []
        if self.refresh_pending(attention) > budget.peak:
            self.new_peak()
        deadline = self.config.slow_consumer_deadline
        frame_timeout = self.config.frame_timeout
        for c in attention:
            if c.state != OPEN:
                continue
            if c.reads_stopped:  # its replies may have drained below the high-water mark
                self.check_replies(c, c.transport.get_write_buffer_size())
            if (
                c.dropped
                and not c.paused
                and not c.write_paused
                and c.transport.get_write_buffer_size() <= c.limit >> 2
            ):  # drained without ever reaching the high-water mark (no resume_writing)
                c.base = c.transport.get_write_buffer_size()
                self.notify_loss(c)
            elif (
                c.over_since
                and not c.dropped
                and not c.paused
                and not c.reads_stopped
                and c.transport.get_write_buffer_size() <= c.limit >> 2
            ):  # told already (`reopen`), and drained: its clock stops
                c.over_since = 0.0
            elif c.over_since and now - c.over_since > deadline:
                self.slow_disconnect(c)
            elif c.rest and not c.held and now - c.partial_since > frame_timeout:
                self.fatal(c, ErrorCode.TRUNCATED_FRAME, f"silence inside a frame for {frame_timeout:g} s")
        replay = self.replay
        if replay is not None:
            replay.expire()
            replay.trim_some()
        if self.handover.awaiting:
            self.handover_deadlines()
        if (
            budget.freed_sub_bytes >= TRIM_AFTER_BYTES
            or (budget.peak >= min(TRIM_AFTER_PEAK, budget.share >> 2) and budget.pending < budget.peak >> 2)
        ) and now - budget.trimmed_at >= TRIM_INTERVAL:
            self.trim_heap(now)
