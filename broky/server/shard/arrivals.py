"""A connection's arrival: its Hello answered with a Welcome, and a reconnecting client's claim.

Theory of operation
-------------------
The master reads a client's Hello and hands the socket to a worker with
those bytes (broky.server.handoff); the worker makes a Connection of it
(`new_connection`: an id made of this worker incarnation's `epoch` and a
counter, and a secret of its own, the resume token) and answers the Hello
with a Welcome once the transport holds the socket (`opened`; the core
answers with a Goodbye instead if it is shutting down). The Welcome of a map
is encoded once (`template`: milliseconds for the 1024-entry map), for the
first connection after the map changed.

A client that reconnects names the connection it replaces (Hello.previous:
its id, its resume token, what it received and what it was told it lost).
`take_over` finds that connection's account: from the master when its worker
died (attached to the hand-off, the token checked there), or from this
worker's own book (broky.server.accounts) when it was one of this worker's
connections, still open if the server has not noticed the loss yet (it is
closed now: `supersede`). A claim without the connection's token gets
nothing and closes nothing (`refuse_claim`). The Welcome says how many of
the old connection's publishes were processed (Welcome.resumed), and
LossNotices follow it: deliveries queued to the old connection that the
client did not receive, and drops it was never told of; without an account,
one LossNotice UNACCOUNTED. What a claim resumed goes back to the core,
which tells the restart grace (broky.server.shard.grace): a subscriber of a
dead worker that comes back is marked (`resuming`), so that the grace ends
once they are all back.

A client that resumes by positions is not told the deliveries its Subscribes
replay, except its group members' (no replay gives those back): so this part
keeps what each closed connection's group members were queued and lost
untold (`left`, `closed_groups`), for the claim.

The part is an object the core builds (`Shard.arrivals`, broky.server.shard.part);
the worker makes its connections with it (`new_connection`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from broky import __version__
from broky.errors import ErrorCode, RemoteProtocolError
from broky.protocol import (
    RESUME_TOKEN_BYTES,
    SERVED_VERSIONS,
    Hello,
    LossNotice,
    LossReason,
    PreviousConnection,
    Resumed,
    Welcome,
    WelcomeTemplate,
    decode_frame,
    encode_frame,
)
from broky.server.accounts import Account, same_secret
from broky.server.security.users import subject_of
from broky.server.shard.connection import Connection
from broky.server.shard.stats import DROPPED_AS, DropReason

if TYPE_CHECKING:
    from broky.protocol import VBucketMap
    from broky.server.shard.part import ShardCore

log = logging.getLogger("broky.worker")

CLOSED_KEPT = 65536  # closed connections' group deliveries kept: as many as the account table's slots


class Arrivals:
    """The Shard's part that welcomes connections (`Shard.arrivals`), built with the core
    (broky.server.shard.part)."""

    __slots__ = ("core", "epoch", "next_id", "welcome", "welcome_map", "closed_groups")

    def __init__(self, core: ShardCore, epoch: int) -> None:
        self.core = core
        self.epoch = epoch  # this worker incarnation's part of every connection id
        self.next_id = 0
        # The Welcome of the core's map, made again for the first connection after the map changed.
        self.welcome: WelcomeTemplate | None = None
        self.welcome_map: VBucketMap | None = None
        # Closed connections' group deliveries and their drops not yet told (Connection.group_out,
        # group_untold), for a resume by positions (`take_over`): the oldest forgotten past
        # CLOSED_KEPT.
        self.closed_groups: dict[int, tuple[int, int]] = {}

    def new_connection(self, initial: bytes, account: Account | None = None) -> Connection:
        """A connection handed over with its Hello (and, for a client resuming a
        connection of a dead worker, that connection's account)."""
        self.next_id += 1
        c = Connection(self.core, initial, (self.epoch << 32) | self.next_id)
        c.token = os.urandom(RESUME_TOKEN_BYTES)
        c.account = account
        return c

    def opened(self, c: Connection) -> Resumed | None:
        """A handed-over socket is adopted (the core has it among its connections): answer its
        Hello with a Welcome; what it resumed (Welcome.resumed: the connection it claimed, with
        that connection's account), if anything."""
        core = self.core
        try:
            hello = decode_frame(c.initial) if c.initial else None
        except RemoteProtocolError as exc:
            core.fatal(c, exc.code, str(exc))
            return None
        c.initial = b""
        if not isinstance(hello, Hello):
            core.fatal(c, ErrorCode.EXPECTED_HELLO, "the first frame must be a Hello")
            return None
        if hello.protocol_version not in SERVED_VERSIONS:
            core.fatal(c, ErrorCode.UNSUPPORTED_VERSION, f"protocol version {hello.protocol_version}")
            return None
        c.client_name = hello.client_name
        c.version = hello.protocol_version
        users = core.users
        if users is not None:  # (a TLS client's certificate may name its user: mutual TLS)
            cert = c.transport.get_extra_info("peercert")
            c.user = name = users.identify(hello.auth_token, subject_of(cert) if cert else None)
            if name is not None:
                c.perms = users.permissions(name)
        core.book.open(c)
        resumed, notices = (
            (None, b"") if hello.previous is None else self.take_over(c, hello.previous, hello.positions)
        )
        welcome = self.template().for_connection(c.conn_id, c.token, resumed)
        if notices:
            welcome += notices
        c.transport.write(welcome)
        c.sent = len(welcome)
        log.debug("connection %d from %s (%s) welcomed", c.conn_id, c.peer, c.client_name)
        return resumed

    def template(self) -> WelcomeTemplate:
        """The Welcome of the core's map (made once per map)."""
        welcome = self.welcome
        core = self.core
        vmap = core.map
        if welcome is None or self.welcome_map is not vmap:
            config = core.config
            self.welcome_map = vmap
            welcome = self.welcome = WelcomeTemplate(
                Welcome(
                    node_id=config.node_id,
                    worker=core.index,
                    map=vmap,
                    max_frame_bytes=config.max_frame_bytes,
                    max_pending_bytes=config.max_pending_bytes,
                    server_version=__version__,
                )
            )
        return welcome

    def left(self, c: Connection) -> None:
        """c's subscriptions are gone: keep its group deliveries for its client's resume."""
        if c.group_out:
            kept = self.closed_groups
            if len(kept) >= CLOSED_KEPT:
                del kept[next(iter(kept))]
            kept[c.conn_id] = (c.group_out, c.group_untold)

    def take_over(
        self, c: Connection, prev: PreviousConnection, positions: bool = False
    ) -> tuple[Resumed | None, bytes]:
        """c replaces the connection `prev` names: its account, if anyone has it.

        The account comes from the master when prev's worker died (attached to the
        hand-off), or from this worker's own book when prev was one of its own
        connections (still open, if the server has not noticed the loss yet: it is
        retired now). Returns Welcome.resumed and the LossNotices that follow the
        Welcome: deliveries queued to prev that the client did not receive, and
        drops it was never told of. A client that resumes by positions (Hello.positions)
        is not told the deliveries it did not receive from this worker incarnation: its
        Subscribes `since` its positions replay them, or tell exactly what is gone
        (broky.server.shard.positions; with no replay buffer, all of it).
        """
        old_id = prev.connection_id
        proof = prev.resume_token
        account, reason = c.account, LossReason.WORKER_RESTART  # the master checked its proof
        c.account = None
        core = self.core
        stats = core.stats
        book = core.book
        if account is None or account.conn_id != old_id:
            account, reason = None, LossReason.CONNECTION_LOST
            if old_id >> 32 == self.epoch:
                old = core.conns.get(old_id)
                if old is not None and old is not c:
                    if same_secret(proof, old.token):
                        self.supersede(old)
                    else:  # never close a live connection for a claim that cannot prove itself
                        self.refuse_claim(c, old_id)
                        old = None
                refused_before = book.claims_refused
                account = book.claim(old_id, proof)
                if book.claims_refused != refused_before:
                    self.refuse_claim(c, old_id)
        if account is None:
            stats.resumes["unknown"] += 1
            # It may have had deliveries queued that never arrived: how many, nobody alive knows.
            return None, encode_frame(LossNotice(0, LossReason.UNACCOUNTED))
        stats.resumes[LossReason.name(reason)] += 1
        notices = []
        lost = account.delivered - prev.received
        died = reason == LossReason.WORKER_RESTART
        if account.cut:  # this worker cut it for its memory budget: a slow consumer
            reason = LossReason.SLOW_CONSUMER
        group_out, group_untold = (0, 0) if died else self.closed_groups.pop(old_id, (0, 0))
        replayed = positions and not died  # the Subscribes that follow replay, or tell, what is after
        if lost > 0 and replayed:
            stats.resumes_by_positions += 1
            # Replayed by the Subscribes that follow, or told by them (EVICTED); but not a group
            # member's deliveries (broky.server.shard.groups): no replay gives those back.
            lost = min(lost, group_out - prev.group_received)
        if lost > 0:
            stats.dropped[DROPPED_AS[reason]] += lost
            notices.append(encode_frame(LossNotice(lost, reason)))
        untold = account.dropped - prev.told_lost
        if untold > 0 and replayed:
            # Dropped after every delivery queued to it (broky.server.shard.backpressure, `cap`): the
            # Subscribes that follow replay them, or tell them; not a group member's.
            untold = min(untold, group_untold)
        if untold > 0:  # dropped (and counted) as slow_consumer back then; the notice never arrived
            notices.append(encode_frame(LossNotice(untold, LossReason.SLOW_CONSUMER)))
        if account.owed and died:  # its groups kept them for a member, in the process that died
            stats.dropped[DropReason.WORKER_RESTART] += account.owed
            notices.append(encode_frame(LossNotice(account.owed, LossReason.WORKER_RESTART)))
        if account.group_lost:  # its groups lost them for good, each told once (broky.server.shard.groups)
            notices.append(encode_frame(LossNotice(account.group_lost, LossReason.CONNECTION_LOST)))
        if notices:
            log.info(
                "connection %d from %s resumes %d: %d deliveries lost (%s), %d drops untold, "
                "%d group messages lost",
                c.conn_id, c.peer, old_id, max(lost, 0), LossReason.name(reason), max(untold, 0),
                (account.owed if died else 0) + account.group_lost,
            )  # fmt: skip
        return Resumed(old_id, account.processed, account.refused), b"".join(notices)

    def refuse_claim(self, c: Connection, old_id: int) -> None:
        """A Hello.previous named a connection of this worker without its secret: the
        claim gets nothing (no account, no supersede); counted, logged throttled."""
        self.core.stats.resumes["refused"] += 1
        suppressed = self.core.warnings.allow(("claim", old_id >> 32))
        if suppressed is not None:
            more = f" ({suppressed} more since the last warning)" if suppressed else ""
            log.warning(
                "connection %d from %s claims connection %d without its resume token: refused%s",
                c.conn_id, c.peer, old_id, more,
            )  # fmt: skip

    def supersede(self, old: Connection) -> None:
        """A client reconnected in place of `old`, which this worker still thinks open
        (a half-open connection): close it now, so that its account is final."""
        log.info("connection %d from %s is replaced by a reconnect; closing it", old.conn_id, old.peer)
        old.transport.abort()
        self.core.lost(old, None)
