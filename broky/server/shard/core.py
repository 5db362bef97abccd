"""One worker's shard: the write path in one class, the core, and its parts.

The Shard is a core and parts. The core is this module's `Shard`: the write
path, read top to bottom (`feed`, then `emit`, `shape`, `route`, `flush`,
`write_out` and `squeeze`), what it does at its edges (replies and errors:
`reply`, `error`, `fatal`; the memory budget's charge: `charge`, `new_peak`;
the notice of a slow consumer's drops: `reopen`, `notify_loss`), and the state
it reads: the vbucket map (`take_map`), the subscription table (`subscribe`,
`unsubscribe`, `detach`, reached through `control`), the connections from
their arrival (`opened`) to their end (`lost`). Every other concern is a part,
built with the core, that knows it as `ShardCore` (broky.server.shard.part)
and never another part:

  with state of their own: objects, attributes of the core
    arrivals            Hello and Welcome; a reconnecting client's claim
    moves               sequences handed over in a planned move, and awaited
    grace               the restart grace: publishes held for a dead worker's subscribers
    positions           starts from positions and bounded reads of the replay buffer
    groups              consumer groups, their deliveries, acks and deadlines
  without: modules of functions the core calls with itself
    control             a Subscribe's rules: protocol versions, permissions, limits
    backpressure        the reply bound, slow consumers' deadlines
    closing             the final frame and the lingering close, Goodbye
    budget_enforcement  the memory budget kept: cuts, the heap trimmed
    monitoring          the counters and sizes for /stats

(each broky.server.shard.<name>), over the state they share: a client's
Connection (connection), the vbuckets' sequences (sequences), the retained
messages (replay), the memory budget's share (budget), the counters (stats),
the compiled twin of the read path (fastpath, _feedscan.c), the heap (heap).

The core calls a part only off the per-message path: for a Subscribe, a Read,
an Ack, a route cache miss of a vbucket whose sequence is on its way here, a
map change, a tick, a connection's arrival or end (and for a run of messages
whose route has groups, which never took the fast path: broky.server.shard.groups).
What one part's work means for another the core says: a connection that ends
leaves its groups, its held input and its bounded read; a claim that resumes
a dead worker's subscriber is told to the restart grace. The per-message path
calls the core's own methods only, and reads at most SHARD_ATTRIBUTES
instance attributes.

Theory of operation
-------------------
`Shard.feed(conn, data)` handles one read of one connection, top to bottom:

1. Parse every whole frame of the read (uint32 size prefix, checked against
   max_frame_bytes before anything is buffered). A Message frame in the
   canonical layout (broky.protocol.layout) is recognised by its fixed header,
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
   is not refused (schema/README.md 6.3); but until its sequence is here
   (broky.server.shard.moves) `route` answers AWAITING, never cached, and the
   publish is held with the rest of its connection's input. On a miss,
   `route` checks ownership (one index into a 1024-byte table, `accepts`)
   and asks `Matcher.match` for the delivery plan: the
   distinct connections with an all-partition subscription, plus (only when
   scoped subscriptions match) those subscribed to this key_partition. A
   connection appears at most once, so a message travels once per connection
   however many of its subscriptions match; the client dispatches locally.
   A connection whose user (--users) may publish some keys only reads its
   user's own cache instead (broky.server.security.users `Permissions.routes`): a miss
   there checks the key against the user's patterns first (refused:
   PERMISSION_DENIED, with the frame, as NOT_MY_VBUCKET), then routes it and
   copies the route in; the compiled twin gets that dict, so an allowed key
   costs what it costs anyone. Without --users, or for a user allowed
   everything, nothing of this runs (Connection.perms is None).
   Any subscription change (subscribe, unsubscribe, disconnect) empties the
   cache (and the users' caches); it is also emptied when it reaches ROUTE_CACHE_SIZE entries. Routes
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
   dropped and counted (`squeeze`; see broky.server.shard.connection for how pending
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

The vbucket map
---------------
A worker owns the vbuckets that the map gives it (node `config.node_id`,
worker `index`): `owned` has one byte per vbucket, 1 for its own, and
`accepts` also has 1 for those a prepared map moves to this worker, so that
a client that adopted the commit before this worker did is not refused
(schema/README.md 6.3). The read path tests `accepts` once per route cache
miss (`route`), as a scoped Subscribe does (broky.server.shard.control). A
publish for a vbucket this worker does not accept is dropped and counted,
and refused with a non-fatal NOT_MY_VBUCKET Error that carries the frame
back (`not_mine`), for the client to send to the owner; the connection stays
open.

A newer map from the master (`apply_map`) is taken at once (the Welcome of
later connections carries it, broky.server.shard.arrivals, and the route cache
is emptied) and pushed to every welcomed client as a MapUpdate, a reply
(never dropped). Clients answer MapApplied once they follow it; the cluster
moves vbuckets only when every connection with subscriptions has
(`map_ready`). The sequences of the vbuckets that came or went follow
(broky.server.shard.moves): one that goes is handed over, its retained
messages stay here for bounded reads that name it (a former vbucket); one
that comes continues its sequence once it has it, or starts a new epoch.

Control frames
--------------
Every frame of a client other than a Message (and the SDK's Pings, answered
in the read path) is handled in its place in the connection's stream
(`control`): a Subscribe is admitted or refused by its rules
(broky.server.shard.control), joins its group (broky.server.shard.groups), goes
into the subscription table, a broky.matching.Matcher whose match for a key
is compiled into a `Plan` (broky.server.shard.connection), and replays what it
asks for from positions (broky.server.shard.positions); every change to the
table (Subscribe, Unsubscribe, a connection's end: `detach`) empties the
route cache. A Read goes to the positions, an Ack to the groups; Pause keeps
a connection's deliveries, Resume sends them and restarts a read the Pause
held up. While a vbucket's sequence is on its way here, a Subscribe or Read
that starts from its positions waits for it (broky.server.shard.moves).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

from broky.errors import ErrorCode, MalformedFrameError, RemoteProtocolError
from broky.matching import Matcher
from broky.protocol import (
    GROUPS_VERSION,
    VERSION_3_FRAMES,
    Ack,
    LossNotice,
    LossReason,
    MapApplied,
    MapUpdate,
    NodeInfo,
    Pause,
    Ping,
    Pong,
    Read,
    Resume,
    Subscribe,
    Unsubscribe,
    VBucketMap,
    decode_frame,
    encode_frame,
    route_message,
)
from broky.protocol.frames import PING_SIZE_PREFIX, encode_pong, error_frame, ping_id
from broky.protocol.framing import MIN_FRAME_SIZE, check_size
from broky.protocol.layout import (
    FIXED_SIZE,
    HEADER_AT,
    HEADER_END,
    HEADER_NO_UID,
    HEADER_SIZE,
    HEADER_UID,
    KEY_UOFFSET_AT,
    PAYLOAD_UOFFSET_AT,
    SIZE_AT,
    STAMPS_END,
    TS_BROKER_AT,
    TS_PRODUCER_AT,
    UID_AT,
    UID_END,
    VECTORS_AT,
    read_shape,
    struct_at,
)
from broky.protocol.message import BODY_MESSAGE, body_type, canonical_copy, pack_stamp_into
from broky.protocol.routing import vbucket_of
from broky.protocol.table import Buffer
from broky.server.accounts import AccountBook
from broky.server.config import ServerConfig
from broky.server.histogram import PRODUCER_BEHIND_NS
from broky.server.logs import Throttle
from broky.server.security.users import Users, WorkerUsers
from broky.server.shard import fastpath, monitoring
from broky.server.shard.arrivals import Arrivals
from broky.server.shard.backpressure import check_replies, watch
from broky.server.shard.budget import Budget
from broky.server.shard.budget_enforcement import enforce_budget, refresh_pending, trim_due, trim_heap
from broky.server.shard.closing import count_messages, discard_after_goodbye, final_frame, goodbye
from broky.server.shard.connection import CLOSED, OPEN, Connection, Plan, Subscription, compile_plan
from broky.server.shard.control import admit, deny, deny_publish, text
from broky.server.shard.grace import Grace
from broky.server.shard.groups import Groups, GroupTargets
from broky.server.shard.lag import Lag
from broky.server.shard.moves import Moves
from broky.server.shard.part import Route
from broky.server.shard.positions import Positions
from broky.server.shard.replay import ReplayBuffer
from broky.server.shard.sequences import Sequences
from broky.server.shard.stats import DropReason, WorkerStats

log = logging.getLogger("broky.worker")

_u32 = struct.Struct("<I").unpack_from
_i64 = struct.Struct("<q").unpack_from
_MESSAGE_HEADERS = (HEADER_UID, HEADER_NO_UID)  # a canonical Message's fixed header, either
# Canonical Message (broky.protocol.layout): the size prefix, the fixed header, the
# key and payload uoffsets (each relative to its own position), and the
# key_partition's length where it lies without a uid and where it lies with one.
# One read gives all.
_canonical_head = struct_at(
    (SIZE_AT, "I"),
    (HEADER_AT, f"{HEADER_SIZE}s"),
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (VECTORS_AT[False], "I"),
    (VECTORS_AT[True], "I"),
).unpack_from
CANONICAL_HEAD_SIZE = FIXED_SIZE[True]
_PLAIN_VECTORS_AT = VECTORS_AT[False]
SHAPE_CACHE_SIZE = 4096
# A shape: (read of the key's and the payload's lengths, positions relative to the
# frame's first byte of the key vector, the payload vector, the end and the
# routing bytes); None for a valid canonical header whose vectors are not laid out
# key_partition, key, payload (the generic read handles it).
Shape = tuple[Callable[[Buffer, int], tuple[Any, ...]], int, int, int, int]
# `Shard.route`'s answer for a vbucket that awaits its sequence (broky.server.shard.moves):
# never cached; the publish is held.
AWAITING: Route = ((), -1)
_time_ns = time.time_ns
_monotonic = time.monotonic
# The drop reasons of the per-read path, read once: an Enum member read off its class
# goes through EnumType's __getattr__ slot and costs more than the count itself.
_NO_SUBSCRIBERS = DropReason.NO_SUBSCRIBERS
_SLOW_CONSUMER = DropReason.SLOW_CONSUMER
# A Shard keeps at most this many instance attributes. CPython 3.11 keeps an
# instance's attributes in a table shared with its class, and looks them up by a
# cached position, only while they are few: a 30th attribute made every read of
# one message 4-6% slower (bench/test_micro.py, test_shard_feed_one_message). New
# state goes into an object of its own (as `budget`), or into the part it is for
# (a part is one attribute, however much it keeps).
SHARD_ATTRIBUTES = 29
ROUTE_CACHE_SIZE = 65536
# Routes of messages whose key_partition and key together exceed this many bytes are
# not cached: a cache bounded by entries must not hold megabytes of keys.
ROUTE_CACHE_MAX_KEY = 256
# Seconds between two warnings about one connection's non-fatal errors of one code (or
# about connections cut for the memory budget).
WARNING_INTERVAL = 10.0


class Shard:
    """The state of one worker: owned vbuckets, connections, subscription table; the core
    of its parts (see the header)."""

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
        broky.server.shard.fastpath); False runs the pure-Python reference."""
        self.config = config
        if compiled and fastpath.compiled_scan is None:
            raise RuntimeError(f"the compiled fast path is not available: {fastpath.description}")
        self.scan = fastpath.compiled_scan if compiled is not False else None
        self.index = index
        self.loop = loop
        # Counters of every connection, mirrored where the master can read them if
        # this process dies (broky.server.accounts); in memory for tests and benchmarks.
        self.book = book if book is not None else AccountBook.in_memory()
        if vmap is None:  # a single node (the cluster's map comes from the master)
            node = NodeInfo(config.node_id, config.advertised_host(), config.port, config.workers)
            vmap = VBucketMap.single_node(node)
        self.map = vmap
        self.owned = b""  # vbucket -> 1 if this worker owns it (`take_map`)
        self.accepts = b""  # ... or it is moving here (publishes and scoped Subscribes taken)
        # The subscription table: a Matcher compiling each key's subscriptions into a Plan.
        self.matcher: Matcher[Subscription, Plan] = Matcher(compile_plan)
        # Route cache: the routing bytes of a canonical Message (or (key_partition, key)
        # for any other layout) -> (target connections, vbucket), or None when not our vbucket.
        self.routes: dict[object, Route | None] = {}
        # Shapes of canonical Messages met so far, without and with uid (see `shape`).
        self.shapes: tuple[dict[tuple[int, int, int, int], Shape | None], ...] = ({}, {})
        self._interned: dict[object, tuple[Connection, ...]] = {}
        self.stats = WorkerStats()
        self.conns: dict[int, Connection] = {}
        self.touched: list[Connection] = []  # queued to during this read (or timer): `flush`
        self.closing = False
        self.warnings = Throttle(WARNING_INTERVAL)  # of clients' non-fatal mistakes
        # Restart grace (broky.server.shard.grace): while `holding`, Message frames are held.
        self.holding = False
        # Users and their permissions (--users; broky.server.security.users): None without.
        self.users: WorkerUsers | None = None
        # This worker's share of --memory-budget (broky.server.shard.budget; the replay buffer
        # draws from it too), and the heap trim's bookkeeping.
        self.budget = Budget(config.memory_budget // config.workers)
        # Called once per connection when it is gone (the worker tells the master).
        self.on_closed: Callable[[Connection], object] | None = None
        # Every vbucket's epoch and next offset (broky.server.shard.sequences), and the most
        # recent stamped reads (broky.server.shard.replay; None: --replay-bytes 0).
        self.seqs = Sequences()
        self.replay = (
            ReplayBuffer(
                config.replay_bytes, self.seqs, config.replay_max_age or None, budget=self.budget,
                settle=fastpath.compiled_settle if self.scan is not None else None,
                gather=fastpath.compiled_gather if self.scan is not None else None,
            )
            if config.replay_bytes
            else None
        )  # fmt: skip
        # The parts (see the header), each built with the core.
        self.arrivals = Arrivals(self, epoch)  # epoch: this incarnation's part of every connection id
        self.moves = Moves(self, config.move_timeout)
        self.grace = Grace(self)
        self.positions = Positions(self)
        self.groups = Groups(self)
        # Lagging connections: fed from the replay buffer.
        self.lag = Lag(self, fastpath.compiled_note if self.scan is not None else None)
        # No more attributes here: see SHARD_ATTRIBUTES.
        self.take_map(vmap)

    # ------------------------------------------------------------ the fast path

    def feed(self, c: Connection, data: bytes) -> None:
        """Handle one read of connection c (see the theory of operation)."""
        if c.state != OPEN:
            if c.said_goodbye:
                discard_after_goodbye(self, c, data)
            return  # lingering close: input is discarded
        if self.holding:
            self.grace.feed(c, data)  # the restart grace (broky.server.shard.grace)
            return
        if c.rest:
            data = c.rest + data
            c.rest = b""
        seqs = self.seqs
        t0 = _time_ns()
        if t0 > seqs.last_ts:
            seqs.last_ts = t0
        else:  # the clock stepped back (or stood still): ts_broker never decreases
            t0 = seqs.last_ts
        n = len(data)
        stats = self.stats
        stats.bytes_received += n
        max_frame = self.config.max_frame_bytes
        perms = c.perms  # a user with limited permissions: its own route cache (broky.server.security.users)
        routes = self.routes if perms is None else perms.routes
        plain_shapes, uid_shapes = self.shapes
        startswith = data.startswith
        seq = seqs.view  # [4 vb] epoch, [+1] next offset, [+2] last and [+3] first stamp (ENTRY_WORDS)
        replay = self.replay
        buf: bytearray | None = None
        seg = 0  # buf's segment id in the replay buffer
        run: tuple[Connection, ...] | None = None  # targets of the current run of messages
        run_start = run_end = run_n = 0
        published = delivered = unmatched = 0
        # The first frame of the current run, for a cheap "same route again" test:
        # size prefix and header, then the routing bytes that precede and follow
        # the uid (the stamps and the uid differ from message to message); and its
        # vbucket (the same routing bytes: the same key_partition).
        same_head: bytes | None = None
        same_route = b""
        same_tail: bytes | None = None
        same_len = same_vb = 0
        pos = 0
        scan = self.scan
        runs: list[Any] = []
        try:
            while n - pos >= 4:
                if scan is not None and n - pos >= CANONICAL_HEAD_SIZE:
                    # The compiled twin takes the canonical Messages with a cached route
                    # (broky.server.shard.fastpath); what it stops at is handled below.
                    had = buf
                    if replay is None:
                        log = index = None
                    else:
                        log, index = replay.log, replay.index
                    pos, buf, handled, unrouted = scan(
                        data, pos, buf, t0, routes, max_frame, runs, seqs.state, log, index,
                        replay.next_id if replay is not None and buf is None else seg,
                    )  # fmt: skip
                    if buf is not had and replay is not None:
                        seg = replay.retain(buf, t0)  # the id the twin recorded its messages under
                    if handled:
                        published += handled
                        unmatched += unrouted
                        if runs:
                            # The twin's runs continue the one in progress here (the same
                            # targets, right after it), and its last one stays open: runs end
                            # where the Python loop alone would end them, so a group's
                            # deliveries (broky.server.shard.groups) are chunked the same way.
                            if run is not None:
                                first = runs[0]
                                if first[0] is run and first[1] == run_end:
                                    run_end = first[2]
                                    run_n += first[3]
                                    del runs[0]
                            for targets, start, end, count in runs:
                                if run is not None:
                                    delivered += self.emit(buf, run, run_start, run_end, run_n)
                                run, run_start, run_end, run_n = targets, start, end, count
                            same_head = None
                            runs.clear()
                        if n - pos < 4:
                            break
                if (
                    same_head is not None
                    and pos == run_end
                    and startswith(same_head, pos)
                    and startswith(same_route, pos + STAMPS_END)
                    and (same_tail is None or startswith(same_tail, pos + UID_END))
                ):
                    end = pos + same_len
                    if end > n:
                        break
                    at = 4 * same_vb + 1
                    offset = seq[at]
                    seq[at] = offset + 1
                    if replay is None:
                        seq[at + 1] = t0
                    if offset == 1:
                        seq[at + 2] = t0
                    pack_stamp_into(buf, pos + TS_BROKER_AT, t0, seq[at - 1], offset, same_vb)  # type: ignore[arg-type]
                    if replay is not None:
                        replay.record(same_vb, seg, pos)
                    run_end = end
                    run_n += 1
                    published += 1
                    pos = end
                    continue
                # Canonical Message (layout in broky.protocol.layout): one read gives
                # the header and every offset; the frame's shape (size, offsets,
                # key_partition length) was checked once, when first met (`shape`):
                # its vectors lie inside the frame, in order. What varies within a
                # shape, the key's and the payload's lengths, is checked here.
                shape: Shape | None = None
                if n - pos >= CANONICAL_HEAD_SIZE:
                    size, head, key_off, pay_off, plain_kp_len, uid_kp_len = _canonical_head(data, pos)
                    if head == HEADER_UID:
                        try:
                            shape = uid_shapes[size, key_off, pay_off, uid_kp_len]
                        except KeyError:
                            shape = self.shape(True, size, key_off, pay_off, uid_kp_len)
                    elif head == HEADER_NO_UID:
                        try:
                            shape = plain_shapes[size, key_off, pay_off, plain_kp_len]
                        except KeyError:
                            shape = self.shape(False, size, key_off, pay_off, plain_kp_len)
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
                        ts_at: int | None = pos + TS_BROKER_AT
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
                        behind = self.lag.behind(c) if c.lag is not None else 0  # (lagging: schema 7)
                        self.reply(c, encode_pong(Pong(ping, t0, behind)))
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
                        if not self.control(c, data, pos, end, t0):
                            break  # a start from positions waits for its sequences (c is held)
                        pos = end
                        if c.state != OPEN or c.held:  # held: after a Read (broky.server.shard.positions)
                            break
                        continue
                    rkey = (kp, key)
                published += 1
                try:
                    route = routes[rkey]
                except KeyError:
                    kp, key, ts_at = route_message(data, pos, end)  # validates the whole frame once
                    if perms is not None:
                        why = perms.publish_refusal(key)
                        if why is not None:
                            if run is not None:
                                delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                                run = same_head = None
                            deny_publish(self, c, perms, key, why, data[pos:end])
                            pos = end
                            continue
                    route = self.route(rkey, kp, key)
                    if perms is not None and route is not AWAITING and rkey in self.routes:
                        if len(routes) >= ROUTE_CACHE_SIZE:
                            routes.clear()
                        routes[rkey] = route  # a key this user may publish
                    if route is AWAITING:  # its vbucket's sequence is on its way: held until it is here
                        published -= 1
                        if run is not None:
                            delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                            run = None
                        self.moves.hold(c)
                        break
                if route is None:
                    if run is not None:
                        delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                        run = same_head = None
                    self.not_mine(c, data, pos, end)
                    pos = end
                    continue
                # Accepted: the next offset of its vbucket is its own (its position).
                targets, vb = route
                at = 4 * vb + 1
                offset = seq[at]
                seq[at] = offset + 1
                if replay is None:  # (with one, the replay buffer knows its last stamp)
                    seq[at + 1] = t0
                if offset == 1:
                    seq[at + 2] = t0
                if not targets:
                    unmatched += 1
                    if replay is None:  # nobody gets it, nobody can ask for it later
                        pos = end
                        continue
                if ts_at is None:
                    # Not the canonical layout: its stamps may share bytes with another
                    # field, so it is not stamped in place but forwarded re-encoded (rare:
                    # Broky's SDK writes the canonical layout). The run so far goes first.
                    if run is not None:
                        delivered += self.emit(buf, run, run_start, run_end, run_n)  # type: ignore[arg-type]
                        run = same_head = None
                    copy = bytearray(canonical_copy(data, pos, end, t0, max_frame, vb, seq[at - 1], offset))
                    if replay is not None:
                        replay.record(vb, replay.retain(copy, t0), 0)
                    if targets:
                        delivered += self.emit(copy, targets, 0, len(copy), 1)
                    pos = end
                    continue
                if buf is None:
                    buf = bytearray(data)
                    if replay is not None:
                        seg = replay.retain(buf, t0)
                pack_stamp_into(buf, ts_at, t0, seq[at - 1], offset, vb)
                if replay is not None:
                    replay.record(vb, seg, pos)
                    if not targets:  # retained; delivered to nobody
                        pos = end
                        continue
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
                        same_head = data[pos : pos + HEADER_END]
                        same_len = end - pos
                        same_vb = vb
                        if route_at == _PLAIN_VECTORS_AT:
                            same_route = data[pos + STAMPS_END : pos + p_at + 4]
                            same_tail = None
                        else:
                            same_route = data[pos + STAMPS_END : pos + UID_AT]
                            same_tail = data[pos + UID_END : pos + p_at + 4]
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
            stats.dropped[_NO_SUBSCRIBERS] += unmatched
        if published:  # before anything is written: see broky.server.accounts
            self.book.commit_read(c, self.touched)
            # The producer latency (broky.server.histogram): the read's first frame, when it
            # is a Message, its age counted for each message of the read.
            if startswith(_MESSAGE_HEADERS, HEADER_AT):
                age = t0 - _i64(data, TS_PRODUCER_AT)[0]
                if 0 <= age <= PRODUCER_BEHIND_NS:
                    stats.producer_ns_sum += age * published
                    stats.producer_us[(age >> 10).bit_length()] += published
                else:  # no ts_producer, a clock ahead of this one, or not comparable
                    stats.producer_outlier(t0 - age, age, published)
        if self.touched:
            self.flush(committed=published > 0)
            if delivered:  # one observation per delivered message (broky.server.histogram)
                dt = _time_ns() - t0
                stats.latency_ns_sum += dt * delivered
                stats.latency_us[min(dt >> 10, 1 << 30).bit_length()] += delivered

    # ------------------------------------------------------------ queueing

    def emit(self, buf: bytearray, targets: tuple[Connection, ...], start: int, end: int, count: int) -> int:
        """Queue a run of `count` consecutive stamped messages buf[start:end] to each target."""
        # A run that is the whole read (the usual case) is queued without a copy: buf is
        # not written to again once its last message is stamped.
        chunk = buf if start == 0 and end == len(buf) else buf[start:end]
        size = end - start
        touched = self.touched
        delivered = 0
        for t in targets:
            if t.base + t.unflushed + size > t.cap:  # (its limit; -1 while it has drops untold)
                c_base = t.transport.get_write_buffer_size()  # refresh: it only shrinks between flushes
                t.base = c_base
                if c_base + t.unflushed + size > t.cap:
                    delivered += self.squeeze(t, buf, start, end, count)
                    continue
            t.unflushed += size
            t.out.append(chunk)
            if not t.touched:
                t.touched = True
                touched.append(t)
            t.msgs_out += count
            delivered += count
        if type(targets) is not tuple:  # GroupTargets: and one member of each group
            delivered += self.groups.emit(buf, targets.groups, start, end)  # type: ignore[attr-defined]
        return delivered

    def shape(self, uid: bool, size: int, key_off: int, pay_off: int, kp_len: int) -> Shape | None:
        """Slow path of the shape cache: check once what every canonical Message of
        this size, these offsets and this key_partition length has in common.

        None (cached too) sends such frames to the generic read: a size out of
        bounds (which then raises), or vectors not in the order key_partition,
        key, payload with the key right after the key_partition (layout.read_shape).
        """
        shape: Shape | None = None
        v = read_shape(uid, size, key_off, pay_off, kp_len)
        if v is not None and MIN_FRAME_SIZE <= size <= self.config.max_frame_bytes:
            lengths = struct_at((v.key_at, "I"), (v.payload_at, "I"), start=v.key_at).unpack_from
            shape = (lengths, v.key_at, v.payload_at, v.frame_len, v.kp_at)
        shapes = self.shapes[uid]
        if len(shapes) >= SHAPE_CACHE_SIZE:
            shapes.clear()
        shapes[size, key_off, pay_off, kp_len] = shape
        return shape

    def route(self, rkey: object, kp: bytes, key: bytes) -> Route | None:
        """Slow path of the route cache: None if not our vbucket, else the target
        connections and the vbucket."""
        route: Route | None
        vb = vbucket_of(kp)
        if not self.accepts[vb]:
            route = None
        elif self.moves.awaiting and self.moves.awaited(vb):
            return AWAITING  # not cached: the read path holds the publish
        else:
            everyone, scoped, groups, scoped_groups = self.matcher.match(key)
            if scoped is not None:
                more = scoped.get(kp)
                if more:
                    everyone = everyone + more
            if scoped_groups is not None:
                more_groups = scoped_groups.get(kp)
                if more_groups:
                    groups = groups + more_groups
            if groups:  # a route with groups takes the Python loop (broky.server.shard.groups)
                targets: tuple[Connection, ...] = GroupTargets(everyone, groups)
                intern_key: object = (everyone, groups)
            else:
                targets = intern_key = everyone
            if len(kp) + len(key) > ROUTE_CACHE_MAX_KEY:
                return targets, vb  # neither cached nor interned: that would keep the big key alive
            # Equal target sets share one tuple, so runs of messages are found by identity.
            route = self._interned.setdefault(intern_key, targets), vb
        if len(kp) + len(key) > ROUTE_CACHE_MAX_KEY:
            return None
        if len(self.routes) >= ROUTE_CACHE_SIZE:
            self.routes.clear()
            self._interned.clear()
        self.routes[rkey] = route
        return route

    def forget_routes(self) -> None:
        """Subscriptions changed: every cached route may be wrong."""
        self.routes.clear()
        self._interned.clear()
        if self.users is not None:
            self.users.forget_routes()

    def flush(self, committed: bool = False) -> None:
        """Write once to every connection touched during this read; charge what each
        has pending to the worker's budget, and enforce it (see "Memory budget").
        Their accounts are committed first (broky.server.accounts), unless the read
        did already (`committed`): whatever a client could receive is accounted first,
        whatever queued it (a publish, an Ack, a group's timer, a reply)."""
        if not committed:
            self.book.commit(self.touched)
        sent = 0
        for t in self.touched:
            t.touched = False
            if t.paused or t.state != OPEN:
                if t.state != CLOSED:  # kept for a paused one; a lingering close's buffer
                    self.charge(t, t.base + t.unflushed)
                continue
            sent += self.write_out(t)
        self.touched.clear()
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
        if t.reply_out or t.reads_stopped:  # rare: this read queued replies, or reads wait for them
            check_replies(self, t, base)
        if t.dropped and base <= t.limit >> 2:
            self.notify_loss(t)
        return size

    def squeeze(self, c: Connection, buf: bytearray, start: int, end: int, count: int) -> int:
        """c is at its pending bound: queue the leading messages of the run that fit,
        drop and count the others; return how many were queued. After a drop, nothing
        more is queued to it before the LossNotice that tells it (`cap`, `reopen`: see
        broky.server.shard.backpressure, "Slow consumers")."""
        if c.state != OPEN:
            return 0
        if c.lag is not None:  # it lags: owed, read from the replay buffer as it drains
            return self.lag.missed(c, buf, start, end, count)
        if c.cap < 0:
            self.reopen(c, 4 + _u32(buf, start)[0])
        room = c.cap - c.base - c.unflushed
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
            self.touched.append(c)
        lost = count - fit
        if self.replay is not None and c.subs:
            # With a replay buffer nothing is dropped: c lags (broky.server.shard.lag).
            self.lag.enter(c, buf, cut, end, lost)
            return fit
        c.dropped += lost
        c.dropped_total += lost
        c.cap = -1
        self.stats.dropped[_SLOW_CONSUMER] += lost
        if not c.over_since:
            c.over_since = _monotonic()
        return fit

    # ------------------------------------------------------------ answers

    def reply(self, c: Connection, frame: bytes) -> None:
        """Queue a control frame to c behind what this read already queued for it.

        Replies are never dropped; they count in the pending bytes, and a connection
        with more than --max-reply-bytes of them unread is read no more until they
        drain (broky.server.shard.backpressure).
        """
        if c.paused:
            transport = c.transport
            transport.write(frame)  # not kept: only deliveries wait for Resume
            c.sent += len(frame)
            c.reply_out += len(frame)
            self.stats.bytes_sent += len(frame)
            check_replies(self, c, transport.get_write_buffer_size())
            return
        c.out.append(frame)
        c.unflushed += len(frame)
        c.reply_out += len(frame)
        if not c.touched:
            c.touched = True
            self.touched.append(c)

    def error(
        self,
        c: Connection,
        code: ErrorCode,
        message: str,
        sid: int = 0,
        refused: bytes | None = None,
        rid: int = 0,
    ) -> None:
        """A non-fatal Error frame, and a warning (at most one per connection and code per 10 s)."""
        self.stats.count_error(code)
        suppressed = self.warnings.allow((c.conn_id, code))
        if suppressed is not None:
            more = f" ({suppressed} more since the last warning)" if suppressed else ""
            log.warning("connection %d from %s: %s: %s%s", c.conn_id, c.peer, code.name, message, more)
        version = self.map.version
        self.reply(
            c, error_frame(code, message, fatal=False, map_version=version, sid=sid, refused=refused, rid=rid)
        )

    def fatal(self, c: Connection, code: ErrorCode, message: str) -> None:
        """Send a fatal Error, then close c (lingering: broky.server.shard.closing); one log line."""
        if c.state != OPEN:
            return
        log.warning("connection %d from %s: %s: %s; closing", c.conn_id, c.peer, code.name, message)
        self.stats.count_error(code)
        final_frame(self, c, error_frame(code, message, fatal=True, map_version=self.map.version))

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

    def notify_loss(self, c: Connection) -> None:
        """Tell c how many deliveries it lost since the last notice; stop its clock
        (broky.server.shard.backpressure, "Slow consumers")."""
        frame = encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER))
        c.dropped = c.group_untold = 0
        c.cap = c.limit  # deliveries again
        c.over_since = 0.0
        c.transport.write(frame)
        c.sent += len(frame)
        self.stats.bytes_sent += len(frame)

    def reopen(self, c: Connection, need: int) -> bool:
        """c has drops not yet told, and `need` more bytes would fit under its bound: tell
        them now, ahead of what comes next (the drops come after every delivery queued
        before them), and queue to it again; False while it has no room yet."""
        notice = encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER))
        if c.base + c.unflushed + len(notice) + need > c.limit:
            return False
        c.out.append(notice)
        c.unflushed += len(notice)
        c.dropped = c.group_untold = 0
        c.cap = c.limit
        if not c.touched:
            c.touched = True
            self.touched.append(c)
        return True

    # ------------------------------------------------------------ the memory budget

    def charge(self, c: Connection, pending: int) -> None:
        """c has `pending` bytes pending now: the budget's running total follows
        (broky.server.shard.budget_enforcement)."""
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
            enforce_budget(self)
        else:
            budget.peak = budget.pending

    # ------------------------------------------------------------ the vbucket map

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
        self.forget_routes()
        # Sequences of the vbuckets that came or went (with the new routes: it may route held
        # input). The first map (this process's start) gives the vbuckets it owns new epochs
        # (Sequences); those a prepared map moves here await theirs like any that came.
        self.moves.follow(old, accepted or self.owned, self.accepts)

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

    # ------------------------------------------------------------ control frames

    def control(self, c: Connection, data: bytes, pos: int, end: int, t0: int = 0) -> bool:
        """A frame of c other than a Message, in its place in c's stream (see "Control
        frames"); t0: the clock reading stamped on the messages of this read (a Pong
        carries it). False: it waits for a sequence on its way here (c is held, the frame
        stays in its input)."""
        moves = self.moves
        if moves.awaiting and moves.waits(data, pos, end):
            moves.hold(c)
            return False
        frame = decode_frame(data, pos, end)
        kind = type(frame)
        if kind in VERSION_3_FRAMES and c.version < GROUPS_VERSION:
            self.fatal(
                c, ErrorCode.UNKNOWN_FRAME, f"unknown frame body type {body_type(data, pos, end)} in "
                f"protocol version {c.version} (this connection's Hello; {kind.__name__} is version 3's)",
            )  # fmt: skip
            return True
        if kind is Subscribe:
            self.subscribe(c, frame, t0)  # type: ignore[arg-type]
        elif kind is Unsubscribe:
            self.unsubscribe(c, frame.sid)  # type: ignore[union-attr]
        elif kind is Ping:
            behind = self.lag.behind(c) if c.lag is not None else 0
            self.reply(c, encode_frame(Pong(frame.id, t0, behind)))  # type: ignore[union-attr]
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
            self.positions.bounded_read(c, frame, t0)  # type: ignore[arg-type]
        elif kind is Ack:
            ack: Ack = frame  # type: ignore[assignment]
            self.groups.ack(
                c, ack.sid, ack.kind, [(p.vbucket, p.epoch, p.offset) for p in ack.positions], ack.delay_ms
            )
        else:
            name = kind.__name__
            self.fatal(c, ErrorCode.UNEXPECTED_FRAME, f"a client may not send {name} here")
        return True

    def subscribe(self, c: Connection, sub: Subscribe, t0: int = 0) -> None:
        size = admit(self, c, sub)  # (refused: told)
        if size is None:
            return
        s = Subscription(c, sub.sid, sub.pattern, sub.key_partition, size)
        if sub.group and not self.groups.join(c, s, sub):  # (an empty group name: no group)
            return
        c.subs[sub.sid] = s
        c.sub_bytes += size
        self.matcher.add(sub.pattern, s)
        self.stats.subscriptions += 1
        self.book.set_subscriptions(c, len(c.subs))
        self.stats.subscription_bytes += size
        self.forget_routes()
        if sub.since or sub.since_time or sub.last:  # a start from positions
            self.positions.start_subscription(c, s, sub, t0)

    def unsubscribe(self, c: Connection, sid: int) -> None:
        s = c.subs.pop(sid, None)
        if s is None:
            self.error(c, ErrorCode.UNKNOWN_SID, f"no subscription with sid {sid}", sid)
            return
        self.matcher.remove(s.pattern, s)
        if s.member is not None:
            self.groups.leave(s.member)
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
                self.groups.leave(sub.member)
        self.arrivals.left(c)  # what its group members got, for its client's resume
        self.stats.subscriptions -= len(c.subs)
        self.stats.subscription_bytes -= c.sub_bytes
        self.budget.freed_sub_bytes += c.sub_bytes
        c.sub_bytes = 0
        c.subs.clear()
        self.book.set_subscriptions(c, 0)
        self.forget_routes()

    def resume(self, c: Connection) -> None:
        """Resume: what was kept goes out, and the drops while paused are told."""
        if not c.paused:
            return
        c.paused = False
        if c.out and not c.touched:
            c.touched = True
            self.touched.append(c)
        if c.dropped:
            # After the kept deliveries, which this read's flush writes first.
            c.out.append(encode_frame(LossNotice(c.dropped, LossReason.SLOW_CONSUMER)))
            c.dropped = c.group_untold = 0
            c.cap = c.limit
            c.over_since = 0.0
            if not c.touched:
                c.touched = True
                self.touched.append(c)
        if c.bounded_read is not None:  # its read waited for Resume
            self.positions.pump_read(c)
        if c.lag is not None:  # and its catch-up, on the loop's next turn
            self.lag.wake(c)

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
                    deny(
                        self,
                        c,
                        perms,
                        f"subscription {sid} to '{text(s.pattern)}' ended by a reload: {why}",
                        sid,
                    )
            if c.out and not c.touched:
                c.touched = True
                self.touched.append(c)
        if self.touched:
            self.flush()

    # ------------------------------------------------------------ a connection's life

    def opened(self, c: Connection) -> None:
        """A handed-over socket is adopted: its Hello answered with a Welcome
        (broky.server.shard.arrivals), or a Goodbye if the worker is shutting down."""
        self.conns[c.conn_id] = c
        self.stats.connections += 1
        self.stats.connections_total += 1
        if self.closing:
            goodbye(self, c, "server shutting down")
            return
        resumed = self.arrivals.opened(c)
        if resumed is not None and self.holding:  # maybe a dead worker's subscriber, back
            self.grace.arrived(c, resumed.connection_id)

    def eof(self, c: Connection) -> bool:
        """The peer half-closed. Returning False lets the transport close."""
        if c.state == OPEN and c.rest:
            self.fatal(c, ErrorCode.TRUNCATED_FRAME, f"end of stream inside a frame ({len(c.rest)} bytes)")
        return False

    def drained(self, c: Connection) -> None:
        """c's write buffer fell to its low-water mark (a quarter of the bound):
        its unread replies may be fewer, its drops can be told, its bounded read and its
        ack groups' messages may go on."""
        if c.state != OPEN:
            return
        if c.reads_stopped:
            check_replies(self, c, c.transport.get_write_buffer_size())
        if c.dropped and not c.paused:
            c.base = c.transport.get_write_buffer_size()
            self.notify_loss(c)
        elif not c.paused and not c.reads_stopped:
            c.over_since = 0.0  # told already (`reopen`): its clock stops here
        if c.bounded_read is not None:  # a bounded read waits for room
            self.positions.continue_read(c)
        if c.lag is not None:  # a lagging connection's next batch
            self.lag.drained(c)
        if c.subs:  # an ack group's messages may wait for room
            self.groups.drained(c)

    def lost(self, c: Connection, exc: Exception | None) -> None:
        """c is gone (the peer closed, the network failed, or this worker aborted it):
        nothing of it stays (broky.server.shard.closing)."""
        if c.state == OPEN and c.paused and c.out:
            kept = count_messages(c.out)
            self.stats.dropped[DropReason.SLOW_CONSUMER] += kept
            c.msgs_out -= kept  # queued, never sent: a drop, told on resume (broky.server.accounts)
            c.dropped_total += kept
        if c.lag is not None:  # what it was still owed: never sent on it (a drop, for its account)
            owed = c.lag.count
            c.lag.count = 0
            c.worker_owed -= owed  # (owed by this worker while it lagged: see broky.server.shard.lag)
            self.stats.dropped[DropReason.SLOW_CONSUMER] += owed
            c.dropped_total += owed
        c.state = CLOSED
        self.book.close(c)
        if c.held:  # by the restart grace, for a sequence (or until the loop's next turn)
            c.held = ""
            self.grace.forget(c)
            self.moves.forget(c)
        c.out.clear()
        c.bounded_read = None  # a bounded read in progress ends with it
        self.lag.left(c)
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

    # ------------------------------------------------------------ the clock, the end

    def tick(self) -> None:
        """Periodic: the memory budget made exact (and enforced); slow consumer and
        truncated frame deadlines, stopped reads (broky.server.shard.backpressure); the
        replay buffer's age bound and stale index entries; sequences awaited too long
        (broky.server.shard.moves); the heap trim (broky.server.shard.budget_enforcement)."""
        now = _monotonic()
        budget = self.budget
        attention: list[Connection] = []
        if refresh_pending(self, attention) > budget.peak:
            self.new_peak()
        watch(self, attention, now)
        self.lag.tick(now)
        replay = self.replay
        if replay is not None:
            replay.expire()
            replay.trim_some()
        if self.moves.awaiting:
            self.moves.deadlines()
        if trim_due(budget, now):
            trim_heap(self, now)

    def shutdown(self) -> None:
        """Goodbye to every connection (then half-close it)."""
        self.closing = True
        self.grace.end("shutdown")  # what was held is routed first, then everyone gets the Goodbye
        self.moves.end("shutdown")
        for c in list(self.conns.values()):
            goodbye(self, c, "server shutting down")

    def flushed(self) -> bool:
        """True when every connection is closed or has handed its last byte to the kernel."""
        return all(c.state == CLOSED or c.transport.get_write_buffer_size() == 0 for c in self.conns.values())

    def abort_all(self) -> None:
        for c in list(self.conns.values()):
            if c.state != CLOSED:
                self.stats.bytes_discarded += c.transport.get_write_buffer_size()
                c.transport.abort()

    def snapshot(self) -> dict[str, Any]:
        """Every counter, for the master's /stats and the metrics exporter
        (broky.server.shard.monitoring), and every group of this worker's."""
        return {**monitoring.snapshot(self), **self.groups.snapshot()}
