"""The hot frame: Message. Fast encode, decode and routing read, no Builder.

Theory of operation
-------------------
Every Message frame written by Broky has one canonical layout (below); only
the three vector lengths and the presence of a uid vary. The encoder packs it
with one cached struct.Struct per shape. The readers first compare 48 fixed
header bytes with the canonical header and then read the fields at known
offsets; any other valid layout (another encoder, flatbuffers.Builder) takes
the bounds-checked generic path in broky.protocol.table. Both paths agree:
the property tests check them against flatbuffers.Builder and the generated
accessors.

Canonical layout, offsets from the first byte of the size prefix (f):

    f+0   uint32  size of what follows (frame length - 4)
    f+4   uint32  root offset = 16 -> Frame table at f+20
    f+8   "BRKY"  file identifier
    f+12  Frame vtable: 8, 12, body_type@8, body@4
    f+20  Frame table: soffset 8, body offset 24 (-> f+48), body_type 1, pad
    f+32  Message vtable: 14, table size, kp@4, key@24, payload@28,
          stamps@8, uid@32 (0 without uid), 2 bytes pad
    f+48  Message table: soffset 16, kp offset, ts_producer (f+56),
          ts_broker (f+64), key offset, payload offset, [uid 20 bytes]
    f+80 or f+100: key_partition, key, payload vectors, each padded to 4,
          the frame padded to a multiple of 8.

The server stamps ts_broker in place (8 bytes at the offset the routing read
returns) and forwards the publisher's bytes unchanged otherwise. It does so
only for the canonical layout, where ts_broker (f+64..f+72) cannot share a
byte with anything a reader reads: every vector starts at or after f+72. In
any other layout the stamps struct may overlap an offset, a length or a
vector, so `route_message` returns no stamp position for it and the server
forwards `canonical_copy` instead (decoded, stamped and re-encoded).
"""

from __future__ import annotations

import struct
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
from broky.protocol.table import Buffer, Table, malformed, out_of_buffer, root

BODY_MESSAGE: int = Body.Message
BODY_LAST: int = Body.ReadDone
FILE_IDENTIFIER = b"BRKY"
UID_SIZE = ksuid.SIZE

_u32 = struct.Struct("<I").unpack_from
_qq = struct.Struct("<qq").unpack_from
_ts = struct.Struct("<q")
pack_ts_into = _ts.pack_into

# Fixed bytes f+4 .. f+56 of the canonical layout (through the key_partition
# offset), with and without uid.
_HEAD = struct.Struct("<I4sHHHHiIB3xHHHHHHH2xiI")
HEADER_UID = _HEAD.pack(16, FILE_IDENTIFIER, 8, 12, 8, 4, 8, 24, BODY_MESSAGE,
                        14, 52, 4, 24, 28, 8, 32, 16, 48)  # fmt: skip
HEADER_NO_UID = _HEAD.pack(16, FILE_IDENTIFIER, 8, 12, 8, 4, 8, 24, BODY_MESSAGE,
                           14, 32, 4, 24, 28, 8, 0, 16, 28)  # fmt: skip
HEADER_SIZE = len(HEADER_UID)  # 52: bytes f+4 .. f+56
TS_BROKER_OFFSET = 64  # canonical position of ts_broker from f
# From f: the fixed header bytes f+4..f+56, key offset, payload offset, and the
# key_partition length (@100 after a uid; without uid @80, inside the "20x").
_route_uid = struct.Struct("<4x52s16xII20xI").unpack_from
_route_no_uid = struct.Struct("<4x52s16xIII").unpack_from
_decode_no_uid = struct.Struct("<qqIII").unpack_from  # @56: ts, ts, key, payload, kp length
_decode_uid = struct.Struct("<qqII20sI").unpack_from  # @56: ... uid, kp length

# Message field indexes in schema order.
F_KEY_PARTITION, F_KEY, F_PAYLOAD, F_STAMPS, F_UID = range(5)


class Message(NamedTuple):
    """One message: immutable; ts_* are ns since the Unix epoch (0 = not set)."""

    key_partition: bytes
    key: bytes
    payload: bytes
    ts_producer: int = 0
    ts_broker: int = 0
    uid: bytes | None = None

    @property
    def uid_text(self) -> str | None:
        """The uid's 27-character KSUID text, or None without a uid."""
        return None if self.uid is None else ksuid.ksuid_text(self.uid)


def _pad4(n: int) -> int:
    return -n & 3


_Shape = tuple[struct.Struct, int, bytes, int, int]
_shapes: dict[tuple[int, int, int, bool], _Shape] = {}
_MAX_SHAPES = 4096


def _shape(kp_len: int, key_len: int, pay_len: int, has_uid: bool) -> _Shape:
    d = 100 if has_uid else 80
    k = d + 4 + kp_len + _pad4(kp_len)
    p = k + 4 + key_len + _pad4(key_len)
    end = p + 4 + pay_len
    tail = -end & 7
    fmt = (
        f"<I{HEADER_SIZE}sqqII"
        + ("20s" if has_uid else "")
        + f"I{kp_len}s{_pad4(kp_len)}xI{key_len}s{_pad4(key_len)}xI{pay_len}s{tail}x"
    )
    entry = (
        struct.Struct(fmt),
        end + tail - 4,
        HEADER_UID if has_uid else HEADER_NO_UID,
        k - 72,
        p - 76,
    )
    if len(_shapes) >= _MAX_SHAPES:
        _shapes.clear()
    _shapes[(kp_len, key_len, pay_len, has_uid)] = entry
    return entry


