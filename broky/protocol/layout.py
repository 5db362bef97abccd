"""The canonical Message layout: every byte position of it, named once.

Theory of operation
-------------------
Broky writes every Message frame in one layout, and its fast readers (the
codec's decode and routing read, the server's fan-out and its compiled twin,
the SDK's delivery read, its publish templates and their compiled twin, the
Spark source's column decoder and its compiled twin)
recognise that layout by its fixed header and then read each field at a
fixed position. This module is the one place those positions are written
down; everything else asks it:

- the positions below (``*_AT``: the first byte of a field, from f, the first
  byte of the size prefix; ``*_END``: the first byte after it);
- the fixed header, built from them (HEADER_UID, HEADER_NO_UID);
- `shape`, where the three vectors of a frame with given lengths lie and how
  long the frame is (what a writer lays out), and `read_shape`, the same
  for a frame a reader meets, by the offsets it carries, checked;
- `struct_at`, which builds a struct format from (position, code) pairs, so
  that no struct format that reads or writes this layout spells an offset.

The three C twins (broky/server/shard/_feedscan.c, broky/client/_pubpack.c,
broky/spark/_readcols.c) are handed this module by their configure call at
import (broky.server.shard.fastpath, broky.client.pubpack, broky.spark.readcols)
and read the names they use from it; each gives them back through its
`layout()`, and a test holds those to this module.

Changing the layout (adding stamped fields, say) is an edit of the positions
here, of schema/broky.fbs and its generated code, and of schema/README.md
(section 4.1, the user-facing description, whose hex dump a test checks).
The checks at the end of this module refuse a set of positions that
contradict each other or the schema; the property tests then hold every
reader and writer, Python and C, to flatbuffers' generated accessors.

The layout (offsets from f; with uid | without uid):

    f+0    u32   size prefix: the frame's length - 4          SIZE_AT
    f+4    the fixed header, 52 constant bytes                HEADER_AT .. HEADER_END
    f+4      u32   root uoffset 16 -> Frame table at f+20
    f+8      "BRKY" file identifier
    f+12     Frame vtable: 8, 12, body_type@8, body@4         FRAME_VTABLE_AT
    f+20     Frame table: soffset 8, body uoffset 24          FRAME_TABLE_AT
             (-> f+48), body_type 1 (Message), 3 pad bytes
    f+32     Message vtable: 14, table size 76 | 56,          MESSAGE_VTABLE_AT
             key_partition@4, key@48, payload@52, stamps@8,
             uid@56 | 0, 2 pad bytes
    f+48     Message table: soffset 16 (-> f+32)              MESSAGE_TABLE_AT
    f+52     u32   key_partition uoffset 72 | 52              KP_UOFFSET_AT
    f+56   Stamps, 40 bytes                                   STAMPS_AT .. STAMPS_END
    f+56     i64   ts_producer                                TS_PRODUCER_AT
    f+64     the stamped region, written by the server in     STAMPED_AT .. STAMPS_END
             place (a publisher writes zeros):
    f+64       i64   ts_broker                                TS_BROKER_AT
    f+72       u64   epoch     } the message's position:      EPOCH_AT
    f+80       u64   offset    } (vbucket, epoch, offset)     OFFSET_AT
    f+88       u16   vbucket   } then 6 pad bytes             VBUCKET_AT
    f+96   u32   key uoffset (from f+96)                      KEY_UOFFSET_AT
    f+100  u32   payload uoffset (from f+100)                 PAYLOAD_UOFFSET_AT
    f+104  20 bytes uid (only with uid)                       UID_AT .. UID_END
    f+124 | f+104: the vectors key_partition, key, payload,   VECTORS_AT[has_uid]
           each a u32 length then the bytes, padded with
           zeros to 4; the frame padded with zeros to 8.      (`shape`)

Only the three vector lengths and the presence of the uid vary, so bytes
HEADER_AT .. HEADER_END are one of two constants and everything up to the
key_partition's length word (FIXED_SIZE[has_uid] bytes) lies at a fixed
position. Every field a reader reads (the uoffsets, the uid, the vectors)
lies at or after STAMPS_END, so stamping the stamped region in place changes
nothing else a reader sees.
"""

from __future__ import annotations

import itertools
import struct
from typing import NamedTuple

from broky.fbs import Body, Ksuid, Stamps
from broky.protocol import ksuid
from broky.protocol.framing import PREFIX_SIZE

# ---------------------------------------------------------------- positions (from f)

