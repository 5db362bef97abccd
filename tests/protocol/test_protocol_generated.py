"""The hand-written codec agrees with the code flatc generated, in both directions.

1. Whatever the codec writes (`encode_message`, `encode_frame`), the generated
   accessors in broky.fbs read back the same values.
2. Whatever `flatbuffers.Builder` writes through the generated helpers (fields
   added in any order, defaults omitted or forced, optional fields absent,
   vectors created in any order, unreferenced bytes in between), the codec
   (`decode_frame`, `decode_message`, `route_message`) reads the same values.

The strategies and the reference reader/writer are in tests/support/generated.py
(the other protocol tests use them too).
"""

from __future__ import annotations

import random

import flatbuffers
import pytest
from hypothesis import HealthCheck, given, settings

from broky import fbs
from broky.errors import FrameTooLargeError, LocalProtocolError
from broky.fbs import Body
from broky.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    RESUME_TOKEN_BYTES,
    Ack,
    AckKind,
    Frame,
    FrameReader,
    MapUpdate,
    Message,
    Position,
    ReadDone,
    Subscribe,
    Welcome,
    WelcomeTemplate,
    decode_frame,
    decode_message,
    encode_frame,
    encode_message,
    route_message,
)
from broky.protocol.layout import HEADER_AT, HEADER_END, HEADER_NO_UID, HEADER_UID, TS_BROKER_AT
from broky.protocol.message import canonical_copy, message_size, pack_stamp_into
from broky.protocol.table import root as table_root
from tests.support.generated import (
    BODY_TYPES,
    ONE_OF_EACH,
    E,
    builder_frames,
    control_frames,
    generated_read,
    large_control_frames,
    large_messages,
    map_updates,
    messages,
    welcomes,
)

# ---------------------------------------------------------------- strategies


# ---------------------------------------------------------------- reference reader (generated code)


# ---------------------------------------------------------------- reference writer (flatbuffers.Builder)


# ---------------------------------------------------------------- codec -> generated code

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(messages)
def test_encode_message_reads_back_through_generated_accessors(msg: Message) -> None:
    frame = encode_message(*msg)
    assert len(frame) == message_size(
        len(msg.key_partition), len(msg.key), len(msg.payload), msg.uid is not None
    )
    assert len(frame) % 8 == 0
    assert generated_read(frame) == msg
    assert encode_frame(msg) == frame


@SETTINGS
@given(control_frames)
def test_encode_frame_reads_back_through_generated_accessors(frame: Frame) -> None:
    assert generated_read(encode_frame(frame)) == frame


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(welcomes)
def test_welcome_reads_back_through_generated_accessors(welcome: Welcome) -> None:
    assert generated_read(encode_frame(welcome)) == welcome
    # The template patches the connection id, the resume token, and the resumed table when there is one.
    token = bytes(range(7, 7 + RESUME_TOKEN_BYTES))
    patched = WelcomeTemplate(welcome).for_connection(welcome.connection_id ^ 0x5A5A, token, welcome.resumed)
    assert generated_read(patched) == welcome._replace(
        connection_id=welcome.connection_id ^ 0x5A5A, resume_token=token
    )


# ---------------------------------------------------------------- Builder -> codec


