"""The blocking client: `broky.connect_sync`, for scripts and Spark executors.

Theory of operation
-------------------
A SyncClient owns one daemon I/O thread running its own event loop (uvloop
when available) and an asyncio `Client` inside it. Calls from user threads
cross over in two ways:

- `publish` encodes and size-checks the frame in the caller's thread (so
  PayloadTooLargeError is raised at once), appends it to a hand-off list
  under a lock and, if the I/O thread has not been woken yet, wakes it with
  one `call_soon_threadsafe`. The I/O thread moves the whole list into the
  client's per-worker buffers. The caller blocks while the hand-off list is
  over `handoff_bytes` or a socket's write buffer is over its high-water
  mark, so a fast producer cannot grow memory without bound.
- the reconnect buffer bound is also checked in the caller's thread, so
  `publish` raises PublishBufferFullError itself: when the owning Link is
  down (or not opened yet), the caller adds the Link's buffered bytes and the
  bytes handed off for it (`_down_bytes`, per worker); what does not fit
  waits for the Link to come up (its first connection being opened, or a
  reconnect), at most flush_timeout, and is refused after that. The I/O
  thread moves such frames into the Link and takes them off
  `_down_bytes` under the same lock, so the sum is exact. Only a Link that
  drops between the check and the hand-off can make the I/O thread refuse a
  frame; that error is raised by the next `publish` or `flush`. Every refusal
  is counted in `stats.refused` (under the lock: both threads count there).
  While the Link is up this costs two attribute reads per publish.
- every other call (`flush`, `subscribe`, `read`, `close`, ...) runs a
  coroutine on the loop and waits for its result.

Subscriptions deliver into a thread-safe bounded queue (messages and bytes),
the same Inbox (broky.client.inbox) as an asyncio Subscription's, with the
same rule: once full it pauses its connections, and only past its hard
bounds drops, counts and reports to `on_error` (SlowConsumerError).
Callbacks (`on_error`, `on_disconnect`, ...) run in the I/O thread.

A group member's messages (broky.client.groups) are acknowledged from any
thread: `msg.ack()` takes the client's ack lock for a moment, and the first
settlement of a loop iteration wakes the I/O thread (`call_soon_threadsafe`),
which sends them all in one Ack frame per worker, member and kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, overload

from broky.client.client import Client, ServerInfo, WorkerRef
from broky.client.encoder import PublishEncoder, as_bytes, payload_bytes
from broky.client.groups import (
    DEFAULT_ACK_WAIT,
    DEFAULT_BACKOFF,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    GroupMessage,
)
from broky.client.inbox import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_PENDING_MSGS,
    GROUP_MAX_PENDING_MSGS,
    Inbox,
    Lag,
    M,
)
from broky.client.publisher import old_form
from broky.client.reader import PositionLike, ReadResult, ReadVia
from broky.client.subscription import Subscription
from broky.errors import (
    BrokyError,
    BrokyTimeoutError,
    ClientClosedError,
    PublishBufferFullError,
)
from broky.protocol import Message
from broky.protocol.frames import Position

T = TypeVar("T")

DEFAULT_HANDOFF_BYTES = 1 << 20
RESERVE_POLL = 0.005  # seconds between two looks at a down Link that `publish` waits for


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class SyncSubscription(Inbox[M]):
    """A subscription of a SyncClient: a thread-safe bounded queue of Messages.

    Its Inbox (broky.client.inbox) is filled by the I/O thread (the callback of
    an asyncio Subscription that queues nothing itself) and emptied by `next`,
    both under one lock.
    """

    def __init__(
        self,
        client: Client,
        call: Callable[[Coroutine[Any, Any, None]], object],
        max_pending_msgs: int,
        max_pending_bytes: int,
    ) -> None:
        """For `SyncClient.subscribe`: `client` is its asyncio Client, `call` runs a
        coroutine on the client's loop and waits for it (`SyncClient._call`)."""
        super().__init__(max_pending_msgs, max_pending_bytes, client.stats)
        self._client = client
        self._call = call
        self._sub: Subscription[Any] | None = None  # the asyncio Subscription that feeds it (`attach`)
        self._cond = threading.Condition()
        self._waiter = self._cond  # `_put` wakes through it for every message

    def __repr__(self) -> str:
        return f"<SyncSubscription {self._sub!r}>"

    def positions(self) -> list[Position]:
        """Per vbucket, the position of the last message `next` returned, in vbucket
        order: pass them as `since` to a later `subscribe` to go on from there."""
        with self._cond:
            return super().positions()

    @property
    def sid(self) -> int:  # type: ignore[override]
        assert self._sub is not None
        return self._sub.sid

    @property
    def in_flight(self) -> int:
        """A group member with ack: its deliveries not yet acked or nacked (see
        `Subscription.in_flight`)."""
        return 0 if self._sub is None else self._sub.in_flight

    @property
    def lag(self) -> Lag:
        """How far it is behind (see `Subscription.lag`; its local queue is this one)."""
        behind, server_ns, at_ns = (0, 0, 0) if self._sub is None else self._client.lag_of(self._sub)
        with self._cond:
            return self._lag(behind, server_ns, at_ns)

    @property
    def paused_by_server(self) -> bool:
        """A group member with ack that a worker stopped delivering to (max_in_flight):
        see `Subscription.paused_by_server`."""
        return self._sub is not None and self._sub.paused_by_server

    @property
    def lost_by_vbucket(self) -> dict[int, int]:
        """What its starts were told it lost, per vbucket (see `Subscription`)."""
        return {} if self._sub is None else dict(self._sub.lost_by_vbucket)

    def attach(self, sub: Subscription[Any]) -> None:
        """For `SyncClient.subscribe`: the asyncio Subscription whose callback is `push`."""
        self._sub = sub

    def push(self, msg: M) -> None:
        """I/O thread, the callback of the asyncio Subscription (for `SyncClient.subscribe`):
        queue one delivery (see `Inbox._put`: pause once full, drop past the hard bounds)."""
        with self._cond:
            self._put(msg)

    def _wake(self) -> None:
        """Under the lock: a message was queued (`_waiter` is always set: the Condition
        knows whether anyone waits)."""
        self._cond.notify()

    def _pause_connections(self) -> None:
        """I/O thread, under the lock."""
        if self._sub is not None:
            self._client.pause_subscription(self._sub)

    def _resume_connections(self) -> None:
        """Consumer's thread, under the lock: resume in the I/O thread."""
        with contextlib.suppress(RuntimeError):  # the client's loop is closed
            self._client.loop.call_soon_threadsafe(self._resume)

    def _resume(self) -> None:
        """I/O thread: the reader took the queue down to half."""
        if self._sub is not None:
            self._client.resume_subscription(self._sub)

    def _report(self, exc: BaseException) -> None:
        """I/O thread."""
        self._client.report_error(exc)

    def mark_closed(self) -> None:
        """No more messages (unsubscribed, or its SyncClient closed): wake every reader."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def next(self, timeout: float | None = None) -> M:
        """Return the next message, waiting up to `timeout` seconds (None: for ever).

        Raises:
            BrokyTimeoutError: no message within `timeout`.
            ClientClosedError: unsubscribed or client closed, and the queue is empty.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                if self.closed:
                    raise ClientClosedError("the subscription is closed")
                if deadline is None:
                    self._cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BrokyTimeoutError(f"no message within {timeout:g} s")
                    self._cond.wait(left)
            return self._take()

    def iter(self, timeout: float | None = None, count: int | None = None) -> Iterator[M]:
        """Yield messages until none arrives within `timeout`, `count` were yielded, or close."""
        n = 0
        while count is None or n < count:
            try:
                yield self.next(timeout)
            except (BrokyTimeoutError, ClientClosedError):
                return
            n += 1

    def __iter__(self) -> Iterator[M]:
        """Yield messages until the subscription or its client is closed."""
        return self.iter()

    def unsubscribe(self) -> None:
        """Stop the subscription; messages already queued can still be read."""
        if self._sub is not None and not self.closed:
            self._call(self._sub.unsubscribe())
        self.mark_closed()


