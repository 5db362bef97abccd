"""The shard-aware asyncio client: `Client` and `connect`.

Theory of operation
-------------------
The Client is the facade; each concern has its module:

- broky.client.publisher: the publish path, from `publish`'s arguments to a
  frame queued on a Link (the Client inherits it, so the fast path pays no
  delegation);
- broky.client.routing: the client's view of the vbucket map (the Router:
  route table, Links by worker, map changes, NOT_MY_VBUCKET);
- broky.client.link: the Link, the logical connection to one worker
  (batching, reconnecting, keepalive, inbound dispatch, delivery accounting);
- broky.client.subscription_table and broky.client.subscription: which
  Links carry each subscription, and a subscription's local queue;
- broky.client.groups: group members' settings, their deliveries
  (GroupMessage) and the batching of their acknowledgements (`acks`);
- broky.client.stats: the counters;
- broky.client.reader: bounded reads (`read`, `positions`), on connections
  of their own.

This module keeps the options, the lifecycle (`connect`, `close`), `flush`,
`subscribe` and the callbacks.

The SDK's modules ask the Client for what they need by name, never by
reaching for its private members: each module declares what it needs as a
Protocol (LinkOwner in broky.client.link, RouterOwner in
broky.client.routing, SubscriptionOwner in broky.client.subscription,
ReadOwner in broky.client.reader), and the Client's members that serve them
(`router`, `loop`, `max_frame`, `duplicate_uids`, `report_error`,
`take_welcome`, `pause_subscription`, `publish_rows`, ...) are documented as
for the SDK's own modules: they are not part of the API for users.

The first connection says Hello with worker=-1; its Welcome carries the
vbucket map, the worker it landed on and the server's max_frame_bytes. It is
retried until connect_timeout, a refused connection too: a program started
beside its server (compose, systemd, a test fixture) is refused until the
server listens. `wait_for_server=False` (the `broky` commands) makes a round
in which every seed refused fail at once with NoServerError; an address that
does not answer gets the timeout either way. Reconnects (broky.client.link)
never take this path: they retry until max_reconnect_attempts. From
then on the Router keeps one `Link` per (node, worker) the client needs,
created lazily; a Link survives reconnects, and under it a
`WorkerProtocol` is one TCP connection.

`subscribe` registers the subscription with the SubscriptionTable, which
sends it to every worker (all partitions) or to the owner of its partition,
then waits for a Ping/Pong round trip on every Link that is up (or making
its first attempt), so those workers have the subscription when it returns;
a Link that is down sends it when it reconnects. A worker that refused it
with SUBSCRIPTION_LIMIT or BAD_GROUP during that round trip makes `subscribe`
remove it everywhere and raise the ServerError (later refusals are reported
to `on_error`).

`flush` sends a Ping on every Link and waits for every Pong: the server
answers only after processing every frame received before the Ping. It also
waits for a map refresh under way and the resend of the publishes refused
with NOT_MY_VBUCKET. A connection that dropped with publishes written to it
but not confirmed by a Pong makes the next `flush` raise
BrokyConnectionError (see `Link`). A Link that is down is waited for until
it reconnects or is retired (its node left the map): then what it carried
went to the new owners or was counted (`Router.retire`), and the round
trips start again on the current map's Links, as they do whenever the map
changed or a move settled while they ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import logging
import random
from collections.abc import Callable, Generator, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from broky.client.connection import WorkerProtocol, open_connection, resolve
from broky.client.groups import (
    DEFAULT_ACK_WAIT,
    DEFAULT_BACKOFF,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    AckBatcher,
    GroupMessage,
    group_spec,
)
from broky.client.inbox import GROUP_MAX_PENDING_MSGS
from broky.client.link import Link, WorkerRef, uids_in
from broky.client.losses import LossLog
from broky.client.publisher import Publisher
from broky.client.reader import END_OF_TIME, PositionLike, Reading, ReadVia, as_positions, as_vbuckets
from broky.client.routing import Router, listed, one_cluster
from broky.client.stats import ClientStats
from broky.client.subscription import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_PENDING_MSGS,
    Callback,
    Subscription,
)
from broky.client.subscription_table import SubscriptionTable
from broky.client.url import ServerAddress, parse_servers, wants_tls
from broky.errors import (
    AuthenticationError,
    BrokyConnectionError,
    BrokyError,
    BrokyTimeoutError,
    ClientClosedError,
    NoServerError,
    NotBrokyError,
    SeedsDisagreeError,
    ServerError,
    SlowConsumerError,
    UntrustedCertificateError,
)
from broky.matching import parse_pattern
from broky.protocol import NO_OWNER, Hello, LossReason, MapApplied, Message, VBucketMap, Welcome
from broky.protocol.frames import Position, encode_map_applied

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("broky.client")


def _describe(welcome: Welcome) -> str:
    """A Welcome's node and map in a few words: "node 'a' of a map of 3 nodes (a, b, c)"."""
    names = [n.node_id for n in welcome.map.nodes]
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"node {welcome.node_id!r} of a map of {len(names)} node{'s' * (len(names) != 1)} ({shown})"


DEFAULT_CONNECT_TIMEOUT = 5.0
TLS_CLOSE_TIMEOUT = 1.0  # close waits this long for the server's close_notify, then aborts
DEFAULT_LINGER = 0.0
DEFAULT_BATCH_SIZE = 128 << 10  # 64 KiB: 7 % more client CPU per publish (bench/README.md)
DEFAULT_MAX_RECONNECT_BUFFER_BYTES = 8 << 20
DEFAULT_FLUSH_TIMEOUT = 10.0
DEFAULT_RECONNECT_MIN_DELAY = 0.05
DEFAULT_RECONNECT_MAX_DELAY = 2.0
# A connection that stops answering (a network cut that sends no reset, a
# frozen peer) is noticed by Pings: one every DEFAULT_PING_INTERVAL while
# connected; when DEFAULT_MAX_OUTSTANDING_PINGS are unanswered as the next is
# due, the connection is closed and the normal reconnect follows, so a dead
# link is found within 20-30 s. Why 10 s and not nats.py's 2 minutes: a
# publisher blocked on a dead socket should give up on the scale of the other
# deadlines (flush_timeout 10 s, the server's slow-consumer deadline 10 s),
# and the server answers a Ping right after the frames before it, so 20 s of
# silence is not a busy server. The cost is one small Ping and Pong per
# connection per 10 s, nothing per message.
DEFAULT_PING_INTERVAL = 10.0
DEFAULT_MAX_OUTSTANDING_PINGS = 2
# While publishing, a Ping goes with a write at most this often: the Pongs
# confirm what the server processed, so a connection that drops leaves only a
# few milliseconds of publishes in doubt (about 250 at 50k msgs/s), and the
# chunks kept for a resend stay small. One small Ping and Pong per 5 ms per
# publishing connection; nothing per message.
DEFAULT_CONFIRM_INTERVAL = 0.005
# How long the uids of a lost connection's last deliveries are dropped on arrival
# (publishers resend their unconfirmed publishes once they reach a server again:
# after a reconnect, or after the cluster moved a dead node's vbuckets).
DUPLICATE_WINDOW = 60.0
# Epochs of worker processes whose lost connections a client remembers as settled (a few per
# worker restart): the oldest are forgotten past this many.
SETTLED_EPOCHS = 4096


