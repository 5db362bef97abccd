"""Consumer groups and acknowledgements on the client's side.

Theory of operation
-------------------
A subscription made with `group=` is a member of that group on every worker
it is sent to (schema/README.md 5.3): each worker gives each matching message
to one member, announced by a Delivery frame, which the WorkerProtocol hands
to its Link's `on_group` for that subscription alone (never through the
Link's Matcher, which serves the bare deliveries of plain subscriptions).
`GroupSpec` holds a member's settings, checked once (`group_spec`), and makes
its Subscribe (the same one on every reconnect: a group starts live).

Each group delivery reaches the consumer as a `GroupMessage`: a Message that
also says `delivery_count` (the Delivery's attempt). A member with `ack=True`
must settle each one: `ack()`, `nack(delay)` or, to keep it, `in_progress()`.
They name the message by its position (vbucket, epoch, offset) and go to the
worker it came from, through the Link that brought it.

Who holds what. An `AckLedger` per (Link, ack subscription) holds the
positions of the deliveries received through that Link and not yet settled
by the application (`open`; the sum of their sizes over Links is the
subscription's `in_flight`) and the settlements waiting to be sent, grouped
by (kind, delay). A position is open once however many times it was
delivered (a redelivery after ack_wait while the application still holds
the first copy): settling either copy settles it, and settling a position
that is not open (twice, or after a nack) is a no-op. The client's one
`AckBatcher` owns the lock that guards every ledger and every `in_flight`
(the blocking client's threads settle messages while its I/O thread delivers
more), and sends what waits once per event-loop iteration: one Ack frame per
(Link, sid, kind, delay), at most ACK_POSITIONS positions each.

While a Link is down its ledgers keep their settlements; when it comes back
to the same worker process (the high half of the Welcome's connection_id
names it: schema/README.md 3, 5.4), they are sent after its Subscribes:
that worker still knows the positions (it gave the old connection's
unsettled deliveries to other members, or kept them for this one, and an ack
from any member settles a position the group holds). When it comes back
to another process (the worker or the server restarted), or its node leaves
the map, nobody holds those deliveries any more (`orphan`): an ACK of them,
made while the Link was down or later, is dropped (`stats.acks_dropped`:
the application has the message, nothing is lost), and so is IN_PROGRESS;
a NACK asks for a redelivery nobody can make: each is reported lost then,
once (LossReason.UNACKED_LOST, through `on_loss`, `stats.unacked_lost`).
So UNACKED_LOST counts exactly the messages the application gave back and
will never see again; a message it holds unsettled is not lost (it is in
its hands). What the worker kept for the group and had given nobody yet is
told by the worker's account instead (WORKER_RESTART, schema/README.md 5.4).
An unsubscribed member's ledgers are closed without a loss: its worker
gives what it held to the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from broky.client.stats import ClientStats
from broky.errors import AckError
from broky.protocol import Ack, AckKind, Message, Subscribe
from broky.protocol.frames import Position, encode_ack

# Positions per Ack frame: 24 bytes each, so a frame stays near 24 KiB, far under any
# server's max_frame_bytes; more settlements of one kind go in several frames.
ACK_POSITIONS = 1024
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_I32 = 0x7FFFFFFF  # Ack.delay_ms is an int (-1: the backoff)
DEFAULT_ACK_WAIT = 30.0
DEFAULT_MAX_DELIVERIES = 5
DEFAULT_BACKOFF = (1.0, 5.0, 30.0)
DEFAULT_MAX_IN_FLIGHT = 1000
DEFAULT_MAX_IN_FLIGHT_BYTES = 16 << 20
DEFAULT_DRAIN_TIMEOUT = 10.0

_tuple_new = tuple.__new__


class GroupSpec(NamedTuple):
    """A group member's settings, as its Subscribe carries them (ms where the wire wants ms)."""

    name: str
    key_shared: bool = False
    ack: bool = False
    ack_wait_ms: int = 0
    max_deliveries: int = 0
    backoff_ms: tuple[int, ...] = ()
    max_in_flight: int = 0
    max_in_flight_bytes: int = 0
    dead_letter: bytes | None = None
    drain_timeout_ms: int = 0

    def subscribe(self, sid: int, pattern: bytes, partition: bytes | None) -> Subscribe:
        """The member's Subscribe: the first one and every one after a reconnect (a group
        starts live: no since, since_time or last). The ack settings go only with ack."""
        if not self.ack:
            return Subscribe(sid, pattern, partition, group=self.name, key_shared=self.key_shared)
        return Subscribe(
            sid,
            pattern,
            partition,
            group=self.name,
            key_shared=self.key_shared,
            ack=True,
            ack_wait_ms=self.ack_wait_ms,
            max_deliveries=self.max_deliveries,
            backoff_ms=self.backoff_ms,
            max_in_flight=self.max_in_flight,
            max_in_flight_bytes=self.max_in_flight_bytes,
            dead_letter=self.dead_letter,
            drain_timeout_ms=self.drain_timeout_ms,
        )


