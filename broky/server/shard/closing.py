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

A connection that is gone (`lost`: the peer closed, the network failed, or
this worker aborted it) leaves nothing behind: its subscriptions are removed,
its charge leaves the memory budget, its account is closed (a client
reconnecting in its place learns from it what it lost: broky.server.accounts),
and the worker tells the master (`on_closed`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from broky.errors import ErrorCode, RemoteProtocolError
from broky.protocol import Goodbye, LossNotice, LossReason, encode_frame
from broky.protocol.frames import error_frame
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.protocol.message import BODY_MESSAGE, body_type
from broky.protocol.table import Buffer
from broky.server.shard.connection import CLOSED, CLOSING, OPEN, Connection
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    from broky.protocol import VBucketMap
    from broky.server.accounts import AccountBook
    from broky.server.config import ServerConfig
    from broky.server.shard.budget import Budget
    from broky.server.shard.grace import Grace
    from broky.server.shard.moves import Handovers
    from broky.server.shard.stats import WorkerStats

log = logging.getLogger("broky.worker")

_u32 = struct.Struct("<I").unpack_from


def _is_message(buf: Buffer, pos: int, end: int) -> bool:
    """Whether buf[pos:end] is a Message frame (for counting what is dropped; never raises)."""
    try:
        return body_type(buf, pos, end) == BODY_MESSAGE
    except RemoteProtocolError:
        return False


class Closing:
    """The Shard's part that ends connections (a mixin of broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        config: ServerConfig
        loop: asyncio.AbstractEventLoop
        book: AccountBook
        map: VBucketMap
        stats: WorkerStats
        conns: dict[int, Connection]
        closing: bool
        grace: Grace
        handover: Handovers
        budget: Budget
        on_closed: Callable[[Connection], object] | None

        def detach(self, c: Connection) -> None: ...
        def end_grace(self, why: str) -> None: ...
        def end_handovers(self, why: str) -> None: ...

    def eof(self, c: Connection) -> bool:
        """The peer half-closed. Returning False lets the transport close."""
        if c.state == OPEN and c.rest:
            self.fatal(c, ErrorCode.TRUNCATED_FRAME, f"end of stream inside a frame ({len(c.rest)} bytes)")
        return False

    def lost(self, c: Connection, exc: Exception | None) -> None:
        if c.state == OPEN and c.paused and c.out:
            kept = self.count_messages(c.out)
            self.stats.dropped[DropReason.SLOW_CONSUMER] += kept
            c.msgs_out -= kept  # queued, never sent: a drop, told on resume (broky.server.accounts)
            c.dropped_total += kept
        c.state = CLOSED
        self.book.close(c)
        if c.held:  # by the restart grace or for a sequence (broky.server.shard.moves)
            c.held = False
            for held in (self.grace.held, self.handover.held):
                if c in held:
                    held.remove(c)
        c.out.clear()
        c.bounded_read = None  # a bounded read in progress ends with it (broky.server.shard.reads)
        self.detach(c)
        if c.linger is not None:
            c.linger.cancel()
            c.linger = None
        self.budget.pending -= c.charged
        c.charged = 0
        if self.conns.pop(c.conn_id, None) is not None:
            self.stats.connections -= 1
            if self.on_closed is not None:
                self.on_closed(c)
        if exc is not None:
            log.debug("connection %d lost: %s", c.conn_id, exc)

    def fatal(self, c: Connection, code: ErrorCode, message: str) -> None:
        """Send a fatal Error, then close c (lingering); one log line."""
        if c.state != OPEN:
            return
        log.warning("connection %d from %s: %s: %s; closing", c.conn_id, c.peer, code.name, message)
        self.stats.count_error(code)
        self.final_frame(c, error_frame(code, message, fatal=True, map_version=self.map.version))

    def goodbye(self, c: Connection, reason: str) -> None:
        """Queued deliveries, then Goodbye, then a lingering close. Deliveries kept for a
        paused connection are dropped, and so are the messages it publishes after the
        Goodbye (`discard_after_goodbye`): both counted as `shutdown`."""
        if c.state != OPEN:
            return
        notice = b""
        if c.paused and c.out:
            kept = self.count_messages(c.out)
            self.stats.dropped[DropReason.SHUTDOWN] += kept
            c.out.clear()
            c.msgs_out -= kept  # never sent: a drop, and the client is told so
            c.dropped_total += kept
            self.book.commit((c,))
            notice = encode_frame(LossNotice(kept, LossReason.SHUTDOWN))
        c.said_goodbye = True
        self.final_frame(c, notice + encode_frame(Goodbye(reason, c.msgs_in)), keep_rest=True)

    def count_messages(self, chunks: list[bytes | bytearray]) -> int:
        """Messages among the frames queued in chunks (replies are not counted)."""
        n = 0
        for chunk in chunks:
            pos, end = 0, len(chunk)
            while end - pos >= 4:
                stop = pos + 4 + _u32(chunk, pos)[0]
                n += _is_message(chunk, pos, stop)
                pos = stop
        return n

    def discard_after_goodbye(self, c: Connection, data: bytes) -> None:
        """Count the messages in input read after the Goodbye (a walk over the size prefixes)."""
        if c.rest:
            data = c.rest + data
        pos, n, count = 0, len(data), 0
        max_frame = self.config.max_frame_bytes
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
            self.stats.dropped[DropReason.SHUTDOWN] += count

    def final_frame(self, c: Connection, frame: bytes, keep_rest: bool = False) -> None:
        self.detach(c)
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
        self.stats.bytes_sent += len(chunk)
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
        c.linger = self.loop.call_later(self.config.frame_timeout, self._reset, c)

    def _reset(self, c: Connection) -> None:
        c.linger = None
        if c.state == CLOSING:
            self.stats.bytes_discarded += c.transport.get_write_buffer_size()
            log.info("connection %d did not close within %.0f s; reset", c.conn_id, self.config.frame_timeout)
            c.transport.abort()

    def shutdown(self) -> None:
        """Goodbye to every connection (then half-close it)."""
        self.closing = True
        self.end_grace("shutdown")  # what was held is routed first, then everyone gets the Goodbye
        self.end_handovers("shutdown")
        for c in list(self.conns.values()):
            self.goodbye(c, "server shutting down")

    def flushed(self) -> bool:
        """True when every connection is closed or has handed its last byte to the kernel."""
        return all(c.state == CLOSED or c.transport.get_write_buffer_size() == 0 for c in self.conns.values())

    def abort_all(self) -> None:
        for c in list(self.conns.values()):
            if c.state != CLOSED:
                self.stats.bytes_discarded += c.transport.get_write_buffer_size()
                c.transport.abort()
