"""The logical connection to one worker: `Link`.

Theory of operation
-------------------
A Link is the logical connection to one worker and survives reconnects;
under it, a `WorkerProtocol` (broky.client.connection) is one TCP
connection. The client opens Links lazily (see broky.client.routing) and
knows each by its `WorkerRef`; a Link knows its client only as a
`LinkOwner`: the options, the loop, the counters and the callbacks.

Outbound: publishes are appended to the Link's outbound list, which is
written in one system call when it reaches `batch_size` bytes or
`linger` seconds later (linger=0: at the next loop iteration, which already
coalesces every publish made in between): joined into one bytes when it
holds many frames, as a writev of its parts when it holds a few (publish_many's
chunks of many publishes each, which are not copied again). Control frames (Subscribe,
Unsubscribe, Ping) are written at once, after every publish queued before
them, and not at all while the Link is down (it re-sends its subscriptions
when it reconnects). While a Link is down its outbound list is bounded by
`max_reconnect_buffer_bytes`; past that, `send` raises PublishBufferFullError.

Inbound: bare deliveries carry no sid. Each Link has a Matcher of the plain
subscriptions it carries (cached by key) and hands each bare delivery to
every subscription whose pattern, and partition if scoped, matches. Group
members are not in the Matcher: a worker announces each member's share with
a Delivery frame, and the WorkerProtocol hands those messages to `on_group`
for that member alone, as GroupMessages (broky.client.groups); a member with
ack gets an AckLedger per Link, through which its settlements go back to
this worker. A GroupNotice sets the member's `paused_on` (PAUSED, RESUMED)
or goes to `on_error` (DRAIN_EXPIRED, as a DrainExpiredError). Pongs settle
round trips; an Error goes to the client (NOT_MY_VBUCKET to its map
handling, SUBSCRIPTION_LIMIT and BAD_GROUP to its subscription table); a
LossNotice is counted and reported (GROUP_OVERFLOW and MAX_DELIVERIES, which
name a member's sid, like any other).

Reconnecting: when a Link's connection drops (or the server says Goodbye),
the Link reconnects to the same worker with jittered exponential backoff,
naming the lost connection in its Hello (`previous`: its id, the deliveries
received on it and how many of them were a group member's, the losses it was
told of), re-sends every subscription it
carries (same sids), a Ping, then the publishes the server did not process
(below), then its buffered publishes. A Link that fails
`max_reconnect_attempts` times in a row gives up: its buffered publishes are
dropped and counted (`stats.unsent_gave_up`), and publishing to it or
flushing raises from then on.

Resuming by positions: every delivery carries its position (vbucket, epoch,
offset), and the Link keeps the last one it received per vbucket, with its
ts_broker (three lists the WorkerProtocol writes as it reads each delivery,
from the values it has in hand). A subscription's start on this
worker is the `ts` of the first Pong after its Subscribe. On a reconnect the
Hello says `positions` and each Subscribe is sent again `since` the Link's
positions received after that start (and the subscription's own from a
replay, or from a notice's `through`, where newer), with `since_time` = the
start for the vbuckets it received nothing of since (schema/README.md 5.1):
the worker replays what was in flight, as a Replay frame followed by the
messages for that sid alone, which the WorkerProtocol hands to the Link's
`on_replayed` for that subscription only; and it tells what is gone
(EVICTED, EPOCH_CHANGED, SLOW_CONSUMER), one notice per vbucket, each naming
the last position it accounts for (`through`): the subscription's next start
goes on after it (`told_through`), so what was told is never told again. A
worker without a replay buffer replays nothing and tells all of it. A group
member is sent again as it was first (a group starts live; what was in
flight to the lost connection the worker gives to the other members, or to
this one again).

The seam: a plain subscription whose Subscribe names a start takes no bare
delivery until its Replay arrives (what comes before it is in the replay);
it is out of the Matcher until then (`subscribe_for`, `awaiting`).

Told once: the loss of a lost connection is settled by its account (exact),
by its Goodbye (none), or by one UNACCOUNTED; the client remembers the epochs
it had delivered (`epochs_held`, LinkOwner.epochs_settled), and an
EPOCH_CHANGED for one of them (the same loss, from a start) is not told again.

Group members with ack, across reconnects: the high half of a Welcome's
connection_id names the worker process (schema/README.md 3, 5.4). Back to the
same process, the settlements made while down are sent after the
Subscribes (the worker still knows those positions). Back to another one (the
worker or the server restarted), or retired with its node, the Link orphans
its AckLedgers (broky.client.groups): their ACKs are dropped (the application
has those messages: nothing is lost), and each NACK, which asks for a
redelivery nobody can make, is reported lost (LossReason.UNACKED_LOST,
`stats.unacked_lost`), once.

A vbucket that moves (broky.client.routing) keeps its sequence: same epoch,
the next offset, at its new owner. A subscription that another worker
carried when vbuckets moved here from it, and that has not started here
yet (it reaches this worker only now: the move was committed without this
client's MapApplied, or this Link was down), is sent `since` the positions
the old owner's Link received of those vbuckets, with `since_time` = its
start there (`carry_from`): what the new owner accepted before the
subscription reached it is replayed, and what it never had is told
(EVICTED, schema/README.md 6.3).

Keepalive: every `ping_interval` a connected Link sends a Ping; if
`max_outstanding_pings` are unanswered when the next is due, it aborts the
connection and reconnects as for any drop. A timer per Link, nothing per
message.

Delivery accounting (what the client's `flush` can promise): the server
answers a Ping only after processing every frame received before it. Each
Link counts the publishes it wrote to the current connection (`written`) and
how many the latest Pong confirmed (`confirmed`), and keeps the chunks it
wrote since then (`retained`); while publishing it adds a Ping to a write at
most every `confirm_interval` seconds, so the unconfirmed tail stays short
(a few milliseconds of publishes). When the connection drops, the publishes
after `confirmed` are in doubt. The server keeps an account of every
connection, even of one whose worker died (schema/README.md section 7.1):
on the reconnect, `Welcome.resumed.processed` says exactly how many of them
it processed, and the Link sends the others again, first, in order: nothing
is lost and nothing is delivered twice. Only when the server has no account
(the whole server restarted, or the Link never reconnects) are the in-doubt
publishes counted as "possibly lost" (`unconfirmed`,
`stats.unconfirmed_lost`, an upper bound), which the next `flush` reports by
raising BrokyConnectionError. A Goodbye says the same as `resumed` at once:
the publishes it did not process wait in the outbound list for the reconnect.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import struct
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from broky.client import pubpack
from broky.client.connection import WorkerProtocol, open_connection, server_error
from broky.client.groups import AckBatcher, AckLedger, GroupMessage
from broky.client.stats import ClientStats
from broky.client.subscription import Subscription
from broky.errors import (
    BrokyConnectionError,
    BrokyError,
    ClientClosedError,
    DrainExpiredError,
    ErrorCode,
    PublishBufferFullError,
    RemoteProtocolError,
    ServerError,
    ServerShutdownError,
)
from broky.matching import Matcher
from broky.protocol import (
    VBUCKETS,
    Error,
    Frame,
    Goodbye,
    GroupEvent,
    GroupNotice,
    Hello,
    LossNotice,
    LossReason,
    MapUpdate,
    Message,
    Ping,
    Pong,
    PreviousConnection,
    Replay,
    Subscribe,
    Unsubscribe,
    VBucketMap,
    Welcome,
    vbucket_of,
)
from broky.protocol.frames import PAUSE as PAUSE_FRAME
from broky.protocol.frames import RESUME as RESUME_FRAME
from broky.protocol.frames import Position, encode_ping, encode_subscribe, encode_unsubscribe
from broky.protocol.layout import HEADER_AT, HEADER_END, HEADER_NO_UID, HEADER_UID, UID_AT, UID_END
from broky.protocol.message import BODY_MESSAGE, body_type

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("broky.client")
_u32 = struct.Struct("<I").unpack_from

# An outbound list is written as it is (a writev of its parts) when it holds at
# most WRITEV_PARTS parts or parts of JOIN_BELOW bytes on average (publish_many's
# chunks); else (single frames of per-call publishes) it is joined first.
WRITEV_PARTS = 4
JOIN_BELOW = 4096


def publishes_in(chunk: bytes) -> list[bytes]:
    """The Message frames of a chunk the Link wrote (Pings and Subscribes skipped)."""
    frames = []
    pos, end = 0, len(chunk)
    while pos < end:
        stop = pos + 4 + _u32(chunk, pos)[0]
        if body_type(chunk, pos, stop) == BODY_MESSAGE:
            frames.append(chunk[pos:stop])
        pos = stop
    return frames


def frames_in(out: list[bytes]) -> list[bytes]:
    """The frames of an outbound list: each entry is one frame, or a chunk of several
    publishes packed by the compiled bulk path (broky.client.pubpack)."""
    frames: list[bytes] = []
    for entry in out:
        if 4 + _u32(entry, 0)[0] == len(entry):
            frames.append(entry)
        else:
            frames.extend(publishes_in(entry))
    return frames


def uids_in(tail: list[tuple[bytes, int]]) -> set[bytes]:
    """The uids of the deliveries in a connection's tail (data, end of its whole frames)."""
    uids: set[bytes] = set()
    for data, end in tail:
        pos = 0
        while pos < end:
            if data[pos + HEADER_AT : pos + HEADER_END] == HEADER_UID:  # every delivery is canonical
                uids.add(data[pos + UID_AT : pos + UID_END])
            pos += 4 + _u32(data, pos)[0]
    return uids


