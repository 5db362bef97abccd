"""Consumer groups and acknowledgements: each message of a group goes to one member.

A group Subscribe (schema/README.md 5.3) makes its subscription a `Member` of
the `Group` named by (group name, pattern, key_partition) on this worker (one
of a connection whose Hello said version 2 is refused: BAD_GROUP). The
subscription stays in the worker's subscription table (broky.matching), and
the table compiles the groups matching a key into the delivery plan beside the
plain connections (broky.server.shard.connection `compile_plan`); a route with
groups carries them in its targets tuple (`GroupTargets`), which the compiled
fast path does not take (it hands such messages to the Python loop), so a
route without groups runs exactly the code it ran before groups existed.

Theory of operation
-------------------
Delivery. `Shard.emit` queues a run of messages to the plain targets, then
gives it to this part (`Groups.emit`), which picks a member per message (or per chunk of
GROUP_CHUNK messages) and queues, to that member's connection, a Delivery
frame {sid, messages, attempt} followed by the messages: the client hands
them to that subscription alone. Nothing is copied for a group without acks
(the Delivery frame is a cached 28-byte frame); with acks each message's
bytes are kept (one copy) until it is acknowledged.

Choosing a member. Load-balanced: the member whose connection has the fewest
pending bytes (write buffer + queued this read, kept while paused) plus, with
acks, the fewest bytes in flight; ties go round the members in turn. A client
whose local queue is full pauses its connection (Pause), so its deliveries
stay queued here and count as its load: a member that reads slowly gets
less. Key-shared: each vbucket has one member, sticky, weighed by traffic:
a vbucket's first message gives it to the member whose vbuckets weigh least
(`Group.claim`; a vbucket weighs its recent messages). `rebalance` moves
vbuckets from the heaviest member to the lightest while one carries more
than BALANCE_SLACK times the other: at once when a member joins, and a
second after any join or leave (with acks, every second: those moves
drain); a member that leaves gives back only its own. Without acks a group
thus settles a second after its last membership change. Every message of a
key_partition (one vbucket) goes to its member in offset order.

Acknowledgements. A delivered message of an ack group is `Pending` in the
group's in-flight table, keyed by its position (vbucket, epoch, offset), until
an Ack settles it. NACK schedules it again after a delay (the backoff by
default); IN_PROGRESS restarts its ack_wait; no answer within ack_wait
redelivers it. Deadlines are kept in one heap per worker, served by one
loop.call_at on the earliest (`Groups.arm`): the server redelivers on its
own clock, never on a client's poll. A message delivered max_deliveries times
is dropped, counted, told (LossNotice MAX_DELIVERIES) and published to the
group's dead_letter key (same key_partition, hence the same vbucket of this
worker). A member holds at most max_in_flight messages and max_in_flight_bytes
bytes; reaching either bound sends it a GroupNotice PAUSED (and RESUMED once it
has room). When every member is at its bound, messages wait in a backlog
(per member for key-shared, to keep each vbucket's order; per group
otherwise), bounded by --group-backlog-bytes per group; past it they are
dropped, counted and told once (LossNotice GROUP_OVERFLOW to the group's
first member: one message, one member, so the told counts add up). A
message with its copy is Pending from its arrival (member None while it
waits), so `pending` and the backlogs' positions hold everything the group
keeps.

Positions, not copies. With a replay buffer (broky.server.shard.replay), a
first delivery that must wait is kept as its position, not a copy: the
worker's replay buffer holds its bytes already. A vbucket's offsets are
consecutive, so a backlog (`Backlog`) keeps runs of them, `Run(vb, epoch,
first, last)`, one per stretch of the group's consecutive messages of a
vbucket (one per vbucket while every message of the vbucket is the group's),
in arrival order beside the copies it holds (redeliveries): each vbucket's
order is kept. When a member has room, the run's first position is read from
the buffer (`front`: `ReplayBuffer.read`), copied and made Pending (`take`),
and sent. Positions the buffer evicted first (or of an epoch that ended
here) are taken out on the way and told exactly, once, to the member they
were for: LossNotice EVICTED {dropped, at, through} (the reason a start from
positions is told for the same loss; GROUP_OVERFLOW says the group's own
bound dropped it, which it did not), counted in group_evicted. The bound
--group-backlog-bytes counts each copy's bytes and RUN_BYTES per run,
whatever its length: it bounds the memory the backlog takes, and a group
whose members stall costs a run per vbucket while the buffer decides what
is lost. What is in flight stays a copy (Pending.frame, within KEPT_SHARE):
a NACK, an expiry or a member's departure redelivers it whatever the buffer
evicted meanwhile, as acks promise; a member holds at most max_in_flight of
them. With --replay-bytes 0 every message waiting is a copy, as before.
A member whose connection lags (broky.server.shard.lag) has no room.

Moves (key-shared with acks). When a join or a leave gives a vbucket to
another member while its old member still holds unacknowledged messages of
it, the vbucket drains: its new messages are held (`Drain.held`) until the
old member has settled them all, or is gone, or drain_timeout passed; then
the held messages go to the new member in order. At the deadline the new
member gets a GroupNotice DRAIN_EXPIRED naming the vbucket and how many
messages the old member still held (they may be redelivered after newer
ones), counted in group_drain_expired. Nothing stalls for longer.

A member that leaves (Unsubscribe, connection lost) gives back at once what
it held: with acks, its pending messages go to the other members (their
delivery count goes up: they were delivered once); its backlog goes to the
vbuckets' new members; the last member's are dropped and counted.

Never untold. What an ack group keeps for nobody (a backlog, a drain's held
messages, a redelivery that waits: the Pendings without a member) was never
queued to a connection, so no connection's account counts it, and a worker
that dies would lose it untold. So each group keeps it on the account of one
member's connection, its teller (its first member's; once it has none, its
last one's): `owe` moves the count (`Connection.worker_owed`) whenever it
changes, and the account is committed before anything of the read leaves
(broky.server.accounts). A client that claims that connection after the
worker died is told it, WORKER_RESTART (broky.server.shard.arrivals). What the group
loses for good with no member to tell (an orphan's ack_wait passed, a dead
message) goes on the same account (`group_lost`), told to any claim. A
delivery of an ack group that finds its member's connection over its bound is
not lost: it stays in flight and is delivered again at its deadline
(`group_deferred`); only a group without ack loses such deliveries (counted
and told as the connection's drops, never replayed: `group_untold`).

The part is an object the core builds (`Shard.groups`, broky.server.shard.part),
and keeps the worker's groups, their deadlines' heap and timer, and the bytes
they keep; the core hands it a group Subscribe (`join`), the end of a member's
subscription (`leave`), a run of a route with groups (`emit`), an Ack
(`ack`), and a connection that drained (`drained`).

Cluster: every worker balances among the members connected to it. A client's
all-partition subscription is sent to every worker, so each member of a
group is a member on every worker, and each worker's share is balanced.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import struct
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from broky.errors import ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import (
    GROUPS_VERSION,
    AckKind,
    Delivery,
    GroupEvent,
    GroupNotice,
    LossNotice,
    LossReason,
    Position,
    Subscribe,
    encode_frame,
)
from broky.protocol.frames import encode_delivery
from broky.protocol.layout import EPOCH_AT, VBUCKET_AT
from broky.protocol.message import decode_message, encode_message, pack_stamp_into, route_message
from broky.protocol.routing import VBUCKETS
from broky.server.shard.connection import OPEN, Connection, Subscription
from broky.server.shard.stats import DropReason

if TYPE_CHECKING:
    import asyncio

    from broky.server.shard.part import ShardCore

log = logging.getLogger("broky.worker")
_monotonic = time.monotonic

_u32 = struct.Struct("<I").unpack_from
_position = struct.Struct(f"<{EPOCH_AT}xQQH").unpack_from  # epoch, offset, vbucket of a frame at 0
_vbucket = struct.Struct("<H").unpack_from

# Messages of a load-balanced group without acks given to one member at a time (one
# Delivery frame): the choice by load is made per chunk, not per message.
GROUP_CHUNK = 8
# Key-shared: how often the vbuckets are weighed again (ns of the read clock), how uneven two
# members may be before vbuckets move, and how many move at a time.
BALANCE_NS = 1_000_000_000
BALANCE_SLACK = 1.1
BALANCE_MOVES = 64
DEFAULT_ACK_WAIT = 30.0
DEFAULT_MAX_DELIVERIES = 5
DEFAULT_BACKOFF = (1.0, 5.0, 30.0)
DEFAULT_MAX_IN_FLIGHT = 1000
DEFAULT_MAX_IN_FLIGHT_BYTES = 16 << 20
DEFAULT_DRAIN_TIMEOUT = 10.0

Key = tuple[int, int, int]  # a message's position: (vbucket, epoch, offset)
KEPT_SHARE = 0.5  # of the worker's share of --memory-budget, for what ack groups keep
# What a Run of positions (any length) counts against --group-backlog-bytes: about what it
# takes in memory (the object, its three ints past the small ones, its place in a deque and
# in its backlog's `tails`).
RUN_BYTES = 256
ORPHAN = "orphan"  # a heap entry's `what`: the deadline of a group whose last member left


class GroupTargets(tuple):  # type: ignore[type-arg]
    """A route's targets when groups match: the plain connections (the tuple) and the
    groups (`groups`). Always true, even without plain connections."""

    groups: tuple[Group, ...]

    def __new__(cls, conns: tuple[Connection, ...], groups: tuple[Group, ...]) -> GroupTargets:
        self = super().__new__(cls, conns)
        self.groups = groups
        return self

    def __bool__(self) -> bool:
        return True


class Member:
    """One subscription's place in its group."""

    __slots__ = (
        "group", "sub", "conn", "sid", "header", "max_msgs", "max_bytes", "in_flight", "in_flight_bytes",
        "paused", "delivered", "backlog", "vb_count", "recent", "mark", "weight",
    )  # fmt: skip

    def __init__(self, group: Group, sub: Subscription, max_msgs: int, max_bytes: int) -> None:
        self.group = group
        self.sub = sub
        self.conn = sub.conn
        self.sid = sub.sid
        self.header = encode_delivery(Delivery(sub.sid, 1, 1))  # the usual Delivery frame
        self.max_msgs = max_msgs
        self.max_bytes = max_bytes
        self.in_flight: dict[Key, None] = {}  # ack: positions of its pending messages
        self.in_flight_bytes = 0
        self.paused = False  # ack: at its bound (told PAUSED)
        self.delivered = 0
        # Key-shared with acks: messages of its vbuckets waiting for room, in order.
        self.backlog = Backlog()
        self.vb_count: dict[int, int] = {}  # ack, key-shared: its pending messages per vbucket
        # Bytes queued to it during the read `mark` (the read's clock, `Sequences.last_ts`): its
        # share of what its connection has queued, which may also carry other subscriptions'
        # deliveries.
        self.recent = 0
        self.mark = 0
        self.weight = 0.0  # key-shared: what its vbuckets weigh (Group.weights)

    def full(self) -> bool:
        return len(self.in_flight) >= self.max_msgs or self.in_flight_bytes >= self.max_bytes

    def load(self, mark: int) -> int:
        """What it has not yet taken: its connection's write buffer, plus what was queued to
        it this read (all that its connection keeps, while paused), plus its bytes in flight."""
        c = self.conn
        if c.paused:
            queued = c.unflushed
        elif self.mark == mark:
            queued = self.recent
        else:
            queued = 0
        return c.base + queued + self.in_flight_bytes