def _ms(name: str, seconds: float, low: int = 1, high: int = _U32) -> int:
    """`seconds` as whole ms in low .. high, else ValueError naming `name`."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ValueError(f"{name} must be a number of seconds, not {seconds!r}")
    ms = round(seconds * 1000)
    if not low <= ms <= high:
        least = "at least 0.001 s" if low else ">= 0"
        raise ValueError(f"{name} must be {least} and at most {high // 1000:,} s, not {seconds!r}")
    return ms


def _whole(name: str, value: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{name} must be a whole number from 1 to {high}, not {value!r}")
    return value


def group_spec(
    group: str | None,
    *,
    key_shared: bool = False,
    ack: bool = False,
    ack_wait: float = DEFAULT_ACK_WAIT,
    max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    backoff: Iterable[float] = DEFAULT_BACKOFF,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
    dead_letter: bytes | str | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    starts_from: bool = False,
) -> GroupSpec | None:
    """The GroupSpec of `subscribe`'s group arguments (None without a group); seconds
    become ms. `starts_from`: the subscription also names since, since_time or last.

    Raises:
        ValueError: a setting out of range, key_shared or ack without a group, or a
            group that would start from positions, a time or the last N (a group
            starts live); the message names the argument.
    """
    if group is None:
        if key_shared or ack:
            raise ValueError("key_shared and ack are settings of a group member: give group=NAME too")
        return None
    if not isinstance(group, str) or not group:
        raise ValueError(f"group must be a non-empty str, not {group!r}")
    if starts_from:
        raise ValueError("a group member starts live: since, since_time and last are not for groups")
    if not ack:
        return GroupSpec(group, bool(key_shared))
    steps = tuple(backoff)
    if not steps:
        raise ValueError("backoff must name at least one delay (seconds; the last one repeats)")
    letter = dead_letter.encode() if isinstance(dead_letter, str) else dead_letter
    if letter is not None and (not isinstance(letter, bytes) or not letter):
        raise ValueError(f"dead_letter must be a non-empty key (str or bytes), not {dead_letter!r}")
    return GroupSpec(
        group,
        bool(key_shared),
        True,
        _ms("ack_wait", ack_wait),
        _whole("max_deliveries", max_deliveries, _U32),
        tuple(_ms("every backoff delay", step, low=0) for step in steps),
        _whole("max_in_flight", max_in_flight, _U32),
        _whole("max_in_flight_bytes", max_in_flight_bytes, _U64),
        letter,
        _ms("drain_timeout", drain_timeout),
    )


class GroupMessage(Message):
    """A message delivered to a group member: a Message with `delivery_count` (1 the
    first time; more: a redelivery) and, for a member with ``ack=True``, `ack`,
    `nack` and `in_progress`. Made by the Link that received it (for the SDK's own
    modules: `GroupMessage(msg, attempt, ledger)`)."""

    delivery_count: int = 1
    _ledger: AckLedger | None = None

    def __new__(cls, msg: Message, attempt: int = 1, ledger: AckLedger | None = None) -> GroupMessage:
        self: GroupMessage = _tuple_new(cls, msg)
        self.delivery_count = attempt
        self._ledger = ledger
        return self

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, delivery_count={self.delivery_count})"

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy (pickle, copy) keeps the message and its delivery_count, not the way
        back to its worker: it cannot be acknowledged."""
        return (GroupMessage, (Message(*self), self.delivery_count))

    def ack(self) -> None:
        """Done with it: the worker forgets it. Safe from any thread; once settled (ack or
        nack), settling it again does nothing.

        Raises:
            AckError: its subscription was not made with ack=True.
        """
        self._settle(AckKind.ACK, -1)

    def nack(self, delay: float | None = None) -> None:
        """Not done: redeliver it (to this member or another) after `delay` seconds, or
        (None) after the subscription's backoff for its delivery_count. Safe from any
        thread; settling a settled message again does nothing.

        Raises:
            AckError: its subscription was not made with ack=True.
            ValueError: `delay` is negative or not a number.
        """
        self._settle(AckKind.NACK, -1 if delay is None else _ms("delay", delay, low=0, high=_I32))

    def in_progress(self) -> None:
        """Still working on it: its ack deadline (ack_wait) starts again. Safe from any
        thread; does nothing once it is settled.

        Raises:
            AckError: its subscription was not made with ack=True.
        """
        self._settle(AckKind.IN_PROGRESS, -1)

    def _settle(self, kind: int, delay_ms: int) -> None:
        ledger = self._ledger
        if ledger is None:
            raise AckError("this message's subscription was not made with ack=True: nothing to acknowledge")
        ledger.settle(kind, delay_ms, Position(self.vbucket, self.epoch, self.offset))


