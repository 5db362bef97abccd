"""The vbucket map: what this worker owns, and what it refuses.

Theory of operation
-------------------
A worker owns the vbuckets that the map gives it (node `config.node_id`,
worker `index`): `owned` has one byte per vbucket, 1 for its own, and
`accepts` also has 1 for those a prepared map moves to this worker, so that
a client that adopted the commit before this worker did is not refused
(schema/README.md 6.3). The read path tests `accepts` once per route cache
miss (broky.server.shard.core `Shard.route`), as a scoped Subscribe does
(broky.server.shard.control). A publish for a vbucket this worker does not accept
is dropped and counted, and refused with a non-fatal NOT_MY_VBUCKET Error
that carries the frame back (`not_mine`), for the client to send to the
owner; the connection stays open.

A newer map from the master (`apply_map`) is taken at once (the Welcome of
later connections carries it, and the route cache is emptied) and pushed to
every welcomed client as a MapUpdate, a reply (never dropped). Clients answer
MapApplied once they follow it; the cluster moves vbuckets only when every
connection with subscriptions has (`map_ready`).

Sequences: a vbucket's offsets (broky.server.shard.sequences) count on the worker
that accepts its publishes. One that goes is handed over: its epoch and next
offset go to its new owner through etcd, and its retained messages stay here
for bounded reads that name it until it comes back (a former vbucket); one
that comes continues that sequence once it has it, or starts a new epoch
when it cannot come (broky.server.shard.moves `follow_sequences`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from broky import __version__
from broky.errors import ErrorCode
from broky.protocol import (
    MapUpdate,
    VBucketMap,
    Welcome,
    WelcomeTemplate,
    encode_frame,
    route_message,
)
from broky.server.shard.connection import OPEN, Connection
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    from broky.server.config import ServerConfig
    from broky.server.shard.stats import WorkerStats

log = logging.getLogger("broky.worker")


class Ownership:
    """The Shard's part that follows the vbucket map (a mixin of broky.server.shard.core.Shard)."""

    if TYPE_CHECKING:  # what it uses of the rest of the Shard
        config: ServerConfig
        index: int
        map: VBucketMap
        owned: bytes
        accepts: bytes
        welcome: WelcomeTemplate
        stats: WorkerStats
        conns: dict[int, Connection]

        def forget_routes(self) -> None: ...
        def follow_sequences(self, old: VBucketMap, before: bytes, after: bytes) -> None: ...
        def flush(self) -> None: ...
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

    def take_map(self, vmap: VBucketMap) -> None:
        """Own what `vmap` gives this worker (node `config.node_id`, worker `index`)."""
        me = vmap.node_index(self.config.node_id)
        mine = (me, self.index)
        old = self.map
        self.map = vmap
        self.owned = bytes(1 if owner == mine else 0 for owner in vmap.owners)
        incoming = vmap.incoming or ()
        accepted = self.accepts
        self.accepts = bytes(
            1 if owned or (incoming and incoming[vb] == mine) else 0 for vb, owned in enumerate(self.owned)
        )
        config = self.config
        self.welcome = WelcomeTemplate(
            Welcome(
                node_id=config.node_id,
                worker=self.index,
                map=vmap,
                max_frame_bytes=config.max_frame_bytes,
                max_pending_bytes=config.max_pending_bytes,
                server_version=__version__,
            )
        )
        self.forget_routes()
        # Sequences of the vbuckets that came or went (with the new routes: it may route held
        # input). The first map (this process's start) gives the vbuckets it owns new epochs
        # (Sequences); those a prepared map moves here await theirs like any that came.
        self.follow_sequences(old, accepted or self.owned, self.accepts)

    def apply_map(self, vmap: VBucketMap) -> None:
        """A newer map from the master: take it and push it to every client (MapUpdate).

        From now on a publish for a vbucket this worker no longer owns is refused
        with NOT_MY_VBUCKET (it carries the frame back for the client to resend).
        The MapUpdate is a reply: never dropped, behind what each connection has
        queued; clients answer MapApplied once they have followed it.
        """
        if vmap.version <= self.map.version:
            return
        self.take_map(vmap)
        frame = encode_frame(MapUpdate(vmap))
        for c in self.conns.values():
            if c.state == OPEN and not c.initial:  # welcomed (an older map): told
                self.reply(c, frame)
        self.flush()
        log.info(
            "worker %d applied map version %d: %d vbuckets owned", self.index, vmap.version, sum(self.owned)
        )

    def map_ready(self, version: int) -> dict[str, Any]:
        """Whether every connection with subscriptions has applied map `version`
        (MapApplied): the cluster moves vbuckets only then (schema/README.md 6.3)."""
        lagging = [c for c in self.conns.values() if c.state == OPEN and c.subs and c.map_applied < version]
        return {"version": self.map.version, "ready": not lagging, "lagging": len(lagging)}

    def not_mine(self, c: Connection, data: bytes, pos: int, end: int) -> None:
        """A publish for a vbucket this worker does not own: refused, with the frame
        itself in the Error so that the client can send it to the owner."""
        self.stats.dropped[DropReason.NOT_MY_VBUCKET] += 1
        c.refused += 1  # processed (Welcome.resumed.processed counts it), and refused
        kp = route_message(data, pos, end)[0]
        self.error(
            c,
            ErrorCode.NOT_MY_VBUCKET,
            f"key_partition {kp!r} is owned by another worker",
            refused=data[pos:end],
        )
