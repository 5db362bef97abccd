"""The Shard's core as its parts see it: `ShardCore`, declared once.

The Shard (broky.server.shard.core) is a core and parts. The core is the
write path in one class: a read in, its messages routed and queued, one write
per touched connection, and the answers and counts on its edges (replies,
errors, the memory budget's charge, loss notices). Every other concern is a
part, in a module of its own:

- a part that keeps state of its own is a plain object built with the core
  (`Groups(core)`), an attribute of it (`core.groups`): arrivals, moves,
  grace, positions, groups, lag;
- a part that keeps none (its state lives on the connections, or is the
  core's) is a module of functions the core calls with itself
  (`closing.goodbye(core, c, why)`): control, backpressure, closing,
  budget_enforcement.

Either way a part knows the core only as `ShardCore`, and never another
part: what two parts need is the core's (a method, or its state), and what
one part's work means for another, the core says (it builds the parts and
calls them: a connection that ends leaves its groups, its held input, its
bounded read). The core calls a part only off the per-message path: a
Subscribe, a Read, an Ack, a map change, a tick, a connection's arrival or
end. tests/repo/test_architecture.py holds the imports (a part imports this
module and the shard's state modules, never the core or another part); mypy
holds the rest, since a part that reaches for what this Protocol does not
name fails the type check.

The state a part reads here is the core's and stays where the write path
reads it; what a part may set is said beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from broky.server.shard.connection import Shard as ConnectionOwner

if TYPE_CHECKING:
    import asyncio

    from broky.errors import ErrorCode
    from broky.matching import Matcher
    from broky.protocol import VBucketMap
    from broky.server.accounts import AccountBook
    from broky.server.config import ServerConfig
    from broky.server.logs import Throttle
    from broky.server.security.users import WorkerUsers
    from broky.server.shard.budget import Budget
    from broky.server.shard.connection import Connection, Plan, Subscription
    from broky.server.shard.replay import ReplayBuffer
    from broky.server.shard.sequences import Sequences
    from broky.server.shard.stats import WorkerStats

# A route: the target connections of a key (interned) and its key_partition's vbucket.
Route = tuple[tuple["Connection", ...], int]


class ShardCore(ConnectionOwner, Protocol):
    """What a part of the Shard uses of its core (broky.server.shard.core.Shard is the one).
    It is also what a Connection talks to (connection.Shard: opened, feed, eof, lost, drained)."""

    config: ServerConfig
    index: int  # the worker's
    loop: asyncio.AbstractEventLoop
    book: AccountBook  # every connection's account (broky.server.accounts)
    stats: WorkerStats
    seqs: Sequences  # every vbucket's sequence, and the former ones (broky.server.shard.sequences)
    replay: ReplayBuffer | None  # None: --replay-bytes 0
    budget: Budget  # the worker's share of --memory-budget
    matcher: Matcher[Subscription, Plan]  # the subscription table
    users: WorkerUsers | None  # --users (broky.server.security.users); None without
    warnings: Throttle  # of clients' non-fatal mistakes, and of budget cuts
    conns: dict[int, Connection]
    # The vbucket map, and per vbucket 1 if this worker owns it / accepts it (owned, or moving
    # here: see the core's "The vbucket map").
    map: VBucketMap
    owned: bytes
    accepts: bytes
    # The connections this read (or timer) queued to: each is written once by `flush`.
    # Whoever queues to c outside `reply` and `emit` appends it here unless `c.touched`.
    touched: list[Connection]
    closing: bool  # shutting down: a new connection is told Goodbye
    # While True the read path holds every Message frame (set by the restart grace,
    # broky.server.shard.grace).
    holding: bool

    def flush(self, committed: bool = False) -> None:
        """Write once to every connection in `touched` (their accounts committed first)."""
        ...

    def emit(self, buf: bytearray, targets: tuple[Connection, ...], start: int, end: int, count: int) -> int:
        """Queue the run of stamped messages buf[start:end] to each target; the deliveries."""
        ...

    def route(self, rkey: object, kp: bytes, key: bytes) -> Route | None:
        """The targets of a key and its vbucket; None: not this worker's vbucket."""
        ...

    def control(self, c: Connection, data: bytes, pos: int, end: int, t0: int = 0) -> bool:
        """A frame of c other than a Message; False: it waits for a sequence (c is held)."""
        ...

    def detach(self, c: Connection) -> None:
        """Remove every subscription of c (its end)."""
        ...

    def reply(self, c: Connection, frame: bytes) -> None:
        """Queue a control frame to c (never dropped)."""
        ...

    def error(
        self,
        c: Connection,
        code: ErrorCode,
        message: str,
        sid: int = 0,
        refused: bytes | None = None,
        rid: int = 0,
    ) -> None:
        """A non-fatal Error to c."""
        ...

    def fatal(self, c: Connection, code: ErrorCode, message: str) -> None:
        """A fatal Error to c, then its lingering close."""
        ...

    def notify_loss(self, c: Connection) -> None:
        """Tell c its drops since the last notice, now (written)."""
        ...

    def reopen(self, c: Connection, need: int) -> bool:
        """c has drops untold: tell them ahead of `need` more bytes, if they fit."""
        ...


__all__ = ["Route", "ShardCore"]
