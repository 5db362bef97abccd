"""The hot frame: Message. Fast encode, decode and routing read, no Builder.

Theory of operation
-------------------
Every Message frame written by Broky has one canonical layout
(broky.protocol.layout); only the three vector lengths and the presence of a
uid vary. The encoder packs it with one cached struct.Struct per shape. The
readers first compare the fixed header's bytes with the canonical header's
and then read the fields at known positions; any other valid layout (another
encoder, flatbuffers.Builder) takes the bounds-checked generic path in
broky.protocol.table. Both paths agree: the property tests check them against
flatbuffers.Builder and the generated accessors.

Every byte position of that layout is defined in broky.protocol.layout (its
header draws the layout); this module asks it for each one and builds its
struct formats from them.

The server stamps ts_broker in place (8 bytes at the position the routing
read returns) and forwards the publisher's bytes unchanged otherwise. It does
so only for the canonical layout, where the stamped region cannot share a
byte with anything a reader reads: every uoffset, the uid and every vector
lie at or after layout.STAMPS_END. In any other layout the stamps struct may
overlap an offset, a length or a vector, so `route_message` returns no stamp
position for it and the server forwards `canonical_copy` instead (decoded,
stamped and re-encoded).
"""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

from broky.errors import (
    ErrorCode,
    LocalProtocolError,
    MalformedFrameError,
    RemoteProtocolError,
    UnknownFrameError,
)
from broky.fbs import Body
from broky.protocol import ksuid
from broky.protocol.layout import (
    EPOCH_AT,
    FIXED_SIZE,
    HEADER_AT,
    HEADER_END,
    HEADER_NO_UID,
    HEADER_SIZE,
    HEADER_UID,
    KEY_UOFFSET_AT,
    OFFSET_AT,
    PAYLOAD_UOFFSET_AT,
    SIZE_AT,
    STAMP_FIELDS,
    STAMPS_AT,
    STAMPS_END,
    TS_BROKER_AT,
    TS_PRODUCER_AT,
    UID_AT,
    UID_SIZE,
    VBUCKET_AT,
    VECTORS_AT,
    shape,
    struct_at,
)
from broky.protocol.table import Buffer, Table, malformed, out_of_buffer, root

BODY_MESSAGE: int = Body.Message
# The union's last member (GroupNotice in version 3): a higher body type is UNKNOWN_FRAME, a
# lower one that is not a Message is some other frame. Taken from the generated union, so that
# a frame added to the schema is never mistaken for an unknown one.
BODY_LAST: int = max(v for v in vars(Body).values() if type(v) is int)

_u32 = struct.Struct("<I").unpack_from
_qq = struct.Struct("<qq").unpack_from
_ts = struct.Struct("<q")
pack_ts_into = _ts.pack_into
# The stamped region from TS_BROKER_AT: ts_broker, and the position (epoch, offset,
# vbucket). pack_stamp_into(buf, frame start + TS_BROKER_AT, ts, epoch, offset, vbucket).
_stamp = struct_at(
    (TS_BROKER_AT, "q"), (EPOCH_AT, "Q"), (OFFSET_AT, "Q"), (VBUCKET_AT, "H"), start=TS_BROKER_AT
)
pack_stamp_into = _stamp.pack_into
# The Stamps struct as a generic reader finds it: ts_producer, ts_broker, epoch, offset, vbucket.
_stamps = struct_at(
    *STAMP_FIELDS,
    start=STAMPS_AT, end=STAMPS_END,
)  # fmt: skip

# Where the key_partition's length word and its bytes lie, without and with uid.
_VECTORS_PLAIN = VECTORS_AT[False]
_FIXED_PLAIN, _FIXED_UID = FIXED_SIZE
# From f: the fixed header, the key and payload uoffsets, and the key_partition's
# length (with a uid; without one it lies where the uid would, inside the skipped
# bytes) -- or, for a frame too short to hold a uid, the key_partition's length
# without uid.
_route_uid = struct_at(
    (HEADER_AT, f"{HEADER_SIZE}s"),
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (VECTORS_AT[True], "I"),
).unpack_from
_route_no_uid = struct_at(
    (HEADER_AT, f"{HEADER_SIZE}s"),
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (VECTORS_AT[False], "I"),
).unpack_from
# From TS_PRODUCER_AT: the stamps, the uoffsets, [the uid,] the key_partition's length.
_decode_no_uid = struct_at(
    *STAMP_FIELDS,
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (VECTORS_AT[False], "I"),
    start=TS_PRODUCER_AT,
).unpack_from
_decode_uid = struct_at(
    *STAMP_FIELDS,
    (KEY_UOFFSET_AT, "I"),
    (PAYLOAD_UOFFSET_AT, "I"),
    (UID_AT, f"{UID_SIZE}s"),
    (VECTORS_AT[True], "I"),
    start=TS_PRODUCER_AT,
).unpack_from

