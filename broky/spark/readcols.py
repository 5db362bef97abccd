"""The Spark source's rows, decoded straight from a read's frames into Arrow columns.

A task of the source (`broky.spark.source.read_partition`) reads its range
with the SDK's bounded read in bulk (`broky.client.reader.Reading.batches`):
the read's connections hand whole runs of received Message frames to a
`Decoder`, which appends each message to the nine columns of the source's
schema in Arrow's memory layout, and every `batch_rows` rows (or
`batch_bytes` bytes of key_partitions, keys and payloads) the columns go
out as one `Columns` of bytes buffers, which `arrow_batch` wraps as a
``pyarrow.RecordBatch`` without a copy. No Message object is made per row,
and no Python call either.

Theory of operation
-------------------
``Decoder.scan(data, pos, end, vbuckets, max_frame)`` takes the frames of
``data[pos:end]`` one after the other while each is whole, its size prefix is
in bounds (``MIN_FRAME_SIZE`` .. `max_frame`, as the connection checks it)
and it is a Message in the canonical layout (broky.protocol.layout) whose
vectors lie inside it: what `decode_message` reads on its canonical path. A
frame of a vbucket whose byte in `vbuckets` is 0 is passed over (consumed,
no row: the read's answer from a worker carries only the vbuckets asked of
it, and nothing of a vbucket after its ReadDone). It stops before the first
frame it does not take -- a partial frame, a control frame (Replay,
ReadDone), a Message in another layout, a malformed one -- and when the
batch is full, and returns where it stopped: the connection decodes that
frame with the reference codec (`decode_frame`, which raises a clear
`ProtocolError` for a malformed one) and hands a Message of another layout
back to `scan` re-encoded in the canonical one (broky.client.reader), so
every message reaches the columns, in the order it came.

The columns (the source's SCHEMA, in its order):

==============  =============================================================
key_partition,  binary: int32 offsets (rows + 1), the bytes
key, payload
ts_producer,    timestamp[us, UTC]: a validity bitmap (None when no row is
ts_broker       null), int64 values: ns // 1000; a ts of 0 (not set) is null
uid             string: validity (null without a uid), int32 offsets, the
                27-character KSUID text (broky.protocol.ksuid.ksuid_text)
vbucket         int32
epoch           string: int32 offsets, the epoch in decimal (a u64: a long
                could not hold every one)
offset          int64 (an offset past 2**63 - 1, which no server gives,
                raises OverflowError: the read fails with it)
==============  =============================================================

Bitmaps are Arrow's: bit i of byte i // 8 (least significant first), the
bits after the last row 0.

The compiled twin `broky.spark._readcols` (built with the server's and the
SDK's, see setup.py) does this in C; `PyDecoder` is the pure-Python
reference it is held to (tests/spark/test_spark_readcols.py: the same bytes
from the same frames, valid, truncated or random). Without the twin (no C
compiler, or BROKY_PURE_PYTHON=1) the source runs the reference, and
`description` says why.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any, NamedTuple, Protocol

from broky.client.pubpack import ENV_PURE, pure_requested
from broky.errors import MalformedFrameError
from broky.protocol import Message, decode_message, layout
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.protocol.ksuid import ALPHABET, ksuid_text

VERSION = 1  # the _readcols.c interface this code calls (its READCOLS_VERSION)
MAX_BATCH_ROWS = 1 << 24
MAX_BATCH_BYTES = 1 << 30  # Arrow's int32 offsets: a batch of up to this, plus one frame
_u32 = struct.Struct("<I").unpack_from
_I64_MAX = (1 << 63) - 1


class Columns(NamedTuple):
    """One batch of rows in Arrow's memory layout (see the module's table), as bytes."""

    rows: int
    key_partition_offsets: bytes
    key_partition: bytes
    key_offsets: bytes
    key: bytes
    payload_offsets: bytes
    payload: bytes
    ts_producer_validity: bytes | None
    ts_producer: bytes
    ts_producer_nulls: int
    ts_broker_validity: bytes | None
    ts_broker: bytes
    ts_broker_nulls: int
    uid_validity: bytes | None
    uid_offsets: bytes
    uid: bytes
    uid_nulls: int
    vbucket: bytes
    epoch_offsets: bytes
    epoch: bytes
    offset: bytes


class Decoder(Protocol):
    """What the source asks of a decoder (the compiled one, or PyDecoder)."""

    @property
    def rows(self) -> int: ...
    @property
    def full(self) -> bool: ...
    @property
    def batch_rows(self) -> int: ...
    def scan(self, data: bytes, pos: int, end: int, vbuckets: Any, max_frame: int, /) -> int: ...
    def take(self) -> tuple[Any, ...]: ...


def _check_batch(batch_rows: int, batch_bytes: int) -> None:
    if not (1 <= batch_rows <= MAX_BATCH_ROWS and 1 <= batch_bytes <= MAX_BATCH_BYTES):
        raise ValueError(
            f"Decoder: batch_rows must be 1 .. {MAX_BATCH_ROWS} and batch_bytes 1 .. {MAX_BATCH_BYTES}"
        )


class PyDecoder:
    """The reference: decode_message per frame, a list per column, the buffers made by take()."""

    def __init__(self, batch_rows: int, batch_bytes: int) -> None:
        _check_batch(batch_rows, batch_bytes)
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self.messages: list[Message] = []
        self.nbytes = 0

    @property
    def rows(self) -> int:
        return len(self.messages)

    @property
    def full(self) -> bool:
        return len(self.messages) >= self.batch_rows or self.nbytes >= self.batch_bytes

    def scan(self, data: bytes, pos: int, end: int, vbuckets: Any, max_frame: int, /) -> int:
        """See the module's header; the compiled Decoder.scan does the same."""
        if not isinstance(data, bytes):
            raise TypeError(f"scan: data must be bytes, not {type(data).__name__}")
        if not 0 <= pos <= end <= len(data):
            raise ValueError(f"scan: [{pos}, {end}) is not inside the {len(data)} bytes of data")
        if not 0 <= max_frame < MAX_BATCH_BYTES:
            raise ValueError(f"scan: max_frame must be 0 .. {MAX_BATCH_BYTES - 1}")
        mask = memoryview(vbuckets).cast("B")
        canonical = (layout.HEADER_UID, layout.HEADER_NO_UID)
        while not self.full and end - pos >= 4:
            size = _u32(data, pos)[0]
            stop = pos + 4 + size
            if not MIN_FRAME_SIZE <= size <= max_frame or stop > end:
                break
            if data[pos + layout.HEADER_AT : pos + layout.HEADER_END] not in canonical:
                break
            try:
                msg = decode_message(data, pos, stop)
            except MalformedFrameError:
                break
            if msg.vbucket < len(mask) and mask[msg.vbucket]:
                self._add(msg)
            pos = stop
        return pos

    def _add(self, msg: Message) -> None:
        if msg.offset > _I64_MAX:
            raise OverflowError(
                f"offset {msg.offset} of vbucket {msg.vbucket} does not fit the offset column "
                "(a long): not a position a Broky server gives"
            )
        self.messages.append(msg)
        self.nbytes += len(msg.key_partition) + len(msg.key) + len(msg.payload)

    def take(self) -> tuple[Any, ...]:
        """The batch's columns (Columns' fields); a new batch starts."""
        msgs, self.messages, self.nbytes = self.messages, [], 0
        tsp, tsp_valid, tsp_nulls = _timestamps([m.ts_producer for m in msgs])
        tsb, tsb_valid, tsb_nulls = _timestamps([m.ts_broker for m in msgs])
        uids = [m.uid for m in msgs]
        uid_valid, uid_nulls = _validity([u is not None for u in uids])
        uid_offsets, uid_data = _binary([None if u is None else ksuid_text(u).encode() for u in uids])
        return (
            len(msgs),
            *_binary([m.key_partition for m in msgs]),
            *_binary([m.key for m in msgs]),
            *_binary([m.payload for m in msgs]),
            tsp_valid,
            tsp,
            tsp_nulls,
            tsb_valid,
            tsb,
            tsb_nulls,
            uid_valid,
            uid_offsets,
            uid_data,
            uid_nulls,
            array("i", [m.vbucket for m in msgs]).tobytes(),
            *_binary([str(m.epoch).encode() for m in msgs]),
            array("q", [m.offset for m in msgs]).tobytes(),
        )


