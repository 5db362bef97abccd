"""route_message: the server's routing read, on honest and on lying frames.

A canonical-looking frame (its 52 fixed header bytes match) takes the fast
path, which trusts the header but not the variable offsets and lengths behind
it. Whatever those say, route_message must either raise MalformedFrameError
or return exactly what a FlatBuffers reader would read. Only such a frame gets
a stamp position; any other layout gets None and is forwarded as its
canonical_copy, since its ts_broker may share bytes with another field.
"""

from __future__ import annotations

import struct

import flatbuffers
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broky import fbs
from broky.errors import ErrorCode, MalformedFrameError, ProtocolError, UnknownFrameError
from broky.fbs import Body
from broky.protocol import (
    Frame,
    Message,
    Ping,
    decode_frame,
    decode_message,
    encode_frame,
    encode_message,
    route_message,
)
from broky.protocol.layout import (
    HEADER_AT,
    HEADER_END,
    HEADER_NO_UID,
    HEADER_UID,
    KEY_UOFFSET_AT,
    KP_UOFFSET_AT,
    MESSAGE_VTABLE_AT,
    PAYLOAD_UOFFSET_AT,
    STAMPS_AT,
    STAMPS_END,
    TS_BROKER_AT,
    VECTORS_AT,
)
from broky.protocol.message import BODY_LAST, _route_generic, body_type, canonical_copy, pack_stamp_into
from tests.support.generated import BODY_TYPES, ONE_OF_EACH, builder_frames, generated_read, messages
from tests.support.mutations import OVERLAP_MESSAGE, overlap_frame

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
    key_vec = KEY_UOFFSET_AT + struct.unpack_from("<I", frame, KEY_UOFFSET_AT)[0]
    pay_vec = PAYLOAD_UOFFSET_AT + struct.unpack_from("<I", frame, PAYLOAD_UOFFSET_AT)[0]
    where = {
        "key_off": KEY_UOFFSET_AT,
        "pay_off": PAYLOAD_UOFFSET_AT,
        "kp_len": VECTORS_AT[has_uid],
        "key_len": key_vec,
        "pay_len": pay_vec,
    }
    for name, value in lie.items():
        struct.pack_into("<I", frame, where[name], value)
    raw = bytes(frame)
    assert raw[HEADER_AT:HEADER_END] == (HEADER_UID if has_uid else HEADER_NO_UID)  # still the fast path

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
    assert route_message(raw, 0, len(raw)) == (*expected[:2], TS_BROKER_AT)
    # Valid by the bounds checks, so the generated code can read it too.
    reference = generated_read(raw)
    assert isinstance(reference, Message)
    assert expected[:2] == (reference.key_partition, reference.key)
    assert decode_message(raw) == reference
    # However the vectors lie, none of them covers ts_broker: stamping it in place
    # changes nothing else.
    stamped = bytearray(raw)
    struct.pack_into("<q", stamped, TS_BROKER_AT, -1)
    assert decode_message(stamped) == reference._replace(ts_broker=-1)


@pytest.mark.parametrize("has_uid", [False, True])
def test_key_pointing_back_into_the_header_is_read_as_flatbuffers_would(has_uid: bool) -> None:
    # key offset 0 makes the key vector start at its own offset word (value 0),
    # so the key is empty: odd but a valid FlatBuffer, read identically.
    uid = bytes(20) if has_uid else None
    frame = bytearray(encode_message(b"part", b"a.b", b"pay", 0, 0, uid))
    struct.pack_into("<I", frame, KEY_UOFFSET_AT, 0)
    raw = bytes(frame)
    assert route_message(raw, 0, len(raw)) == (b"part", b"", TS_BROKER_AT)
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


@pytest.mark.parametrize("frame", [f for f in ONE_OF_EACH if not isinstance(f, Message)], ids=repr)
def test_every_control_frame_is_told_from_a_message(frame: Frame) -> None:
    # The server's fast path tries route_message on every frame and takes a
    # MalformedFrameError for "a control frame" (body_type tells it which): the frames of
    # the newest version (an Ack a member sends, say) must not look unknown there.
    raw = encode_frame(frame)
    with pytest.raises(MalformedFrameError, match="expected a Message"):
        route_message(raw, 0, len(raw))
    assert body_type(raw, 0, len(raw)) == BODY_TYPES[type(frame)] != Body.Message
    assert decode_frame(raw) == frame


def _bodiless(kind: int) -> bytes:
    """A frame that names union type `kind` and has no body."""
    b = flatbuffers.Builder(32)
    fbs.FrameStart(b)
    fbs.FrameAddBodyType(b, kind)
    b.FinishSizePrefixed(fbs.FrameEnd(b), b"BRKY")
    return bytes(b.Output())


