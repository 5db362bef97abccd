"""Replies and slow consumers: what the shard does for a client that reads less than it is sent.

The read path (broky.server.shard.core) queues deliveries under each connection's
pending bound and drops what does not fit (`Shard.squeeze`), and tells the
subscriber what it lost (`Shard.reopen`, `Shard.notify_loss`): those are the
core's, on the write path's edge. This part keeps no state of its own (it is
on the connections): a module of functions the core calls with itself
(broky.server.shard.part), that bound the control replies a client leaves
unread (`check_replies`, after a write that carried replies) and close a
connection that stays behind (`watch`, from the core's periodic `tick`).

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
are down to a quarter. The periodic tick (`watch`) closes a connection whose clock
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
from broky.server.shard.connection import OPEN, Connection

if TYPE_CHECKING:
    from broky.server.shard.part import ShardCore

log = logging.getLogger("broky.worker")

_monotonic = time.monotonic
MAX_REPLY_MARKS = 64  # per connection; past it the newest mark moves forward (counts replies longer)


def check_replies(core: ShardCore, c: Connection, buffered: int) -> None:
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
    unread = unread_replies(c, buffered)
    limit = core.config.max_reply_bytes  # at most max_pending_bytes (ServerConfig.from_args)
    if unread > limit:
        stop_reading(core, c)
    elif c.reads_stopped and unread <= limit >> 2:
        read_again(c)


def unread_replies(c: Connection, buffered: int) -> int:
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


def stop_reading(core: ShardCore, c: Connection) -> None:
    """c's unread replies are over the reply bound: read nothing more from it until
    they drain (`check_replies`), so its own sends back up; the slow-consumer clock runs."""
    if c.reads_stopped or c.state != OPEN:
        return
    c.reads_stopped = True
    c.transport.pause_reading()
    core.stats.reads_stopped += 1
    if not c.over_since:
        c.over_since = _monotonic()
    log.debug("connection %d from %s does not read its replies; reading paused", c.conn_id, c.peer)


def read_again(c: Connection) -> None:
    c.reads_stopped = False
    if not c.held:  # held (the restart grace, a sequence on its way): resumed when that ends
        c.transport.resume_reading()
    if not c.dropped:
        c.over_since = 0.0


def watch(core: ShardCore, attention: list[Connection], now: float) -> None:
    """The tick's look at the connections `attention` names (stopped reads, losses to
    tell, over their bound, a frame in pieces: `refresh_pending` found them): replies
    drained, losses told, deadlines passed."""
    config = core.config
    deadline = config.slow_consumer_deadline
    frame_timeout = config.frame_timeout
    for c in attention:
        if c.state != OPEN:
            continue
        if c.reads_stopped:  # its replies may have drained below the high-water mark
            check_replies(core, c, c.transport.get_write_buffer_size())
        if (
            c.dropped
            and not c.paused
            and not c.write_paused
            and c.transport.get_write_buffer_size() <= c.limit >> 2
        ):  # drained without ever reaching the high-water mark (no resume_writing)
            c.base = c.transport.get_write_buffer_size()
            core.notify_loss(c)
        elif (
            c.over_since
            and not c.dropped
            and not c.paused
            and not c.reads_stopped
            and c.transport.get_write_buffer_size() <= c.limit >> 2
        ):  # told already (`reopen`), and drained: its clock stops
            c.over_since = 0.0
        elif c.over_since and now - c.over_since > deadline:
            slow_disconnect(core, c)
        elif c.rest and not c.held and now - c.partial_since > frame_timeout:
            core.fatal(c, ErrorCode.TRUNCATED_FRAME, f"silence inside a frame for {frame_timeout:g} s")


def slow_disconnect(core: ShardCore, c: Connection) -> None:
    """Close c, over its bound for longer than the deadline. Its drops not yet told
    are not told here: they came after every delivery queued to it (`cap`), so a
    client that resumes by positions gets them again from the replay buffer (or is
    told exactly what is gone), and one that does not is told them by the
    connection's account when it reconnects (broky.server.shard.arrivals); the Error's
    message counts them for a client that does neither."""
    core.stats.slow_consumer_disconnects += 1
    config = core.config
    deadline = config.slow_consumer_deadline
    if c.reads_stopped:
        why = f"over {config.max_reply_bytes} bytes of unread replies for more than {deadline:g} s"
    else:
        why = f"over {c.limit} pending bytes for more than {deadline:g} s"
    if c.dropped:
        why += f"; {c.dropped} deliveries dropped since the last LossNotice (told on a resume)"
    core.fatal(c, ErrorCode.SLOW_CONSUMER, why)


__all__ = ["check_replies", "read_again", "slow_disconnect", "stop_reading", "unread_replies", "watch"]