class Pending:
    """A delivered message of an ack group, until it is settled."""

    __slots__ = ("frame", "key", "member", "attempt", "deadline", "gen")

    def __init__(self, frame: bytes, key: Key) -> None:
        self.frame = frame
        self.key = key
        self.member: Member | None = None  # None: waiting for its redelivery (NACK)
        self.attempt = 0  # deliveries so far
        self.deadline = 0.0
        self.gen = 0  # its heap entries with another gen are stale


class Held:
    """A message waiting for a member (backlog, or a draining vbucket), with its copy: a
    redelivery, or any message of a worker without a replay buffer."""

    __slots__ = ("frame", "vb", "entry")

    def __init__(self, frame: bytes, vb: int, entry: Pending | None = None) -> None:
        self.frame = frame
        self.vb = vb
        # Its Pending (a redelivery's: attempt so far); None only for a Run's message just
        # read from the replay buffer (`Groups.front`), not yet taken.
        self.entry = entry


class Run:
    """First deliveries waiting, as positions: the group's messages of vbucket vb, epoch
    `epoch`, with the consecutive offsets first .. last, read from the worker's replay
    buffer when they are sent (see "Positions, not copies" in the module's header)."""

    __slots__ = ("vb", "epoch", "first", "last")

    def __init__(self, vb: int, epoch: int, offset: int) -> None:
        self.vb = vb
        self.epoch = epoch
        self.first = offset
        self.last = offset


