"""The compiled twin of the SDK's publish encoding (broky.client._pubpack) is held to
the pure-Python reference: the same bytes as encode_message and the encoder's
templates, the same uids from the same sequence, and it leaves to the Python path
exactly the rows that path must take. Also: publishing through a real server
with the twin turned off (BROKY_PURE_PYTHON=1) still passes the SDK's tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.client import pubpack
from broky.client.encoder import PublishEncoder
from broky.client.link import frames_in, publishes_in
from broky.protocol import decode_message, encode_message
from broky.protocol.ksuid import KsuidSequence
from broky.protocol.message import message_size
from tests.support.paths import ROOT

if pubpack.compiled is None and pubpack.pure_requested():
    pytest.skip(f"{pubpack.ENV_PURE} is set: no compiled twin to compare", allow_module_level=True)
small = st.binary(max_size=40)
int64 = st.integers(-(2**63), 2**63 - 1)


def _rolled() -> KsuidSequence:
    seq = pubpack.new_sequence()
    seq.roll(time.time_ns())
    return seq


def test_the_compiled_twin_is_built() -> None:
    # `pip install -e .` builds it wherever there is a C compiler (CI has one) and
    # `./run test` rebuilds it when _pubpack.c changes; a missing or stale twin would
    # fail every test below instead of skipping them (a silent fallback would hide a
    # broken build, and the publish path would run at twice the CPU per message).
    assert pubpack.compiled is not None, pubpack.description
    assert pubpack.description == "compiled"


@pytest.fixture(autouse=True, scope="module")
def _twin() -> None:
    """The tests here need the twin: each fails with the reason when it is not there."""
    if pubpack.compiled is None:
        pytest.fail(f"no compiled publish path: {pubpack.description}", pytrace=False)


@settings(max_examples=300, deadline=None)
@given(
    kp=small, key=small, payload=st.binary(max_size=600), ts=int64, uid=st.binary(min_size=20, max_size=20)
)
def test_encode_equals_encode_message(kp: bytes, key: bytes, payload: bytes, ts: int, uid: bytes) -> None:
    assert pubpack.compiled.encode(kp, key, payload, ts, uid) == encode_message(kp, key, payload, ts, 0, uid)


def test_encode_refuses_what_encode_message_refuses() -> None:
    c = pubpack.compiled
    with pytest.raises(TypeError):
        c.encode("kp", b"k", b"v", 0, bytes(20))
    with pytest.raises(TypeError):
        c.encode(b"kp", b"k", b"v", 0, bytes(19))
    with pytest.raises(OverflowError):
        c.encode(b"kp", b"k", b"v", 2**63, bytes(20))


@settings(max_examples=300, deadline=None)
@given(kp=small, key=small, payload=st.binary(max_size=600), ts=st.one_of(st.none(), int64))
def test_stamp_equals_the_template_and_advances_the_sequence(
    kp: bytes, key: bytes, payload: bytes, ts: int | None
) -> None:
    encoder = PublishEncoder(1 << 20)
    seq = encoder.uids = _rolled()
    pack, head, mid, block, _ = encoder.template(kp, key, len(payload))
    sample = pack(head, 0, mid, bytes(12), 0, block, bytes(len(payload)))
    while True:
        n = seq.next
        before = time.time_ns()
        frame = pubpack.compiled.stamp(sample, payload, ts, seq)
        if frame is not None:
            break
        # the one reason a rolled sequence is refused: the clock passed its second
        assert time.time_ns() >= seq.until and seq.next == n
        seq.roll(time.time_ns())
    assert seq.next == n + 1
    msg = decode_message(frame)
    assert msg.uid == seq.pre + n.to_bytes(8, "little")
    if ts is None:
        assert before <= msg.ts_producer <= time.time_ns()
    else:
        assert msg.ts_producer == ts
    assert frame == encode_message(kp, key, payload, msg.ts_producer, 0, msg.uid)
    assert frame == pack(head, msg.ts_producer, mid, seq.pre, n, block, payload)
    out: list[bytes] = [b"before"]
    while (appended := pubpack.compiled.stamp(sample, payload, 5, seq, out)) is None:
        assert time.time_ns() >= seq.until and out == [b"before"]  # as above
        seq.roll(time.time_ns())
        n = seq.next - 1
    assert appended == len(frame)
    assert out[0] == b"before" and decode_message(out[1]).uid == seq.pre + (n + 1).to_bytes(8, "little")


def test_stamp_leaves_to_the_python_path_what_it_must_take() -> None:
    c = pubpack.compiled
    seq = pubpack.new_sequence()  # never rolled
    sample = encode_message(b"p", b"k", bytes(3), 0, 0, bytes(20))
    assert c.stamp(sample, b"abc", None, seq) is None  # the sequence must roll first
    seq.roll(time.time_ns())
    n = seq.next
    assert c.stamp(sample, b"abcd", None, seq) is None  # another payload length
    assert c.stamp(sample, bytearray(b"abc"), None, seq) is None  # not bytes
    assert c.stamp(sample, b"abc", 2**63, seq) is None  # ts_producer out of range
    assert c.stamp(sample, b"abc", "1", seq) is None
    seq.start, seq.until = seq.until, seq.until + 1  # a new second: the Python path rolls
    assert c.stamp(sample, b"abc", None, seq) is None
    assert seq.next == n  # nothing was taken
    with pytest.raises(ValueError):
        c.stamp(encode_message(b"p", b"k", b"abc", 0, 0, None), b"abc", None, seq)  # no uid
    with pytest.raises(TypeError):
        c.stamp(sample, b"abc", None, KsuidSequence())


class _Link(pubpack.compiled.LinkState if pubpack.compiled is not None else object):  # type: ignore[misc]
    """The part of broky.client.link.Link that FastPath touches: its state and schedule_flush."""

    def __init__(self, up: bool) -> None:
        self.proto = object() if up else None
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flush_handle: object = None
        self.scheduled = 0

    def schedule_flush(self) -> None:
        self.scheduled += 1
        self.flush_handle = object()


# One publish: key_partition (one the cache lacks too), payload length (one it lacks too),
# a payload that is not bytes now and then, ts_producer (one out of range too).
publish_strategy = st.lists(
    st.tuples(
        st.sampled_from([b"up", b"down", b"unknown", "up", ["unhashable"]]),
        st.sampled_from([3, 7, 9]),
        st.booleans(),
        st.one_of(st.none(), int64, st.just(2**63), st.just("1")),
        st.booleans(),  # the Link's scheduled write fires (flush_handle back to None)
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(publishes=publish_strategy, batch_size=st.integers(1, 3000))
def test_fast_path_publishes_what_stamp_makes_and_leaves_the_rest(
    publishes: list[tuple[object, int, bool, object, bool]], batch_size: int
) -> None:
    # FastPath.publish against a model of publish's fast path in Python: the
    # same frame as stamp (the reference's bytes, the next uid), counted in
    # out_bytes, a write scheduled once per batch, the Link returned at
    # batch_size; False, with nothing changed, wherever the Python path must go.
    encoder = PublishEncoder(1 << 20)
    seq = encoder.uids = _rolled()
    links = {b"up": _Link(up=True), b"down": _Link(up=False)}
    fast: dict[object, dict[object, dict[int, tuple[bytes, _Link]]]] = {}
    for cached_kp, cached_link in links.items():
        for length in (3, 7):  # 9 is never cached
            pack, head, mid, block, _ = encoder.template(cached_kp, b"k", length)
            sample = pack(head, 0, mid, bytes(12), 0, block, bytes(length))
            fast.setdefault(cached_kp, {}).setdefault(b"k", {})[length] = (sample, cached_link)
    path = pubpack.compiled.FastPath(fast, seq, batch_size)
    for kp, length, as_bytes, ts, fired in publishes:
        payload: object = bytes(range(length)) if as_bytes else bytearray(length)
        link = links.get(kp) if isinstance(kp, bytes) else None
        before = [(lk.out[:], lk.out_bytes, lk.scheduled) for lk in links.values()]
        handle_was_none = links[b"up"].flush_handle is None
        n = seq.next
        t0 = time.time_ns()
        result = path.publish(kp, b"k", payload, ts)
        takes = (
            link is not None
            and link.proto is not None
            and length != 9
            and as_bytes
            and (ts is None or (isinstance(ts, int) and -(2**63) <= ts < 2**63))
            and seq.start <= t0
            and time.time_ns() < seq.until
        )
        if not takes:
            if result is False and seq.next == n:
                assert [(lk.out, lk.out_bytes, lk.scheduled) for lk in links.values()] == before
                continue
            # the only case the model cannot foresee: the clock passed a second boundary
            assert result is False and time.time_ns() >= seq.until
            seq.roll(time.time_ns())
            continue
        assert link is links[b"up"]
        frame = link.out[-1]
        assert seq.next == n + 1 and link.out[:-1] == before[0][0]
        msg = decode_message(frame)
        assert msg.uid == seq.pre + n.to_bytes(8, "little")
        assert frame == encode_message(kp, b"k", payload, msg.ts_producer, 0, msg.uid)  # type: ignore[arg-type]
        if ts is not None:
            assert msg.ts_producer == ts
        old_bytes, old_scheduled = before[0][1], before[0][2]
        assert link.out_bytes == old_bytes + len(frame)
        if link.out_bytes >= batch_size:
            assert result is link and link.scheduled == old_scheduled  # the caller writes it now
            link.out.clear()
            link.out_bytes = 0
            link.flush_handle = None
        else:
            assert result is None
            assert link.scheduled == old_scheduled + (1 if handle_was_none else 0)
            assert link.flush_handle is not None
        if fired:  # the loop ran the scheduled write
            link.out.clear()
            link.out_bytes = 0
            link.flush_handle = None


def test_sequence_state_in_c_behaves_as_ksuid_sequence() -> None:
    seq = pubpack.new_sequence()
    now = time.time_ns()
    uids = [seq.new(now) for _ in range(1000)]
    assert len(set(uids)) == 1000 and all(u[:12] == uids[0][:12] for u in uids)
    later = seq.new(now + 1_000_000_000)
    assert later[4:12] != uids[0][4:12]
    with pytest.raises(TypeError):
        seq.pre = b"short"


def plain(key: bytes) -> bool:
    """A key the compiled loop publishes itself: no empty token and no `*` or `>` byte
    (any other goes to the Python path, which refuses a wildcard or empty token)."""
    return b"*" not in key and b">" not in key and b"" not in key.split(b".")


# One row: key_partition, key, payload, ts_producer; kinds the compiled loop must leave
# to the Python path are mixed in (str fields, an unknown key_partition, a big payload).
KNOWN = [b"a", b"bb", b"tenant-7"]
rows_strategy = st.lists(
    st.tuples(
        st.one_of(st.sampled_from(KNOWN), st.sampled_from([b"unknown", "a"])),
        st.one_of(small, st.just("str-key")),
        st.one_of(st.binary(max_size=80), st.just(b"x" * 500), st.just(bytearray(b"ba"))),
        st.one_of(st.none(), int64, st.just(2**63)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    rows=rows_strategy,
    room=st.lists(st.integers(-1, 2000), min_size=2, max_size=2),
    part=st.integers(1, 1200),
    given_uids=st.booleans(),
    ts_column=st.booleans(),
)
def test_pack_rows_encodes_rows_as_the_reference_and_stops_where_python_must(
    rows: list[tuple[object, object, object, object]],
    room: list[int],
    part: int,
    given_uids: bool,
    ts_column: bool,
) -> None:
    c = pubpack.compiled
    seq = _rolled()
    max_frame = 400
    kps, keys, payloads = ([r[i] for r in rows] for i in range(3))
    tss = [r[3] for r in rows] if ts_column else None
    slots = {b"a": 0, b"bb": 1, b"tenant-7": 1}
    outs: list[list[bytes]] = [[], []]
    added, counts = [0, 0], [0, 0]
    prefix = bytes(range(12)) if given_uids else None
    base = 5 << 40
    n0 = seq.next
    before = time.time_ns()
    stop, full = c.pack_rows(kps, keys, payloads, tss, 0, slots, outs, added, counts, room, part,
                             max_frame, seq, prefix, base)  # fmt: skip
    after = time.time_ns()
    # Every row before `stop` went into its slot's chunks, in order, as the reference encodes it.
    frames = [frames_in(out) for out in outs]
    expected: list[list[bytes]] = [[], []]
    for i in range(stop):
        kp, key, payload, _ = rows[i]
        j = slots[kp]  # type: ignore[index]
        assert len(frames[j]) > len(expected[j])
        got = frames[j][len(expected[j])]
        msg = decode_message(got)
        uid = (
            prefix + (base + i).to_bytes(8, "little") if prefix else seq.pre + (n0 + i).to_bytes(8, "little")
        )
        t = None if tss is None else tss[i]
        assert msg.uid == uid
        if t is None:
            assert before <= msg.ts_producer <= after  # a reading of this call (every 32 rows)
        else:
            assert msg.ts_producer == t
        assert got == encode_message(kp, key, payload, msg.ts_producer, 0, uid)  # type: ignore[arg-type]
        expected[j].append(got)
    for j in (0, 1):
        assert frames[j] == expected[j]
        # chunks of whole frames, each at most `part` bytes or one larger frame, each
        # as full as the next frame allowed
        for chunk, after_it in zip(outs[j], [*outs[j][1:], b""]):
            assert publishes_in(chunk) and (len(chunk) <= part or len(publishes_in(chunk)) == 1)
            if after_it:
                assert len(chunk) + len(publishes_in(after_it)[0]) > part
        assert added[j] == sum(len(f) for f in expected[j]) and counts[j] == len(expected[j])
    if prefix is None:
        assert seq.next == n0 + stop
    # Where it stopped: a full slot, the end, or a row the Python path must take.
    if full >= 0:
        assert stop >= 1 and added[full] >= room[full]
        assert slots[rows[stop - 1][0]] == full
    elif stop < len(rows):
        kp, key, payload, t = rows[stop]
        t = t if ts_column else None
        must = (
            not all(x.__class__ is bytes for x in (kp, key, payload))
            or not plain(key)
            or kp not in slots
            or room[slots[kp]] < 0
            or message_size(len(kp), len(key), len(payload)) - 4 > max_frame
            or (t is not None and not -(2**63) <= t < 2**63)
        )
        assert must, rows[stop]


def test_pack_rows_takes_any_sequence_and_starts_where_told() -> None:
    c = pubpack.compiled
    seq = _rolled()
    kps = (b"a", b"a", b"a")
    outs: list[list[bytes]] = [[]]
    stop, full = c.pack_rows(kps, range(3), [b"1", b"2", b"3"], None, 1, {b"a": 0}, outs, [0], [0], [10**6],
                             1 << 16, 1000, seq, None, 0)  # fmt: skip
    assert (stop, full) == (1, -1) and outs == [[]]  # keys are ints: row 1 goes to the Python path
    keys = type("Keys", (), {"__getitem__": lambda self, i: b"k%d" % i, "__len__": lambda self: 3})()
    stop, full = c.pack_rows(kps, keys, [b"1", b"2", b"3"], None, 1, {b"a": 0}, outs, [0], [0], [10**6],
                             1 << 16, 1000, seq, None, 0)  # fmt: skip
    assert (stop, full) == (3, -1)
    assert [decode_message(f).key for f in frames_in(outs[0])] == [b"k1", b"k2"]


def test_the_sdk_tests_pass_on_the_pure_python_path() -> None:
    # The reference path stays working: the publish tests again, in a process with
    # the twin turned off (as a machine without a C compiler runs them).
    env = {**os.environ, "BROKY_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/client/test_client_fastpath.py", "tests/client/test_client.py",
         "-k", "publish or fast or rows",
         "--timeout", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout


def test_a_chunk_of_publishes_is_counted_as_its_publishes_when_a_link_retires_or_gives_up() -> None:
    # publish_many packs one chunk per Link; what is not written yet is still counted
    # per publish: handed over when the Link retires, counted as dropped if it gives up.
    import asyncio

    from tests.support.sdk import unconnected_client

    async def main() -> None:
        client, link = unconnected_client()
        n = 10
        await client.publish(b"k", b"first", partition=b"p")  # the general path: a frame of its own
        await client.publish_many([b"k"] * n, [b"v%d" % i for i in range(n)], partitions=[b"p"] * n)
        assert len(link.out) < n + 1 and len(link.out) + link.out_extra == n + 1
        assert [decode_message(f).payload for f in frames_in(link.out)] == [b"first"] + [
            b"v%d" % i for i in range(n)
        ]
        link.proto = None  # its connection is gone: its node left the map
        frames, _, _ = link.retire()
        assert len(frames) == n + 1 and link.out_extra == 0
        client2, link2 = unconnected_client()
        await client2.publish_many([b"k"] * n, [b"v"] * n, partitions=[b"p"] * n)
        link2.proto = None
        link2._give_up(1, None)
        assert client2.stats.unsent_gave_up == n and link2.out_extra == 0

    asyncio.run(main())
