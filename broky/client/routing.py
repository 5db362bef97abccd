"""The client's view of the vbucket map: `Router`.

Theory of operation
-------------------
The first Welcome carries the vbucket map. From then on the client keeps one
`Link` per (node, worker) it needs, opened lazily by `link` the first time a
publish or a subscription needs that worker. `route` is a 1024-entry table,
vbucket -> Link, filled on first use from the map (`fill`): a publish to
`vbucket_of(key_partition)` costs one list index once its vbucket was seen.

Following the map. A server pushes every newer map to every connection
(MapUpdate), and a Welcome carries the current one; a map with a higher
version is adopted at once (`apply`):

- the route table and the publish path's cache of Links are dropped;
- vbuckets that changed owner (a node joined, left or died): the new
  owner's Link is fenced (it writes nothing) until every Link that used to own
  one of them has answered a round trip (`_settle_moves`): that old owner
  processed, or refused with NOT_MY_VBUCKET, every publish sent to it before
  (the refused ones come back in the Errors, before the Pong). The refused
  publishes go to the new owner first (`Link.send_first`), then what was
  published since: the order of one key_partition's publishes from this
  client holds across the move. A connected old owner's publishes not yet
  written go to the new owner at once, likewise. An old owner that is down
  keeps them: its lost connection's unconfirmed publishes come before them;
  the new owner waits until it reconnected (its account says which ones to
  send again; the worker refuses them and they come back as above) or left
  the map, at most `flush_timeout`. So does one whose connection drops
  before it answered (a draining node says Goodbye: what it did not process
  waits in its Link until the node leaves the map, then goes first);
- a node that is no longer in the map: its Links are retired (`retire`;
  one still connected first answers a round trip, or says Goodbye, so that
  what it processed is known): their unconfirmed publishes (no server can
  account for them any more) are sent again if they carry a uid (the
  client's subscribers drop the duplicates this may cause: see
  broky.client.client `drop_duplicates`),
  else counted as possibly lost; then their buffered publishes, each to its
  new owner, ahead of anything published since;
- the SubscriptionTable puts every subscription on the Links the new map
  names, partition-scoped ones also on the owner their vbucket is moving to
  (`incoming`), so that no delivery is missed while it moves; one that
  reaches a new owner only after the move (a commit without this client's
  MapApplied) starts there `since` what the old owner's Link received of the
  moved vbuckets (`Link.carry_from`): the new owner continues their
  sequences, so it replays what it accepted meanwhile;
- once every Link carrying subscriptions has confirmed them (a round trip),
  the client says MapApplied on every connection (broky.client.client): the
  cluster moves vbuckets only when every subscriber is in place
  (schema/README.md section 6.3).

NOT_MY_VBUCKET: a worker refuses a subscription (the Error names its sid) or
a publish (the Error carries the refused frame) for a vbucket it does not
own. If the Error's map version is not newer than the client's map, the map
is current (the refusal followed a move the client already knows of): the
publish goes to its owner now. Otherwise the client fetches a fresh map (a
Hello to a node of the map, or a seed, on a connection of its own that is
closed after the Welcome), adopts it, then resends (`resend_refused`). A
refused publish is lost, counted in `stats.misrouted` and reported to
`on_error`, when the server did not return its frame, when the frame is
unreadable, when the map could not be refreshed, or when the fresh map still
names the worker that refused it; one the new owner cannot take (it is down
with a full buffer, or was given up) is counted in `stats.refused`. `flush`
waits for the refresh and the resends.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from broky.client.connection import open_connection
from broky.client.link import Link, LinkOwner, WorkerRef, frames_in
from broky.client.subscription_table import SubscriptionTable
from broky.client.url import ServerAddress
from broky.errors import (
    BrokyConnectionError,
    BrokyError,
    ErrorCode,
    NotMyVBucketError,
    ProtocolError,
    RemoteProtocolError,
    ServerError,
)
from broky.protocol import NO_OWNER, VBUCKETS, Hello, VBucketMap, route_message, vbucket_of


class RouterOwner(LinkOwner, Protocol):
    """What the Router needs from its client (`broky.client.client.Client` is one), beyond
    what its Links need."""

    address: ServerAddress  # the seed that answered the first Hello
    seeds: list[ServerAddress]  # every seed given to `connect`
    flush_timeout: float

    def forget_routes(self) -> None:
        """Drop the publish path's cache of Links (the map changed)."""

    def map_applied(self, version: int) -> None:
        """The map `version` is in place: say MapApplied once the subscriptions are confirmed."""

    def drop_duplicates(self, tail: list[tuple[bytes, int]]) -> None:
        """Publishers may send again what a lost connection delivered last: drop those uids."""


