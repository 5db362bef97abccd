"""The Spark source's column decoder (broky.spark.readcols): its compiled twin
(broky.spark._readcols) is held to the pure-Python reference, byte for byte, on
streams of frames as a read's connection receives them (canonical Messages with
and without uid, control frames, Messages in other layouts, cut anywhere), on
damaged streams and on random bytes: the same positions, the same columns, the
same errors, and never a crash. The reference is held to what the source made
of each message before it decoded in bulk (`Message` fields, one row each).
Without a Spark session: the source's read itself, end to end, is in
test_spark_source.py."""

from __future__ import annotations

import struct
from collections.abc import Callable
from operator import itemgetter
from typing import Any, cast

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import broky
from broky.client import pubpack
from broky.errors import ProtocolError
from broky.protocol import (
    VBUCKETS,
    Message,
    Ping,
    ReadDone,
    Replay,
    decode_frame,
    encode_frame,
    encode_message,
    ksuid,
)
from broky.protocol.framing import MIN_FRAME_SIZE, check_size
from broky.protocol.layout import shape
from broky.spark import readcols, source
from broky.spark.source import (
    SCHEMA,
    SourceOptions,
    _positions,
    _run,
    arrow_schema,
    initial_offsets,
    plan,
    read_partition,
)
from tests.support.generated import Writer, small_frames
from tests.support.mutations import mutate, mutation
from tests.support.serverproc import ServerProcess

if readcols.compiled is None and pubpack.pure_requested():
    pytest.skip(f"{pubpack.ENV_PURE} is set: no compiled twin to compare", allow_module_level=True)

MAX_FRAME = 1 << 20
I64_MAX = 2**63 - 1

messages = st.builds(
    Message,
    key_partition=st.binary(max_size=40),
    key=st.binary(max_size=40),
    payload=st.binary(max_size=300),
    ts_producer=st.integers(-(2**63), I64_MAX) | st.sampled_from([0, 0, -1, 1, -999, -1000, -1001, 999]),
    ts_broker=st.integers(-(2**63), I64_MAX) | st.just(0),
    uid=st.none() | st.binary(min_size=20, max_size=20) | st.sampled_from([bytes(20), b"\xff" * 20]),
    vbucket=st.integers(0, VBUCKETS - 1) | st.integers(0, 2**16 - 1),
    epoch=st.integers(0, 2**64 - 1) | st.sampled_from([0, 10, 2**64 - 1]),
    offset=st.integers(0, I64_MAX) | st.sampled_from([0, I64_MAX, I64_MAX + 1, 2**64 - 1]),
)


@st.composite
def items(draw: st.DrawFn) -> bytes:
    """One frame of a read's answer: mostly canonical Messages, some control frames and
    Messages written by flatbuffers.Builder (another layout: the scan stops at them)."""
    kind = draw(st.sampled_from(["canonical"] * 6 + ["control", "builder"]))
    if kind == "canonical":
        return encode_message(*draw(messages))
    if kind == "control":
        return encode_frame(draw(small_frames))
    return Writer(draw).frame(draw(messages))


def masks() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(b"\x01" * VBUCKETS),
        st.binary(min_size=VBUCKETS, max_size=VBUCKETS),
        st.binary(max_size=VBUCKETS + 8),  # shorter or longer than the vbuckets
    )


def both(batch_rows: int, batch_bytes: int) -> tuple[Any, readcols.PyDecoder]:
    assert readcols.compiled is not None, readcols.description
    return readcols.compiled.Decoder(batch_rows, batch_bytes), readcols.PyDecoder(batch_rows, batch_bytes)


