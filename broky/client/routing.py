"""The client's view of the vbucket map: `Router`.

Theory of operation
-------------------
The first Welcome carries the vbucket map. From then on the client keeps one
`Link` per (node, worker) it needs, opened lazily by `link` the first time a
publish or a subscription needs that worker. `route` is a 1024-entry table,
vbucket -> Link, filled on first use from the map (`fill`): a publish to
`vbucket_of(key_partition)` costs one list index once its vbucket was seen.

A Welcome (of any connection) whose map has another version makes the
client adopt it (`apply`): the route table and the publish path's cache of
Links are dropped, and the SubscriptionTable puts every subscription on the
Links the new map names.

NOT_MY_VBUCKET: a worker refuses a subscription (the Error names its sid) or
a publish (the Error carries the refused frame) for a vbucket it does not
own. The client then fetches a fresh map (a new Hello to the seed node, on a
connection of its own that is closed after the Welcome), adopts it and
resends the refused publishes to their owner in it (`resend_refused`): in
publish order per refusing worker, after anything published since to the
new owner, so order per key_partition holds except across a map change.
A refused publish is lost, counted in `stats.misrouted` and reported to
`on_error`, when the server did not return its frame, when the frame is
unreadable, when the map could not be refreshed, or when the fresh map
still names the worker that refused it; one the new owner cannot take (it
is down with a full buffer, or was given up) is counted in `stats.refused`.
`flush` waits for the refresh and the resends.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from broky.client.connection import open_connection
from broky.client.link import Link, LinkOwner, WorkerRef
from broky.client.subscription_table import SubscriptionTable
from broky.client.url import ServerAddress
from broky.errors import BrokyConnectionError, BrokyError, ProtocolError, RemoteProtocolError, ServerError
from broky.protocol import VBUCKETS, Hello, VBucketMap, route_message, vbucket_of


class RouterOwner(LinkOwner, Protocol):
    """What the Router needs from its client (`broky.client.client.Client` is one)."""

    address: ServerAddress  # the seed server, as given to `connect`

    def _forget_routes(self) -> None:
        """Drop the publish path's cache of Links (the map changed)."""


