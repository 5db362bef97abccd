"""Encoding publishes fast: per-(key_partition, key, payload length) templates.

Theory of operation
-------------------
`broky.protocol.encode_message` packs a whole Message frame; that is correct
for any input but costs a shape lookup and a 12-field pack, and a KSUID from
`new_ksuid` costs a clock read and two allocations more. A publisher mostly
repeats a few (key_partition, key) pairs with payloads of a few sizes, so the
encoder keeps, for each (key_partition, key, payload length), a `Template`:

- the frame's constant bytes, cut from one frame that `encode_message`
  produced (canonical layout, see broky.protocol.layout): the head (size
  prefix and fixed header, up to ts_producer), the middle (after ts_producer
  up to the uid: the stamped region, zeros, and the key and payload
  uoffsets) and the block from key_partition's length through the payload's
  length;
- a struct that packs header, ts_producer, those 16 bytes, the uid (12 bytes
  of time prefix and seed, then an 8-byte counter: see
  `broky.protocol.ksuid.KsuidSequence`), the block and the payload in one call;
- the vbucket of the key_partition (so routing needs no hash).

A template costs several plain encodes to make, so a shape gets one only the
second time it comes (`_admit`), while fewer than MAX_TEMPLATES exist; other
publishes are encoded by `encode_message`. The templates are dropped (a
refresh) after MAX_SEEN shapes were met once. A publisher with a
key_partition per user and payloads of many sizes thus mostly pays a plain
encode, not templates it never uses again, without churning the cache.

The uid comes from the encoder's `KsuidSequence` and the same clock read as
ts_producer. The bytes produced are exactly those of `encode_message` with
the same fields (a property test checks it). The size limit is checked when
a template is made, so an oversized message raises PayloadTooLargeError
before anything is queued. The key and key_partition are checked
(`check_fields`: what `broky pub` refuses, BadKeyError) on a template miss
only: a shape with a template was checked when it first came, so the
publish paths that find one (the client's cache, the compiled twin) pay
nothing for it. The client's publish path
(broky.client.publisher) inlines `encode`, with its own cache of templates
that also holds the target Link.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from broky.errors import BadKeyError, LocalProtocolError, PayloadTooLargeError, PayloadTypeError
from broky.matching import key_problem
from broky.protocol import encode_message, vbucket_of
from broky.protocol.ksuid import KsuidSequence
from broky.protocol.layout import (
    HEADER_AT,
    HEADER_END,
    HEADER_UID,
    PAYLOAD_UOFFSET_AT,
    SIZE_AT,
    TS_PRODUCER_AT,
    UID_AT,
    UID_END,
    UID_SIZE,
    struct_at,
)

_u32 = struct.Struct("<I").unpack_from
_time_ns = time.time_ns
MAX_TEMPLATES = 4096
MAX_SEEN = 65536
_ZERO_UID = bytes(20)

# (pack, head, mid, block, vbucket); pack(head, ts_producer, mid, uid_pre, uid_counter, block, payload)
Template = tuple[Callable[..., bytes], bytes, bytes, bytes, int]


def as_bytes(value: object, what: str) -> bytes:
    """bytes of a str (UTF-8) or bytes-like field; LocalProtocolError otherwise."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise LocalProtocolError(f"{what} must be bytes or str, not {type(value).__name__}")


def check_fields(key_partition: bytes, key: bytes, call: str = "publish") -> None:
    """BadKeyError, naming the argument, if `broky pub` would refuse this key or partition:
    a key with an empty or a wildcard token (broky.matching.key_problem), an empty partition."""
    problem = key_problem(key)
    if problem is not None:
        raise BadKeyError(call, "key", key.decode(errors="backslashreplace"), problem)
    if not key_partition:
        raise BadKeyError(call, "partition", "", "must not be empty (leave it out: it defaults to the key)")


