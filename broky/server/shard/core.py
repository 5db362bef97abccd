"""One worker's shard: its subscription table and the fan-out fast path.

The Shard is one class assembled from one part per concern, each a mixin
class in a module of its own. A part's methods reach the shard's state as
`self.x`, as cheaply as the read path does; the state is created here
(`__init__`), and a part that needs more keeps it in an object of its own
(`Grace`, `Budget`: see SHARD_ATTRIBUTES). This module has the read path,
top to bottom: `feed`, then `emit`, `shape`, `route`, `flush`, `write_out`
and `squeeze`. The other parts:

  broky.server.shard.ownership      the vbucket map: what the worker owns and refuses
  broky.server.shard.moves       planned moves: a vbucket's sequence goes on at its
                              new owner
  broky.server.shard.arrivals       Hello and Welcome; a reconnecting client's claim
  broky.server.shard.control        control frames: subscriptions and their limits,
                              Ping, Pause and Resume, MapApplied
  broky.server.shard.history        starts from positions: a subscription's replay
  broky.server.shard.reads          bounded reads: a closed range, paced by the connection's drain
  broky.server.shard.backpressure   replies and their bound, slow consumers, `tick`
  broky.server.shard.grace          the restart grace
  broky.server.shard.budget  the memory budget kept, the heap trimmed
  broky.server.shard.closing        lost connections, fatal errors, Goodbye, shutdown
  broky.server.shard.stats          the worker's counters and their snapshot

Each opens with its share of the theory of operation and declares what it
uses of the others (under TYPE_CHECKING: mypy checks those declarations
against the definitions).

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
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

from broky.errors import MalformedFrameError, RemoteProtocolError
from broky.protocol import NodeInfo, Pong, VBucketMap, WelcomeTemplate, route_message
from broky.protocol.frames import PING_SIZE_PREFIX, encode_pong, ping_id
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
from broky.server.security.users import WorkerUsers
from broky.server.shard import fastpath
from broky.server.shard.arrivals import Arrivals
from broky.server.shard.backpressure import Backpressure
from broky.server.shard.budget import Budget
from broky.server.shard.budget_enforcement import BudgetEnforcement
from broky.server.shard.closing import Closing
from broky.server.shard.connection import CLOSED, OPEN, Connection, compile_plan
from broky.server.shard.control import ControlFrames
from broky.server.shard.grace import Grace, RestartGrace
from broky.server.shard.groups import GroupDelivery, GroupTargets, SubscriptionTable
from broky.server.shard.history import History
from broky.server.shard.moves import Handover, Handovers
from broky.server.shard.ownership import Ownership
from broky.server.shard.reads import Reads
from broky.server.shard.replay import ReplayBuffer
from broky.server.shard.sequences import Sequences
from broky.server.shard.stats import DropReason, Monitoring, WorkerStats

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
# A route: the target connections of a key (interned) and its key_partition's vbucket.
Route = tuple[tuple[Connection, ...], int]
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
# state goes into an object of its own (as `budget`).
SHARD_ATTRIBUTES = 29
ROUTE_CACHE_SIZE = 65536
# Routes of messages whose key_partition and key together exceed this many bytes are
# not cached: a cache bounded by entries must not hold megabytes of keys.
ROUTE_CACHE_MAX_KEY = 256
# Seconds between two warnings about one connection's non-fatal errors of one code (or
# about connections cut for the memory budget).
WARNING_INTERVAL = 10.0


class Shard(
    Ownership,
    Handover,
    Arrivals,
    ControlFrames,
    History,
    Reads,
    Backpressure,
    RestartGrace,
    BudgetEnforcement,
    Closing,
    GroupDelivery,
    Monitoring,
):
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
        self.epoch = epoch  # this worker incarnation's part of every connection id
        if vmap is None:  # a single node (the cluster's map comes from the master)
            node = NodeInfo(config.node_id, config.advertised_host(), config.port, config.workers)
            vmap = VBucketMap.single_node(node)
        self.map = vmap
        self.owned = b""  # vbucket -> 1 if this worker owns it (`take_map`)
        self.accepts = b""  # ... or it is moving here (publishes and scoped Subscribes taken)
        self.welcome: WelcomeTemplate
        # The subscription table, with its consumer groups (broky.server.shard.groups).
        self.matcher = SubscriptionTable(compile_plan)
        # Route cache: the routing bytes of a canonical Message (or (key_partition, key)
        # for any other layout) -> (target connections, vbucket), or None when not our vbucket.
        self.routes: dict[object, Route | None] = {}
        # Shapes of canonical Messages met so far, with and without uid (see `shape`).
        self.uid_shapes: dict[tuple[int, int, int, int], Shape | None] = {}
        self.plain_shapes: dict[tuple[int, int, int, int], Shape | None] = {}
        self._interned: dict[object, tuple[Connection, ...]] = {}
        self.stats = WorkerStats()
        self.conns: dict[int, Connection] = {}
        self._touched: list[Connection] = []
        self._next_id = 0
        self.closing = False
        self.warnings = Throttle(WARNING_INTERVAL)  # of clients' non-fatal mistakes
        # Restart grace (see `start_grace`): while `holding`, Message frames are held.
        self.holding = False
        self.grace = Grace()
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
            )
            if config.replay_bytes
            else None
        )  # fmt: skip
        # Sequences of vbuckets moving here or away (broky.server.shard.moves).
        self.handover = Handovers(config.move_timeout)
        # No more attributes here: see SHARD_ATTRIBUTES.
        self.take_map(vmap)

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
        uid_shapes = self.uid_shapes
        plain_shapes = self.plain_shapes
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
                        self.reply(c, encode_pong(Pong(ping, t0)))
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
                        if self.handover.awaiting and self.subscribe_waits(data, pos, end):
                            self.hold_for_sequence(c)  # a start from positions waits for them
                            break
                        self.control(c, data, pos, end, t0)
                        pos = end
                        if c.state != OPEN or c.held:  # held: after a Read (broky.server.shard.reads)
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
                            self.deny_publish(c, perms, key, why, data[pos:end])
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
                        self.hold_for_sequence(c)
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
            self.book.commit_read(c, self._touched)
            # The producer latency (broky.server.histogram): the read's first frame, when it
            # is a Message, its age counted for each message of the read.
            if startswith(_MESSAGE_HEADERS, HEADER_AT):
                age = t0 - _i64(data, TS_PRODUCER_AT)[0]
                if 0 <= age <= PRODUCER_BEHIND_NS:
                    stats.producer_ns_sum += age * published
                    stats.producer_us[(age >> 10).bit_length()] += published
                else:  # no ts_producer, a clock ahead of this one, or not comparable
                    self.producer_outlier(t0 - age, age, published)
        if self._touched:
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
        touched = self._touched
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
            delivered += self.emit_groups(buf, targets.groups, start, end)  # type: ignore[attr-defined]
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
        shapes = self.uid_shapes if uid else self.plain_shapes
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
        elif self.handover.awaiting and self.awaited(vb):
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
            self.book.commit(self._touched)
        sent = 0
        for t in self._touched:
            t.touched = False
            if t.paused or t.state != OPEN:
                if t.state != CLOSED:  # kept for a paused one; a lingering close's buffer
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
        if t.reply_out or t.reads_stopped:  # rare: this read queued replies, or reads wait for them
            self.check_replies(t, base)
        if t.dropped and base <= t.limit >> 2:
            self.notify_loss(t)
        return size

    def squeeze(self, c: Connection, buf: bytearray, start: int, end: int, count: int) -> int:
        """c is at its pending bound: queue the leading messages of the run that fit,
        drop and count the others; return how many were queued. After a drop, nothing
        more is queued to it before the LossNotice that tells it (`cap`, `reopen`:
        broky.server.shard.backpressure)."""
        if c.state != OPEN:
            return 0
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
            self._touched.append(c)
        lost = count - fit
        c.dropped += lost
        c.dropped_total += lost
        c.cap = -1
        self.stats.dropped[_SLOW_CONSUMER] += lost
        if not c.over_since:
            c.over_since = _monotonic()
        return fit
