"""The canonical Message layout has one owner, broky.protocol.layout.

Its writer's and reader's views (`shape`, `read_shape`) agree with the
encoder; `struct_at` builds the formats the readers use. The three compiled
twins read their positions from it when they are configured: each gives back
exactly the owner's values, and a twin configured with a position moved
does something else with the same input than the twin configured with the
owner's layout, so no position is spelled in C instead of asked for (and the
property tests of each twin would catch it against its Python reference).
"""

from __future__ import annotations

import struct
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.client import pubpack
from broky.protocol import encode_message, layout
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.protocol.ksuid import ALPHABET
from broky.protocol.layout import (
    EPOCH_AT,
    FIXED_SIZE,
    HEADER_AT,
    HEADER_END,
    HEADER_NO_UID,
    HEADER_UID,
    KEY_UOFFSET_AT,
    OFFSET_AT,
    PAYLOAD_UOFFSET_AT,
    TS_BROKER_AT,
    TS_PRODUCER_AT,
    UID_AT,
    UID_END,
    VBUCKET_AT,
    VECTORS_AT,
    read_shape,
    shape,
    struct_at,
)
from broky.server.shard import fastpath
from broky.server.shard.sequences import Sequences
from broky.spark import readcols

lengths = st.integers(0, 300)


@settings(max_examples=300, deadline=None)
@given(has_uid=st.booleans(), kp_len=lengths, key_len=lengths, pay_len=lengths)
def test_shape_is_where_the_encoder_puts_the_vectors(
    has_uid: bool, kp_len: int, key_len: int, pay_len: int
) -> None:
    kp, key, payload = b"k" * kp_len, b"e" * key_len, b"p" * pay_len
    frame = encode_message(kp, key, payload, 1, 2, bytes(range(20)) if has_uid else None)
    v = shape(has_uid, kp_len, key_len, pay_len)
    assert v.frame_len == len(frame) and v.frame_len % 8 == 0
    assert frame[HEADER_AT:HEADER_END] == (HEADER_UID if has_uid else HEADER_NO_UID)
    assert struct.unpack_from("<q", frame, TS_PRODUCER_AT) == (1,)
    assert struct.unpack_from("<q", frame, TS_BROKER_AT) == (2,)
    if has_uid:
        assert frame[UID_AT:UID_END] == bytes(range(20))
    for at, vector in ((v.kp_at, kp), (v.key_at, key), (v.payload_at, payload)):
        assert struct.unpack_from("<I", frame, at) == (len(vector),)
        assert frame[at + 4 : at + 4 + len(vector)] == vector
    key_uoffset, payload_uoffset = struct.unpack_from("<II", frame, KEY_UOFFSET_AT)
    assert read_shape(has_uid, len(frame) - 4, key_uoffset, payload_uoffset, kp_len) == v


def test_read_shape_refuses_vectors_out_of_order_or_outside_the_frame() -> None:
    v = shape(True, 2, 3, 5)
    key_uoffset, payload_uoffset = v.key_at - KEY_UOFFSET_AT, v.payload_at - PAYLOAD_UOFFSET_AT
    size = v.frame_len - 4
    assert read_shape(True, size, key_uoffset, payload_uoffset, 2) == v
    assert read_shape(True, size, key_uoffset + 4, payload_uoffset, 2) is None  # key not after key_partition
    assert read_shape(True, size, key_uoffset, payload_uoffset, 7) is None  # key_partition runs into it
    assert read_shape(False, size, key_uoffset, payload_uoffset, 2) is None  # vectors start elsewhere
    assert read_shape(True, size, key_uoffset, v.key_at - PAYLOAD_UOFFSET_AT, 2) is None  # payload on the key
    assert read_shape(True, v.payload_at - 4 + 3, key_uoffset, payload_uoffset, 2) is None  # past the end
    assert read_shape(True, v.payload_at, key_uoffset, payload_uoffset, 2) is not None  # just inside


def test_struct_at_fills_the_gaps_and_refuses_overlaps() -> None:
    assert struct_at((4, "I"), (12, "q"), start=4, end=24).format == "<I4xq4x"
    assert struct_at((0, "I"), (4, "52s"), (72, "II"), (100, "I")).format == "<I52s16xII20xI"
    with pytest.raises(ValueError, match="overlaps"):
        struct_at((0, "q"), (4, "I"))
    with pytest.raises(ValueError, match="past the end"):
        struct_at((0, "q"), end=4)


# ---------------------------------------------------------------- the compiled twins

# What each twin reads from the owner, by the owner's names (broky/protocol/_layout.h).
TWIN_NAMES = {
    "HEADER_AT",
    "HEADER_END",
    "HEADER_UID",
    "HEADER_NO_UID",
    "TS_PRODUCER_AT",
    "TS_BROKER_AT",
    "EPOCH_AT",
    "OFFSET_AT",
    "VBUCKET_AT",
    "KEY_UOFFSET_AT",
    "PAYLOAD_UOFFSET_AT",
    "UID_AT",
    "VECTORS_AT",
    "FIXED_SIZE",
}


