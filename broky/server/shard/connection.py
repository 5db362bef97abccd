"""The asyncio Protocol of one client connection: a thin adapter over the shard.

It holds the connection's state that the hot path in broky.server.shard.core
reads and writes (outbound list, pending byte counts, flow control flags),
sets TCP_NODELAY and the transport's write limits, and forwards every event
to the shard. It parses nothing itself.

Pending bytes of a connection = bytes in its transport's write buffer (`base`,
refreshed at every flush and before any drop) + bytes appended to `out` since
the last flush or kept while paused (`unflushed`): deliveries and control
replies alike. The write buffer's high-water mark is half the pending bound and
its low-water mark a quarter; `pause_writing`/`resume_writing` tell the shard
when the connection stalls and when it has drained again. Deliveries never
take the pending bytes past the bound (they are dropped instead); replies are
never dropped, so a client that keeps asking (Pings, bad requests) without
reading could pile them up: once more than --max-reply-bytes of replies are
unread, the shard stops reading from that connection
(`transport.pause_reading`) until they drain (`reads_stopped`). Deliveries do not
count toward that bound.

What a connection counts in its worker's memory budget (broky.server.shard.budget)
is `charged`: its pending bytes as of the last flush that touched it, or of
the last exact refresh (every tick, and before the worker cuts anyone).

A connection's subscriptions are `Subscription`s; the subscription table
(broky.server.shard.core, "Control frames") compiles those matching a key into
a `Plan`, the distinct connections a message with that key goes to. Its
bounded read in progress is a `ReadCursor` (broky.server.shard.positions serves it).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from broky.matching import GT
from broky.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:
    from broky.server.accounts import Account
    from broky.server.config import ServerConfig
    from broky.server.security.users import Permissions


class Shard(Protocol):
    """What a Connection tells its worker's shard (broky.server.shard.core.Shard is one; the
    shard's parts know it as broky.server.shard.part.ShardCore, which says this and more):
    this module knows the shard through this, so that nothing imports back."""

    config: ServerConfig

    def opened(self, c: Connection) -> None: ...
    def feed(self, c: Connection, data: bytes) -> None: ...
    def eof(self, c: Connection) -> bool: ...
    def lost(self, c: Connection, exc: Exception | None) -> None: ...
    def drained(self, c: Connection) -> None: ...


OPEN = 1
CLOSING = 2  # a final frame was written; waiting for the peer's EOF or the linger deadline
CLOSED = 3

# What holds a connection's input (`Connection.held`; "": nothing): it waits, reads paused,
# in `rest`, and is fed again in order by whoever held it.
HELD_BY_GRACE = "grace"  # its first publish during the restart grace (broky.server.shard.grace)
HELD_FOR_SEQUENCE = "sequence"  # a frame that needs a sequence on its way here (broky.server.shard.moves)
HELD_FOR_TURN = "turn"  # what follows a Read, until the loop's next turn (broky.server.shard.positions)


class Connection(asyncio.Protocol):
    __slots__ = (
        "shard", "transport", "initial", "conn_id", "peer", "client_name", "state",
        "rest", "partial_since", "out", "touched", "unflushed", "base", "limit",
        "paused", "write_paused", "reads_stopped", "said_goodbye", "dropped", "over_since", "subs", "linger",
        "msgs_in", "msgs_out", "dropped_total", "connected_at", "on_adopted", "slot", "acct_ver", "account",
        "resuming", "held", "map_applied", "sub_bytes", "sent", "reply_out", "reply_sent", "reply_left",
        "reply_marks", "token", "refused", "charged", "handoff_id", "bounded_read", "group_out", "user",
        "perms", "version", "cap", "worker_owed", "group_lost", "group_untold", "lag",
    )  # fmt: skip

    def __init__(self, shard: Shard, initial: bytes, conn_id: int) -> None:
        self.shard = shard
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.initial = initial  # the Hello frame the master read
        self.conn_id = conn_id
        self.peer = "?"
        self.client_name: str | None = None
        # The protocol version its Hello named (set when it is welcomed): a version-2
        # connection is served as version 2 (broky.server.shard.control, schema/README.md 11).
        self.version = PROTOCOL_VERSION
        self.state = OPEN
        self.rest = b""  # start of an incomplete frame
        self.partial_since = 0.0  # monotonic time of the last read that left `rest`
        self.out: list[
            bytes | bytearray
        ] = []  # frames to write at the end of this read (or kept while paused)
        self.touched = False  # already in the shard's list of connections to flush
        self.unflushed = 0
        self.base = 0
        self.charged = 0  # its pending bytes as counted in the worker's budget (broky.server.shard.budget)
        self.limit = shard.config.max_pending_bytes
        # What deliveries may take it to: `limit`, or -1 from its first drop until the
        # LossNotice that tells it (broky.server.shard.backpressure: the drops told by one notice
        # come after every delivery queued before it, none are queued between them).
        self.cap = self.limit
        self.paused = False  # the client sent Pause: deliveries stay in `out`
        self.write_paused = False  # the transport's buffer is over its high-water mark
        self.reads_stopped = False  # its unread replies are over the bound: reading is paused
        self.said_goodbye = False  # the shutdown's Goodbye was sent: input is counted and dropped
        self.dropped = 0  # deliveries lost since the last LossNotice
        self.over_since = 0.0  # monotonic time of the first drop since the last notice
        self.subs: dict[int, Subscription] = {}
        self.sub_bytes = 0  # summed Subscription.size of `subs` (--max-subscription-bytes)
        # Unread replies (see broky.server.shard.backpressure, "Replies"): bytes ever handed to the
        # transport; reply bytes queued in `out`, ever written, known to have left the
        # write buffer; marks (stream position after a write, reply_sent then).
        self.sent = 0
        self.reply_out = 0
        self.reply_sent = 0
        self.reply_left = 0
        self.reply_marks: deque[tuple[int, int]] | None = None
        self.linger: asyncio.TimerHandle | None = None
        # Per-connection totals for /connections (broky.server.http.monitor).
        self.msgs_in = 0  # messages published by this connection
        self.msgs_out = 0  # messages delivered to it
        self.dropped_total = 0  # deliveries to it dropped (slow consumer)
        self.refused = 0  # its publishes refused (NOT_MY_VBUCKET, PERMISSION_DENIED), counted as processed
        # Its secret (Welcome.resume_token): a client claims this connection's account
        # with it (broky.server.accounts); never logged, never listed.
        self.token = b""
        self.connected_at = time.time()
        # Called once the transport holds the socket, before a byte is read or written
        # (the worker answers the master's hand-off there; broky.server.worker.process).
        self.on_adopted: Callable[[], object] | None = None
        self.handoff_id = 0  # the master's hand-off that brought it (named when it closes)
        # Its account (broky.server.accounts): msgs_in, msgs_out and dropped_total as of
        # the last commit, at byte `slot` of the shared table (-1: none).
        self.slot = -1
        self.acct_ver = 0
        self.account: Account | None = None  # a dead worker's account of Hello.previous (hand-off)
        self.resuming = 0  # id of the dead worker's connection it replaces, until it is back
        self.held = ""  # what holds its input (HELD_*), or "": restart grace, a sequence, a Read
        self.map_applied = 0  # the latest map version its client said it follows (MapApplied)
        self.bounded_read: ReadCursor | None = (
            None  # its bounded read in progress (broky.server.shard.positions)
        )
        # While it lags (over its bound, with a replay buffer): where it reads on from
        # (broky.server.shard.lag); None while it is live.
        self.lag: LagCursor | None = None
        self.group_out = 0  # of msgs_out, those queued to its group members (broky.server.shard.groups)
        self.group_untold = 0  # of `dropped`, deliveries to its members without ack (never replayed)
        # Messages this worker keeps for it and has not sent (its account's owed word, for a
        # claim after the worker died): its groups' kept for nobody yet while it carries their
        # teller (broky.server.shard.groups), and what it is owed while it lags
        # (broky.server.shard.lag). `group_lost`: its groups' lost for good meanwhile.
        self.worker_owed = 0
        self.group_lost = 0
        # Its user (--users; None: none, or the server's token) and, when that user's
        # permissions are limited, what it may do (broky.server.security.users).
        self.user: str | None = None
        self.perms: Permissions | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.on_adopted is not None:
            self.on_adopted()
            self.on_adopted = None
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        self.transport.set_write_buffer_limits(high=max(self.limit // 2, 1), low=self.limit // 4)
        self.shard.opened(self)

    def data_received(self, data: bytes) -> None:
        self.shard.feed(self, data)

    def eof_received(self) -> bool:
        return self.shard.eof(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.shard.lost(self, exc)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.shard.drained(self)

    def __repr__(self) -> str:
        return f"<Connection {self.conn_id} {self.peer}>"


class GroupMember(Protocol):
    """A subscription's place in a consumer group, as the subscription table needs it
    (broky.server.shard.groups.Member is one; known through this, so that nothing imports back)."""

    @property
    def group(self) -> Hashable: ...


class Subscription:
    """One subscription of one connection (hashed by identity)."""

    __slots__ = ("conn", "sid", "pattern", "key_partition", "size", "member")

    def __init__(
        self, conn: Connection, sid: int, pattern: bytes, key_partition: bytes | None, size: int = 0
    ) -> None:
        self.conn = conn
        self.sid = sid
        self.pattern = pattern
        self.key_partition = key_partition
        self.size = size  # charged against --max-subscription-bytes (control.subscription_size)
        self.member: Any = None  # a group member's place (broky.server.shard.groups.Member), or None


class Plan(NamedTuple):
    """Where a message with a given key goes."""

    everyone: tuple[Connection, ...]  # connections with an all-partition subscription
    scoped: dict[bytes, tuple[Connection, ...]] | None  # further connections by key_partition
    # Consumer groups (broky.server.shard.groups): each gets the message once, for one member.
    groups: tuple[Any, ...] = ()  # groups (broky.server.shard.groups.Group) of all-partition subscriptions
    scoped_groups: dict[bytes, tuple[Any, ...]] | None = None  # further groups by key_partition


def compile_plan(subs: list[Subscription]) -> Plan:
    """Turn the subscriptions matching a key into a delivery plan (distinct connections,
    distinct groups): a group member's subscription counts for its group, not its connection."""
    everyone = dict.fromkeys(s.conn for s in subs if s.key_partition is None and s.member is None)
    scoped: dict[bytes, dict[Connection, None]] = {}
    groups: dict[Hashable, None] = {}
    scoped_groups: dict[bytes, dict[Hashable, None]] = {}
    for s in subs:
        m: GroupMember | None = s.member
        if m is not None:
            if s.key_partition is None:
                groups[m.group] = None
            else:
                scoped_groups.setdefault(s.key_partition, {})[m.group] = None
        elif s.key_partition is not None and s.conn not in everyone:
            scoped.setdefault(s.key_partition, {})[s.conn] = None
    return Plan(
        tuple(everyone),
        {kp: tuple(c) for kp, c in scoped.items()} if scoped else None,
        tuple(groups),
        {kp: tuple(g) for kp, g in scoped_groups.items()} if scoped_groups else None,
    )


