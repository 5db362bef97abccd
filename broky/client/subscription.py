"""A subscription's local end: a bounded queue, an async iterator, or a callback.

Deliveries arrive on the connection's reader (inside `data_received`); they
must never block it. So each subscription has a bounded pending queue
(`max_pending_msgs` messages and `max_pending_bytes` payload bytes). Flow
control: once the queue is full the subscription *pauses* the connections
that carry it (the client sends Pause on each: the server keeps their
deliveries under its own bound, `Welcome.max_pending_bytes`, and counts and
tells what does not fit), and resumes them (Resume) once the consumer has
taken the queue down to half. Deliveries already on their way when it paused
still go into the queue (the server stops sending at the Pause, so that is
bounded by what it had queued for the connection and the sockets' buffers);
past `hard_bounds` (a server that does not pause) a message is dropped,
counted in `dropped`, and reported to the client's error callback as a
`SlowConsumerError` (one report per burst of drops, with the count of that
burst). One subscription's full queue pauses its connections for every
subscription they carry.

Three ways to consume:
- iterate: ``async for msg in sub`` (ends when the subscription is closed);
- `await sub.next_msg(timeout)`;
- a callback given to `Client.subscribe`: a plain function is called inline
  by the reader (keep it short); a coroutine function (or an object whose
  `__call__` is one) is awaited by a task of the subscription, one message at
  a time, in order, fed by the bounded queue. A plain callable that returns an
  awaitable (a lambda returning a coroutine) is found out at its first call:
  from then on the subscription treats it as a coroutine function.

A Subscription knows its client only as a `SubscriptionOwner`: where to
report errors, where to count local drops, and how to unsubscribe.

Positions: every delivery carries its position (vbucket, epoch, offset). A
subscription remembers the position of the last message it handed to the
consumer per vbucket (`positions()`: what to persist and pass back as
`since` after a process restart), and, for its Links (broky.client.link),
where it started on each worker (`starts`, the server's clock when its
Subscribe was confirmed) and the positions of the retained messages a start
replayed to it alone (`replayed`): with the Link's own positions that is
what a resume asks for, so that a reconnect loses nothing and repeats nothing
while the worker still retains it.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from broky.client.stats import ClientStats
from broky.errors import BrokyTimeoutError, ClientClosedError, SlowConsumerError
from broky.protocol import Message
from broky.protocol.frames import Position

DEFAULT_MAX_PENDING_MSGS = 65536
DEFAULT_MAX_PENDING_BYTES = 64 << 20
# A paused subscription still queues what was on its way when it paused (what the server
# had queued for the connection, under the server's own bound, and what the sockets
# hold); it drops only past these (a server that does not pause): 8 times its bounds,
# and never less than the defaults.
HARD_FACTOR = 8
# `positions()` keeps the last consumed message per vbucket when its payload is at most
# this many bytes (else only its position): at most 1024 x 4 KiB per subscription.
KEEP_PAYLOAD_BYTES = 4096


def hard_bounds(max_pending_msgs: int, max_pending_bytes: int) -> tuple[int, int]:
    """The queue's limits while its connections are paused: (messages, payload bytes)."""
    return (
        max(HARD_FACTOR * max_pending_msgs, DEFAULT_MAX_PENDING_MSGS),
        max(HARD_FACTOR * max_pending_bytes, DEFAULT_MAX_PENDING_BYTES),
    )


Callback = Callable[[Message], Any]


class SubscriptionOwner(Protocol):
    """What a Subscription needs from its client (`broky.client.client.Client` is one)."""

    stats: ClientStats  # counts `dropped_local`

    def _report(self, exc: BaseException) -> None:
        """Hand an error to the client's `on_error` (a drop, a callback that raised)."""

    def _pause(self, sub: Subscription) -> None:
        """`sub`'s queue is full: pause the connections that carry it."""

    def _resume(self, sub: Subscription) -> None:
        """`sub`'s queue has room again: resume them."""

    async def _unsubscribe(self, sub: Subscription) -> None:
        """Stop `sub` on every worker that has it, then close it."""