def encode_message(
    key_partition: bytes,
    key: bytes,
    payload: bytes,
    ts_producer: int = 0,
    ts_broker: int = 0,
    uid: bytes | None = None,
) -> bytes:
    """Return the whole Message frame (size prefix included) in canonical layout.

    Raises:
        LocalProtocolError: a field is not bytes, uid is not 20 bytes, or a
            timestamp is not an int64.
    """
    has_uid = uid is not None
    try:
        kp_len = len(key_partition)
        key_len = len(key)
        pay_len = len(payload)
        try:
            s, size, head, o_key, o_pay = _shapes[(kp_len, key_len, pay_len, has_uid)]
        except KeyError:
            s, size, head, o_key, o_pay = _shape(kp_len, key_len, pay_len, has_uid)
        if has_uid:
            if len(uid) != UID_SIZE:  # type: ignore[arg-type]
                raise LocalProtocolError(f"uid must be {UID_SIZE} bytes, got {len(uid)}")  # type: ignore[arg-type]
            return s.pack(size, head, ts_producer, ts_broker, o_key, o_pay, uid,
                          kp_len, key_partition, key_len, key, pay_len, payload)  # fmt: skip
        return s.pack(size, head, ts_producer, ts_broker, o_key, o_pay,
                      kp_len, key_partition, key_len, key, pay_len, payload)  # fmt: skip
    except (struct.error, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode message: {exc}") from None


def message_size(kp_len: int, key_len: int, pay_len: int, has_uid: bool = True) -> int:
    """Length in bytes of the canonical frame of a message with these lengths."""
    d = 100 if has_uid else 80
    end = d + 12 + kp_len + _pad4(kp_len) + key_len + _pad4(key_len) + pay_len
    return end + (-end & 7)


def _canonical(buf: Buffer, f: int, end: int) -> bool:
    head = buf[f + 4 : f + 56]
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
        if end - f >= 104:
            head, key_off, pay_off, kp_len = _route_uid(buf, f)
            if head == HEADER_UID:
                kp_start = f + 104
            elif head == HEADER_NO_UID:
                kp_len = _u32(buf, f + 80)[0]
                kp_start = f + 84
            else:
                return _route_generic(buf, f, end)
        elif end - f >= 84:
            head, key_off, pay_off, kp_len = _route_no_uid(buf, f)
            if head != HEADER_NO_UID:
                return _route_generic(buf, f, end)
            kp_start = f + 84
        else:
            return _route_generic(buf, f, end)
        k = f + 72 + key_off
        key_stop = k + 4 + _u32(buf, k)[0]
        p = f + 76 + pay_off
        pay_stop = p + 4 + _u32(buf, p)[0]
    except struct.error:
        raise malformed("vector overruns the frame") from None
    kp_stop = kp_start + kp_len
    if kp_stop > end or key_stop > end or pay_stop > end:
        raise malformed("vector overruns the frame")
    return buf[kp_start:kp_stop], buf[k + 4 : key_stop], f + TS_BROKER_OFFSET


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
    buf: Buffer, f: int, end: int, ts_broker: int, max_frame_bytes: int | None = None
) -> bytes:
    """The Message frame in buf[f:end] re-encoded in the canonical layout, ts_broker set.

    What the server forwards for a Message whose stamp position route_message
    gives as None (any layout but the canonical one): every field as the
    publisher wrote it, but ts_broker.

    Raises:
        MalformedFrameError, UnknownFrameError: as decode_message.
        RemoteProtocolError: code FRAME_TOO_LARGE, the copy's size prefix would
            exceed max_frame_bytes (possible when the publisher's vectors share
            bytes, or by a few bytes of padding at the very limit).
    """
    msg = decode_message(buf, f, end)
    frame = encode_message(msg.key_partition, msg.key, msg.payload, msg.ts_producer, ts_broker, msg.uid)
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
    head = buf[f + 4 : f + 56]
    uid: bytes | None
    try:  # reads past the buffer raise struct.error; past `end`, the checks below
        if head == HEADER_UID:
            ts_p, ts_b, key_off, pay_off, uid, kp_len = _decode_uid(buf, f + 56)
            kp_start = f + 104
        elif head == HEADER_NO_UID:
            ts_p, ts_b, key_off, pay_off, kp_len = _decode_no_uid(buf, f + 56)
            kp_start = f + 84
            uid = None
        else:
            return _decode_generic(buf, f, end)
        kp_stop = kp_start + kp_len
        k = f + 72 + key_off
        key_stop = k + 4 + _u32(buf, k)[0]
        p = f + 76 + pay_off
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
    )


def _decode_generic(buf: Buffer, f: int, end: int) -> Message:
    msg = _generic_table(buf, f, end)
    kp, key, payload, stamps = _generic_refs(msg)
    ts_p, ts_b = _qq(buf, stamps)
    uid_pos = msg.field(F_UID, UID_SIZE)
    return Message(
        bytes(buf[kp[0] : kp[1]]),
        bytes(buf[key[0] : key[1]]),
        bytes(buf[payload[0] : payload[1]]),
        ts_p,
        ts_b,
        bytes(buf[uid_pos : uid_pos + UID_SIZE]) if uid_pos else None,
    )


def body_type(buf: Buffer, f: int, end: int) -> int:
    """The union type of the frame in buf[f:end] (validated root table)."""
    if f < 0 or end > len(buf):
        raise out_of_buffer(buf, f, end)
    if end - f >= 84 and _canonical(buf, f, end):
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
    stamps = msg.field(F_STAMPS, 16)
    if not stamps:
        raise malformed("Message.stamps is required")
    return spans[0], spans[1], spans[2], stamps
