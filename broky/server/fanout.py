"""One worker's shard: its subscription table and the fan-out fast path.

Theory of operation
-------------------
`Shard.feed(conn, data)` handles one read of one connection, top to bottom:

1. Parse every whole frame of the read (uint32 size prefix, checked against
   max_frame_bytes before anything is buffered). A Message frame in the
   canonical layout (broky.protocol.message) is recognised by its fixed header,
   read with its size prefix and every offset in one struct read. Its shape
   (size, offsets, key_partition length) is checked once, when first met, and
   cached (`shape`: size within the limit, vectors inside the frame in the
   order key_partition, key, payload); per message only the key's and the
   payload's lengths are read (one struct read) and checked, because
   subscribers receive these bytes. The routing bytes (the key_partition and
   key vectors) are then sliced out (a route cache miss validates the whole
   frame). Any other valid layout takes `route_message`; any other frame goes
   through `decode_frame` and `control`.
2. Route through a cache: routing bytes -> the target connections (a tuple
   interned per distinct target set), or None when this worker does not own
   the key_partition's vbucket (a non-fatal NOT_MY_VBUCKET error; the message
   is dropped and counted). A vbucket a prepared map moves to this worker
   counts as owned: a client that adopted the commit before this worker did
   is not refused (schema/README.md 6.3). On a miss, `route` checks ownership
   (one index into a 1024-byte table, `accepts`) and asks `Matcher.match` for the delivery plan: the
   distinct connections with an all-partition subscription, plus (only when
   scoped subscriptions match) those subscribed to this key_partition. A
   connection appears at most once, so a message travels once per connection
   however many of its subscriptions match; the client dispatches locally.
   Any subscription change (subscribe, unsubscribe, disconnect) empties the
   cache; it is also emptied when it reaches ROUTE_CACHE_SIZE entries. Routes
   of keys (key_partition + key) over ROUTE_CACHE_MAX_KEY bytes are not cached,
   here or in the matcher, so the caches hold at most ROUTE_CACHE_SIZE small keys.
3. Runs: consecutive messages with the same targets form a run. A message whose
   size prefix, fixed header and routing bytes equal those of the run's first
   message is known to have the same route and valid bounds without any
   further parsing, so it only gets its stamp. Once a message of the run
   differs, the rest of the run skips that comparison.
4. Stamp ts_broker: the read is copied once into a bytearray (only when it
   holds a message with subscribers), every message is stamped in place with
   the one time.time_ns() taken for the read, and slices of that copy are
   forwarded. The publisher's bytes are not re-encoded, except for a Message
   in another layout than the canonical one (route_message gives no stamp
   position): it ends the current run and its `canonical_copy` is queued alone.
5. At the end of each run (`emit`) append one slice holding the whole run to
   each target's `out` list and remember the connection; a target over its
   pending bound takes the leading messages that fit and the others are
   dropped and counted (`squeeze`; see broky.server.connection for how pending
   bytes are counted).
6. After the whole read, commit the counters it changed (the publisher's
   messages processed, each target's deliveries queued and dropped) to the
   accounts table (broky.server.accounts), then write once per touched
   connection (`b"".join`): whatever a client could receive is accounted
   before it leaves, so a client reconnecting after this worker died learns
   exactly what was processed and what was lost.

Order: frames of one connection are handled in order and every delivery to a
connection goes through its single `out` list, so the messages of one
key_partition from one publisher reach each subscriber in publish order.

Slow consumers: the first drop starts a clock (`over_since`). When the
connection's pending bytes are down to the low-water mark (a quarter of the
bound: seen after a write, on resume_writing, or by `tick` when the buffer
drained without ever reaching the high-water mark) or, for a paused
connection, when it resumes, it gets LossNotice{dropped} and the clock stops.
A quarter rather than "below the bound" leaves the subscriber room, so the
notices do not flap and each carries a useful count. The periodic `tick`
closes a connection whose clock ran past --slow-consumer-deadline with a
fatal SLOW_CONSUMER error (preceded by a LossNotice). A paused connection
keeps its deliveries in `out` under the same bound.

Replies: control replies (Pong, Error) count in the pending bytes but are
never dropped, and they have a bound of their own, --max-reply-bytes (at most
the pending bound): a connection with more unread replies than that is read no
more (`hold_reads`) until they are down to a quarter of it, and its clock runs
meanwhile. Only replies count here, never deliveries: a subscriber's backlog
must not stop that client's publishes. The write buffer is a FIFO, so a
connection counts the bytes it ever handed to its transport (`sent`) and, for
writes that carried replies, marks where they end (`reply_marks`: stream
position, replies written so far). Bytes that left the buffer = sent minus its
size; every mark at or before that point is popped, and the replies not known
to have left are the unread ones, except that the writes up to the first mark
left count at most their bytes still in the buffer (an upper bound, exact when
those writes held only replies). This runs only on rare paths: a flush whose
read queued a reply, and a connection whose reads are held (`flush`, `drained`,
and `tick` for a buffer that never reached the high-water mark).

Limits: a Subscribe over --max-subscriptions (count) or --max-subscription-bytes
(pattern + key_partition + SUBSCRIPTION_TOKEN_BYTES per pattern token, summed
over the connection) gets a non-fatal SUBSCRIPTION_LIMIT and creates nothing.
The token charge is there because a pattern token that no other pattern shares
costs a trie node of about 420 bytes (CPython 3.11): 4 KB of one-byte tokens
cost 850 KB, a 4 KB pattern of two tokens about 9.4 KB, a short pattern about
0.7-1 KB with its own Subscription and table entries. At the default limits
one connection holds at most about 13 MB, whatever its patterns (measured:
8-9 MB with 10,000 short patterns, 12 MB with patterns of one-byte tokens).

Memory budget: every worker keeps the pending bytes of all its connections
together under its share of --memory-budget (broky.server.budget), however
many connections there are and whatever their --max-pending-bytes allows.
`flush` charges each connection it touched (`charged` := its pending bytes
now: O(1) per touched connection, where `base` and `unflushed` change
anyway; nothing for one that had and has nothing pending) and adds the
difference to the worker's running total, `budget.pending`; a new peak of it
over the budget's room calls `enforce_budget` once the read is written
(`budget.peaked`: one test per read). That first makes the total exact
(`refresh_pending`: every transport's write buffer, as `tick` does four
times a second), since buffers drain unseen between writes; if still over,
it cuts the connections with the most pending bytes first, until the total
is under the low mark (a quarter below the room): `cut` aborts the transport
(its buffer freed at once), closes the connection as if lost, and marks its
account (broky.server.accounts, `cut`). The client is not told then (its
socket is full or stalled): when it reconnects naming the connection
(Hello.previous), the LossNotice after its Welcome carries exactly what it
lost (deliveries queued minus received) with reason SLOW_CONSUMER, counted
under dropped{slow_consumer}; each cut counts in `budget_cuts` and
`budget_cut_bytes`, and the worker logs at most one line per
WARNING_INTERVAL. The check runs after a read's deliveries are queued, so
the budget is overshot by at most one read's deliveries (at most about 256
KB read times the targets of its messages), until that read's flush ends.

Memory: what a closed connection's subscriptions or pending bytes used goes
back to the allocators, but glibc keeps freed heap below its top
(fragmentation), so a worker's RSS stayed far above its baseline after a
subscription flood (50,000 Subscribes of 4 KB, limits raised: 44 MB before,
490 MB at the peak, 100-290 MB after the close), and after a burst held for
stalled subscribers. Once closed connections or Unsubscribes freed
TRIM_AFTER_BYTES subscription bytes, or the pending bytes fell from a peak
over TRIM_AFTER_PEAK (or a quarter of the budget's room, if less) to under a
quarter of it, `tick` shrinks the matcher's tables that had an entry per
pattern (`Matcher.compact`) and calls malloc_trim(0) (broky.server.memory),
at most once per TRIM_INTERVAL seconds: 53-64 MB after the same flood, for
20-40 ms of the worker's time.

Restart grace: a worker that replaced a dead one holds every Message frame
(`feed_held`: a connection's reads pause at its first publish) until each of
the dead worker's subscribing connections has reconnected and restored its
subscriptions, or --restart-grace seconds pass (`start_grace`, `end_grace`);
then it routes what it held, in order. Control frames before a connection's
first publish are handled as usual, so the subscribers can come back.

Closing: a fatal error writes what the connection still had queued, then the
Error frame, then half-closes (write_eof) and discards further input until the
peer closes or --frame-timeout passes (then the socket is reset). This lingering
close lets the client read the Error even if it had more bytes in flight.
At shutdown every connection gets the same treatment with a Goodbye: what was
queued to it goes first (deliveries held for a paused connection are dropped),
and the messages it publishes after the Goodbye are counted and dropped
(`discard_after_goodbye`), both under the drop reason `shutdown`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from broky import __version__, fbs
from broky.errors import BadPatternError, ErrorCode, MalformedFrameError, RemoteProtocolError
from broky.matching import Matcher, parse_pattern
from broky.protocol import (
    PROTOCOL_VERSION,
    RESUME_TOKEN_BYTES,
    Goodbye,
    Hello,
    LossNotice,
    LossReason,
    MapApplied,
    MapUpdate,
    NodeInfo,
    Pause,
    Ping,
    Pong,
    PreviousConnection,
    Resume,
    Resumed,
    Subscribe,
    Unsubscribe,
    VBucketMap,
    Welcome,
    WelcomeTemplate,
    decode_frame,
    encode_frame,
    route_message,
)
from broky.protocol.frames import PING_SIZE_PREFIX, encode_pong, error_frame, ping_id
from broky.protocol.framing import MIN_FRAME_SIZE, check_size
from broky.protocol.message import (
    BODY_MESSAGE,
    HEADER_NO_UID,
    HEADER_UID,
    TS_BROKER_OFFSET,
    body_type,
    canonical_copy,
    pack_ts_into,
)
from broky.protocol.routing import vbucket_of
from broky.protocol.table import Buffer
from broky.server import fastpath, memory
from broky.server.accounts import Account, AccountBook, same_secret
from broky.server.budget import Budget
from broky.server.config import ServerConfig
from broky.server.connection import CLOSED, CLOSING, OPEN, Connection, Subscription
from broky.server.logs import Throttle

log = logging.getLogger("broky.worker")

_u32 = struct.Struct("<I").unpack_from
_SUBSCRIPTION_FRAMES = (fbs.Body.Subscribe, fbs.Body.Unsubscribe)
# Canonical Message (broky.protocol.message): size prefix @0, the 52 fixed header
# bytes @4, key offset @72, payload offset @76 (each relative to its own
# position), key_partition length @80, or @100 after a uid. One read gives all.
_canonical_head = struct.Struct("<I52s16xIII16xI").unpack_from
CANONICAL_HEAD_SIZE = 104
SHAPE_CACHE_SIZE = 4096
# A shape: (read of the key's and the payload's lengths, positions relative to the
# frame's first byte of the key vector, the payload vector, the end and the
# routing bytes); None for a valid canonical header whose vectors are not laid out
# key_partition, key, payload (the generic read handles it).
Shape = tuple[Callable[[Buffer, int], tuple[Any, ...]], int, int, int, int]
_time_ns = time.time_ns
_monotonic = time.monotonic
_LATENCY_BUCKETS = 32  # log2 buckets of microseconds
# A Shard keeps at most this many instance attributes. CPython 3.11 keeps an
# instance's attributes in a table shared with its class, and looks them up by a
# cached position, only while they are few: a 30th attribute made every read of
# one message 4-6% slower (bench/test_micro.py, test_shard_feed_one_message). New
# state goes into an object of its own (as `budget`).
SHARD_ATTRIBUTES = 29
ROUTE_CACHE_SIZE = 65536
# Routes of messages whose key_partition and key together exceed this many bytes are
# not cached: a cache bounded by entries must not hold megabytes of keys.
ROUTE_CACHE_MAX_KEY = 256
# Seconds between two warnings about one connection's non-fatal errors of one code (or
# about connections cut for the memory budget).
WARNING_INTERVAL = 10.0
SUBSCRIPTION_TOKEN_BYTES = 64  # charged per pattern token against --max-subscription-bytes
MAX_REPLY_MARKS = 64  # per connection; past it the newest mark moves forward (counts replies longer)
TRIM_AFTER_BYTES = 1 << 20  # subscription bytes freed before the heap is trimmed
TRIM_AFTER_PEAK = 64 << 20  # ... or pending bytes that fell from a peak over this to a quarter of it
TRIM_INTERVAL = 5.0  # seconds between two trims at least


def _is_message(buf: Buffer, pos: int, end: int) -> bool:
    """Whether buf[pos:end] is a Message frame (for counting what is dropped; never raises)."""
    try:
        return body_type(buf, pos, end) == BODY_MESSAGE
    except RemoteProtocolError:
        return False


def subscription_size(pattern: bytes, key_partition: bytes | None, tokens: int) -> int:
    """What a subscription counts against --max-subscription-bytes (schema/README.md, §5)."""
    return len(pattern) + len(key_partition or b"") + SUBSCRIPTION_TOKEN_BYTES * tokens


class Grace:
    """The state of a restart grace (see `Shard.start_grace`); `Shard.holding` is its flag."""

    __slots__ = ("expected", "held", "started", "timer", "until", "node_until")

    def __init__(self) -> None:
        self.expected: set[int] = set()  # ids of the dead worker's subscribers, until each is back
        self.held: list[Connection] = []  # connections whose input waits for the grace to end
        self.started = 0.0  # monotonic time it began
        self.timer: asyncio.TimerHandle | None = None
        self.until = 0.0  # monotonic time it ends at the latest
        self.node_until = 0.0  # monotonic end of a server restart grace (`start_node_grace`)


class Plan(NamedTuple):
    """Where a message with a given key goes."""

    everyone: tuple[Connection, ...]  # connections with an all-partition subscription
    scoped: dict[bytes, tuple[Connection, ...]] | None  # further connections by key_partition


def compile_plan(subs: list[Subscription]) -> Plan:
    """Turn the subscriptions matching a key into a delivery plan (distinct connections)."""
    everyone = dict.fromkeys(s.conn for s in subs if s.key_partition is None)
    scoped: dict[bytes, dict[Connection, None]] = {}
    for s in subs:
        if s.key_partition is not None and s.conn not in everyone:
            scoped.setdefault(s.key_partition, {})[s.conn] = None
    return Plan(tuple(everyone), {kp: tuple(c) for kp, c in scoped.items()} if scoped else None)


class WorkerStats:
    """Plain counters of one worker, read at scrape time (never locked)."""

    def __init__(self) -> None:
        self.messages_published = 0
        self.messages_delivered = 0
        self.dropped: dict[str, int] = {
            "no_subscribers": 0,
            "slow_consumer": 0,
            "not_my_vbucket": 0,
            "shutdown": 0,
            # deliveries queued to a connection that dropped, never received (counted
            # when its client reconnects and says what it received: broky.server.accounts)
            "connection_lost": 0,
            "worker_restart": 0,
        }
        # Reconnecting clients (Hello.previous) by whose account answered them:
        # this worker's own (connection_lost), a dead worker's (worker_restart), none.
        # "refused": claims that did not carry the connection's secret (they count as unknown too).
        self.resumes: dict[str, int] = {"connection_lost": 0, "worker_restart": 0, "unknown": 0, "refused": 0}
        # The restart grace of a worker that replaced a dead one (see Shard.start_grace).
        self.restart_subscribers_expected = 0
        self.restart_subscribers_missing = 0
        self.restart_connections_held = 0
        self.restart_grace_seconds = 0.0
        self.node_restart_graces = 0  # graces given because the whole server restarted (start_node_grace)
        self.bytes_received = 0
        self.bytes_sent = 0
        self.connections = 0  # open now
        self.connections_total = 0
        self.subscriptions = 0  # now
        self.subscription_bytes = 0  # now: summed `Subscription.size` of every connection
        self.subscriptions_refused: dict[str, int] = {"count": 0, "bytes": 0}  # SUBSCRIPTION_LIMIT, by limit
        self.reads_held = 0  # times a connection was read no more for its unread replies
        self.memory_trims = 0  # malloc_trim calls after subscription-heavy connections left
        self.budget_cuts = 0  # connections cut to keep the worker within its memory budget
        self.budget_cut_bytes = 0  # their pending bytes, freed by cutting them
        self.slow_consumer_disconnects = 0
        self.errors: dict[str, int] = {}  # Error frames sent, by code name
        self.bytes_discarded = 0  # unsent bytes of connections reset at the linger deadline
        # Delivered messages by log2 of their read's receive-to-write time: bucket i
        # counts times under 2**(i+10) ns (about 2**i us; see broky.server.histogram).
        self.latency_us = [0] * _LATENCY_BUCKETS
        self.latency_ns_sum = 0  # sum of those times, one per delivered message

    def count_error(self, code: ErrorCode) -> None:
        self.errors[code.name] = self.errors.get(code.name, 0) + 1


def _charged(c: Connection) -> int:
    return c.charged


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Shard:
    """The state of one worker: owned vbuckets, connections, subscription table."""

    def __init__(
        self,
        config: ServerConfig,
        index: int,
        loop: asyncio.AbstractEventLoop,
        book: AccountBook | None = None,
        epoch: int = 0,
        vmap: VBucketMap | None = None,
        compiled: bool | None = None,
    ) -> None:
        """compiled: run the compiled twin of the fast path (None: when it is built,
        broky.server.fastpath); False runs the pure-Python reference."""
        self.config = config
        if compiled and fastpath.compiled_scan is None:
            raise RuntimeError(f"the compiled fast path is not available: {fastpath.description}")
        self.scan = fastpath.compiled_scan if compiled is not False else None
        self.index = index
        self.loop = loop
        # Counters of every connection, mirrored where the master can read them if
        # this process dies (broky.server.accounts); in memory for tests and benchmarks.
        self.book = book if book is not None else AccountBook.in_memory()
        self.epoch = epoch  # this worker incarnation's part of every connection id
        if vmap is None:  # a single node (the cluster's map comes from the master)
            node = NodeInfo(config.node_id, config.advertised_host(), config.port, config.workers)
            vmap = VBucketMap.single_node(node)
        self.map = vmap
        self.owned = b""  # vbucket -> 1 if this worker owns it (`take_map`)
        self.accepts = b""  # ... or it is moving here (publishes and scoped Subscribes taken)
        self.welcome: WelcomeTemplate
        self.matcher: Matcher[Subscription, Plan] = Matcher(compile_plan)
        # Route cache: the routing bytes of a canonical Message (or (key_partition, key)
        # for any other layout) -> target connections, or None when not our vbucket.
        self.routes: dict[object, tuple[Connection, ...] | None] = {}
        # Shapes of canonical Messages met so far, with and without uid (see `shape`).
        self.uid_shapes: dict[tuple[int, int, int, int], Shape | None] = {}
        self.plain_shapes: dict[tuple[int, int, int, int], Shape | None] = {}
        self._interned: dict[tuple[Connection, ...], tuple[Connection, ...]] = {}
        self.stats = WorkerStats()
        self.conns: dict[int, Connection] = {}
        self._touched: list[Connection] = []
        self._next_id = 0
        self.closing = False
        self.warnings = Throttle(WARNING_INTERVAL)  # of clients' non-fatal mistakes
        # Restart grace (see `start_grace`): while `holding`, Message frames are held.
        self.holding = False
        self.grace = Grace()
        self.max_reply_bytes = min(config.max_reply_bytes, config.max_pending_bytes)
        # This worker's share of --memory-budget (see "Memory budget"; the replay buffer
        # will draw from it too), and the heap trim's bookkeeping.
        self.budget = Budget(config.memory_budget // config.workers)
        # Called once per connection when it is gone (the worker tells the master).
        self.on_closed: Callable[[Connection], object] | None = None
        # No more attributes here: see SHARD_ATTRIBUTES.
        self.take_map(vmap)

    # ------------------------------------------------------------ the vbucket map

    def take_map(self, vmap: VBucketMap) -> None:
        """Own what `vmap` gives this worker (node `config.node_id`, worker `index`)."""
        me = vmap.node_index(self.config.node_id)
        mine = (me, self.index)
        self.map = vmap
        self.owned = bytes(1 if owner == mine else 0 for owner in vmap.owners)
        incoming = vmap.incoming or ()
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

    # ------------------------------------------------------------ connections

    def new_connection(self, initial: bytes, account: Account | None = None) -> Connection:
        """A connection handed over with its Hello (and, for a client resuming a
        connection of a dead worker, that connection's account)."""
        self._next_id += 1
        c = Connection(self, initial, (self.epoch << 32) | self._next_id)
        c.token = os.urandom(RESUME_TOKEN_BYTES)
        c.account = account
        return c

    def opened(self, c: Connection) -> None:
        """A handed-over socket is adopted: answer its Hello with a Welcome."""
        self.conns[c.conn_id] = c
        self.stats.connections += 1
        self.stats.connections_total += 1
        if self.closing:
            self.goodbye(c, "server shutting down")
            return
        try:
            hello = decode_frame(c.initial) if c.initial else None
        except RemoteProtocolError as exc:
            self.fatal(c, exc.code, str(exc))
            return
        c.initial = b""
        if not isinstance(hello, Hello):
            self.fatal(c, ErrorCode.EXPECTED_HELLO, "the first frame must be a Hello")
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            self.fatal(c, ErrorCode.UNSUPPORTED_VERSION, f"protocol version {hello.protocol_version}")
            return
        c.client_name = hello.client_name
        self.book.open(c)
        resumed, notices = (None, b"") if hello.previous is None else self.take_over(c, hello.previous)
        welcome = self.welcome.for_connection(c.conn_id, c.token, resumed)
        if notices:
            welcome += notices
        c.transport.write(welcome)
        c.sent = len(welcome)
        log.debug("connection %d from %s (%s) welcomed", c.conn_id, c.peer, c.client_name)

    def take_over(self, c: Connection, prev: PreviousConnection) -> tuple[Resumed | None, bytes]:
        """c replaces the connection `prev` names: its account, if anyone has it.

        The account comes from the master when prev's worker died (attached to the
        hand-off), or from this worker's own book when prev was one of its own
        connections (still open, if the server has not noticed the loss yet: it is
        retired now). Returns Welcome.resumed and the LossNotices that follow the
        Welcome: deliveries queued to prev that the client did not receive, and
        drops it was never told of.
        """
        old_id = prev.connection_id
        proof = prev.resume_token
        account, reason = c.account, LossReason.WORKER_RESTART  # the master checked its proof
        c.account = None
        stats = self.stats
        if account is None or account.conn_id != old_id:
            account, reason = None, LossReason.CONNECTION_LOST
            if old_id >> 32 == self.epoch:
                old = self.conns.get(old_id)
                if old is not None and old is not c:
                    if same_secret(proof, old.token):
                        self.supersede(old)
                    else:  # never close a live connection for a claim that cannot prove itself
                        self.refuse_claim(c, old_id)
                        old = None
                refused_before = self.book.claims_refused
                account = self.book.claim(old_id, proof)
                if self.book.claims_refused != refused_before:
                    self.refuse_claim(c, old_id)
        if account is None:
            stats.resumes["unknown"] += 1
            # It may have had deliveries queued that never arrived: how many, nobody alive knows.
            return None, encode_frame(LossNotice(0, LossReason.UNACCOUNTED))
        if self.holding and old_id in self.grace.expected:
            c.resuming = old_id  # back once its subscriptions are in (`feed_held`)
        stats.resumes[LossReason.name(reason)] += 1
        notices = []
        lost = account.delivered - prev.received
        if account.cut:  # this worker cut it for its memory budget: a slow consumer
            reason = LossReason.SLOW_CONSUMER
        if lost > 0:
            stats.dropped[LossReason.name(reason)] += lost
            notices.append(encode_frame(LossNotice(lost, reason)))
        untold = account.dropped - prev.told_lost
        if untold > 0:  # dropped (and counted) as slow_consumer back then; the notice never arrived
            notices.append(encode_frame(LossNotice(untold, LossReason.SLOW_CONSUMER)))
        if notices:
            log.info(
                "connection %d from %s resumes %d: %d deliveries lost (%s), %d drops untold",
                c.conn_id, c.peer, old_id, max(lost, 0), LossReason.name(reason), max(untold, 0),
            )  # fmt: skip
        return Resumed(old_id, account.processed, account.refused), b"".join(notices)

    def refuse_claim(self, c: Connection, old_id: int) -> None:
        """A Hello.previous named a connection of this worker without its secret: the
        claim gets nothing (no account, no supersede); counted, logged throttled."""
        self.stats.resumes["refused"] += 1
        held = self.warnings.allow(("claim", old_id >> 32))
        if held is not None:
            more = f" ({held} more since the last warning)" if held else ""
            log.warning(
                "connection %d from %s claims connection %d without its resume token: refused%s",
                c.conn_id, c.peer, old_id, more,
            )  # fmt: skip

    def supersede(self, old: Connection) -> None:
        """A client reconnected in place of `old`, which this worker still thinks open
        (a half-open connection): close it now, so that its account is final."""
        log.info("connection %d from %s is replaced by a reconnect; closing it", old.conn_id, old.peer)
        old.transport.abort()
        self.lost(old, None)

    def eof(self, c: Connection) -> bool:
        """The peer half-closed. Returning False lets the transport close."""
        if c.state == OPEN and c.rest:
            self.fatal(c, ErrorCode.TRUNCATED_FRAME, f"end of stream inside a frame ({len(c.rest)} bytes)")
        return False

    def lost(self, c: Connection, exc: Exception | None) -> None:
        if c.state == OPEN and c.paused and c.out:
            held = self.count_messages(c.out)
            self.stats.dropped["slow_consumer"] += held
            c.msgs_out -= held  # queued, never sent: a drop, told on resume (broky.server.accounts)
            c.dropped_total += held
        c.state = CLOSED
        self.book.close(c)
        if c.held:
            c.held = False
            self.grace.held.remove(c)
        c.out.clear()
        self.detach(c)
        if c.linger is not None:
            c.linger.cancel()
            c.linger = None
        self.budget.pending -= c.charged
        c.charged = 0
        if self.conns.pop(c.conn_id, None) is not None:
            self.stats.connections -= 1
            if self.on_closed is not None:
                self.on_closed(c)
        if exc is not None:
            log.debug("connection %d lost: %s", c.conn_id, exc)

    def detach(self, c: Connection) -> None:
        """Remove every subscription of a connection."""
        if not c.subs:
            return
        for sub in c.subs.values():
            self.matcher.remove(sub.pattern, sub)
        self.stats.subscriptions -= len(c.subs)
        self.stats.subscription_bytes -= c.sub_bytes
        self.budget.freed_sub_bytes += c.sub_bytes
        c.sub_bytes = 0
        c.subs.clear()
        self.book.set_subscriptions(c, 0)
        self.forget_routes()

    # ------------------------------------------------------------ the fast path

    def feed(self, c: Connection, data: bytes) -> None:
        """Handle one read of connection c (see the theory of operation)."""
        if c.state != OPEN:
            if c.said_goodbye:
                self.discard_after_goodbye(c, data)
            return  # lingering close: input is discarded
        if self.holding:
            self.feed_held(c, data)
            return
        if c.rest:
            data = c.rest + data
            c.rest = b""
        t0 = _time_ns()
        n = len(data)
        stats = self.stats
        stats.bytes_received += n
        max_frame = self.config.max_frame_bytes
        routes = self.routes
        uid_shapes = self.uid_shapes
        plain_shapes = self.plain_shapes
        startswith = data.startswith
        buf: bytearray | None = None
        run: tuple[Connection, ...] | None = None  # targets of the current run of messages
        run_start = run_end = run_n = 0
        published = delivered = unmatched = 0
        # The first frame of the current run, for a cheap "same route again" test:
        # size prefix and header, then the routing bytes that precede and follow
        # the uid (the stamps and the uid differ from message to message).
        same_head: bytes | None = None
        same_route = b""
        same_tail: bytes | None = None
        same_len = 0
        pos = 0
        scan = self.scan
        runs: list[Any] = []
        try:
            while n - pos >= 4:
                if scan is not None and n - pos >= CANONICAL_HEAD_SIZE:
                    # The compiled twin takes the canonical Messages with a cached route
                    # (broky.server.fastpath); what it stops at is handled below.
                    pos, buf, handled, unrouted = scan(data, pos, buf, t0, routes, max_frame, runs)
                    if handled:
                        published += handled
                        unmatched += unrouted
                        if runs:
                            if run is not None:
                                delivered += self.emit(buf, run, run_start, run_end, run_n)
                                run = same_head = None
                            for targets, start, end, count in runs:
                                delivered += self.emit(buf, targets, start, end, count)
                            runs.clear()
                        if n - pos < 4:
                            break
                if (
                    same_head is not None
                    and pos == run_end
                    and startswith(same_head, pos)
                    and startswith(same_route, pos + 72)
                    and (same_tail is None or startswith(same_tail, pos + 100))
                ):
                    end = pos + same_len
                    if end > n:
                        break
                    pack_ts_into(buf, pos + TS_BROKER_OFFSET, t0)  # type: ignore[arg-type]
                    run_end = end
                    run_n += 1
                    published += 1
                    pos = end
                    continue
                # Canonical Message (layout in broky.protocol.message): one read gives
                # the header and every offset; the frame's shape (size, offsets,
                # key_partition length) was checked once, when first met (`shape`):
                # its vectors lie inside the frame, in order. What varies within a
                # shape, the key's and the payload's lengths, is checked here.
                shape: Shape | None = None
                if n - pos >= CANONICAL_HEAD_SIZE:
                    size, head, key_off, pay_off, len80, len100 = _canonical_head(data, pos)
                    if head == HEADER_UID:
                        try:
                            shape = uid_shapes[size, key_off, pay_off, len100]
                        except KeyError:
                            shape = self.shape(True, size, key_off, pay_off, len100)
                    elif head == HEADER_NO_UID:
                        try:
                            shape = plain_shapes[size, key_off, pay_off, len80]
                        except KeyError:
                            shape = self.shape(False, size, key_off, pay_off, len80)
                if shape is not None:
                    lengths, k_at, p_at, end_at, route_at = shape
                    end = pos + end_at
                    if end > n:
                        break
                    key_len, pay_len = lengths(data, pos + k_at)
                    key_stop = pos + k_at + 4 + key_len
                    # Subscribers get these bytes: the payload must be in bounds, even
                    # when the route comes from the cache. A key running into the
                    # payload's vector (valid: vectors may share bytes) or out of the
                    # frame goes to the generic read, which accepts or refuses it.
                    if key_stop > pos + p_at or p_at + 4 + pay_len > end_at:
                        shape = None
                    else:
                        # The routing bytes: the key_partition and key vectors. (Not the
                        # payload's length: payloads of many sizes would multiply the routes.)
                        rkey: object = data[pos + route_at : key_stop]
                        ts_at: int | None = pos + TS_BROKER_OFFSET
                if shape is None:
                    size = _u32(data, pos)[0]
                    if size > max_frame or size < MIN_FRAME_SIZE:
                        check_size(size, max_frame)
                    end = pos + 4 + size
                    if end > n:
                        break
                    if size == PING_SIZE_PREFIX and (ping := ping_id(data, pos, end)) is not None:
                        # The SDK's Pings (it confirms its publishes with them every few ms):
                        # answered without decoding, behind the deliveries before them.
                        if run is not None:
                            delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                            run = same_head = None
                        self.reply(c, encode_pong(Pong(ping)))
                        pos = end
                        continue
                    try:
                        kp, key, ts_at = route_message(data, pos, end)
                    except MalformedFrameError:
                        # Not a Message: a control frame, or really malformed (then re-raise).
                        if body_type(data, pos, end) == BODY_MESSAGE:
                            raise
                        if run is not None:  # earlier deliveries go out before any reply
                            delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                            run = same_head = None
                        self.control(c, data, pos, end)
                        pos = end
                        if c.state != OPEN:
                            break
                        continue
                    rkey = (kp, key)
                published += 1
                try:
                    targets = routes[rkey]
                except KeyError:
                    kp, key, ts_at = route_message(data, pos, end)  # validates the whole frame once
                    targets = self.route(rkey, kp, key)
                if not targets:
                    if targets is None:
                        if run is not None:
                            delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                            run = same_head = None
                        self.not_mine(c, data, pos, end)
                    else:
                        unmatched += 1
                    pos = end
                    continue
                if ts_at is None:
                    # Not the canonical layout: its ts_broker may share bytes with another
                    # field, so it is not stamped in place but forwarded re-encoded (rare:
                    # Broky's SDK writes the canonical layout). The run so far goes first.
                    if run is not None:
                        delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                        run = same_head = None
                    copy = bytearray(canonical_copy(data, pos, end, t0, max_frame))
                    delivered += self.emit(copy, targets, 0, len(copy), 1)
                    pos = end
                    continue
                if buf is None:
                    buf = bytearray(data)
                pack_ts_into(buf, ts_at, t0)
                if targets is run and pos == run_end:
                    run_end = end
                    run_n += 1
                    same_head = None  # this run's messages differ: stop comparing them
                else:
                    if run is not None:
                        delivered += self.emit(buf, run, run_start, run_end, run_n)
                    run = targets
                    run_start = pos
                    run_end = end
                    run_n = 1
                    if shape is not None:  # canonical: the key ends before the payload's length
                        same_head = data[pos : pos + 56]
                        same_len = end - pos
                        if route_at == 80:
                            same_route = data[pos + 72 : pos + p_at + 4]
                            same_tail = None
                        else:
                            same_route = data[pos + 72 : pos + 80]
                            same_tail = data[pos + 100 : pos + p_at + 4]
                    else:
                        same_head = None
                pos = end
        except RemoteProtocolError as exc:
            if run is not None:
                delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                run = None
            self.fatal(c, exc.code, str(exc))
        if run is not None:
            delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
        if pos < n and c.state == OPEN:
            c.rest = data[pos:]
            c.partial_since = _monotonic()
        stats.messages_published += published
        stats.messages_delivered += delivered
        c.msgs_in += published
        if unmatched:
            stats.dropped["no_subscribers"] += unmatched
        if published:  # before anything is written: see broky.server.accounts
            self.book.commit_read(c, self._touched)
        if self._touched:
            self.flush()
            if delivered:  # one observation per delivered message (broky.server.histogram)
                dt = _time_ns() - t0
                stats.latency_ns_sum += dt * delivered
                stats.latency_us[min(dt >> 10, 1 << 30).bit_length()] += delivered

    # ------------------------------------------------------------ restart grace

    def start_grace(self, expected: set[int], seconds: float) -> None:
        """This worker replaces one that died; `expected` are the ids of the dead
        worker's connections that had subscriptions. Until each of them has
        reconnected naming it (Hello.previous) and restored its subscriptions, or
        `seconds` pass, Message frames are held, not routed: a publish must not be
        dropped as no_subscribers merely because its subscribers are not back yet.
        Holding a connection pauses its reads, so memory stays bounded (TCP holds
        the rest) and its frames keep their order."""
        if not expected or seconds <= 0:
            return
        grace = self.grace
        self.holding = True
        grace.expected = set(expected)
        grace.started = _monotonic()
        grace.until = grace.started + seconds
        self.stats.restart_subscribers_expected = len(expected)
        grace.timer = self.loop.call_later(seconds, self.end_grace, f"{seconds:g} s passed")
        log.info(
            "worker %d replaces a dead worker: holding publishes until its %d subscribing "
            "connections are back (at most %g s)", self.index, len(expected), seconds,
        )  # fmt: skip

    def start_node_grace(self, seconds: float) -> None:
        """The whole server (or node) restarted under its clients: a client named a
        connection of an earlier server process (broky.server.master `_note_restart`).
        Nobody knows which of that process's connections had subscriptions, so
        Message frames are held for `seconds`, whoever comes back meanwhile; then
        what was held is routed, in order. (A worker restart grace under way lasts
        at least as long.)"""
        if seconds <= 0 or self.closing:
            return
        now = _monotonic()
        grace = self.grace
        grace.node_until = max(grace.node_until, now + seconds)
        self.stats.node_restart_graces += 1
        if not self.holding:
            self.holding = True
            grace.started = now
            grace.until = now
        if grace.node_until > grace.until:
            grace.until = grace.node_until
            if grace.timer is not None:
                grace.timer.cancel()
            grace.timer = self.loop.call_later(
                grace.until - now, self.end_grace, "the server restart grace passed"
            )
        log.info(
            "worker %d: this server restarted under its clients; holding publishes %g s for the "
            "subscribers of the previous process to subscribe again", self.index, seconds,
        )  # fmt: skip

    def feed_held(self, c: Connection, data: bytes) -> None:
        """`feed` during the restart grace: control frames are handled as usual; the
        first Message frame stops this connection's input until the grace ends. A
        resuming subscriber is back at its first frame other than (Un)Subscribe."""
        if c.held:  # a read that raced with pause_reading: it waits with the rest
            c.rest += data
            return
        if c.rest:
            data = c.rest + data
            c.rest = b""
        pos, n = 0, len(data)
        max_frame = self.config.max_frame_bytes
        try:
            while n - pos >= 4:
                size = _u32(data, pos)[0]
                if size > max_frame or size < MIN_FRAME_SIZE:
                    check_size(size, max_frame)
                end = pos + 4 + size
                if end > n:
                    break
                kind = body_type(data, pos, end)
                if c.resuming and kind not in _SUBSCRIPTION_FRAMES:
                    self.came_back(c)
                    if not self.holding:
                        break  # that was the last one: the normal path takes the rest
                if kind == BODY_MESSAGE:
                    c.held = True
                    self.grace.held.append(c)
                    c.transport.pause_reading()
                    break
                self.control(c, data, pos, end)
                pos = end
                if c.state != OPEN:
                    break
        except RemoteProtocolError as exc:
            self.fatal(c, exc.code, str(exc))
        if pos < n and c.state == OPEN:
            c.rest = data[pos:]
            c.partial_since = _monotonic()
        if self._touched:
            self.flush()
        if not self.holding and c.rest and c.state == OPEN:
            self.feed(c, b"")

    def came_back(self, c: Connection) -> None:
        """A subscriber of the dead worker has restored its subscriptions."""
        grace = self.grace
        grace.expected.discard(c.resuming)
        c.resuming = 0
        if not grace.expected and _monotonic() >= grace.node_until:
            self.end_grace("every subscribing connection is back")

    def end_grace(self, why: str) -> None:
        """Route what was held, in order per connection; from now on nothing is held."""
        if not self.holding:
            return
        self.holding = False
        grace = self.grace
        if grace.timer is not None:
            grace.timer.cancel()
            grace.timer = None
        held, grace.held = grace.held, []
        missing = len(grace.expected)
        grace.expected.clear()
        stats = self.stats
        stats.restart_grace_seconds = _monotonic() - grace.started
        stats.restart_subscribers_missing = missing
        stats.restart_connections_held = len(held)
        (log.warning if missing else log.info)(
            "worker %d: restart grace over after %.2f s (%s); %d of %d subscribing connections back, "
            "%d publishing connections held", self.index, stats.restart_grace_seconds, why,
            stats.restart_subscribers_expected - missing, stats.restart_subscribers_expected, len(held),
        )  # fmt: skip
        for c in held:
            c.held = False
            if c.state != OPEN:
                continue
            if not c.reads_held:
                c.transport.resume_reading()
            self.feed(c, b"")

    # ------------------------------------------------------------ queueing

    def emit(self, buf: bytearray, targets: tuple[Connection, ...], start: int, end: int, count: int) -> int:
        """Queue a run of `count` consecutive stamped messages buf[start:end] to each target."""
        # A run that is the whole read (the usual case) is queued without a copy: buf is
        # not written to again once its last message is stamped.
        chunk = buf if start == 0 and end == len(buf) else buf[start:end]
        size = end - start
        touched = self._touched
        delivered = 0
        for t in targets:
            if t.base + t.unflushed + size > t.limit:
                c_base = t.transport.get_write_buffer_size()  # refresh: it only shrinks between flushes
                t.base = c_base
                if c_base + t.unflushed + size > t.limit:
                    delivered += self.squeeze(t, buf, start, end, count)
                    continue
            t.unflushed += size
            t.out.append(chunk)
            if not t.touched:
                t.touched = True
                touched.append(t)
            t.msgs_out += count
            delivered += count
        return delivered

    def shape(self, uid: bool, size: int, key_off: int, pay_off: int, kp_len: int) -> Shape | None:
        """Slow path of the shape cache: check once what every canonical Message of
        this size, these offsets and this key_partition length has in common.

        None (cached too) sends such frames to the generic read: a size out of
        bounds (which then raises), or vectors not in the order key_partition,
        key, payload with the key right after the key_partition.
        """
        route_at = 100 if uid else 80  # the key_partition vector (its length) in the frame
        k_at = 72 + key_off  # the key vector
        p_at = 76 + pay_off  # the payload vector
        end_at = 4 + size
        shape: Shape | None = None
        if (
            MIN_FRAME_SIZE <= size <= self.config.max_frame_bytes
            and k_at == route_at + 4 + kp_len + (-kp_len & 3)
            and k_at + 4 <= p_at
            and p_at + 4 <= end_at
        ):
            lengths = struct.Struct(f"<I{p_at - k_at - 4}xI").unpack_from
            shape = (lengths, k_at, p_at, end_at, route_at)
        shapes = self.uid_shapes if uid else self.plain_shapes
        if len(shapes) >= SHAPE_CACHE_SIZE:
            shapes.clear()
        shapes[size, key_off, pay_off, kp_len] = shape
        return shape

    def route(self, rkey: object, kp: bytes, key: bytes) -> tuple[Connection, ...] | None:
        """Slow path of the route cache: None if not our vbucket, else the target connections."""
        targets: tuple[Connection, ...] | None
        if not self.accepts[vbucket_of(kp)]:
            targets = None
        else:
            everyone, scoped = self.matcher.match(key)
            if scoped is not None:
                more = scoped.get(kp)
                if more:
                    everyone = everyone + more
            if len(kp) + len(key) > ROUTE_CACHE_MAX_KEY:
                return everyone  # neither cached nor interned: that would keep the big key alive
            # Equal target sets share one tuple, so runs of messages are found by identity.
            targets = self._interned.setdefault(everyone, everyone)
        if len(kp) + len(key) > ROUTE_CACHE_MAX_KEY:
            return None
        if len(self.routes) >= ROUTE_CACHE_SIZE:
            self.routes.clear()
            self._interned.clear()
        self.routes[rkey] = targets
        return targets

    def forget_routes(self) -> None:
        """Subscriptions changed: every cached route may be wrong."""
        self.routes.clear()
        self._interned.clear()

    def flush(self) -> None:
        """Write once to every connection touched during this read; charge what each
        has pending to the worker's budget, and enforce it (see "Memory budget")."""
        sent = 0
        for t in self._touched:
            t.touched = False
            if t.paused or t.state != OPEN:
                if t.state != CLOSED:  # held for a paused one; a lingering close's buffer
                    self.charge(t, t.base + t.unflushed)
                continue
            sent += self.write_out(t)
        self._touched.clear()
        self.stats.bytes_sent += sent
        if self.budget.peaked:
            self.new_peak()

    def write_out(self, t: Connection) -> int:
        """Write what is queued for t (flush, and a Pause: what came before it goes out);
        the bytes written, for the caller to count in stats.bytes_sent."""
        out = t.out
        chunk = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        transport = t.transport
        transport.write(chunk)
        size = len(chunk)
        t.sent += size
        t.unflushed = 0
        t.base = base = transport.get_write_buffer_size()
        if base or t.charged:  # it has bytes pending, or had: the budget's total changes
            self.charge(t, base)
        if t.reply_out or t.reads_held:  # rare: this read queued replies, or reads wait for them
            self.check_replies(t, base)
        if t.dropped and base <= t.limit >> 2:
            self.notify_loss(t)
        return size

    # ------------------------------------------------------------ memory budget

    def charge(self, c: Connection, pending: int) -> None:
        """c has `pending` bytes pending now: the budget's running total follows."""
        budget = self.budget
        budget.pending += pending - c.charged
        c.charged = pending
        if budget.pending > budget.peak:
            budget.peaked = True  # `flush` calls new_peak once the read is written

    def new_peak(self) -> None:
        """The pending bytes reached a new peak: over the room, enforce the budget."""
        budget = self.budget
        budget.peaked = False
        if budget.pending > budget.room:
            budget.peak = budget.room  # at most the room: every read past it checks again
            self.enforce_budget()
        else:
            budget.peak = budget.pending

    def refresh_pending(self) -> int:
        """Make every connection's charge, and their total, exact; return the total."""
        total = 0
        for c in self.conns.values():
            c.base = buffered = c.transport.get_write_buffer_size()
            c.charged = pending = buffered + c.unflushed
            total += pending
        self.budget.pending = total
        return total

    def enforce_budget(self) -> None:
        """Over the budget's room (maybe: the total may be stale): made exact, and if
        still over, the connections with the most pending bytes are cut, worst first,
        until the total is under the low mark."""
        budget = self.budget
        total = self.refresh_pending()
        if total <= budget.room:
            return
        low = budget.low
        worst = sorted(self.conns.values(), key=_charged, reverse=True)
        cut = freed = 0
        largest = worst[0]
        largest_bytes = largest.charged
        for c in worst:
            if total <= low or not c.charged:
                break
            total -= c.charged
            freed += c.charged
            cut += 1
            self.cut(c)
        held = self.warnings.allow("budget cuts")
        if held is not None:
            more = f"; {held} more cut since the last line" if held else ""
            log.warning(
                "worker %d over its memory budget (%d bytes for pending bytes): cut %d connections "
                "holding %d bytes, the most pending first (connection %d from %s: %d bytes); "
                "%d cut so far%s",
                self.index, budget.room, cut, freed, largest.conn_id, largest.peer, largest_bytes,
                self.stats.budget_cuts, more,
            )  # fmt: skip

    def cut(self, c: Connection) -> None:
        """Close c at once, its buffers freed, to keep the worker within its budget. Its
        account says so: a client reconnecting in its place is told exactly what it
        lost, as SLOW_CONSUMER (`take_over`)."""
        stats = self.stats
        stats.budget_cuts += 1
        stats.budget_cut_bytes += c.charged
        self.book.mark_cut(c)
        c.transport.abort()
        self.lost(c, None)

    def squeeze(self, c: Connection, buf: bytearray, start: int, end: int, count: int) -> int:
        """c is at its pending bound: queue the leading messages of the run that fit,
        drop and count the others; return how many were queued."""
        if c.state != OPEN:
            return 0
        room = c.limit - c.base - c.unflushed
        cut = start
        fit = 0
        while cut < end:
            size = 4 + _u32(buf, cut)[0]
            if size > room:
                break
            room -= size
            cut += size
            fit += 1
        if fit:
            c.unflushed += cut - start
            c.out.append(buf[start:cut])
            c.msgs_out += fit
        if not c.touched:  # also when nothing fit: its account changed (dropped_total)
            c.touched = True
            self._touched.append(c)
        lost = count - fit
        c.dropped += lost
        c.dropped_total += lost
        self.stats.dropped["slow_consumer"] += lost
        if not c.over_since:
            c.over_since = _monotonic()
        return fit

    def notify_loss(self, c: Connection) -> None:
        """Tell c how many deliveries it lost since the last notice; stop its clock."""
        frame = encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER))
        c.dropped = 0
        c.over_since = 0.0
        c.transport.write(frame)
        c.sent += len(frame)
        self.stats.bytes_sent += len(frame)

    def drained(self, c: Connection) -> None:
        """c's write buffer fell to its low-water mark (a quarter of the bound)."""
        if c.state != OPEN:
            return
        if c.reads_held:
            self.check_replies(c, c.transport.get_write_buffer_size())
        if c.dropped and not c.paused:
            c.base = c.transport.get_write_buffer_size()
            self.notify_loss(c)

    def check_replies(self, c: Connection, buffered: int) -> None:
        """Rare path: mark the replies just written (c.reply_out) and hold or release
        c's reads by its unread replies; `buffered` is its write buffer's size now."""
        if c.reply_out:
            c.reply_sent += c.reply_out
            c.reply_out = 0
            marks = c.reply_marks
            if marks is None:
                marks = c.reply_marks = deque()
            if len(marks) < MAX_REPLY_MARKS:
                marks.append((c.sent, c.reply_sent))
            else:  # merged with the newest: those replies count until this write left
                marks[-1] = (c.sent, c.reply_sent)
        unread = self.unread_replies(c, buffered)
        if unread > self.max_reply_bytes:
            self.hold_reads(c)
        elif c.reads_held and unread <= self.max_reply_bytes >> 2:
            self.release_reads(c)

    def unread_replies(self, c: Connection, buffered: int) -> int:
        """Reply bytes written to c that may still be in its write buffer (an upper bound)."""
        marks = c.reply_marks
        if not marks:
            return c.reply_sent - c.reply_left
        left = c.sent - buffered  # bytes that left the buffer (it is a FIFO)
        while marks and marks[0][0] <= left:
            c.reply_left = marks.popleft()[1]
        if not marks:
            return c.reply_sent - c.reply_left
        # The writes up to the first mark left in part: their replies still buffered are
        # at most what of them is still buffered. Later writes' replies all count.
        end, upto = marks[0]
        return min(upto - c.reply_left, end - left) + c.reply_sent - upto

    def hold_reads(self, c: Connection) -> None:
        """c's unread replies are over the reply bound: read nothing more from it until
        they drain (`check_replies`), so its own sends back up; the slow-consumer clock runs."""
        if c.reads_held or c.state != OPEN:
            return
        c.reads_held = True
        c.transport.pause_reading()
        self.stats.reads_held += 1
        if not c.over_since:
            c.over_since = _monotonic()
        log.debug("connection %d from %s does not read its replies; reading paused", c.conn_id, c.peer)

    def release_reads(self, c: Connection) -> None:
        c.reads_held = False
        if not c.held:  # held by the restart grace: `end_grace` resumes it
            c.transport.resume_reading()
        if not c.dropped:
            c.over_since = 0.0

    def reply(self, c: Connection, frame: bytes) -> None:
        """Queue a control frame to c behind what this read already queued for it.

        Replies are never dropped; they count in the pending bytes, and a connection
        with more than --max-reply-bytes of them unread is read no more until they drain.
        """
        if c.paused:
            transport = c.transport
            transport.write(frame)  # not held: only deliveries wait for Resume
            c.sent += len(frame)
            c.reply_out += len(frame)
            self.stats.bytes_sent += len(frame)
            self.check_replies(c, transport.get_write_buffer_size())
            return
        c.out.append(frame)
        c.unflushed += len(frame)
        c.reply_out += len(frame)
        if not c.touched:
            c.touched = True
            self._touched.append(c)

    def not_mine(self, c: Connection, data: bytes, pos: int, end: int) -> None:
        """A publish for a vbucket this worker does not own: refused, with the frame
        itself in the Error so that the client can send it to the owner."""
        self.stats.dropped["not_my_vbucket"] += 1
        c.refused += 1  # processed (Welcome.resumed.processed counts it), and refused
        kp = route_message(data, pos, end)[0]
        self.error(
            c,
            ErrorCode.NOT_MY_VBUCKET,
            f"key_partition {kp!r} is owned by another worker",
            refused=data[pos:end],
        )

    def error(
        self, c: Connection, code: ErrorCode, message: str, sid: int = 0, refused: bytes | None = None
    ) -> None:
        """A non-fatal Error frame, and a warning (at most one per connection and code per 10 s)."""
        self.stats.count_error(code)
        held = self.warnings.allow((c.conn_id, code))
        if held is not None:
            more = f" ({held} more since the last warning)" if held else ""
            log.warning("connection %d from %s: %s: %s%s", c.conn_id, c.peer, code.name, message, more)
        self.reply(
            c, error_frame(code, message, fatal=False, map_version=self.map.version, sid=sid, refused=refused)
        )

    # ------------------------------------------------------------ control frames

    def control(self, c: Connection, data: bytes, pos: int, end: int) -> None:
        frame = decode_frame(data, pos, end)
        kind = type(frame)
        if kind is Subscribe:
            self.subscribe(c, frame)  # type: ignore[arg-type]
        elif kind is Unsubscribe:
            self.unsubscribe(c, frame.sid)  # type: ignore[union-attr]
        elif kind is Ping:
            self.reply(c, encode_frame(Pong(frame.id)))  # type: ignore[union-attr]
        elif kind is Pause:
            if c.out and not c.paused:  # queued before the Pause (a Pong among them): out now
                self.stats.bytes_sent += self.write_out(c)
            c.paused = True
        elif kind is Resume:
            self.resume(c)
        elif kind is MapApplied:
            if frame.version > c.map_applied:  # type: ignore[union-attr]
                c.map_applied = frame.version  # type: ignore[union-attr]
        else:
            name = kind.__name__
            self.fatal(c, ErrorCode.UNEXPECTED_FRAME, f"a client may not send {name} here")

    def subscribe(self, c: Connection, sub: Subscribe) -> None:
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
        c.subs[sub.sid] = s
        c.sub_bytes += size
        self.matcher.add(sub.pattern, s)
        self.stats.subscriptions += 1
        self.book.set_subscriptions(c, len(c.subs))
        self.stats.subscription_bytes += size
        self.forget_routes()

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
        self.stats.subscriptions -= 1
        self.book.set_subscriptions(c, len(c.subs))
        self.stats.subscription_bytes -= s.size
        self.budget.freed_sub_bytes += s.size
        c.sub_bytes -= s.size
        self.forget_routes()

    def resume(self, c: Connection) -> None:
        if not c.paused:
            return
        c.paused = False
        if c.out and not c.touched:
            c.touched = True
            self._touched.append(c)
        if c.dropped:
            # After the held deliveries, which this read's flush writes first.
            c.out.append(encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER)))
            c.dropped = 0
            c.over_since = 0.0
            if not c.touched:
                c.touched = True
                self._touched.append(c)

    # ------------------------------------------------------------ closing

    def fatal(self, c: Connection, code: ErrorCode, message: str) -> None:
        """Send a fatal Error, then close c (lingering); one log line."""
        if c.state != OPEN:
            return
        log.warning("connection %d from %s: %s: %s; closing", c.conn_id, c.peer, code.name, message)
        self.stats.count_error(code)
        self.final_frame(c, error_frame(code, message, fatal=True, map_version=self.map.version))

    def goodbye(self, c: Connection, reason: str) -> None:
        """Queued deliveries, then Goodbye, then a lingering close. Deliveries held for a
        paused connection are dropped, and so are the messages it publishes after the
        Goodbye (`discard_after_goodbye`): both counted as `shutdown`."""
        if c.state != OPEN:
            return
        notice = b""
        if c.paused and c.out:
            held = self.count_messages(c.out)
            self.stats.dropped["shutdown"] += held
            c.out.clear()
            c.msgs_out -= held  # never sent: a drop, and the client is told so
            c.dropped_total += held
            self.book.commit((c,))
            notice = encode_frame(LossNotice(held, LossReason.SHUTDOWN))
        c.said_goodbye = True
        self.final_frame(c, notice + encode_frame(Goodbye(reason, c.msgs_in)), keep_rest=True)

    def count_messages(self, chunks: list[bytes | bytearray]) -> int:
        """Messages among the frames queued in chunks (replies are not counted)."""
        n = 0
        for chunk in chunks:
            pos, end = 0, len(chunk)
            while end - pos >= 4:
                stop = pos + 4 + _u32(chunk, pos)[0]
                n += _is_message(chunk, pos, stop)
                pos = stop
        return n

    def discard_after_goodbye(self, c: Connection, data: bytes) -> None:
        """Count the messages in input read after the Goodbye (a walk over the size prefixes)."""
        if c.rest:
            data = c.rest + data
        pos, n, count = 0, len(data), 0
        max_frame = self.config.max_frame_bytes
        while n - pos >= 4:
            size = _u32(data, pos)[0]
            if size > max_frame or size < MIN_FRAME_SIZE:
                c.said_goodbye = False  # not frames: nothing further can be counted
                pos = n
                break
            end = pos + 4 + size
            if end > n:
                break
            count += _is_message(data, pos, end)
            pos = end
        c.rest = data[pos:] if pos < n else b""
        if count:
            self.stats.dropped["shutdown"] += count

    def final_frame(self, c: Connection, frame: bytes, keep_rest: bool = False) -> None:
        self.detach(c)
        c.state = CLOSING
        if not keep_rest:
            c.rest = b""
        if c.reads_held:  # a lingering close reads until the peer's EOF
            c.reads_held = False
            c.transport.resume_reading()
        chunk = b"".join([*c.out, frame])
        c.out.clear()
        c.unflushed = 0
        transport = c.transport
        transport.write(chunk)
        self.stats.bytes_sent += len(chunk)
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
        c.linger = self.loop.call_later(self.config.frame_timeout, self._reset, c)

    def _reset(self, c: Connection) -> None:
        c.linger = None
        if c.state == CLOSING:
            self.stats.bytes_discarded += c.transport.get_write_buffer_size()
            log.info("connection %d did not close within %.0f s; reset", c.conn_id, self.config.frame_timeout)
            c.transport.abort()

    def slow_disconnect(self, c: Connection) -> None:
        self.stats.slow_consumer_disconnects += 1
        if c.dropped:
            c.out.append(encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER)))
            c.dropped = 0
        deadline = self.config.slow_consumer_deadline
        if c.reads_held:
            why = f"over {self.max_reply_bytes} bytes of unread replies for more than {deadline:g} s"
        else:
            why = f"over {c.limit} pending bytes for more than {deadline:g} s"
        self.fatal(c, ErrorCode.SLOW_CONSUMER, why)

    def tick(self) -> None:
        """Periodic: slow consumer and truncated frame deadlines, held reads, the memory
        budget made exact (and enforced), heap trim."""
        now = _monotonic()
        budget = self.budget
        if self.refresh_pending() > budget.peak:
            self.new_peak()
        deadline = self.config.slow_consumer_deadline
        frame_timeout = self.config.frame_timeout
        for c in list(self.conns.values()):
            if c.state != OPEN:
                continue
            if c.reads_held:  # its replies may have drained below the high-water mark
                self.check_replies(c, c.transport.get_write_buffer_size())
            if (
                c.dropped
                and not c.paused
                and not c.write_paused
                and c.transport.get_write_buffer_size() <= c.limit >> 2
            ):  # drained without ever reaching the high-water mark (no resume_writing)
                c.base = c.transport.get_write_buffer_size()
                self.notify_loss(c)
            elif c.over_since and now - c.over_since > deadline:
                self.slow_disconnect(c)
            elif c.rest and not c.held and now - c.partial_since > frame_timeout:
                self.fatal(c, ErrorCode.TRUNCATED_FRAME, f"silence inside a frame for {frame_timeout:g} s")
        if (
            budget.freed_sub_bytes >= TRIM_AFTER_BYTES
            or (budget.peak >= min(TRIM_AFTER_PEAK, budget.share >> 2) and budget.pending < budget.peak >> 2)
        ) and now - budget.trimmed_at >= TRIM_INTERVAL:
            self.trim_heap(now)

    def trim_heap(self, now: float) -> None:
        """Give the heap that freed subscriptions or pending bytes left behind back to the OS."""
        budget = self.budget
        freed, peak = budget.freed_sub_bytes, budget.peak
        budget.freed_sub_bytes = 0
        budget.peak = budget.pending
        budget.trimmed_at = now
        before = _rss_bytes()
        self.matcher.compact()
        if memory.trim():
            self.stats.memory_trims += 1
            after = _rss_bytes()
            log.debug(
                "heap trimmed (%d subscription bytes freed, pending bytes %d after a peak of %d): "
                "RSS %d -> %d bytes (%.1f ms)",
                freed, budget.pending, peak, before, after, (_monotonic() - now) * 1000,
            )  # fmt: skip

    def shutdown(self) -> None:
        """Goodbye to every connection (then half-close it)."""
        self.closing = True
        self.end_grace("shutdown")  # what was held is routed first, then everyone gets the Goodbye
        for c in list(self.conns.values()):
            self.goodbye(c, "server shutting down")

    def flushed(self) -> bool:
        """True when every connection is closed or has handed its last byte to the kernel."""
        return all(c.state == CLOSED or c.transport.get_write_buffer_size() == 0 for c in self.conns.values())

    def abort_all(self) -> None:
        for c in list(self.conns.values()):
            if c.state != CLOSED:
                self.stats.bytes_discarded += c.transport.get_write_buffer_size()
                c.transport.abort()

    # ------------------------------------------------------------ monitoring

    def snapshot(self) -> dict[str, Any]:
        """Every counter, for the master's /stats and the metrics exporter."""
        s = self.stats
        data = dict(vars(s))
        data["dropped"] = dict(s.dropped)
        data["resumes"] = dict(s.resumes)
        data["errors"] = dict(s.errors)
        data["subscriptions_refused"] = dict(s.subscriptions_refused)
        data["latency_us"] = list(s.latency_us)
        data.update(
            worker=self.index,
            pid=os.getpid(),
            topics=len(self.matcher.patterns),
            match_cache_entries=self.matcher.cache_len,
            match_cache_hits=self.matcher.cache_hits,
            match_cache_misses=self.matcher.cache_misses,
            matcher_empty=self.matcher.is_empty(),
            rss_bytes=_rss_bytes(),
            map_version=self.map.version,
            accounts_unavailable=self.book.unavailable,
            accounts_closed_kept=len(self.book.closed),
            pending_bytes=self.budget.pending,
            memory_budget=self.budget.share,
            budget=self.budget.snapshot(),
        )
        return data
