"""Encoding publishes fast: per-(key_partition, key, payload length) templates.

Theory of operation
-------------------
`broky.protocol.encode_message` packs a whole Message frame; that is correct
for any input but costs a shape lookup and a 12-field pack, and a KSUID from
`new_ksuid` costs a clock read and two allocations more. A publisher mostly
repeats a few (key_partition, key) pairs with payloads of a few sizes, so the
encoder keeps, for each (key_partition, key, payload length):

- the frame's constant bytes, cut from one frame that `encode_message`
  produced (canonical layout, see broky.protocol.message): the 56 header
  bytes, the 16 bytes after ts_producer (ts_broker = 0 and two offsets) and
  the block from key_partition's length through the payload's length;
- a struct that packs header, ts_producer, those 16 bytes, the uid (4-byte
  time prefix + 16 random bytes), the block and the payload in one call;
- the vbucket of the key_partition (so routing needs no hash).

The uid's time prefix is recomputed once per second from the same clock read
as ts_producer; its random parts come from one os.urandom call per 4096 uids,
pre-cut into 16-byte pieces. The bytes produced are exactly those of
`encode_message` with the same fields (a property test checks it). The size
limit is checked when a template is made, so an oversized message raises
PayloadTooLargeError before anything is queued.
"""

from __future__ import annotations

import os
import struct
import time
import weakref
from collections.abc import Callable

from broky.errors import LocalProtocolError, PayloadTooLargeError
from broky.protocol import encode_message, vbucket_of
from broky.protocol.ksuid import EPOCH
from broky.protocol.message import HEADER_UID

_u32 = struct.Struct("<I").unpack_from
_time_ns = time.time_ns
_NS = 1_000_000_000
UIDS_PER_REFILL = 4096
MAX_TEMPLATES = 4096
_ZERO_UID = bytes(20)

_Template = tuple[Callable[..., bytes], bytes, bytes, bytes, int]
_live: weakref.WeakSet[PublishEncoder] = weakref.WeakSet()


def _after_fork() -> None:
    # a forked child must not reuse its parent's random bytes
    for encoder in list(_live):
        encoder._reset_random()


os.register_at_fork(after_in_child=_after_fork)


def as_bytes(value: object, what: str) -> bytes:
    """bytes of a str (UTF-8) or bytes-like field; LocalProtocolError otherwise."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise LocalProtocolError(f"{what} must be bytes or str, not {type(value).__name__}")


def payload_bytes(value: object) -> bytes:
    """bytes of a bytes-like payload; a str is refused (encode it yourself)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise LocalProtocolError(f"payload must be bytes, not {type(value).__name__}")


class PublishEncoder:
    """Encodes Message frames for publishing; not thread-safe (one per client)."""

    def __init__(self, max_frame_bytes: int = 0) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._templates: dict[tuple[bytes, bytes, int], _Template] = {}
        self._second = -1
        self._prefix = b""
        self._random: list[bytes] = []
        self._next = 0
        _live.add(self)

    def set_limit(self, max_frame_bytes: int) -> None:
        """The server's max_frame_bytes (from its Welcome)."""
        if max_frame_bytes != self.max_frame_bytes:
            self.max_frame_bytes = max_frame_bytes
            self._templates.clear()

    def _reset_random(self) -> None:
        self._random = []
        self._next = 0

    def _refill(self) -> None:
        pool = os.urandom(16 * UIDS_PER_REFILL)
        self._random = [pool[i : i + 16] for i in range(0, len(pool), 16)]
        self._next = 0

    def encode(
        self, key_partition: bytes, key: bytes, payload: bytes, ts_producer: int | None
    ) -> tuple[bytes, int]:
        """Encode a publish with a new KSUID; return (frame, vbucket).

        ts_producer None means now (the same clock read as the uid's time).

        Raises:
            PayloadTooLargeError: the frame exceeds max_frame_bytes.
            LocalProtocolError: payload is not bytes, or ts_producer is not an int64.
        """
        ts = _time_ns()
        second = ts // _NS
        if second != self._second:
            self._second = second
            self._prefix = (second - EPOCH).to_bytes(4, "big")
        n = self._next
        if n >= len(self._random):
            self._refill()
            n = 0
        self._next = n + 1
        try:
            pack, head, mid, block, vb = self._templates[(key_partition, key, len(payload))]
        except KeyError:
            pack, head, mid, block, vb = self._template(key_partition, key, len(payload))
        try:
            frame = pack(
                head,
                ts if ts_producer is None else ts_producer,
                mid,
                self._prefix,
                self._random[n],
                block,
                payload,
            )
        except struct.error as exc:
            raise LocalProtocolError(f"cannot encode message: {exc}") from None
        return frame, vb

    def encode_any(
        self, key_partition: bytes, key: bytes, payload: bytes, ts_producer: int | None, uid: bytes | None
    ) -> tuple[bytes, int]:
        """Encode a publish with the given uid (or none); return (frame, vbucket).

        Raises:
            PayloadTooLargeError, LocalProtocolError: as `encode`.
        """
        frame = encode_message(
            key_partition, key, payload, _time_ns() if ts_producer is None else ts_producer, 0, uid
        )
        if len(frame) - 4 > self.max_frame_bytes:
            raise PayloadTooLargeError(len(frame) - 4, self.max_frame_bytes)
        return frame, vbucket_of(key_partition)

    def _template(self, key_partition: bytes, key: bytes, pay_len: int) -> _Template:
        sample = encode_message(key_partition, key, bytes(pay_len), 0, 0, _ZERO_UID)
        size = len(sample) - 4
        if size > self.max_frame_bytes:
            raise PayloadTooLargeError(size, self.max_frame_bytes)
        if sample[4:56] != HEADER_UID:  # pragma: no cover - encode_message is canonical
            raise LocalProtocolError("unexpected Message layout")
        pay_at = 76 + _u32(sample, 76)[0] + 4  # first payload byte
        head, mid, block = sample[:56], sample[64:80], sample[100:pay_at]
        tail = len(sample) - pay_at - pay_len
        fmt = f"<56sq16s4s16s{len(block)}s{pay_len}s{tail}x"
        entry = (struct.Struct(fmt).pack, head, mid, block, vbucket_of(key_partition))
        if len(self._templates) >= MAX_TEMPLATES:
            self._templates.clear()
        self._templates[(key_partition, key, pay_len)] = entry
        return entry