class ServerInfo(NamedTuple):
    """What the server said about itself in its latest Welcome."""

    node_id: str
    server_version: str | None
    workers: int
    map: VBucketMap
    max_frame_bytes: int
    max_pending_bytes: int


class Client(Publisher):
    """A shard-aware Broky client for asyncio; see `broky.connect`.

    Use `await broky.connect(...)` or ``async with broky.connect(...) as client``.
    Every method must be called from the event loop the client connected on.
    """

    def __init__(
        self,
        server: str | None = None,
        *,
        name: str | None = None,
        auth_token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        wait_for_server: bool = True,
        linger: float = DEFAULT_LINGER,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_reconnect_buffer_bytes: int = DEFAULT_MAX_RECONNECT_BUFFER_BYTES,
        flush_timeout: float = DEFAULT_FLUSH_TIMEOUT,
        reconnect_min_delay: float = DEFAULT_RECONNECT_MIN_DELAY,
        reconnect_max_delay: float = DEFAULT_RECONNECT_MAX_DELAY,
        max_reconnect_attempts: int | None = None,
        ping_interval: float | None = DEFAULT_PING_INTERVAL,
        max_outstanding_pings: int = DEFAULT_MAX_OUTSTANDING_PINGS,
        confirm_interval: float = DEFAULT_CONFIRM_INTERVAL,
        on_error: Callable[[BaseException], Any] | None = None,
        on_disconnect: Callable[[WorkerRef, BaseException | None], Any] | None = None,
        on_reconnect: Callable[[WorkerRef], Any] | None = None,
        on_loss: Callable[[WorkerRef, int, int], Any] | None = None,
    ) -> None:
        """Configure a client; `connect()` makes the first connection. See `broky.connect`.

        Raises:
            ValueError: an option is out of range (the message names it), or `server`
                is not a server address.
        """
        _check_options(
            batch_size=batch_size,
            linger=linger,
            connect_timeout=connect_timeout,
            flush_timeout=flush_timeout,
            max_reconnect_buffer_bytes=max_reconnect_buffer_bytes,
            reconnect_min_delay=reconnect_min_delay,
            reconnect_max_delay=reconnect_max_delay,
            max_reconnect_attempts=max_reconnect_attempts,
            ping_interval=ping_interval,
            max_outstanding_pings=max_outstanding_pings,
            confirm_interval=confirm_interval,
        )
        self.seeds: list[ServerAddress] = parse_servers(server)
        self.address: ServerAddress = self.seeds[0]  # the seed that answered the first Hello
        self.name = name
        # A user of the server's users file (--users) goes in the Hello's auth_token as
        # USER:PASSWORD (inside TLS when the connection has it; broky.server.security.users).
        self.auth_token = auth_token if user is None else f"{user}:{password or ''}"
        # TLS (broky+tls://, or an ssl_context): every connection of this client, to any
        # node of the map, upgrades to TLS with this context (schema/README.md 2.1).
        self.tls: ssl.SSLContext | None = ssl_context
        if self.tls is None and wants_tls(server):
            import ssl

            self.tls = ssl.create_default_context()  # the system's trust store
        self.connect_timeout = connect_timeout
        self.wait_for_server = wait_for_server
        self.linger = linger
        self.batch_size = batch_size
        self.max_reconnect_buffer_bytes = max_reconnect_buffer_bytes
        self.flush_timeout = flush_timeout
        self.reconnect_min_delay = reconnect_min_delay
        self.reconnect_max_delay = reconnect_max_delay
        self.max_reconnect_attempts = max_reconnect_attempts
        self.ping_interval = ping_interval
        self.max_outstanding_pings = max_outstanding_pings
        self.confirm_interval = confirm_interval
        self.on_error = on_error
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.on_loss = on_loss
        self.stats = ClientStats()
        self.server_info: ServerInfo | None = None
        # For the SDK's own modules (not for users): the event loop it connected on, the
        # server's max_frame_bytes (the blocking client's encoder), and its Router (the
        # vbucket map, the route table and the Links by worker).
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.max_frame = 0
        self._subscriptions = SubscriptionTable(self.report_error)
        self._losses = LossLog(lambda line: log.warning("broky client: %s", line))
        self.router = Router(self, self._subscriptions)
        self._connected = False
        self._closed = False
        self._open = False  # connected and not closed: the publish fast path's one check
        # uids that may arrive twice (see `drop_duplicates`), read by Link.on_message
        self.duplicate_uids: set[bytes] | None = None
        # Epochs of worker processes whose lost connections are settled (see `epochs_settled`).
        self._settled_epochs: dict[int, None] = {}
        self._dupes_timer: asyncio.TimerHandle | None = None
        # group members' settlements, batched per loop iteration (broky.client.groups)
        self.acks = AckBatcher(self.stats)
        super().__init__()  # the publish path's encoder and cache
        self._tasks: set[asyncio.Task[Any]] = set()

    def __repr__(self) -> str:
        return f"<broky.Client {self.address} links={list(self.router.links.values())}>"

    # ---------------------------------------------------------------- lifecycle

    async def connect(self) -> Client:
        """Make the first connection (retrying until connect_timeout) and read the map.

        With several seeds (a cluster's nodes), they are tried in turn, each
        attempt bounded by a share of connect_timeout, until one answers; the
        others that its map does not list are then asked for a Welcome (at the
        same time, a share at most): they must be nodes of the same server or
        cluster (`_check_seeds`).
        A refused connection is retried too (a server may be starting), unless
        wait_for_server is False: then a round in which every seed refused
        raises NoServerError at once.

        Returns:
            The client itself.

        Raises:
            BrokyConnectionError: the host name does not resolve, or no Welcome
                from the server within connect_timeout.
            NoServerError: every seed refused the connection (at once without
                wait_for_server, else for connect_timeout).
            AuthenticationError: the server refused the auth token.
            ServerError: the server refused the Hello for another reason.
            SeedsDisagreeError: a seed answered as a node of another server or
                cluster than the first one that answered (the other seeds that the
                first one's map does not list are asked for a Welcome too).
            ClientClosedError: the client was closed.
        """
        self._check_open()
        if self._connected:
            return self
        self.loop = loop = asyncio.get_running_loop()
        self.acks.bind(loop)
        deadline = loop.time() + self.connect_timeout
        delay = self.reconnect_min_delay
        hello = Hello(client_name=self.name, auth_token=self.auth_token)
        # once per seed: a name that does not resolve is its own failure, not retried
        resolved: list[tuple[ServerAddress, list[str]]] = []
        unresolved: list[BrokyConnectionError] = []
        for seed in self.seeds:
            try:
                resolved.append((seed, await resolve(seed.host, seed.port, self.connect_timeout)))
            except BrokyConnectionError as exc:
                unresolved.append(exc)
        if not resolved:
            raise (
                unresolved[0]
                if len(unresolved) == 1
                else BrokyConnectionError("; ".join(map(str, unresolved)))
            )
        share = max(self.connect_timeout / len(resolved), 0.5)  # one dead seed must not use it all
        last: BrokyError | None = None
        found: tuple[ServerAddress, WorkerProtocol, Welcome] | None = None
        while found is None:
            refused = 0
            for seed, addresses in resolved:
                left = deadline - loop.time()
                try:
                    proto, welcome = await open_connection(
                        seed.host, seed.port, hello, max(min(left, share), 0.001), addresses, self.tls
                    )
                    found = (seed, proto, welcome)
                    break
                except (ServerError, NotBrokyError, UntrustedCertificateError):
                    raise  # an answer: another try would get the same
                except BrokyError as exc:
                    refused += isinstance(exc, NoServerError)
                    if last is None or not isinstance(exc, BrokyTimeoutError):
                        last = exc  # keep "connection refused" rather than the last short timeout
            if found is not None:
                break
            tls = self.tls is not None
            if refused == len(resolved) and not self.wait_for_server:
                if isinstance(last, NoServerError) and not last.refused:  # closed without a word
                    raise NoServerError(str(last), refused=False) from None
                tried = ", ".join(seed.url(tls) for seed, _ in resolved)
                raise NoServerError(f"connection refused at {tried}: no server listens there") from None
            left = deadline - loop.time()
            if left <= 0:
                tried = ", ".join(seed.url(tls) for seed, _ in resolved)
                raise (NoServerError if refused == len(resolved) else BrokyConnectionError)(
                    f"cannot connect to {tried} within {self.connect_timeout:g} s: {last}"
                ) from None
            await asyncio.sleep(min(random.uniform(delay / 2, delay), left))
            delay = min(delay * 2, self.reconnect_max_delay)
        self.address, proto, welcome = found
        others = [
            (seed, hosts)
            for seed, hosts in resolved
            if seed != self.address and not listed(welcome.map, seed.port, [seed.host, *hosts])
        ]
        if others:
            try:
                await self._check_seeds(self.address, welcome, others, share)
            except BaseException:
                proto.close()
                raise
        self.router.set_seed(welcome.node_id, welcome.map)
        self.take_welcome(welcome)
        link = Link(self, welcome.node_id, welcome.worker)
        self.router.links[link.ref] = link
        link.attach(proto, welcome, reconnect=False)
        self._connected = True
        self._open = True
        return self

    async def _check_seeds(
        self,
        first: ServerAddress,
        welcome: Welcome,
        others: list[tuple[ServerAddress, list[str]]],
        bound: float,
    ) -> None:
        """The seeds the first one's map does not list (by address) must be one server or
        cluster with it (`routing.one_cluster`): each is asked for a Welcome (a Hello on a
        connection closed at once, all at the same time, `bound` seconds at most). One that
        does not answer, or refuses, is not judged: a cluster's seeds may name a dead node.

        Raises:
            SeedsDisagreeError: one answered as a node of another server or cluster.
        """
        hello = Hello(client_name=self.name, auth_token=self.auth_token)

        async def ask(seed: ServerAddress, hosts: list[str]) -> tuple[ServerAddress, Welcome] | None:
            try:
                proto, answer = await open_connection(seed.host, seed.port, hello, bound, hosts, self.tls)
            except BrokyError:
                return None
            proto.close()
            return seed, answer

        mine = (welcome.node_id, welcome.map)
        for answer in await asyncio.gather(*(ask(seed, hosts) for seed, hosts in others)):
            if answer is not None and not one_cluster(mine, (answer[1].node_id, answer[1].map)):
                raise SeedsDisagreeError(
                    f"the seeds are not one server or cluster: {first} is {_describe(welcome)}, "
                    f"{answer[0]} is {_describe(answer[1])}; give the address of one server, or "
                    "addresses of nodes of one cluster"
                )

    async def close(self) -> None:
        """Flush what can be flushed (up to flush_timeout), close every connection.

        The flush is `flush`'s: publishes queued for a worker whose connection
        is still being opened (a client's first publishes to a worker open its
        connection) or reopened are waited for, as are refused ones sent again
        on a fresh map. What the flush could not settle within flush_timeout
        is logged as a warning: publishes that may not have reached the
        server, and those still buffered for a worker that stayed down, which
        are dropped and counted in `stats.unsent_on_close`. Iterators of
        subscriptions end after the messages already received. Closing twice
        is harmless.
        """
        if self._closed:
            return
        try:
            if self._connected:
                await self.flush()
            else:
                self.acks.flush()
        except BrokyError as exc:
            log.warning("close: %s", exc)
        finally:
            protos = [link.proto for link in self.router.links.values() if link.proto is not None]
            self._close_now()
        # let the transports deliver connection_lost
        await asyncio.sleep(0)
        if self.tls is not None:  # a TLS close is a round trip (close_notify): wait for it, bounded
            deadline = self.loop.time() + TLS_CLOSE_TIMEOUT
            while any(not p.closed for p in protos) and self.loop.time() < deadline:
                await asyncio.sleep(0.005)
            for p in protos:
                if not p.closed:
                    p.abort()
            await asyncio.sleep(0)

    def _close_now(self) -> None:
        self._closed = True
        self._open = False
        unsent = self.stats.unsent_on_close
        self.router.close()
        unsent = self.stats.unsent_on_close - unsent
        if unsent:
            log.warning("close: %d publishes dropped: never sent (their worker stayed unreachable)", unsent)
        self._subscriptions.close()
        self._losses.close()
        for task in list(self._tasks):
            task.cancel()

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if not self._connected:
            raise BrokyConnectionError("the client is not connected; await connect() first")

    # ---------------------------------------------------------------- flushing

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every worker has processed everything published (and acknowledged) so far.

        A worker that is disconnected is waited for (it reconnects first, and
        a connection that drops during the flush is waited for again), until
        `timeout`; in a cluster, until its node leaves the map: what was sent
        to it then goes to the new owners (if it carries a uid, else it is
        counted as possibly lost: schema/README.md 7.1), and the flush waits
        for them. The flush fails if a publish may have been lost: publishes
        written to a connection that dropped before the server confirmed them
        (a Pong) are reported by the next flush, once (see
        `stats.unconfirmed_lost`).

        Args:
            timeout: seconds; default `flush_timeout`.

        Raises:
            BrokyTimeoutError: not every worker answered in time.
            BrokyConnectionError: since the previous flush, a connection dropped
                with publishes written to it but not confirmed (the message names
                each worker and how many may not have reached the server); or
                reconnecting to a worker was given up (max_reconnect_attempts).
            ClientClosedError: the client is closed.
        """
        self._check_open()
        timeout = self.flush_timeout if timeout is None else timeout
        self.acks.flush()  # group members' settlements so far: before the Pings
        try:
            async with asyncio.timeout(timeout):
                router = self.router
                while True:
                    changes = router.changes
                    links, results = await self._round_trips()
                    # Publishes refused with NOT_MY_VBUCKET came back in the Errors, before
                    # the Pongs: once the map is fresh they are sent again; wait for those
                    # too (a refused publish waits in `to_resend` only while a refresh or
                    # a move's settling is under way: both resend it when they end).
                    if router.refreshing is not None and not router.refreshing.done():
                        await asyncio.shield(router.refreshing)
                    elif router.settling:  # vbuckets moving: their new owners write once settled
                        await asyncio.wait(list(router.settling))
                    elif router.changes == changes and not any(link.retired for link in links):
                        break
                    # Else the map changed, or a move settled, during the round trips: what
                    # was kept back, or sent again to the new owners (a node that left:
                    # `Router.retire`), may have been written after their Pings. Again.
        except TimeoutError:
            down = [link.ref.worker for link in self.router.links.values() if link.proto is None]
            why = f" (down: workers {down})" if down else ""
            raise BrokyTimeoutError(f"flush did not complete within {timeout:g} s{why}") from None
        problems: list[str] = []
        retired, self.router.retired = self.router.retired, []
        for link in retired:  # Links whose node left the map with publishes possibly lost
            problems.append(
                f"worker {link.ref.worker} of {link.ref.node_id} (left the cluster): {link.unconfirmed} "
                "publishes may not have reached the server"
            )
        for link, result in zip(links, results, strict=True):
            unconfirmed, link.unconfirmed = link.unconfirmed, 0
            if unconfirmed:
                problems.append(
                    f"worker {link.ref.worker}: {unconfirmed} publishes may not have reached the server "
                    "(written to a connection that dropped before confirming them)"
                )
            if isinstance(result, BrokyConnectionError):  # given up
                problems.append(str(result))
            elif isinstance(result, BaseException):  # closed meanwhile, or a bug
                raise result
        if problems:
            raise BrokyConnectionError("flush: " + "; ".join(problems))

    async def _round_trips(self) -> tuple[list[Link], list[BaseException | None]]:
        """A round trip on every Link that is up, has something queued, gave up or lost publishes.

        A Link retired meanwhile (its node left the map) ends its round trip at once; its
        publishes were settled by the rule of schema/README.md 7.1 (sent again to their
        new owners, or counted for `flush` to report: `Router.retire`), and `flush`
        starts again on the Links of the current map."""
        links = [
            link
            for link in self.router.links.values()
            if link.proto is not None or link.out or link.failed is not None or link.unconfirmed
        ]
        results = await asyncio.gather(*(link.round_trip() for link in links), return_exceptions=True)
        return links, results

    # ---------------------------------------------------------------- subscribing

    # A plain subscription's messages are Messages, a group member's GroupMessages (the
    # overloads say so to a type checker; a group member takes no since, since_time, last).
    @overload
    async def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        callback: Callable[[Message], Any] | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        since: Iterable[PositionLike] = (),
        since_time: int | float | datetime.datetime | None = None,
        last: int = 0,
        group: None = None,
        on_loss: Callable[[int, int], Any] | None = None,
    ) -> Subscription[Message]: ...

    @overload
    async def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        callback: Callable[[GroupMessage], Any] | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        group: str,
        key_shared: bool = False,
        ack: bool = False,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        backoff: Iterable[float] = DEFAULT_BACKOFF,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        dead_letter: bytes | str | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> Subscription[GroupMessage]: ...

    @overload
    async def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        callback: Callback | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        since: Iterable[PositionLike] = (),
        since_time: int | float | datetime.datetime | None = None,
        last: int = 0,
        group: str | None = None,
        on_loss: Callable[[int, int], Any] | None = None,
        key_shared: bool = False,
        ack: bool = False,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        backoff: Iterable[float] = DEFAULT_BACKOFF,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        dead_letter: bytes | str | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> Subscription[Any]: ...

    async def subscribe(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        callback: Callable[[Any], Any] | None = None,
        max_pending_msgs: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        since: Iterable[PositionLike] = (),
        since_time: int | float | datetime.datetime | None = None,
        last: int = 0,
        group: str | None = None,
        on_loss: Callable[[int, int], Any] | None = None,
        key_shared: bool = False,
        ack: bool = False,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        backoff: Iterable[float] = DEFAULT_BACKOFF,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        dead_letter: bytes | str | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> Subscription[Any]:
        """Subscribe to keys matching `pattern`.

        Args:
            pattern: dot-separated tokens; `*` = one token, `>` (last) = one or more.
            partition: only messages of this key_partition (sent to its owner
                worker only); None = every partition (sent to every worker).
            callback: called with each Message instead of queueing it for
                iteration; a coroutine function is awaited, one message at a time.
            max_pending_msgs, max_pending_bytes: bound of the local queue; once
                it is full the connections that carry the subscription are
                paused (the server keeps their deliveries queued, under its own bound)
                until the queue is down to half (see broky.client.subscription).
                None: 65,536 messages, or for a group member GROUP_MAX_PENDING_MSGS
                (1,000): the server gives a member less once its queue is full and
                its connection paused, so a smaller queue keeps a slow member's share
                close to its speed (bench/results/groups.md).
            since: positions to go on from (a previous subscription's `positions()`):
                per vbucket, the retained messages after that position are delivered
                first, then live ones (schema/README.md 5.1). Positions, or what JSON
                gives back of them: [vbucket, epoch, offset] lists, or objects with
                those keys, numbers as ints or decimal strings (reader.PositionLike);
                anything else, or a vbucket named twice, is a ValueError naming `since`.
            since_time: for the vbuckets `since` does not name, start with the
                retained messages published at or after this time (ns since the epoch
                as an int, seconds as a float, or an aware datetime).
            last: for the vbuckets neither names, start with the last `last`
                retained messages that match.
            What the workers no longer retain is reported through `on_loss`
            (LossReason EVICTED or EPOCH_CHANGED), never skipped in silence.
            on_loss: called with (dropped, reason) for the LossNotices that name this
                subscription (a start from positions, a time or the last N: EVICTED,
                EPOCH_CHANGED), instead of the client's `on_loss`; the losses of a
                whole connection (sid 0) still go to the client's.
            group: join the consumer group of that name (for this pattern and
                partition): each matching message goes to one member of the group
                only, on whichever client, the least loaded (other subscriptions and
                groups get their own copies). Its messages are GroupMessages, with
                `delivery_count`. A member starts live (no since, since_time, last).
            key_shared: (with group) every message of one key_partition goes to the
                same member, in publish order; key_partitions are spread over members.
            ack: (with group) acknowledge each message: `msg.ack()`, `msg.nack(delay)`
                or `msg.in_progress()`; what is not acked within `ack_wait` seconds,
                or nacked, is delivered again (to this member or another) with its
                delivery_count up by one. Acks live in the worker's memory: a worker
                that restarts loses its unacked messages, and they are reported
                through `on_loss` (LossReason.UNACKED_LOST).
            ack_wait: (with ack) seconds before an unacked message is redelivered (30).
            max_deliveries: (with ack) deliveries of one message before it is
                dropped, told through `on_loss` (MAX_DELIVERIES) and published to
                `dead_letter` if given (5).
            backoff: (with ack) seconds before the n-th redelivery of a nacked
                message (`nack()` without a delay); the last one repeats (1, 5, 30).
            max_in_flight, max_in_flight_bytes: (with ack) unacked messages (and
                their bytes) this member may hold (1000, 16 MiB); at the bound a
                worker pauses it (`sub.paused_by_server`, `stats.group_paused`)
                until it acks.
            dead_letter: (with ack) the key a message goes to (same key_partition
                and payload) after max_deliveries.
            drain_timeout: (with key_shared and ack) seconds a key_partition moving
                to another member waits for its old member's unacked messages
                before moving anyway (reported to `on_error` as DrainExpiredError) (10).

        Returns:
            The Subscription (of GroupMessages for a group member), already known
            to every worker that is connected (one round trip; a worker connected
            for the first time is waited for, one attempt). A worker that is down
            gets it when it reconnects.

        Raises:
            BadPatternError: the pattern is not valid.
            ValueError: an argument is out of range (the message names it), key_shared
                or ack without a group, or a group with since, since_time or last.
            ServerError: a worker refused it with SUBSCRIPTION_LIMIT (this connection
                holds as many subscriptions, or subscription bytes, as the server
                allows), BAD_GROUP (the group's members on that worker have other
                key_shared or ack settings) or PERMISSION_DENIED (`user` may not
                read it); it is then unsubscribed everywhere, and not retried. Raised
                once, not also reported to `on_error` (a worker that refuses it later,
                e.g. on a reconnect, is reported there, once per reason).
            ClientClosedError: the client is closed.
        """
        self._check_open()
        pat = pattern.encode() if isinstance(pattern, str) else bytes(pattern)
        parse_pattern(pat)
        part = partition.encode() if isinstance(partition, str) else partition
        if last < 0:
            raise ValueError(f"last must be >= 0, not {last!r}")
        since = as_positions(since, "since")
        start_time = time_ns(since_time)
        spec = group_spec(
            group,
            key_shared=key_shared,
            ack=ack,
            ack_wait=ack_wait,
            max_deliveries=max_deliveries,
            backoff=backoff,
            max_in_flight=max_in_flight,
            max_in_flight_bytes=max_in_flight_bytes,
            dead_letter=dead_letter,
            drain_timeout=drain_timeout,
            starts_from=bool(since or start_time or last),
        )
        if not self._connected:
            raise BrokyConnectionError("the client is not connected; await connect() first")
        sid = self._subscriptions.new_sid()
        if max_pending_msgs is None:  # a member's smaller queue: see GROUP_MAX_PENDING_MSGS
            max_pending_msgs = DEFAULT_MAX_PENDING_MSGS if spec is None else GROUP_MAX_PENDING_MSGS
        sub = Subscription(
            self,
            sid,
            pat,
            part,
            callback,
            max_pending_msgs,
            max_pending_bytes,
            since=since,
            since_time=start_time,
            last=last,
            group=spec,
        )
        if on_loss is not None:
            sub.on_loss = on_loss
        router = self.router
        if part is None:
            links = router.all_links()
        else:  # its owner, and the worker its vbucket is moving to (schema/README.md 6.3)
            owner, incoming = router.owner_link(part), router.incoming_link(part)
            links = [owner] if incoming is None or incoming is owner else [owner, incoming]
        table = self._subscriptions
        table.add(sub, links)
        table.confirming.add(sid)  # a refusal meanwhile is raised here, not also told to on_error
        try:
            async with asyncio.timeout(self.flush_timeout):
                await asyncio.gather(*(self._confirm(link) for link in links))
        except TimeoutError:
            self.report_error(
                BrokyTimeoutError(
                    f"{sub!r} not confirmed by every worker within {self.flush_timeout:g} s; "
                    "it is restored on reconnect"
                )
            )
        finally:
            table.confirming.discard(sid)
        limited = table.limited.get(sub.sid)
        if limited is not None:
            await self.remove_subscription(sub)
            raise limited[0]
        vmap = router.map
        if vmap is not None and vmap.incoming is not None:  # a move waits for every subscriber
            self.map_applied(vmap.version)
        return sub

    async def _confirm(self, link: Link) -> None:
        """Round trip on `link` if it is connected (or connecting for the first time).

        A link that is down carries the subscription in `subs`, and `attach`
        sends it when it reconnects: nothing to wait for.
        """
        if link.proto is None and link.failed is None and not link.tried.is_set():
            await link.tried.wait()  # a new link's first attempt (connect_timeout at most)
        if link.proto is None:
            return
        with contextlib.suppress(BrokyConnectionError):  # dropped: restored on reconnect
            await link.round_trip(retry=False)

    # ------------------------------------------------------------ asked by a Subscription (SubscriptionOwner)

    def pause_subscription(self, sub: Subscription[Any]) -> None:
        """For the SDK's subscriptions: `sub`'s queue is full, pause its connections."""
        self._subscriptions.pause(sub)

    def resume_subscription(self, sub: Subscription[Any]) -> None:
        """For the SDK's subscriptions: `sub`'s queue has room again."""
        if not self._closed:
            self._subscriptions.resume(sub)

    def lag_of(self, sub: Subscription[Any]) -> tuple[int, int, int]:
        """For `Subscription.lag`: what the last Pongs of the connections carrying `sub`
        said (messages owed while lagging, summed; the newest server clock, and this
        process's monotonic clock when it came)."""
        behind = server_ns = at_ns = 0
        for link in self.router.all_links():
            if link.ref not in sub.starts:
                continue
            behind += link.behind
            if link.pong_at > at_ns:
                server_ns, at_ns = link.pong_ts, link.pong_at
        return behind, server_ns, at_ns

    async def remove_subscription(self, sub: Subscription[Any]) -> None:
        """For `Subscription.unsubscribe`: stop `sub` on every worker, then close it.

        Raises:
            ClientClosedError: the client is closed.
        """
        self._check_open()
        self._subscriptions.remove(sub)

    # ---------------------------------------------------------------- bounded reads (broky.client.reader)

    def read(
        self,
        pattern: bytes | str,
        *,
        partition: bytes | str | None = None,
        start: Iterable[PositionLike] | None = None,
        start_time: int = 0,
        stop: Iterable[PositionLike] | None = None,
        vbuckets: Iterable[int] | None = None,
        via: Mapping[int, ReadVia] | None = None,
        timeout: float | None = None,
    ) -> Reading:
        """Read the retained messages of a closed range, then stop (schema/README.md 5.2).

        ``result = await client.read(...)`` gives every message and where each
        vbucket's range ended; ``async for msg in client.read(...)`` gives the
        messages as they come (the Reading's `ends` once done). Per vbucket the
        range starts after its position in `start` (another epoch: from the
        current one's first offset, `epoch_changed`), else at the first retained
        message with ts_broker >= `start_time` (ns), else at the oldest retained;
        it ends with its position in `stop`, else with the last message accepted
        when the read reached its worker. Two reads of one range return the same
        messages while they are retained; `RangeEnd.evicted` counts those gone.

        Args:
            pattern: the keys to read (`>`: all).
            partition: only this key_partition (read from its owner only).
            start, stop: positions (vbucket, epoch, offset), e.g. an earlier
                read's `positions` or `client.positions()`, or what JSON gives back
                of them (as `subscribe`'s `since`).
            start_time: ns since the epoch, for the vbuckets `start` does not name.
            vbuckets: only these vbuckets (ints 0 .. 1023, none twice), each
                read from its owner; with `partition`, its vbucket must be
                one of them. None: every vbucket.
            via: per vbucket, a worker to ask first (`ReadVia`): the one that
                owned it when `start` was taken. A worker that handed the
                vbucket over in a planned move since answers what it retained
                up to the handover, and the rest is read from the owner; a
                `via` worker that is gone is skipped.
            timeout: seconds for the whole read (None: no limit).

        Returns:
            A Reading, to await or iterate.

        Raises:
            BadPatternError, ValueError: a bad pattern, position or vbucket, an
                empty `vbuckets`, or a partition outside `vbuckets` (at once).
            ServerError: a worker refused the read (BAD_POSITION: a position past
                what it accepted, or named twice); BrokyConnectionError: a read
                connection was lost; BrokyTimeoutError (when awaited or iterated).
        """
        self._check_usable()
        pat = pattern.encode() if isinstance(pattern, str) else bytes(pattern)
        part = partition.encode() if isinstance(partition, str) else partition
        return Reading(
            self,
            pat,
            part,
            start=as_positions(start, "start"),
            start_time=start_time,
            stop=as_positions(stop, "stop"),
            vbuckets=as_vbuckets(vbuckets),
            via=dict(via) if via else None,
            timeout=timeout,
        )

    async def positions(
        self,
        *,
        partition: bytes | str | None = None,
        vbuckets: Iterable[int] | None = None,
        timeout: float | None = None,
    ) -> tuple[Position, ...]:
        """Where every vbucket stands now: (vbucket, epoch, last offset accepted), in vbucket
        order (only the partition's with `partition`, only `vbuckets`' with `vbuckets`, as
        `read` takes them); the `stop` of a read up to now, or the `start` of one from now.
        A read of an empty range (broky.client.reader)."""
        reading = self.read(
            b">", partition=partition, start_time=END_OF_TIME, vbuckets=vbuckets, timeout=timeout
        )
        return (await reading).positions

    async def refresh_map(self) -> VBucketMap:
        """Ask a node for the current vbucket map now, follow it if it is newer, and return
        the map the client follows then.

        A client follows the map by itself (every node pushes its changes): this is
        for a caller with a reason to think the push has not come yet, such as the
        server's HTTP gateway after a worker refused a publish or a node went. One
        refresh at a time: a call during one waits for it. A refresh that reaches no
        node leaves the map as it was (and is reported to `on_error`).

        Raises:
            ClientClosedError: the client is closed.
            BrokyConnectionError: the client is not connected yet.
        """
        self._check_usable()
        await self.router.refresh()
        vmap = self.router.map
        assert vmap is not None  # connected: the first Welcome carried one
        return vmap

    # ---------------------------------------------------------------- asked by the Links (LinkOwner)

    def take_welcome(self, welcome: Welcome) -> None:
        """For the Links and the Router (LinkOwner): take in a Welcome's map and max_frame_bytes."""
        vmap = welcome.map
        self.max_frame = welcome.max_frame_bytes
        self._limit_frames(welcome.max_frame_bytes)
        self.server_info = ServerInfo(
            welcome.node_id,
            welcome.server_version,
            sum(n.workers for n in vmap.nodes),
            vmap,
            welcome.max_frame_bytes,
            welcome.max_pending_bytes,
        )
        self.router.take_map(vmap)

    def address_of(self, node_id: str) -> tuple[str, int]:
        """For the Links and reads (LinkOwner, ReadOwner): where node `node_id` listens."""
        return self.router.address_of(node_id)

    def not_my_vbucket(self, link: Link, err: ServerError, refused: bytes | None) -> None:
        """For the Links (LinkOwner): `link`'s worker refused a subscription or a publish."""
        self.router.not_my_vbucket(link, err, refused)

    def subscription_refused(self, link: Link, err: ServerError) -> None:
        """For the Links (LinkOwner): `link`'s worker refused err.sid for good
        (SUBSCRIPTION_LIMIT, BAD_GROUP, PERMISSION_DENIED): raised by `subscribe`, or
        told to `on_error` once (broky.client.subscription_table)."""
        self._subscriptions.limited_by(link, err)

    def map_updated(self, link: Link, vmap: VBucketMap) -> None:
        """For the Links (LinkOwner): `link`'s worker pushed a newer vbucket map."""
        self.router.take_map(vmap)
        if self.server_info is not None and vmap.version > self.server_info.map.version:
            self.server_info = self.server_info._replace(map=vmap, workers=sum(n.workers for n in vmap.nodes))

    def send_again(self, link: Link, frames: list[bytes]) -> None:
        """For the Links (LinkOwner): publishes `link` cannot deliver, for their owners."""
        self.router.send_again(frames)

    def link_reconnected(self, link: Link, resumed: bool, tail: list[tuple[bytes, int]]) -> None:
        """For the Links (LinkOwner): `link` is connected again (see LinkOwner)."""
        if not resumed:  # publishers may send again what the lost connection delivered last
            self.drop_duplicates(tail)
        vmap = self.router.map
        if link.subs and vmap is not None:  # after its Subscribes, on the same connection
            link.send_control(encode_map_applied(MapApplied(vmap.version)))
            if self.router.applied < vmap.version and link.ref in _incoming_refs(vmap):
                # `_acknowledge` gave up on this map while this incoming owner was down: the
                # other nodes' connections must hear MapApplied too, or the move they
                # prepared waits for its timeout and its commit finds this client unready.
                self.map_applied(vmap.version)

    def map_applied(self, version: int) -> None:
        """For the Router (RouterOwner): map `version` is in place; say MapApplied once confirmed."""
        if self.loop is None or self._closed:
            return
        task = self.loop.create_task(self._acknowledge(version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acknowledge(self, version: int) -> None:
        """Say MapApplied(version) on every connection once every incoming owner of
        the map (a worker it moves vbuckets to) has confirmed the subscriptions it
        carries (a round trip): the cluster moves vbuckets only when its subscribers
        are in place there (schema/README.md section 6.3). Only those are waited
        for: a worker that keeps or loses vbuckets (a frozen node's among them)
        must not hold up a move that does not need it."""
        vmap = self.router.map
        incoming = set() if vmap is None else _incoming_refs(vmap)
        carrying = [link for link in self.router.links.values() if link.subs and link.ref in incoming]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.flush_timeout):
                await asyncio.gather(*(self._confirm(link) for link in carrying))
        vmap = self.router.map
        if self._closed or vmap is None or vmap.version != version:
            return  # superseded: the newer map says it
        # An incoming owner that is down gets its subscriptions and a MapApplied when it
        # reconnects (`link_reconnected`, which then asks again): not before, since they
        # must be in place first.
        if any(link.proto is None and link.failed is None for link in carrying):
            return
        frame = encode_map_applied(MapApplied(version))
        for link in self.router.links.values():
            link.send_control(frame)
        self.router.applied = max(self.router.applied, version)

    def drop_duplicates(self, tail: list[tuple[bytes, int]]) -> None:
        """For the Router (RouterOwner), and `link_reconnected`. The last deliveries of a
        connection lost without an account (the node is gone, or the server restarted)
        may come again: publishers send again what no server confirmed. Their uids are
        dropped on arrival for DUPLICATE_WINDOW seconds (`stats.duplicates_dropped`)."""
        uids = uids_in(tail)
        if not uids:
            return
        if self.duplicate_uids is None:
            self.duplicate_uids = uids
        else:
            self.duplicate_uids |= uids
        if self._dupes_timer is not None:
            self._dupes_timer.cancel()
        self._dupes_timer = self.loop.call_later(DUPLICATE_WINDOW, self._forget_duplicates)

    def _forget_duplicates(self) -> None:
        self.duplicate_uids = None
        self._dupes_timer = None

    # ---------------------------------------------------------------- callbacks

    def report_error(self, exc: BaseException) -> None:
        """For every part of the SDK (LinkOwner, SubscriptionOwner, the SubscriptionTable): count
        an error and hand it to `on_error` (or the log)."""
        self.stats.errors += 1
        if self.on_error is not None:
            self.invoke_callback(self.on_error, exc)
        elif isinstance(exc, SlowConsumerError):  # one line per subscription every few seconds
            sub = self._subscriptions.subs.get(exc.sid)
            pattern = "" if sub is None else f" ({sub.pattern.decode(errors='replace')})"
            self._losses.add(("local", exc.sid), f"subscription {exc.sid}{pattern}, queue full", exc.dropped)
        else:
            log.warning("broky client: %s", exc)

    def loss_told(self, ref: WorkerRef, dropped: int, reason: int) -> None:
        """For the Links (LinkOwner): a LossNotice, to `on_loss` or the loss log."""
        if self.on_loss is not None:
            self.invoke_callback(self.on_loss, ref, dropped, reason)
            return
        label = f"deliveries from worker {ref.worker} of {ref.node_id} ({LossReason.name(reason)})"
        self._losses.add(("server", ref, reason), label, dropped)

    def epochs_settled(self, epochs: Iterable[int]) -> None:
        """For the Links and the Router (LinkOwner): what a lost connection delivered of these
        epochs is settled: counted exactly by its account, or all delivered before a Goodbye,
        or told once as UNACCOUNTED. A start told EPOCH_CHANGED for one of them tells no
        further loss (schema/README.md 7.3): it is not reported again."""
        settled = self._settled_epochs
        for epoch in epochs:
            settled[epoch] = None
        while len(settled) > SETTLED_EPOCHS:
            del settled[next(iter(settled))]

    def epoch_settled(self, epoch: int) -> bool:
        """For the Links (LinkOwner): see `epochs_settled`."""
        return epoch in self._settled_epochs

    def loss_unaccounted(self, ref: WorkerRef) -> None:
        """For the Links and the Router (LinkOwner): a lost connection nobody accounts for."""
        self.stats.unaccounted += 1
        if self.on_loss is not None:
            self.invoke_callback(self.on_loss, ref, 0, LossReason.UNACCOUNTED)
            return
        label = (
            f"deliveries from worker {ref.worker} of {ref.node_id}: no server could account for a lost "
            "connection (a restart, or a node that died); some may have been lost, how many is unknown"
        )
        noun = ("connection unaccounted", "connections unaccounted")
        self._losses.add(("unaccounted", ref), label, 1, noun)

    def invoke_callback(self, callback: Callable[..., Any] | None, *args: Any) -> None:
        """For the Links (LinkOwner): call a user callback (awaited in a task if it returns an awaitable)."""
        if callback is None:
            return
        try:
            result = callback(*args)
        except Exception:
            log.exception("broky client: callback %r raised", callback)
            return
        if inspect.isawaitable(result):
            task = self.loop.create_task(_await(result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


def time_ns(when: int | float | datetime.datetime | None) -> int:
    """A start time as ns since the epoch: an int is ns, a float seconds, a datetime
    must be timezone-aware; None is 0 (not set)."""
    if when is None:
        return 0
    if isinstance(when, datetime.datetime):
        if when.tzinfo is None:
            raise ValueError("since_time must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return int(when.timestamp() * 1e9)
    if isinstance(when, float) and when >= 0:
        return int(when * 1e9)
    if isinstance(when, int) and not isinstance(when, bool) and when >= 0:
        return when
    raise ValueError(f"since_time must be ns (int >= 0), seconds (float) or a datetime, not {when!r}")


def _incoming_refs(vmap: VBucketMap) -> set[WorkerRef]:
    """The workers a prepared map moves vbuckets to."""
    if not vmap.incoming:
        return set()
    return {WorkerRef(vmap.nodes[i[0]].node_id, i[1]) for i in set(vmap.incoming) if i != NO_OWNER}


def _check_options(
    *,
    batch_size: int,
    linger: float,
    connect_timeout: float,
    flush_timeout: float,
    max_reconnect_buffer_bytes: int,
    reconnect_min_delay: float,
    reconnect_max_delay: float,
    max_reconnect_attempts: int | None,
    ping_interval: float | None,
    max_outstanding_pings: int,
    confirm_interval: float,
) -> None:
    """Raise ValueError naming the first option out of range (NaN is out of every range)."""
    checks = [
        (batch_size >= 1, f"batch_size must be at least 1 byte, not {batch_size!r}"),
        (linger >= 0, f"linger must be >= 0 seconds, not {linger!r}"),
        (connect_timeout > 0, f"connect_timeout must be > 0 seconds, not {connect_timeout!r}"),
        (flush_timeout > 0, f"flush_timeout must be > 0 seconds, not {flush_timeout!r}"),
        (
            max_reconnect_buffer_bytes >= 0,
            f"max_reconnect_buffer_bytes must be >= 0, not {max_reconnect_buffer_bytes!r}",
        ),
        (reconnect_min_delay > 0, f"reconnect_min_delay must be > 0 seconds, not {reconnect_min_delay!r}"),
        (
            reconnect_max_delay >= reconnect_min_delay,
            f"reconnect_max_delay ({reconnect_max_delay!r}) must be >= reconnect_min_delay "
            f"({reconnect_min_delay!r})",
        ),
        (
            max_reconnect_attempts is None or max_reconnect_attempts >= 1,
            f"max_reconnect_attempts must be None or at least 1, not {max_reconnect_attempts!r}",
        ),
        (
            ping_interval is None or ping_interval > 0,
            f"ping_interval must be None or > 0 seconds, not {ping_interval!r}",
        ),
        (
            max_outstanding_pings >= 1,
            f"max_outstanding_pings must be at least 1, not {max_outstanding_pings!r}",
        ),
        (confirm_interval >= 0, f"confirm_interval must be >= 0 seconds, not {confirm_interval!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


async def _await(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception:
        log.exception("broky client: async callback raised")


class Connecting:
    """What `broky.connect` returns: await it, or use it as an async context manager."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def __await__(self) -> Generator[Any, None, Client]:
        return self.client.connect().__await__()

    async def __aenter__(self) -> Client:
        return await self.client.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.client.close()


def connect(server: str | None = None, **options: Any) -> Connecting:
    """Connect to a Broky server (asyncio).

    ``client = await broky.connect(url)`` or ``async with broky.connect(url) as client``.

    Args:
        server: ``broky://host:port`` or ``host:port`` (port 4777 by default);
            ``broky+tls://host:port`` for TLS (see ssl_context);
            None = $BROKY_SERVER or 127.0.0.1:4777.
        name: client name shown by the server's monitoring.
        auth_token: the server's token, if it has one.
        user, password: a user of the server's users file (--users), instead of auth_token.
        ssl_context: TLS with this `ssl.SSLContext` (its trusted CAs, and a client
            certificate for mutual TLS: `load_cert_chain`); without it, a
            ``broky+tls://`` server uses `ssl.create_default_context()` (the system's
            trust store). Either way every connection of the client, to any node,
            is TLS, and a server that offers none is an error.
        connect_timeout: seconds to keep trying the first connection (default 5),
            and the handshake timeout of every later connection.
        wait_for_server: retry a refused first connection until connect_timeout
            (default True: a server that is starting refuses for a moment);
            False: raise NoServerError as soon as every address of every seed
            refused (nothing listens there), as the `broky` commands do. An
            address that does not answer is waited for either way; reconnects
            after the first connection always retry.
        linger: seconds a publish may wait for others to share its write
            (Kafka's linger.ms); 0 (default) = the next event loop iteration.
        batch_size: bytes after which the queued publishes of one worker are
            written at once (Kafka's batch.size), default 128 KiB.
        max_reconnect_buffer_bytes: publishes kept for a disconnected worker
            (default 8 MiB); past it `publish` waits up to flush_timeout for
            the worker, then raises PublishBufferFullError.
        flush_timeout: default timeout of `flush`, of `subscribe`'s confirmation
            and of the flush in `close` (default 10 s).
        reconnect_min_delay, reconnect_max_delay: bounds of the jittered
            exponential backoff between reconnect attempts (0.05 s, 2 s).
        max_reconnect_attempts: give up on a worker after that many failed
            attempts in a row (default None: never); its buffered publishes are
            dropped (`stats.unsent_gave_up`), and `publish` and `flush` raise
            BrokyConnectionError for it from then on.
        ping_interval: seconds between keepalive Pings on each connection
            (default 10; None: no keepalive).
        max_outstanding_pings: a connection with that many Pings unanswered
            when the next is due is closed and reconnected (default 2), so a
            silent network cut is noticed within about
            ping_interval * (max_outstanding_pings + 1) seconds.
        confirm_interval: while publishing, a Ping goes with a write at most
            this often (default 0.005 s), so that the server confirms what it
            processed: a connection that drops leaves only that much in doubt.
        on_error(exc): errors from the server (ServerError), local drops
            (SlowConsumerError), exceptions raised by subscription callbacks,
            publishes that may have been lost with a connection, a key-shared
            group's drain deadline passed (DrainExpiredError). Without it
            they are logged, local drops at most once every 5 s per
            subscription (broky.client.losses).
        on_disconnect(worker_ref, reason): a connection dropped (reconnecting
            follows); `reason` is never None: ServerShutdownError (the server
            said Goodbye), a ServerError (a fatal error: its `code`), or
            BrokyConnectionError (the connection was lost).
        on_reconnect(worker_ref): a connection came back, subscriptions restored
            and unprocessed publishes sent again.
        on_loss(worker_ref, dropped, reason): the server lost `dropped`
            deliveries to us; `reason` is a LossReason (slow consumer, a
            connection that dropped, a worker that restarted, a shutdown; for
            group members GROUP_OVERFLOW, MAX_DELIVERIES, and UNACKED_LOST:
            unacknowledged deliveries of a worker that restarted).
            Without it they are logged at most once every 5 s per worker and
            reason, with the running count.

    Callbacks may be plain functions or coroutine functions.

    Raises:
        ValueError: an option is out of range (at once, not when awaited).

    Raises (when awaited):
        BrokyConnectionError: the host name does not resolve, or no server
            answered within connect_timeout.
        AuthenticationError: wrong or missing auth token.
    """
    return Connecting(Client(server, **options))


__all__ = [
    "AuthenticationError",
    "Client",
    "ClientStats",
    "Connecting",
    "Link",
    "ServerInfo",
    "WorkerRef",
    "connect",
]