class Subscription:
    """Interest in keys matching `pattern` (and only `partition`, if given).

    Created by `Client.subscribe`; not constructed directly. Attributes
    `delivered` (messages handed to the consumer), `dropped` (messages lost
    because the local queue was full) and `pending` are plain counters.
    """

    def __init__(
        self,
        owner: SubscriptionOwner,
        sid: int,
        pattern: bytes,
        partition: bytes | None,
        callback: Callback | None,
        max_pending_msgs: int,
        max_pending_bytes: int,
        since: tuple[Position, ...] = (),
        since_time: int = 0,
        last: int = 0,
    ) -> None:
        if max_pending_msgs < 1 or max_pending_bytes < 1:
            raise ValueError("max_pending_msgs and max_pending_bytes must be positive")
        self._owner = owner
        self.sid = sid
        self.pattern = pattern
        self.partition = partition
        self.max_pending_msgs = max_pending_msgs
        self.max_pending_bytes = max_pending_bytes
        self._hard_msgs, self._hard_bytes = hard_bounds(max_pending_msgs, max_pending_bytes)
        self.delivered = 0
        self.dropped = 0
        self.closed = False
        self._queue: collections.deque[Message] = collections.deque()
        self._queue_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._unreported_drops = 0
        self._paused = False  # its queue filled up: its connections are paused
        self._task: asyncio.Task[None] | None = None
        self._inline: Callback | None = None
        # Where it asked to start (schema/README.md 5.1), for the first Subscribe on each worker.
        self.since = since
        self.since_time = since_time
        self.last = last
        # Per worker (a Link's WorkerRef): ts_broker from which it receives everything (the
        # server's clock when its Subscribe was confirmed), and the positions of the retained
        # messages replayed to it alone: vbucket -> (epoch, offset, ts_broker).
        self.starts: dict[object, int] = {}
        self.replayed: dict[object, dict[int, tuple[int, int, int]]] = {}
        # vbucket -> the last message handed to the consumer (its position: storing the
        # message costs a quarter of building a tuple), or just its Position when its
        # payload is over KEEP_PAYLOAD_BYTES (so at most that much is kept per vbucket)
        self._consumed: dict[int, Message | Position] = {}
        if callback is not None:
            if inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(
                type(callback).__call__  # an object with `async def __call__`
            ):
                self._task = asyncio.get_running_loop().create_task(self._run_callback(callback))
            else:
                self._inline = callback

    def __repr__(self) -> str:
        scope = f" partition={self.partition!r}" if self.partition is not None else ""
        return f"<Subscription sid={self.sid} pattern={self.pattern!r}{scope}>"

    @property
    def pending(self) -> int:
        """Messages received but not yet consumed."""
        return len(self._queue)

    def positions(self) -> list[Position]:
        """Per vbucket, the position of the last message handed to the consumer (by
        `next_msg`, iteration or the callback), in vbucket order: persist them and pass
        them as `since` to a later `subscribe` to go on from there."""
        return [
            Position(m.vbucket, m.epoch, m.offset) if isinstance(m, Message) else m
            for _, m in sorted(self._consumed.items())
        ]

    # ---------------------------------------------------------------- reader side

    def _deliver(self, msg: Message) -> None:
        """Called by the reader for every matching delivery; never blocks."""
        inline = self._inline
        if inline is not None:
            self.delivered += 1
            self._consumed[msg.vbucket] = (
                msg
                if len(msg.payload) <= KEEP_PAYLOAD_BYTES
                else Position(msg.vbucket, msg.epoch, msg.offset)
            )
            try:
                result = inline(msg)
            except Exception as exc:
                self._owner._report(exc)
                return
            if result is not None and inspect.isawaitable(result):
                # it is asynchronous after all: await this result, then queue
                # every later message for a task, as for a coroutine function
                self._inline = None
                self._task = asyncio.get_running_loop().create_task(self._run_callback(inline, result))
            return
        size = len(msg.payload)
        if len(self._queue) >= self.max_pending_msgs or self._queue_bytes + size > self.max_pending_bytes:
            if not self._paused:
                self._paused = True
                self._owner._pause(self)
            if len(self._queue) >= self._hard_msgs or self._queue_bytes + size > self._hard_bytes:
                self._owner._pause(self)  # a connection it was put on since it paused
                self.dropped += 1
                self._owner.stats.dropped_local += 1
                if not self._unreported_drops:
                    asyncio.get_running_loop().call_soon(self._report_drops)
                self._unreported_drops += 1
                return
        self._queue.append(msg)
        self._queue_bytes += size
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _report_drops(self) -> None:
        dropped, self._unreported_drops = self._unreported_drops, 0
        if dropped:
            self._owner._report(SlowConsumerError(self.sid, dropped))

    def _close(self) -> None:
        """No more messages: wake the consumer, stop the callback task."""
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._waiter = None
        if self._task is not None and not self._queue:
            self._task.cancel()

    # ---------------------------------------------------------------- consumer side

    async def next_msg(self, timeout: float | None = None) -> Message:
        """Return the next message.

        Args:
            timeout: seconds to wait; None waits for ever.

        Raises:
            BrokyTimeoutError: no message within `timeout`.
            ClientClosedError: the subscription was unsubscribed or its client closed
                (and every message already received has been consumed).
        """
        while not self._queue:
            if self.closed:
                raise ClientClosedError(f"subscription {self.sid} is closed")
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            except TimeoutError:
                raise BrokyTimeoutError(f"no message within {timeout:g} s") from None
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        msg = self._queue.popleft()
        size = len(msg.payload)
        self._queue_bytes -= size
        self.delivered += 1
        self._consumed[msg.vbucket] = (
            msg if size <= KEEP_PAYLOAD_BYTES else Position(msg.vbucket, msg.epoch, msg.offset)
        )
        if (
            self._paused
            and len(self._queue) <= self.max_pending_msgs // 2
            and self._queue_bytes <= self.max_pending_bytes // 2
        ):
            self._paused = False
            self._owner._resume(self)
        return msg

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.next_msg()
        except ClientClosedError:
            raise StopAsyncIteration from None

    async def _run_callback(self, callback: Callback, first: Awaitable[Any] | None = None) -> None:
        """Await the callback's result for each queued message, one at a time, in order."""
        if first is not None:
            try:
                await first
            except Exception as exc:
                self._owner._report(exc)
        while True:
            try:
                msg = await self.next_msg()
            except ClientClosedError:
                return
            try:
                result = callback(msg)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                self._owner._report(exc)

    async def unsubscribe(self) -> None:
        """Stop the subscription; iteration ends once the queued messages are consumed.

        Raises:
            ClientClosedError: the client is closed.
        """
        if self.closed:
            return
        await self._owner._unsubscribe(self)


__all__ = ["DEFAULT_MAX_PENDING_BYTES", "DEFAULT_MAX_PENDING_MSGS", "Subscription", "hard_bounds"]