class Written(NamedTuple):
    """One write of publishes, kept until a Pong confirms them: its chunks (the
    frames, one after the other, in one or more bytes objects), the number of its
    first publish on the connection, how many publishes it holds, and its size."""

    chunks: list[bytes]
    first: int
    publishes: int
    size: int

    def frames(self) -> list[bytes]:
        """The write's publish frames, in order (control frames left out)."""
        return [frame for chunk in self.chunks for frame in publishes_in(chunk)]


class InDoubt(NamedTuple):
    """The publishes of a lost connection that no Pong confirmed: the ones numbered
    `confirmed` .. `written` - 1 on it; `retained` holds the chunks that carried
    them (Written: the write's chunks, number of its first publish, publishes in it,
    bytes), from `released` on (older ones were let go to bound memory)."""

    confirmed: int
    written: int
    released: int
    retained: collections.deque[Written]


class WorkerRef(NamedTuple):
    """One worker of one node, as named in callbacks."""

    node_id: str
    worker: int


def later(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """Whether position a (epoch, offset, ts_broker) comes after b: by offset within an
    epoch, by time across epochs."""
    if a[0] == b[0]:
        return a[1] > b[1]
    return (a[2], a[1]) > (b[2], b[1])


class LinkOwner(Protocol):
    """What a Link needs from its client (`broky.client.client.Client` is one): the
    names the Client documents as for the SDK's own modules."""

    # options (see `broky.connect`)
    name: str | None
    auth_token: str | None
    tls: ssl.SSLContext | None  # every connection upgrades to TLS with it (None: plain)
    connect_timeout: float
    linger: float
    batch_size: int
    max_reconnect_buffer_bytes: int
    reconnect_min_delay: float
    reconnect_max_delay: float
    max_reconnect_attempts: int | None
    ping_interval: float | None
    max_outstanding_pings: int
    confirm_interval: float
    # callbacks, called through `invoke_callback`
    on_disconnect: Callable[[WorkerRef, BaseException | None], Any] | None
    on_reconnect: Callable[[WorkerRef], Any] | None
    on_loss: Callable[[WorkerRef, int, int], Any] | None
    # state
    stats: ClientStats
    loop: asyncio.AbstractEventLoop
    duplicate_uids: set[bytes] | None  # uids dropped on arrival (see Client.drop_duplicates)
    acks: AckBatcher  # group members' settlements (broky.client.groups)

    @property
    def is_closed(self) -> bool:
        """`close` was called."""

    def address_of(self, node_id: str) -> tuple[str, int]:
        """Where node `node_id` listens."""

    def take_welcome(self, welcome: Welcome) -> None:
        """Take in what a Welcome says (the map, max_frame_bytes)."""

    def not_my_vbucket(self, link: Link, err: ServerError, refused: bytes | None) -> None:
        """`link`'s worker refused a subscription (err.sid) or a publish (`refused`, its frame)."""

    def subscription_refused(self, link: Link, err: ServerError) -> None:
        """`link`'s worker refused subscription err.sid for good: SUBSCRIPTION_LIMIT, or
        BAD_GROUP (a member whose settings differ from its group's)."""

    def map_updated(self, link: Link, vmap: VBucketMap) -> None:
        """`link`'s worker pushed a newer vbucket map."""

    def send_again(self, link: Link, frames: list[bytes]) -> None:
        """Publishes `link` cannot deliver, for the owners of their key_partitions."""

    def link_reconnected(self, link: Link, resumed: bool, tail: list[tuple[bytes, int]]) -> None:
        """`link` is connected again; `resumed`: the server had an account of the lost
        connection; `tail`: the last reads of the lost connection (for duplicates)."""

    def loss_told(self, ref: WorkerRef, dropped: int, reason: int) -> None:
        """A LossNotice: `on_loss`, or a line in the loss log."""

    def loss_unaccounted(self, ref: WorkerRef) -> None:
        """A connection that carried subscriptions was lost and no server can say what
        it lost (LossReason.UNACCOUNTED): `on_loss` with a count of 0, or the loss log."""

    def epochs_settled(self, epochs: Iterable[int]) -> None:
        """What lost connections delivered of these epochs is settled (told, or proven whole)."""

    def epoch_settled(self, epoch: int) -> bool:
        """Whether `epochs_settled` named this epoch."""

    def report_error(self, exc: BaseException) -> None:
        """Hand an error to `on_error`."""

    def invoke_callback(self, callback: Callable[..., Any] | None, *args: Any) -> None:
        """Call a user callback (awaited in a task if it returns an awaitable)."""


# With the compiled twin, a Link's proto, out, out_bytes and flush_handle are kept in C,
# where publish's fast path (pubpack's FastPath) reads and writes them.
if TYPE_CHECKING:

    class _LinkState:
        pass

else:
    _LinkState = object if pubpack.compiled is None else pubpack.compiled.LinkState


class Link(_LinkState):
    """The logical connection to one worker; survives reconnects.

    Delivery accounting (what `flush` can promise): `written` counts the
    publishes written to the current connection (counted per write in
    `flush_out`, not per publish; control frames are subtracted there),
    `confirmed` how many of them the latest Pong covers (each Ping remembers
    `written` when it was sent; the server answers a Ping after processing
    every frame before it), and `retained` keeps the chunks written after
    `confirmed`. When the connection drops they are `in_doubt`, settled on the
    reconnect (`settle`): sent again from where the server's account says it
    stopped, or, with no account, added to `unconfirmed` (and
    `stats.unconfirmed_lost`), which the next `flush` reports as a
    BrokyConnectionError. Publishes still in `out` are not lost: they are sent
    after the reconnect. `received` (of which `group_received` were a group
    member's) and `told_lost` count the deliveries and the losses told on the
    current connection, for the next Hello's `previous`.
    """

    def __init__(self, client: LinkOwner, node_id: str, worker: int) -> None:
        self.client = client
        self.ref = WorkerRef(node_id, worker)
        self.proto: WorkerProtocol | None = None
        # Frames to write, and their size. An entry is one frame, or a chunk of
        # publishes from the compiled bulk path: `out_extra` counts the publishes
        # in chunks beyond one per entry (see `frames_in`).
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.out_extra = 0
        self.flush_handle: asyncio.Handle | None = None
        self.subs: dict[int, Subscription[Any]] = {}
        self.matcher: Matcher[Subscription[Any], tuple[Subscription[Any], ...]] = Matcher(tuple)
        self._matched = self.matcher.cached  # key -> subscriptions, read first by on_message
        # ping id -> (future of the round trip, or None for a keepalive; `written` when sent)
        self.pings: dict[int, tuple[asyncio.Future[None] | None, int]] = {}
        self.next_ping = 0
        self.written = 0
        self.confirmed = 0
        self.unconfirmed = 0
        # the writes since `confirmed` (Written: chunks, number of its first publish, publishes, bytes)
        self.retained: collections.deque[Written] = collections.deque()
        self.retained_bytes = 0
        self.released = 0  # publishes before this number were let go of unconfirmed (memory bound)
        self.confirm_sent = 0.0  # loop time of the last Ping added to a write of publishes
        self.conn_id = 0  # Welcome.connection_id of the current (or last) connection
        self.resume_token: bytes | None = None  # its Welcome.resume_token (the proof of a resume)
        self.received = 0  # deliveries received on it
        self.group_received = 0  # of those, announced by a Delivery frame (a group member's)
        self.told_lost = 0  # LossNotice counts received on it
        self.refusals = 0  # publishes refused on it with NOT_MY_VBUCKET (Errors received)
        self.lost_refusals = 0  # the same, of the lost connection named in `previous`
        self.previous: PreviousConnection | None = None  # the lost connection, named in the next Hello
        self.in_doubt: InDoubt | None = None  # its unconfirmed publishes, until `settle`
        self.goodbye_processed: int | None = None  # Goodbye.processed of the current connection
        self.ended_clean = False  # the lost connection ended with a Goodbye: it lost nothing untold
        self.paused_by: set[int] = set()  # sids whose full queues paused this connection's deliveries
        self.tail: list[tuple[bytes, int]] = []  # the lost connection's last reads (see `connection`)
        self.fences = 0  # while > 0 nothing is written: a vbucket is moving here (broky.client.routing)
        self.front = 0  # frames at the head of `out` sent again for other Links, in order
        self.retired = False  # its node left the map: no more reconnects
        self.outstanding = 0  # keepalive Pings sent since the last Pong
        # The last Pong's: messages its connection is owed while it lags (schema/README.md 7),
        # the server's clock, and this process's monotonic clock when it came (Subscription.lag).
        self.behind = 0
        self.pong_ts = 0
        self.pong_at = 0
        self.keepalive: asyncio.TimerHandle | None = None
        # Set while connected, and for good once the Link has ended (given up, retired,
        # closed): a waiter that finds it set and no connection must not wait again.
        self.up = asyncio.Event()
        self.tried = asyncio.Event()  # set once the first connection attempt has ended
        self.task: asyncio.Task[None] | None = None
        self.failed: BrokyConnectionError | None = None
        # Per vbucket, the position and ts_broker of the last delivery received (0: none).
        self.pos_epoch = [0] * VBUCKETS
        self.pos_offset = [0] * VBUCKETS
        self.pos_ts = [0] * VBUCKETS
        # Subscriptions whose start here is the ts of the first Pong to a Ping numbered
        # above the one given (sent after their Subscribe).
        self.unstarted: list[tuple[int, Subscription[Any]]] = []
        # sid -> {vbucket: the Link of the worker it moved here from}: subscriptions that
        # worker carried, until they start here (`carry_from`).
        self.carried: dict[int, dict[int, Link]] = {}
        # sid -> the AckLedger of a group member with ack: its deliveries through this Link
        # from the current worker process (broky.client.groups)
        self.ledgers: dict[int, AckLedger] = {}
        # sid -> the ts of the last Replay frame a start of it was answered with, on this Link
        self.replay_ts: dict[int, int] = {}
        # Plain subscriptions in the Matcher (they take bare deliveries), and those whose start
        # waits for its Replay before they do (`subscribe_for`).
        self.matched: set[int] = set()
        self.awaiting: set[int] = set()

    def __repr__(self) -> str:
        state = "up" if self.proto is not None else "down"
        return f"<Link {self.ref.node_id}/{self.ref.worker} {state}>"

    @property
    def is_up(self) -> bool:
        """Connected (AckLink): a control frame written now reaches the worker."""
        return self.proto is not None

    # ---------------------------------------------------------------- connection state

    def start(self, reconnect: bool) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._connect_loop(reconnect))

    def attach(self, proto: WorkerProtocol, welcome: Welcome, reconnect: bool) -> None:
        client = self.client
        proto.attach(self, (self.pos_epoch, self.pos_offset, self.pos_ts), self.on_replayed, self.on_group)
        self.proto = proto
        client.take_welcome(welcome)
        resumed = welcome.resumed
        if resumed is not None and (
            self.previous is None or resumed.connection_id != self.previous.connection_id
        ):
            resumed = None
        lost_one = self.previous is not None
        if lost_one and (resumed is not None or self.ended_clean):
            # Its account said exactly what it lost, or its Goodbye came after every delivery
            # (and notice): the epochs it delivered end with no further loss.
            client.epochs_settled(self.epochs_held())
        self.previous = None
        self.settle(None if resumed is None else resumed.processed)
        if resumed is not None and resumed.refused > self.lost_refusals:
            # refused with NOT_MY_VBUCKET, and the Errors carrying them back went with the connection
            self._count_lost_refusals(resumed.refused - self.lost_refusals)
        self.lost_refusals = 0
        # another worker process than the last connection's (it or its server restarted):
        # the deliveries acknowledgements would name are gone with the old one
        restarted = bool(self.conn_id) and welcome.connection_id >> 32 != self.conn_id >> 32
        if restarted and self.ledgers:
            self.lose_unacked()
        # a new connection: count from zero (`out` holds publishes only while down)
        self.conn_id = welcome.connection_id
        self.resume_token = welcome.resume_token
        self.refusals = 0
        self.received = self.told_lost = self.group_received = 0
        self.written = self.confirmed = self.released = 0
        self.retained.clear()
        self.retained_bytes = 0
        self.goodbye_processed = None
        self.outstanding = 0
        subscribes = [encode_subscribe(self.subscribe_for(s)) for s in self.subs.values()]
        if subscribes:
            proto.write(b"".join(subscribes))  # first: a restarted worker waits for them (section 7.2)
        if self.paused_by:  # a subscriber's queue is still full: the new connection is paused too
            proto.write(PAUSE_FRAME)
        if reconnect or self.out:
            self._send_ping(None)  # after the publishes that wait in `out`, in the same write
        for ledger in self.ledgers.values():  # settled while down, for the same worker process
            ledger.send()
        if client.ping_interval is not None:
            self.keepalive = client.loop.call_later(client.ping_interval, self._keepalive)
        self.up.set()
        self.tried.set()
        if lost_one:
            tail, self.tail = self.tail, []
            client.link_reconnected(self, resumed is not None, tail)
        if reconnect:
            client.stats.reconnects += 1
            client.invoke_callback(client.on_reconnect, self.ref)

    async def _connect_loop(self, reconnect: bool) -> None:
        client = self.client
        delay = client.reconnect_min_delay
        attempts = 0
        last: BaseException | None = None
        while not client.is_closed and not self.retired:
            host, port = client.address_of(self.ref.node_id)
            hello = Hello(
                worker=self.ref.worker,
                client_name=client.name,
                auth_token=client.auth_token,
                previous=self.previous,
                positions=self.previous is not None,  # it resubscribes `since` its positions
            )
            try:
                proto, welcome = await open_connection(
                    host, port, hello, client.connect_timeout, tls=client.tls
                )
            except BrokyError as exc:
                last = exc
                self.tried.set()
                if isinstance(exc, ServerError):
                    client.report_error(exc)
            else:
                if client.is_closed or self.retired:
                    proto.abort()
                    return
                self.attach(proto, welcome, reconnect)
                return
            attempts += 1
            limit = client.max_reconnect_attempts
            if limit is not None and attempts >= limit:
                self._give_up(attempts, last)
                return
            await asyncio.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, client.reconnect_max_delay)

    def settle(self, processed: int | None) -> None:
        """Settle the publishes of the lost connection that no Pong confirmed: the ones
        the server did not process (it said how many it did: `processed`) go first
        into `out`, to be sent again; with no account (None), all of them may have
        been lost, and are counted so."""
        doubt, self.in_doubt = self.in_doubt, None
        if doubt is None or doubt.written <= doubt.confirmed:
            return
        client = self.client
        if processed is None:
            self._settle_unknown(doubt)
            return
        again: list[bytes] = []
        for w in doubt.retained:
            if w.first + w.publishes > processed:
                again.extend(w.frames()[max(processed - w.first, 0) :])
        if again:
            self.out[:0] = again
            self.out_bytes += sum(len(f) for f in again)
            client.stats.resent_after_loss += len(again)
        lost = max(min(doubt.released, doubt.written) - processed, 0)  # let go of before the drop
        if lost:
            self._count_unconfirmed(lost, "they were no longer kept (memory bound)")

    def _settle_unknown(self, doubt: InDoubt) -> None:
        """The server has no account of the lost connection (another server process,
        or a node that is gone): the unconfirmed publishes that carry a uid are sent
        again, through the client's routing (subscribers drop the duplicates this
        may cause, by uid); those without a uid may have been lost, and are counted."""
        again: list[bytes] = []
        for w in doubt.retained:
            again.extend(w.frames()[max(doubt.confirmed - w.first, 0) :])
        with_uid = [f for f in again if f[HEADER_AT:HEADER_END] == HEADER_UID]
        lost = doubt.written - doubt.confirmed - len(with_uid)
        if with_uid:
            self.client.stats.resent_after_loss += len(with_uid)
            self.client.send_again(self, with_uid)
        if lost > 0:
            why = "the server has no account of it"
            if len(again) > len(with_uid):
                why += "; publishes without a uid are not sent twice"
            self._count_unconfirmed(lost, why)

    def _count_lost_refusals(self, n: int) -> None:
        """The server refused n publishes of the lost connection with NOT_MY_VBUCKET
        (Welcome.resumed.refused), and the Errors that carried them back were lost with
        it: they are lost, counted in `stats.misrouted` and reported by the next flush."""
        self.unconfirmed += n
        self.client.stats.misrouted += n
        self.client.report_error(
            BrokyConnectionError(
                f"connection to worker {self.ref.worker} lost with {n} publishes refused with "
                "NOT_MY_VBUCKET whose refusals (carrying them back) never arrived: they are lost"
            )
        )

    def _count_unconfirmed(self, n: int, why: str) -> None:
        client = self.client
        self.unconfirmed += n
        client.stats.unconfirmed_lost += n
        client.report_error(
            BrokyConnectionError(
                f"connection to worker {self.ref.worker} lost with {n} publishes written but not "
                f"confirmed: they may not have reached the server ({why})"
            )
        )

    def _give_up(self, attempts: int, last: BaseException | None) -> None:
        self.settle(None)
        dropped = len(self.out) + self.out_extra
        self.client.stats.unsent_gave_up += dropped
        self.out = []
        self.out_bytes = 0
        self.out_extra = 0
        exc = BrokyConnectionError(
            f"gave up on worker {self.ref.worker} after {attempts} attempts ({last}); "
            f"{dropped} buffered publishes dropped"
        )
        self.failed = exc
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        self.pings.clear()
        self.up.set()  # wake round trips; they see `failed`
        self.client.report_error(exc)

    def gave_up_error(self) -> BrokyConnectionError:
        """A fresh copy of `failed` to raise (re-raising one instance grows its traceback)."""
        assert self.failed is not None
        return BrokyConnectionError(str(self.failed))

    def _keepalive(self) -> None:
        """Timer, every ping_interval while connected: Ping, or drop a connection that stopped answering."""
        self.keepalive = None
        proto = self.proto
        client = self.client
        if proto is None or client.ping_interval is None:
            return
        if self.outstanding >= client.max_outstanding_pings:
            client.stats.ping_timeouts += 1
            proto.failure = BrokyConnectionError(
                f"no Pong from worker {self.ref.worker} to {self.outstanding} Pings in "
                f"{self.outstanding * client.ping_interval:g} s: the connection is stale"
            )
            proto.abort()  # connection_lost -> on_lost -> reconnect
            return
        self.outstanding += 1
        self._send_ping(None)
        self.keepalive = client.loop.call_later(client.ping_interval, self._keepalive)

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        if proto is not self.proto:
            return
        self.proto = None
        self.up.clear()
        self._stop_timers()
        for sub in self.subs.values():  # a member paused there: the member was the lost connection
            sub.paused_on.discard(self.ref)
        report = isinstance(exc, BrokyError) and not isinstance(exc, ServerShutdownError)
        if exc is None:
            exc = BrokyConnectionError(f"connection to worker {self.ref.worker} closed")
        self.ended_clean = self.goodbye_processed is not None
        if self.conn_id:
            self.previous = PreviousConnection(
                self.conn_id, self.received, self.told_lost, self.resume_token, self.group_received
            )
            self.lost_refusals = self.refusals
            self.tail = proto.tail
        self.in_doubt = InDoubt(self.confirmed, self.written, self.released, self.retained)
        self.retained = collections.deque()
        self.retained_bytes = 0
        self.written = self.confirmed = 0
        if self.goodbye_processed is not None:  # the server said what it processed: settled now
            self.settle(self.goodbye_processed)
        lost = BrokyConnectionError(f"connection to worker {self.ref.worker} lost: {exc}")
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(lost)
        self.pings.clear()
        client = self.client
        if client.is_closed:
            self.settle(None)
            return
        if report:  # an error the server sent, or the protocol broken (a plain drop is no error)
            client.report_error(exc)
        client.invoke_callback(client.on_disconnect, self.ref, exc)
        self.start(reconnect=True)

    def _stop_timers(self) -> None:
        """Cancel the pending flush and the keepalive."""
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None

    def close(self) -> None:
        self.up.set()  # wake round trips waiting for a reconnect: they see the client closed
        self.tried.set()
        if self.task is not None:
            self.task.cancel()
        self._stop_timers()
        for ledger in self.ledgers.values():  # settled after the client's close: dropped
            ledger.close()
        if self.proto is not None:
            self.flush_out()
            self.proto.close()
        self.settle(None)  # a lost connection's unconfirmed publishes that were never settled
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(ClientClosedError("the client was closed"))
        self.pings.clear()

    # ---------------------------------------------------------------- outbound

    def send(self, frame: bytes) -> bool:
        """Queue a publish; return True if it completed a batch that was written now.

        Raises:
            PublishBufferFullError: down, and `max_reconnect_buffer_bytes` already wait.
            BrokyConnectionError: reconnecting to this worker was given up.
        """
        n = self.out_bytes + len(frame)
        if self.proto is None:
            if self.failed is not None:
                raise self.gave_up_error()
            limit = self.client.max_reconnect_buffer_bytes
            if n > limit:
                raise PublishBufferFullError(self.out_bytes, limit)
            self.out.append(frame)
            self.out_bytes = n
            return False
        self.out.append(frame)
        self.out_bytes = n
        if n >= self.client.batch_size:
            self.flush_out()
            return True
        if self.flush_handle is None:
            self.schedule_flush()
        return False

    def schedule_flush(self) -> None:
        """Write `out` when the loop next runs, or after `linger` (once per batch, not per publish)."""
        linger = self.client.linger
        loop = self.client.loop
        self.flush_handle = (
            loop.call_soon(self.flush_out) if linger <= 0 else loop.call_later(linger, self.flush_out)
        )

    def flush_out(self, controls: int = 0) -> None:
        """Write `out` in one write; `controls` of its frames are control frames, not publishes.

        The chunk is kept (`retained`) until a Pong confirms its publishes; a Ping
        goes with it when the last one added to a write of publishes is older than
        `confirm_interval` (so confirmations cost a Ping per interval, not per write).
        """
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        proto = self.proto
        if proto is None or not self.out or self.fences:
            return
        out = self.out
        self.front = 0
        published = len(out) - controls + self.out_extra
        ping_id = 0
        if published:
            client = self.client
            now = client.loop.time()
            if now - self.confirm_sent >= client.confirm_interval:
                self.confirm_sent = now
                self.next_ping = ping_id = self.next_ping + 1
                out.append(encode_ping(Ping(ping_id)))
        if len(out) > WRITEV_PARTS and self.out_bytes < len(out) * JOIN_BELOW:
            out = [b"".join(out)]  # many frames (per-call publishes): one bytes
        if len(out) == 1:
            proto.write(out[0])
        else:  # a few parts, or large ones (publish_many's chunks): a writev, not copied again
            proto.writelines(out)
        size = sum(map(len, out))
        self.out = []
        self.out_bytes = 0
        self.out_extra = 0
        if published:
            first = self.written
            self.written = written = first + published
            if ping_id:
                self.pings[ping_id] = (None, written)
            self.retained.append(Written(out, first, published, size))
            self.retained_bytes += size
            if self.retained_bytes > self.client.max_reconnect_buffer_bytes:
                self._release()

    def _release(self) -> None:
        """Let go of the oldest unconfirmed chunks past the memory bound (if the
        connection drops now, those publishes cannot be sent again: see `settle`)."""
        retained = self.retained
        limit = self.client.max_reconnect_buffer_bytes
        while len(retained) > 1 and self.retained_bytes > limit:
            w = retained.popleft()
            self.retained_bytes -= w.size
            self.released = w.first + w.publishes

    def fence(self) -> None:
        """Write nothing until `lift_fence`: a vbucket moves here, and what its old owner
        refuses must be sent here before the publishes made since (broky.client.routing)."""
        self.fences += 1

    def lift_fence(self) -> None:
        self.fences -= 1
        if not self.fences and self.out and self.proto is not None:
            self.flush_out()  # only publishes wait in `out` while fenced (`send_control`)

    def send_first(self, frames: list[bytes]) -> None:
        """Queue publishes sent again for another Link (refused, or left by a Link whose
        node is gone) ahead of every publish queued since, after earlier ones of this kind."""
        at = self.front
        self.out[at:at] = frames
        self.front = at + len(frames)
        self.out_bytes += sum(len(f) for f in frames)
        if self.proto is not None and not self.fences and self.flush_handle is None:
            self.schedule_flush()

    def ended_cleanly(self) -> bool:
        """Nothing queued to this Link by its worker can have been lost unseen: its last
        connection ended with a Goodbye (the server writes every delivery before it; its
        close may still be on its way), or it never had one."""
        return self.goodbye_processed is not None or (self.proto is None and self.previous is None)

    def retire(self) -> tuple[list[bytes], InDoubt | None, list[tuple[bytes, int]]]:
        """Its node left the map: stop for good. Returns what it still had for others
        to take over: publishes never written (first those its worker said, in a
        Goodbye, it did not process), the lost connection's unconfirmed ones that no
        server can account for, and the tail of its last reads."""
        self.retired = True
        if self.task is not None:
            self.task.cancel()
        self._stop_timers()
        self.lose_unacked()  # no worker of this node will take their acknowledgements
        tail, self.tail = self.tail, []
        if self.proto is not None:
            proto, self.proto = self.proto, None
            proto.close()
            tail = proto.tail
            if self.written > self.confirmed:
                self.in_doubt = InDoubt(self.confirmed, self.written, self.released, self.retained)
        if self.in_doubt is not None and self.goodbye_processed is not None:
            # A Goodbye came (its connection's close may still be on its way): it said
            # what was processed; the rest is sent again, ahead of what was never written.
            self.settle(self.goodbye_processed)
        out, self.out = self.out, []
        self.out_bytes = 0
        self.out_extra = 0
        doubt, self.in_doubt = self.in_doubt, None
        for fut, _ in self.pings.values():
            if fut is not None and not fut.done():
                fut.set_exception(
                    BrokyConnectionError(f"worker {self.ref.worker} of {self.ref.node_id} left")
                )
        self.pings.clear()
        self.up.set()  # wake round trips and waiters: they see `retired`
        self.tried.set()
        return (
            [f for f in frames_in(out) if f[HEADER_AT:HEADER_END] in (HEADER_UID, HEADER_NO_UID)],
            doubt,
            tail,
        )

    def send_control(self, frame: bytes) -> None:
        """Write a control frame now, after every publish queued before it (nothing while
        down). While fenced (a move settles), it goes ahead of the fenced publishes: a
        Subscribe must be in place before them, and a Ping covers what was written."""
        proto = self.proto
        if proto is None:
            return
        if self.fences:
            proto.write(frame)
            return
        self.out.append(frame)
        self.out_bytes += len(frame)
        self.flush_out(1)

    def ping(self) -> asyncio.Future[None]:
        """Send a Ping now; the future is done when its Pong arrives."""
        fut: asyncio.Future[None] = self.client.loop.create_future()
        self._send_ping(fut)
        return fut

    def ping_now(self) -> asyncio.Future[None]:
        """A Ping written at once, even while fenced: its Pong says the worker processed
        every frame written before it (not those still in `out`)."""
        fut: asyncio.Future[None] = self.client.loop.create_future()
        if self.proto is None:
            fut.set_exception(BrokyConnectionError(f"worker {self.ref.worker} is down"))
            return fut
        self.next_ping += 1
        self.proto.write(encode_ping(Ping(self.next_ping)))
        self.pings[self.next_ping] = (fut, self.written)
        return fut

    def _send_ping(self, fut: asyncio.Future[None] | None) -> None:
        self.next_ping += 1
        ping_id = self.next_ping
        self.send_control(encode_ping(Ping(ping_id)))
        # after the write: `written` counts every publish sent before this Ping
        self.pings[ping_id] = (fut, self.written)

    async def round_trip(self, retry: bool = True) -> None:
        """Return once the worker has processed every frame sent before now.

        Waits for the connection if it is down. If it drops before the Pong:
        with `retry`, waits for the reconnect and pings again (what the dropped
        connection carried unconfirmed is in `unconfirmed`); else raises. A Link
        retired meanwhile (its node left the map) ends the round trip at once:
        what it carried went to the new owners or was counted (`retire`), and
        the caller confirms it there (broky.client.client `flush`).

        Every turn of the loop waits for the Pong or for `up`, which is set only
        when the Link is connected or has ended (given up, retired, closed):
        the loop never turns without yielding to the event loop.

        Raises:
            BrokyConnectionError: reconnecting was given up; the Link was retired;
                or, without `retry`, the connection dropped.
            ClientClosedError: the client was closed.
        """
        while True:
            if self.failed is not None:
                raise self.gave_up_error()
            if self.client.is_closed:
                raise ClientClosedError("the client is closed")
            if self.retired:
                raise BrokyConnectionError(
                    f"worker {self.ref.worker} of {self.ref.node_id} left the cluster (its node is "
                    "no longer in the map)"
                )
            if self.proto is None:
                await self.up.wait()  # set once connected again, given up, retired or closed
                continue
            try:
                await self.ping()
                return
            except BrokyConnectionError:
                if not retry or self.failed is not None:
                    raise

    # ---------------------------------------------------------------- subscriptions

    def add_sub(self, sub: Subscription[Any]) -> None:
        self.subs[sub.sid] = sub
        if sub.group is None:  # a member's deliveries are announced for it alone (on_group)
            self.unstarted.append((self.next_ping, sub))
        self.send_control(encode_subscribe(self.subscribe_for(sub)))

    def subscribe_for(self, sub: Subscription[Any]) -> Subscribe:
        """`sub`'s Subscribe on this worker (`resume_subscribe`), and its place in the
        Matcher: a plain subscription whose Subscribe names a start takes no bare delivery
        until its Replay arrives (the seam, schema/README.md 5.1: what comes before it is
        also in the replay); one without a start takes them from now on."""
        subscribe = self.resume_subscribe(sub)
        if sub.group is None:
            sid = sub.sid
            if subscribe.since or subscribe.since_time or subscribe.last:
                if sid in self.matched:
                    self.matched.discard(sid)
                    self.matcher.remove(sub.pattern, sub)
                self.awaiting.add(sid)
            else:
                self.awaiting.discard(sid)
                if sid not in self.matched:
                    self.matched.add(sid)
                    self.matcher.add(sub.pattern, sub)
        return subscribe

    def resume_subscribe(self, sub: Subscription[Any]) -> Subscribe:
        """The Subscribe for `sub` on this worker: where it asked to start, the first time;
        after that, from what this Link received since it started (see the header). A
        group member's is always the same (a group starts live)."""
        if sub.group is not None:
            return sub.group.subscribe(sub.sid, sub.pattern, sub.partition)
        start = sub.starts.get(self.ref)
        if start is None:  # not started here yet: as asked (and its start is the next Pong's ts)
            if not any(s is sub for _, s in self.unstarted):
                self.unstarted.append((self.next_ping, sub))
            carried = self.carried.get(sub.sid)
            if carried:
                return self._carried_subscribe(sub, carried)
            return Subscribe(sub.sid, sub.pattern, sub.partition, sub.since, sub.since_time, sub.last)
        ts = self.pos_ts
        epochs = self.pos_epoch
        offsets = self.pos_offset
        since = {vb: (epochs[vb], offsets[vb], t) for vb, t in enumerate(ts) if t and t >= start}
        for vb, replayed in sub.replayed.get(self.ref, {}).items():
            mine = since.get(vb)
            if mine is None or later(replayed, mine):
                since[vb] = replayed
        positions = tuple(Position(vb, e, o) for vb, (e, o, _) in sorted(since.items()))
        return Subscribe(sub.sid, sub.pattern, sub.partition, positions, start)

    def carry_from(self, old: Link, vbs: set[int]) -> None:
        """Vbuckets `vbs` moved here from `old`'s worker: the subscriptions it carried
        that have not started here go on from what `old` received (see the header)."""
        for sub in old.subs.values():
            if old.ref not in sub.starts or self.ref in sub.starts:  # (never a group member's)
                continue
            mine = vbs if sub.partition is None else vbs & {vbucket_of(sub.partition)}
            if mine:
                carried = self.carried.setdefault(sub.sid, {})
                for vb in mine:
                    carried[vb] = old

    def _carried_subscribe(self, sub: Subscription[Any], carried: dict[int, Link]) -> Subscribe:
        """The first Subscribe here of a subscription whose vbuckets moved here from
        other workers: `since` what their Links received after it started there."""
        since = {p.vbucket: (p.epoch, p.offset, 0) for p in sub.since}
        begun: list[int] = []
        for vb, old in carried.items():
            start = sub.starts.get(old.ref)
            if start is None:
                continue
            begun.append(start)
            t = old.pos_ts[vb]
            if t and t >= start:
                since[vb] = (old.pos_epoch[vb], old.pos_offset[vb], t)
            replayed = sub.replayed.get(old.ref, {}).get(vb)  # a start there replayed it, newer?
            mine = since.get(vb)
            if replayed is not None and (mine is None or later(replayed, mine)):
                since[vb] = replayed
        positions = tuple(Position(vb, e, o) for vb, (e, o, _) in sorted(since.items()))
        since_time = min(begun) if begun else sub.since_time
        return Subscribe(sub.sid, sub.pattern, sub.partition, positions, since_time, sub.last)

    def remove_sub(self, sub: Subscription[Any], tell_server: bool = True) -> None:
        self.carried.pop(sub.sid, None)
        self.replay_ts.pop(sub.sid, None)
        self.awaiting.discard(sub.sid)
        if self.subs.pop(sub.sid, None) is None:
            return
        self.resume_for(sub.sid)
        sub.paused_on.discard(self.ref)
        ledger = self.ledgers.pop(sub.sid, None)
        if ledger is not None:  # what was settled goes before the Unsubscribe; later ones are dropped
            ledger.send()
            ledger.close()
        if sub.sid in self.matched:
            self.matched.discard(sub.sid)
            self.matcher.remove(sub.pattern, sub)
        if tell_server:
            self.send_control(encode_unsubscribe(Unsubscribe(sub.sid)))

    def lose_unacked(self) -> None:
        """The worker process that holds this Link's group deliveries is gone (restarted,
        or its node left the map): its ack members' ledgers are orphaned (broky.client.groups).
        The NACKs that waited to be sent are lost, told through `on_loss`
        (LossReason.UNACKED_LOST); the deliveries the application still holds are its own
        (an ACK of them is dropped, a NACK told lost then)."""
        ledgers, self.ledgers = self.ledgers, {}
        for sid, ledger in ledgers.items():
            self.unacked_lost(sid, ledger.orphan())

    def unacked_lost(self, sid: int, lost: int) -> None:
        """`lost` NACKs of ack subscription `sid` asked a worker process that is gone for a
        redelivery: lost, told (UNACKED_LOST)."""
        if lost:
            client = self.client
            client.stats.unacked_lost += lost
            client.loss_told(self.ref, lost, LossReason.UNACKED_LOST)

    def pause_for(self, sid: int) -> None:
        """Subscription `sid`'s queue is full: the worker keeps this connection's
        deliveries queued (Pause) until every subscription that asked has room again."""
        if sid in self.paused_by:
            return
        self.paused_by.add(sid)
        if len(self.paused_by) == 1:
            self.client.stats.pauses += 1
            self.send_control(PAUSE_FRAME)

    def resume_for(self, sid: int) -> None:
        """Subscription `sid` has room again (or is gone)."""
        if sid not in self.paused_by:
            return
        self.paused_by.discard(sid)
        if not self.paused_by:
            self.send_control(RESUME_FRAME)

    # ---------------------------------------------------------------- inbound (WorkerProtocol handler)

    def on_message(self, msg: Message) -> None:
        # (its position is in pos_epoch/pos_offset/pos_ts already: the WorkerProtocol wrote it)
        self.received += 1
        client = self.client
        stats = client.stats
        stats.received += 1
        dupes = client.duplicate_uids
        if dupes is not None and msg.uid in dupes:
            stats.duplicates_dropped += 1
            return
        subs = self._matched.get(msg.key)
        if subs is None:
            subs = self.matcher.match(msg.key)
        if not subs:
            stats.unmatched += 1
            return
        kp = msg.key_partition
        for sub in subs:
            if sub.partition is None or sub.partition == kp:
                sub.deliver(msg)

    def on_group(self, msg: Message, sid: int, attempt: int) -> None:
        """A delivery a Delivery frame announced for group member `sid` alone (the
        WorkerProtocol counts them): handed to it as a GroupMessage, never to the
        Matcher's subscriptions, and not a position of the Link's live stream."""
        self.received += 1
        self.group_received += 1
        stats = self.client.stats
        stats.received += 1
        stats.group_received += 1
        if attempt > 1:
            stats.redeliveries += 1
        sub = self.subs.get(sid)
        if sub is None or sub.closed or sub.group is None:
            stats.unmatched += 1
            return
        if not sub.group.ack:
            sub.deliver(GroupMessage(msg, attempt))
            return
        ledger = self.ledgers.get(sid)
        if ledger is None:
            ledger = self.ledgers[sid] = self.client.acks.ledger(self, sid, sub)
        position = Position(msg.vbucket, msg.epoch, msg.offset)
        opened = ledger.delivered(position)
        dropped = stats.dropped_local  # (the blocking client's queue counts there too)
        sub.deliver(GroupMessage(msg, attempt, ledger))
        if opened and stats.dropped_local != dropped:  # its queue was full past the hard bound
            ledger.forget(position)

    def on_group_notice(self, notice: GroupNotice) -> None:
        """A member's pause or resume on this worker, or a drain deadline that passed."""
        client = self.client
        sub = self.subs.get(notice.sid)
        if notice.event == GroupEvent.PAUSED:
            client.stats.group_paused += 1
            if sub is not None:
                sub.paused_on.add(self.ref)
        elif notice.event == GroupEvent.RESUMED:
            if sub is not None:
                sub.paused_on.discard(self.ref)
        elif notice.event == GroupEvent.DRAIN_EXPIRED:
            client.stats.group_drain_expired += 1
            client.report_error(DrainExpiredError(notice.sid, notice.vbucket, notice.messages))

    def on_frame(self, frame: Frame) -> None:
        client = self.client
        if isinstance(frame, Pong):
            self.outstanding = 0
            self.behind = frame.behind  # owed while it lags (Subscription.lag)
            self.pong_ts = frame.ts
            self.pong_at = time.monotonic_ns()
            entry = self.pings.pop(frame.id, None)
            if entry is not None:
                fut, written = entry
                if written > self.confirmed:
                    self.confirmed = written
                    retained = self.retained
                    while retained and retained[0].first + retained[0].publishes <= written:
                        self.retained_bytes -= retained.popleft().size
                if fut is not None and not fut.done():
                    fut.set_result(None)
            if self.unstarted:
                self.started(frame.id, frame.ts)
        elif isinstance(frame, Error):
            err = server_error(frame)
            handled = False  # else reported below
            if err.code == ErrorCode.NOT_MY_VBUCKET:
                if not err.sid:
                    self.refusals += 1  # a publish (Welcome.resumed.refused counts them too)
                client.not_my_vbucket(self, err, frame.refused)
                handled = True  # resent, or reported if lost
            elif err.code in (ErrorCode.SUBSCRIPTION_LIMIT, ErrorCode.BAD_GROUP) and err.sid:
                client.subscription_refused(self, err)
                handled = True  # raised by `subscribe`, or reported once
            elif err.code == ErrorCode.PERMISSION_DENIED:  # (--users) the connection stays
                if err.sid:  # refused, or ended by a reload of the users: ended here too
                    client.subscription_refused(self, err)
                    handled = True
                else:
                    self.refusals += 1  # a publish (Welcome.resumed.refused counts them too)
                    client.stats.denied += 1
            if frame.fatal and self.proto is not None and self.proto.failure is None:
                self.proto.failure = err  # the reason the server closes: on_disconnect's
            elif not handled:
                client.report_error(err)
        elif isinstance(frame, Replay):  # a start's answer begins: where its notices' positions stand
            self.replay_ts[frame.sid] = frame.ts
            if frame.sid in self.awaiting:  # its live deliveries follow: bare ones are its own now
                self.awaiting.discard(frame.sid)
                sub = self.subs.get(frame.sid)
                if sub is not None:
                    self.matcher.add(sub.pattern, sub)
                    self.matched.add(frame.sid)
        elif isinstance(frame, LossNotice):
            if frame.through is not None and frame.sid:
                self.told_through(frame.sid, frame.through, frame.dropped)
            elif frame.through is not None and frame.reason == LossReason.EVICTED:
                self.lag_told_through(frame.through)
            if not frame.sid or frame.reason == LossReason.SLOW_CONSUMER:  # the account's drops
                self.told_lost += frame.dropped
            client.stats.server_lost += frame.dropped
            if frame.reason == LossReason.EPOCH_CHANGED:
                client.stats.epochs_changed += 1
                if frame.at is not None and client.epoch_settled(frame.at.epoch):
                    # The connection that delivered that epoch was lost and its loss is told
                    # (exactly, by its account; or once, UNACCOUNTED) or none (a Goodbye):
                    # the epoch's end is no further loss, and is not told again.
                    return
            if frame.reason == LossReason.UNACCOUNTED:
                # A connection that carried no subscription had no delivery to lose, and one
                # that ended with a Goodbye was sent every delivery and notice before it.
                if self.subs and not self.ended_clean:
                    client.loss_unaccounted(self.ref)
                client.epochs_settled(self.epochs_held())
                return
            told = self.subs.get(frame.sid) if frame.sid else None
            if told is not None and told.on_loss is not None:  # the subscription's own hook
                client.invoke_callback(told.on_loss, frame.dropped, frame.reason)
                return
            client.loss_told(self.ref, frame.dropped, frame.reason)
        elif isinstance(frame, GroupNotice):
            self.on_group_notice(frame)
        elif isinstance(frame, MapUpdate):
            client.map_updated(self, frame.map)
        elif isinstance(frame, Goodbye):
            log.info("worker %s says goodbye: %s", self.ref, frame.reason)
            self.goodbye_processed = frame.processed
            if self.proto is not None:  # nothing sent from now on would be processed
                self.proto.failure = ServerShutdownError(frame.reason or "", frame.processed)
                self.proto.abort()
        else:
            if self.proto is not None:
                self.proto.failure = RemoteProtocolError(
                    f"unexpected {type(frame).__name__} frame from the server"
                )
                self.proto.abort()

    def epochs_held(self) -> set[int]:
        """The epochs of the positions this Link received (live, or replayed to one of its
        subscriptions): those of the worker processes its connections were served by."""
        epochs = {e for e, t in zip(self.pos_epoch, self.pos_ts, strict=True) if t}
        for sub in self.subs.values():
            epochs.update(e for e, _, _ in sub.replayed.get(self.ref, {}).values() if e)
        return epochs

    def told_through(self, sid: int, through: Position, dropped: int) -> None:
        """A start's LossNotice accounts for subscription `sid`'s messages of a vbucket up to
        `through` (told lost, or replayed before it): its next start here goes on after
        that, unless the start already replayed a later message of the vbucket. So what
        was told is never asked for, and told, again."""
        sub = self.subs.get(sid)
        if sub is None:
            return
        vb = through.vbucket
        if dropped:
            sub.lost_by_vbucket[vb] = sub.lost_by_vbucket.get(vb, 0) + dropped
        mine = sub.replayed.setdefault(self.ref, {})
        have = mine.get(vb)
        if have is not None and have[0] == through.epoch and have[1] >= through.offset:
            return
        # The start's ts: every message it replayed is older, every live one after it newer.
        mine[vb] = (through.epoch, through.offset, self.replay_ts.get(sid, 0))

    def lag_told_through(self, through: Position) -> None:
        """A lagging connection's notice (sid 0): the buffer evicted messages of a vbucket
        before the worker could send them (schema/README.md 7). Every plain subscription
        started here accounts for them as told: its next start goes on after `through`, so
        a resume neither asks for them nor is told them again."""
        vb = through.vbucket
        for sub in self.subs.values():
            start = sub.starts.get(self.ref)
            if sub.group is not None or start is None:
                continue
            mine = sub.replayed.setdefault(self.ref, {})
            have = mine.get(vb)
            if have is not None and have[0] == through.epoch and have[1] >= through.offset:
                continue
            if (
                self.pos_epoch[vb] == through.epoch
                and self.pos_offset[vb] >= through.offset
                and self.pos_ts[vb]
            ):
                continue  # received past it already
            # Its messages came after the start and before what follows them here.
            mine[vb] = (through.epoch, through.offset, max(start, self.pos_ts[vb]))

    def started(self, ping_id: int, ts: int) -> None:
        """A Pong: the subscriptions whose Subscribe went before its Ping start at its ts."""
        waiting = []
        for after, sub in self.unstarted:
            if ping_id > after:
                sub.starts.setdefault(self.ref, ts)
                self.carried.pop(sub.sid, None)
            else:
                waiting.append((after, sub))
        self.unstarted = waiting

    def on_replayed(self, msg: Message, sid: int) -> None:
        """A delivery a Replay frame announced for subscription `sid` alone (the
        WorkerProtocol counts them): not a position of the Link's live stream, but the
        subscription's own, for its next resume."""
        self.received += 1
        stats = self.client.stats
        stats.received += 1
        stats.replayed += 1
        sub = self.subs.get(sid)
        if sub is not None and not sub.closed:
            sub.replayed.setdefault(self.ref, {})[msg.vbucket] = (msg.epoch, msg.offset, msg.ts_broker)
            sub.deliver(msg)


__all__ = ["Link", "LinkOwner", "WorkerRef"]
