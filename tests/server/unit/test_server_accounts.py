"""The accounts table (broky.server.accounts): what a dead worker leaves behind."""

from __future__ import annotations

import mmap
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from broky.server import accounts
from broky.server.accounts import ACCOUNT_TTL, Account, AccountBook, DeadAccounts, read_accounts


class Conn:
    """What the book reads of a connection."""

    def __init__(self, conn_id: int) -> None:
        self.conn_id = conn_id
        self.msgs_in = 0
        self.msgs_out = 0
        self.dropped_total = 0
        self.refused = 0
        self.worker_owed = 0
        self.group_lost = 0
        self.token = secret_of(conn_id)
        self.slot = -1
        self.acct_ver = 0


def secret_of(conn_id: int) -> bytes:
    return conn_id.to_bytes(8, "little") * 2


def test_open_commit_close_claim() -> None:
    book = AccountBook.in_memory(slots=4)
    a, b = Conn(1 << 32 | 1), Conn(1 << 32 | 2)
    book.open(a)
    book.open(b)
    a.msgs_in, a.refused, b.msgs_out, b.dropped_total = 5, 2, 4, 1
    book.commit_read(a, [b, a])
    book.set_subscriptions(b, 2)
    found = {x.conn_id: x for x in read_accounts(book.table)}
    assert found[a.conn_id] == Account(a.conn_id, 5, 0, 0, 0, True, 2, a.token)
    assert found[b.conn_id] == Account(b.conn_id, 0, 4, 1, 2, True, 0, b.token)
    book.close(b)
    assert book.claim(b.conn_id, a.token) is None  # another connection's secret proves nothing
    assert book.claim(b.conn_id, None) is None
    assert book.claims_refused == 2
    assert book.claim(b.conn_id, b.token) == Account(b.conn_id, 0, 4, 1)  # still there for its owner
    assert book.claim(b.conn_id, b.token) is None  # once
    assert book.claim(a.conn_id, a.token) is None  # still open: not a closed account
    assert {x.conn_id for x in read_accounts(book.table)} == {a.conn_id}


def test_a_cut_connection_says_so_in_its_account() -> None:
    book = AccountBook.in_memory(slots=2)
    a, b = Conn(1 << 32 | 1), Conn(1 << 32 | 2)
    book.open(a)
    book.open(b)
    a.msgs_out, a.dropped_total = 7, 3
    book.commit((a,))
    book.mark_cut(a)
    assert [x.cut for x in sorted(read_accounts(book.table))] == [True, False]  # what a master reads
    book.close(a)
    claimed = book.claim(a.conn_id, a.token)
    assert claimed == Account(a.conn_id, 0, 7, 3, cut=True)
    assert Account.unpack(claimed.pack()) == claimed  # a hand-off carries it
    book.open(c := Conn(1 << 32 | 3))  # the slot again: a fresh account is not cut
    book.close(c)
    assert book.claim(c.conn_id, c.token) == Account(c.conn_id, 0, 0, 0)


def test_slots_are_recycled_oldest_closed_first_and_then_run_out() -> None:
    book = AccountBook.in_memory(slots=2)
    a, b, c, d = (Conn(i) for i in range(1, 5))
    book.open(a)
    book.open(b)
    book.close(a)
    book.open(c)  # takes a's slot: a's account is gone
    assert book.claim(a.conn_id, a.token) is None
    book.open(d)
    assert d.slot == -1 and book.unavailable == 1
    assert book.used == 2


def test_closed_accounts_expire() -> None:
    book = AccountBook.in_memory(slots=2)
    a = Conn(1)
    book.open(a)
    book.close(a)
    _, closed_at = book.closed[a.conn_id]
    assert book.expire(closed_at + ACCOUNT_TTL - 1) == 0
    assert book.expire(closed_at + ACCOUNT_TTL + 1) == 1
    assert book.claim(a.conn_id, a.token) is None and book.free == [0]


def test_the_table_lives_in_a_memfd_the_master_reads() -> None:
    fd, table = accounts.new_table(slots=8)
    book = AccountBook.from_fd(fd)  # the worker's mapping (and it closes fd)
    c = Conn(7)
    book.open(c)
    c.msgs_in, c.msgs_out = 3, 9
    book.commit_read(c, [])
    assert read_accounts(table) == [Account(7, 3, 9, 0, 0, True, 0, c.token)]
    table.close()
    assert isinstance(book.table, mmap.mmap)


@settings(max_examples=200, deadline=None)
@given(
    reads=st.lists(
        st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 3), st.integers(0, 1))),
        max_size=12,
    ),
    torn=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 3), st.integers(0, 1))),
    tear_at=st.integers(0, 200),
)
def test_a_crash_inside_a_commit_leaves_the_previous_commit(
    reads: list[list[tuple[int, int, int, int]]], torn: list[tuple[int, int, int, int]], tear_at: int
) -> None:
    """Commits of whole reads, then one that dies after writing `tear_at` bytes of
    its versions: the reader sees exactly the counters of the last whole commit."""
    book = AccountBook.in_memory(slots=8)
    conns = [Conn(100 + i) for i in range(5)]
    for c in conns:
        book.open(c)

    def apply(changes: list[tuple[int, int, int, int]]) -> list[Conn]:
        touched = []
        for i, dp, dd, dx in changes:
            c = conns[i]
            c.msgs_in += dp
            c.msgs_out += dd
            c.dropped_total += dx
            c.refused += dx & dp
            if c not in touched:
                touched.append(c)
        return touched

    for changes in reads:
        touched = apply(changes)
        if touched:
            book.commit_read(touched[0], touched)
    expected = {c.conn_id: (c.msgs_in, c.msgs_out, c.dropped_total, c.refused) for c in conns}
    # The torn commit: the same writes as commit_read, cut after tear_at bytes, no commit point.
    touched = apply(torn)
    image = bytearray(book.table)
    seq = book.seq + 1
    writes = b""
    spots = []
    for c in touched:
        at = c.slot + (c.acct_ver ^ 1) * accounts.VERSION_BYTES
        spots.append(at)
        writes += struct.pack("<QQQQQ", seq, c.msgs_in, c.msgs_out, c.dropped_total, c.refused)
    cut = writes[:tear_at]
    for k, at in enumerate(spots):
        part = cut[40 * k : 40 * (k + 1)]
        image[at : at + len(part)] = part
    found = {a.conn_id: (a.processed, a.delivered, a.dropped, a.refused) for a in read_accounts(image)}
    assert found == expected


def test_dead_accounts_are_found_by_worker_and_given_once() -> None:
    dead = DeadAccounts()
    five = Account(5, 1, 2, 3, token=secret_of(5))
    dead.add(1, [five, Account(6, 0, 0, 0, token=secret_of(6))])
    assert dead.find(5, 0, secret_of(5)) is None  # another worker's connection
    assert dead.find(5, 1, secret_of(6)) is None  # another connection's secret
    assert dead.find(5, 1, None) is None
    assert dead.claims_refused == 2
    assert dead.find(5, 1, secret_of(5)) == five
    dead.discard(5)
    assert dead.find(5, 1, secret_of(5)) is None
    assert len(dead) == 1
    dead.expire(now=float("inf"))
    assert len(dead) == 0
