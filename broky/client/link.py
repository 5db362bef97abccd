"""The logical connection to one worker: `Link`.

Theory of operation
-------------------
A Link is the logical connection to one worker and survives reconnects;
under it, a `WorkerProtocol` (broky.client.connection) is one TCP
connection. The client opens Links lazily (see broky.client.routing) and
knows each by its `WorkerRef`; a Link knows its client only as a
`LinkOwner`: the options, the loop, the counters and the callbacks.

Outbound: publishes are appended to the Link's outbound list, which is
written in one `transport.write` when it reaches `batch_size` bytes or
`linger` seconds later (linger=0: at the next loop iteration, which already
coalesces every publish made in between). Control frames (Subscribe,
Unsubscribe, Ping) are written at once, after every publish queued before
them, and not at all while the Link is down (it re-sends its subscriptions
when it reconnects). While a Link is down its outbound list is bounded by
`max_reconnect_buffer_bytes`; past that, `send` raises PublishBufferFullError.

Inbound: deliveries carry no sid. Each Link has a Matcher of the
subscriptions it carries (cached by key) and hands each delivery to every
subscription whose pattern, and partition if scoped, matches. Pongs settle
round trips; an Error goes to the client (NOT_MY_VBUCKET to its map
handling); a LossNotice is counted and reported.

Reconnecting: when a Link's connection drops (or the server says Goodbye),
the Link reconnects to the same worker with jittered exponential backoff,
re-sends every subscription it carries (same sids), then its buffered
publishes. A Link that fails `max_reconnect_attempts` times in a row gives
up: its buffered publishes are dropped and counted (`stats.unsent_gave_up`),
and publishing to it or flushing raises from then on.

Keepalive: every `ping_interval` a connected Link sends a Ping; if
`max_outstanding_pings` are unanswered when the next is due, it aborts the
connection and reconnects as for any drop. A timer per Link, nothing per
message.

Delivery accounting (what the client's `flush` can promise): the server
answers a Ping only after processing every frame received before it. Frames
written to a connection that then drops are gone (only what was still queued
in the client is re-sent), so each Link counts the publishes it wrote to the
current connection and how many the latest Pong confirmed (see `Link`); a
drop turns the difference into "possibly lost" publishes, which the next
`flush` reports by raising BrokyConnectionError.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from broky.client.connection import WorkerProtocol, open_connection, server_error
from broky.client.stats import ClientStats
from broky.client.subscription import Subscription
from broky.errors import (
    BrokyConnectionError,
    BrokyError,
    ClientClosedError,
    ErrorCode,
    PublishBufferFullError,
    RemoteProtocolError,
    ServerError,
)
from broky.matching import Matcher
from broky.protocol import (
    Error,
    Frame,
    Goodbye,
    Hello,
    LossNotice,
    Message,
    Ping,
    Pong,
    Subscribe,
    Unsubscribe,
    Welcome,
)
from broky.protocol.frames import encode_ping, encode_subscribe, encode_unsubscribe

log = logging.getLogger("broky.client")


class WorkerRef(NamedTuple):
    """One worker of one node, as named in callbacks."""

    node_id: str
    worker: int


class LinkOwner(Protocol):
    """What a Link needs from its client (`broky.client.client.Client` is one)."""

    # options (see `broky.connect`)
    name: str | None
    auth_token: str | None
    connect_timeout: float
    linger: float
    batch_size: int
    max_reconnect_buffer_bytes: int
    reconnect_min_delay: float
    reconnect_max_delay: float
    max_reconnect_attempts: int | None
    ping_interval: float | None
    max_outstanding_pings: int
    # callbacks, called through `_emit`
    on_disconnect: Callable[[WorkerRef, BaseException | None], Any] | None
    on_reconnect: Callable[[WorkerRef], Any] | None
    on_loss: Callable[[WorkerRef, int, int], Any] | None
    # state
    stats: ClientStats
    _loop: asyncio.AbstractEventLoop
    _closed: bool

    def _address_of(self, node_id: str) -> tuple[str, int]:
        """Where node `node_id` listens."""

    def _welcome(self, welcome: Welcome) -> None:
        """Take in what a Welcome says (the map, max_frame_bytes)."""

    def _not_my_vbucket(self, link: Link, err: ServerError, refused: bytes | None) -> None:
        """`link`'s worker refused a subscription (err.sid) or a publish (`refused`, its frame)."""

    def _report(self, exc: BaseException) -> None:
        """Hand an error to `on_error`."""

    def _emit(self, callback: Callable[..., Any] | None, *args: Any) -> None:
        """Call a user callback (awaited in a task if it returns an awaitable)."""