# Message field indexes in schema order.
F_KEY_PARTITION, F_KEY, F_PAYLOAD, F_STAMPS, F_UID = range(5)


class Message(NamedTuple):
    """One message: immutable; ts_* are ns since the Unix epoch (0 = not set); its
    position (vbucket, epoch, offset) is stamped by the worker that accepted it
    (0, 0, 0 in a publish)."""

    key_partition: bytes
    key: bytes
    payload: bytes
    ts_producer: int = 0
    ts_broker: int = 0
    uid: bytes | None = None
    vbucket: int = 0
    epoch: int = 0
    offset: int = 0

    @property
    def uid_text(self) -> str | None:
        """The uid's 27-character KSUID text, or None without a uid."""
        return None if self.uid is None else ksuid.ksuid_text(self.uid)

    @property
    def age(self) -> float:
        """Seconds since the server accepted it (ts_broker), by this machine's clock;
        0.0 when ts_broker is not set (a message not yet published)."""
        return (time.time_ns() - self.ts_broker) / 1e9 if self.ts_broker else 0.0


# (struct, size prefix, header, key uoffset, payload uoffset) per (kp_len, key_len,
# pay_len, has_uid): the struct packs a whole frame of that shape.
_Packer = tuple[struct.Struct, int, bytes, int, int]
_packers: dict[tuple[int, int, int, bool], _Packer] = {}
_MAX_PACKERS = 4096


def _packer(kp_len: int, key_len: int, pay_len: int, has_uid: bool) -> _Packer:
    v = shape(has_uid, kp_len, key_len, pay_len)
    fields = [
        (SIZE_AT, "I"),
        (HEADER_AT, f"{HEADER_SIZE}s"),
        *STAMP_FIELDS,
        (KEY_UOFFSET_AT, "I"),
        (PAYLOAD_UOFFSET_AT, "I"),
    ]
    if has_uid:
        fields.append((UID_AT, f"{UID_SIZE}s"))
    fields += [
        (v.kp_at, f"I{kp_len}s"),
        (v.key_at, f"I{key_len}s"),
        (v.payload_at, f"I{pay_len}s"),
    ]
    entry = (
        struct_at(*fields, end=v.frame_len),
        v.frame_len - 4,
        HEADER_UID if has_uid else HEADER_NO_UID,
        v.key_at - KEY_UOFFSET_AT,
        v.payload_at - PAYLOAD_UOFFSET_AT,
    )
    if len(_packers) >= _MAX_PACKERS:
        _packers.clear()
    _packers[(kp_len, key_len, pay_len, has_uid)] = entry
    return entry