def _check_message_readers(msg: Message, frame: bytes) -> None:
    assert decode_frame(frame) == msg
    assert decode_message(frame) == msg
    # The readers take (buffer, start, end): the frame in the middle of a larger buffer.
    padded = b"\xa5" * 13 + frame + b"\x5a" * 7
    assert decode_message(padded, 13, 13 + len(frame)) == msg
    assert decode_frame(padded, 13) == msg
    kp, key, ts_pos = route_message(padded, 13, 13 + len(frame))
    assert (kp, key) == (msg.key_partition, msg.key)
    assert type(kp) is bytes and type(key) is bytes
    # The server stamps ts_broker and the position (vbucket, epoch, offset).
    expected = msg._replace(ts_broker=-12345, vbucket=517, epoch=2**64 - 1, offset=2**63 + 9)
    if frame[HEADER_AT:HEADER_END] in (HEADER_UID, HEADER_NO_UID):
        # The canonical layout: ts_broker sits where route_message says, and
        # stamping in place changes only the stamped fields.
        assert ts_pos == 13 + TS_BROKER_AT
        stamped = bytearray(frame)
        pack_stamp_into(stamped, ts_pos - 13, -12345, 2**64 - 1, 2**63 + 9, 517)
        assert decode_message(stamped) == expected
        assert generated_read(bytes(stamped)) == expected
    else:
        # Any other layout is not stamped in place: the server forwards a
        # canonical copy that differs from the original in the stamped fields only.
        assert ts_pos is None
        forwarded = canonical_copy(padded, 13, 13 + len(frame), -12345, None, 517, 2**64 - 1, 2**63 + 9)
        assert forwarded == encode_message(*expected)
        assert generated_read(forwarded) == expected


@SETTINGS
@given(builder_frames(messages))
def test_builder_messages_read_by_fast_decoder(case: tuple[Frame, bytes]) -> None:
    msg, frame = case
    assert isinstance(msg, Message)
    assert generated_read(frame) == msg  # the writer itself is right
    _check_message_readers(msg, frame)


@SETTINGS
@given(messages)
def test_canonical_messages_read_and_route(msg: Message) -> None:
    frame = encode_message(*msg)
    _check_message_readers(msg, frame)
    assert route_message(frame, 0, len(frame))[2] == TS_BROKER_AT


LARGE = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@LARGE
@given(large_messages())
def test_large_messages_read_back_through_generated_accessors(msg: Message) -> None:
    frame = encode_message(*msg)
    assert len(frame) - 4 <= DEFAULT_MAX_FRAME_BYTES
    assert generated_read(frame) == msg
    _check_message_readers(msg, frame)


@LARGE
@given(builder_frames(large_messages()))
def test_large_builder_messages_read_by_fast_decoder(case: tuple[Frame, bytes]) -> None:
    msg, frame = case
    assert isinstance(msg, Message)
    assert generated_read(frame) == msg
    _check_message_readers(msg, frame)


@LARGE
@given(large_control_frames())
def test_large_control_frames_agree_with_generated_code(frame: Frame) -> None:
    raw = encode_frame(frame)
    assert len(raw) - 4 <= DEFAULT_MAX_FRAME_BYTES
    assert generated_read(raw) == frame
    assert decode_frame(raw) == frame


@LARGE
@given(builder_frames(large_control_frames()))
def test_large_builder_control_frames_read_by_decode_frame(case: tuple[Frame, bytes]) -> None:
    frame, raw = case
    assert generated_read(raw) == frame
    assert decode_frame(raw) == frame


@SETTINGS
@given(builder_frames(control_frames))
def test_builder_control_frames_read_by_decode_frame(case: tuple[Frame, bytes]) -> None:
    frame, data = case
    assert generated_read(data) == frame
    assert decode_frame(data) == frame
    assert decode_frame(b"\x00" * 5 + data + b"\x00", 5) == frame


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(builder_frames(welcomes | map_updates))
def test_builder_welcome_and_map_update_read_by_decode_frame(case: tuple[Frame, bytes]) -> None:
    frame, data = case
    assert decode_frame(data) == frame


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(map_updates)
def test_map_update_reads_back_through_generated_accessors(update: MapUpdate) -> None:
    assert generated_read(encode_frame(update)) == update


# ---------------------------------------------------------------- large frames


def _payload_for_frame_size(size: int, has_uid: bool) -> int:
    """Payload length whose canonical frame (prefix included) is exactly `size` bytes."""
    n = size - message_size(2, 5, 0, has_uid) + 8
    while message_size(2, 5, n, has_uid) > size:
        n -= 1
    assert message_size(2, 5, n, has_uid) == size
    return n


