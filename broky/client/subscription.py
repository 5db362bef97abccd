"""A subscription's local end: a bounded queue, an async iterator, or a callback.

Deliveries arrive on the connection's reader (inside `data_received`); they
must never block it. So each subscription is an Inbox (broky.client.inbox):
a bounded pending queue (`max_pending_msgs` messages and `max_pending_bytes`
payload bytes) that pauses the connections carrying the subscription once it
is full, resumes them once the consumer has taken it down to half, and drops,
counts and reports (`SlowConsumerError`) only past its `hard_bounds`: the
rule is written there, once, for this class and the blocking client's.

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
report errors, where to count local drops, how to pause and resume its
connections, and how to unsubscribe. Its Links call `deliver`, the
SubscriptionTable `mark_closed` (for the SDK's own modules, not for users).

Positions: every delivery carries its position (vbucket, epoch, offset). A
subscription remembers the position of the last message it handed to the
consumer per vbucket (`positions()`: what to persist and pass back as
`since` after a process restart), and, for its Links (broky.client.link),
where it started on each worker (`starts`, the server's clock when its
Subscribe was confirmed) and the positions of the retained messages a start
replayed to it alone (`replayed`): with the Link's own positions that is
what a resume asks for, so that a reconnect loses nothing and repeats nothing
while the worker still retains it.

Groups (broky.client.groups): a subscription made with a group is a member
(`group`: its settings); its deliveries are GroupMessages, queued like any
other. `in_flight` counts those of an ack member not yet settled by the
application, and `paused_by_server` says whether a worker holds its
deliveries back (it reached max_in_flight there: GroupNotice PAUSED, until
RESUMED), per worker in `paused_on`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from broky.client.groups import GroupSpec
from broky.client.inbox import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_PENDING_MSGS,
    KEEP_PAYLOAD_BYTES,
    Inbox,
    Lag,
    M,
    hard_bounds,
)
from broky.client.stats import ClientStats
from broky.errors import BrokyTimeoutError, ClientClosedError
from broky.protocol import Message
from broky.protocol.frames import Position

Callback = Callable[[Message], Any]


class SubscriptionOwner(Protocol):
    """What a Subscription needs from its client (`broky.client.client.Client` is one)."""

    stats: ClientStats  # counts `dropped_local`

    def report_error(self, exc: BaseException) -> None:
        """Hand an error to the client's `on_error` (a drop, a callback that raised)."""

    def pause_subscription(self, sub: Subscription[Any]) -> None:
        """`sub`'s queue is full: pause the connections that carry it."""

    def resume_subscription(self, sub: Subscription[Any]) -> None:
        """`sub`'s queue has room again: resume them."""

    def lag_of(self, sub: Subscription[Any]) -> tuple[int, int, int]:
        """What the last Pongs of `sub`'s connections said: messages they are owed while
        they lag, the newest server clock (ns), and this process's monotonic clock then."""

    async def remove_subscription(self, sub: Subscription[Any]) -> None:
        """Stop `sub` on every worker that has it, then close it."""