class Backlog:
    """What waits for a member (a member's, a group's, a draining vbucket's), in order per
    vbucket: Held copies and Runs of positions. A vbucket's next offset extends its Run
    when that Run is the vbucket's last item (`tails`). `bytes` is what it counts against
    --group-backlog-bytes: each copy's bytes and RUN_BYTES per Run, whatever its length."""

    __slots__ = ("items", "tails", "bytes", "positions")

    def __init__(self) -> None:
        self.items: deque[Held | Run] = deque()
        self.tails: dict[int, Run] = {}  # per vbucket: its last item, when that is a Run
        self.bytes = 0
        self.positions = 0  # messages in its Runs

    def __bool__(self) -> bool:
        return bool(self.items)

    def cost(self, vb: int, epoch: int, offset: int) -> int:
        """The bytes that the position (vb, epoch, offset) would add."""
        r = self.tails.get(vb)
        return 0 if r is not None and r.epoch == epoch and r.last + 1 == offset else RUN_BYTES

    def add_position(self, vb: int, epoch: int, offset: int) -> int:
        """At the end (the newest of vb); the bytes it added."""
        self.positions += 1
        r = self.tails.get(vb)
        if r is not None and r.epoch == epoch and r.last + 1 == offset:
            r.last = offset
            return 0
        r = self.tails[vb] = Run(vb, epoch, offset)
        self.items.append(r)
        self.bytes += RUN_BYTES
        return RUN_BYTES

    def append(self, item: Held | Run) -> int:
        """At the end (the newest of its vbucket); the bytes it added."""
        self.items.append(item)
        if type(item) is Run:
            self.tails[item.vb] = item
            self.positions += item.last - item.first + 1
            size = RUN_BYTES
        else:
            self.tails.pop(item.vb, None)
            size = len(item.frame)  # type: ignore[union-attr]
        self.bytes += size
        return size

    def appendleft(self, h: Held) -> int:
        """At the front (older than anything it holds: a redelivery); the bytes it added."""
        self.items.appendleft(h)
        self.bytes += len(h.frame)
        return len(h.frame)

    def popleft(self) -> int:
        """Remove the first item; the bytes it gave back."""
        item = self.items.popleft()
        if type(item) is Run:
            if self.tails.get(item.vb) is item:
                del self.tails[item.vb]
            self.positions -= item.last - item.first + 1
            size = RUN_BYTES
        else:
            size = len(item.frame)  # type: ignore[union-attr]
        self.bytes -= size
        return size

    def advance(self, n: int) -> int:
        """The first item is a Run: its first n positions are taken; the bytes given back."""
        r = self.items[0]
        assert type(r) is Run
        if r.first + n > r.last:
            return self.popleft()
        r.first += n
        self.positions -= n
        return 0

    def take_all(self) -> list[Held | Run]:
        """Empty it; what it held, in order."""
        items = list(self.items)
        self.items.clear()
        self.tails.clear()
        self.bytes = self.positions = 0
        return items

    def take_vbucket(self, vb: int) -> tuple[list[Held | Run], int]:
        """Remove vb's items; them, in order, and the bytes they gave back."""
        moving = [item for item in self.items if item.vb == vb]
        if not moving:
            return moving, 0
        kept = [item for item in self.items if item.vb != vb]
        self.take_all()
        for item in kept:
            self.append(item)
        return moving, sum(size_of(item) for item in moving)


def size_of(item: Held | Run) -> int:
    """What an item of a Backlog counts against --group-backlog-bytes."""
    return RUN_BYTES if type(item) is Run else len(item.frame)  # type: ignore[union-attr]


class Drain:
    """A vbucket moving between members of a key-shared ack group."""

    __slots__ = ("old", "deadline", "held", "gen")

    def __init__(self, old: Member, deadline: float, gen: int) -> None:
        self.old = old
        self.deadline = deadline
        self.held = Backlog()
        self.gen = gen


class Group:
    """The members on this worker of one group, and with acks its messages in flight."""

    def __init__(self, name: str, pattern: bytes, kp: bytes | None, sub: Subscribe) -> None:
        self.name = name
        self.pattern = pattern
        self.kp = kp
        self.key_shared = sub.key_shared
        self.ack = sub.ack
        self.ack_wait = (sub.ack_wait_ms or DEFAULT_ACK_WAIT * 1000) / 1000
        self.max_deliveries = sub.max_deliveries or DEFAULT_MAX_DELIVERIES
        self.backoff = tuple(ms / 1000 for ms in sub.backoff_ms) or DEFAULT_BACKOFF
        self.dead_letter = sub.dead_letter or None  # empty: none
        self.drain_timeout = (sub.drain_timeout_ms or DEFAULT_DRAIN_TIMEOUT * 1000) / 1000
        self.members: list[Member] = []
        self.turn = 0  # where the next tie-break starts
        # Key-shared: each vbucket's member (None: none yet, claimed by its next message), what
        # each vbucket weighs (its messages, halved at every rebalance: recent traffic counts
        # most), and when the next rebalance is due (the read clock, ns).
        self.owners: list[Member | None] = [None] * VBUCKETS
        self.counts = [0] * VBUCKETS
        self.weights = [0.0] * VBUCKETS
        self.next_balance = 0
        # Without acks a move is not drained (nothing tells when a member is done), so vbuckets
        # move only to settle a membership change: one rebalance BALANCE_NS after it, then none
        # until the next. With acks moves drain, and the group is rebalanced every BALANCE_NS.
        self.settling = True
        self.pending: dict[Key, Pending] = {}
        self.backlog = Backlog()  # load-balanced with acks: waiting for room
        # What every backlog of the group counts (its members', its own, its drains'),
        # bounded by --group-backlog-bytes.
        self.backlog_bytes = 0
        self.draining: dict[int, Drain] = {}
        self.orphan_gen = 0  # its last member left: the deadline's gen (see Groups.give_back)
        # Its teller (see "Never untold" in the module's header): the connection of its first member (of
        # its last one, once it has none), and the messages it keeps for nobody, as counted in
        # that connection's `worker_owed`.
        self.teller: Connection | None = None
        self.owed = 0

    def keeps_for_nobody(self) -> int:
        """With acks: its messages that no member holds now (waiting in a backlog or a drain,
        or for a redelivery): each Pending without a member, and each position of a Run."""
        return len(self.pending) - sum(len(m.in_flight) for m in self.members) + self.positions()

    def positions(self) -> int:
        """Messages waiting as positions (Runs) in its backlogs."""
        return (
            self.backlog.positions
            + sum(m.backlog.positions for m in self.members)
            + sum(d.held.positions for d in self.draining.values())
        )

    def settings(self) -> tuple[Any, ...]:
        """What every member of the group must agree on."""
        if not self.ack:
            return (self.key_shared, False)
        return (
            self.key_shared, True, self.ack_wait, self.max_deliveries, self.backoff, self.dead_letter,
            self.drain_timeout if self.key_shared else None,  # only a key-shared group drains
        )  # fmt: skip

    def pick(self, mark: int, size: int = 0) -> Member | None:
        """The least loaded member (`Member.load`; ties in turn). With acks, only members with
        room (within max_in_flight, and `size` bytes free under their connection's pending
        bound); None: every one is at its bound. Without acks, a member whose connection takes
        nothing now (`cap` -1: it lags, broky.server.shard.lag, or has drops untold) is passed
        over while another can take it."""
        members = self.members
        n = len(members)
        ack = self.ack
        if n == 1:
            m = members[0]
            c = m.conn
            if ack and (m.paused or c.base + c.unflushed + size > c.cap):
                return None
            return m
        best = None
        best_load = -1
        start = self.turn if self.turn < n else 0  # (members may have left since)
        self.turn = start + 1 if start + 1 < n else 0
        for i in range(n):
            j = start + i
            m = members[j if j < n else j - n]
            c = m.conn
            if ack:
                if m.paused or c.base + c.unflushed + size > c.cap:
                    continue
            elif c.cap < 0:
                continue
            load = m.load(mark)
            if best is None or load < best_load:
                best = m
                best_load = load
        if best is None and not ack:  # every one takes nothing now: as before, dropped and told
            best = members[start]
        return best

    def lightest(self) -> Member:
        """Key-shared: the member whose vbuckets weigh least (ties in turn)."""
        members = self.members
        n = len(members)
        start = self.turn if self.turn < n else 0  # (members may have left since)
        self.turn = start + 1 if start + 1 < n else 0
        best = members[start]
        for i in range(1, n):
            j = start + i
            m = members[j if j < n else j - n]
            if m.weight < best.weight:
                best = m
        return best

    def claim(self, vb: int) -> Member:
        """Key-shared: a vbucket with no member yet (its first message, or its member left)
        goes to the lightest member, weighed as the average vbucket until it is measured."""
        m = self.lightest()
        owners = self.owners
        owners[vb] = m
        taken = VBUCKETS - owners.count(None)
        measured = sum(self.weights)
        m.weight += measured / taken if measured and taken else 1.0
        return m


