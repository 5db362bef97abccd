"""Per-connection accounts that outlive the worker process keeping them.

Theory of operation
-------------------
A client that loses a connection to a worker (the network, or the worker
itself died) reconnects and names the lost connection in Hello.previous. To
answer it exactly, someone must still know, for that connection:

  processed  Message frames it published that the worker processed (routed,
             or dropped and counted): the first `processed` publishes sent on
             the connection; the client resends the ones after (Welcome.resumed);
  delivered  deliveries the worker queued to it; minus what the client says it
             received, that is what it lost (a LossNotice on the new connection);
  dropped    deliveries the worker dropped for it (slow consumer); minus the
             LossNotice counts the client says it was told, that is what it was
             never told;
  refused    of the processed publishes, those refused with NOT_MY_VBUCKET or
             PERMISSION_DENIED (Welcome.resumed.refused): an Error carried each
             back, so a client that received fewer of them lost the others with
             the connection.
  cut        the worker closed it to stay within its memory budget
             (broky.server.shard.budget): what it lost with the connection
             is then told as SLOW_CONSUMER, not CONNECTION_LOST.
  owed       messages the consumer groups of this worker keep for nobody yet
             (a backlog, a vbucket that drains, a redelivery that waits) and
             whose loss this connection is to be told of if the worker dies
             (it carries the groups' teller, broky.server.shard.groups): told as
             WORKER_RESTART to a claim of a dead worker's account, and nothing
             to a live worker's (the group still has them); it also holds what
             the connection is owed while it lags (broky.server.shard.lag: kept
             for it in the replay buffer, not sent yet), which a live worker
             moves into `dropped` when the connection ends;
  group_lost messages its groups lost for good while it carried their teller
             (kept for a member that did not come back within ack_wait, or
             delivered max_deliveries times with no member left to tell):
             told as CONNECTION_LOST to any claim.

A worker keeps these counters per connection anyway (`msgs_in`, `msgs_out`,
`dropped_total`, `refused` of broky.server.shard.connection). To survive the
worker, it mirrors them into an `AccountBook`: a shared-memory table (a
memfd the master creates, maps and passes to the worker at spawn) of one slot
per connection. Only the worker writes it and only the master reads it, and
only once the worker is dead (`read_accounts`): this is a flight recorder, not
shared state, and nothing on the data path crosses processes through it.

Crash consistency. A worker may die between any two instructions, so the
table must always hold the counters as of the end of some whole read: a read
that was processed must count its publishes as processed *and* its deliveries
as delivered, or neither (else the client would resend a delivered message or
never hear of a lost one). Each slot therefore holds two versions of its
counters, each stamped with a sequence number; the header holds the last
committed sequence number. `commit` writes the new counters of every
connection a read changed into the version of its slot that does not hold
its latest state, then stores the new sequence number in the header (one
aligned 8-byte store: the commit point). A reader takes, per slot, the
version with the highest sequence number not above the committed one. The
worker commits after routing a read and before writing anything to a socket
(broky.server.shard.core `Shard.feed`), so whatever a client could have received
is already accounted.

Claims. An account is a capability: only the client that made the connection
may claim it. Every connection has a secret of RESUME_TOKEN_BYTES random bytes
(its Welcome.resume_token, sent to that client alone), kept in its slot;
a claim (Hello.previous) must carry it, and it is compared in constant time
(`same_secret`). A claim without the right secret is refused as unknown and
leaves the account where it was, for its owner. The secret is never logged
and never listed (broky.server.http.monitor lists connection ids, which alone
claim nothing).

Lifetime. A slot is taken when a connection opens and kept ACCOUNT_TTL seconds
after it closes, for a reconnecting client (`claim` gives it away once). The
oldest closed slot is recycled when none is free; a connection that finds no
slot at all has no account (it is served, but cannot be resumed: counted).
When a worker dies, the master reads every slot (`read_accounts`) and keeps the
accounts (`DeadAccounts`) for ACCOUNT_TTL seconds; the hand-off of a resuming
client carries its account to the new worker (broky.server.handoff).

Connection ids are `epoch << 32 | n`: the master gives every worker process a
random 32-bit epoch, so an id names one connection of one worker incarnation
and the master knows who holds its account (the live worker of that epoch, or
the dead accounts).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from _operator import _compare_digest  # hmac.compare_digest without hmac's OpenSSL (0.7 MB)
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from broky.protocol import RESUME_TOKEN_BYTES

ACCOUNT_TTL = 60.0  # seconds an account is kept after its connection closed (or its worker died)
SLOTS = 65536  # connections with an account per worker (open, or closed within ACCOUNT_TTL)

_MAGIC = 0x42524B5941434356  # "BRKYACCV": this layout (a worker of another layout reads as empty)
_HEADER = struct.Struct("<QQQQ")  # magic, committed sequence number, slots, slots ever used
_COMMITTED = 1  # word index of the committed sequence number
_HIGH_WATER = 3  # word index of the number of slots ever used
HEADER_BYTES = 64
# A slot: conn_id, state, subs, flags, the connection's secret (2 words), then two
# versions of its counters, each seq, processed, delivered, dropped, refused, owed,
# group_lost, spare.
_SLOT_HEAD = 6  # words before version A
_VERSION_WORDS = 8
VERSION_BYTES = 8 * _VERSION_WORDS
SLOT_BYTES = 8 * (_SLOT_HEAD + 2 * _VERSION_WORDS)  # 176
_VERSION = struct.Struct("<QQQQQQQ")  # seq, processed, delivered, dropped, refused, owed, group_lost
_SLOT = struct.Struct("<" + "Q" * (_SLOT_HEAD + 2 * _VERSION_WORDS))
# conn_id, processed, delivered, dropped, refused, flags, owed, group_lost
_ACCOUNT = struct.Struct("<QQQQQQQQ")
_FLAGS = 3  # word index, in a slot, of its flags
FREE, OPEN, CLOSED = 0, 1, 2
CUT = 1  # flag: the worker cut the connection (memory budget)


def same_secret(given: bytes | None, kept: bytes) -> bool:
    """Whether a claimed secret is the one kept, compared in constant time."""
    return given is not None and len(kept) == RESUME_TOKEN_BYTES and _compare_digest(bytes(given), kept)


def table_bytes(slots: int = SLOTS) -> int:
    return HEADER_BYTES + slots * SLOT_BYTES


class Account(NamedTuple):
    """What a worker knew of one connection when it last committed."""

    conn_id: int
    processed: int
    delivered: int
    dropped: int
    subscriptions: int = 0
    open: bool = False  # the connection was still open (the worker died under it)
    refused: int = 0  # processed publishes refused with NOT_MY_VBUCKET
    # The connection's secret. In a hand-off only for a TLS client: the master checks a plain
    # client's claim, but a TLS client's secret is inside TLS, so its worker checks it.
    token: bytes = b""
    cut: bool = False  # the worker cut it to stay within its memory budget
    owed: int = 0  # its groups' messages kept for nobody yet (told if the worker died)
    group_lost: int = 0  # its groups' messages lost for good (told to any claim)

    def pack(self, secret: bool = False) -> bytes:
        """The 64 bytes a hand-off carries (broky.server.handoff); `secret`: then the token."""
        flags = CUT if self.cut else 0
        packed = _ACCOUNT.pack(
            self.conn_id, self.processed, self.delivered, self.dropped, self.refused, flags,
            self.owed, self.group_lost,
        )  # fmt: skip
        return packed + self.token if secret else packed

    @classmethod
    def unpack(cls, data: bytes) -> Account:
        conn_id, processed, delivered, dropped, refused, flags, owed, group_lost = _ACCOUNT.unpack_from(data)
        token = bytes(data[_ACCOUNT.size :])
        return cls(
            conn_id, processed, delivered, dropped, refused=refused, token=token, cut=bool(flags & CUT),
            owed=owed, group_lost=group_lost,
        )  # fmt: skip


class Accounted(Protocol):
    """What the book needs of a connection (broky.server.shard.connection.Connection)."""

    conn_id: int
    msgs_in: int
    msgs_out: int
    dropped_total: int
    refused: int
    worker_owed: int  # kept by its worker, not sent: its groups' backlog, its lag (the owed word)
    group_lost: int  # its groups' messages lost for good while it carried their teller
    token: bytes  # its secret, RESUME_TOKEN_BYTES random bytes (Welcome.resume_token)
    slot: int  # byte offset of its slot's first version, or -1: no account
    acct_ver: int  # 0 or 1: the version holding its latest committed counters


def new_table(slots: int = SLOTS) -> tuple[int, mmap.mmap]:
    """Create the shared table of one worker: (memfd to pass to it, the master's mapping)."""
    fd = os.memfd_create("broky-accounts", os.MFD_CLOEXEC)
    size = table_bytes(slots)
    os.ftruncate(fd, size)
    table = mmap.mmap(fd, size)
    _HEADER.pack_into(table, 0, _MAGIC, 0, slots, 0)
    return fd, table


def _latest(words: memoryview, slot: int, committed: int) -> tuple[int, int, int, int, int, int]:
    """(processed, delivered, dropped, refused, owed, group_lost) of the slot's newest
    committed version."""
    base = (HEADER_BYTES + slot * SLOT_BYTES) // 8
    a, b = base + _SLOT_HEAD, base + _SLOT_HEAD + _VERSION_WORDS
    seq_a, seq_b = words[a], words[b]
    a_ok, b_ok = seq_a <= committed, seq_b <= committed
    at = a if a_ok and (not b_ok or seq_a >= seq_b) else b
    if not (a_ok or b_ok):  # pragma: no cover - the initial version has seq 0
        return 0, 0, 0, 0, 0, 0
    return words[at + 1], words[at + 2], words[at + 3], words[at + 4], words[at + 5], words[at + 6]


def _secret(words: memoryview, slot: int) -> bytes:
    base = (HEADER_BYTES + slot * SLOT_BYTES) // 8
    return words[base + 4 : base + 6].tobytes()


def read_accounts(table: mmap.mmap | bytearray) -> list[Account]:
    """Every account in a dead worker's table (master side), as of its last commit."""
    words = memoryview(table).cast("Q")
    try:
        if words[0] != _MAGIC:
            return []
        committed = words[_COMMITTED]
        used = min(words[_HIGH_WATER], words[2])
        out = []
        for slot in range(used):
            base = (HEADER_BYTES + slot * SLOT_BYTES) // 8
            state = words[base + 1]
            if state == FREE:
                continue
            processed, delivered, dropped, refused, owed, group_lost = _latest(words, slot, committed)
            out.append(
                Account(
                    words[base],
                    processed,
                    delivered,
                    dropped,
                    words[base + 2],
                    state == OPEN,
                    refused,
                    _secret(words, slot),
                    bool(words[base + _FLAGS] & CUT),
                    owed,
                    group_lost,
                )
            )
        return out
    finally:
        words.release()


class AccountBook:
    """The worker's side of its table: slots for its connections, and `commit`."""

    def __init__(self, table: mmap.mmap | bytearray) -> None:
        self.table = table
        self.words = memoryview(table).cast("Q")
        self.slots = self.words[2] if self.words[0] == _MAGIC else len(table) // SLOT_BYTES - 1
        self.words[0] = _MAGIC
        self.words[2] = self.slots
        self.seq = self.words[_COMMITTED]
        self.used = 0  # slots ever handed out (they are recycled LIFO, so this stays low)
        self.free: list[int] = []
        self.closed: dict[int, tuple[int, float]] = {}  # conn_id -> (slot, closed at), oldest first
        self.unavailable = 0  # connections that found no slot
        self.claims_refused = 0  # claims of a closed account without its secret

    @classmethod
    def from_fd(cls, fd: int) -> AccountBook:
        size = os.fstat(fd).st_size
        table = mmap.mmap(fd, size)
        os.close(fd)
        return cls(table)

    @classmethod
    def in_memory(cls, slots: int = 1024) -> AccountBook:
        """A book nobody reads after a crash (tests, benchmarks)."""
        table = bytearray(table_bytes(slots))
        _HEADER.pack_into(table, 0, _MAGIC, 0, slots, 0)
        return cls(table)

    # ------------------------------------------------------------ slots

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.used < self.slots:
            self.used += 1
            self.words[_HIGH_WATER] = self.used
            return self.used - 1
        if self.closed:  # recycle the oldest closed account
            conn_id = next(iter(self.closed))
            slot, _ = self.closed.pop(conn_id)
            self._clear(slot)
            return slot
        return -1

    def _clear(self, slot: int) -> None:
        base = (HEADER_BYTES + slot * SLOT_BYTES) // 8
        self.words[base] = 0  # first: a half-cleared slot must not name its old connection
        self.words[base + 1] = FREE
        self.words[base + _FLAGS] = 0
        self.words[base + 4] = self.words[base + 5] = 0  # and keeps no secret

    def open(self, c: Accounted) -> None:
        """Give a new connection a slot (counters at zero), or none (c.slot = -1)."""
        slot = self._take()
        if slot < 0:
            self.unavailable += 1
            c.slot = -1
            return
        base = HEADER_BYTES + slot * SLOT_BYTES
        # Zero both versions before naming the connection: a crash in between leaves
        # a slot that names nobody, never one that gives a new id old counters.
        _SLOT.pack_into(self.table, base, *(0 for _ in range(_SLOT_HEAD + 2 * _VERSION_WORDS)))
        self.table[base + 32 : base + 48] = c.token
        self.words[base // 8] = c.conn_id
        self.words[base // 8 + 1] = OPEN
        c.slot = base + 8 * _SLOT_HEAD
        c.acct_ver = 0

    def mark_cut(self, c: Accounted) -> None:
        """The worker cuts c (memory budget): its account will say so."""
        if c.slot >= 0:
            self.words[c.slot // 8 - _SLOT_HEAD + _FLAGS] |= CUT

    def set_subscriptions(self, c: Accounted, count: int) -> None:
        if c.slot >= 0:
            self.words[c.slot // 8 - _SLOT_HEAD + 2] = count

    def commit(self, conns: Iterable[Accounted]) -> None:
        """Record the counters of every connection a read changed, atomically."""
        self.seq = seq = self.seq + 1
        pack = _VERSION.pack_into
        table = self.table
        for c in conns:
            at = c.slot
            if at >= 0:
                v = c.acct_ver ^ 1
                pack(
                    table, at + v * VERSION_BYTES, seq, c.msgs_in, c.msgs_out, c.dropped_total, c.refused,
                    c.worker_owed, c.group_lost,
                )  # fmt: skip
                c.acct_ver = v
        self.words[_COMMITTED] = seq  # the commit point

    def commit_read(self, c: Accounted, touched: Iterable[Accounted]) -> None:
        """`commit` of the connection that was read and of those the read touched
        (the hot path's form: no tuple built per read)."""
        self.seq = seq = self.seq + 1
        pack = _VERSION.pack_into
        table = self.table
        at = c.slot
        if at >= 0:
            v = c.acct_ver ^ 1
            pack(
                table, at + v * VERSION_BYTES, seq, c.msgs_in, c.msgs_out, c.dropped_total, c.refused,
                c.worker_owed, c.group_lost,
            )  # fmt: skip
            c.acct_ver = v
        for t in touched:
            at = t.slot
            if at >= 0 and t is not c:
                v = t.acct_ver ^ 1
                pack(
                    table, at + v * VERSION_BYTES, seq, t.msgs_in, t.msgs_out, t.dropped_total, t.refused,
                    t.worker_owed, t.group_lost,
                )  # fmt: skip
                t.acct_ver = v
        self.words[_COMMITTED] = seq  # the commit point

    def amend(self, c: Accounted) -> None:
        """A closed connection's groups changed what its account owes (its `worker_owed`,
        `group_lost`; broky.server.shard.groups): a new version of its kept account, if it is
        still kept."""
        entry = self.closed.get(c.conn_id)
        if entry is None:
            return
        slot = entry[0]
        processed, delivered, dropped, refused, _, _ = _latest(self.words, slot, self.seq)
        base = HEADER_BYTES + slot * SLOT_BYTES + 8 * _SLOT_HEAD
        a, b = self.words[base // 8], self.words[base // 8 + _VERSION_WORDS]
        older = base if a <= b else base + VERSION_BYTES  # the version not holding the latest
        self.seq = seq = self.seq + 1
        _VERSION.pack_into(
            self.table, older, seq, processed, delivered, dropped, refused, c.worker_owed, c.group_lost
        )
        self.words[_COMMITTED] = seq

    def close(self, c: Accounted) -> None:
        """The connection closed: keep its (committed) account for a reconnecting client."""
        if c.slot < 0:
            return
        self.commit((c,))
        base = c.slot - 8 * _SLOT_HEAD
        slot = (base - HEADER_BYTES) // SLOT_BYTES
        self.words[base // 8 + 1] = CLOSED
        self.closed[c.conn_id] = (slot, time.monotonic())
        c.slot = -1

    def claim(self, conn_id: int, secret: bytes | None) -> Account | None:
        """The account of a closed connection, given away once to a claim that
        carries its secret (None: unknown, expired, or the secret is wrong; a
        wrong one leaves the account to its owner and is counted)."""
        entry = self.closed.get(conn_id)
        if entry is None:
            return None
        slot = entry[0]
        if not same_secret(secret, _secret(self.words, slot)):
            self.claims_refused += 1
            return None
        del self.closed[conn_id]
        processed, delivered, dropped, refused, owed, group_lost = _latest(self.words, slot, self.seq)
        cut = bool(self.words[(HEADER_BYTES + slot * SLOT_BYTES) // 8 + _FLAGS] & CUT)
        self._clear(slot)
        self.free.append(slot)
        return Account(
            conn_id, processed, delivered, dropped, refused=refused, cut=cut, owed=owed, group_lost=group_lost
        )

    def expire(self, now: float | None = None) -> int:
        """Free the accounts closed more than ACCOUNT_TTL seconds ago; return how many."""
        now = time.monotonic() if now is None else now
        n = 0
        while self.closed:
            conn_id = next(iter(self.closed))
            slot, closed_at = self.closed[conn_id]
            if now - closed_at < ACCOUNT_TTL:
                break
            del self.closed[conn_id]
            self._clear(slot)
            self.free.append(slot)
            n += 1
        return n


class DeadAccounts:
    """The master's store of the accounts of dead workers, by connection id."""

    def __init__(self) -> None:
        self._accounts: dict[int, tuple[int, Account, float]] = {}  # conn_id -> (worker, account, death)
        self.claims_refused = 0  # claims of a dead worker's account without its secret

    def __len__(self) -> int:
        return len(self._accounts)

    def add(self, worker: int, accounts: Iterable[Account]) -> None:
        now = time.monotonic()
        self.expire(now)
        for account in accounts:
            self._accounts[account.conn_id] = (worker, account, now)

    def find(self, conn_id: int, worker: int, secret: bytes | None) -> Account | None:
        """The account of a connection of a dead incarnation of `worker`, for a
        claim that carries its secret; None otherwise (a wrong secret is counted)."""
        entry = self._accounts.get(conn_id)
        if entry is None or entry[0] != worker:
            return None
        if not same_secret(secret, entry[1].token):
            self.claims_refused += 1
            return None
        return entry[1]

    def lookup(self, conn_id: int, worker: int) -> Account | None:
        """The account of a connection of a dead incarnation of `worker`, unproven: for a
        TLS client, whose secret only its worker reads (inside TLS), and checks against
        the account's before using it (broky.server.worker.process)."""
        entry = self._accounts.get(conn_id)
        return entry[1] if entry is not None and entry[0] == worker else None

    def discard(self, conn_id: int) -> None:
        """The account was handed to a worker: it is answered once."""
        self._accounts.pop(conn_id, None)

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self._accounts:
            conn_id = next(iter(self._accounts))
            if now - self._accounts[conn_id][2] < ACCOUNT_TTL:
                break
            del self._accounts[conn_id]
