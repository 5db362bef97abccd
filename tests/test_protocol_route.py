"""route_message: the server's routing read, on honest and on lying frames.

A canonical-looking frame (its 52 fixed header bytes match) takes the fast
path, which trusts the header but not the variable offsets and lengths behind
it. Whatever those say, route_message must either raise MalformedFrameError
or return exactly what a FlatBuffers reader would read.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broky.errors import MalformedFrameError, ProtocolError, UnknownFrameError
from broky.protocol import (
    Message,
    Ping,
    decode_frame,
    decode_message,
    encode_frame,
    encode_message,
    route_message,
)
from broky.protocol.message import HEADER_NO_UID, HEADER_UID, TS_BROKER_OFFSET, _route_generic
from tests.test_protocol_generated import builder_frames, generated_read, messages

# Positions (from the start of the size prefix) of the canonical variable words.
KEY_OFFSET_AT = 72
PAYLOAD_OFFSET_AT = 76


def kp_length_at(has_uid: bool) -> int:
    return 100 if has_uid else 80


lies = st.sampled_from([0, 1, 2, 3, 4, 8, 12, 0x7FFF_FFFF, 0xFFFF_FFFF, 0xFFFF_FFF8]) | st.integers(
    0, 2**32 - 1
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages,
    st.dictionaries(
        st.sampled_from(["key_off", "pay_off", "kp_len", "key_len", "pay_len"]), lies, min_size=1
    ),
)
def test_lying_offsets_are_refused_or_read_correctly(msg: Message, lie: dict[str, int]) -> None:
    frame = bytearray(encode_message(*msg))
    has_uid = msg.uid is not None
    key_vec = KEY_OFFSET_AT + struct.unpack_from("<I", frame, KEY_OFFSET_AT)[0]
    pay_vec = PAYLOAD_OFFSET_AT + struct.unpack_from("<I", frame, PAYLOAD_OFFSET_AT)[0]
    where = {
        "key_off": KEY_OFFSET_AT,
        "pay_off": PAYLOAD_OFFSET_AT,
        "kp_len": kp_length_at(has_uid),
        "key_len": key_vec,
        "pay_len": pay_vec,
    }
    for name, value in lie.items():
        struct.pack_into("<I", frame, where[name], value)
    raw = bytes(frame)
    assert raw[4:56] == (HEADER_UID if has_uid else HEADER_NO_UID)  # still the fast path

    # An independent answer: the bounds-checked generic reader.
    try:
        expected = _route_generic(raw, 0, len(raw))
    except MalformedFrameError:
        expected = None
    event("refused" if expected is None else "accepted")
    if expected is None:
        with pytest.raises(MalformedFrameError):
            route_message(raw, 0, len(raw))
        with pytest.raises(MalformedFrameError):
            decode_message(raw)
        return
    assert route_message(raw, 0, len(raw)) == expected
    # Valid by the bounds checks, so the generated code can read it too.
    reference = generated_read(raw)
    assert isinstance(reference, Message)
    assert expected == (reference.key_partition, reference.key, TS_BROKER_OFFSET)
    assert decode_message(raw) == reference


@pytest.mark.parametrize("has_uid", [False, True])
def test_key_pointing_back_into_the_header_is_read_as_flatbuffers_would(has_uid: bool) -> None:
    # key offset 0 makes the key vector start at its own offset word (value 0),
    # so the key is empty: odd but a valid FlatBuffer, read identically.
    uid = bytes(20) if has_uid else None
    frame = bytearray(encode_message(b"part", b"a.b", b"pay", 0, 0, uid))
    struct.pack_into("<I", frame, KEY_OFFSET_AT, 0)
    raw = bytes(frame)
    assert route_message(raw, 0, len(raw)) == (b"part", b"", TS_BROKER_OFFSET)
    assert generated_read(raw) == Message(b"part", b"", b"pay", 0, 0, uid)


@pytest.mark.parametrize("cut", [0, 4, 8, 55, 56, 60, 80, 83, 84, 88, 91])
@pytest.mark.parametrize("has_uid", [False, True])
def test_frames_cut_short_are_refused(cut: int, has_uid: bool) -> None:
    uid = bytes(20) if has_uid else None
    frame = encode_message(b"", b"", b"", 0, 0, uid)
    assert len(frame) >= 92 > cut  # the last vector ends at byte 92 without uid
    raw = frame[:cut]
    with pytest.raises(ProtocolError):
        route_message(raw, 0, len(raw))
    # The same bytes followed by more data that `end` excludes.
    with pytest.raises(ProtocolError):
        route_message(frame + frame, 0, cut)


def test_control_frames_do_not_route() -> None:
    raw = encode_frame(Ping(1))
    with pytest.raises(MalformedFrameError, match="expected a Message"):
        route_message(raw, 0, len(raw))
    # An unknown union type (a newer protocol) is UnknownFrameError.
    frame = bytearray(encode_message(b"k", b"k", b"v"))
    frame[28] = 200  # Frame.body_type in the canonical layout
    with pytest.raises(UnknownFrameError) as info:
        route_message(bytes(frame), 0, len(frame))
    assert info.value.body_type == 200
    with pytest.raises(UnknownFrameError):
        decode_frame(bytes(frame))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(messages.map(lambda m: (m, encode_message(*m))), builder_frames(messages)), min_size=1)
)
def test_server_scan_stamps_every_message_in_place(stream: list[tuple[Message, bytes]]) -> None:
    # The loop a worker runs over one read: frame boundaries, route, stamp.
    buf = bytearray(b"".join(raw for _, raw in stream))
    data = bytes(buf)
    pos = 0
    routed: list[tuple[bytes, bytes]] = []
    while pos < len(data):
        end = pos + 4 + struct.unpack_from("<I", data, pos)[0]
        kp, key, ts_pos = route_message(data, pos, end)
        struct.pack_into("<q", buf, ts_pos, 1_700_000_000_000_000_000 + len(routed))
        routed.append((kp, key))
        pos = end
    assert routed == [(m.key_partition, m.key) for m, _ in stream]
    pos = 0
    for i, (msg, raw) in enumerate(stream):
        got = decode_frame(buf, pos)
        assert got == msg._replace(ts_broker=1_700_000_000_000_000_000 + i)
        # Only the 8 ts_broker bytes changed.
        diff = [j for j in range(len(raw)) if buf[pos + j] != raw[j]]
        assert all(0 <= j - (diff[0] if diff else 0) < 8 for j in diff)
        pos += len(raw)


def test_a_layout_where_ts_broker_overlaps_a_vector_does_not_route() -> None:
    # Found by tests/test_server_fanout_fuzz.py: the key_partition offset moved
    # so that its vector's length overlaps the stamps struct. The frame reads
    # fine as it is, but the server's ts_broker stamp would break it.
    frame = bytearray(encode_message(b"p1", b"k.a", b"\x00" * 5))
    frame[52] = 9  # key_partition offset (Message table at 48): vector at 61, inside stamps (56..72)
    with pytest.raises(MalformedFrameError, match="ts_broker overlaps another field"):
        route_message(bytes(frame), 0, len(frame))
