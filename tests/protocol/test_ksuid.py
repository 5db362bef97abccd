"""KSUIDs (broky.protocol.ksuid): the 20 bytes, their base62 text, and the generators."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broky.protocol.ksuid import (
    ALPHABET,
    EPOCH,
    SIZE,
    TEXT_SIZE,
    KsuidSequence,
    ksuid_text,
    ksuid_time,
    new_ksuid,
    parse_ksuid,
)

ids = st.binary(min_size=SIZE, max_size=SIZE)
NS = 1_000_000_000

# segmentio/ksuid's README example (`ksuid -f inspect`).
REFERENCE_TEXT = "0ujtsYcgvSTl8PAuAdqWYSMnLOv"
REFERENCE_BYTES = bytes.fromhex("0669F7EFB5A1CD34B5F99D1154FB6853345C9735")
REFERENCE_TIME = 1507608047  # 2017-10-10T04:00:47Z
MAX_TEXT = "aWgEPTl1tmebfsQzFP4bxwgy80V"  # segmentio's Max: twenty 0xFF bytes


def test_segmentio_reference_example() -> None:
    assert ksuid_text(REFERENCE_BYTES) == REFERENCE_TEXT
    assert parse_ksuid(REFERENCE_TEXT) == REFERENCE_BYTES
    assert ksuid_time(REFERENCE_BYTES) == REFERENCE_TIME
    assert int.from_bytes(REFERENCE_BYTES[:4], "big") == 107608047  # segmentio's "Timestamp"


def test_smallest_and_largest_ids() -> None:
    assert ksuid_text(bytes(SIZE)) == "0" * TEXT_SIZE
    assert parse_ksuid("0" * TEXT_SIZE) == bytes(SIZE)
    assert ksuid_text(b"\xff" * SIZE) == MAX_TEXT
    assert parse_ksuid(MAX_TEXT) == b"\xff" * SIZE
    assert ksuid_time(bytes(SIZE)) == EPOCH
    assert ksuid_time(b"\xff" * SIZE) == EPOCH + 2**32 - 1


@given(ids)
def test_round_trip(uid: bytes) -> None:
    text = ksuid_text(uid)
    assert len(text) == TEXT_SIZE and set(text) <= set(ALPHABET)
    assert parse_ksuid(text) == uid


@given(st.text(ALPHABET, min_size=TEXT_SIZE, max_size=TEXT_SIZE).filter(lambda t: t <= MAX_TEXT))
def test_every_valid_text_round_trips(text: str) -> None:
    assert ksuid_text(parse_ksuid(text)) == text


@given(ids, ids)
def test_text_order_is_byte_order(a: bytes, b: bytes) -> None:
    ta, tb = ksuid_text(a), ksuid_text(b)
    assert (ta < tb) == (a < b)
    assert (ta == tb) == (a == b)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0ujtsYcgvSTl8PAuAdqWYSMnLO-", "not a base62 character"),
        ("0ujtsYcgvSTl8PAuAdqWYSMnLO ", "not a base62 character"),
        ("0ujtsYcgvSTl8PAuAdqWYSMnLOé", "not a base62 character"),
        ("0ujtsYcgvSTl8PAuAdqWYSMnLO", "got 26"),
        ("0ujtsYcgvSTl8PAuAdqWYSMnLOv0", "got 28"),
        ("", "got 0"),
        ("aWgEPTl1tmebfsQzFP4bxwgy80W", "out of range"),  # the largest id plus one
        ("z" * TEXT_SIZE, "out of range"),
    ],
)
def test_bad_text_is_refused(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ksuid(text)


@pytest.mark.parametrize("size", [0, 19, 21])
def test_wrong_byte_length_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match=f"got {size}"):
        ksuid_text(bytes(size))


# ---------------------------------------------------------------- new_ksuid


def test_new_ksuid_holds_the_current_time() -> None:
    before = int(time.time())
    uid = new_ksuid()
    after = int(time.time())
    assert len(uid) == SIZE
    assert before <= ksuid_time(uid) <= after


@pytest.mark.parametrize("seconds", [0, 1, 2**31, 2**32 - 1])
def test_new_ksuid_at_the_edges_of_its_range(seconds: int) -> None:
    uid = new_ksuid(EPOCH + seconds + 0.75)  # fractions of a second are dropped
    assert uid[:4] == seconds.to_bytes(4, "big")
    assert ksuid_time(uid) == EPOCH + seconds


@pytest.mark.parametrize("now", [EPOCH - 1, EPOCH + 2**32, 0])
def test_new_ksuid_refuses_times_outside_its_range(now: float) -> None:
    with pytest.raises(ValueError, match="outside the KSUID range"):
        new_ksuid(now)


def test_new_ksuid_payloads_are_random() -> None:
    # More than one block of the random pool (4096 ids): no repeat across refills.
    uids = [new_ksuid(EPOCH + 5) for _ in range(10_000)]
    assert len(set(uids)) == len(uids)
    assert len({u[4:] for u in uids}) == len(uids)


# ---------------------------------------------------------------- KsuidSequence

T = (EPOCH + 300_000_000) * NS  # some second, in ns


def test_sequence_ids_within_a_second_are_unique_and_consecutive() -> None:
    seq = KsuidSequence()
    uids = [seq.new(T + i) for i in range(5000)]
    assert len(set(uids)) == len(uids)
    assert {u[:12] for u in uids} == {uids[0][:12]}  # one time and seed
    assert uids[0][:4] == (T // NS - EPOCH).to_bytes(4, "big")
    counters = [int.from_bytes(u[12:], "little") for u in uids]
    assert counters == list(range(counters[0], counters[0] + len(uids)))
    assert counters[0] < 2**63  # cannot reach 2**64 within a second


def test_sequence_rolls_at_the_next_second() -> None:
    seq = KsuidSequence()
    a = seq.new(T + NS - 1)
    b = seq.new(T + NS)
    assert ksuid_time(b) == ksuid_time(a) + 1
    assert a[4:12] != b[4:12]  # a fresh seed
    assert seq.start == T + NS and seq.until == T + 2 * NS


def test_sequence_reseeds_when_the_clock_goes_back() -> None:
    seq = KsuidSequence()
    first = [seq.new(T + NS) for _ in range(3)]
    back = seq.new(T + NS - 1)  # the clock stepped back by 1 ns, into the previous second
    assert ksuid_time(back) == ksuid_time(first[0]) - 1
    again = [seq.new(T + NS) for _ in range(3)]  # and forward again: the same second, a new seed
    assert len({back[4:12], first[0][4:12], again[0][4:12]}) == 3
    assert len({*first, back, *again}) == 7


def test_sequence_counter_starts_are_random_and_below_two_to_the_63() -> None:
    seq = KsuidSequence()
    starts = set()
    for i in range(200):
        seq.roll(T + i * NS)
        assert seq.next < 2**63
        starts.add(seq.next)
    assert len(starts) == 200


@pytest.mark.parametrize("ts", [(EPOCH - 1) * NS, (EPOCH + 2**32) * NS])
def test_sequence_refuses_times_outside_the_range(ts: int) -> None:
    with pytest.raises(ValueError, match="outside the KSUID range"):
        KsuidSequence().new(ts)


def test_sequence_and_pool_reseed_in_a_forked_child() -> None:
    seq = KsuidSequence()
    parent_first = seq.new(T)
    new_ksuid(EPOCH)  # the parent's pool has bytes left for the child to (not) reuse
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ids and leave at once
        try:
            os.write(write_fd, seq.new(T) + new_ksuid(EPOCH))
        finally:
            os._exit(0)
    try:
        os.close(write_fd)
        child = b""
        while len(child) < 2 * SIZE:
            chunk = os.read(read_fd, 2 * SIZE)
            if not chunk:
                break
            child += chunk
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_seq, child_pool = child[:SIZE], child[SIZE:]
    parent_next = seq.new(T)
    assert parent_next[:12] == parent_first[:12]  # the parent's sequence goes on
    assert child_seq[:4] == parent_first[:4]  # same second
    assert child_seq[4:12] != parent_first[4:12]  # but the child drew a new seed
    assert child_pool != new_ksuid(EPOCH)  # and a new random pool