class Groups:
    """The Shard's part that serves consumer groups (`Shard.groups`), built with the core
    (broky.server.shard.part): every group of the worker, and the ack deadlines' heap and timer."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        self.groups: dict[tuple[str, bytes, bytes | None], Group] = {}
        # (deadline, sequence, what): what is (group, key, gen) of a Pending, or (group, vb, gen)
        # of a Drain (vb an int: told apart from a key, a tuple).
        self.heap: list[tuple[float, int, tuple[Group, Any, int]]] = []
        self.seq = itertools.count()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        # Bytes of the messages ack groups keep (in flight or waiting), bounded by KEPT_SHARE of
        # the worker's share of --memory-budget: past it a group's new messages are dropped
        # and told as group_overflow, however many groups and members hostile clients make.
        self.kept = 0

    def push(self, deadline: float, what: tuple[Group, Any, int]) -> None:
        heapq.heappush(self.heap, (deadline, next(self.seq), what))

    # ------------------------------------------------------------ joining and leaving

    def join(self, c: Connection, s: Subscription, sub: Subscribe) -> bool:
        """Make s a member of its group (created with the first); False: refused (BAD_GROUP)."""
        assert sub.group is not None
        if c.version < GROUPS_VERSION:  # never a member a version-2 client cannot tell from a plain one
            self.core.error(
                c, ErrorCode.BAD_GROUP, f"group {sub.group!r}: groups are protocol version "
                f"{GROUPS_VERSION}'s; this connection's Hello said {c.version}", sub.sid,
            )  # fmt: skip
            return False
        if sub.since or sub.since_time or sub.last:
            self.core.error(
                c, ErrorCode.BAD_GROUP, f"group {sub.group!r}: a group member starts live "
                "(since, since_time and last are not for groups)", sub.sid,
            )  # fmt: skip
            return False
        if sub.ack and sub.dead_letter:
            try:
                tokens = parse_pattern(sub.pattern)
                parse_pattern(sub.dead_letter)
            except Exception as exc:  # BadPatternError: the key is not a valid key
                self.core.error(c, ErrorCode.BAD_GROUP, f"dead_letter {sub.dead_letter!r}: {exc}", sub.sid)
                return False
            if pattern_matches(tokens, sub.dead_letter):
                self.core.error(
                    c, ErrorCode.BAD_GROUP, f"dead_letter {sub.dead_letter!r} matches the group's own "
                    f"pattern {sub.pattern!r}: a dead message would come back to the group", sub.sid,
                )  # fmt: skip
                return False
        gkey = (sub.group, sub.pattern, sub.key_partition)
        g = self.groups.get(gkey)
        new = Group(sub.group, sub.pattern, sub.key_partition, sub)
        if g is not None and not g.members and g.settings() != new.settings():
            self.orphan_expired(g)  # kept for a member with the old settings: lost, counted
            g = None
        if g is None:
            g = self.groups[gkey] = new
            self.core.stats.groups += 1
        elif g.settings() != new.settings():
            self.core.error(
                c, ErrorCode.BAD_GROUP, f"group {sub.group!r} on {sub.pattern!r}: its members here have "
                f"other settings (key_shared, ack, ack_wait, max_deliveries, backoff, dead_letter, "
                f"drain_timeout: {g.settings()} != {new.settings()})", sub.sid,
            )  # fmt: skip
            return False
        m = Member(
            g,
            s,
            sub.max_in_flight or DEFAULT_MAX_IN_FLIGHT,
            sub.max_in_flight_bytes or DEFAULT_MAX_IN_FLIGHT_BYTES,
        )
        s.member = m
        g.members.append(m)
        self.core.stats.group_members += 1
        if g.key_shared:
            if len(g.members) > 1:
                self.rebalance(g, decay=False)  # it takes a share of what the others carry
            g.settling = True  # and a second later, weighed again
            g.next_balance = max(self.core.seqs.last_ts, time.time_ns()) + BALANCE_NS
        if len(g.members) == 1 and (g.pending or g.backlog):
            self.revive(g)
        if g.ack:
            self.owe(g)
        return True

    def leave(self, m: Member) -> None:
        """m's subscription ended (Unsubscribe or its connection's end)."""
        g = m.group
        if m not in g.members:
            return
        g.members.remove(m)
        m.sub.member = None
        self.core.stats.group_members -= 1
        if g.ack:
            self.give_back(g, m)
            self.owe(g)  # a new teller, or the same one (its connection's account) with no member
        elif g.key_shared:
            self.release_vbuckets(g, m)
        if not g.members and not g.pending and not g.backlog:
            self.forget_group(g)
        self.flush_soon()

    def forget_group(self, g: Group) -> None:
        groups = self.groups
        gkey = (g.name, g.pattern, g.kp)
        if groups.get(gkey) is g:
            del groups[gkey]
            self.core.stats.groups -= 1

    def give_back(self, g: Group, m: Member) -> None:
        """A departed member's pending messages and backlog go to the others, in offset order
        per vbucket before anything newer; with no member left the group keeps them for
        ack_wait, for a member that comes back (a client reconnecting)."""
        now = self.core.loop.time()
        entries = sorted((g.pending[k] for k in m.in_flight if k in g.pending), key=lambda e: e.key)
        for e in entries:
            e.member = None
            e.gen += 1  # its ack deadline no longer runs
        m.in_flight.clear()
        m.in_flight_bytes = 0
        m.vb_count.clear()
        g.backlog_bytes -= m.backlog.bytes
        backlog = m.backlog.take_all()
        # Drains that waited for m: what they hold is newer than m's messages, so it goes after.
        newer: list[Held | Run] = []
        for vb in [vb for vb, d in g.draining.items() if d.old is m]:
            d = g.draining.pop(vb)
            g.backlog_bytes -= d.held.bytes
            newer.extend(d.held.take_all())
        if not g.members:
            if g.key_shared:
                self.release_vbuckets(g, m)
            for d in g.draining.values():
                g.backlog_bytes -= d.held.bytes
                newer.extend(d.held.take_all())
            g.draining.clear()
            kept = backlog + g.backlog.take_all() + newer
            for item in kept:
                g.backlog.append(item)
            g.backlog_bytes = g.backlog.bytes
            if g.pending or kept:
                g.orphan_gen += 1
                self.push(now + g.ack_wait, (g, ORPHAN, g.orphan_gen))
                self.arm(now + g.ack_wait)
            return
        if g.key_shared:
            self.release_vbuckets(g, m)  # claimed by the others as their messages come
        for e in entries:
            self.redeliver(g, e, now)
        for item in backlog + newer:
            self.place_item(g, item, now)

    def revive(self, g: Group) -> None:
        """A member joined a group whose last member had left: what it kept goes out again."""
        now = self.core.loop.time()
        g.orphan_gen += 1  # its deadline no longer runs
        # These go out below, in the backlog's order.
        waiting = {id(h.entry) for h in g.backlog.items if type(h) is Held}
        for e in sorted(
            (e for e in g.pending.values() if e.member is None and id(e) not in waiting), key=lambda e: e.key
        ):
            e.gen += 1
            self.redeliver(g, e, now)
        kept = g.backlog.take_all()
        g.backlog_bytes = 0
        for item in kept:
            self.place_item(g, item, now)

    def orphan_expired(self, g: Group) -> None:
        """No member came back within ack_wait: what the group kept is lost, and counted."""
        if g.members:
            return
        lost = len(g.pending) + g.backlog.positions  # (its backlog's copies are Pending too)
        self.kept -= sum(len(e.frame) for e in g.pending.values())
        g.pending.clear()
        g.backlog.take_all()
        g.backlog_bytes = 0
        if lost:
            self.core.stats.dropped[DropReason.GROUP_OVERFLOW] += lost
            self.core.stats.group_lost_no_member += lost
            self.tell_lost(g, LossReason.CONNECTION_LOST, None, count=lost)
        self.owe(g)
        self.forget_group(g)

    def release_vbuckets(self, g: Group, m: Member) -> None:
        """Key-shared: m left; its vbuckets are claimed again by their next messages (and
        weighed again a second later)."""
        owners = g.owners
        for vb, owner in enumerate(owners):
            if owner is m:
                owners[vb] = None
        m.weight = 0.0
        g.settling = True
        g.next_balance = max(self.core.seqs.last_ts, time.time_ns()) + BALANCE_NS

    def rebalance(self, g: Group, decay: bool = True) -> None:
        """Key-shared: move vbuckets from the heaviest member to the lightest while one weighs
        more than BALANCE_SLACK times the other, at most BALANCE_MOVES at a time, each the
        vbucket that best halves their gap: only what must move moves. Periodic (every
        BALANCE_NS of the read clock, with the weights' decay) and when a member joins."""
        weights = g.weights
        counts = g.counts
        if decay:
            g.next_balance = self.core.seqs.last_ts + BALANCE_NS
            g.settling = g.ack
            for vb in range(VBUCKETS):
                weights[vb] = weights[vb] * 0.5 + counts[vb]
                counts[vb] = 0
            weight = weights
        else:
            weight = [w + c for w, c in zip(weights, counts, strict=True)]
        members = g.members
        owned: dict[Member, list[int]] = {m: [] for m in members}
        for m in members:
            m.weight = 0.0
        for vb, owner in enumerate(g.owners):
            if owner is not None:
                owner.weight += weight[vb]
                owned[owner].append(vb)
        for _ in range(BALANCE_MOVES):
            hi = max(members, key=lambda m: m.weight)
            lo = min(members, key=lambda m: m.weight)
            gap = hi.weight - lo.weight
            if gap <= 0 or hi.weight <= BALANCE_SLACK * lo.weight:
                break
            best = -1
            best_miss = gap
            for vb in owned[hi]:
                w = weight[vb]
                if 0 < w < gap and abs(gap / 2 - w) < best_miss:
                    best, best_miss = vb, abs(gap / 2 - w)
            if best < 0:
                break  # only vbuckets heavier than the gap: moving one would not help
            owned[hi].remove(best)
            owned[lo].append(best)
            hi.weight -= weight[best]
            lo.weight += weight[best]
            self.move(g, best, hi, lo)
            self.core.stats.group_vbuckets_moved += 1

    def move(self, g: Group, vb: int, old: Member, new: Member) -> None:
        """Key-shared: vb goes from old to new; with acks it drains first when old still holds
        messages of it (see the theory of operation)."""
        g.owners[vb] = new
        if not g.ack or vb in g.draining:  # (a drain under way ends at the vbucket's new owner)
            return
        now = self.core.loop.time()
        moving, size = old.backlog.take_vbucket(vb)
        g.backlog_bytes -= size
        if old.vb_count.get(vb):
            d = Drain(old, now + g.drain_timeout, next(self.seq))  # a gen of its own: see `expire`
            for item in moving:
                g.backlog_bytes += d.held.append(item)
            g.draining[vb] = d
            self.push(d.deadline, (g, vb, d.gen))
            self.arm(d.deadline)
        else:
            for item in moving:
                self.place_item(g, item, now)

    # ------------------------------------------------------------ delivery

    def emit(self, buf: bytearray, groups: tuple[Group, ...], start: int, end: int) -> int:
        """Queue the run buf[start:end] to one member of each group; the deliveries queued
        (`Shard.emit`, for a route with groups)."""
        seqs = self.core.seqs
        delivered = 0
        for g in groups:
            if not g.members:
                continue
            if g.ack:
                delivered += self.emit_acked(g, buf, start, end)
            elif g.key_shared:
                if g.settling and seqs.last_ts >= g.next_balance:
                    self.rebalance(g)
                owners = g.owners
                counts = g.counts
                pos = start
                run_m: Member | None = None
                run_start = run_n = 0
                while pos < end:
                    vb = _vbucket(buf, pos + VBUCKET_AT)[0]
                    counts[vb] += 1
                    m = owners[vb] or g.claim(vb)
                    if m is not run_m:
                        if run_m is not None:
                            delivered += self.queue_to(run_m, buf, run_start, pos, run_n, 1)
                        run_m = m
                        run_start = pos
                        run_n = 0
                    run_n += 1
                    pos += 4 + _u32(buf, pos)[0]
                if run_m is not None:
                    delivered += self.queue_to(run_m, buf, run_start, end, run_n, 1)
            else:
                pos = start
                while pos < end:
                    stop = pos
                    n = 0
                    while stop < end and n < GROUP_CHUNK:
                        stop += 4 + _u32(buf, stop)[0]
                        n += 1
                    m = g.pick(seqs.last_ts)
                    assert m is not None  # without acks nobody is at a bound
                    delivered += self.queue_to(m, buf, pos, stop, n, 1)
                    pos = stop
        return delivered

    def queue_to(self, m: Member, buf: bytes | bytearray, start: int, end: int, n: int, attempt: int) -> int:
        """Queue n messages buf[start:end] to member m behind a Delivery frame; the number queued
        (0: its connection is over its pending bound: they are dropped as to a slow consumer)."""
        t = m.conn
        if t.state != OPEN:
            return 0
        core = self.core
        header = m.header if n == 1 and attempt == 1 else encode_delivery(Delivery(m.sid, n, attempt))
        size = end - start + len(header)
        if t.base + t.unflushed + size > t.cap:
            t.base = t.transport.get_write_buffer_size()
            if t.base + t.unflushed + size > t.cap and not (t.cap < 0 and core.reopen(t, size)):
                if m.group.ack:  # not lost: in flight all the same, delivered again at its deadline
                    core.stats.group_deferred += n
                    return 0
                t.dropped += n
                t.dropped_total += n
                t.group_untold += n  # a member's: no replay gives them back (broky.server.shard.arrivals)
                t.cap = -1  # nothing more until it is told (broky.server.shard.core `Shard.reopen`)
                core.stats.dropped[DropReason.SLOW_CONSUMER] += n
                if not t.over_since:
                    t.over_since = _monotonic()
                if not t.touched:
                    t.touched = True
                    core.touched.append(t)
                return 0
        t.out.append(header)
        t.out.append(buf[start:end] if start or end != len(buf) else buf)
        t.unflushed += size
        if not t.touched:
            t.touched = True
            core.touched.append(t)
        t.msgs_out += n
        t.group_out += n
        m.delivered += n
        mark = core.seqs.last_ts  # the read's clock: the same for every message of one read
        if m.mark != mark:
            m.mark = mark
            m.recent = size
        else:
            m.recent += size
        core.stats.group_delivered += n
        return n

    def emit_acked(self, g: Group, buf: bytearray, start: int, end: int) -> int:
        """An ack group: each message is kept until acknowledged (a copy from its delivery;
        a position while it waits, with a replay buffer)."""
        core = self.core
        now = core.loop.time()
        limit = int(core.budget.share * KEPT_SHARE)
        bound = core.config.group_backlog_bytes
        replay = core.replay
        counts = g.counts if g.key_shared else None
        if counts is not None and core.seqs.last_ts >= g.next_balance:
            self.rebalance(g)
        delivered = 0
        pos = start
        pending = g.pending
        m: Member | None = None
        while pos < end:
            stop = pos + 4 + _u32(buf, pos)[0]
            epoch, offset, vb = _position(buf, pos)
            if counts is not None:
                counts[vb] += 1
            if replay is not None:
                b, m = self.where(g, vb, stop - pos)
                if b is not None:  # it waits, as its position
                    if g.backlog_bytes + b.cost(vb, epoch, offset) > bound:
                        self.overflow(g, None)
                    else:
                        g.backlog_bytes += b.add_position(vb, epoch, offset)
                    pos = stop
                    continue
            frame = bytes(buf[pos:stop])
            key = (vb, epoch, offset)
            e = pending[key] = Pending(frame, key)  # the group keeps it from now on, until settled
            h = Held(frame, vb, e)
            self.kept += stop - pos
            if self.kept > limit:
                self.overflow(g, h)
            elif replay is not None:
                assert m is not None
                delivered += self.send(g, m, h, now)
            else:
                delivered += self.place(g, h, now)
            pos = stop
        self.owe(g)
        return delivered

    def where(self, g: Group, vb: int, size: int) -> tuple[Backlog | None, Member | None]:
        """Where a new message of vb goes: (None, the member to send it to now), or (the
        backlog it waits in, None)."""
        if g.key_shared:
            d = g.draining.get(vb)
            if d is not None:
                return d.held, None
            m: Member | None = g.owners[vb] or g.claim(vb)
            assert m is not None
            if m.paused or m.backlog or not self.has_room(m, size):
                return m.backlog, None
            return None, m
        m = g.pick(self.core.seqs.last_ts, size)
        if m is None:
            return g.backlog, None
        return None, m

    def place_item(self, g: Group, item: Held | Run, now: float) -> None:
        """An item of a backlog goes where its messages go now (a member's departure, the end
        of a drain, a member that joins); a Run whole, into the backlog its vbucket's
        messages wait in, served from there at once if its member has room."""
        if type(item) is Held:
            self.place(g, item, now)
            return
        assert type(item) is Run
        if not g.members:
            g.backlog_bytes += g.backlog.append(item)
            return
        if g.key_shared:
            d = g.draining.get(item.vb)
            if d is not None:
                g.backlog_bytes += d.held.append(item)
                return
            m = g.owners[item.vb] or g.claim(item.vb)
            g.backlog_bytes += m.backlog.append(item)
            self.room_for(g, m, now)
            return
        g.backlog_bytes += g.backlog.append(item)
        self.room_for(g, None, now)

    def place(self, g: Group, h: Held, now: float) -> int:
        """Deliver h to the member it goes to, or hold it (a drain, a backlog); 1 if delivered."""
        if not g.members:  # kept for a member that comes back (give_back)
            g.backlog_bytes += g.backlog.append(h)
            return 0
        if g.key_shared:
            d = g.draining.get(h.vb)
            if d is not None:
                if g.backlog_bytes + len(h.frame) > self.core.config.group_backlog_bytes:
                    self.overflow(g, h)
                    return 0
                g.backlog_bytes += d.held.append(h)
                return 0
            m: Member | None = g.owners[h.vb] or g.claim(h.vb)
            assert m is not None
            if m.paused or m.backlog or not self.has_room(m, len(h.frame)):
                return self.hold(g, m.backlog, h)
        else:
            m = g.pick(self.core.seqs.last_ts, len(h.frame))
            if m is None:
                return self.hold(g, g.backlog, h)
        return self.send(g, m, h, now)

    def has_room(self, m: Member, size: int) -> bool:
        """m's connection can take `size` more bytes within its pending bound (never while
        it lags: broky.server.shard.lag serves it from the replay buffer then)."""
        t = m.conn
        if t.lag is not None:
            return False
        if t.base + t.unflushed + size <= t.cap:
            return True
        t.base = t.transport.get_write_buffer_size()
        return t.base + t.unflushed + size <= t.cap

    def hold(self, g: Group, b: Backlog, h: Held) -> int:
        """Every member (or h's member) is at its bound: h waits in b, within
        --group-backlog-bytes (the group's bound counts every backlog of the group)."""
        if g.backlog_bytes + len(h.frame) > self.core.config.group_backlog_bytes:
            self.overflow(g, h)
            return 0
        g.backlog_bytes += b.append(h)
        return 0

    def overflow(self, g: Group, h: Held | None) -> None:
        """A message finds the group's backlog full (h: its copy; None: a position), or the
        ack groups' share of the memory budget: dropped, counted, told once (to the teller)."""
        if h is not None:
            if h.entry is not None:
                g.pending.pop(h.entry.key, None)
            self.kept -= len(h.frame)
        self.core.stats.dropped[DropReason.GROUP_OVERFLOW] += 1
        self.tell_lost(g, LossReason.GROUP_OVERFLOW, None)

    def front(self, g: Group, b: Backlog, m: Member | None) -> Held | None:
        """The first message that b holds (None: nothing), left in b. A Run's first position
        is read from the replay buffer: a Held with a copy of its frame and no entry yet
        (`take` makes it Pending). Positions the buffer evicted first (or whose epoch ended
        here) are taken out on the way, counted and told (EVICTED, to m)."""
        replay = self.core.replay
        while b.items:
            item = b.items[0]
            if type(item) is Held:
                return item
            assert type(item) is Run
            vb, first = item.vb, item.first
            if replay is not None and self.core.seqs.epoch_of(vb) == item.epoch:
                got = replay.read(vb, first, first + 1)
                if got:
                    segment, a, z = got[0]
                    return Held(bytes(memoryview(segment)[a:z]), vb)
                base = replay.first(vb)
                gone = item.last if base is None else min(item.last, base - 1)
            else:
                gone = item.last
            n = gone - first + 1
            if n <= 0:  # (never: a position is recorded before its message is emitted)
                log.error("group %s: position %s/%s not in the replay buffer", g.name, vb, first)
                n, gone = 1, first
            g.backlog_bytes -= b.advance(n)
            self.core.stats.group_evicted += n
            at = Position(vb, item.epoch, first)
            self.tell_lost(g, LossReason.EVICTED, m, at, n, Position(vb, item.epoch, gone))
        return None

    def take(self, g: Group, b: Backlog, h: Held) -> Held | None:
        """Take h, b's first message (`front`), out of b to send it; None: it cannot be
        kept (the ack groups' share of the memory budget is full: dropped and told)."""
        if h.entry is not None:
            g.backlog_bytes -= b.popleft()
            return h
        r = b.items[0]
        assert type(r) is Run
        key = (r.vb, r.epoch, r.first)
        g.backlog_bytes -= b.advance(1)
        self.kept += len(h.frame)
        if self.kept > int(self.core.budget.share * KEPT_SHARE):
            self.overflow(g, h)
            return None
        h.entry = g.pending[key] = Pending(h.frame, key)
        return h

    def send(self, g: Group, m: Member, h: Held, now: float) -> int:
        """Deliver h to m and keep it pending (ack); 1 if queued."""
        frame = h.frame
        e = h.entry
        assert e is not None  # (every message of an ack group is Pending from its arrival)
        if g.pending.get(e.key) is not e:
            return 0  # settled while it waited (acknowledged by a position before its delivery)
        e.attempt += 1
        e.member = m
        e.gen += 1
        e.deadline = now + g.ack_wait
        self.push(e.deadline, (g, e.key, e.gen))
        self.arm(e.deadline)
        m.in_flight[e.key] = None
        m.in_flight_bytes += len(frame)
        if g.key_shared:
            vb = e.key[0]
            m.vb_count[vb] = m.vb_count.get(vb, 0) + 1
        if e.attempt > 1:
            self.core.stats.redelivered += 1
        queued = self.queue_to(m, frame, 0, len(frame), 1, e.attempt)
        if not m.paused and m.full():
            m.paused = True
            self.core.stats.group_paused += 1
            self.core.reply(m.conn, encode_frame(GroupNotice(m.sid, GroupEvent.PAUSED, len(m.in_flight))))
        return queued

    # ------------------------------------------------------------ acknowledgements

    def ack(self, c: Connection, sid: int, kind: int, keys: list[Key], delay_ms: int) -> None:
        """An Ack frame of c (schema/README.md 5.4)."""
        s = c.subs.get(sid)
        m = s.member if s is not None else None
        if m is None or not m.group.ack:
            self.core.error(c, ErrorCode.UNKNOWN_SID, f"no ack subscription with sid {sid}", sid)
            return
        g = m.group
        if kind not in (AckKind.ACK, AckKind.NACK, AckKind.IN_PROGRESS):
            self.core.stats.acks_unknown += len(keys)  # a kind of a later version: ignored
            return
        now = self.core.loop.time()
        stats = self.core.stats
        touched: set[Member] = set()
        for key in keys:
            e = g.pending.get(key)
            if e is None or not e.attempt:  # (not delivered yet: no member can be settling it)
                stats.acks_unknown += 1
                continue
            if kind == AckKind.IN_PROGRESS:
                if e.member is not None:
                    e.gen += 1
                    e.deadline = now + g.ack_wait
                    self.push(e.deadline, (g, key, e.gen))
                    self.arm(e.deadline)
                stats.acks_in_progress += 1
                continue
            holder = e.member
            if holder is not None:
                self.release(g, holder, e)
                touched.add(holder)
            if kind == AckKind.ACK:
                stats.acks += 1
                del g.pending[key]
                self.kept -= len(e.frame)
            else:
                stats.nacks += 1
                if e.attempt >= g.max_deliveries:
                    self.dead(g, e, holder)
                    continue
                delay = delay_ms / 1000 if delay_ms >= 0 else g.backoff[min(e.attempt, len(g.backoff)) - 1]
                e.member = None
                if delay <= 0:  # again at once, in this read
                    self.redeliver(g, e, now)
                    continue
                e.gen += 1
                e.deadline = now + delay
                self.push(e.deadline, (g, key, e.gen))
                self.arm(e.deadline)
        for holder in touched:
            self.room(g, holder, now)
        self.owe(g)

    def owe(self, g: Group) -> None:
        """Count what g keeps for nobody on its teller's account (see the header): the
        connection of its first member, else that of its last one."""
        if not g.ack:
            return
        teller = g.members[0].conn if g.members else g.teller
        owed = g.keeps_for_nobody() if g.members else len(g.pending) + g.backlog.positions
        old = g.teller
        if teller is not old:
            if old is not None and g.owed:
                old.worker_owed -= g.owed
                self.amend_account(old)
            g.teller = teller
            g.owed = 0
        if teller is not None and owed != g.owed:
            teller.worker_owed += owed - g.owed
            g.owed = owed
            self.amend_account(teller)

    def tell_lost(
        self,
        g: Group,
        reason: int,
        member: Member | None,
        at: Position | None = None,
        count: int = 1,
        through: Position | None = None,
    ) -> None:
        """`count` messages of g are lost for good: told once, to `member` (the one it was
        last delivered to), else to g's first member, else on its teller's account (told to
        its client when it claims it: broky.server.shard.arrivals)."""
        told = member if member is not None and member in g.members else None
        if told is None and g.members:
            told = g.members[0]
        if told is not None:
            self.core.reply(told.conn, encode_frame(LossNotice(count, reason, told.sid, at, through)))
            return
        t = g.teller
        if t is not None:
            t.group_lost += count
            self.amend_account(t)

    def amend_account(self, c: Connection) -> None:
        """c's account changed outside a read's deliveries: committed with the next flush
        (an open connection), or now (a closed one's, kept for its client)."""
        if c.slot >= 0:
            if not c.touched:
                c.touched = True
                self.core.touched.append(c)
        else:
            self.core.book.amend(c)

    def release(self, g: Group, m: Member, e: Pending) -> None:
        """e is no longer m's (settled, expired or NACKed)."""
        if e.key in m.in_flight:
            del m.in_flight[e.key]
            m.in_flight_bytes -= len(e.frame)
        if g.key_shared:
            vb = e.key[0]
            left = m.vb_count.get(vb, 0) - 1
            if left > 0:
                m.vb_count[vb] = left
            else:
                m.vb_count.pop(vb, None)
                d = g.draining.get(vb)
                if d is not None and d.old is m:
                    self.end_drain(g, vb, expired=False)

    def room(self, g: Group, m: Member, now: float) -> None:
        """m may have room again: RESUMED, then what waits for it."""
        self.room_for(g, m, now)
        self.owe(g)

    def drained(self, c: Connection) -> None:
        """c's write buffer drained (`Shard.drained`): its ack members' messages may have
        room now."""
        now = self.core.loop.time()
        for s in c.subs.values():
            m = s.member
            if m is not None and m.group.ack:
                self.room(m.group, m, now)

    def room_for(self, g: Group, m: Member | None, now: float) -> None:
        if m is not None and m.paused and not m.full() and m in g.members:
            m.paused = False
            self.core.reply(m.conn, encode_frame(GroupNotice(m.sid, GroupEvent.RESUMED, len(m.in_flight))))
        if g.key_shared:
            assert m is not None
            while not m.paused:
                h = self.front(g, m.backlog, m)
                if h is None or not self.has_room(m, len(h.frame)):
                    break
                taken = self.take(g, m.backlog, h)
                if taken is not None:
                    self.send(g, m, taken, now)
        else:
            while True:
                h = self.front(g, g.backlog, None)
                if h is None:
                    break
                target = g.pick(self.core.seqs.last_ts, len(h.frame))
                if target is None:
                    break
                taken = self.take(g, g.backlog, h)
                if taken is not None:
                    self.send(g, target, taken, now)

    def end_drain(self, g: Group, vb: int, expired: bool) -> None:
        """The vbucket's move is done (or its deadline passed): its held messages go on."""
        d = g.draining.pop(vb, None)
        if d is None:
            return
        now = self.core.loop.time()
        new = g.owners[vb] or g.claim(vb)
        if expired:
            left = d.old.vb_count.get(vb, 0)
            self.core.stats.group_drain_expired += 1
            self.core.reply(new.conn, encode_frame(GroupNotice(new.sid, GroupEvent.DRAIN_EXPIRED, left, vb)))
        g.backlog_bytes -= d.held.bytes
        for item in d.held.take_all():
            self.place_item(g, item, now)

    def redeliver(self, g: Group, e: Pending, now: float) -> None:
        """e goes out again (after a NACK's delay, an expiry, or its member's departure)."""
        if e.attempt >= g.max_deliveries:
            self.dead(g, e, None)
            return
        vb = e.key[0]
        h = Held(e.frame, vb, e)
        if not g.members:
            self.place(g, h, now)
            return
        if g.key_shared:
            m = g.owners[vb] or g.claim(vb)
            d = g.draining.get(vb)
            if d is not None:
                g.backlog_bytes += d.held.appendleft(h)  # older than what the drain holds
                return
            if m.paused or not self.has_room(m, len(h.frame)):
                g.backlog_bytes += m.backlog.appendleft(h)
                return
            self.send(g, m, h, now)
            return
        target = g.pick(self.core.seqs.last_ts, len(h.frame))
        if target is None:
            g.backlog_bytes += g.backlog.appendleft(h)
            return
        self.send(g, target, h, now)

    def dead(self, g: Group, e: Pending, last: Member | None) -> None:
        """e was delivered max_deliveries times: dropped, counted, told, dead-lettered."""
        g.pending.pop(e.key, None)
        self.kept -= len(e.frame)
        self.core.stats.dropped[DropReason.MAX_DELIVERIES] += 1
        vb, epoch, offset = e.key
        self.tell_lost(g, LossReason.MAX_DELIVERIES, last, Position(vb, epoch, offset))
        if g.dead_letter is not None:
            self.publish_dead_letter(g, e.frame)

    def publish_dead_letter(self, g: Group, frame: bytes) -> None:
        """Publish a dead message again to the group's dead_letter key: same key_partition
        and payload (so the same vbucket, owned here), a new offset, delivered like any publish."""
        msg = decode_message(frame)
        assert g.dead_letter is not None
        out = bytearray(
            encode_message(msg.key_partition, g.dead_letter, msg.payload, msg.ts_producer, 0, msg.uid)
        )
        kp, key, ts_at = route_message(bytes(out), 0, len(out))
        route = self.core.route((kp, key), kp, key)
        if route is None or route[1] < 0 or ts_at is None:
            self.core.stats.dead_letters_refused += 1  # the vbucket is leaving this worker
            return
        targets, vb = route
        t0 = max(time.time_ns(), self.core.seqs.last_ts)  # ts_broker never decreases
        self.core.seqs.last_ts = t0
        offset = self.core.seqs.take(vb, t0)
        pack_stamp_into(out, ts_at, t0, self.core.seqs.epoch_of(vb), offset, vb)
        replay = self.core.replay
        if replay is not None:
            replay.record(vb, replay.retain(out, t0), 0)
        self.core.stats.dead_lettered += 1
        self.core.stats.messages_published += 1
        if targets:
            self.core.stats.messages_delivered += self.core.emit(out, targets, 0, len(out), 1)
        else:
            self.core.stats.dropped[DropReason.NO_SUBSCRIBERS] += 1

    # ------------------------------------------------------------ the clock

    def arm(self, deadline: float) -> None:
        """Have `expire` run by `deadline`."""
        if self.timer is not None and self.timer_at <= deadline:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.core.loop.call_at(deadline, self.expire)
        self.timer_at = deadline

    def expire(self) -> None:
        """Deadlines passed: redeliver what was not acknowledged in time, end drains."""
        self.timer = None
        heap = self.heap
        now = self.core.loop.time()
        changed: dict[Group, None] = {}
        while heap and heap[0][0] <= now:
            _, _, (g, what, gen) = heapq.heappop(heap)
            changed[g] = None
            if isinstance(what, int):  # a drain's deadline
                d = g.draining.get(what)
                if d is not None and d.gen == gen:
                    self.end_drain(g, what, expired=True)
                continue
            if what == ORPHAN:
                if gen == g.orphan_gen:
                    self.orphan_expired(g)
                continue
            e = g.pending.get(what)
            if e is None or e.gen != gen:
                continue  # settled, or its deadline moved
            holder = e.member
            if holder is not None:  # no answer within ack_wait
                self.core.stats.ack_expired += 1
                self.release(g, holder, e)
                e.member = None
                self.redeliver(g, e, now)
                self.room(g, holder, now)
            else:  # a NACK's delay passed
                self.redeliver(g, e, now)
        for g in changed:
            self.owe(g)
        if heap:
            self.arm(heap[0][0])
        if self.core.touched:
            self.core.flush()

    def flush_soon(self) -> None:
        """Writes queued outside a read (a member's departure) go out on the next turn."""
        if self.core.touched:
            self.core.loop.call_soon(self.flush_if_touched)

    def flush_if_touched(self) -> None:
        if self.core.touched:
            self.core.flush()

    def snapshot(self) -> dict[str, Any]:
        """/stats: every group of this worker."""
        out = []
        for g in self.groups.values():
            out.append(
                {
                    "group": g.name,
                    "pattern": g.pattern.decode(errors="replace"),
                    "key_shared": g.key_shared,
                    "ack": g.ack,
                    "members": [
                        {
                            "conn": m.conn.conn_id,
                            "sid": m.sid,
                            "delivered": m.delivered,
                            "in_flight": len(m.in_flight),
                            "paused": m.paused,
                        }
                        for m in g.members
                    ],
                    "pending": len(g.pending),
                    "backlog_bytes": g.backlog_bytes,
                    "backlog_positions": g.positions(),
                    "draining": len(g.draining),
                }
            )
        return {
            "groups_detail": out,
            "in_flight": sum(len(g.pending) for g in self.groups.values()),
            "group_kept_bytes": self.kept,
        }