@pytest.mark.parametrize("has_uid", [True, False])
def test_largest_frame_round_trips_and_one_more_byte_is_refused(has_uid: bool) -> None:
    # Canonical frames are padded to 8 bytes, so the largest one is 1 MiB in all
    # (prefix value 1 MiB - 4); one more payload byte makes it 1 MiB + 4.
    uid = bytes(range(20)) if has_uid else None
    n = _payload_for_frame_size(DEFAULT_MAX_FRAME_BYTES, has_uid)
    payload = random.Random(n).randbytes(n)
    msg = Message(b"kp", b"a.b.c", payload, 1, 2, uid)
    frame = encode_message(*msg)
    assert len(frame) == DEFAULT_MAX_FRAME_BYTES
    assert generated_read(frame) == msg
    assert decode_frame(frame) == msg
    assert route_message(frame, 0, len(frame))[:2] == (b"kp", b"a.b.c")
    reader = FrameReader()
    reader.feed(frame)
    assert reader.frames() == [frame]
    # The limit is inclusive: a prefix equal to it is accepted, one less refuses.
    exact = FrameReader(max_frame_bytes=len(frame) - 4)
    exact.feed(frame)
    assert exact.frames() == [frame]
    under = FrameReader(max_frame_bytes=len(frame) - 5)
    under.feed(frame)
    with pytest.raises(FrameTooLargeError):
        under.next_frame()

    bigger = encode_message(b"kp", b"a.b.c", payload + b"x", 1, 2, uid)
    assert len(bigger) - 4 > DEFAULT_MAX_FRAME_BYTES
    reader = FrameReader()
    reader.feed(bigger[:4])  # the prefix alone is enough to refuse it
    with pytest.raises(FrameTooLargeError) as info:
        reader.next_frame()
    assert info.value.size == len(bigger) - 4
    assert info.value.limit == DEFAULT_MAX_FRAME_BYTES
    assert reader.buffered == 4


def test_large_builder_message_read_by_fast_decoder() -> None:
    payload = random.Random(1).randbytes(700_000)
    key = b"k." * 30_000 + b"end"
    kp = random.Random(2).randbytes(60_000)
    b = flatbuffers.Builder(0)
    pay_off = b.CreateByteVector(payload)
    kp_off = b.CreateByteVector(kp)
    key_off = b.CreateByteVector(key)
    fbs.MessageStart(b)
    fbs.MessageAddKey(b, key_off)
    fbs.MessageAddStamps(b, fbs.CreateStamps(b, 7, 8, 0, 0, 0))
    fbs.MessageAddPayload(b, pay_off)
    fbs.MessageAddKeyPartition(b, kp_off)
    body = fbs.MessageEnd(b)
    fbs.FrameStart(b)
    fbs.FrameAddBody(b, body)
    fbs.FrameAddBodyType(b, Body.Message)
    b.FinishSizePrefixed(fbs.FrameEnd(b), b"BRKY")
    frame = bytes(b.Output())
    assert len(frame) - 4 <= DEFAULT_MAX_FRAME_BYTES
    msg = Message(kp, key, payload, 7, 8, None)
    _check_message_readers(msg, frame)
    assert encode_message(*msg) != frame and decode_frame(encode_message(*msg)) == msg


def test_read_done_writes_moved_only_when_true() -> None:
    # A ReadDone of a vbucket owned here is the frame it was before `moved` existed (field 7
    # absent); a moved one carries it and decodes back.
    plain = ReadDone(3, 517, 2**63, 10_001, 4, True, 2)
    moved = plain._replace(moved=True)
    before = encode_frame(plain)
    body = table_root(before, 0, len(before)).table(1)
    assert body is not None and body.field(7, 1) == 0
    assert decode_frame(before, 0, len(before)) == plain
    frame = encode_frame(moved)
    assert len(frame) > len(before)
    assert decode_frame(frame, 0, len(frame)) == moved
    with pytest.raises(LocalProtocolError):
        encode_frame(plain._replace(moved=1))  # type: ignore[arg-type]


# ---------------------------------------------------------------- every frame, version 3's too


def _union_members() -> dict[str, int]:
    return {name: value for name, value in vars(Body).items() if type(value) is int and name != "NONE"}