class Link:
    """The logical connection to one worker; survives reconnects.

    Delivery accounting (what `flush` can promise): `written` counts the
    publishes written to the current connection (counted per write in
    `flush_out`, not per publish; control frames are subtracted there),
    `confirmed` how many of them the latest Pong covers (each Ping remembers
    `written` when it was sent; the server answers a Ping after processing
    every frame before it). When the connection drops, `written - confirmed`
    publishes may or may not have reached the server: they are added to
    `unconfirmed` (and `stats.unconfirmed_lost`), which the next `flush`
    reports as a BrokyConnectionError. Publishes still in `out` are not lost:
    they are sent after the reconnect.
    """

    def __init__(self, client: LinkOwner, node_id: str, worker: int) -> None:
        self.client = client
        self.ref = WorkerRef(node_id, worker)
        self.proto: WorkerProtocol | None = None
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flush_handle: asyncio.Handle | None = None
        self.subs: dict[int, Subscription] = {}
        self.matcher: Matcher[Subscription, tuple[Subscription, ...]] = Matcher(tuple)
        self._matched = self.matcher.cached  # key -> subscriptions, read first by on_message
        # ping id -> (future of the round trip, or None for a keepalive; `written` when sent)
        self.pings: dict[int, tuple[asyncio.Future[None] | None, int]] = {}
        self.next_ping = 0
        self.written = 0
        self.confirmed = 0
        self.unconfirmed = 0
        self.outstanding = 0  # keepalive Pings sent since the last Pong
        self.keepalive: asyncio.TimerHandle | None = None
        self.up = asyncio.Event()
        self.tried = asyncio.Event()  # set once the first connection attempt has ended
        self.task: asyncio.Task[None] | None = None
        self.failed: BrokyConnectionError | None = None

    def __repr__(self) -> str:
        state = "up" if self.proto is not None else "down"
        return f"<Link {self.ref.node_id}/{self.ref.worker} {state}>"

    # ---------------------------------------------------------------- connection state

    def start(self, reconnect: bool) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._connect_loop(reconnect))

    def attach(self, proto: WorkerProtocol, welcome: Welcome, reconnect: bool) -> None:
        client = self.client
        proto.attach(self)
        self.proto = proto
        client._welcome(welcome)
        frames = [encode_subscribe(Subscribe(s.sid, s.pattern, s.partition)) for s in self.subs.values()]
        # a new connection: count from zero (`out` holds publishes only while down)
        self.written = len(self.out)
        self.confirmed = 0
        self.outstanding = 0
        if self.out:
            frames += self.out
            self.out = []
            self.out_bytes = 0
        if frames:
            proto.write(b"".join(frames))
        if client.ping_interval is not None:
            self.keepalive = client._loop.call_later(client.ping_interval, self._keepalive)
        self.up.set()
        self.tried.set()
        if reconnect:
            client.stats.reconnects += 1
            client._emit(client.on_reconnect, self.ref)

    async def _connect_loop(self, reconnect: bool) -> None:
        client = self.client
        delay = client.reconnect_min_delay
        attempts = 0
        last: BaseException | None = None
        while not client._closed:
            host, port = client._address_of(self.ref.node_id)
            hello = Hello(worker=self.ref.worker, client_name=client.name, auth_token=client.auth_token)
            try:
                proto, welcome = await open_connection(host, port, hello, client.connect_timeout)
            except BrokyError as exc:
                last = exc
                self.tried.set()
                if isinstance(exc, ServerError):
                    client._report(exc)
            else:
                if client._closed:
                    proto.abort()
                    return
                self.attach(proto, welcome, reconnect)
                return
            attempts += 1
            limit = client.max_reconnect_attempts
            if limit is not None and attempts >= limit:
                self._give_up(attempts, last)
                return
            await asyncio.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, client.reconnect_max_delay)

    def _give_up(self, attempts: int, last: BaseException | None) -> None:
        dropped = len(self.out)
        self.client.stats.unsent_gave_up += dropped
        self.out = []
        self.out_bytes = 0
        exc = BrokyConnectionError(
            f"gave up on worker {self.ref.worker} after {attempts} attempts ({last}); "
            f"{dropped} buffered publishes dropped"
        )
        self.failed = exc
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        self.pings.clear()
        self.up.set()  # wake round trips; they see `failed`
        self.client._report(exc)

    def gave_up_error(self) -> BrokyConnectionError:
        """A fresh copy of `failed` to raise (re-raising one instance grows its traceback)."""
        assert self.failed is not None
        return BrokyConnectionError(str(self.failed))

    def _keepalive(self) -> None:
        """Timer, every ping_interval while connected: Ping, or drop a connection that stopped answering."""
        self.keepalive = None
        proto = self.proto
        client = self.client
        if proto is None or client.ping_interval is None:
            return
        if self.outstanding >= client.max_outstanding_pings:
            client.stats.ping_timeouts += 1
            proto.failure = BrokyConnectionError(
                f"no Pong from worker {self.ref.worker} to {self.outstanding} Pings in "
                f"{self.outstanding * client.ping_interval:g} s: the connection is stale"
            )
            proto.abort()  # connection_lost -> on_lost -> reconnect
            return
        self.outstanding += 1
        self._send_ping(None)
        self.keepalive = client._loop.call_later(client.ping_interval, self._keepalive)

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        if proto is not self.proto:
            return
        self.proto = None
        self.up.clear()
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None
        unconfirmed = self.written - self.confirmed
        self.written = self.confirmed = 0
        lost = BrokyConnectionError(f"connection to worker {self.ref.worker} lost: {exc or 'closed'}")
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(lost)
        self.pings.clear()
        client = self.client
        if client._closed:
            return
        if isinstance(exc, BrokyError):
            client._report(exc)
        if unconfirmed > 0:
            self.unconfirmed += unconfirmed
            client.stats.unconfirmed_lost += unconfirmed
            client._report(
                BrokyConnectionError(
                    f"connection to worker {self.ref.worker} lost with {unconfirmed} publishes "
                    "written but not confirmed: they may not have reached the server"
                )
            )
        client._emit(client.on_disconnect, self.ref, exc)
        self.start(reconnect=True)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None
        if self.proto is not None:
            self.flush_out()
            self.proto.close()
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(ClientClosedError("the client was closed"))
        self.pings.clear()

    # ---------------------------------------------------------------- outbound

    def send(self, frame: bytes) -> bool:
        """Queue a publish; return True if it completed a batch that was written now.

        Raises:
            PublishBufferFullError: down, and `max_reconnect_buffer_bytes` already wait.
            BrokyConnectionError: reconnecting to this worker was given up.
        """
        n = self.out_bytes + len(frame)
        if self.proto is None:
            if self.failed is not None:
                raise self.gave_up_error()
            limit = self.client.max_reconnect_buffer_bytes
            if n > limit:
                raise PublishBufferFullError(self.out_bytes, limit)
            self.out.append(frame)
            self.out_bytes = n
            return False
        self.out.append(frame)
        self.out_bytes = n
        if n >= self.client.batch_size:
            self.flush_out()
            return True
        if self.flush_handle is None:
            self.schedule_flush()
        return False

    def schedule_flush(self) -> None:
        """Write `out` when the loop next runs, or after `linger` (once per batch, not per publish)."""
        linger = self.client.linger
        loop = self.client._loop
        self.flush_handle = (
            loop.call_soon(self.flush_out) if linger <= 0 else loop.call_later(linger, self.flush_out)
        )

    def flush_out(self, controls: int = 0) -> None:
        """Write `out` in one write; `controls` of its frames are control frames, not publishes."""
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        proto = self.proto
        if proto is None or not self.out:
            return
        out = self.out
        proto.write(out[0] if len(out) == 1 else b"".join(out))
        self.written += len(out) - controls
        self.out = []
        self.out_bytes = 0

    def send_control(self, frame: bytes) -> None:
        """Write a control frame now, after every publish queued before it (nothing while down)."""
        if self.proto is not None:
            self.out.append(frame)
            self.out_bytes += len(frame)
            self.flush_out(1)

    def ping(self) -> asyncio.Future[None]:
        """Send a Ping now; the future is done when its Pong arrives."""
        fut: asyncio.Future[None] = self.client._loop.create_future()
        self._send_ping(fut)
        return fut

    def _send_ping(self, fut: asyncio.Future[None] | None) -> None:
        self.next_ping += 1
        ping_id = self.next_ping
        self.send_control(encode_ping(Ping(ping_id)))
        # after the write: `written` counts every publish sent before this Ping
        self.pings[ping_id] = (fut, self.written)

    async def round_trip(self, retry: bool = True) -> None:
        """Return once the worker has processed every frame sent before now.

        Waits for the connection if it is down. If it drops before the Pong:
        with `retry`, waits for the reconnect and pings again (what the dropped
        connection carried unconfirmed is in `unconfirmed`); else raises.

        Raises:
            BrokyConnectionError: reconnecting was given up; or, without `retry`,
                the connection dropped.
            ClientClosedError: the client was closed.
        """
        while True:
            if self.failed is not None:
                raise self.gave_up_error()
            if self.client._closed:
                raise ClientClosedError("the client is closed")
            await self.up.wait()
            if self.proto is None:
                continue
            try:
                await self.ping()
                return
            except BrokyConnectionError:
                if not retry or self.failed is not None:
                    raise

    # ---------------------------------------------------------------- subscriptions

    def add_sub(self, sub: Subscription) -> None:
        self.subs[sub.sid] = sub
        self.matcher.add(sub.pattern, sub)
        self.send_control(encode_subscribe(Subscribe(sub.sid, sub.pattern, sub.partition)))

    def remove_sub(self, sub: Subscription, tell_server: bool = True) -> None:
        if self.subs.pop(sub.sid, None) is None:
            return
        self.matcher.remove(sub.pattern, sub)
        if tell_server:
            self.send_control(encode_unsubscribe(Unsubscribe(sub.sid)))

    # ---------------------------------------------------------------- inbound (WorkerProtocol handler)

    def on_message(self, msg: Message) -> None:
        stats = self.client.stats
        stats.received += 1
        subs = self._matched.get(msg.key)
        if subs is None:
            subs = self.matcher.match(msg.key)
        if not subs:
            stats.unmatched += 1
            return
        kp = msg.key_partition
        for sub in subs:
            if sub.partition is None or sub.partition == kp:
                sub._deliver(msg)

    def on_frame(self, frame: Frame) -> None:
        client = self.client
        if isinstance(frame, Pong):
            self.outstanding = 0
            entry = self.pings.pop(frame.id, None)
            if entry is not None:
                fut, written = entry
                if written > self.confirmed:
                    self.confirmed = written
                if fut is not None and not fut.done():
                    fut.set_result(None)
        elif isinstance(frame, Error):
            err = server_error(frame)
            if err.code == ErrorCode.NOT_MY_VBUCKET:
                client._not_my_vbucket(self, err, frame.refused)
            client._report(err)
        elif isinstance(frame, LossNotice):
            client.stats.server_lost += frame.dropped
            client._emit(client.on_loss, self.ref, frame.dropped, frame.reason)
        elif isinstance(frame, Goodbye):
            log.info("worker %s says goodbye: %s", self.ref, frame.reason)
        else:
            if self.proto is not None:
                self.proto.failure = RemoteProtocolError(
                    f"unexpected {type(frame).__name__} frame from the server"
                )
                self.proto.abort()


__all__ = ["Link", "LinkOwner", "WorkerRef"]
