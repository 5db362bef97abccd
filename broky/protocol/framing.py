"""Splitting a byte stream into frames, sans I/O.

A frame is a uint32 little-endian size prefix followed by that many bytes.
`FrameReader.feed` takes whatever chunks the transport delivered;
`next_frame` returns one whole frame (prefix included) or NEED_DATA. The size
prefix is checked against the limit as soon as its four bytes are in, before
any body is buffered, so a prefix claiming 4 GB allocates nothing.
"""

from __future__ import annotations

import enum
import struct

from broky.errors import FrameTooLargeError, MalformedFrameError, TruncatedFrameError

DEFAULT_MAX_FRAME_BYTES = 1 << 20
PREFIX_SIZE = 4
# The smallest FlatBuffer frame: root offset, file identifier, a vtable and a table.
MIN_FRAME_SIZE = 12

_u32 = struct.Struct("<I").unpack_from


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA = _NeedData.NEED_DATA
"""Returned by FrameReader.next_frame when no whole frame is buffered yet."""


def check_size(size: int, limit: int) -> None:
    """Raise if a size prefix value is out of bounds."""
    if size > limit:
        raise FrameTooLargeError(size, limit)
    if size < MIN_FRAME_SIZE:
        raise MalformedFrameError(f"size prefix {size} is smaller than any frame ({MIN_FRAME_SIZE})")


class FrameReader:
    """Buffers stream chunks and yields whole frames."""

    __slots__ = ("_buf", "_pos", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._pos = 0
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append a chunk of the stream."""
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf) - self._pos

    def next_frame(self) -> bytes | _NeedData:
        """Return the next whole frame (size prefix included), or NEED_DATA.

        Raises:
            FrameTooLargeError: the size prefix exceeds max_frame_bytes.
            MalformedFrameError: the size prefix is too small to hold a frame.
        """
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if avail < PREFIX_SIZE:
            return NEED_DATA
        size = _u32(buf, pos)[0]
        check_size(size, self.max_frame_bytes)
        end = pos + PREFIX_SIZE + size
        if end > len(buf):
            return NEED_DATA
        self._pos = end
        return bytes(buf[pos:end])

    def frames(self) -> list[bytes]:
        """Every whole frame buffered now."""
        out: list[bytes] = []
        while (frame := self.next_frame()) is not NEED_DATA:
            out.append(frame)
        return out

    def close(self) -> None:
        """The stream ended: raise TruncatedFrameError if it ended inside a frame."""
        if self.buffered:
            raise TruncatedFrameError(self.buffered)
