"""A bounds-checked reader of FlatBuffer tables, with struct.unpack_from only.

The generated accessors in broky.fbs trust their input and cost microseconds
per field; this reader checks every offset against the frame it was given and
raises MalformedFrameError instead of IndexError, struct.error or reading
outside the frame. It is used for every frame that is not on the hot path and
as the fallback for Message frames whose layout is not the canonical one.

FlatBuffers in brief: a table starts with an int32 soffset to its vtable
(vtable = table - soffset); the vtable holds uint16 vtable size, uint16 table
size, then one uint16 offset per field (0 = absent) relative to the table.
Reference fields (vectors, strings, tables) hold a uint32 offset relative to
their own position; a vector is a uint32 length followed by its elements.
"""

from __future__ import annotations

import struct

from broky.errors import MalformedFrameError

_u8 = struct.Struct("<B").unpack_from
_u16 = struct.Struct("<H").unpack_from
_i16 = struct.Struct("<h").unpack_from
_u32 = struct.Struct("<I").unpack_from
_i32 = struct.Struct("<i").unpack_from
_u64 = struct.Struct("<Q").unpack_from
_i64 = struct.Struct("<q").unpack_from
_hh = struct.Struct("<HH").unpack_from

Buffer = bytes | bytearray | memoryview


def malformed(what: str) -> MalformedFrameError:
    return MalformedFrameError(f"malformed frame: {what}")


def out_of_buffer(buf: Buffer, start: int, end: int) -> MalformedFrameError:
    """The error for a frame said to lie at buf[start:end] that buf does not hold."""
    return malformed(f"frame bounds {start}..{end} lie outside the buffer of {len(buf)} bytes")


class Table:
    """One table inside buf[base:end] (base = first byte after the size prefix)."""

    __slots__ = ("buf", "pos", "base", "end", "vt", "vt_size", "tbl_end")

    def __init__(self, buf: Buffer, pos: int, base: int, end: int) -> None:
        if pos < base or pos + 4 > end:
            raise malformed("table offset out of bounds")
        vt = pos - _i32(buf, pos)[0]
        if vt < base or vt + 4 > end:
            raise malformed("vtable out of bounds")
        vt_size, tbl_size = _hh(buf, vt)
        if vt_size < 4 or vt_size & 1 or vt + vt_size > end:
            raise malformed("bad vtable size")
        if tbl_size < 4 or pos + tbl_size > end:
            raise malformed("bad table size")
        self.buf = buf
        self.pos = pos
        self.base = base
        self.end = end
        self.vt = vt
        self.vt_size = vt_size
        self.tbl_end = pos + tbl_size

    def field(self, index: int, size: int) -> int:
        """Absolute position of field `index` of `size` inline bytes, 0 if absent."""
        o = 4 + 2 * index
        if o >= self.vt_size:
            return 0
        off: int = _u16(self.buf, self.vt + o)[0]
        if off == 0:
            return 0
        p = self.pos + off
        if off < 4 or p + size > self.tbl_end:
            raise malformed(f"field {index} outside its table")
        return p

    def u8(self, index: int, default: int = 0) -> int:
        p = self.field(index, 1)
        return _u8(self.buf, p)[0] if p else default

    def u16(self, index: int, default: int = 0) -> int:
        p = self.field(index, 2)
        return _u16(self.buf, p)[0] if p else default

    def i16(self, index: int, default: int = 0) -> int:
        p = self.field(index, 2)
        return _i16(self.buf, p)[0] if p else default

    def u32(self, index: int, default: int = 0) -> int:
        p = self.field(index, 4)
        return _u32(self.buf, p)[0] if p else default

    def i32(self, index: int, default: int = 0) -> int:
        p = self.field(index, 4)
        return _i32(self.buf, p)[0] if p else default

    def u64(self, index: int, default: int = 0) -> int:
        p = self.field(index, 8)
        return _u64(self.buf, p)[0] if p else default

    def i64(self, index: int, default: int = 0) -> int:
        p = self.field(index, 8)
        return _i64(self.buf, p)[0] if p else default

    def boolean(self, index: int, default: bool = False) -> bool:
        p = self.field(index, 1)
        return _u8(self.buf, p)[0] != 0 if p else default

    def target(self, index: int) -> int:
        """Absolute position a reference field points to, 0 if absent."""
        p = self.field(index, 4)
        if not p:
            return 0
        t: int = p + _u32(self.buf, p)[0]
        if t + 4 > self.end:
            raise malformed(f"field {index} points outside the frame")
        return t

    def vector(self, index: int, elem_size: int) -> tuple[int, int]:
        """(position of the first element, length) of a vector field; (0, 0) if absent."""
        v = self.target(index)
        if not v:
            return 0, 0
        n = _u32(self.buf, v)[0]
        if v + 4 + n * elem_size > self.end:
            raise malformed(f"vector {index} overruns the frame")
        return v + 4, n

    def byte_vector(self, index: int) -> bytes | None:
        v = self.target(index)
        if not v:
            return None
        n = _u32(self.buf, v)[0]
        start = v + 4
        if start + n > self.end:
            raise malformed(f"vector {index} overruns the frame")
        return bytes(self.buf[start : start + n])

    def string(self, index: int) -> str | None:
        raw = self.byte_vector(index)
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise malformed(f"string {index} is not UTF-8") from None

    def table(self, index: int) -> Table | None:
        t = self.target(index)
        return Table(self.buf, t, self.base, self.end) if t else None

    def table_at(self, pos: int) -> Table:
        """The table referenced by the uint32 offset stored at pos (vector element)."""
        return Table(self.buf, pos + _u32(self.buf, pos)[0], self.base, self.end)


def root(buf: Buffer, start: int, end: int) -> Table:
    """The root table of the size-prefixed frame occupying buf[start:end]."""
    if start < 0 or end > len(buf):
        raise out_of_buffer(buf, start, end)
    base = start + 4
    if end - base < 8:
        raise malformed("shorter than a FlatBuffer header")
    if buf[base + 4 : base + 8] != b"BRKY":
        raise malformed("file identifier is not BRKY")
    return Table(buf, base + _u32(buf, base)[0], base, end)