def drain(decoder: Any, data: bytes, mask: bytes, max_frame: int = MAX_FRAME) -> list[Any]:
    """What a read's connection does with `data`: scan, take each full batch, pass over each
    frame the scan stops at (when its size prefix says where it ends), until nothing is left
    or a frame cannot be passed over; every position, batch and error, in order."""
    events: list[Any] = []
    pos = 0
    while True:
        try:
            pos = decoder.scan(data, pos, len(data), mask, max_frame)
        except (OverflowError, ValueError, TypeError) as exc:
            events.append((type(exc).__name__, str(exc)))
            break
        events.append(pos)
        if decoder.full:
            events.append(decoder.take())
            continue
        if len(data) - pos < 4:
            break
        size = struct.unpack_from("<I", data, pos)[0]
        if size < MIN_FRAME_SIZE or pos + 4 + size > len(data):
            break
        pos += 4 + size
    events.append(("left", decoder.rows, decoder.take()))
    return events


def test_the_compiled_twin_is_built() -> None:
    # `pip install -e .` builds it wherever there is a C compiler, and `./run test` rebuilds
    # it when _readcols.c changes: a missing or stale twin fails here (the source would run
    # the reference at several times the CPU per row, silently).
    assert readcols.compiled is not None, readcols.description
    assert readcols.description == "compiled"


@settings(max_examples=300, deadline=None)
@given(
    frames=st.lists(items(), max_size=30),
    mask=masks(),
    batch_rows=st.integers(1, 12),
    batch_bytes=st.integers(1, 3000) | st.just(1 << 30),
)
def test_a_read_answer_decodes_alike_in_c_and_in_the_reference(
    frames: list[bytes], mask: bytes, batch_rows: int, batch_bytes: int
) -> None:
    data = b"".join(frames)
    c, py = both(batch_rows, batch_bytes)
    assert drain(c, data, mask) == drain(py, data, mask)


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(items(), min_size=1, max_size=12), ops=st.lists(mutation, min_size=1, max_size=4))
def test_damaged_answers_decode_alike_and_never_crash(frames: list[bytes], ops: list[Any]) -> None:
    data = bytearray(b"".join(frames))
    for op in ops:
        data = mutate(data, op)
    c, py = both(5, 1 << 30)
    mask = b"\x01" * VBUCKETS
    assert drain(c, bytes(data), mask) == drain(py, bytes(data), mask)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600), cut=st.integers(0, 600), max_frame=st.integers(0, 1 << 12))
def test_random_bytes_decode_alike_and_never_crash(data: bytes, cut: int, max_frame: int) -> None:
    c, py = both(3, 1 << 30)
    mask = b"\x01" * VBUCKETS
    assert drain(c, data, mask, max_frame) == drain(py, data, mask, max_frame)
    # from any position inside, and up to any end
    end = min(cut, len(data))
    for start in range(0, end, 7):
        assert c.scan(data, start, end, mask, max_frame) == py.scan(data, start, end, mask, max_frame)
        assert c.take() == py.take()


def old_rows(msgs: list[Message]) -> list[dict[str, Any]]:
    """What the source made of each message before it read in bulk (its per-message loop)."""
    from datetime import UTC, datetime, timedelta

    def ts(ns: int) -> datetime | None:
        return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000) if ns else None

    return [
        {
            "key_partition": m.key_partition,
            "key": m.key,
            "payload": m.payload,
            "ts_producer": ts(m.ts_producer),
            "ts_broker": ts(m.ts_broker),
            "uid": m.uid_text,
            "vbucket": m.vbucket,
            "epoch": str(m.epoch),
            "offset": m.offset,
        }
        for m in msgs
    ]


# Every int64 of ns is a datetime to_pylist can give (years 1677 to 2262).
_DATETIME_NS = st.integers(-(2**63), I64_MAX) | st.sampled_from([-1, 1, -1000, -1001, 999])