class Counted(Protocol):
    """What a ledger counts on: the subscription's `in_flight` (the sum of its ledgers' `open`)."""

    in_flight: int


class AckLink(Protocol):
    """What a ledger needs of the Link it belongs to (broky.client.link.Link is one)."""

    @property
    def is_up(self) -> bool:
        """Connected: a control frame written now reaches the worker."""

    def send_control(self, frame: bytes) -> None:
        """Write a control frame now (nothing while down)."""

    def unacked_lost(self, sid: int, lost: int) -> None:
        """I/O thread: `lost` NACKs of subscription `sid` asked a worker process that is
        gone for redeliveries: report them lost (UNACKED_LOST)."""


class AckLedger:
    """The ack subscription `sid`'s deliveries through one Link from one worker process:
    the positions the application has not settled (`open`), and the settlements
    waiting to be sent. Every change is made under the batcher's `lock`."""

    def __init__(self, batcher: AckBatcher, link: AckLink, sid: int, sub: Counted) -> None:
        self.batcher = batcher
        self.lock = batcher.lock
        self.link = link
        self.sid = sid
        self.sub = sub
        self.open: set[Position] = set()
        self.closed = False  # its subscription is gone here: settlements dropped
        # Its worker process is gone (`orphan`): ACKs are dropped, each NACK is a loss.
        self.orphaned = False
        self.nacks_lost = 0  # NACKs of an orphaned ledger not yet reported (`send` reports them)
        self.pending: dict[tuple[int, int], list[Position]] = {}  # (kind, delay_ms) -> positions

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<AckLedger sid={self.sid} open={len(self.open)}{state}>"

    def delivered(self, position: Position) -> bool:
        """I/O thread: the Link received a delivery of `position` for this ledger. Returns
        whether it opened it (False: the application holds a copy, still open)."""
        with self.lock:
            if position in self.open:
                return False
            self.open.add(position)
            self.sub.in_flight += 1
            return True

    def forget(self, position: Position) -> None:
        """A delivery that opened `position` never reached the application (its queue dropped it)."""
        with self.lock:
            if position in self.open:
                self.open.remove(position)
                self.sub.in_flight -= 1

    def settle(self, kind: int, delay_ms: int, position: Position) -> None:
        """Any thread: the application settles `position` (ACK, NACK) or keeps it
        (IN_PROGRESS); nothing if it is not open; dropped once the ledger is closed."""
        with self.lock:
            if self.closed:
                self.batcher.stats.acks_dropped += 1
                return
            if position not in self.open:
                return  # settled already
            if kind != AckKind.IN_PROGRESS:
                self.open.remove(position)
                self.sub.in_flight -= 1
            if self.orphaned:  # nobody holds it: an ACK changes nothing, a NACK loses it
                if kind == AckKind.NACK:
                    self.nacks_lost += 1
                    self.batcher.request(self)  # reported on the I/O thread
                else:
                    self.batcher.stats.acks_dropped += 1
                return
            key = (kind, delay_ms)
            waiting = self.pending.get(key)
            if waiting is None:
                self.pending[key] = [position]
            else:
                waiting.append(position)
            self.batcher.request(self)

    def send(self) -> None:
        """I/O thread: write what waits, one Ack frame per (kind, delay) (more past
        ACK_POSITIONS), if the Link is up; else it waits for the Link to come back."""
        if self.nacks_lost:
            with self.lock:
                lost, self.nacks_lost = self.nacks_lost, 0
            self.link.unacked_lost(self.sid, lost)
        if not self.link.is_up:
            return
        with self.lock:
            if self.closed or self.orphaned or not self.pending:
                return
            pending, self.pending = self.pending, {}
        stats = self.batcher.stats
        for (kind, delay_ms), positions in pending.items():
            for at in range(0, len(positions), ACK_POSITIONS):
                chunk = tuple(positions[at : at + ACK_POSITIONS])
                self.link.send_control(encode_ack(Ack(self.sid, kind, chunk, delay_ms)))
            if kind == AckKind.ACK:
                stats.acks_sent += len(positions)
            elif kind == AckKind.NACK:
                stats.nacks_sent += len(positions)
            else:
                stats.in_progress_sent += len(positions)

    def orphan(self) -> int:
        """The worker process that held these deliveries is gone: what waits to be sent is
        settled for nobody (ACKs dropped); returns the NACKs among it (lost: nobody
        redelivers them). The open ones stay the application's to settle (`settle`)."""
        with self.lock:
            if self.closed or self.orphaned:
                return 0
            self.orphaned = True
            lost = self.nacks_lost + sum(
                len(positions) for (kind, _), positions in self.pending.items() if kind == AckKind.NACK
            )
            self.nacks_lost = 0
            dropped = sum(
                len(positions) for (kind, _), positions in self.pending.items() if kind != AckKind.NACK
            )
            self.pending = {}
            self.batcher.stats.acks_dropped += dropped
            return lost

    def close(self) -> int:
        """The subscription is gone here: drop what waits and whatever is settled from
        now on. Returns how many were open (no longer in the subscription's `in_flight`)."""
        with self.lock:
            if self.closed:
                return 0
            self.closed = True
            dropped = sum(map(len, self.pending.values()))
            self.pending = {}
            self.batcher.stats.acks_dropped += dropped
            lost = len(self.open)
            self.open = set()
            self.sub.in_flight -= lost
            return lost


