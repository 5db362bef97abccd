"""A thin asyncio Protocol over one TCP connection to one worker.

It cuts each read into frames (size prefix checked against the limit before
anything is buffered, like the codec's `FrameReader`), decodes deliveries on
a fast path (see `data_received`) and every other frame with `decode_frame`,
and hands the results to its owner (a `Link` of the client). It writes each
live delivery's position (epoch, offset, ts_broker per vbucket) into the
owner's lists as it reads it (three stores of values it holds anyway).

Announced deliveries: a Replay frame (schema/README.md 5.1) or a Delivery
frame (5.3, a group member's share) says that the next `messages` Message
frames are for one subscription alone. The WorkerProtocol counts them down
(`announced`) and hands each to the owner's `on_replayed(msg, sid)` or
`on_group(msg, sid, attempt)`: never to `on_message`, and never as a
position of the connection's live stream. A bare delivery pays one test of a
local for this (`if announced:`), as it did for replays alone.
It knows nothing about routing, subscriptions or reconnecting.

Runs: a handler may take the Message frames straight from the received
bytes itself (`attach`'s `on_run`: a bounded read decoded in bulk, see
broky.client.reader's `Reading.batches`). Each read then goes to
`_runs_received`, which hands it to `on_run` from the first whole frame on
and reads only the frames on_run stops at (control frames, a Message in
another layout, a malformed or partial frame) as above; the connections of
other handlers pay one test of an attribute per read for it.

Handshake: `open_connection` resolves the host (`resolve`: awaited on its
own, so a timeout never leaves a half-done lookup behind), connects to its
addresses in order, writes the Hello and waits for the Welcome (or a fatal
Error) within the timeout; from then on frames go to the owner's handlers.
With TLS it first upgrades the connection (`_start_tls`: a plain Hello that
asks for TLS and carries no secret, the server's go-ahead, the TLS
handshake), then sends the Hello inside TLS; the protocol is the same
WorkerProtocol over asyncio's TLS transport (its writes and reads, and so the
compiled publish and read paths, go through the transport either way).

What answers the Hello if not a Broky server is told from its first bytes
(`not_broky`), at once and without a retry (NotBrokyError): an HTTP server
(Broky's own HTTP port says which client port is its server's, in a
`Broky-Client-Port` header), a TLS alert (a port that speaks TLS from its
first byte), or anything else that is not a frame. The checks run only when
the first frame fails to read (a size prefix out of bounds: "HTTP" is one of
1.3 GB), when a read ends inside a frame before the Welcome (a TLS alert
reads as the size prefix of a frame of 192 KiB), or when the connection ends
before a Welcome: the read path pays one test of `self.handler` on a read
that ends inside a frame, nothing on the others. A peer that closes without a byte is no Broky server either
(one always answers a Hello), but may be a proxy or port forward whose server
is starting: NoServerError, retried while the client waits for its server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from broky.client.url import ServerAddress
from broky.errors import (
    AuthenticationError,
    BrokyConnectionError,
    BrokyError,
    BrokyTimeoutError,
    ErrorCode,
    MalformedFrameError,
    NoServerError,
    NotBrokyError,
    NotMyVBucketError,
    ProtocolError,
    RemoteProtocolError,
    ServerError,
    UntrustedCertificateError,
)
from broky.protocol import (
    VBUCKETS,
    Delivery,
    Error,
    Frame,
    Goodbye,
    Hello,
    Message,
    PreviousConnection,
    Replay,
    Welcome,
    decode_frame,
)
from broky.protocol.frames import encode_hello
from broky.protocol.framing import MIN_FRAME_SIZE, check_size
from broky.protocol.layout import (
    FIXED_SIZE,
    HEADER_AT,
    HEADER_SIZE,
    HEADER_UID,
    KEY_UOFFSET_AT,
    PAYLOAD_UOFFSET_AT,
    SIZE_AT,
    STAMP_FIELDS,
    TS_PRODUCER_AT,
    UID_AT,
    UID_SIZE,
    VECTORS_AT,
    read_shape,
    struct_at,
)

if TYPE_CHECKING:
    import ssl

# Inbound frames are deliveries (bounded by the server's max_frame_bytes) and
# control frames; a Welcome with a large map is a few KiB.
INBOUND_MAX_FRAME_BYTES = 64 << 20
# Bytes of the last reads a connection keeps (by reference): what it received just
# before being lost, the deliveries a publisher may send again (its unconfirmed
# tail, a few milliseconds of publishes).
TAIL_BYTES = 1 << 20
WRITE_HIGH_WATER = 1 << 20

_u32 = struct.Struct("<I").unpack_from
# A canonical Message with uid (broky.protocol.layout), from TS_PRODUCER_AT:
# ts_producer, ts_broker, the position (epoch, offset, vbucket), the key and
# payload uoffsets, the uid, the key_partition's length
_uid_fields = struct_at(
    *STAMP_FIELDS,
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (UID_AT, f"{UID_SIZE}s"),
    (VECTORS_AT[True], "I"),
    start=TS_PRODUCER_AT,
).unpack_from
# ... and from f: the size prefix, the fixed header, the key and payload uoffsets
# and the key_partition's length, in one read
_canonical_head = struct_at(
    (SIZE_AT, "I"),
    (HEADER_AT, f"{HEADER_SIZE}s"),
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (VECTORS_AT[True], "I"),
).unpack_from
_FIXED_UID = FIXED_SIZE[True]  # bytes at fixed positions (with a uid): the key_partition follows
_tuple_new = tuple.__new__
SHAPE_CACHE_SIZE = 1024
# (read of every field from TS_PRODUCER_AT, key length, payload length, frame length)
Shape = tuple[Callable[[bytes, int], tuple[Any, ...]], int, int, int]
# What a stranger's answer keeps to be told apart (an HTTP status line and headers).
ANSWER_KEPT = 1024
# The header of an answer of Broky's HTTP port (broky.server.http.server) to bytes that are
# not HTTP: the port of its server's clients.
CLIENT_PORT_HEADER = b"broky-client-port:"
SILENT_CLOSE = (
    "without answering the Hello: no Broky server answers there (a port forward or proxy with no "
    "server behind it closes so, as does a port that speaks TLS from its first byte, such as https)"
)


class Handler(Protocol):
    """What a WorkerProtocol reports to its owner after the handshake."""

    def on_message(self, msg: Message) -> None: ...
    def on_frame(self, frame: Frame) -> None: ...
    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None: ...


def server_error(err: Error) -> ServerError:
    """The exception for an Error frame from the server."""
    text = err.message or ""
    if err.code == ErrorCode.AUTH_FAILED:
        return AuthenticationError(err.code, text)
    if err.code == ErrorCode.NOT_MY_VBUCKET:
        return NotMyVBucketError(err.code, text, map_version=err.map_version, sid=err.sid, rid=err.rid)
    return ServerError(err.code, text, map_version=err.map_version, sid=err.sid, rid=err.rid)


def _tls_alert(data: bytes, pos: int) -> bool:
    """Whether a TLS alert record starts at pos: type 21, version 3.1 to 3.4, length 2. (A
    frame whose size prefix reads so is over 64 KiB, and the first byte of its root offset
    would have to be 2 as well.)"""
    head = data[pos : pos + 5]
    return (
        len(head) == 5
        and head[0] == 0x15
        and head[1] == 0x03
        and 1 <= head[2] <= 4
        and head[3:5] == b"\x00\x02"
    )


def not_broky(host: str, port: int, tls: bool, answered: bytes) -> NotBrokyError:
    """The error for a peer that answered a Hello with `answered`, which is not a Broky
    frame: it names what was reached, from those first bytes."""
    url = ServerAddress(host, port).url(tls)
    if answered.startswith(b"HTTP/"):
        head = answered.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        status = head[0][:60].decode("latin-1")
        client_port = next(
            (
                line[len(CLIENT_PORT_HEADER) :].strip()
                for line in head[1:]
                if line.lower().startswith(CLIENT_PORT_HEADER)
            ),
            b"",
        )
        if client_port.isdigit():
            other = ServerAddress(host, int(client_port)).url(tls)
            return NotBrokyError(
                f"{url} is the HTTP port of a Broky server (metrics, /v1/), not its client port "
                f"(it answered {status!r}): connect to {other}",
                answered[:64],
            )
        return NotBrokyError(
            f"{url} is an HTTP server, not a Broky client port (it answered {status!r})", answered[:64]
        )
    if _tls_alert(answered, 0):  # the peer tried to read the Hello as TLS
        return NotBrokyError(
            f"{url} speaks TLS from its first byte (it answered a TLS alert), not the Broky protocol: "
            "an https port, or a TLS proxy. A Broky server with TLS answers a plain Hello itself "
            "(TLS_REQUIRED), and broky+tls:// reaches it on its client port",
            answered[:64],
        )
    return NotBrokyError(f"{url} is not a Broky client port (it answered {answered[:24]!r})", answered[:64])


class WorkerProtocol(asyncio.Protocol):
    """One connection; the owner is set once the Welcome has arrived."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.handler: Handler | None = None
        self.welcome: asyncio.Future[Welcome] = asyncio.get_running_loop().create_future()
        self.write_paused = False
        self.closed = False
        self.failure: BrokyError | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._partial = b""
        self.max_frame_bytes = INBOUND_MAX_FRAME_BYTES
        self._on_message: Callable[[Message], None] | None = None
        # Positions: per vbucket, the epoch, offset and ts_broker of the last live delivery,
        # in the owner's lists (`attach`); and the Message frames a Replay or a Delivery
        # announced for one subscription (`announced` more of them, for `announced_sid`),
        # handed to `_on_replayed` (attempt 0: a Replay) or `_on_group` (a Delivery's
        # attempt, 1 or more) instead (schema/README.md 5.1, 5.3).
        self.pos_epoch = self.pos_offset = self.pos_ts = [0] * VBUCKETS
        # A handler that takes runs of Message frames from the received bytes itself (a
        # read in bulk, broky.client.reader): `_runs_received` (attach's `on_run`).
        self._on_run: Callable[[bytes, int, int], int] | None = None
        self._on_replayed: Callable[[Message, int], None] | None = None
        self._on_group: Callable[[Message, int, int], None] | None = None
        self.announced = 0
        self.announced_sid = 0
        self.announced_attempt = 0
        self._early: list[Frame] = []  # frames after the Welcome, before `attach`
        # The last reads (data, end of its whole frames), about TAIL_BYTES: if the
        # connection is lost without an account (broky.client.link), the uids of its
        # last deliveries let the client drop the duplicates that resends may cause.
        self.tail: list[tuple[bytes, int]] = []
        self._tail_bytes = 0
        # shapes of deliveries met so far: (size, key offset, payload offset,
        # key_partition length) -> Shape, or None for a shape the fast read skips
        self._shapes: dict[tuple[int, int, int, int], Shape | None] = {}

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        if self._on_run is not None:
            self._runs_received(data)
            return
        # The fast path: frames are cut straight out of `data` (only a partial
        # frame at the end is kept for the next read), and a delivery in the
        # canonical layout with a uid -- what the SDK publishes -- is decoded
        # inline. A delivery of a shape met before (size, offsets, key_partition
        # length: `_shape` checked once that its vectors lie inside the frame, in
        # order) is read with one struct read that also yields its key's and
        # payload's lengths, which must be those of the shape. Any other canonical
        # delivery is read with the same bounds checks as
        # broky.protocol.decode_message, every other frame with decode_frame.
        if self._partial:
            data = self._partial + data
            self._partial = b""
        n = len(data)
        pos = 0
        on_message = self._on_message
        limit = self.max_frame_bytes
        shapes = self._shapes
        pos_epoch, pos_offset, pos_ts = self.pos_epoch, self.pos_offset, self.pos_ts
        vbuckets = VBUCKETS
        announced = self.announced  # kept in step with self.announced
        try:
            while n - pos >= 4:
                if on_message is not None and n - pos >= _FIXED_UID:
                    size, head, key_off, pay_off, kp_len = _canonical_head(data, pos)
                    if head == HEADER_UID:
                        try:
                            shape = shapes[size, key_off, pay_off, kp_len]
                        except KeyError:
                            shape = self._shape(data, pos, size, key_off, pay_off, kp_len)
                        if shape is not None:
                            read, key_len, pay_len, end_at = shape
                            end = pos + end_at
                            if end > n:
                                break
                            ts_p, ts_b, epoch, offset, vb, uid, kp, k_len, key, p_len, payload = read(
                                data, pos + TS_PRODUCER_AT
                            )
                            if k_len == key_len and p_len == pay_len:
                                msg = _tuple_new(
                                    Message, (kp, key, payload, ts_p, ts_b, uid, vb, epoch, offset)
                                )
                                if announced:
                                    self._announced(msg)
                                    announced = self.announced
                                else:
                                    if vb < vbuckets:  # (a u16 may name none: no position then)
                                        pos_epoch[vb] = epoch
                                        pos_offset[vb] = offset
                                        pos_ts[vb] = ts_b
                                    on_message(msg)
                                pos = end
                                continue
                size = _u32(data, pos)[0]
                if size > limit or size < MIN_FRAME_SIZE:
                    check_size(size, limit)
                end = pos + 4 + size
                if end > n:
                    if self.handler is None and not self.welcome.done() and _tls_alert(data, pos):
                        raise MalformedFrameError("a TLS alert")  # (the peer may keep the connection)
                    break
                if (
                    on_message is not None
                    and end - pos >= _FIXED_UID
                    and data.startswith(HEADER_UID, pos + HEADER_AT)
                ):
                    ts_p, ts_b, epoch, offset, vb, key_off, pay_off, uid, kp_len = _uid_fields(
                        data, pos + TS_PRODUCER_AT
                    )
                    kp_stop = pos + _FIXED_UID + kp_len
                    k = pos + KEY_UOFFSET_AT + key_off
                    p = pos + PAYLOAD_UOFFSET_AT + pay_off
                    if kp_stop > end or k + 4 > end or p + 4 > end:
                        raise MalformedFrameError("malformed frame: vector overruns the frame")
                    key_stop = k + 4 + _u32(data, k)[0]
                    pay_stop = p + 4 + _u32(data, p)[0]
                    if key_stop > end or pay_stop > end:
                        raise MalformedFrameError("malformed frame: vector overruns the frame")
                    self._deliver(
                        Message(
                            data[pos + _FIXED_UID : kp_stop],
                            data[k + 4 : key_stop],
                            data[p + 4 : pay_stop],
                            ts_p,
                            ts_b,
                            uid,
                            vb,
                            epoch,
                            offset,
                        ),
                        on_message,
                    )
                    announced = self.announced
                else:
                    frame = decode_frame(data, pos, end)
                    if on_message is not None and isinstance(frame, Message):
                        self._deliver(frame, on_message)
                        announced = self.announced
                    else:
                        self._control(frame)
                        on_message = self._on_message
                        announced = self.announced
                pos = end
        except ProtocolError as exc:
            if self.handler is None and not self.welcome.done():  # the first frame: no Broky answer
                self._fail(NotBrokyError("not a Broky frame", data[:ANSWER_KEPT]))
            else:
                self._fail(exc)
            return
        if pos:  # the tail: whole frames of the last reads, kept by reference (no copy)
            tail = self.tail
            tail.append((data, pos))
            self._tail_bytes += pos
            if self._tail_bytes > TAIL_BYTES and len(tail) > 1:
                self._tail_bytes -= tail.pop(0)[1]
        if pos < n:
            self._partial = data[pos:]

    def _runs_received(self, data: bytes) -> None:
        """data_received for a handler that takes runs of frames itself (attach's `on_run`):
        `on_run(data, pos, end)` takes what it can from pos (whole Message frames) and
        returns where it stopped; the frame there (a control frame, a Message it does not
        read, a partial or malformed one) is read as data_received reads it, and on_run goes
        on after it. Such a connection (a read's) keeps no tail: it is never resumed."""
        if self._partial:
            data = self._partial + data
            self._partial = b""
        n = len(data)
        pos = 0
        on_run = self._on_run
        assert on_run is not None and self.handler is not None
        limit = self.max_frame_bytes
        try:
            while n - pos >= 4:
                pos = on_run(data, pos, n)
                if n - pos < 4:
                    break
                size = _u32(data, pos)[0]
                if size > limit or size < MIN_FRAME_SIZE:
                    check_size(size, limit)
                end = pos + 4 + size
                if end > n:
                    break
                frame = decode_frame(data, pos, end)
                if isinstance(frame, Message):
                    self._deliver(frame, self.handler.on_message)
                else:
                    self._control(frame)
                pos = end
        except ProtocolError as exc:
            self._fail(exc)
            return
        if pos < n:
            self._partial = data[pos:]

    def _shape(
        self, data: bytes, pos: int, size: int, key_off: int, pay_off: int, kp_len: int
    ) -> Shape | None:
        """The Shape of the canonical delivery at pos (cached), or None: a size out of
        bounds, or vectors not in the order key_partition, key, payload inside the
        frame, as broky.protocol.layout.read_shape checks (such frames take the
        checked general read)."""
        end = 4 + size
        shape: Shape | None = None
        v = read_shape(True, size, key_off, pay_off, kp_len)
        if v is not None and MIN_FRAME_SIZE <= size <= self.max_frame_bytes and pos + end <= len(data):
            key_len = _u32(data, pos + v.key_at)[0]
            pay_len = _u32(data, pos + v.payload_at)[0]
            if v.key_at + 4 + key_len <= v.payload_at and v.payload_at + 4 + pay_len <= end:
                fields = struct_at(
                    *STAMP_FIELDS,
                    (UID_AT, f"{UID_SIZE}s"),
                    (v.kp_at + 4, f"{kp_len}s"),
                    (v.key_at, f"I{key_len}s"),
                    (v.payload_at, f"I{pay_len}s"),
                    start=TS_PRODUCER_AT,
                )
                shape = (fields.unpack_from, key_len, pay_len, end)
        if pos + end > len(data):
            return shape  # a partial frame: the bounds of its shape are not known yet
        if len(self._shapes) >= SHAPE_CACHE_SIZE:
            self._shapes.clear()
        self._shapes[size, key_off, pay_off, kp_len] = shape
        return shape

    def _deliver(self, msg: Message, on_message: Callable[[Message], None]) -> None:
        """A delivery read on a general path: to the announcement it belongs to, or live."""
        if self.announced:
            self._announced(msg)
            return
        vb = msg.vbucket
        if vb >= VBUCKETS:  # a position of no vbucket: delivered, as the codec reads it, not kept
            on_message(msg)
            return
        self.pos_epoch[vb] = msg.epoch
        self.pos_offset[vb] = msg.offset
        self.pos_ts[vb] = msg.ts_broker
        on_message(msg)

    def _announced(self, msg: Message) -> None:
        """One of the Message frames a Replay or a Delivery announced: for its subscription
        alone, and not a position of the connection's live stream."""
        self.announced -= 1
        attempt = self.announced_attempt
        if attempt:
            assert self._on_group is not None
            self._on_group(msg, self.announced_sid, attempt)
        else:
            assert self._on_replayed is not None
            self._on_replayed(msg, self.announced_sid)

    def _control(self, frame: Frame) -> None:
        handler = self.handler
        if isinstance(frame, Replay) and frame.sid and self._on_replayed is not None:
            self.announced = frame.messages
            self.announced_sid = frame.sid
            self.announced_attempt = 0
            if handler is not None:  # a start's answer begins (its ts: where its live part starts)
                handler.on_frame(frame)
            return
        if isinstance(frame, Delivery) and self._on_group is not None:
            self.announced = frame.messages
            self.announced_sid = frame.sid
            self.announced_attempt = max(frame.attempt, 1)  # (0 on the wire: the first)
            return
        if handler is not None:
            if isinstance(frame, Message):
                handler.on_message(frame)
            else:
                handler.on_frame(frame)
            return
        # handshake: a Welcome or an Error; after the Welcome, what comes before the owner
        # attaches (the LossNotices of a resumed connection) waits for it
        if self.welcome.done() and not self.welcome.cancelled() and self.welcome.exception() is None:
            self._early.append(frame)
            return
        if isinstance(frame, Welcome):
            if not self.welcome.done():
                self.welcome.set_result(frame)
            return
        if isinstance(frame, Error):
            self._fail(server_error(frame))
            return
        self._fail(RemoteProtocolError(f"expected Welcome, got {type(frame).__name__}"))

    def _fail(self, exc: BrokyError) -> None:
        """The server broke the protocol (or refused us): remember why and close."""
        if self.failure is None:
            self.failure = exc
        if self.handler is None and not self.welcome.done():
            self.welcome.set_exception(exc)
        self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.handler is None and not self.welcome.done():
            # (open_connection names the address in these)
            if self._partial and _tls_alert(self._partial, 0):
                lost: BrokyError = NotBrokyError("a TLS alert", self._partial[:ANSWER_KEPT])
            elif self._partial:  # a frame begun (a server that died while writing it?): transient
                lost = BrokyConnectionError(
                    f"closed the connection in the middle of its answer ({len(self._partial)} bytes)"
                )
            elif exc is None:
                lost = NoServerError(f"closed the connection {SILENT_CLOSE}", refused=False)
            else:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                lost = BrokyConnectionError(f"ended the connection before answering the Hello: {reason}")
            self.welcome.set_exception(lost)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()
        if self.handler is not None:
            self.handler.on_lost(self, self.failure or exc)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # ---------------------------------------------------------------- owner API

    def attach(
        self,
        handler: Handler,
        positions: tuple[list[int], list[int], list[int]] | None = None,
        on_replayed: Callable[[Message, int], None] | None = None,
        on_group: Callable[[Message, int, int], None] | None = None,
        on_run: Callable[[bytes, int, int], int] | None = None,
    ) -> None:
        """Route frames to `handler` from now on (after the Welcome), starting with
        those that arrived between the Welcome and now. `positions`: the lists (epoch,
        offset, ts_broker per vbucket) where each live delivery's position is written;
        `on_replayed(msg, sid)`: takes the deliveries a Replay announces for subscription
        sid (without it, a Replay goes to `on_frame` and its messages to `on_message`);
        `on_group(msg, sid, attempt)`: takes the deliveries a Delivery announces for group
        member sid (likewise without it); `on_run(data, pos, end)`: takes runs of Message
        frames straight from the received bytes (`_runs_received`; not with on_replayed
        or on_group)."""
        if on_run is not None and (on_replayed is not None or on_group is not None):
            raise ValueError("attach: on_run takes every Message frame; not with on_replayed or on_group")
        self.handler = handler
        self._on_run = on_run
        self._on_message = handler.on_message
        if positions is not None:
            self.pos_epoch, self.pos_offset, self.pos_ts = positions
        self._on_replayed = on_replayed
        self._on_group = on_group
        early, self._early = self._early, []
        for frame in early:
            self._control(frame)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is under its high-water mark."""
        if self.write_paused and not self.closed:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def writelines(self, chunks: list[bytes]) -> None:
        """Write `chunks` one after the other, in one system call (writev), without joining them."""
        if self.transport is not None and not self.closed:
            self.transport.writelines(chunks)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _is_numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int, timeout: float) -> list[str]:
    """The numeric addresses of `host`, in getaddrinfo's order (an address is itself).

    `loop.getaddrinfo` is awaited directly, so a timeout cancels it cleanly
    (a name resolved inside `create_connection` and cancelled there can leave
    an exception nobody retrieves under uvloop).

    Raises:
        BrokyConnectionError: the name does not resolve, or not within `timeout` seconds.
    """
    if _is_numeric(host):
        return [host]
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise BrokyConnectionError(f"cannot resolve host {host!r} within {timeout:g} s") from None
    except OSError as exc:  # socket.gaierror
        raise BrokyConnectionError(f"cannot resolve host {host!r}: {exc.strerror or exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise BrokyConnectionError(f"cannot resolve host {host!r}: no address")
    return addresses


async def _start_tls(
    sock: socket.socket, host: str, port: int, hello: Hello, tls: ssl.SSLContext
) -> WorkerProtocol:
    """The TLS upgrade (schema/README.md 2.1) on a connected socket: a plain Hello that
    asks for TLS and carries no secret, the server's go-ahead (a size prefix of 0) or a
    fatal Error, then the TLS handshake; returns the protocol over TLS.

    Raises:
        ServerError: the server refused the Hello (TLS_UNAVAILABLE: it offers no TLS).
        BrokyConnectionError: it answered something else (it does not know Hello.tls:
            an older server), closed, or the TLS handshake failed (e.g. its certificate
            is not trusted).
    """
    import ssl

    loop = asyncio.get_running_loop()
    previous = hello.previous
    plain = Hello(
        protocol_version=hello.protocol_version,
        worker=hello.worker,
        previous=None if previous is None else PreviousConnection(previous.connection_id),
        tls=True,
    )
    url = ServerAddress(host, port).url(tls=True)
    await loop.sock_sendall(sock, encode_hello(plain))
    head = await _recv_exactly(sock, 4, url)
    size = _u32(head)[0]
    if size:  # not the go-ahead: a refusal (a fatal Error), or a server that does not know Hello.tls
        if (
            not MIN_FRAME_SIZE <= size <= 1 << 20
            or head.startswith(b"HTTP")
            or (head[:2] == b"\x15\x03" and 1 <= head[2] <= 4)  # a TLS alert
        ):
            raise not_broky(host, port, True, head + await _recv_some(sock, ANSWER_KEPT))
        try:
            frame = decode_frame(head + await _recv_exactly(sock, size, url))
        except ProtocolError:
            raise not_broky(host, port, True, head) from None
        if isinstance(frame, Error):
            raise server_error(frame)
        if isinstance(frame, Goodbye):
            raise BrokyConnectionError(f"{url} is shutting down: {frame.reason}")
        raise BrokyConnectionError(
            f"{url} does not offer TLS: it answered a Hello asking for TLS with a "
            f"{type(frame).__name__} (a server older than TLS support)"
        )
    try:
        _, proto = await loop.create_connection(WorkerProtocol, sock=sock, ssl=tls, server_hostname=host)
    except ssl.SSLError as exc:
        hint = ""
        if exc.reason in ("WRONG_VERSION_NUMBER", "UNEXPECTED_RECORD", "RECORD_LAYER_FAILURE"):
            hint = f": the server does not speak TLS on this port: use {ServerAddress(host, port).url()}"
        elif exc.reason == "CERTIFICATE_VERIFY_FAILED":
            hint = (
                " (the client does not trust the server's certificate: give its CA, "
                "ssl_context=ssl.create_default_context(cafile=...) or --tls-ca)"
            )
        if exc.reason == "CERTIFICATE_VERIFY_FAILED":
            raise UntrustedCertificateError(f"TLS handshake with {url} failed: {exc}{hint}") from None
        raise BrokyConnectionError(f"TLS handshake with {url} failed: {exc}{hint}") from None
    return proto


async def _recv_exactly(sock: socket.socket, n: int, url: str) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(sock, n - len(data))
        if not chunk:
            if data:
                raise BrokyConnectionError(f"{url} closed the connection in the middle of its answer")
            raise NoServerError(f"{url} closed the connection {SILENT_CLOSE}", refused=False)
        data += chunk
    return data


async def _recv_some(sock: socket.socket, n: int) -> bytes:
    """What the peer sent next (at most n bytes, within 0.2 s), b"" if nothing: more of
    the answer that tells what it is."""
    try:
        async with asyncio.timeout(0.2):
            return await asyncio.get_running_loop().sock_recv(sock, n)
    except (TimeoutError, OSError):
        return b""


async def _connect(address: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket (the TLS upgrade starts on it)."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, (address, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def open_connection(
    host: str,
    port: int,
    hello: Hello,
    timeout: float,
    addresses: Sequence[str] | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[WorkerProtocol, Welcome]:
    """Connect, send Hello and wait for the Welcome.

    Args:
        host, port: the server; `host` is resolved first unless `addresses` are given.
        hello: the Hello to send.
        timeout: seconds for everything (resolving, connecting, the handshake).
        addresses: numeric addresses of `host` (see `resolve`), tried in order.
        tls: TLS with this context (schema/README.md 2.1): the Hello is sent inside TLS.

    Raises:
        BrokyConnectionError: the name did not resolve, the TCP connection failed
            (NoServerError: refused) or it closed during the handshake, or the TLS
            upgrade failed.
        BrokyTimeoutError: no Welcome within `timeout` seconds.
        ServerError: the server answered with an Error (AuthenticationError for AUTH_FAILED;
            TLS_UNAVAILABLE: TLS was asked for, and the server offers none).
    """
    loop = asyncio.get_running_loop()
    proto: WorkerProtocol | None = None
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout):
            if addresses is None:
                addresses = await resolve(host, port, timeout)
            error: OSError | None = None
            refused = 0
            for address in addresses:  # numeric: create_connection resolves nothing
                try:
                    if tls is None:
                        _, proto = await loop.create_connection(WorkerProtocol, address, port)
                    else:
                        sock = await _connect(address, port)
                    break
                except OSError as exc:
                    error = exc
                    refused += isinstance(exc, ConnectionRefusedError)
            if sock is not None and tls is not None:
                proto = await _start_tls(sock, host, port, hello, tls)
                sock = None  # the transport's now
            url = ServerAddress(host, port).url(tls is not None)
            if proto is None:
                reason = (error.strerror or error) if error is not None else "no address"
                message = f"cannot connect to {url}: {reason}"
                if refused and refused == len(addresses):  # every address: nothing listens there
                    raise NoServerError(message)
                raise BrokyConnectionError(message)
            proto.write(encode_hello(hello))
            try:
                welcome = await proto.welcome
            except NotBrokyError as exc:
                if tls is not None:  # inside TLS: a Broky server's go-ahead, then not Broky
                    raise NotBrokyError(
                        f"{url} is not a Broky client port (inside TLS)", exc.answered
                    ) from None
                raise not_broky(host, port, False, exc.answered) from None
            except BrokyConnectionError as exc:  # (the protocol's: closed, or reset)
                if tls is not None:
                    raise BrokyConnectionError(
                        f"{url} closed the TLS connection before its Welcome: with mutual "
                        "TLS, it refused this client's certificate, or the client sent none"
                    ) from None
                if isinstance(exc, NoServerError):
                    raise NoServerError(f"{url} {exc}", refused=exc.refused) from None
                raise BrokyConnectionError(f"{url} {exc}") from None
    except TimeoutError:
        if proto is not None:
            proto.abort()
        if sock is not None:
            sock.close()
        url = ServerAddress(host, port).url(tls is not None)
        raise BrokyTimeoutError(f"no Welcome from {url} within {timeout:g} s") from None
    except BaseException:
        if proto is not None:
            proto.abort()
        if sock is not None:
            sock.close()
        raise
    return proto, welcome