class Router:
    """The map, the route table and the Links of one client; follows map changes."""

    def __init__(self, owner: RouterOwner, subscriptions: SubscriptionTable) -> None:
        self.owner = owner
        self.subscriptions = subscriptions
        self.map: VBucketMap | None = None
        self.route: list[Link | None] = [None] * VBUCKETS  # vbucket -> Link, filled by `fill`
        self.links: dict[WorkerRef, Link] = {}
        self.seed_node = ""  # the node of the first connection; fresh maps are asked there
        self.refreshing: asyncio.Task[None] | None = None
        # publishes refused with NOT_MY_VBUCKET, to resend once the map is fresh: (refused by, frame)
        self.to_resend: list[tuple[Link, bytes]] = []

    # ---------------------------------------------------------------- lookups

    def fill(self, vb: int) -> Link:
        """The Link owning vbucket `vb` per the map (opened if needed), now in `route`."""
        assert self.map is not None
        node, worker = self.map.owners[vb]
        link = self.link(self.map.nodes[node].node_id, worker)
        self.route[vb] = link
        return link

    def owner_link(self, partition: bytes) -> Link:
        """The Link of the worker that owns `partition`."""
        vb = vbucket_of(partition)
        return self.route[vb] or self.fill(vb)

    def all_links(self) -> list[Link]:
        """The Links of every worker of the map (opening those not open yet)."""
        assert self.map is not None
        return [self.link(node.node_id, w) for node in self.map.nodes for w in range(node.workers)]

    def link(self, node_id: str, worker: int) -> Link:
        """The Link of that worker; a new one starts connecting."""
        ref = WorkerRef(node_id, worker)
        link = self.links.get(ref)
        if link is None:
            link = self.links[ref] = Link(self.owner, node_id, worker)
            link.start(reconnect=False)
        return link

    def address_of(self, node_id: str) -> tuple[str, int]:
        """Where node `node_id` listens: the seed's address as given, others' per the map."""
        if node_id == self.seed_node or self.map is None:
            return self.owner.address
        for node in self.map.nodes:
            if node.node_id == node_id:
                return node.host, node.port
        return self.owner.address

    # ---------------------------------------------------------------- map changes

    def take_map(self, vmap: VBucketMap) -> None:
        """The map of a Welcome: the first one, or a change to `apply`."""
        if self.map is None:
            self.map = vmap
        elif vmap.version != self.map.version:
            self.apply(vmap)

    def apply(self, vmap: VBucketMap) -> None:
        """Adopt a new map: re-route publishes, move subscriptions."""
        self.map = vmap
        self.route = [None] * VBUCKETS
        self.owner._forget_routes()
        self.owner.stats.map_refreshes += 1
        self.subscriptions.follow_map(self.all_links, self.owner_link)

    def not_my_vbucket(self, link: Link, err: ServerError, refused: bytes | None) -> None:
        """A worker refused a subscription or a publish: fetch the map, then move the
        subscription; a publish comes back in the Error and is sent again then."""
        if err.sid:
            self.subscriptions.refused(err.sid, link)
        elif refused is not None:
            self.to_resend.append((link, refused))
        else:  # a server that does not return the refused frame
            self.owner.stats.misrouted += 1
        if self.refreshing is None or self.refreshing.done():
            self.refreshing = self.owner._loop.create_task(self._refresh())

    async def _refresh(self) -> None:
        owner = self.owner
        host, port = self.address_of(self.seed_node)
        hello = Hello(client_name=owner.name, auth_token=owner.auth_token)
        try:
            proto, welcome = await open_connection(host, port, hello, owner.connect_timeout)
        except BrokyError as exc:
            owner._report(BrokyConnectionError(f"cannot refresh the vbucket map: {exc}"))
            self.resend_refused(refresh_failed=True)
            return
        proto.close()
        owner._welcome(welcome)
        self.apply(welcome.map)
        self.resend_refused()

    def resend_refused(self, refresh_failed: bool = False) -> None:
        """Send the publishes refused with NOT_MY_VBUCKET to their owner in the fresh map.

        In publish order per refusing worker (the Errors came in that order), after
        anything published since to the new owner: order per key_partition holds
        except across a map change. A publish the fresh map still routes to the
        worker that refused it (or with no map) is dropped, counted in
        `stats.misrouted` and reported.
        """
        stats = self.owner.stats
        report = self.owner._report
        pending, self.to_resend = self.to_resend, []
        for refused_by, frame in pending:
            try:
                kp = route_message(frame, 0, len(frame))[0]
                link = None if refresh_failed else self.owner_link(kp)
            except ProtocolError as exc:  # not a Message frame: the server broke the protocol
                stats.misrouted += 1
                report(RemoteProtocolError(f"NOT_MY_VBUCKET returned an unreadable frame: {exc}"))
                continue
            if link is None or link is refused_by:
                stats.misrouted += 1
                why = "the map could not be refreshed" if link is None else "it owns it per the map"
                report(
                    BrokyError(
                        f"worker {refused_by.ref.worker} refused a publish to key_partition {kp!r} "
                        f"and {why}: the message is dropped"
                    )
                )
                continue
            try:
                link.send(frame)
            except BrokyError as exc:  # the owner is down and its buffer is full, or given up
                stats.refused += 1
                report(exc)
                continue
            stats.resent += 1

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Close every Link; publishes they still buffer while down, and refused ones
        waiting for a fresh map, are dropped and counted in `stats.unsent_on_close`."""
        stats = self.owner.stats
        for link in self.links.values():
            stats.unsent_on_close += len(link.out) if link.proto is None else 0
            link.close()
        if self.refreshing is not None:
            self.refreshing.cancel()
        stats.unsent_on_close += len(self.to_resend)  # refused, waiting for a fresh map
        self.to_resend.clear()


__all__ = ["Router", "RouterOwner"]