class AckBatcher:
    """The client's settlements: its lock, the ledgers with settlements waiting, and
    the one `flush` per event-loop iteration that sends them (see the module's header)."""

    def __init__(self, stats: ClientStats) -> None:
        self.stats = stats
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread = 0
        self.waiting: dict[AckLedger, None] = {}  # in the order they were settled in
        self.scheduled = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop (and its thread) the client runs on: flushes are scheduled there."""
        self.loop = loop
        self.loop_thread = threading.get_ident()

    def ledger(self, link: AckLink, sid: int, sub: Counted) -> AckLedger:
        """A new ledger of subscription `sid` on `link`."""
        return AckLedger(self, link, sid, sub)

    def request(self, ledger: AckLedger) -> None:
        """Under the lock: `ledger` has settlements to send; flush at the next iteration."""
        self.waiting[ledger] = None
        if self.scheduled or self.loop is None:
            return
        self.scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the client is gone
            if threading.get_ident() == self.loop_thread:
                self.loop.call_soon(self.flush)
            else:
                self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        """I/O thread: send every ledger's settlements (those of a Link that is down wait
        in their ledger until it is back: `Link.attach`)."""
        with self.lock:
            self.scheduled = False
            waiting, self.waiting = self.waiting, {}
        for ledger in waiting:
            ledger.send()


__all__ = [
    "ACK_POSITIONS",
    "AckBatcher",
    "AckLedger",
    "GroupMessage",
    "GroupSpec",
    "group_spec",
]