def _twins() -> dict[str, Any]:
    """The compiled twins, by name; a test fails (with the reason) without them."""
    if fastpath.pure_requested():
        pytest.skip(f"{fastpath.ENV_PURE} is set: no compiled twins")
    from broky.client import _pubpack
    from broky.server.shard import _feedscan

    assert fastpath.compiled_scan is not None, fastpath.description
    assert pubpack.compiled is not None, pubpack.description
    assert readcols.compiled is not None, readcols.description
    return {"feedscan": _feedscan, "pubpack": _pubpack, "readcols": readcols.compiled}


def test_the_twins_were_configured_with_the_owners_positions() -> None:
    for name, twin in _twins().items():
        configured = twin.layout()
        assert configured is not None, name
        assert set(configured) == TWIN_NAMES, name
        assert configured == {n: getattr(layout, n) for n in TWIN_NAMES}, name


def _configure(name: str, twin: Any, owner: object) -> None:
    if name == "feedscan":
        twin.configure(owner, MIN_FRAME_SIZE)
    elif name == "readcols":
        twin.configure(owner, MIN_FRAME_SIZE, ALPHABET.encode())
    else:
        twin.configure(owner)


@contextmanager
def _configured(name: str, twin: Any, **moved: object) -> Iterator[None]:
    """The twin configured with the owner's layout but for `moved`; the owner's again after."""
    owner = types.SimpleNamespace(**{n: getattr(layout, n) for n in TWIN_NAMES})
    for n, value in moved.items():
        setattr(owner, n, value)
    try:
        _configure(name, twin, owner)
        yield
    finally:
        _configure(name, twin, layout)
        assert twin.layout() == {n: getattr(layout, n) for n in TWIN_NAMES}


def _flip(header: bytes) -> bytes:
    return header[:20] + bytes([header[20] ^ 1]) + header[21:]


# Each name the twins read, moved so that the moved layout still passes the twin's
# checks: the twin must then read or write the frame somewhere else.
MOVES: dict[str, dict[str, object]] = {
    "HEADER_AT": {"HEADER_AT": HEADER_AT + 1, "HEADER_END": HEADER_END + 1},
    "HEADER_UID": {"HEADER_UID": _flip(HEADER_UID)},
    "HEADER_NO_UID": {"HEADER_NO_UID": _flip(HEADER_NO_UID)},
    "TS_PRODUCER_AT": {"TS_PRODUCER_AT": TS_PRODUCER_AT + 8},
    "TS_BROKER_AT": {"TS_BROKER_AT": TS_BROKER_AT - 8},
    "EPOCH_AT": {"EPOCH_AT": EPOCH_AT + 4},
    "OFFSET_AT": {"OFFSET_AT": OFFSET_AT - 4},
    "VBUCKET_AT": {"VBUCKET_AT": VBUCKET_AT + 2},
    "KEY_UOFFSET_AT": {"KEY_UOFFSET_AT": KEY_UOFFSET_AT + 4},
    "PAYLOAD_UOFFSET_AT": {"PAYLOAD_UOFFSET_AT": PAYLOAD_UOFFSET_AT - 4},
    "UID_AT": {"UID_AT": UID_AT - 4},
    "VECTORS_AT": {
        "VECTORS_AT": (VECTORS_AT[0], VECTORS_AT[1] + 4),
        "FIXED_SIZE": (FIXED_SIZE[0], FIXED_SIZE[1] + 4),
    },
    "FIXED_SIZE": {"FIXED_SIZE": (FIXED_SIZE[0], FIXED_SIZE[1] + 100)},
}
# The names each twin uses (the others it reads only to check them, or not at all).
USES = {
    "feedscan": {
        "HEADER_AT",
        "HEADER_UID",
        "HEADER_NO_UID",
        "TS_BROKER_AT",
        "EPOCH_AT",
        "OFFSET_AT",
        "VBUCKET_AT",
        "KEY_UOFFSET_AT",
        "PAYLOAD_UOFFSET_AT",
        "VECTORS_AT",
        "FIXED_SIZE",
    },
    "pubpack": {
        "HEADER_AT",
        "HEADER_UID",
        "TS_PRODUCER_AT",
        "KEY_UOFFSET_AT",
        "PAYLOAD_UOFFSET_AT",
        "UID_AT",
        "VECTORS_AT",
    },
    "readcols": {
        "HEADER_AT",
        "HEADER_UID",
        "HEADER_NO_UID",
        "TS_PRODUCER_AT",
        "TS_BROKER_AT",
        "EPOCH_AT",
        "OFFSET_AT",
        "VBUCKET_AT",
        "KEY_UOFFSET_AT",
        "PAYLOAD_UOFFSET_AT",
        "UID_AT",
        "VECTORS_AT",
        "FIXED_SIZE",
    },
}