def _binary(values: list[bytes | None]) -> tuple[bytes, bytes]:
    """Arrow's int32 offsets and the data of `values` (a None, a null row, takes no bytes)."""
    offsets = array("i", [0])
    at = 0
    for value in values:
        if value is not None:
            at += len(value)
        offsets.append(at)
    return offsets.tobytes(), b"".join(v for v in values if v is not None)


def _validity(valid: list[bool]) -> tuple[bytes | None, int]:
    """Arrow's validity bitmap (None when nothing is null) and the nulls."""
    nulls = valid.count(False)
    if not nulls:
        return None, 0
    bits = bytearray((len(valid) + 7) // 8)
    for i, ok in enumerate(valid):
        if ok:
            bits[i >> 3] |= 1 << (i & 7)
    return bytes(bits), nulls


def _timestamps(ns: list[int]) -> tuple[bytes, bytes | None, int]:
    """µs values (0 is null), their validity and nulls."""
    valid, nulls = _validity([t != 0 for t in ns])
    return array("q", [t // 1000 for t in ns]).tobytes(), valid, nulls


def arrow_batch(pa: Any, schema: Any, cols: tuple[Any, ...]) -> Any:
    """The ``pyarrow.RecordBatch`` of `schema` (the source's, see the module's table) over the
    buffers of one batch (Columns' fields, what take() returns): no copy."""
    c = Columns._make(cols)
    n = c.rows
    buf = pa.py_buffer

    def valid(bits: bytes | None) -> Any:
        return None if bits is None else buf(bits)

    types = schema.types
    arrays = [
        pa.Array.from_buffers(types[0], n, [None, buf(c.key_partition_offsets), buf(c.key_partition)]),
        pa.Array.from_buffers(types[1], n, [None, buf(c.key_offsets), buf(c.key)]),
        pa.Array.from_buffers(types[2], n, [None, buf(c.payload_offsets), buf(c.payload)]),
        pa.Array.from_buffers(
            types[3], n, [valid(c.ts_producer_validity), buf(c.ts_producer)], c.ts_producer_nulls
        ),
        pa.Array.from_buffers(
            types[4], n, [valid(c.ts_broker_validity), buf(c.ts_broker)], c.ts_broker_nulls
        ),
        pa.Array.from_buffers(
            types[5], n, [valid(c.uid_validity), buf(c.uid_offsets), buf(c.uid)], c.uid_nulls
        ),
        pa.Array.from_buffers(types[6], n, [None, buf(c.vbucket)]),
        pa.Array.from_buffers(types[7], n, [None, buf(c.epoch_offsets), buf(c.epoch)]),
        pa.Array.from_buffers(types[8], n, [None, buf(c.offset)]),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _load() -> tuple[Any, str]:
    if pure_requested():
        return None, f"pure Python ({ENV_PURE} is set)"
    try:
        from broky.spark import _readcols
    except ImportError as exc:
        return (
            None,
            f"pure Python: the compiled column decoder is not built ({exc}); reinstall with a C compiler",
        )
    if getattr(_readcols, "VERSION", None) != VERSION:
        return None, "pure Python: the compiled column decoder is out of date; reinstall (pip install -e .)"
    try:
        _readcols.configure(layout, MIN_FRAME_SIZE, ALPHABET.encode())
    except ValueError as exc:
        return None, f"pure Python: {exc}"
    return _readcols, "compiled"


compiled, description = _load()


def new_decoder(batch_rows: int, batch_bytes: int = 64 << 20) -> Decoder:
    """A decoder of batches of `batch_rows` rows (or `batch_bytes` bytes): the compiled one
    when it is there, else the reference."""
    if compiled is None:
        return PyDecoder(batch_rows, batch_bytes)
    decoder: Decoder = compiled.Decoder(batch_rows, batch_bytes)
    return decoder


__all__ = ["Columns", "Decoder", "PyDecoder", "arrow_batch", "compiled", "description", "new_decoder"]