def _owner_ref(vmap: VBucketMap, owner: tuple[int, int]) -> WorkerRef:
    return WorkerRef(vmap.nodes[owner[0]].node_id, owner[1])


def _address_in(vmap: VBucketMap, node_id: str) -> tuple[str, int] | None:
    for node in vmap.nodes:
        if node.node_id == node_id:
            return node.host, node.port
    return None


def one_cluster(a: tuple[str, VBucketMap], b: tuple[str, VBucketMap]) -> bool:
    """Two Welcomes' (node_id, map) come from one server or cluster: either map names the
    other's node; or both are the same node, at the address its maps give (a standalone
    server's node id is its host name: two servers on one host share it)."""
    (node_a, map_a), (node_b, map_b) = a, b
    if node_a == node_b:
        return _address_in(map_a, node_a) == _address_in(map_b, node_b)
    return _address_in(map_a, node_b) is not None or _address_in(map_b, node_a) is not None


def listed(vmap: VBucketMap, port: int, hosts: list[str]) -> bool:
    """Some node of `vmap` listens at `port` of one of `hosts` (a seed's name and addresses)."""
    return any(node.port == port and node.host in hosts for node in vmap.nodes)


def _kp(frame: bytes) -> bytes | None:
    try:
        return route_message(frame, 0, len(frame))[0]
    except ProtocolError:
        return None