@settings(max_examples=200, deadline=None)
@given(
    msgs=st.lists(messages.filter(lambda m: m.offset <= I64_MAX and m.vbucket < VBUCKETS), max_size=20),
    tsp=st.lists(_DATETIME_NS | st.just(0), min_size=20, max_size=20),
    tsb=st.lists(_DATETIME_NS | st.just(0), min_size=20, max_size=20),
)
def test_the_columns_are_the_rows_the_source_made_of_each_message(
    msgs: list[Message], tsp: list[int], tsb: list[int]
) -> None:
    msgs = [m._replace(ts_producer=tsp[i], ts_broker=tsb[i]) for i, m in enumerate(msgs)]
    data = b"".join(encode_message(*m) for m in msgs)
    c, py = both(100, 1 << 30)
    mask = b"\x01" * VBUCKETS
    assert (
        c.scan(data, 0, len(data), mask, MAX_FRAME)
        == py.scan(data, 0, len(data), mask, MAX_FRAME)
        == len(data)
    )
    cols = c.take()
    assert cols == py.take()
    batch = readcols.arrow_batch(pa, arrow_schema(pa), cols)
    batch.validate(full=True)
    assert batch.schema.names == SCHEMA.names
    assert batch.to_pylist() == old_rows(msgs)


def test_the_uid_text_is_ksuid_text_at_the_edges() -> None:
    uids = [bytes(20), b"\xff" * 20, b"\x00" * 19 + b"\x01", bytes(range(20)), b"\x80" + bytes(19)]
    msgs = [Message(b"p", b"k", b"", 1, 1, u, 1, 1, i) for i, u in enumerate(uids)]
    data = b"".join(encode_message(*m) for m in msgs)
    c, _ = both(100, 1 << 30)
    c.scan(data, 0, len(data), b"\x01" * VBUCKETS, MAX_FRAME)
    cols = readcols.Columns._make(c.take())
    assert cols.uid == "".join(ksuid.ksuid_text(u) for u in uids).encode()
    assert cols.uid_validity is None and cols.uid_nulls == 0


def test_the_scan_stops_at_each_frame_it_does_not_take_and_the_codec_says_why() -> None:
    msg = Message(b"kp", b"k.a", b"payload", 5, 6, bytes(range(20)), 7, 8, 9)
    one = encode_message(*msg)
    overrun = bytearray(one)
    struct.pack_into(
        "<I", overrun, shape(True, 2, 3, 7).payload_at, 1 << 10
    )  # payload's length: past the end
    stops = [
        encode_frame(Replay(0, 3, 1, 1)),  # control frames: read by the codec
        encode_frame(ReadDone(1, 7, 8, 10, 0, False, 0)),
        encode_frame(Ping(1)),
        bytes(overrun),  # canonical, but a vector overruns it: malformed
        struct.pack("<I", 8) + bytes(8),  # smaller than any frame
    ]
    mask = b"\x01" * VBUCKETS
    for frame in stops:
        data = one + frame + one
        for dec in both(100, 1 << 30):
            assert dec.scan(data, 0, len(data), mask, MAX_FRAME) == len(one)
            assert dec.rows == 1
            assert dec.scan(data, len(one) + len(frame), len(data), mask, MAX_FRAME) == len(data)
            assert dec.rows == 2
    for frame in stops[:3]:
        decode_frame(frame)
    with pytest.raises(ProtocolError, match="overruns"):
        decode_frame(stops[3])
    with pytest.raises(ProtocolError, match="smaller than any frame"):
        check_size(8, MAX_FRAME)
    # a partial frame, and one over max_frame: not taken either
    for dec in both(100, 1 << 30):
        assert dec.scan(one + one[:-1], 0, 2 * len(one) - 1, mask, MAX_FRAME) == len(one)
        assert dec.scan(one, 0, len(one), mask, len(one) - 5) == 0
        assert dec.scan(one, 0, len(one), mask, len(one) - 4) == len(one)


def test_a_frame_of_a_vbucket_not_asked_is_passed_over_and_a_full_batch_stops() -> None:
    frames = [
        encode_message(b"p", b"k", b"x" * 10, 1, 2, None, vb, 3, i) for i, vb in enumerate([1, 2, 1, 3, 1])
    ]
    data = b"".join(frames)
    mask = bytearray(VBUCKETS)
    mask[1] = 1
    for dec in both(2, 1 << 30):
        pos = dec.scan(data, 0, len(data), mask, MAX_FRAME)
        assert pos == len(frames[0]) * 3 and dec.full  # rows 0 and 2; 1 passed over
        assert readcols.Columns._make(dec.take()).offset == struct.pack("<2q", 0, 2)
        assert dec.scan(data, pos, len(data), mask, MAX_FRAME) == len(data) and dec.rows == 1
    for dec in both(100, 24):  # full at 24 bytes: after 2 rows of 12 (any vbucket below 4 asked)
        assert dec.scan(data, 0, len(data), b"\x01" * 4, MAX_FRAME) == 2 * len(frames[0])
        assert dec.full and dec.rows == 2