def _feedscan_run(twin: Any) -> object:
    """What scan() does with a read of canonical Messages with and without uid, all routed."""
    frames = [
        encode_message(
            b"p%d" % i, b"k.%d" % i, b"x" * (i * 7), 10 + i, 0, bytes(range(i, i + 20)) if i % 2 else None
        )
        for i in range(8)
    ]
    routes: dict[bytes, tuple[tuple[str, ...], int]] = {}
    for i, frame in enumerate(frames):
        v = shape(bool(i % 2), 2, 3, i * 7)
        routes[frame[v.kp_at : v.key_at + 4 + 3]] = (("target",), 3 * i)
    runs: list[Any] = []
    seqs = Sequences(epoch=77).state
    try:
        pos, buf, published, unmatched = twin.scan(
            b"".join(frames), 0, None, 1234, routes, 1 << 20, runs, seqs, None, None, 0
        )
    except ValueError as exc:
        return repr(exc)
    return pos, None if buf is None else bytes(buf), published, unmatched, runs


def _pubpack_run(twin: Any) -> object:
    """What encode() and stamp() make of one message."""
    seq = pubpack.new_sequence()
    seq.start, seq.until, seq.pre, seq.next = 0, 1 << 62, bytes(range(12)), 5
    sample = encode_message(b"kp", b"a.b", bytes(9), 0, 0, bytes(20))
    makes: list[Callable[[], object]] = [
        lambda: twin.encode(b"kp", b"a.b", b"payload", 7, bytes(range(20))),
        lambda: twin.stamp(sample, b"123456789", 7, seq),
    ]
    out: list[object] = []
    for make in makes:
        try:
            out.append(make())
        except ValueError as exc:
            out.append(repr(exc))
    return out


def _readcols_run(twin: Any) -> object:
    """What a Decoder makes of canonical Messages with and without uid (every field differs
    from its neighbours, so a field read elsewhere reads another value)."""
    data = b"".join(
        encode_message(
            b"p%d" % i,
            b"k.%d" % i,
            b"x" * (i * 7),
            10_000 * (i + 1),
            900_000 * (i + 1),
            bytes(range(i, i + 20)) if i % 2 else None,
            i,
            1000 + i,
            5000 + i,
        )
        for i in range(8)
    )
    decoder = twin.Decoder(100, 1 << 20)
    try:
        pos = decoder.scan(data, 0, len(data), b"\x01" * 1024, 1 << 20)
    except (ValueError, OverflowError) as exc:
        return repr(exc)
    return pos, decoder.take()


RUNS: dict[str, Callable[[Any], object]] = {
    "feedscan": _feedscan_run,
    "pubpack": _pubpack_run,
    "readcols": _readcols_run,
}


@pytest.mark.parametrize("twin_name", ["feedscan", "pubpack", "readcols"])
def test_a_twin_reads_every_position_from_its_configuration(twin_name: str) -> None:
    assert set(MOVES) | {"HEADER_END"} == TWIN_NAMES == set().union(*USES.values(), {"HEADER_END"})
    twin = _twins()[twin_name]
    run = RUNS[twin_name]
    expected = run(twin)
    if twin_name == "pubpack":  # the reference: what the owner's layout gives
        assert expected == [
            encode_message(b"kp", b"a.b", b"payload", 7, 0, bytes(range(20))),
            encode_message(b"kp", b"a.b", b"123456789", 7, 0, bytes(range(12)) + (5).to_bytes(8, "little")),
        ]
    elif twin_name == "readcols":  # the reference decoder's, from the same frames
        assert isinstance(expected, tuple) and expected[1][0] == 8  # every message a row
        assert expected == _readcols_run(types.SimpleNamespace(Decoder=readcols.PyDecoder))
    else:
        assert isinstance(expected, tuple) and expected[2] == 8  # every message handled
    for name in sorted(USES[twin_name]):
        with _configured(twin_name, twin, **MOVES[name]):
            assert run(twin) != expected, f"{twin_name} ignores a moved {name}"


def test_a_twin_refuses_a_layout_it_cannot_hold_and_keeps_its_own() -> None:
    for name, twin in _twins().items():
        for moved in (
            {"TS_BROKER_AT": VECTORS_AT[0]},  # ts_broker among the vectors
            {"HEADER_UID": HEADER_UID[:-1]},  # headers of two sizes
            {"VECTORS_AT": (VECTORS_AT[0], UID_END - 4)},  # the uid runs into the vectors
            {"FIXED_SIZE": (FIXED_SIZE[0], 1000)},  # more than a twin holds
            {"KEY_UOFFSET_AT": "72"},
        ):
            with pytest.raises((ValueError, TypeError)), _configured(name, twin, **moved):
                pass
            assert twin.layout() == {n: getattr(layout, n) for n in TWIN_NAMES}, (name, moved)
