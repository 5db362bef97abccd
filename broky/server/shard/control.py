"""Control frames: subscriptions and their limits, Ping, Pause and Resume, MapApplied, Read.

Every frame of a client other than a Message (and the SDK's Pings, which
the read path answers itself) comes here, decoded, in its place in the
connection's stream (`control`). A subscription goes into the worker's
subscription table, a broky.matching.Matcher whose match for a key is
compiled into a `Plan` (broky.server.shard.connection: the distinct connections
to deliver to; the read path in broky.server.shard.core caches it per route),
and every change to the table (Subscribe, Unsubscribe, a connection's end:
`detach`) empties the route cache. A Read goes to broky.server.shard.reads, and
Resume restarts a read the Pause held up.

Theory of operation
-------------------
Versions: a connection speaks the version its Hello named (Connection.version).
On a version-2 connection the frames version 3 added (Delivery, Ack, GroupNotice)
are unknown body types, a fatal UNKNOWN_FRAME, and a Subscribe that names a group
is refused (BAD_GROUP, broky.server.shard.groups): such a connection is served exactly
as version 2 says, never made a group member that a version-2 client could not
tell from a plain subscription (schema/README.md 11).

Permissions (--users, broky.server.security.users): a Subscribe of a connection whose
user may not subscribe to its pattern (or use groups) gets a non-fatal
PERMISSION_DENIED and creates nothing (`deny`, counted per user);
`apply_users` takes a reloaded users file and ends, with the same Error and
the sid, each subscription the new rules refuse.

Limits: a Subscribe over --max-subscriptions (count) or --max-subscription-bytes
(pattern + key_partition + SUBSCRIPTION_TOKEN_BYTES per pattern token, summed
over the connection) gets a non-fatal SUBSCRIPTION_LIMIT and creates nothing.
The token charge is there because a pattern token that no other pattern shares
costs a trie node of about 420 bytes (CPython 3.11): 4 KB of one-byte tokens
cost 850 KB, a 4 KB pattern of two tokens about 9.4 KB, a short pattern about
0.7-1 KB with its own Subscription and table entries. At the default limits
one connection holds at most about 13 MB, whatever its patterns (measured:
8-9 MB with 10,000 short patterns, 12 MB with patterns of one-byte tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broky.errors import BadPatternError, ErrorCode
from broky.matching import parse_pattern
from broky.protocol import (
    GROUPS_VERSION,
    VERSION_3_FRAMES,
    Ack,
    LossNotice,
    LossReason,
    MapApplied,
    Pause,
    Ping,
    Pong,
    Read,
    Resume,
    Subscribe,
    Unsubscribe,
    decode_frame,
    encode_frame,
)
from broky.protocol.message import body_type
from broky.protocol.routing import vbucket_of
from broky.server.shard.connection import Connection, Subscription

if TYPE_CHECKING:
    from broky.server.accounts import AccountBook
    from broky.server.config import ServerConfig
    from broky.server.security.users import Permissions, Users, WorkerUsers
    from broky.server.shard.budget import Budget
    from broky.server.shard.groups import Member, SubscriptionTable
    from broky.server.shard.stats import WorkerStats

SUBSCRIPTION_TOKEN_BYTES = 64  # charged per pattern token against --max-subscription-bytes


def _text(b: bytes) -> str:
    return b.decode(errors="backslashreplace")


def subscription_size(pattern: bytes, key_partition: bytes | None, tokens: int) -> int:
    """What a subscription counts against --max-subscription-bytes (schema/README.md, §5)."""
    return len(pattern) + len(key_partition or b"") + SUBSCRIPTION_TOKEN_BYTES * tokens


class ControlFrames:
    """The Shard's part that handles control frames (a mixin of broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        config: ServerConfig
        book: AccountBook
        accepts: bytes
        matcher: SubscriptionTable
        stats: WorkerStats
        budget: Budget
        _touched: list[Connection]
        users: WorkerUsers | None
        conns: dict[int, Connection]

        def flush(self) -> None: ...

        def forget_routes(self) -> None: ...
        def write_out(self, t: Connection) -> int: ...
        def reply(self, c: Connection, frame: bytes) -> None: ...
        def error(
            self,
            c: Connection,
            code: ErrorCode,
            message: str,
            sid: int = 0,
            refused: bytes | None = None,
            rid: int = 0,
        ) -> None: ...
        def fatal(self, c: Connection, code: ErrorCode, message: str) -> None: ...
        def start_subscription(self, c: Connection, s: Subscription, sub: Subscribe, t0: int) -> None: ...
        def bounded_read(self, c: Connection, rd: Read, t0: int) -> None: ...
        def pump_read(self, c: Connection) -> None: ...
        def join_group(self, c: Connection, s: Subscription, sub: Subscribe) -> bool: ...
        def leave_group(self, m: Member) -> None: ...
        def ack(
            self, c: Connection, sid: int, kind: int, keys: list[tuple[int, int, int]], delay_ms: int
        ) -> None: ...

    def control(self, c: Connection, data: bytes, pos: int, end: int, t0: int = 0) -> None:
        """A control frame of c; t0: the clock reading stamped on the messages of this
        read (a Pong carries it)."""
        frame = decode_frame(data, pos, end)
        kind = type(frame)
        if kind in VERSION_3_FRAMES and c.version < GROUPS_VERSION:
            self.fatal(
                c, ErrorCode.UNKNOWN_FRAME, f"unknown frame body type {body_type(data, pos, end)} in "
                f"protocol version {c.version} (this connection's Hello; {kind.__name__} is version 3's)",
            )  # fmt: skip
            return
        if kind is Subscribe:
            self.subscribe(c, frame, t0)  # type: ignore[arg-type]
        elif kind is Unsubscribe:
            self.unsubscribe(c, frame.sid)  # type: ignore[union-attr]
        elif kind is Ping:
            self.reply(c, encode_frame(Pong(frame.id, t0)))  # type: ignore[union-attr]
        elif kind is Pause:
            if c.out and not c.paused:  # queued before the Pause (a Pong among them): out now
                self.stats.bytes_sent += self.write_out(c)
            c.paused = True
        elif kind is Resume:
            self.resume(c)
        elif kind is MapApplied:
            if frame.version > c.map_applied:  # type: ignore[union-attr]
                c.map_applied = frame.version  # type: ignore[union-attr]
        elif kind is Read:
            self.bounded_read(c, frame, t0)  # type: ignore[arg-type]  # broky.server.shard.reads
        elif kind is Ack:  # broky.server.shard.groups
            ack: Ack = frame  # type: ignore[assignment]
            self.ack(
                c, ack.sid, ack.kind, [(p.vbucket, p.epoch, p.offset) for p in ack.positions], ack.delay_ms
            )
        else:
            name = kind.__name__
            self.fatal(c, ErrorCode.UNEXPECTED_FRAME, f"a client may not send {name} here")

    def subscribe(self, c: Connection, sub: Subscribe, t0: int = 0) -> None:
        if not sub.sid:
            self.error(c, ErrorCode.BAD_SID, "sid 0 is reserved (an Error's sid 0 means no subscription)")
            return
        if sub.sid in c.subs:
            self.error(c, ErrorCode.DUPLICATE_SID, f"sid {sub.sid} is already in use", sub.sid)
            return
        try:
            tokens = len(parse_pattern(sub.pattern))
        except BadPatternError as exc:
            self.error(c, ErrorCode.BAD_PATTERN, str(exc), sub.sid)
            return
        perms = c.perms
        if perms is not None:
            why = perms.subscribe_refusal(sub.pattern, bool(sub.group))
            if why is not None:
                self.deny(
                    c, perms, f"subscription {sub.sid} to '{_text(sub.pattern)}' refused: {why}", sub.sid
                )
                return
        kp = sub.key_partition
        if kp is not None and not self.accepts[vbucket_of(kp)]:
            self.error(
                c, ErrorCode.NOT_MY_VBUCKET, f"key_partition {kp!r} is owned by another worker", sub.sid
            )
            return
        size = subscription_size(sub.pattern, kp, tokens)
        config = self.config
        if len(c.subs) >= config.max_subscriptions:
            self.refuse_subscription(
                c,
                sub.sid,
                "count",
                f"the connection holds {len(c.subs)} subscriptions, max_subscriptions is "
                f"{config.max_subscriptions}",
            )
            return
        if c.sub_bytes + size > config.max_subscription_bytes:
            self.refuse_subscription(
                c,
                sub.sid,
                "bytes",
                f"the connection holds {c.sub_bytes} subscription bytes, this one is {size} "
                f"(pattern + key_partition + {SUBSCRIPTION_TOKEN_BYTES} per token), "
                f"max_subscription_bytes is {config.max_subscription_bytes}",
            )
            return
        s = Subscription(c, sub.sid, sub.pattern, kp, size)
        if sub.group and not self.join_group(
            c, s, sub
        ):  # (an empty group name: no group)  # broky.server.shard.groups
            return
        c.subs[sub.sid] = s
        c.sub_bytes += size
        self.matcher.add(sub.pattern, s)
        self.stats.subscriptions += 1
        self.book.set_subscriptions(c, len(c.subs))
        self.stats.subscription_bytes += size
        self.forget_routes()
        if sub.since or sub.since_time or sub.last:  # a start from positions (broky.server.shard.history)
            self.start_subscription(c, s, sub, t0)

    def deny(
        self, c: Connection, perms: Permissions, message: str, sid: int = 0, refused: bytes | None = None
    ) -> None:
        """PERMISSION_DENIED (non-fatal), counted per user (broky.server.security.users)."""
        denied = self.stats.permission_denied
        denied[perms.name] = denied.get(perms.name, 0) + 1
        self.error(c, ErrorCode.PERMISSION_DENIED, f"user {perms.name!r}: {message}", sid, refused)

    def deny_publish(self, c: Connection, perms: Permissions, key: bytes, why: str, frame: bytes) -> None:
        """A publish outside the user's permissions: processed and refused, as NOT_MY_VBUCKET
        (the frame goes back in the Error)."""
        c.refused += 1
        self.deny(c, perms, f"publish to '{_text(key)}' refused: {why}", refused=frame)

    def apply_users(self, users: Users) -> None:
        """Users read again (SIGHUP): every connection takes its user's new rules, and
        each subscription they refuse ends with a PERMISSION_DENIED carrying its sid."""
        registry = self.users
        if registry is None:
            return
        registry.replace(users)
        self.forget_routes()
        for c in list(self.conns.values()):
            if c.user is None:
                continue
            c.perms = perms = registry.permissions(c.user)
            if perms is None:
                continue
            for sid, s in list(c.subs.items()):
                why = perms.subscribe_refusal(s.pattern, s.member is not None)
                if why is not None:
                    self.unsubscribe(c, sid)
                    self.deny(
                        c, perms, f"subscription {sid} to '{_text(s.pattern)}' ended by a reload: {why}", sid
                    )
            if c.out and not c.touched:
                c.touched = True
                self._touched.append(c)
        if self._touched:
            self.flush()

    def refuse_subscription(self, c: Connection, sid: int, limit: str, why: str) -> None:
        """A Subscribe over a per-connection limit: non-fatal SUBSCRIPTION_LIMIT, counted."""
        self.stats.subscriptions_refused[limit] += 1
        self.error(c, ErrorCode.SUBSCRIPTION_LIMIT, f"subscription {sid} refused: {why}", sid)

    def unsubscribe(self, c: Connection, sid: int) -> None:
        s = c.subs.pop(sid, None)
        if s is None:
            self.error(c, ErrorCode.UNKNOWN_SID, f"no subscription with sid {sid}", sid)
            return
        self.matcher.remove(s.pattern, s)
        if s.member is not None:
            self.leave_group(s.member)
        self.stats.subscriptions -= 1
        self.book.set_subscriptions(c, len(c.subs))
        self.stats.subscription_bytes -= s.size
        self.budget.freed_sub_bytes += s.size
        c.sub_bytes -= s.size
        self.forget_routes()

    def detach(self, c: Connection) -> None:
        """Remove every subscription of a connection."""
        if not c.subs:
            return
        for sub in c.subs.values():
            self.matcher.remove(sub.pattern, sub)
        for sub in c.subs.values():
            if sub.member is not None:  # after the table no longer names it: its work goes elsewhere
                self.leave_group(sub.member)
        if c.group_out:  # for its client's resume (broky.server.shard.arrivals)
            self.matcher.groups.closed(c.conn_id, c.group_out, c.group_untold)
        self.stats.subscriptions -= len(c.subs)
        self.stats.subscription_bytes -= c.sub_bytes
        self.budget.freed_sub_bytes += c.sub_bytes
        c.sub_bytes = 0
        c.subs.clear()
        self.book.set_subscriptions(c, 0)
        self.forget_routes()

    def resume(self, c: Connection) -> None:
        if not c.paused:
            return
        c.paused = False
        if c.out and not c.touched:
            c.touched = True
            self._touched.append(c)
        if c.dropped:
            # After the kept deliveries, which this read's flush writes first.
            c.out.append(encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER)))
            c.dropped = c.group_untold = 0
            c.cap = c.limit
            c.over_since = 0.0
            if not c.touched:
                c.touched = True
                self._touched.append(c)
        if c.bounded_read is not None:  # its read waited for Resume
            self.pump_read(c)
