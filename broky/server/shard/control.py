"""Control frames' rules: who may subscribe to what, how much, in which protocol version.

Every frame of a client other than a Message (and the SDK's Pings, which
the read path answers itself) is handled, decoded, in its place in the
connection's stream by the core (broky.server.shard.core `Shard.control`): a
subscription goes into the worker's subscription table, a
broky.matching.Matcher whose match for a key is compiled into a `Plan`
(broky.server.shard.connection: the distinct connections to deliver to; the
read path caches it per route), and every change to the table (Subscribe,
Unsubscribe, a connection's end: `detach`) empties the route cache. A group
Subscribe joins its group (broky.server.shard.groups), one that names a start
replays first (broky.server.shard.positions), a Read goes to the positions
too, and Resume restarts a read the Pause held up. This part keeps no state:
it is a module of functions the core calls with itself
(broky.server.shard.part), that admit a Subscribe or refuse it (`admit`) and
refuse what a user may not do (`deny`).

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
`Shard.apply_users` takes a reloaded users file and ends, with the same Error
and the sid, each subscription the new rules refuse.

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
from broky.protocol import Subscribe
from broky.protocol.routing import vbucket_of
from broky.server.shard.connection import Connection

if TYPE_CHECKING:
    from broky.server.security.users import Permissions
    from broky.server.shard.part import ShardCore

SUBSCRIPTION_TOKEN_BYTES = 64  # charged per pattern token against --max-subscription-bytes


def text(b: bytes) -> str:
    return b.decode(errors="backslashreplace")


def subscription_size(pattern: bytes, key_partition: bytes | None, tokens: int) -> int:
    """What a subscription counts against --max-subscription-bytes (schema/README.md, §5)."""
    return len(pattern) + len(key_partition or b"") + SUBSCRIPTION_TOKEN_BYTES * tokens


def admit(core: ShardCore, c: Connection, sub: Subscribe) -> int | None:
    """The size a Subscribe of c counts against its limits, if it may subscribe; None:
    refused, and told (a non-fatal Error with its sid)."""
    if not sub.sid:
        core.error(c, ErrorCode.BAD_SID, "sid 0 is reserved (an Error's sid 0 means no subscription)")
        return None
    if sub.sid in c.subs:
        core.error(c, ErrorCode.DUPLICATE_SID, f"sid {sub.sid} is already in use", sub.sid)
        return None
    try:
        tokens = len(parse_pattern(sub.pattern))
    except BadPatternError as exc:
        core.error(c, ErrorCode.BAD_PATTERN, str(exc), sub.sid)
        return None
    perms = c.perms
    if perms is not None:
        why = perms.subscribe_refusal(sub.pattern, bool(sub.group))
        if why is not None:
            deny(core, c, perms, f"subscription {sub.sid} to '{text(sub.pattern)}' refused: {why}", sub.sid)
            return None
    kp = sub.key_partition
    if kp is not None and not core.accepts[vbucket_of(kp)]:
        core.error(c, ErrorCode.NOT_MY_VBUCKET, f"key_partition {kp!r} is owned by another worker", sub.sid)
        return None
    size = subscription_size(sub.pattern, kp, tokens)
    config = core.config
    if len(c.subs) >= config.max_subscriptions:
        refuse_subscription(
            core,
            c,
            sub.sid,
            "count",
            f"the connection holds {len(c.subs)} subscriptions, max_subscriptions is "
            f"{config.max_subscriptions}",
        )
        return None
    if c.sub_bytes + size > config.max_subscription_bytes:
        refuse_subscription(
            core,
            c,
            sub.sid,
            "bytes",
            f"the connection holds {c.sub_bytes} subscription bytes, this one is {size} "
            f"(pattern + key_partition + {SUBSCRIPTION_TOKEN_BYTES} per token), "
            f"max_subscription_bytes is {config.max_subscription_bytes}",
        )
        return None
    return size


def deny(
    core: ShardCore,
    c: Connection,
    perms: Permissions,
    message: str,
    sid: int = 0,
    refused: bytes | None = None,
) -> None:
    """PERMISSION_DENIED (non-fatal), counted per user (broky.server.security.users)."""
    denied = core.stats.permission_denied
    denied[perms.name] = denied.get(perms.name, 0) + 1
    core.error(c, ErrorCode.PERMISSION_DENIED, f"user {perms.name!r}: {message}", sid, refused)


def deny_publish(
    core: ShardCore, c: Connection, perms: Permissions, key: bytes, why: str, frame: bytes
) -> None:
    """A publish outside the user's permissions: processed and refused, as NOT_MY_VBUCKET
    (the frame goes back in the Error)."""
    c.refused += 1
    deny(core, c, perms, f"publish to '{text(key)}' refused: {why}", refused=frame)


def refuse_subscription(core: ShardCore, c: Connection, sid: int, limit: str, why: str) -> None:
    """A Subscribe over a per-connection limit: non-fatal SUBSCRIPTION_LIMIT, counted."""
    core.stats.subscriptions_refused[limit] += 1
    core.error(c, ErrorCode.SUBSCRIPTION_LIMIT, f"subscription {sid} refused: {why}", sid)


__all__ = ["SUBSCRIPTION_TOKEN_BYTES", "admit", "deny", "deny_publish", "subscription_size", "text"]