class Router:
    """The map, the route table and the Links of one client; follows map changes."""

    def __init__(self, owner: RouterOwner, subscriptions: SubscriptionTable) -> None:
        self.owner = owner
        self.subscriptions = subscriptions
        self.map: VBucketMap | None = None
        self.route: list[Link | None] = [None] * VBUCKETS  # vbucket -> Link, filled by `fill`
        self.links: dict[WorkerRef, Link] = {}
        self.applied = 0  # the latest map version this client said MapApplied for
        self.seed_node = ""  # the node of the first connection; the seed's address reaches it...
        self.seed_advertised: tuple[str, int] | None = None  # ...while the map names it here
        self.refreshing: asyncio.Task[None] | None = None
        self.settling: set[asyncio.Task[None]] = set()  # moves waiting for old owners (`apply`)
        self.retired: list[Link] = []  # retired Links with publishes possibly lost, until a flush
        # +1 per map adopted and per move settled: a flush whose round trips saw it change
        # does them again (what a fence kept back may have been written after its Pings)
        self.changes = 0
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

    def incoming_link(self, partition: bytes) -> Link | None:
        """The Link of the worker `partition` is moving to, if it is moving."""
        vmap = self.map
        if vmap is None or vmap.incoming is None:
            return None
        owner = vmap.incoming[vbucket_of(partition)]
        if owner == NO_OWNER:
            return None
        return self.link(*_owner_ref(vmap, owner))

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

    def set_seed(self, node_id: str, vmap: VBucketMap) -> None:
        """The first Welcome came from `node_id`, whose map names it as in `vmap`."""
        self.seed_node = node_id
        self.seed_advertised = _address_in(vmap, node_id)

    def address_of(self, node_id: str) -> tuple[str, int]:
        """Where node `node_id` listens: per the map; the seed node at the seed's address
        as given (it may be the only one that reaches it, e.g. through NAT) as long as
        the map names it where it did then (a node started again may listen elsewhere)."""
        if self.map is None:
            return self.owner.address
        advertised = _address_in(self.map, node_id)
        if advertised is None or (node_id == self.seed_node and advertised == self.seed_advertised):
            return self.owner.address
        return advertised

    # ---------------------------------------------------------------- map changes

    def take_map(self, vmap: VBucketMap) -> None:
        """A map from a Welcome or a MapUpdate: the first one, or a newer one to `apply`."""
        if self.map is None:
            self.map = vmap
        elif vmap.version > self.map.version:
            self.apply(vmap)

    def apply(self, vmap: VBucketMap) -> None:
        """Adopt a newer map (see the module's header)."""
        old, self.map = self.map, vmap
        self.changes += 1
        self.route = [None] * VBUCKETS
        self.owner.forget_routes()
        self.owner.stats.map_refreshes += 1
        gained: set[Link] = set() if old is None else self._hand_over(old, vmap)
        self.subscriptions.follow_map(self.all_links, self.owner_link, self.incoming_link)
        late = [link for link in gained if link.subs] if self.applied < vmap.version - 1 else []
        if late:
            # Vbuckets moved without this client's MapApplied for their prepared map (the
            # leader's move timeout, or a prepared map it never saw): its subscriptions
            # reach their new owners only now. What those routed before is lost to it, and
            # nobody can say how much: told once the subscriptions are in place there.
            task = self.owner.loop.create_task(self._tell_when_placed(late))
            self.settling.add(task)
            task.add_done_callback(self.settling.discard)
        self.owner.map_applied(vmap.version)

    def _hand_over(self, old: VBucketMap, new: VBucketMap) -> set[Link]:
        """The vbuckets that changed owner: fence their new owners until the old ones
        answered; retire the Links of nodes no longer in the map. Returns the new owners."""
        moved: dict[Link, set[Link]] = {}  # new owner -> the old owners it waits for
        moved_vbs: dict[Link, set[int]] = {}  # old owner -> the vbuckets it lost
        moves: dict[tuple[Link, Link], set[int]] = {}  # (new owner, old owner) -> vbuckets
        for vb in range(VBUCKETS):
            before = _owner_ref(old, old.owners[vb])
            after = _owner_ref(new, new.owners[vb])
            if before == after:
                continue
            old_link = self.links.get(before)
            if old_link is None:
                continue  # nothing was ever sent there
            new_link = self.link(*after)
            moved.setdefault(new_link, set()).add(old_link)
            moved_vbs.setdefault(old_link, set()).add(vb)
            moves.setdefault((new_link, old_link), set()).add(vb)
        for new_link in moved:
            new_link.fence()
        # Subscriptions that reach a new owner only now go on from what the old one
        # delivered (its sequences go on there: same epoch, next offset).
        for (new_link, old_link), vbs in moves.items():
            new_link.carry_from(old_link, vbs)
        nodes = {n.node_id for n in new.nodes}
        # Publishes a connected old owner has not written yet (they wait for the next
        # write): to their new owner now, ahead of anything published from now on. Not
        # those of an old owner that is down: its lost connection's unconfirmed publishes
        # come before them, and go first (a Link that leaves: `retire`; one that
        # reconnects: sent again to it, refused, resent in order while the new owner is
        # fenced).
        for old_link, vbs in moved_vbs.items():
            if old_link.out and old_link.proto is not None and old_link.ref.node_id in nodes:
                keep = []
                for frame in frames_in(old_link.out):
                    kp = _kp(frame)
                    if kp is not None and vbucket_of(kp) in vbs:
                        self.owner_link(kp).send_first([frame])
                    else:
                        keep.append(frame)
                old_link.out = keep
                old_link.out_bytes = sum(len(f) for f in keep)
                old_link.out_extra = 0
        for ref, link in list(self.links.items()):
            if ref.node_id not in nodes:
                self.retire(link)  # at once: `_settle_moves` does not wait for it
        for new_link, olds in moved.items():
            task = self.owner.loop.create_task(self._settle_moves(new_link, olds))
            self.settling.add(task)
            task.add_done_callback(self.settling.discard)
        return set(moved)

    async def _tell_when_placed(self, links: list[Link]) -> None:
        """Tell that deliveries of `links` may have been lost (UNACCOUNTED), once the
        subscriptions just sent to them are in place (a round trip; flush_timeout at most)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.owner.flush_timeout):
                await asyncio.gather(*(link.round_trip() for link in links), return_exceptions=True)
        for link in links:
            self.owner.loss_unaccounted(link.ref)

    async def _settle_moves(self, new_link: Link, olds: set[Link]) -> None:
        """Lift `new_link`'s fence once every old owner of its new vbuckets answered a round
        trip (their NOT_MY_VBUCKET refusals came back first and were resent)."""
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.owner.flush_timeout):
                    await asyncio.gather(*(self._answered(o) for o in olds), return_exceptions=True)
            if self.to_resend:
                self.resend_refused()
        finally:
            new_link.lift_fence()
            self.changes += 1

    @staticmethod
    async def _answered(old: Link) -> None:
        """`old` processed what it was sent (its refusals came back): a round trip; if it
        is down, once it reconnected (and sent its unprocessed publishes again) or left.
        A connection that drops before the Pong (a draining node's Goodbye, a crash)
        left its unprocessed publishes in `old`, to be sent again: wait again."""
        while not old.retired and old.failed is None and not old.client.is_closed:
            if old.proto is None:
                await old.up.wait()  # set once connected again, retired or given up
                continue
            try:
                # written now, past anything fenced: an old owner may be fenced too
                await old.ping_now()
                return
            except BrokyConnectionError:
                continue

    def retire(self, link: Link) -> None:
        """`link`'s node left the map, now: what it had goes to the new owners, ahead
        of anything published to them since (they are fenced until then: `_hand_over`).

        A node leaves the map once it is dead (its lease expired, its vbuckets moved
        away) or once it has drained and stopped (it said Goodbye before leaving). It is
        not waited for: a frozen node would stop the traffic of every vbucket moved
        from it (and of every other vbucket of their new owners) for as long as it was
        waited for. So its publishes that no Pong or Goodbye confirmed are settled as
        without an account (sent again if they carry a uid, else counted as possibly
        lost), its connection is closed, the uids of its last deliveries are dropped
        as copies for a while, and a subscriber is told that deliveries may have been
        lost with it when it ended without a Goodbye.
        """
        del self.links[link.ref]
        self.subscriptions.forget_link(link)
        carried = bool(link.subs)
        clean = link.ended_cleanly()
        out, doubt, tail = link.retire()
        self.owner.drop_duplicates(tail)  # publishers may send its last deliveries again
        if doubt is not None:
            link.in_doubt = doubt
            link.settle(None)  # resends through `send_again`, or counts
        self.send_again(out)
        if carried and not clean:
            self.owner.loss_unaccounted(link.ref)
        self.owner.epochs_settled(link.epochs_held())  # told once, or nothing lost (a Goodbye)
        if link.unconfirmed:
            self.retired.append(link)  # its possible losses, for the next flush

    def send_again(self, frames: list[bytes]) -> None:
        """Publishes a Link cannot deliver (its node is gone, or its connection was lost
        without an account): each to the owner of its key_partition, ahead of newer ones."""
        for frame in frames:
            kp = _kp(frame)
            if kp is not None:
                self.owner_link(kp).send_first([frame])

    def not_my_vbucket(self, link: Link, err: ServerError, refused: bytes | None) -> None:
        """A worker refused a subscription or a publish (see the module's header)."""
        if err.sid:
            self.subscriptions.refused(err.sid, link)
        elif refused is not None:
            self.to_resend.append((link, refused))
        else:  # a server that does not return the refused frame
            self.owner.stats.misrouted += 1
        current = self.map is not None and err.map_version <= self.map.version
        if current and not err.sid:
            if self.settling:  # the move's settling resends, in order, after the round trips
                return
            if self.resend_refused(final=False):
                return
            # the map still names the worker that refused: ours is wrong after all
        if self.refreshing is None or self.refreshing.done():
            self.refreshing = self.owner.loop.create_task(self._refresh())

    async def refresh(self) -> None:
        """Ask for a fresh map now (`_refresh`), or wait for the refresh under way."""
        if self.refreshing is None or self.refreshing.done():
            self.refreshing = self.owner.loop.create_task(self._refresh())
        await asyncio.shield(self.refreshing)

    async def _refresh(self) -> None:
        """A fresh map from any node that answers: the seed node, the map's nodes, the seeds."""
        owner = self.owner
        hello = Hello(client_name=owner.name, auth_token=owner.auth_token)
        candidates: list[tuple[str, int]] = [self.address_of(self.seed_node)]
        if self.map is not None:
            candidates += [(n.host, n.port) for n in self.map.nodes]
        candidates += [(s.host, s.port) for s in owner.seeds]
        last: BrokyError | None = None
        for host, port in dict.fromkeys(candidates):
            try:
                proto, welcome = await open_connection(
                    host, port, hello, owner.connect_timeout, tls=owner.tls
                )
            except BrokyError as exc:
                last = exc
                continue
            proto.close()
            owner.take_welcome(welcome)
            if self.map is None or welcome.map.version > self.map.version or welcome.map != self.map:
                self.apply(welcome.map)  # newer, or ours was wrong (a worker refused what it named)
            self.resend_refused()
            return
        owner.report_error(BrokyConnectionError(f"cannot refresh the vbucket map: {last}"))
        self.resend_refused(refresh_failed=True)

    def resend_refused(self, refresh_failed: bool = False, final: bool = True) -> bool:
        """Send the publishes refused with NOT_MY_VBUCKET to their owner in the current map.

        In publish order per refusing worker (the Errors came in that order), ahead of
        what was published since to the new owner (`Link.send_first`). A publish the
        map still routes to the worker that refused it (or with no map) is dropped,
        counted in `stats.misrouted` and reported; unless not `final`: then it, and
        every later one, waits for a fresh map, and False is returned.
        """
        stats = self.owner.stats
        report = self.owner.report_error
        pending, self.to_resend = self.to_resend, []
        if not final:
            for i, (refused_by, frame) in enumerate(pending):
                kp = _kp(frame)
                if kp is not None and self.owner_link(kp) is refused_by:
                    self.to_resend = pending[i:]
                    pending = pending[:i]
                    break
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
                    NotMyVBucketError(
                        ErrorCode.NOT_MY_VBUCKET,
                        f"worker {refused_by.ref.worker} refused a publish to key_partition {kp!r} "
                        f"and {why}: the message is dropped",
                    )
                )
                continue
            if link.failed is not None:  # given up
                stats.refused += 1
                report(link.gave_up_error())
                continue
            link.send_first([frame])
            stats.resent += 1
        return not self.to_resend

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Close every Link; publishes they still buffer while down, and refused ones
        waiting for a fresh map, are dropped and counted in `stats.unsent_on_close`."""
        stats = self.owner.stats
        for task in list(self.settling):
            task.cancel()
        for link in self.links.values():
            stats.unsent_on_close += len(link.out) + link.out_extra if link.proto is None else 0
            link.close()
        if self.refreshing is not None:
            self.refreshing.cancel()
        stats.unsent_on_close += len(self.to_resend)  # refused, waiting for a fresh map
        self.to_resend.clear()


__all__ = ["Router", "RouterOwner", "listed", "one_cluster"]