def test_the_tests_know_every_frame_of_the_union() -> None:
    # A frame added to the schema must be added to the strategies, the reference reader
    # (generated_read) and the reference writer (Writer.body) above: this fails until it is.
    members = _union_members()
    assert sorted(BODY_TYPES.values()) == sorted(members.values()) == list(range(1, len(members) + 1))
    assert {cls.__name__: kind for cls, kind in BODY_TYPES.items()} == members
    assert sorted(BODY_TYPES[type(f)] for f in ONE_OF_EACH) == sorted(members.values())
    for frame in ONE_OF_EACH:
        raw = encode_frame(frame)
        assert generated_read(raw) == frame == decode_frame(raw)


def test_ack_delay_defaults_to_minus_one_on_the_wire() -> None:
    # -1 (the subscription's backoff) is the schema's default: the codec leaves the field
    # out, an absent field reads as -1 through both readers, and a -1 written anyway
    # (ForceDefaults, another client's builder) reads the same.
    plain = Ack(3, AckKind.NACK, (Position(517, E, 9),))
    assert plain.delay_ms == -1
    raw = encode_frame(plain)
    body = table_root(raw, 0, len(raw)).table(1)
    assert body is not None and body.field(3, 4) == 0
    assert decode_frame(raw) == generated_read(raw) == plain
    b = flatbuffers.Builder(64)
    b.ForceDefaults(True)
    fbs.AckStart(b)
    fbs.AckAddSid(b, 3)
    fbs.AckAddKind(b, AckKind.NACK)
    fbs.AckAddDelayMs(b, -1)
    body_at = fbs.AckEnd(b)
    fbs.FrameStart(b)
    fbs.FrameAddBodyType(b, Body.Ack)
    fbs.FrameAddBody(b, body_at)
    b.FinishSizePrefixed(fbs.FrameEnd(b), b"BRKY")
    forced = bytes(b.Output())
    forced_body = table_root(forced, 0, len(forced)).table(1)
    assert forced_body is not None and forced_body.field(3, 4) != 0
    assert decode_frame(forced) == generated_read(forced) == Ack(3, AckKind.NACK, (), -1)
    # Any other delay is written, 0 (redeliver at once) included.
    for delay in (0, 1, 500, 2**31 - 1, -2, -(2**31)):
        raw = encode_frame(plain._replace(delay_ms=delay))
        assert decode_frame(raw) == generated_read(raw) == plain._replace(delay_ms=delay)


@pytest.mark.parametrize(
    "sub",
    [
        Subscribe(1, b"a.>"),
        Subscribe(1, b"a.>", group=""),
        Subscribe(1, b"a.>", group="billing"),
        Subscribe(1, b"a.>", group="billing", ack=True, dead_letter=b""),
        Subscribe(1, b"a.>", group="billing", ack=True, dead_letter=b"orders.dead"),
    ],
    ids=repr,
)
def test_absent_and_present_group_and_dead_letter_are_told_apart(sub: Subscribe) -> None:
    raw = encode_frame(sub)
    body = table_root(raw, 0, len(raw)).table(1)
    assert body is not None
    assert (body.field(6, 4) != 0) == (sub.group is not None)  # group
    assert (body.field(14, 4) != 0) == (sub.dead_letter is not None)  # dead_letter
    assert decode_frame(raw) == generated_read(raw) == sub


def test_a_subscribe_without_version_3_fields_is_the_version_2_frame() -> None:
    # The codec writes no version-3 field at its default: a plain Subscribe is byte for
    # byte what a version-2 client writes, and a version-2 server reads it as before.
    sub = Subscribe(7, b"orders.*", b"tenant-1", (Position(3, E, 4),), 5, 6)
    raw = encode_frame(sub)
    body = table_root(raw, 0, len(raw)).table(1)
    assert body is not None
    assert all(body.field(i, 1) == 0 for i in range(6, 16))
    assert body.vt_size <= 4 + 2 * 6  # the vtable ends at `last`, the last version-2 field