def payload_bytes(value: object) -> bytes:
    """bytes of a bytes-like payload; a str is refused (encode it yourself)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise payload_type_error(value)


def payload_type_error(value: object) -> PayloadTypeError:
    """The error for a payload that is not bytes (a TypeError too), saying what to do."""
    hint = ": encode it (text.encode())" if isinstance(value, str) else ""
    return PayloadTypeError(f"payload must be bytes, not {type(value).__name__}{hint}")


class PublishEncoder:
    """Encodes Message frames for publishing; not thread-safe (one per client)."""

    def __init__(self, max_frame_bytes: int = 0) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._templates: dict[tuple[bytes, bytes, int], Template] = {}
        self._seen: set[tuple[bytes, bytes, int]] = set()  # shapes met once, without a template
        self.uids = KsuidSequence()

    def set_limit(self, max_frame_bytes: int) -> bool:
        """The server's max_frame_bytes (from its Welcome); True if it changed (templates dropped)."""
        if max_frame_bytes != self.max_frame_bytes:
            self.max_frame_bytes = max_frame_bytes
            self._templates.clear()
            self._seen.clear()
            return True
        return False

    def template_of(self, key_partition: bytes, key: bytes, pay_len: int) -> Template | None:
        """The Template of these fields if one was made (see `template`), else None."""
        return self._templates.get((key_partition, key, pay_len))

    def _admit(self, shape: tuple[bytes, bytes, int]) -> bool:
        """True the second time a shape without a template comes: making a template
        costs several encodes, worth it only for a shape that repeats (a publisher
        with a key_partition per user and payloads of many sizes repeats few)."""
        seen = self._seen
        if shape in seen:
            if len(self._templates) >= MAX_TEMPLATES:
                return False  # full: plain encodes until the next refresh
            seen.discard(shape)
            return True
        if len(seen) >= MAX_SEEN:
            # A refresh, after MAX_SEEN shapes met once: hot shapes may have changed.
            seen.clear()
            self._templates.clear()
        seen.add(shape)
        return False

    def _encode_plain(
        self, key_partition: bytes, key: bytes, payload: bytes, ts_producer: int | None, uid: bytes | None
    ) -> tuple[bytes, int]:
        """encode_message with a KSUID from the sequence when uid is None; size-checked."""
        ts = _time_ns()
        if uid is None:
            seq = self.uids
            if not seq.start <= ts < seq.until:
                seq.roll(ts)
            n = seq.next
            seq.next = n + 1
            uid = seq.pre + n.to_bytes(8, "little")
        frame = encode_message(
            key_partition, key, payload, ts if ts_producer is None else ts_producer, 0, uid
        )
        if len(frame) - 4 > self.max_frame_bytes:
            raise PayloadTooLargeError(len(frame) - 4, self.max_frame_bytes)
        return frame, vbucket_of(key_partition)

    def encode(
        self, key_partition: bytes, key: bytes, payload: bytes, ts_producer: int | None
    ) -> tuple[bytes, int]:
        """Encode a publish with a new KSUID; return (frame, vbucket).

        ts_producer None means now (the same clock read as the uid's time).

        Raises:
            PayloadTooLargeError: the frame exceeds max_frame_bytes.
            PayloadTypeError: payload is not bytes.
            BadKeyError: the key or key_partition is one `broky pub` refuses (`check_fields`).
            LocalProtocolError: ts_producer is not an int64.
        """
        try:
            pack, head, mid, block, vb = self._templates[key_partition, key, len(payload)]
        except KeyError:
            check_fields(key_partition, key)
            if not self._admit((key_partition, key, len(payload))):
                if payload.__class__ is not bytes:
                    raise payload_type_error(payload) from None
                return self._encode_plain(key_partition, key, payload, ts_producer, None)
            pack, head, mid, block, vb = self.template(key_partition, key, len(payload))
        ts = _time_ns()
        seq = self.uids
        if not seq.start <= ts < seq.until:
            seq.roll(ts)
        n = seq.next
        seq.next = n + 1
        try:
            frame = pack(head, ts if ts_producer is None else ts_producer, mid, seq.pre, n, block, payload)
        except struct.error as exc:
            raise LocalProtocolError(f"cannot encode message: {exc}") from None
        return frame, vb

    def encode_any(
        self, key_partition: bytes, key: bytes, payload: bytes, ts_producer: int | None, uid: bytes | None
    ) -> tuple[bytes, int]:
        """Encode a publish with the given uid (or none); return (frame, vbucket).

        A 20-byte uid (the Spark sink's deterministic ids) takes the template
        like `encode`; no uid or anything else takes `encode_message`.

        Raises:
            PayloadTooLargeError, BadKeyError, LocalProtocolError: as `encode`.
        """
        if uid.__class__ is bytes and len(uid) == 20:
            try:
                pack, head, mid, block, vb = self._templates[key_partition, key, len(payload)]
            except KeyError:
                check_fields(key_partition, key)
                if not self._admit((key_partition, key, len(payload))):
                    return self._encode_plain(key_partition, key, payload, ts_producer, uid)
                pack, head, mid, block, vb = self.template(key_partition, key, len(payload))
            try:
                frame = pack(
                    head,
                    _time_ns() if ts_producer is None else ts_producer,
                    mid,
                    uid[:12],
                    int.from_bytes(uid[12:], "little"),
                    block,
                    payload,
                )
            except struct.error as exc:
                raise LocalProtocolError(f"cannot encode message: {exc}") from None
            return frame, vb
        check_fields(key_partition, key)
        frame = encode_message(
            key_partition, key, payload, _time_ns() if ts_producer is None else ts_producer, 0, uid
        )
        if len(frame) - 4 > self.max_frame_bytes:
            raise PayloadTooLargeError(len(frame) - 4, self.max_frame_bytes)
        return frame, vbucket_of(key_partition)

    def template(self, key_partition: bytes, key: bytes, pay_len: int) -> Template:
        """The (cached) Template of these fields.

        Raises:
            PayloadTooLargeError: such a frame exceeds max_frame_bytes.
        """
        entry = self._templates.get((key_partition, key, pay_len))
        if entry is not None:
            return entry
        sample = encode_message(key_partition, key, bytes(pay_len), 0, 0, _ZERO_UID)
        size = len(sample) - 4
        if size > self.max_frame_bytes:
            raise PayloadTooLargeError(size, self.max_frame_bytes)
        if sample[HEADER_AT:HEADER_END] != HEADER_UID:  # pragma: no cover - encode_message is canonical
            raise LocalProtocolError("unexpected Message layout")
        pay_at = PAYLOAD_UOFFSET_AT + _u32(sample, PAYLOAD_UOFFSET_AT)[0] + 4  # first payload byte
        mid_at = TS_PRODUCER_AT + 8
        head, mid, block = sample[:TS_PRODUCER_AT], sample[mid_at:UID_AT], sample[UID_END:pay_at]
        fields = struct_at(
            (SIZE_AT, f"{len(head)}s"),
            (TS_PRODUCER_AT, "q"),
            (mid_at, f"{len(mid)}s"),
            (UID_AT, f"{UID_SIZE - 8}sQ"),  # KsuidSequence's pre, then its counter
            (UID_END, f"{len(block)}s"),
            (pay_at, f"{pay_len}s"),
            end=len(sample),
        )
        entry = (fields.pack, head, mid, block, vbucket_of(key_partition))
        if len(self._templates) >= MAX_TEMPLATES:
            self._templates.clear()
        self._templates[key_partition, key, pay_len] = entry
        return entry