class Subscription(Inbox[M]):
    """Interest in keys matching `pattern` (and only `partition`, if given).

    Created by `Client.subscribe`; not constructed directly. Attributes
    `delivered` (messages handed to the consumer), `dropped` (messages lost
    because the local queue was full), `pending` and, for a group member with
    ack, `in_flight` are plain counters; `lost_by_vbucket` maps a vbucket to
    the messages a start of this subscription (its first, or a resume's) was
    told it lost there (EVICTED, SLOW_CONSUMER; not the unknown counts). Its
    messages are Messages, a group member's GroupMessages (a
    `Subscription[GroupMessage]`).
    """

    # (dropped, reason) of the LossNotices naming it (`Client.subscribe`'s on_loss); a class
    # default, so that a subscription without one carries no attribute more.
    on_loss: Callable[[int, int], Any] | None = None

    def __init__(
        self,
        owner: SubscriptionOwner,
        sid: int,
        pattern: bytes,
        partition: bytes | None,
        callback: Callable[[M], Any] | None,
        max_pending_msgs: int,
        max_pending_bytes: int,
        since: tuple[Position, ...] = (),
        since_time: int = 0,
        last: int = 0,
        group: GroupSpec | None = None,
    ) -> None:
        super().__init__(max_pending_msgs, max_pending_bytes, owner.stats)
        self._owner = owner
        self.sid = sid
        self.pattern = pattern
        self.partition = partition
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._inline: Callable[[M], Any] | None = None
        # Where it asked to start (schema/README.md 5.1), for the first Subscribe on each worker.
        self.since = since
        self.since_time = since_time
        self.last = last
        # Per worker (a Link's WorkerRef): ts_broker from which it receives everything (the
        # server's clock when its Subscribe was confirmed), and the positions of the retained
        # messages replayed to it alone: vbucket -> (epoch, offset, ts_broker).
        self.starts: dict[object, int] = {}
        self.replayed: dict[object, dict[int, tuple[int, int, int]]] = {}
        self.lost_by_vbucket: dict[int, int] = {}  # what its starts were told it lost, per vbucket
        # A group member's settings; its unsettled deliveries (ack: the sum of its Links'
        # AckLedgers' `open`, under the client's AckBatcher lock); the workers (WorkerRef)
        # that paused it (GroupNotice PAUSED, until RESUMED or the connection is lost).
        self.group = group
        self.in_flight = 0
        self.paused_on: set[object] = set()
        if callback is not None:
            if _is_coroutine_callback(callback):
                self._task = asyncio.get_running_loop().create_task(self._run_callback(callback))
            else:  # an InlineSubscription (see __new__)
                self._inline = callback

    def __new__(
        cls,
        owner: SubscriptionOwner,
        sid: int,
        pattern: bytes,
        partition: bytes | None,
        callback: Callable[[M], Any] | None,
        *args: Any,
        **kwargs: Any,
    ) -> Subscription[M]:
        """A plain callback makes an InlineSubscription: the reader calls it, no queue."""
        if cls is Subscription and callback is not None and not _is_coroutine_callback(callback):
            cls = InlineSubscription
        return super().__new__(cls)

    def __repr__(self) -> str:
        scope = f" partition={self.partition!r}" if self.partition is not None else ""
        member = f" group={self.group.name!r}" if self.group is not None else ""
        return f"<Subscription sid={self.sid} pattern={self.pattern!r}{scope}{member}>"

    @property
    def lag(self) -> Lag:
        """How far it is behind (see `Lag`): messages its connections are owed while they
        lag (as of their last Pong, one every ping_interval) plus its local queue, and the
        age of the newest message consumed."""
        return self._lag(*self._owner.lag_of(self))

    @property
    def paused_by_server(self) -> bool:
        """A group member with ack that a worker stopped delivering to: it holds
        max_in_flight (or max_in_flight_bytes) unsettled deliveries there. Settle some
        (ack, nack) and the worker resumes it; counted in `stats.group_paused`."""
        return bool(self.paused_on)

    def positions(self) -> list[Position]:
        """Per vbucket, the position of the last message handed to the consumer (by
        `next_msg`, iteration or the callback), in vbucket order: persist them and pass
        them as `since` to a later `subscribe` to go on from there (`json.dumps` writes
        each as [vbucket, epoch, offset], and `since` takes `json.loads`'s lists back)."""
        return super().positions()

    # ---------------------------------------------------------------- reader side

    # For the Links (broky.client.link), not for users: called by the reader for every
    # matching delivery; never blocks. The Inbox's `_put` itself, so that queueing costs
    # no call of its own (an InlineSubscription's calls its callback instead).
    deliver = Inbox._put

    def _wake(self) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause_connections(self) -> None:
        self._owner.pause_subscription(self)

    def _resume_connections(self) -> None:
        self._owner.resume_subscription(self)

    def _report(self, exc: BaseException) -> None:
        self._owner.report_error(exc)

    def mark_closed(self) -> None:
        """For the SubscriptionTable, not for users: no more messages; wake the consumer,
        stop the callback task."""
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._waiter = None
        if self._task is not None and not self._queue:
            self._task.cancel()

    # ---------------------------------------------------------------- consumer side

    async def next_msg(self, timeout: float | None = None) -> M:
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
        return self._take()

    def __aiter__(self) -> AsyncIterator[M]:
        return self

    async def __anext__(self) -> M:
        try:
            return await self.next_msg()
        except ClientClosedError:
            raise StopAsyncIteration from None

    async def _run_callback(self, callback: Callable[[M], Any], first: Awaitable[Any] | None = None) -> None:
        """Await the callback's result for each queued message, one at a time, in order."""
        if first is not None:
            try:
                await first
            except Exception as exc:
                self._owner.report_error(exc)
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
                self._owner.report_error(exc)

    async def unsubscribe(self) -> None:
        """Stop the subscription; iteration ends once the queued messages are consumed.

        Raises:
            ClientClosedError: the client is closed.
        """
        if self.closed:
            return
        await self._owner.remove_subscription(self)


class InlineSubscription(Subscription[M]):
    """A Subscription with a plain callback, which the reader calls inline, without a
    queue (`Subscription(...)` with one makes this class). A callback that returns an
    awaitable is found out at its first call: that result is awaited by a task, and every
    later message queued for that task, as for a coroutine function."""

    def deliver(self, msg: M) -> None:
        inline = self._inline
        if inline is None:  # it turned out asynchronous: queued for the task
            self._put(msg)
            return
        self.delivered += 1
        self._consumed[msg.vbucket] = (
            msg if len(msg.payload) <= KEEP_PAYLOAD_BYTES else Position(msg.vbucket, msg.epoch, msg.offset)
        )
        try:
            result = inline(msg)
        except Exception as exc:
            self._owner.report_error(exc)
            return
        if result is not None and inspect.isawaitable(result):
            # it is asynchronous after all: await this result, then queue
            # every later message for a task, as for a coroutine function
            self._inline = None
            self._task = asyncio.get_running_loop().create_task(self._run_callback(inline, result))


def _is_coroutine_callback(callback: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose `async def __call__` is one."""
    return inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(type(callback).__call__)


__all__ = ["DEFAULT_MAX_PENDING_BYTES", "DEFAULT_MAX_PENDING_MSGS", "Subscription", "hard_bounds"]