def test_the_last_body_type_is_the_unions_last() -> None:
    # A known type without its body is malformed; past the union's last one it is a
    # newer version's frame: unknown.
    assert BODY_LAST == Body.GroupNotice == max(BODY_TYPES.values())
    for kind in range(2, BODY_LAST + 1):
        with pytest.raises(MalformedFrameError, match="no body"):
            decode_frame(_bodiless(kind))
    for kind in (BODY_LAST + 1, 255):
        with pytest.raises(UnknownFrameError) as info:
            decode_frame(_bodiless(kind))
        assert info.value.body_type == kind


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(messages.map(lambda m: (m, encode_message(*m))), builder_frames(messages)), min_size=1)
)
def test_server_scan_stamps_or_copies_every_message(stream: list[tuple[Message, bytes]]) -> None:
    # The loop a worker runs over one read: frame boundaries, route, then stamp
    # (ts_broker and the position) in place or forward a canonical copy.
    data = b"".join(raw for _, raw in stream)
    buf = bytearray(data)
    pos = 0
    routed: list[tuple[bytes, bytes]] = []
    forwarded: list[bytes] = []
    stamps: list[tuple[int, int, int, int]] = []
    for _, raw in stream:
        end = pos + 4 + struct.unpack_from("<I", data, pos)[0]
        kp, key, ts_pos = route_message(data, pos, end)
        i = len(routed)
        ts, vb, epoch, offset = 1_700_000_000_000_000_000 + i, (i * 7) % 1024, 0x5EED + i, 1000 + i
        stamps.append((ts, vb, epoch, offset))
        if ts_pos is None:
            assert raw[HEADER_AT:HEADER_END] not in (HEADER_UID, HEADER_NO_UID)
            forwarded.append(canonical_copy(data, pos, end, ts, None, vb, epoch, offset))
        else:
            pack_stamp_into(buf, ts_pos, ts, epoch, offset, vb)
            forwarded.append(bytes(buf[pos:end]))
            # Only the stamped region changed: ts_broker and the position.
            diff = [j for j in range(len(raw)) if buf[pos + j] != raw[j]]
            assert all(TS_BROKER_AT <= j < STAMPS_END for j in diff)
        routed.append((kp, key))
        pos = end
    assert routed == [(m.key_partition, m.key) for m, _ in stream]
    for (msg, _), out, (ts, vb, epoch, offset) in zip(stream, forwarded, stamps):
        assert decode_frame(out) == msg._replace(ts_broker=ts, vbucket=vb, epoch=epoch, offset=offset)


def test_a_layout_where_ts_broker_overlaps_a_vector_is_copied_not_stamped() -> None:
    # Found by tests/server/unit/test_server_fanout_fuzz.py: the key_partition offset moved
    # so that its vector's length overlaps the stamps struct. The frame reads
    # fine as it is, but stamping ts_broker in place would break it.
    frame = bytearray(encode_message(b"p1", b"k.a", b"\x00" * 5))
    frame[KP_UOFFSET_AT] = STAMPS_AT + 5 - KP_UOFFSET_AT  # key_partition vector inside the stamps
    raw = bytes(frame)
    ts = 1_700_000_000_123_456_789
    published = decode_message(raw)
    kp, key, ts_pos = route_message(raw, 0, len(raw))
    assert (kp, key, ts_pos) == (published.key_partition, published.key, None)
    copy = canonical_copy(raw, 0, len(raw), ts)
    assert decode_message(copy) == published._replace(ts_broker=ts)
    assert copy[HEADER_AT:HEADER_END] == HEADER_NO_UID
    # What stamping in place would have done: the key_partition's length changes.
    stamped = bytearray(raw)
    struct.pack_into("<q", stamped, TS_BROKER_AT, ts)
    try:
        broken: Message | None = decode_message(bytes(stamped))
    except MalformedFrameError:
        broken = None
    assert broken != published._replace(ts_broker=ts)


def test_a_frame_crafted_against_stamp_probes_is_copied_not_stamped() -> None:
    raw = overlap_frame()
    published = OVERLAP_MESSAGE
    assert raw[HEADER_AT:HEADER_END] not in (HEADER_UID, HEADER_NO_UID)
    assert generated_read(raw) == published == decode_message(raw)
    assert route_message(raw, 0, len(raw)) == (b"p1", b"a.b", None)
    # The trap: probes with all-zero or all-one ts_broker read like the
    # original, a real time does not.
    for probe, key in ((0, b"a.b"), (-1, b"a.b"), (0x18 << 56 | 12345, b"x.y")):
        stamped = bytearray(raw)
        struct.pack_into("<q", stamped, 64, probe)
        assert decode_message(bytes(stamped)).key == key
    # What the server forwards instead: the canonical copy, stamped.
    ts = 0x18 << 56 | 12345
    copy = canonical_copy(raw, 0, len(raw), ts)
    assert decode_message(copy) == generated_read(copy) == published._replace(ts_broker=ts, epoch=0)
    assert route_message(copy, 0, len(copy)) == (b"p1", b"a.b", TS_BROKER_AT)