def test_an_offset_a_long_cannot_hold_fails_and_keeps_the_rows_before() -> None:
    good = encode_message(b"p", b"k", b"", 1, 2, None, 5, 3, 4)
    bad = encode_message(b"p", b"k", b"", 1, 2, None, 5, 3, 2**63)
    for dec in both(100, 1 << 30):
        with pytest.raises(OverflowError, match="offset 9223372036854775808 of vbucket 5"):
            dec.scan(good + bad, 0, len(good + bad), b"\x01" * VBUCKETS, MAX_FRAME)
        assert dec.rows == 1
        # of a vbucket not asked: passed over, no error
        mask = bytearray(b"\x01" * VBUCKETS)
        mask[5] = 0
        assert dec.scan(bad, 0, len(bad), mask, MAX_FRAME) == len(bad) and dec.rows == 1


def test_bad_arguments_are_refused_alike() -> None:
    mask = b"\x01" * VBUCKETS
    one = encode_message(b"p", b"k", b"v")
    for dec in both(10, 100):
        with pytest.raises(TypeError):
            cast(Any, dec).scan(bytearray(one), 0, len(one), mask, MAX_FRAME)
        for pos, end in [(-1, len(one)), (5, 4), (0, len(one) + 1)]:
            with pytest.raises(ValueError, match="not inside"):
                dec.scan(one, pos, end, mask, MAX_FRAME)
        with pytest.raises(ValueError, match="max_frame"):
            dec.scan(one, 0, len(one), mask, 1 << 30)
    for args in [(0, 1), (1, 0), (1 << 25, 1), (1, (1 << 30) + 1)]:
        with pytest.raises(ValueError, match="batch_rows"):
            readcols.PyDecoder(*args)
        with pytest.raises(ValueError, match="batch_rows"):
            readcols.compiled.Decoder(*args)


def test_a_task_reads_the_same_rows_with_the_twin_and_the_reference(
    start_server: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source's read (`read_partition`, outside Spark) against a real broker, compiled and
    pure: the same Arrow batches, and the rows the per-message read made of the same range."""
    server = start_server(workers=2)
    address = f"127.0.0.1:{server.port}"
    with broky.connect_sync(address, name="test-pub") as client:
        for i in range(3000):
            client.publish("cols.k", b"%d" % i + b"x" * (i % 50), partition=f"kp{i % 64}")
        client.flush()
        messages = client.read(">").messages
    opts = SourceOptions.from_options({"broky.servers": address}, streaming=False)
    start = initial_offsets(opts, "earliest", 0)
    end, vmap = _run(_positions(opts))
    tasks = plan(opts, start, end, vmap)
    assert len(tasks) == 2
    monkeypatch.setattr(source, "ARROW_BATCH_ROWS", 1000)
    per_task = [list(read_partition(task, opts)) for task in tasks]
    monkeypatch.setattr(readcols, "compiled", None)
    assert readcols.new_decoder(10).__class__ is readcols.PyDecoder
    reference = [list(read_partition(task, opts)) for task in tasks]
    for batches in per_task:  # full batches of 1000 rows, then the rest
        assert {b.num_rows for b in batches[:-1]} == {1000} and 0 < batches[-1].num_rows <= 1000
    compiled = [b for batches in per_task for b in batches]
    assert [b.to_pydict() for b in compiled] == [b.to_pydict() for batches in reference for b in batches]
    rows = [r for b in compiled for r in b.to_pylist()]
    key = itemgetter("vbucket", "offset")
    assert sorted(rows, key=key) == sorted(old_rows(messages), key=key)
    assert len(rows) == 3000 and all(r["uid"] is not None for r in rows)
