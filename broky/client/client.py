"""The shard-aware asyncio client.

Theory of operation
-------------------
The first connection says Hello with worker=-1; its Welcome carries the
vbucket map, the worker it landed on and the server's max_frame_bytes. From
then on the client keeps one `Link` per (node, worker) it needs, created
lazily: a Link is the logical connection to one worker and survives
reconnects; under it, a `WorkerProtocol` is one TCP connection.

Publishing: `publish` encodes the Message frame (fast path), checks its size
against max_frame_bytes, picks the Link owning `vbucket_of(key_partition)`
(a 1024-entry route table) and appends the frame to the Link's outbound list.
The fast path does it with one cache lookup per publish: key_partition ->
key -> payload length -> (encoder template, Link), dropped when the map or
max_frame_bytes changes; anything else (a miss, other field types, a uid
given) takes the general path, which fills the cache.
The list is written in one `transport.write` when it reaches `batch_size`
bytes or `linger` seconds later (linger=0: at the next loop iteration, which
already coalesces every publish made in between). While a Link is down its
outbound list is bounded by `max_reconnect_buffer_bytes`; past that,
`publish` raises PublishBufferFullError.

Subscribing: an all-partition subscription goes to every worker of the map
(the Links for all of them are opened then); a partition-scoped one goes to
the owner of its partition. Deliveries carry no sid: each Link has a Matcher
of its subscriptions (cached by key) and hands each delivery to every
subscription whose pattern, and partition if scoped, matches. `subscribe`
waits for a Ping/Pong round trip on every Link that is up (or making its first
attempt), so those workers have the subscription when it returns; a Link that
is down sends it when it reconnects. A worker that refuses it with
SUBSCRIPTION_LIMIT (the connection is at the server's per-connection limits)
is reported to `on_error`, and that Link forgets it (never re-sent, not on a
reconnect nor on a new map); if that happened during `subscribe`, the
subscription is removed everywhere and `subscribe` raises the ServerError.

Reconnecting: when a Link's connection drops (or the server says Goodbye),
the Link reconnects to the same worker with jittered exponential backoff,
re-sends every subscription it carries (same sids), then its buffered
publishes. NOT_MY_VBUCKET makes the client fetch a fresh map (a new Hello)
and move partition-scoped subscriptions to their new owners. A publish the
server refused this way is lost: the Error frame does not say which one, so
it is counted (`stats.misrouted`) and reported to `on_error`. A Link that
fails `max_reconnect_attempts` times in a row gives up: its buffered publishes
are dropped and counted (`stats.unsent_gave_up`), and publishing to it or
flushing raises from then on.

Keepalive: every `ping_interval` a connected Link sends a Ping; if
`max_outstanding_pings` are unanswered when the next is due, it aborts the
connection and reconnects as for any drop. A timer per Link, nothing per
message.

`flush` sends a Ping on every Link and waits for every Pong: the server
answers only after processing every frame received before the Ping. Frames
written to a connection that then drops are gone (only what was still queued
in the client is re-sent), so each Link counts the publishes it wrote to the
current connection and how many the latest Pong confirmed (see `Link`); a drop
turns the difference into "possibly lost" publishes, which the next `flush`
reports by raising BrokyConnectionError.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import struct
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

from broky.client.connection import WorkerProtocol, open_connection, resolve, server_error
from broky.client.encoder import MAX_TEMPLATES, PublishEncoder, as_bytes, payload_bytes
from broky.client.subscription import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_PENDING_MSGS,
    Callback,
    Subscription,
)
from broky.client.url import ServerAddress, parse_server
from broky.errors import (
    AuthenticationError,
    BrokyConnectionError,
    BrokyError,
    BrokyTimeoutError,
    ClientClosedError,
    ErrorCode,
    ProtocolError,
    PublishBufferFullError,
    RemoteProtocolError,
    ServerError,
)
from broky.matching import Matcher, parse_pattern
from broky.protocol import (
    VBUCKETS,
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
    VBucketMap,
    Welcome,
    route_message,
    vbucket_of,
)
from broky.protocol.frames import encode_ping, encode_subscribe, encode_unsubscribe

log = logging.getLogger("broky.client")

DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_LINGER = 0.0
DEFAULT_BATCH_SIZE = 64 << 10
DEFAULT_MAX_RECONNECT_BUFFER_BYTES = 8 << 20
DEFAULT_FLUSH_TIMEOUT = 10.0
DEFAULT_RECONNECT_MIN_DELAY = 0.05
DEFAULT_RECONNECT_MAX_DELAY = 2.0
# A connection that stops answering (a network cut that sends no reset, a
# frozen peer) is noticed by Pings: one every DEFAULT_PING_INTERVAL while
# connected; when DEFAULT_MAX_OUTSTANDING_PINGS are unanswered as the next is
# due, the connection is closed and the normal reconnect follows, so a dead
# link is found within 20-30 s. Why 10 s and not nats.py's 2 minutes: a
# publisher blocked on a dead socket should give up on the scale of the other
# deadlines (flush_timeout 10 s, the server's slow-consumer deadline 10 s),
# and the server answers a Ping right after the frames before it, so 20 s of
# silence is not a busy server. The cost is one small Ping and Pong per
# connection per 10 s, nothing per message.
DEFAULT_PING_INTERVAL = 10.0
DEFAULT_MAX_OUTSTANDING_PINGS = 2

_time_ns = time.time_ns


class WorkerRef(NamedTuple):
    """One worker of one node, as named in callbacks."""

    node_id: str
    worker: int


class ServerInfo(NamedTuple):
    """What the server said about itself in its latest Welcome."""

    node_id: str
    server_version: str | None
    workers: int
    map: VBucketMap
    max_frame_bytes: int
    max_pending_bytes: int


@dataclass
class ClientStats:
    """Plain counters of one client (read them at any time)."""

    published: int = 0
    received: int = 0
    unmatched: int = 0  # deliveries no local subscription matched (e.g. after unsubscribe)
    dropped_local: int = 0  # deliveries dropped because a subscription's queue was full
    server_lost: int = 0  # deliveries the server reported lost (LossNotice)
    misrouted: int = 0  # publishes refused with NOT_MY_VBUCKET and not resent (lost)
    resent: int = 0  # publishes refused with NOT_MY_VBUCKET, then sent to the owner of a fresh map
    refused: int = 0  # publishes refused: reconnect buffer full, or reconnecting given up
    unconfirmed_lost: int = 0  # publishes written to a connection that dropped before a Pong confirmed them
    unsent_gave_up: int = 0  # publishes buffered for a worker when reconnecting to it was given up
    unsent_on_close: int = 0  # publishes still buffered for a down worker at close()
    reconnects: int = 0
    ping_timeouts: int = 0  # connections closed because max_outstanding_pings went unanswered
    errors: int = 0
    map_refreshes: int = 0


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

    def __init__(self, client: Client, node_id: str, worker: int) -> None:
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
            elif err.code == ErrorCode.SUBSCRIPTION_LIMIT and err.sid:
                client._subscription_refused(self, err)
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


class Client:
    """A shard-aware Broky client for asyncio; see `broky.connect`.

    Use `await broky.connect(...)` or ``async with broky.connect(...) as client``.
    Every method must be called from the event loop the client connected on.
    """

    def __init__(
        self,
        server: str | None = None,
        *,
        name: str | None = None,
        auth_token: str | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        linger: float = DEFAULT_LINGER,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_reconnect_buffer_bytes: int = DEFAULT_MAX_RECONNECT_BUFFER_BYTES,
        flush_timeout: float = DEFAULT_FLUSH_TIMEOUT,
        reconnect_min_delay: float = DEFAULT_RECONNECT_MIN_DELAY,
        reconnect_max_delay: float = DEFAULT_RECONNECT_MAX_DELAY,
        max_reconnect_attempts: int | None = None,
        ping_interval: float | None = DEFAULT_PING_INTERVAL,
        max_outstanding_pings: int = DEFAULT_MAX_OUTSTANDING_PINGS,
        on_error: Callable[[BaseException], Any] | None = None,
        on_disconnect: Callable[[WorkerRef, BaseException | None], Any] | None = None,
        on_reconnect: Callable[[WorkerRef], Any] | None = None,
        on_loss: Callable[[WorkerRef, int, int], Any] | None = None,
    ) -> None:
        """Configure a client; `connect()` makes the first connection. See `broky.connect`.

        Raises:
            ValueError: an option is out of range (the message names it), or `server`
                is not a server address.
        """
        _check_options(
            batch_size=batch_size,
            linger=linger,
            connect_timeout=connect_timeout,
            flush_timeout=flush_timeout,
            max_reconnect_buffer_bytes=max_reconnect_buffer_bytes,
            reconnect_min_delay=reconnect_min_delay,
            reconnect_max_delay=reconnect_max_delay,
            max_reconnect_attempts=max_reconnect_attempts,
            ping_interval=ping_interval,
            max_outstanding_pings=max_outstanding_pings,
        )
        self.address: ServerAddress = parse_server(server)
        self.name = name
        self.auth_token = auth_token
        self.connect_timeout = connect_timeout
        self.linger = linger
        self.batch_size = batch_size
        self.max_reconnect_buffer_bytes = max_reconnect_buffer_bytes
        self.flush_timeout = flush_timeout
        self.reconnect_min_delay = reconnect_min_delay
        self.reconnect_max_delay = reconnect_max_delay
        self.max_reconnect_attempts = max_reconnect_attempts
        self.ping_interval = ping_interval
        self.max_outstanding_pings = max_outstanding_pings
        self.on_error = on_error
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.on_loss = on_loss
        self.stats = ClientStats()
        self.server_info: ServerInfo | None = None
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._map: VBucketMap | None = None
        self._max_frame = 0
        self._seed_node = ""
        self._links: dict[WorkerRef, Link] = {}
        self._route: list[Link | None] = [None] * VBUCKETS
        self._subs: dict[int, Subscription] = {}
        self._sub_links: dict[int, list[Link]] = {}
        self._rejected: dict[int, Link] = {}
        # sid -> (the last SUBSCRIPTION_LIMIT Error, the links whose worker refused it)
        self._limited: dict[int, tuple[ServerError, list[Link]]] = {}
        self._next_sid = 0
        self._connected = False
        self._closed = False
        self._open = False  # connected and not closed: the publish fast path's one check
        self._encoder = PublishEncoder()
        self._uids = self._encoder.uids
        # publish's fast path: key_partition -> key -> payload length -> (pack, head, mid, block, Link)
        self._fast: dict[object, dict[object, dict[int, tuple[Any, bytes, bytes, bytes, Link]]]] = {}
        self._fast_count = 0
        self._refreshing: asyncio.Task[None] | None = None
        # publishes refused with NOT_MY_VBUCKET, to resend once the map is fresh: (refused by, frame)
        self._to_resend: list[tuple[Link, bytes]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    def __repr__(self) -> str:
        return f"<broky.Client {self.address} links={list(self._links.values())}>"

    # ---------------------------------------------------------------- lifecycle

    async def connect(self) -> Client:
        """Make the first connection (retrying until connect_timeout) and read the map.

        Returns:
            The client itself.

        Raises:
            BrokyConnectionError: the host name does not resolve, or no Welcome
                from the server within connect_timeout.
            AuthenticationError: the server refused the auth token.
            ServerError: the server refused the Hello for another reason.
            ClientClosedError: the client was closed.
        """
        self._check_open()
        if self._connected:
            return self
        self._loop = asyncio.get_running_loop()
        host, port = self.address
        deadline = self._loop.time() + self.connect_timeout
        delay = self.reconnect_min_delay
        hello = Hello(client_name=self.name, auth_token=self.auth_token)
        last: BrokyError | None = None
        # once: a name that does not resolve is its own failure, not retried
        addresses = await resolve(host, port, self.connect_timeout)
        while True:
            left = deadline - self._loop.time()
            try:
                proto, welcome = await open_connection(host, port, hello, max(left, 0.001), addresses)
                break
            except ServerError:
                raise
            except BrokyError as exc:
                if last is None or not isinstance(exc, BrokyTimeoutError):
                    last = exc  # keep "connection refused" rather than the last short timeout
                left = deadline - self._loop.time()
                if left <= 0:
                    raise BrokyConnectionError(
                        f"cannot connect to {self.address} within {self.connect_timeout:g} s: {last}"
                    ) from None
                await asyncio.sleep(min(random.uniform(delay / 2, delay), left))
                delay = min(delay * 2, self.reconnect_max_delay)
        self._seed_node = welcome.node_id
        self._welcome(welcome)
        link = Link(self, welcome.node_id, welcome.worker)
        self._links[link.ref] = link
        link.attach(proto, welcome, reconnect=False)
        self._connected = True
        self._open = True
        return self

    async def close(self) -> None:
        """Flush what can be flushed (up to flush_timeout), close every connection.

        Publishes still buffered for a worker that is down are dropped and
        counted in `stats.unsent_on_close`. Iterators of subscriptions end
        after the messages already received. Closing twice is harmless.
        """
        if self._closed:
            return
        up = [link for link in self._links.values() if link.proto is not None]
        if up:
            try:
                async with asyncio.timeout(self.flush_timeout):
                    await asyncio.gather(*(link.round_trip(retry=False) for link in up))
            except (TimeoutError, BrokyError) as exc:
                log.warning("close: flush incomplete: %s", exc)
        self._closed = True
        self._open = False
        for link in self._links.values():
            self.stats.unsent_on_close += len(link.out) if link.proto is None else 0
            link.close()
        for sub in self._subs.values():
            sub._close()
        for task in list(self._tasks):
            task.cancel()
        if self._refreshing is not None:
            self._refreshing.cancel()
        self.stats.unsent_on_close += len(self._to_resend)  # refused, waiting for a fresh map
        self._to_resend.clear()
        # let the transports deliver connection_lost
        await asyncio.sleep(0)

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed")

    # ---------------------------------------------------------------- publishing

    def publish_nowait(
        self,
        key_partition: bytes | str,
        key: bytes | str,
        payload: bytes,
        *,
        ts_producer: int | None = None,
        uid: bool | bytes = True,
    ) -> None:
        """Queue one message without awaiting; same arguments and errors as `publish`.

        Unlike `publish` it never yields to the event loop, so a loop of
        publish_nowait calls must await something now and then (the writes
        happen when `batch_size` is reached or when the loop runs).
        """
        # `publish` does all its work before its first await (its awaits only yield
        # to the loop after a batch was written), so running it up to that point is
        # publishing without waiting, on the same fast path.
        coro = self.publish(key_partition, key, payload, ts_producer=ts_producer, uid=uid)
        try:
            coro.send(None)
        except StopIteration:
            return
        coro.close()

    async def publish(
        self,
        key_partition: bytes | str,
        key: bytes | str,
        payload: bytes,
        *,
        ts_producer: int | None = None,
        uid: bool | bytes = True,
    ) -> None:
        """Publish one message to the worker that owns its key_partition.

        The frame is queued and written with others (see `linger` and
        `batch_size`); `flush` tells when the server has processed it. When a
        batch has just been written, `publish` yields to the event loop once
        (or until the socket drains, if its write buffer is over its
        high-water mark), so a tight publish loop cannot starve the readers.

        Args:
            key_partition: chooses the shard; bytes, or str (UTF-8).
            key: matched against subscription patterns; bytes, or str (UTF-8).
            payload: the message body (bytes).
            ts_producer: nanoseconds since the epoch; None = now, 0 = not set.
            uid: True = a new KSUID, False = none, or the 20 bytes to use.

        Raises:
            PayloadTooLargeError: the frame exceeds the server's max_frame_bytes
                (nothing is sent; `size` and `limit` carry the numbers).
            PublishBufferFullError: the owning worker is disconnected and
                `max_reconnect_buffer_bytes` already wait for it (counted in
                `stats.refused`).
            BrokyConnectionError: reconnecting to the owning worker was given up
                (max_reconnect_attempts; counted in `stats.refused`).
            ClientClosedError: the client is closed.
            LocalProtocolError: a field cannot be encoded (wrong type, bad uid).
        """
        # The fast path, inlined: one cached template and Link per (key_partition,
        # key, payload length), then the steps of PublishEncoder.encode and Link.send.
        # Anything unusual (a miss, str fields, wrong types, uid neither True nor 20
        # bytes, closed client, a pack error) takes the general path, which raises
        # the errors. Every path publishes before its first await: `publish_nowait`
        # relies on it.
        try:
            pack, head, mid, block, link = self._fast[key_partition][key][len(payload)]
        except Exception:
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        if not self._open:
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        if uid is True:
            ts = _time_ns()
            seq = self._uids
            if not seq.start <= ts < seq.until:
                seq.roll(ts)
            n = seq.next
            seq.next = n + 1
            pre = seq.pre
        elif isinstance(uid, bytes) and len(uid) == 20:  # e.g. the Spark sink's deterministic uids
            ts = _time_ns() if ts_producer is None else 0
            pre = uid[:12]
            n = int.from_bytes(uid[12:], "little")  # the template packs the last 8 bytes as "<Q"
        else:
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        try:
            frame = pack(head, ts if ts_producer is None else ts_producer, mid, pre, n, block, payload)
        except struct.error:  # e.g. a str payload, a ts_producer out of range
            return await self._publish_general(key_partition, key, payload, ts_producer, uid)
        proto = link.proto
        if proto is None:
            try:
                link.send(frame)
            except BrokyError:  # buffer full, or given up: not published, counted as refused
                self.stats.refused += 1
                raise
            self.stats.published += 1
            return
        self.stats.published += 1
        link.out.append(frame)
        n = link.out_bytes = link.out_bytes + len(frame)
        if n >= self.batch_size:
            link.flush_out()
            # a batch was written: let the loop run once (readers, other tasks),
            # or wait for the socket if its buffer is over the high-water mark
            if proto.write_paused:
                await proto.drain()
            else:
                await asyncio.sleep(0)
        elif link.flush_handle is None:
            link.schedule_flush()

    async def _publish_rows(
        self,
        key_partitions: Sequence[Any],
        keys: Sequence[Any],
        payloads: Sequence[Any],
        ts_producers: Sequence[int | None] | None,
        uid_prefix: bytes | None,
        uid_base: int = 0,
    ) -> None:
        """Publish rows given as columns: row i is (key_partitions[i], keys[i],
        payloads[i], ts_producers[i] or now); the bulk path of the Spark sink.

        The steps of `publish`'s fast path, in one loop, without an await per
        row: it yields only after writing a batch whose socket is over its
        high-water mark. uid_prefix None gives each row a new KSUID; else row i's
        uid is the 12 bytes uid_prefix then uid_base + i as 8 little-endian bytes
        (the Spark sink's deterministic uids). Raises what `publish` raises; the
        rows before the one that raised are published.
        """
        fast = self._fast
        stats = self.stats
        seq = self._uids
        for i in range(len(key_partitions)):
            kp = key_partitions[i]
            key = keys[i]
            payload = payloads[i]
            t = None if ts_producers is None else ts_producers[i]
            try:
                pack, head, mid, block, link = fast[kp][key][len(payload)]
                proto = link.proto
                if proto is None or not self._open:
                    raise LookupError
                if uid_prefix is None:
                    ts = _time_ns()
                    if not seq.start <= ts < seq.until:
                        seq.roll(ts)
                    n = seq.next
                    seq.next = n + 1
                    frame = pack(head, ts if t is None else t, mid, seq.pre, n, block, payload)
                else:
                    n = uid_base + i
                    frame = pack(head, _time_ns() if t is None else t, mid, uid_prefix, n, block, payload)
            except (LookupError, TypeError, struct.error):  # not cached, down, closed, odd types
                uid = True if uid_prefix is None else uid_prefix + (uid_base + i).to_bytes(8, "little")
                written = self._publish(kp, key, payload, t, uid)
                if written is not None and written.proto is not None and written.proto.write_paused:
                    await written.proto.drain()
                continue
            stats.published += 1
            link.out.append(frame)
            size = link.out_bytes = link.out_bytes + len(frame)
            if size >= self.batch_size:
                link.flush_out()
                if proto.write_paused:  # the socket is backed up: wait for it
                    await proto.drain()
            elif link.flush_handle is None:
                link.schedule_flush()

    async def _publish_general(
        self,
        key_partition: bytes | str,
        key: bytes | str,
        payload: bytes,
        ts_producer: int | None,
        uid: bool | bytes,
    ) -> None:
        link = self._publish(key_partition, key, payload, ts_producer, uid)
        if link is None:
            return
        proto = link.proto
        if proto is not None and proto.write_paused:
            await proto.drain()
        else:
            await asyncio.sleep(0)

    def _publish(
        self,
        key_partition: bytes | str,
        key: bytes | str,
        payload: bytes,
        ts_producer: int | None,
        uid: bool | bytes,
    ) -> Link | None:
        """Queue one publish; return its Link if that completed a batch written now."""
        if not self._open:
            self._check_usable()
        kp = key_partition if key_partition.__class__ is bytes else as_bytes(key_partition, "key_partition")
        k = key if key.__class__ is bytes else as_bytes(key, "key")
        if payload.__class__ is not bytes:
            payload = payload_bytes(payload)
        given = isinstance(uid, bytes) and len(uid) == 20
        if uid is True or given:
            encoder = self._encoder
            # PayloadTooLargeError before anything is queued; a shape seen twice gets a template
            if given:
                frame, vb = encoder.encode_any(kp, k, payload, ts_producer, uid)  # type: ignore[arg-type]
            else:
                frame, vb = encoder.encode(kp, k, payload, ts_producer)
            link = self._route[vb] or self._route_slow(vb)
            if encoder.has_template(kp, k, len(payload)):
                self._remember(key_partition, key, kp, k, len(payload), link)
        else:
            frame, vb = self._encoder.encode_any(kp, k, payload, ts_producer, uid or None)
            link = self._route[vb] or self._route_slow(vb)
        try:
            wrote = link.send(frame)
        except BrokyError:  # buffer full, or given up: not published, counted as refused
            self.stats.refused += 1
            raise
        self.stats.published += 1
        return link if wrote else None

    def _remember(
        self, key_partition: object, key: object, kp: bytes, k: bytes, pay_len: int, link: Link
    ) -> None:
        """Cache the template and Link of a publish for `publish`'s fast path.

        Under the bytes fields, and also under the str ones if given as str.
        Dropped whenever a template or the route may change (map, max_frame_bytes).
        """
        if self._fast_count >= MAX_TEMPLATES:
            self._fast.clear()
            self._fast_count = 0
        pack, head, mid, block, _ = self._encoder.template(kp, k, pay_len)
        entry = (pack, head, mid, block, link)
        self._fast.setdefault(kp, {}).setdefault(k, {})[pay_len] = entry
        self._fast_count += 1
        if key_partition.__class__ is str or key.__class__ is str:
            kp_str = key_partition if key_partition.__class__ is str else kp
            k_str = key if key.__class__ is str else k
            self._fast.setdefault(kp_str, {}).setdefault(k_str, {})[pay_len] = entry
            self._fast_count += 1

    def _forget_routes(self) -> None:
        """Drop the fast path's cache (templates and Links)."""
        self._fast.clear()
        self._fast_count = 0

    def _check_usable(self) -> None:
        self._check_open()
        if not self._connected:
            raise BrokyConnectionError("the client is not connected; await connect() first")

    def _send_encoded(self, vb: int, frame: bytes) -> Link | None:
        """Queue an already encoded and size-checked publish (the blocking client's path).

        A refused publish raises and is not counted here: the caller counts it
        (under its own lock; see broky.client.sync).
        """
        link = self._route[vb] or self._route_slow(vb)
        wrote = link.send(frame)
        self.stats.published += 1
        return link if wrote else None

    def _route_slow(self, vb: int) -> Link:
        assert self._map is not None
        node, worker = self._map.owners[vb]
        link = self._link(self._map.nodes[node].node_id, worker)
        self._route[vb] = link
        return link

    def _link(self, node_id: str, worker: int) -> Link:
        ref = WorkerRef(node_id, worker)
        link = self._links.get(ref)
        if link is None:
            link = self._links[ref] = Link(self, node_id, worker)
            link.start(reconnect=False)
        return link

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every worker has processed everything published so far.

        A worker that is disconnected is waited for (it reconnects first, and
        a connection that drops during the flush is waited for again). The
        flush fails if a publish may have been lost: publishes written to a
        connection that dropped before the server confirmed them (a Pong) are
        reported by the next flush, once (see `stats.unconfirmed_lost`).

        Args:
            timeout: seconds; default `flush_timeout`.

        Raises:
            BrokyTimeoutError: not every worker answered in time.
            BrokyConnectionError: since the previous flush, a connection dropped
                with publishes written to it but not confirmed (the message names
                each worker and how many may not have reached the server); or
                reconnecting to a worker was given up (max_reconnect_attempts).
            ClientClosedError: the client is closed.
        """
        self._check_open()
        timeout = self.flush_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                links, results = await self._round_trips()
                # Publishes refused with NOT_MY_VBUCKET came back in the Errors, before
                # the Pongs: once the map is fresh they are sent again; wait for those too.
                while self._to_resend or (self._refreshing is not None and not self._refreshing.done()):
                    if self._refreshing is not None:
                        await asyncio.shield(self._refreshing)
                    links, results = await self._round_trips()
        except TimeoutError:
            down = [link.ref.worker for link in self._links.values() if link.proto is None]
            why = f" (down: workers {down})" if down else ""
            raise BrokyTimeoutError(f"flush did not complete within {timeout:g} s{why}") from None
        problems: list[str] = []
        for link, result in zip(links, results, strict=True):
            unconfirmed, link.unconfirmed = link.unconfirmed, 0
            if unconfirmed:
                problems.append(
                    f"worker {link.ref.worker}: {unconfirmed} publishes may not have reached the server "
                    "(written to a connection that dropped before confirming them)"
                )
            if isinstance(result, BrokyConnectionError):  # given up
                problems.append(str(result))
            elif isinstance(result, BaseException):  # closed meanwhile, or a bug
                raise result
        if problems:
            raise BrokyConnectionError("flush: " + "; ".join(problems))

    async def _round_trips(self) -> tuple[list[Link], list[BaseException | None]]:
        """A round trip on every Link that is up, has something queued, gave up or lost publishes."""
        links = [
            link
            for link in self._links.values()
            if link.proto is not None or link.out or link.failed is not None or link.unconfirmed
        ]
        results = await asyncio.gather(*(link.round_trip() for link in links), return_exceptions=True)
        return links, results

    # ---------------------------------------------------------------- subscribing

    async def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        callback: Callback | None = None,
        max_pending_msgs: int = DEFAULT_MAX_PENDING_MSGS,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> Subscription:
        """Subscribe to keys matching `pattern`.

        Args:
            pattern: dot-separated tokens; `*` = one token, `>` (last) = one or more.
            partition: only messages of this key_partition (sent to its owner
                worker only); None = every partition (sent to every worker).
            callback: called with each Message instead of queueing it for
                iteration; a coroutine function is awaited, one message at a time.
            max_pending_msgs, max_pending_bytes: bound of the local queue;
                overflow is dropped, counted and reported as SlowConsumerError.

        Returns:
            The Subscription, already known to every worker that is connected
            (one round trip; a worker connected for the first time is waited for,
            one attempt). A worker that is down gets it when it reconnects.

        Raises:
            BadPatternError: the pattern is not valid.
            ServerError: a worker refused it with SUBSCRIPTION_LIMIT (this connection
                holds as many subscriptions, or subscription bytes, as the server
                allows); it is then unsubscribed everywhere, and not retried.
            ClientClosedError: the client is closed.
        """
        self._check_open()
        if not self._connected:
            raise BrokyConnectionError("the client is not connected; await connect() first")
        pat = pattern.encode() if isinstance(pattern, str) else bytes(pattern)
        parse_pattern(pat)
        part = partition.encode() if isinstance(partition, str) else partition
        self._next_sid += 1
        sub = Subscription(self, self._next_sid, pat, part, callback, max_pending_msgs, max_pending_bytes)
        self._subs[sub.sid] = sub
        links = self._all_links() if part is None else [self._owner_link(part)]
        self._sub_links[sub.sid] = links
        for link in links:
            link.add_sub(sub)
        try:
            async with asyncio.timeout(self.flush_timeout):
                await asyncio.gather(*(self._confirm(link) for link in links))
        except TimeoutError:
            self._report(
                BrokyTimeoutError(
                    f"{sub!r} not confirmed by every worker within {self.flush_timeout:g} s; "
                    "it is restored on reconnect"
                )
            )
        limited = self._limited.get(sub.sid)
        if limited is not None:
            await self._unsubscribe(sub)
            raise limited[0]
        return sub

    async def _confirm(self, link: Link) -> None:
        """Round trip on `link` if it is connected (or connecting for the first time).

        A link that is down carries the subscription in `subs`, and `attach`
        sends it when it reconnects: nothing to wait for.
        """
        if link.proto is None and link.failed is None and not link.tried.is_set():
            await link.tried.wait()  # a new link's first attempt (connect_timeout at most)
        if link.proto is None:
            return
        with contextlib.suppress(BrokyConnectionError):  # dropped: restored on reconnect
            await link.round_trip(retry=False)

    def _owner_link(self, partition: bytes) -> Link:
        vb = vbucket_of(partition)
        return self._route[vb] or self._route_slow(vb)

    def _all_links(self) -> list[Link]:
        assert self._map is not None
        return [self._link(node.node_id, w) for node in self._map.nodes for w in range(node.workers)]

    async def _unsubscribe(self, sub: Subscription) -> None:
        self._check_open()
        self._subs.pop(sub.sid, None)
        self._rejected.pop(sub.sid, None)
        self._limited.pop(sub.sid, None)
        for link in self._sub_links.pop(sub.sid, []):
            link.remove_sub(sub)
        sub._close()

    # ---------------------------------------------------------------- map

    def _welcome(self, welcome: Welcome) -> None:
        vmap = welcome.map
        self._max_frame = welcome.max_frame_bytes
        if self._encoder.set_limit(welcome.max_frame_bytes):
            self._forget_routes()
        self.server_info = ServerInfo(
            welcome.node_id,
            welcome.server_version,
            sum(n.workers for n in vmap.nodes),
            vmap,
            welcome.max_frame_bytes,
            welcome.max_pending_bytes,
        )
        if self._map is None:
            self._map = vmap
        elif vmap.version != self._map.version:
            self._apply_map(vmap)

    def _address_of(self, node_id: str) -> tuple[str, int]:
        if node_id == self._seed_node or self._map is None:
            return self.address
        for node in self._map.nodes:
            if node.node_id == node_id:
                return node.host, node.port
        return self.address

    def _apply_map(self, vmap: VBucketMap) -> None:
        """Adopt a new map: re-route publishes, move partition-scoped subscriptions."""
        self._map = vmap
        self._route = [None] * VBUCKETS
        self._forget_routes()
        self.stats.map_refreshes += 1
        all_partition = [s for s in self._subs.values() if s.partition is None]
        if all_partition:
            for link in self._all_links():
                for sub in all_partition:
                    if sub.sid not in link.subs and not self._refused_by(sub, link):
                        link.add_sub(sub)
                        self._sub_links[sub.sid].append(link)
        for sub in list(self._subs.values()):
            if sub.partition is None:
                continue
            owner = self._owner_link(sub.partition)
            current = self._sub_links.get(sub.sid, [])
            if current == [owner] or self._refused_by(sub, owner):
                continue
            rejected_by = self._rejected.pop(sub.sid, None)
            if rejected_by is owner:
                self._report(
                    BrokyError(f"{sub!r}: worker {owner.ref.worker} refuses it but owns it per the map")
                )
                continue
            for link in current:
                link.remove_sub(sub)
            owner.add_sub(sub)
            self._sub_links[sub.sid] = [owner]

    def _subscription_refused(self, link: Link, err: ServerError) -> None:
        """A worker refused a subscription with SUBSCRIPTION_LIMIT: forget it on that
        link, so that neither a reconnect nor a new map sends it there again."""
        sub = self._subs.get(err.sid)
        if sub is None:
            return
        link.remove_sub(sub, tell_server=False)
        links = self._sub_links.get(sub.sid, [])
        if link in links:
            links.remove(link)
        refused_by = self._limited[sub.sid][1] if sub.sid in self._limited else []
        if link not in refused_by:
            refused_by.append(link)
        self._limited[sub.sid] = (err, refused_by)

    def _refused_by(self, sub: Subscription, link: Link) -> bool:
        limited = self._limited.get(sub.sid)
        return limited is not None and link in limited[1]

    def _not_my_vbucket(self, link: Link, err: ServerError, refused: bytes | None) -> None:
        """A worker refused a subscription or a publish: fetch the map, then move the
        subscription; a publish comes back in the Error and is sent again then."""
        if err.sid:
            sub = self._subs.get(err.sid)
            if sub is not None:
                link.remove_sub(sub, tell_server=False)
                self._sub_links[sub.sid] = []
                self._rejected[sub.sid] = link
        elif refused is not None:
            self._to_resend.append((link, refused))
        else:  # a server that does not return the refused frame
            self.stats.misrouted += 1
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = self._loop.create_task(self._refresh_map())

    async def _refresh_map(self) -> None:
        host, port = self._address_of(self._seed_node)
        hello = Hello(client_name=self.name, auth_token=self.auth_token)
        try:
            proto, welcome = await open_connection(host, port, hello, self.connect_timeout)
        except BrokyError as exc:
            self._report(BrokyConnectionError(f"cannot refresh the vbucket map: {exc}"))
            self._resend_refused(refresh_failed=True)
            return
        proto.close()
        self._welcome(welcome)
        self._apply_map(welcome.map)
        self._resend_refused()

    def _resend_refused(self, refresh_failed: bool = False) -> None:
        """Send the publishes refused with NOT_MY_VBUCKET to their owner in the fresh map.

        In publish order per refusing worker (the Errors came in that order), after
        anything published since to the new owner: order per key_partition holds
        except across a map change. A publish the fresh map still routes to the
        worker that refused it (or with no map) is dropped, counted in
        `stats.misrouted` and reported.
        """
        pending, self._to_resend = self._to_resend, []
        for refused_by, frame in pending:
            try:
                kp = route_message(frame, 0, len(frame))[0]
                link = None if refresh_failed else self._owner_link(kp)
            except ProtocolError as exc:  # not a Message frame: the server broke the protocol
                self.stats.misrouted += 1
                self._report(RemoteProtocolError(f"NOT_MY_VBUCKET returned an unreadable frame: {exc}"))
                continue
            if link is None or link is refused_by:
                self.stats.misrouted += 1
                why = "the map could not be refreshed" if link is None else "it owns it per the map"
                self._report(
                    BrokyError(
                        f"worker {refused_by.ref.worker} refused a publish to key_partition {kp!r} "
                        f"and {why}: the message is dropped"
                    )
                )
                continue
            try:
                link.send(frame)
            except BrokyError as exc:  # the owner is down and its buffer is full, or given up
                self.stats.refused += 1
                self._report(exc)
                continue
            self.stats.resent += 1

    # ---------------------------------------------------------------- callbacks

    def _report(self, exc: BaseException) -> None:
        self.stats.errors += 1
        if self.on_error is None:
            log.warning("broky client: %s", exc)
        else:
            self._emit(self.on_error, exc)

    def _emit(self, callback: Callable[..., Any] | None, *args: Any) -> None:
        if callback is None:
            return
        try:
            result = callback(*args)
        except Exception:
            log.exception("broky client: callback %r raised", callback)
            return
        if inspect.isawaitable(result):
            task = self._loop.create_task(_await(result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


def _check_options(
    *,
    batch_size: int,
    linger: float,
    connect_timeout: float,
    flush_timeout: float,
    max_reconnect_buffer_bytes: int,
    reconnect_min_delay: float,
    reconnect_max_delay: float,
    max_reconnect_attempts: int | None,
    ping_interval: float | None,
    max_outstanding_pings: int,
) -> None:
    """Raise ValueError naming the first option out of range (NaN is out of every range)."""
    checks = [
        (batch_size >= 1, f"batch_size must be at least 1 byte, not {batch_size!r}"),
        (linger >= 0, f"linger must be >= 0 seconds, not {linger!r}"),
        (connect_timeout > 0, f"connect_timeout must be > 0 seconds, not {connect_timeout!r}"),
        (flush_timeout > 0, f"flush_timeout must be > 0 seconds, not {flush_timeout!r}"),
        (
            max_reconnect_buffer_bytes >= 0,
            f"max_reconnect_buffer_bytes must be >= 0, not {max_reconnect_buffer_bytes!r}",
        ),
        (reconnect_min_delay > 0, f"reconnect_min_delay must be > 0 seconds, not {reconnect_min_delay!r}"),
        (
            reconnect_max_delay >= reconnect_min_delay,
            f"reconnect_max_delay ({reconnect_max_delay!r}) must be >= reconnect_min_delay "
            f"({reconnect_min_delay!r})",
        ),
        (
            max_reconnect_attempts is None or max_reconnect_attempts >= 1,
            f"max_reconnect_attempts must be None or at least 1, not {max_reconnect_attempts!r}",
        ),
        (
            ping_interval is None or ping_interval > 0,
            f"ping_interval must be None or > 0 seconds, not {ping_interval!r}",
        ),
        (
            max_outstanding_pings >= 1,
            f"max_outstanding_pings must be at least 1, not {max_outstanding_pings!r}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


async def _await(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception:
        log.exception("broky client: async callback raised")


class Connecting:
    """What `broky.connect` returns: await it, or use it as an async context manager."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def __await__(self) -> Generator[Any, None, Client]:
        return self.client.connect().__await__()

    async def __aenter__(self) -> Client:
        return await self.client.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.client.close()


def connect(server: str | None = None, **options: Any) -> Connecting:
    """Connect to a Broky server (asyncio).

    ``client = await broky.connect(url)`` or ``async with broky.connect(url) as client``.

    Args:
        server: ``broky://host:port`` or ``host:port`` (port 4777 by default);
            None = $BROKY_SERVER or 127.0.0.1:4777.
        name: client name shown by the server's monitoring.
        auth_token: the server's token, if it has one.
        connect_timeout: seconds to keep trying the first connection (default 5),
            and the handshake timeout of every later connection.
        linger: seconds a publish may wait for others to share its write
            (Kafka's linger.ms); 0 (default) = the next event loop iteration.
        batch_size: bytes after which the queued publishes of one worker are
            written at once (Kafka's batch.size), default 64 KiB.
        max_reconnect_buffer_bytes: publishes kept for a disconnected worker
            (default 8 MiB); past it `publish` raises PublishBufferFullError.
        flush_timeout: default timeout of `flush`, of `subscribe`'s confirmation
            and of the flush in `close` (default 10 s).
        reconnect_min_delay, reconnect_max_delay: bounds of the jittered
            exponential backoff between reconnect attempts (0.05 s, 2 s).
        max_reconnect_attempts: give up on a worker after that many failed
            attempts in a row (default None: never); its buffered publishes are
            dropped (`stats.unsent_gave_up`), and `publish` and `flush` raise
            BrokyConnectionError for it from then on.
        ping_interval: seconds between keepalive Pings on each connection
            (default 10; None: no keepalive).
        max_outstanding_pings: a connection with that many Pings unanswered
            when the next is due is closed and reconnected (default 2), so a
            silent network cut is noticed within about
            ping_interval * (max_outstanding_pings + 1) seconds.
        on_error(exc): errors from the server (ServerError), local drops
            (SlowConsumerError), exceptions raised by subscription callbacks.
        on_disconnect(worker_ref, exc): a connection dropped (reconnecting follows).
        on_reconnect(worker_ref): a connection came back, subscriptions restored.
        on_loss(worker_ref, dropped, reason): the server lost deliveries to us.

    Callbacks may be plain functions or coroutine functions.

    Raises:
        ValueError: an option is out of range (at once, not when awaited).

    Raises (when awaited):
        BrokyConnectionError: the host name does not resolve, or no server
            answered within connect_timeout.
        AuthenticationError: wrong or missing auth token.
    """
    return Connecting(Client(server, **options))


__all__ = [
    "AuthenticationError",
    "Client",
    "ClientStats",
    "Connecting",
    "ServerInfo",
    "WorkerRef",
    "connect",
]