SIZE_AT = 0  # u32 size prefix
HEADER_AT = 4  # the fixed header: root uoffset .. key_partition uoffset
FRAME_VTABLE_AT = 12
FRAME_TABLE_AT = 20
FRAME_BODY_AT = 24  # u32 uoffset of the Message table
FRAME_BODY_TYPE_AT = 28  # u8 body type
MESSAGE_VTABLE_AT = 32
MESSAGE_TABLE_AT = 48
KP_UOFFSET_AT = 52  # u32 key_partition uoffset (a constant: the vectors start at a fixed place)
HEADER_END = 56
STAMPS_AT = 56  # the Stamps struct
TS_PRODUCER_AT = 56  # i64, written by the publisher
TS_BROKER_AT = 64  # i64, written by the server
STAMPED_AT = 64  # the stamped region: what the server writes in place, up to STAMPS_END
EPOCH_AT = 72  # u64, the position's epoch, written by the server
OFFSET_AT = 80  # u64, the position's offset, written by the server
VBUCKET_AT = 88  # u16, the position's vbucket, written by the server (then 6 pad bytes)
STAMPS_END = 96
KEY_UOFFSET_AT = 96  # u32, relative to itself
PAYLOAD_UOFFSET_AT = 100  # u32, relative to itself
UID_AT = 104  # 20 bytes, only with a uid
UID_END = 124
VECTORS_AT = (104, 124)  # [has_uid]: the key_partition vector's length word, then key, payload

HEADER_SIZE = HEADER_END - HEADER_AT
# The Stamps struct's fields, as struct_at takes them: ts_producer, ts_broker, and the
# position (epoch, offset, vbucket). Readers that read the stamps spell them so.
STAMP_FIELDS = (
    (TS_PRODUCER_AT, "q"),
    (TS_BROKER_AT, "q"),
    (EPOCH_AT, "Q"),
    (OFFSET_AT, "Q"),
    (VBUCKET_AT, "H"),
)
# Bytes from f through the key_partition's length word, the last field at a fixed
# position: what a reader needs before it knows where the key and the payload are.
FIXED_SIZE = (VECTORS_AT[False] + 4, VECTORS_AT[True] + 4)
FILE_IDENTIFIER = b"BRKY"
UID_SIZE = ksuid.SIZE

# The Message table's fields in schema order (their vtable slots: broky.fbs).
_MESSAGE_FIELDS = (KP_UOFFSET_AT, KEY_UOFFSET_AT, PAYLOAD_UOFFSET_AT, STAMPS_AT, UID_AT)


# ---------------------------------------------------------------- struct formats


def struct_at(*fields: tuple[int, str], start: int = 0, end: int | None = None) -> struct.Struct:
    """A little-endian struct.Struct over `fields` (position from f, struct code),
    read or written from position `start`: the bytes between fields are pad bytes
    (skipped when read, zeros when packed), as are those up to `end` when given.

    Raises:
        ValueError: the fields are not in increasing order or overlap.
    """
    fmt = ["<"]
    at = start
    for pos, code in fields:
        if pos < at:
            raise ValueError(f"struct_at: field {code!r} at {pos} overlaps the bytes before {at}")
        if pos > at:
            fmt.append(f"{pos - at}x")
        fmt.append(code)
        at = pos + struct.calcsize("<" + code)
    if end is not None:
        if end < at:
            raise ValueError(f"struct_at: the fields run to {at}, past the end {end}")
        if end > at:
            fmt.append(f"{end - at}x")
    return struct.Struct("".join(fmt))


# ---------------------------------------------------------------- the fixed header


def _header(has_uid: bool) -> bytes:
    vectors = VECTORS_AT[has_uid]
    vtable = MESSAGE_TABLE_AT - MESSAGE_VTABLE_AT
    slots = [at - MESSAGE_TABLE_AT for at in _MESSAGE_FIELDS]
    if not has_uid:
        slots[-1] = 0  # absent
    head = struct_at(
        (HEADER_AT, "I"),  # root uoffset
        (HEADER_AT + 4, "4s"),
        (FRAME_VTABLE_AT, "HHHH"),  # vtable size, table size, body_type slot, body slot
        (FRAME_TABLE_AT, "i"),  # soffset to the vtable
        (FRAME_BODY_AT, "I"),
        (FRAME_BODY_TYPE_AT, "B"),
        (MESSAGE_VTABLE_AT, f"HH{len(slots)}H"),  # vtable size, table size, field slots
        (MESSAGE_TABLE_AT, "i"),  # soffset to the vtable
        (KP_UOFFSET_AT, "I"),
        start=HEADER_AT,
        end=HEADER_END,
    )
    return head.pack(
        FRAME_TABLE_AT - HEADER_AT,
        FILE_IDENTIFIER,
        FRAME_TABLE_AT - FRAME_VTABLE_AT,
        MESSAGE_VTABLE_AT - FRAME_TABLE_AT,
        FRAME_BODY_TYPE_AT - FRAME_TABLE_AT,
        FRAME_BODY_AT - FRAME_TABLE_AT,
        FRAME_TABLE_AT - FRAME_VTABLE_AT,
        MESSAGE_TABLE_AT - FRAME_BODY_AT,
        Body.Message,
        4 + 2 * len(slots),
        vectors - MESSAGE_TABLE_AT,
        *slots,
        vtable,
        vectors - KP_UOFFSET_AT,
    )


HEADER_UID = _header(True)
HEADER_NO_UID = _header(False)