def test_a_canonical_copy_over_the_frame_limit_is_refused() -> None:
    # Vectors that share bytes: a small frame whose copy is three times larger.
    frame = bytearray(encode_message(b"", b"", b"x" * 1000))
    payload_at = PAYLOAD_UOFFSET_AT + struct.unpack_from("<I", frame, PAYLOAD_UOFFSET_AT)[0]
    table_size = struct.unpack_from("<H", frame, MESSAGE_VTABLE_AT + 2)[0]
    # Message table 4 bytes larger: not canonical, still valid
    struct.pack_into("<H", frame, MESSAGE_VTABLE_AT + 2, table_size + 4)
    struct.pack_into("<I", frame, KP_UOFFSET_AT, payload_at - KP_UOFFSET_AT)  # key_partition = the payload
    struct.pack_into("<I", frame, KEY_UOFFSET_AT, payload_at - KEY_UOFFSET_AT)  # key = the payload
    raw = bytes(frame)
    msg = decode_message(raw)
    assert msg.key_partition == msg.key == msg.payload == b"x" * 1000
    assert len(canonical_copy(raw, 0, len(raw), 1, max_frame_bytes=4000)) > len(raw)
    with pytest.raises(ProtocolError, match="re-encoded in the canonical layout") as info:
        canonical_copy(raw, 0, len(raw), 1, max_frame_bytes=len(raw))
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


# ---------------------------------------------------------------- bounds and buffer types


def builder_message(kp: bytes, key: bytes, payload: bytes) -> bytes:
    """A Message frame written by flatbuffers.Builder (not the canonical layout)."""
    b = flatbuffers.Builder(0)
    vectors = [b.CreateByteVector(v) for v in (payload, key, kp)]
    fbs.MessageStart(b)
    fbs.MessageAddStamps(b, fbs.CreateStamps(b, 1, 0, 0, 0, 0))
    fbs.MessageAddPayload(b, vectors[0])
    fbs.MessageAddKey(b, vectors[1])
    fbs.MessageAddKeyPartition(b, vectors[2])
    body = fbs.MessageEnd(b)
    fbs.FrameStart(b)
    fbs.FrameAddBodyType(b, Body.Message)
    fbs.FrameAddBody(b, body)
    b.FinishSizePrefixed(fbs.FrameEnd(b), b"BRKY")
    return bytes(b.Output())


def test_bounds_outside_the_buffer_are_malformed() -> None:
    frame = encode_message(b"kp", b"a.b", b"payload", 1, 0, bytes(20))
    ping = encode_frame(Ping(1))
    for buf, f, end in (
        (ping[:12], 0, 100),  # end past the buffer (was struct.error)
        (frame, 0, len(frame) + 1),
        (frame, -8, len(frame)),  # a negative start would read from the end
        (frame + frame, -len(frame), len(frame)),
    ):
        for reader in (route_message, decode_message, decode_frame, body_type):
            with pytest.raises(MalformedFrameError, match="outside the buffer"):
                reader(buf, f, end)
    with pytest.raises(MalformedFrameError):
        decode_frame(frame, -4)
    with pytest.raises(MalformedFrameError):
        decode_message(frame, -4)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
@pytest.mark.parametrize("has_uid", [False, True])
def test_route_message_reads_bytearray_and_memoryview(kind: type, has_uid: bool) -> None:
    frame = encode_message(b"kp", b"a.b", b"payload", 1, 0, bytes(20) if has_uid else None)
    builder = builder_message(b"kp", b"a.b", b"payload")
    for raw, ts in ((frame, 5 + TS_BROKER_AT), (builder, None)):
        buf = kind(b"\xee" * 5 + raw + b"\xee" * 3)
        kp, key, ts_pos = route_message(buf, 5, 5 + len(raw))
        assert (kp, key, ts_pos) == (b"kp", b"a.b", ts)
        assert type(kp) is bytes and type(key) is bytes
        with pytest.raises(MalformedFrameError, match="outside the buffer"):
            route_message(buf, 5, len(buf) + 1)


def test_route_message_refuses_other_types() -> None:
    frame = encode_message(b"kp", b"a.b", b"payload")
    with pytest.raises(TypeError, match="route_message reads bytes, bytearray or memoryview, not str"):
        route_message(frame.decode("latin-1"), 0, len(frame))  # type: ignore[arg-type]