class ReadRange:
    """One vbucket's range of a read: offsets `at` .. `stop` - 1 of `epoch` still to go."""

    __slots__ = ("vb", "epoch", "at", "stop", "evicted", "epoch_changed")

    def __init__(self, vb: int, epoch: int, at: int, stop: int, evicted: int, epoch_changed: bool) -> None:
        self.vb = vb
        self.epoch = epoch
        self.at = at  # the next offset to look at
        self.stop = stop  # the first offset after the range (ReadDone.next)
        self.evicted = evicted  # offsets of the range found gone so far
        self.epoch_changed = epoch_changed


class ReadCursor:
    """A bounded read in progress on one connection (broky.server.shard.positions)."""

    __slots__ = ("rid", "tokens", "kp", "ts", "ranges", "done", "scheduled", "matches")

    def __init__(self, rid: int, tokens: list[bytes], kp: bytes | None, ts: int, ranges: list[ReadRange]):
        self.rid = rid
        # The pattern's tokens, None when it matches every key (`>`): nothing to match.
        self.tokens: list[bytes] | None = None if tokens == [GT] else tokens
        self.kp = kp
        self.ts = ts  # the server's clock when the Read was handled (Replay.ts)
        self.ranges = ranges
        self.done = 0  # ranges[:done] got their ReadDone
        self.scheduled = False  # a batch waits on call_soon
        self.matches: dict[bytes, bool] = {}  # key -> matches the pattern


