"""A subscription's bounded queue of received messages, and when it pauses its connections.

One policy for both kinds of subscription: the asyncio `Subscription`
(broky.client.subscription) and the blocking client's `SyncSubscription`
(broky.client.sync) are Inboxes. The Inbox owns the queue, its bounds and
counters, and decides; the subclass knows how to act (how a consumer waits,
how its connections are paused, where an error goes) and, in the blocking
client, holds the lock: it calls `_put` and `_take` under it.

The rule, on the reader's side (`_put`, for every delivery; never blocks):
- a message that fits (fewer than `max_pending_msgs` queued and at most
  `max_pending_bytes` of payload with it) is queued;
- one that does not: the subscription *pauses* the connections that carry it
  (the client sends Pause on each: the server keeps their deliveries under its
  own bound, `Welcome.max_pending_bytes`, and counts and tells what does not
  fit), and the message is still queued up to `hard_bounds` (deliveries
  already on their way when it paused: the server stops sending at the Pause,
  so that is bounded by what it had queued for the connection and the
  sockets' buffers);
- past `hard_bounds` (a server that does not pause) the message is dropped,
  counted in `dropped` and in the client's `stats.dropped_local`, the
  connections are paused again (one it was put on since it paused), and the
  drops are reported to the client's error callback as a `SlowConsumerError`:
  one report per burst of drops, with the count of that burst.

On the consumer's side (`_take`): the oldest message, counted in `delivered`
and remembered for `positions()`; once the consumer has taken the queue down
to half of both bounds, the connections are resumed (Resume).

One subscription's full queue pauses its connections for every subscription
they carry.

Cost: the asyncio Subscription's `_deliver`, which its Links call for every
delivery, is `_put` itself, so queueing costs no call of its own; taking a
message costs one call (`_take`). Measured in bench/README.md, "The
subscription queue".
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Generic, NamedTuple

from broky.client.stats import ClientStats
from broky.errors import SlowConsumerError
from broky.protocol import Message
from broky.protocol.frames import Position

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    # What a subscription's messages are: Message, or the GroupMessage of a group member
    # (broky.client.groups); a bare `Subscription` is a Subscription[Message].
    M = TypeVar("M", bound=Message, default=Message)
else:  # (a default is for the type checker alone: 3.11's TypeVar has none)
    from typing import TypeVar

    M = TypeVar("M", bound=Message)

DEFAULT_MAX_PENDING_MSGS = 65536
# A consumer group member's default (broky.client.client, Client.subscribe): the worker sees a
# member's backlog only once its queue is full and its connection paused.
GROUP_MAX_PENDING_MSGS = 1000
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


class Lag(NamedTuple):
    """How far a subscription is behind (`Subscription.lag`).

    messages: those the server owes its connections while they lag (it sends them from its
    replay buffer as they drain; schema/README.md 7, "Lagging"), as of each connection's
    last Pong, plus those received and not consumed yet (`pending`); 0 when it keeps up.
    seconds: how old, by the server's clock, the newest message consumed is (0.0 before
    the first one): about the delivery latency while it keeps up, its delay while it lags.
    """

    messages: int
    seconds: float


class Inbox(Generic[M]):
    """The bounded queue of a subscription (of messages of type M); subclassed by the
    SDK's subscriptions.

    Attributes `delivered` (messages handed to the consumer) and `dropped`
    (messages lost because the queue was full) are plain counters.

    For the SDK's own modules: a subclass provides `sid`, `_wake`,
    `_pause_connections`, `_resume_connections` and `_report`, and calls `_put`
    for every delivery and `_take` for the consumer (the blocking client: both
    under its lock).
    """

    sid: int

    def __init__(self, max_pending_msgs: int, max_pending_bytes: int, stats: ClientStats) -> None:
        """Raises ValueError if a bound is not positive."""
        if max_pending_msgs < 1 or max_pending_bytes < 1:
            raise ValueError("max_pending_msgs and max_pending_bytes must be positive")
        self.max_pending_msgs = max_pending_msgs
        self.max_pending_bytes = max_pending_bytes
        self._hard_msgs, self._hard_bytes = hard_bounds(max_pending_msgs, max_pending_bytes)
        self._stats = stats  # the client's: counts `dropped_local`
        self.delivered = 0
        self.dropped = 0
        self.closed = False
        self._queue: collections.deque[M] = collections.deque()
        self._queue_bytes = 0
        self._unreported_drops = 0
        self._paused = False  # its queue filled up: its connections are paused
        self._waiter: object | None = None  # not None: `_put` calls `_wake` (someone waits)
        # vbucket -> the last message handed to the consumer (its position: storing the
        # message costs a quarter of building a tuple), or just its Position when its
        # payload is over KEEP_PAYLOAD_BYTES (so at most that much is kept per vbucket)
        self._consumed: dict[int, Message | Position] = {}

    @property
    def pending(self) -> int:
        """Messages received but not yet consumed."""
        return len(self._queue)

    def _lag(self, behind: int, server_ns: int, at_ns: int) -> Lag:
        """The lag, given what its connections' last Pongs said: `behind` messages owed, the
        server's clock `server_ns` when this process's monotonic clock read `at_ns`."""
        newest = max((m.ts_broker for m in self._consumed.values() if isinstance(m, Message)), default=0)
        seconds = 0.0
        if newest and server_ns:
            seconds = max(0.0, (server_ns + time.monotonic_ns() - at_ns - newest) / 1e9)
        return Lag(behind + len(self._queue), round(seconds, 6))

    def positions(self) -> list[Position]:
        """Per vbucket, the position of the last message handed to the consumer, in
        vbucket order: persist them and pass them as `since` to a later `subscribe` to
        go on from there."""
        return [
            Position(m.vbucket, m.epoch, m.offset) if isinstance(m, Message) else m
            for _, m in sorted(self._consumed.items())
        ]

    # ---------------------------------------------------------------- reader side

    def _put(self, msg: M) -> None:
        """Queue `msg`, wake the consumer; or pause, or drop (the blocking client: under
        its lock). The asyncio Subscription's Links call it directly (its `deliver`)."""
        size = len(msg.payload)
        queue = self._queue
        if len(queue) < self.max_pending_msgs and self._queue_bytes + size <= self.max_pending_bytes:
            queue.append(msg)
            self._queue_bytes += size
            if self._waiter is not None:
                self._wake()
            return
        self._put_over(msg, size)

    def _put_over(self, msg: M, size: int) -> None:
        """The queue is full: pause the connections that carry the subscription, queue up
        to the hard bounds, drop past them."""
        if not self._paused:
            self._paused = True
            self._pause_connections()
        queue = self._queue
        if len(queue) >= self._hard_msgs or self._queue_bytes + size > self._hard_bytes:
            self._pause_connections()  # a connection it was put on since it paused
            self.dropped += 1
            self._stats.dropped_local += 1
            if not self._unreported_drops:
                asyncio.get_running_loop().call_soon(self._report_drops)
            self._unreported_drops += 1
            return
        queue.append(msg)
        self._queue_bytes += size
        if self._waiter is not None:
            self._wake()

    def _report_drops(self) -> None:
        dropped, self._unreported_drops = self._unreported_drops, 0
        if dropped:
            self._report(SlowConsumerError(self.sid, dropped))

    # ---------------------------------------------------------------- consumer side

    def _take(self) -> M:
        """The oldest queued message (there is one; the blocking client: under its lock),
        counted and remembered for `positions()`; resumes the connections once the queue
        is down to half of both bounds."""
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
            self._resume_connections()
        return msg

    # ---------------------------------------------------------------- what a subclass does

    def _wake(self) -> None:
        """A message was queued and `_waiter` is not None: wake the consumer."""
        raise NotImplementedError

    def _pause_connections(self) -> None:
        """The queue is full: pause the connections that carry the subscription (the
        blocking client: under its lock, in the I/O thread)."""
        raise NotImplementedError

    def _resume_connections(self) -> None:
        """The queue is down to half: resume them (the blocking client: under its lock,
        in the consumer's thread)."""
        raise NotImplementedError

    def _report(self, exc: BaseException) -> None:
        """Hand an error to the client's `on_error`."""
        raise NotImplementedError


__all__ = [
    "Lag",
    "M",
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_MAX_PENDING_MSGS",
    "GROUP_MAX_PENDING_MSGS",
    "HARD_FACTOR",
    "KEEP_PAYLOAD_BYTES",
    "Inbox",
    "hard_bounds",
]