class SyncClient:
    """A blocking Broky client running its own I/O thread; see `broky.connect_sync`.

    Methods may be called from any thread.
    """

    def __init__(
        self, server: str | None = None, *, handoff_bytes: int = DEFAULT_HANDOFF_BYTES, **options: Any
    ) -> None:
        """Connect; same options as `broky.connect` (see there), plus `handoff_bytes`.

        Raises:
            BrokyConnectionError, AuthenticationError: as `broky.connect`.
        """
        self._client = Client(server, **options)
        # (vbucket, frame, worker if its Link was down at publish time, else None)
        self._handoff: list[tuple[int, bytes, WorkerRef | None]] = []
        self._down_bytes: dict[WorkerRef, int] = {}  # handed off for Links that are down
        self._encoder = PublishEncoder()
        self._handoff_bytes = 0
        self._handoff_limit = handoff_bytes
        self._io_paused = False
        self._scheduled = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._subs: list[SyncSubscription[Any]] = []
        self._closed = False
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._run, name="broky-io", daemon=True)
        self._thread.start()
        try:
            self._call(self._client.connect())
        except BaseException:
            self._stop_thread()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _stop_thread(self) -> None:
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_closed() and not self._thread.is_alive():
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._closed:
            coro.close()
            raise ClientClosedError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---------------------------------------------------------------- publishing

    def publish_many(
        self,
        keys: Sequence[bytes | str],
        payloads: Sequence[bytes],
        *old: Any,
        partitions: Sequence[bytes | str] | None = None,
        ts_producers: Sequence[int | None] | None = None,
    ) -> int:
        """Publish many messages given as columns (see `Client.publish_many`): one
        hand-over to the I/O thread for all of them. Returns the number of messages."""
        if old:  # the deprecated publish_many(key_partitions, keys, payloads)
            keys, payloads, partitions = old_form("publish_many", keys, payloads, old, partitions, 2)
        return self._call(
            self._client.publish_many(keys, payloads, partitions=partitions, ts_producers=ts_producers)
        )

    def publish(
        self,
        key: bytes | str,
        payload: bytes,
        *old: Any,
        partition: bytes | str | None = None,
        ts_producer: int | None = None,
        uid: bool | bytes = True,
    ) -> None:
        """Publish one message under `key` (queued; see `Client.publish` for the arguments:
        the partition defaults to the key; `publish(key_partition, key, payload)` is
        deprecated and warns).

        Raises:
            BadKeyError: the key is empty or has an empty or wildcard token, or the
                partition is empty (nothing sent; a ValueError too).
            PayloadTooLargeError: the frame exceeds the server's limit (nothing sent).
            PublishBufferFullError: the owning worker is down and
                `max_reconnect_buffer_bytes` already wait for it, still after
                waiting up to flush_timeout for it to come up (nothing queued);
                or, rarely, an earlier publish met that in the I/O thread because
                its worker dropped just after it was handed off (raised once).
            BrokyConnectionError: reconnecting to the owning worker was given up.
            ClientClosedError: the client is closed.
            PayloadTypeError: the payload is not bytes-like (a str: encode it; a TypeError too).
            LocalProtocolError: a field cannot be encoded.
        """
        if old:  # the deprecated publish(key_partition, key, payload)
            key, payload, partition = old_form("publish", key, payload, old, partition, 2)
        key_partition = key if partition is None else partition
        if self._closed:
            raise ClientClosedError("the client is closed")
        if key_partition.__class__ is not bytes:
            key_partition = as_bytes(key_partition, "partition")
        if key.__class__ is not bytes:
            key = as_bytes(key, "key")
        if payload.__class__ is not bytes:
            payload = payload_bytes(payload)
        encoder = self._encoder
        with self._cond:
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            encoder.set_limit(self._client.max_frame)
            if uid is True:
                frame, vb = encoder.encode(key_partition, key, payload, ts_producer)
            else:
                frame, vb = encoder.encode_any(key_partition, key, payload, ts_producer, uid or None)
            link = self._client.router.route[vb]
            down = None if link is not None and link.proto is not None else self._reserve(vb, len(frame))
            self._handoff.append((vb, frame, down))
            self._handoff_bytes += len(frame)
            if not self._scheduled:
                self._scheduled = True
                self._loop.call_soon_threadsafe(self._drain)
            while (self._handoff_bytes > self._handoff_limit or self._io_paused) and not self._closed:
                self._cond.wait(1.0)

    def _reserve(self, vb: int, size: int) -> WorkerRef | None:
        """Caller's thread, under the lock: room for `size` bytes for a Link that is down?
        If there is none, wait (the lock released) for the Link to come up or its buffer to
        drain, at most flush_timeout.

        Returns:
            The worker whose `_down_bytes` now include the frame; None if its
            Link turned out to be up.

        Raises:
            PublishBufferFullError, BrokyConnectionError: refused (and counted).
        """
        client = self._client
        vmap = client.router.map
        assert vmap is not None
        node, worker = vmap.owners[vb]
        ref = WorkerRef(vmap.nodes[node].node_id, worker)
        limit = client.max_reconnect_buffer_bytes
        deadline = 0.0
        while True:
            link = client.router.links.get(ref)  # None: not opened yet, it starts down
            if link is not None and link.proto is not None:
                return None
            if link is not None and link.failed is not None:
                client.stats.refused += 1
                raise link.gave_up_error()
            queued = (link.out_bytes if link is not None else 0) + self._down_bytes.get(ref, 0)
            if queued + size <= limit:
                self._down_bytes[ref] = self._down_bytes.get(ref, 0) + size
                return ref
            # Full: wait for the Link to open (the first publishes for a worker open its
            # connection) or come back, at most flush_timeout, as the asyncio `publish` does.
            now = time.monotonic()
            if not deadline:
                deadline = now + client.flush_timeout
                if not self._scheduled:  # let the I/O thread take what waits (and open the Link)
                    self._scheduled = True
                    self._loop.call_soon_threadsafe(self._drain)
            elif now >= deadline or self._closed:
                client.stats.refused += 1
                raise PublishBufferFullError(queued, limit)
            self._cond.wait(min(deadline - now, RESERVE_POLL))

    def _drain(self) -> None:
        """I/O thread: move the hand-off list into the client's buffers."""
        with self._cond:
            items, self._handoff = self._handoff, []
            self._handoff_bytes = 0
            self._scheduled = False
        client = self._client
        paused = None
        for vb, frame, down in items:
            try:
                if down is None:
                    link = client.send_encoded(vb, frame)
                else:
                    with self._cond:  # the Link's out_bytes and _down_bytes change together
                        left = self._down_bytes[down] - len(frame)
                        if left:
                            self._down_bytes[down] = left
                        else:
                            del self._down_bytes[down]
                        link = client.send_encoded(vb, frame)
            except BrokyError as exc:
                with self._cond:
                    client.stats.refused += 1
                    if self._error is None:
                        self._error = exc
                continue
            if link is not None and link.proto is not None and link.proto.write_paused:
                paused = link.proto
        with self._cond:
            self._io_paused = paused is not None
            self._cond.notify_all()
        if paused is not None:
            self._loop.create_task(self._unpause(paused.drain()))

    async def _unpause(self, drained: Coroutine[Any, Any, None]) -> None:
        await drained
        with self._cond:
            self._io_paused = False
            self._cond.notify_all()

    async def _flush(self, timeout: float | None) -> None:
        self._drain()
        await self._client.flush(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Block until the server has processed every message published so far.

        Raises:
            BrokyTimeoutError: not done within `timeout` (default flush_timeout).
            BrokyConnectionError: publishes may have been lost since the previous
                flush (a connection dropped with publishes written to it but not
                confirmed; the message says how many), or reconnecting to a worker
                was given up (see `Client.flush`).
            PublishBufferFullError: an earlier publish could not be queued.
            ClientClosedError: the client is closed.
        """
        self._call(self._flush(timeout))
        with self._cond:
            if self._error is not None:
                err, self._error = self._error, None
                raise err

    # ---------------------------------------------------------------- subscribing

    # As `Client.subscribe`'s: a group member's messages are GroupMessages.
    @overload
    def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        since: Iterable[PositionLike] = (),
        since_time: int | float | datetime.datetime | None = None,
        last: int = 0,
        group: None = None,
    ) -> SyncSubscription[Message]: ...

    @overload
    def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        group: str,
        key_shared: bool = False,
        ack: bool = False,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        backoff: Iterable[float] = DEFAULT_BACKOFF,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        dead_letter: bytes | str | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> SyncSubscription[GroupMessage]: ...

    @overload
    def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        since: Iterable[PositionLike] = (),
        since_time: int | float | datetime.datetime | None = None,
        last: int = 0,
        group: str | None = None,
        key_shared: bool = False,
        ack: bool = False,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        backoff: Iterable[float] = DEFAULT_BACKOFF,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        dead_letter: bytes | str | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> SyncSubscription[Any]: ...

    def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        since: Iterable[PositionLike] = (),
        since_time: int | float | datetime.datetime | None = None,
        last: int = 0,
        group: str | None = None,
        key_shared: bool = False,
        ack: bool = False,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        backoff: Iterable[float] = DEFAULT_BACKOFF,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        dead_letter: bytes | str | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> SyncSubscription[Any]:
        """Subscribe (see `Client.subscribe`, and its `since`, `since_time` and `last`,
        and `group` and its settings for a consumer group member); read with
        `next(timeout)` or iterate. A member's messages are acked from any thread.

        Raises:
            BadPatternError: the pattern is not valid.
            ValueError: an argument is out of range (see `Client.subscribe`).
            ServerError: a worker refused it (SUBSCRIPTION_LIMIT, BAD_GROUP).
            ClientClosedError: the client is closed.
        """
        if max_pending_msgs is None:  # as Client.subscribe chooses it
            max_pending_msgs = DEFAULT_MAX_PENDING_MSGS if group is None else GROUP_MAX_PENDING_MSGS
        sync_sub: SyncSubscription[Any] = SyncSubscription(
            self._client, self._call, max_pending_msgs, max_pending_bytes
        )
        sub = self._call(
            self._client.subscribe(
                pattern,
                partition=partition,
                callback=sync_sub.push,
                since=since,
                since_time=since_time,
                last=last,
                group=group,
                key_shared=key_shared,
                ack=ack,
                ack_wait=ack_wait,
                max_deliveries=max_deliveries,
                backoff=backoff,
                max_in_flight=max_in_flight,
                max_in_flight_bytes=max_in_flight_bytes,
                dead_letter=dead_letter,
                drain_timeout=drain_timeout,
            )
        )
        sync_sub.attach(sub)
        self._subs.append(sync_sub)
        return sync_sub

    # ---------------------------------------------------------------- bounded reads

    def read(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        start: Iterable[PositionLike] | None = None,
        start_time: int = 0,
        stop: Iterable[PositionLike] | None = None,
        vbuckets: Iterable[int] | None = None,
        via: Mapping[int, ReadVia] | None = None,
        timeout: float | None = None,
    ) -> ReadResult:
        """Read the retained messages of a closed range (see `Client.read`; `vbuckets`: only
        those; `via`: workers to ask first): every message, then where each vbucket's range
        ended. Raises as `Client.read`."""

        async def whole() -> ReadResult:
            reading = self._client.read(
                pattern,
                partition=partition,
                start=start,
                start_time=start_time,
                stop=stop,
                vbuckets=vbuckets,
                via=via,
                timeout=timeout,
            )
            return await reading

        return self._call(whole())

    def positions(
        self,
        *,
        partition: bytes | str | None = None,
        vbuckets: Iterable[int] | None = None,
        timeout: float | None = None,
    ) -> tuple[Position, ...]:
        """Where every vbucket stands now (see `Client.positions`)."""
        return self._call(self._client.positions(partition=partition, vbuckets=vbuckets, timeout=timeout))

    # ---------------------------------------------------------------- state

    @property
    def stats(self) -> Any:
        """The underlying client's counters (ClientStats)."""
        return self._client.stats

    @property
    def server_info(self) -> ServerInfo | None:
        return self._client.server_info

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def _close(self) -> None:
        self._drain()
        await self._client.close()

    def close(self) -> None:
        """Flush (up to flush_timeout), close the connections, stop the I/O thread."""
        if self._closed:
            return
        try:
            self._call(self._close())
        finally:
            for sub in self._subs:
                sub.mark_closed()
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._stop_thread()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def connect_sync(server: str | None = None, **options: Any) -> SyncClient:
    """Connect a blocking client; same arguments as `broky.connect`.

    ``with broky.connect_sync("127.0.0.1:4777", name="job") as c: c.publish(key, payload); c.flush()``

    Raises:
        BrokyConnectionError: no server answered within connect_timeout.
        AuthenticationError: wrong or missing auth token.
    """
    return SyncClient(server, **options)


__all__ = ["SyncClient", "SyncSubscription", "connect_sync"]