class LagCursor:
    """Where a lagging connection reads on from (broky.server.shard.lag).

    Two forms. A connection with a plain subscription to every key (`>`) is owed every
    message of every vbucket from a point on: once sealed, `open_from[vb]` is that point
    (the next offset to send) and `epochs[vb]` its epoch; nothing per message. Any other
    connection is owed only the messages routed to it: `owed[vb]` lists them as ranges of
    offsets [start, stop), appended as they are refused, about 144 bytes a range in CPython
    (a vbucket's messages of one key_partition are consecutive offsets, one range); the
    ranges the buffer evicted are trimmed at the worker's tick, and kept as a count per
    vbucket, `gone[vb]`, until they are told."""

    __slots__ = (
        "every_key", "open_from", "epochs", "tracked", "owed", "owed_epochs", "gone", "count", "since",
        "served", "evicted", "scheduled", "pending", "next_vb", "progress",
    )  # fmt: skip

    def __init__(self, every_key: bool, since: float) -> None:
        self.every_key = every_key
        self.open_from: list[int] | None = None  # sealed (every_key): per vbucket, the next offset
        self.epochs: list[int] | None = None  # ... and its epoch
        self.tracked = b""  # sealed: 1 for the vbuckets it was owed (accepted or former) then
        self.owed: dict[int, list[list[int]]] = {}  # vb -> ranges [start, stop) of offsets owed
        self.owed_epochs: dict[int, int] = {}  # vb -> the epoch of its owed offsets
        # vb -> [count, first, last, epoch]: owed offsets the buffer evicted, not told yet
        self.gone: dict[int, list[int]] = {}
        # Messages it is owed (refused, not yet sent nor told), also in the connection's
        # `worker_owed`: its account's owed word, told to a claim if the worker dies.
        self.count = 0
        self.since = since  # monotonic: when it began lagging
        self.served = 0  # messages sent to it from the replay buffer
        self.evicted = 0  # messages it was owed that the buffer evicted first (told)
        self.scheduled = False  # a batch waits on call_soon
        self.pending: list[int] | None = None  # the vbuckets it was behind in, at the last look
        self.next_vb = 0  # ... and where the batches are in that list
        self.progress = since  # monotonic: the last batch that sent it something