# ---------------------------------------------------------------- shapes


class Vectors(NamedTuple):
    """Where the vectors of a canonical frame lie (each its u32 length word, from
    f; the bytes follow it), and the frame's length (size prefix included)."""

    kp_at: int
    key_at: int
    payload_at: int
    frame_len: int


def next_vector(at: int, n: int) -> int:
    """The length word of the vector after the one at `at` holding n bytes (padded to 4)."""
    return at + 4 + n + (-n & 3)


def shape(has_uid: bool, kp_len: int, key_len: int, pay_len: int) -> Vectors:
    """The writer's view: the Vectors of the canonical frame with these lengths."""
    kp_at = VECTORS_AT[has_uid]
    key_at = next_vector(kp_at, kp_len)
    payload_at = next_vector(key_at, key_len)
    end = payload_at + 4 + pay_len
    return Vectors(kp_at, key_at, payload_at, end + (-end & 7))


def read_shape(
    has_uid: bool, size: int, key_uoffset: int, payload_uoffset: int, kp_len: int
) -> Vectors | None:
    """The reader's view: the Vectors of a canonical frame as its size prefix, its
    key and payload uoffsets and its key_partition's length say, or None when they
    are not laid out as `shape` lays them out: key_partition, key, payload, in
    this order, the key right after the key_partition, each length word inside
    the frame. (The key's and the payload's lengths vary between frames of one
    such shape: a reader checks them per frame.)"""
    kp_at = VECTORS_AT[has_uid]
    key_at = KEY_UOFFSET_AT + key_uoffset
    payload_at = PAYLOAD_UOFFSET_AT + payload_uoffset
    frame_len = PREFIX_SIZE + size
    if key_at == next_vector(kp_at, kp_len) and key_at + 4 <= payload_at and payload_at + 4 <= frame_len:
        return Vectors(kp_at, key_at, payload_at, frame_len)
    return None


# ---------------------------------------------------------------- consistency


def _check() -> None:
    """Refuse positions that contradict each other or the schema."""
    fields = sorted(
        [
            ("size prefix", SIZE_AT, PREFIX_SIZE),
            ("header", HEADER_AT, HEADER_SIZE),
            ("stamps", STAMPS_AT, STAMPS_END - STAMPS_AT),
            ("key uoffset", KEY_UOFFSET_AT, 4),
            ("payload uoffset", PAYLOAD_UOFFSET_AT, 4),
            ("uid", UID_AT, UID_SIZE),
        ],
        key=lambda f: f[1],
    )
    for (a, at, size), (b, b_at, _) in itertools.pairwise(fields):
        if at + size > b_at:
            raise AssertionError(f"layout: the {a} overlaps the {b}")
    problems = [
        (HEADER_AT == PREFIX_SIZE, "the header follows the size prefix"),
        (HEADER_END == STAMPS_AT, "the stamps follow the header"),
        (MESSAGE_TABLE_AT < KP_UOFFSET_AT < HEADER_END, "the key_partition uoffset is in the header"),
        (Stamps.SizeOf() == STAMPS_END - STAMPS_AT, "the stamps are the schema's Stamps struct"),
        (Ksuid.SizeOf() == UID_SIZE and UID_END == UID_AT + UID_SIZE, "the uid is the schema's Ksuid"),
        (STAMPS_AT % 8 == 0 and TS_PRODUCER_AT % 8 == 0 and TS_BROKER_AT % 8 == 0, "int64s aligned"),
        (
            all(at % 4 == 0 for at in (KP_UOFFSET_AT, KEY_UOFFSET_AT, PAYLOAD_UOFFSET_AT, *VECTORS_AT)),
            "u32s aligned",
        ),
        (STAMPS_AT <= TS_PRODUCER_AT and TS_PRODUCER_AT + 8 <= STAMPED_AT, "ts_producer is not stamped"),
        (STAMPED_AT <= TS_BROKER_AT and TS_BROKER_AT + 8 <= STAMPS_END, "ts_broker is in the stamped region"),
        (
            TS_BROKER_AT + 8 <= EPOCH_AT
            and EPOCH_AT + 8 <= OFFSET_AT
            and OFFSET_AT + 8 <= VBUCKET_AT
            and VBUCKET_AT + 2 <= STAMPS_END
            and EPOCH_AT % 8 == 0
            and OFFSET_AT % 8 == 0,
            "the position is in the stamped region, after ts_broker, aligned",
        ),
        (VECTORS_AT == (UID_AT, UID_END), "the uid is the last field before the vectors"),
        (all(at >= STAMPS_END for at in (KEY_UOFFSET_AT, PAYLOAD_UOFFSET_AT, UID_AT)), "read after stamps"),
        (len(HEADER_UID) == len(HEADER_NO_UID) == HEADER_SIZE, "two headers of one size"),
    ]
    for ok, what in problems:
        if not ok:
            raise AssertionError(f"layout: {what}")


_check()
