"""How a connection ends: lost, closed for a fatal error, or told Goodbye at shutdown.

Theory of operation
-------------------
Closing: a fatal error writes what the connection still had queued, then the
Error frame, then half-closes (write_eof) and discards further input until the
peer closes or --frame-timeout passes (then the socket is reset). This lingering
close lets the client read the Error even if it had more bytes in flight.
At shutdown every connection gets the same treatment with a Goodbye: what was
queued to it goes first (deliveries kept for a paused connection are dropped),
and the messages it publishes after the Goodbye are counted and dropped
(`discard_after_goodbye`), both under the drop reason `shutdown`.

A connection that is gone (broky.server.shard.core `Shard.lost`: the peer
closed, the network failed, or this worker aborted it) leaves nothing behind:
its subscriptions are removed, its held input and bounded read forgotten, its
charge leaves the memory budget, its account is closed (a client reconnecting
in its place learns from it what it lost: broky.server.accounts), and the
worker tells the master (`on_closed`). That is the core's, as are a fatal
Error (`Shard.fatal`) and the shutdown (`Shard.shutdown`), since each touches
the parts; this part keeps no state of its own, and is a module of functions
the core calls with itself (broky.server.shard.part): the final frame and its
lingering close, the Goodbye, and the counting of what is dropped then.
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING

from broky.errors import RemoteProtocolError
from broky.protocol import Goodbye, LossNotice, LossReason, encode_frame
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.protocol.message import BODY_MESSAGE, body_type
from broky.protocol.table import Buffer
from broky.server.shard.connection import CLOSING, OPEN, Connection
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    from broky.server.shard.part import ShardCore

log = logging.getLogger("broky.worker")

_u32 = struct.Struct("<I").unpack_from


def _is_message(buf: Buffer, pos: int, end: int) -> bool:
    """Whether buf[pos:end] is a Message frame (for counting what is dropped; never raises)."""
    try:
        return body_type(buf, pos, end) == BODY_MESSAGE
    except RemoteProtocolError:
        return False


def goodbye(core: ShardCore, c: Connection, reason: str) -> None:
    """Queued deliveries, then Goodbye, then a lingering close. Deliveries kept for a
    paused connection are dropped, and so are the messages it publishes after the
    Goodbye (`discard_after_goodbye`): both counted as `shutdown`."""
    if c.state != OPEN:
        return
    notice = b""
    if c.paused and c.out:
        kept = count_messages(c.out)
        core.stats.dropped[DropReason.SHUTDOWN] += kept
        c.out.clear()
        c.msgs_out -= kept  # never sent: a drop, and the client is told so
        c.dropped_total += kept
        core.book.commit((c,))
        notice = encode_frame(LossNotice(kept, LossReason.SHUTDOWN))
    c.said_goodbye = True
    final_frame(core, c, notice + encode_frame(Goodbye(reason, c.msgs_in)), keep_rest=True)


def count_messages(chunks: list[bytes | bytearray]) -> int:
    """Messages among the frames queued in chunks (replies are not counted)."""
    n = 0
    for chunk in chunks:
        pos, end = 0, len(chunk)
        while end - pos >= 4:
            stop = pos + 4 + _u32(chunk, pos)[0]
            n += _is_message(chunk, pos, stop)
            pos = stop
    return n


def discard_after_goodbye(core: ShardCore, c: Connection, data: bytes) -> None:
    """Count the messages in input read after the Goodbye (a walk over the size prefixes)."""
    if c.rest:
        data = c.rest + data
    pos, n, count = 0, len(data), 0
    max_frame = core.config.max_frame_bytes
    while n - pos >= 4:
        size = _u32(data, pos)[0]
        if size > max_frame or size < MIN_FRAME_SIZE:
            c.said_goodbye = False  # not frames: nothing further can be counted
            pos = n
            break
        end = pos + 4 + size
        if end > n:
            break
        count += _is_message(data, pos, end)
        pos = end
    c.rest = data[pos:] if pos < n else b""
    if count:
        core.stats.dropped[DropReason.SHUTDOWN] += count


def final_frame(core: ShardCore, c: Connection, frame: bytes, keep_rest: bool = False) -> None:
    """What c still had queued, then `frame`, then a half-close and the lingering close."""
    core.detach(c)
    c.state = CLOSING
    if not keep_rest:
        c.rest = b""
    if c.reads_stopped:  # a lingering close reads until the peer's EOF
        c.reads_stopped = False
        c.transport.resume_reading()
    chunk = b"".join([*c.out, frame])
    c.out.clear()
    c.unflushed = 0
    transport = c.transport
    transport.write(chunk)
    core.stats.bytes_sent += len(chunk)
    try:
        transport.write_eof()
    except (OSError, RuntimeError):
        transport.close()
    c.linger = core.loop.call_later(core.config.frame_timeout, _reset, core, c)


def _reset(core: ShardCore, c: Connection) -> None:
    c.linger = None
    if c.state == CLOSING:
        core.stats.bytes_discarded += c.transport.get_write_buffer_size()
        log.info("connection %d did not close within %.0f s; reset", c.conn_id, core.config.frame_timeout)
        c.transport.abort()


__all__ = ["count_messages", "discard_after_goodbye", "final_frame", "goodbye"]