def encode_message(
    key_partition: bytes,
    key: bytes,
    payload: bytes,
    ts_producer: int = 0,
    ts_broker: int = 0,
    uid: bytes | None = None,
    vbucket: int = 0,
    epoch: int = 0,
    offset: int = 0,
) -> bytes:
    """Return the whole Message frame (size prefix included) in canonical layout
    (the Message fields in order: a publisher leaves the position at 0).

    Raises:
        LocalProtocolError: a field is not bytes, uid is not 20 bytes, or a
            number is out of its field's range.
    """
    has_uid = uid is not None
    try:
        kp_len = len(key_partition)
        key_len = len(key)
        pay_len = len(payload)
        try:
            s, size, head, o_key, o_pay = _packers[(kp_len, key_len, pay_len, has_uid)]
        except KeyError:
            s, size, head, o_key, o_pay = _packer(kp_len, key_len, pay_len, has_uid)
        if has_uid:
            if len(uid) != UID_SIZE:  # type: ignore[arg-type]
                raise LocalProtocolError(f"uid must be {UID_SIZE} bytes, got {len(uid)}")  # type: ignore[arg-type]
            return s.pack(size, head, ts_producer, ts_broker, epoch, offset, vbucket, o_key, o_pay, uid,
                          kp_len, key_partition, key_len, key, pay_len, payload)  # fmt: skip
        return s.pack(size, head, ts_producer, ts_broker, epoch, offset, vbucket, o_key, o_pay,
                      kp_len, key_partition, key_len, key, pay_len, payload)  # fmt: skip
    except (struct.error, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode message: {exc}") from None


def message_size(kp_len: int, key_len: int, pay_len: int, has_uid: bool = True) -> int:
    """Length in bytes of the canonical frame of a message with these lengths."""
    return shape(has_uid, kp_len, key_len, pay_len).frame_len


def _canonical(buf: Buffer, f: int, end: int) -> bool:
    head = buf[f + HEADER_AT : f + HEADER_END]
    return head == HEADER_NO_UID or head == HEADER_UID


def route_message(buf: bytes, f: int, end: int) -> tuple[bytes, bytes, int | None]:
    """Routing read of the Message frame in buf[f:end] (0 <= f, end <= len(buf)).

    The three vectors are bounds-checked (payload included, so a frame that
    routes is a frame every subscriber can decode); the payload is not copied.
    buf is bytes; a bytearray or memoryview is accepted at the cost of a copy
    of the frame.

    Returns:
        (key_partition, key, stamp position). The stamp position is where the
        8 bytes of ts_broker lie in buf when the frame has the canonical
        layout: it can be stamped in place and forwarded as is. It is None for
        any other valid layout, where ts_broker may share bytes with another
        field: such a frame cannot be stamped in place; forward
        `canonical_copy(buf, f, end, ts_broker)` instead.

    Raises:
        MalformedFrameError: the frame is not a valid Message frame, or f/end
            lie outside buf.
        UnknownFrameError: its body type is unknown to this version.
        TypeError: buf is not bytes, bytearray or memoryview.
    """
    if type(buf) is not bytes:
        return _route_copy(buf, f, end)
    if f < 0 or end > len(buf):
        raise out_of_buffer(buf, f, end)
    # The fixed-size reads below lie inside buf[f:end]; the vector reads either
    # land inside buf (then the stop <= end checks decide) or past its end
    # (struct.error).
    try:
        if end - f >= _FIXED_UID:
            head, key_off, pay_off, kp_len = _route_uid(buf, f)
            if head == HEADER_UID:
                kp_start = f + _FIXED_UID
            elif head == HEADER_NO_UID:
                kp_len = _u32(buf, f + _VECTORS_PLAIN)[0]
                kp_start = f + _FIXED_PLAIN
            else:
                return _route_generic(buf, f, end)
        elif end - f >= _FIXED_PLAIN:
            head, key_off, pay_off, kp_len = _route_no_uid(buf, f)
            if head != HEADER_NO_UID:
                return _route_generic(buf, f, end)
            kp_start = f + _FIXED_PLAIN
        else:
            return _route_generic(buf, f, end)
        k = f + KEY_UOFFSET_AT + key_off
        key_stop = k + 4 + _u32(buf, k)[0]
        p = f + PAYLOAD_UOFFSET_AT + pay_off
        pay_stop = p + 4 + _u32(buf, p)[0]
    except struct.error:
        raise malformed("vector overruns the frame") from None
    kp_stop = kp_start + kp_len
    if kp_stop > end or key_stop > end or pay_stop > end:
        raise malformed("vector overruns the frame")
    return buf[kp_start:kp_stop], buf[k + 4 : key_stop], f + TS_BROKER_AT


def _route_copy(buf: object, f: int, end: int) -> tuple[bytes, bytes, int | None]:
    """route_message of a bytearray or memoryview: route a bytes copy of the frame."""
    if not isinstance(buf, bytearray | memoryview):
        raise TypeError(f"route_message reads bytes, bytearray or memoryview, not {type(buf).__name__}")
    if f < 0 or end > len(buf):
        raise out_of_buffer(buf, f, end)
    kp, key, at = route_message(bytes(buf[f:end]), 0, end - f)
    return kp, key, None if at is None else at + f


def _route_generic(buf: Buffer, f: int, end: int) -> tuple[bytes, bytes, None]:
    msg = _generic_table(buf, f, end)
    kp, key, _, _ = _generic_refs(msg)
    msg.field(F_UID, UID_SIZE)  # validated like decode_message does
    return bytes(buf[kp[0] : kp[1]]), bytes(buf[key[0] : key[1]]), None


def canonical_copy(
    buf: Buffer,
    f: int,
    end: int,
    ts_broker: int,
    max_frame_bytes: int | None = None,
    vbucket: int = 0,
    epoch: int = 0,
    offset: int = 0,
) -> bytes:
    """The Message frame in buf[f:end] re-encoded in the canonical layout, ts_broker
    and the position set.

    What the server forwards for a Message whose stamp position route_message
    gives as None (any layout but the canonical one): every field as the
    publisher wrote it, but the stamped ones.

    Raises:
        MalformedFrameError, UnknownFrameError: as decode_message.
        RemoteProtocolError: code FRAME_TOO_LARGE, the copy's size prefix would
            exceed max_frame_bytes (possible when the publisher's vectors share
            bytes, or by a few bytes of padding at the very limit).
    """
    msg = decode_message(buf, f, end)
    frame = encode_message(
        msg.key_partition, msg.key, msg.payload, msg.ts_producer, ts_broker, msg.uid, vbucket, epoch, offset
    )
    if max_frame_bytes is not None and len(frame) - 4 > max_frame_bytes:
        raise RemoteProtocolError(
            f"this Message re-encoded in the canonical layout would be a frame of {len(frame) - 4} "
            f"bytes, over the limit of {max_frame_bytes} bytes",
            ErrorCode.FRAME_TOO_LARGE,
        )
    return frame


def decode_message(buf: Buffer, f: int = 0, end: int | None = None) -> Message:
    """Decode the Message frame in buf[f:end] (end defaults to the prefix's size).

    Raises:
        MalformedFrameError: the frame is not a valid Message frame.
        UnknownFrameError: its body type is unknown to this version.
    """
    if end is None:
        if f < 0 or len(buf) - f < 4:
            raise malformed("shorter than a size prefix")
        end = f + 4 + _u32(buf, f)[0]
        if end > len(buf):
            raise malformed("size prefix larger than the buffer")
    elif f < 0 or end > len(buf):
        raise out_of_buffer(buf, f, end)
    head = buf[f + HEADER_AT : f + HEADER_END]
    uid: bytes | None
    try:  # reads past the buffer raise struct.error; past `end`, the checks below
        if head == HEADER_UID:
            ts_p, ts_b, epoch, offset, vb, key_off, pay_off, uid, kp_len = _decode_uid(
                buf, f + TS_PRODUCER_AT
            )
            kp_start = f + _FIXED_UID
        elif head == HEADER_NO_UID:
            ts_p, ts_b, epoch, offset, vb, key_off, pay_off, kp_len = _decode_no_uid(buf, f + TS_PRODUCER_AT)
            kp_start = f + _FIXED_PLAIN
            uid = None
        else:
            return _decode_generic(buf, f, end)
        kp_stop = kp_start + kp_len
        k = f + KEY_UOFFSET_AT + key_off
        key_stop = k + 4 + _u32(buf, k)[0]
        p = f + PAYLOAD_UOFFSET_AT + pay_off
        pay_stop = p + 4 + _u32(buf, p)[0]
    except struct.error:
        raise malformed("vector overruns the frame") from None
    if kp_stop > end or key_stop > end or pay_stop > end:
        raise malformed("vector overruns the frame")
    return Message(
        bytes(buf[kp_start:kp_stop]),
        bytes(buf[k + 4 : key_stop]),
        bytes(buf[p + 4 : pay_stop]),
        ts_p,
        ts_b,
        uid,
        vb,
        epoch,
        offset,
    )


def _decode_generic(buf: Buffer, f: int, end: int) -> Message:
    msg = _generic_table(buf, f, end)
    kp, key, payload, stamps = _generic_refs(msg)
    ts_p, ts_b, epoch, offset, vb = _stamps.unpack_from(buf, stamps)
    uid_pos = msg.field(F_UID, UID_SIZE)
    return Message(
        bytes(buf[kp[0] : kp[1]]),
        bytes(buf[key[0] : key[1]]),
        bytes(buf[payload[0] : payload[1]]),
        ts_p,
        ts_b,
        bytes(buf[uid_pos : uid_pos + UID_SIZE]) if uid_pos else None,
        vb,
        epoch,
        offset,
    )


def body_type(buf: Buffer, f: int, end: int) -> int:
    """The union type of the frame in buf[f:end] (validated root table)."""
    if f < 0 or end > len(buf):
        raise out_of_buffer(buf, f, end)
    if end - f >= _FIXED_PLAIN and _canonical(buf, f, end):
        return BODY_MESSAGE
    return root(buf, f, end).u8(0)


def _generic_table(buf: Buffer, f: int, end: int) -> Table:
    frame = root(buf, f, end)
    kind = frame.u8(0)
    if kind != BODY_MESSAGE:
        if kind == 0:
            raise malformed("frame has no body")
        raise (
            UnknownFrameError(kind)
            if kind > BODY_LAST
            else MalformedFrameError(f"expected a Message frame, got body type {kind}")
        )
    body = frame.table(1)
    if body is None:
        raise malformed("frame has no body")
    return body


def _generic_refs(msg: Table) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], int]:
    spans = []
    for index, name in ((F_KEY_PARTITION, "key_partition"), (F_KEY, "key"), (F_PAYLOAD, "payload")):
        start, n = msg.vector(index, 1)
        if not start:
            raise malformed(f"Message.{name} is required")
        spans.append((start, start + n))
    stamps = msg.field(F_STAMPS, _stamps.size)
    if not stamps:
        raise malformed("Message.stamps is required")
    return spans[0], spans[1], spans[2], stamps
