"""Damaged and lying frames: byte mutations (`mutation`, `mutate`) of valid streams for the
fuzz tests, and `overlap_frame`, a valid Message built to fool a stamp-and-compare check.
"""

from __future__ import annotations

import struct

from hypothesis import strategies as st

from broky.protocol import Message

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 8)),
    # Overwrite an aligned word with a value an offset or a length could take.
    st.tuples(
        st.just("word"),
        st.integers(0, 10**6),
        st.sampled_from([0, 1, 2, 3, 4, 8, 12, 16, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 0xFFFF_FFFC])
        | st.integers(0, 2**32 - 1),
    ),
    st.tuples(st.just("short"), st.integers(0, 10**6), st.integers(0, 2**16 - 1)),
)


def mutate(data: bytearray, op: tuple) -> bytearray:  # type: ignore[type-arg]
    if not data:
        return data
    kind, at = op[0], op[1] % len(data)
    if kind == "flip":
        data[at] ^= 1 << op[2]
    elif kind == "truncate":
        del data[at:]
    elif kind == "insert":
        data[at:at] = op[2]
    elif kind == "delete":
        del data[at : at + op[2]]
    elif kind == "word":
        at &= ~3
        if at + 4 <= len(data):
            struct.pack_into("<I", data, at, op[2])
    elif kind == "short":
        at &= ~1
        if at + 2 <= len(data):
            struct.pack_into("<H", data, at, op[2])
    return data


# The key offset of the crafted frame below: Message table at 48, field at table+23.
OVERLAP_KEY_FIELD = 48 + 23


# What it decodes to: its epoch reads the key offset's bytes after ts_broker's (1).
OVERLAP_MESSAGE = Message(b"p1", b"a.b", b"hello", 7, 0, None, 0, 1, 0)


def overlap_frame() -> bytes:
    """A valid Message frame built to fool a stamp-and-compare check (from an audit).

    Its vtable puts the key offset at table+23, so the offset's low byte is the
    most significant byte of ts_broker (table+16..24). As published (ts_broker 0)
    the key vector is at 71+0x100; stamped with all-0xFF bits it would be at
    71+0x1FF, holding the same `a.b`; stamped with a real time (top byte 0x18,
    2024 to 2026) it would be at 71+0x118, holding `x.y`.
    """
    frame = bytearray(600)
    struct.pack_into("<I", frame, 0, len(frame) - 4)
    # Root offset, identifier, Frame vtable and table: as in the canonical layout.
    struct.pack_into("<I4sHHHHiIB", frame, 4, 16, b"BRKY", 8, 12, 8, 4, 8, 24, 1)
    # Message vtable at 32: 14 bytes, table 52 bytes; kp@4, key@23, payload@48, stamps@8 (40
    # bytes: its epoch shares bytes with the key offset too), no uid.
    struct.pack_into("<HHHHHHH", frame, 32, 14, 52, 4, 23, 48, 8, 0)
    struct.pack_into("<iI", frame, 48, 16, 100 - 52)  # soffset; kp vector at 100
    struct.pack_into("<qq", frame, 56, 7, 0)  # ts_producer 7, ts_broker 0
    struct.pack_into("<BBB", frame, 72, 0x01, 0, 0)  # key offset = 0x100 + ts_broker's top byte
    struct.pack_into("<I", frame, 96, 108 - 96)  # payload vector at 108
    struct.pack_into("<I2s", frame, 100, 2, b"p1")
    struct.pack_into("<I5s", frame, 108, 5, b"hello")
    for top, key in ((0x00, b"a.b"), (0xFF, b"a.b"), (0x18, b"x.y")):
        struct.pack_into("<I3s", frame, OVERLAP_KEY_FIELD + 0x100 + top, 3, key)
    return bytes(frame)
