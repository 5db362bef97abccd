"""Fuzzing: random and mutated byte streams give frames or a ProtocolError, nothing else.

Every byte string that reaches the codec goes through the same steps the
server and the client take (FrameReader, decode_frame, route_message,
decode_message). Any exception other than ProtocolError (IndexError,
struct.error, UnicodeDecodeError, RecursionError, MemoryError, ...) fails the
test, and so would a hang (pytest-timeout).

The fast Message readers are also checked differentially: on every input they
either both raise, or they agree with the bounds-checked generic reader. And
whatever route_message accepts, the server can forward: a canonical frame
stamped in place, any other its canonical copy, decodes to the same message
with only ts_broker changed.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broky.errors import ProtocolError
from broky.protocol import NEED_DATA, Frame, FrameReader, Message, decode_frame, decode_message, route_message
from broky.protocol.layout import HEADER_AT, HEADER_END, HEADER_NO_UID, HEADER_UID, TS_BROKER_AT
from broky.protocol.message import _decode_generic, _route_generic, canonical_copy, pack_stamp_into
from tests.support.generated import all_frames, encoded_frames, generated_read, messages, welcomes
from tests.support.mutations import mutate, mutation

LIMIT = 1 << 16
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn: object, *args: object) -> object:
    """The value fn returns, or the ProtocolError class it raises."""
    try:
        return fn(*args)  # type: ignore[operator]
    except ProtocolError:
        return ProtocolError


def consume(data: bytes, chunks: list[int]) -> list[Frame]:
    """Feed data in chunks of the given sizes; decode and route every frame.

    Returns the frames decoded before the first ProtocolError (if any).
    """
    reader = FrameReader(max_frame_bytes=LIMIT)
    out: list[Frame] = []
    pos = 0
    sizes = iter(chunks)
    try:
        while pos < len(data):
            step = next(sizes, len(data)) or 1
            reader.feed(data[pos : pos + step])
            pos += step
            while (raw := reader.next_frame()) is not NEED_DATA:
                assert isinstance(raw, bytes)
                frame = decode_frame(raw)
                out.append(frame)
                check_message_readers_agree(raw)
        reader.close()
    except ProtocolError as exc:
        assert isinstance(exc.code, int) and exc.code > 0
    return out


def check_message_readers_agree(raw: bytes, f: int = 0, end: int | None = None) -> None:
    """Fast and generic Message readers: same values or both ProtocolError."""
    buf = raw
    end = len(raw) if end is None else end
    fast_route = _outcome(route_message, buf, f, end)
    slow_route = _outcome(_route_generic, buf, f, end)
    fast = _outcome(decode_message, buf, f, end)
    slow = _outcome(_decode_generic, buf, f, end)
    assert fast == slow
    if isinstance(fast_route, tuple) and isinstance(slow_route, tuple):
        assert fast_route[:2] == slow_route[:2]
    else:
        assert fast_route == slow_route
    # A frame routes if and only if it decodes: the server forwards nothing
    # that a subscriber could not read.
    assert (fast_route is ProtocolError) == (fast is ProtocolError)
    if isinstance(fast, Message):
        assert isinstance(fast_route, tuple)
        kp, key, ts_at = fast_route
        assert (kp, key) == (fast.key_partition, fast.key)
        assert decode_frame(buf, f, end) == fast
        stamp = 0x1234_5678_9ABC_DEF0
        vb, epoch, offset = 1023, 0xFEDC_BA98_7654_3210, 0x0123_4567_89AB_CDEF
        stamped_msg = fast._replace(ts_broker=stamp, vbucket=vb, epoch=epoch, offset=offset)
        if buf[f + HEADER_AT : f + HEADER_END] in (HEADER_UID, HEADER_NO_UID):
            # Canonical: stamped in place (ts_broker and the position), nothing else changes.
            assert ts_at == f + TS_BROKER_AT
            assert struct.unpack_from("<q", buf, ts_at)[0] == fast.ts_broker
            stamped = bytearray(buf)
            pack_stamp_into(stamped, ts_at, stamp, epoch, offset, vb)
            assert decode_message(stamped, f, end) == stamped_msg
        else:
            # Any other layout: not stamped in place; its canonical copy is forwarded.
            assert ts_at is None
            copy = canonical_copy(buf, f, end, stamp, None, vb, epoch, offset)
            assert decode_message(copy) == stamped_msg


# ---------------------------------------------------------------- random bytes


@FUZZ
@given(st.binary(max_size=600), st.lists(st.integers(0, 64), max_size=30))
def test_random_bytes(data: bytes, chunks: list[int]) -> None:
    consume(data, chunks)


@FUZZ
@given(st.binary(min_size=8, max_size=400))
def test_random_bytes_behind_a_plausible_prefix(body: bytes) -> None:
    # Random bodies behind a correct prefix and identifier reach the table reader.
    body = struct.pack("<I", min(len(body), 255) & ~3) + b"BRKY" + body
    consume(struct.pack("<I", len(body)) + body, [])


# ---------------------------------------------------------------- mutated valid streams


@FUZZ
@given(
    st.lists(encoded_frames(), min_size=1, max_size=4),
    st.lists(mutation, min_size=1, max_size=4),
    st.lists(st.integers(0, 80), max_size=20),
)
def test_mutated_streams(stream: list[tuple[Frame, bytes]], ops: list[tuple], chunks: list[int]) -> None:  # type: ignore[type-arg]
    data = bytearray(b"".join(raw for _, raw in stream))
    for op in ops:
        data = mutate(data, op)
    consume(bytes(data), chunks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(encoded_frames(all_frames), max_size=2),
    encoded_frames(welcomes),
    st.lists(encoded_frames(all_frames), max_size=2),
    st.lists(mutation, min_size=1, max_size=4),
    st.lists(st.integers(0, 4096), max_size=10),
)
def test_mutated_streams_with_welcomes(
    before: list[tuple[Frame, bytes]],
    welcome: tuple[Frame, bytes],
    after: list[tuple[Frame, bytes]],
    ops: list[tuple],  # type: ignore[type-arg]
    chunks: list[int],
) -> None:
    # The corpus above leaves out Welcome frames (a 1024-entry map: slower to
    # make); here every stream has one, mutated like the rest.
    data = bytearray(b"".join(raw for _, raw in [*before, welcome, *after]))
    for op in ops:
        data = mutate(data, op)
    consume(bytes(data), chunks)


@FUZZ
@given(messages, st.lists(mutation, min_size=1, max_size=3))
def test_mutated_canonical_messages(msg: Message, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    from broky.protocol import encode_message

    frame = bytearray(encode_message(*msg))
    size = len(frame)
    for op in ops:
        frame = mutate(frame, op)
    raw = bytes(frame)
    # The readers are given the original end, the mutated end, and the frame
    # inside a larger buffer whose extra bytes must never be read.
    for end in {min(size, len(raw)), len(raw)}:
        check_message_readers_agree(raw, 0, end)
        check_message_readers_agree(b"\xff" * 8 + raw + b"\xff" * 64, 8, 8 + end)
    consume(raw, [])


def test_valid_stream_still_reads_after_the_fuzz_helpers() -> None:
    # consume() is not vacuous: valid frames come out and agree with the generated code.
    from broky.protocol import Ping, encode_frame, encode_message

    raw = encode_message(b"kp", b"a.b", b"pay", 1, 2, bytes(20))
    data = raw + encode_frame(Ping(5))
    assert consume(data, [3, 1, 50]) == [Message(b"kp", b"a.b", b"pay", 1, 2, bytes(20)), Ping(5)]
    assert generated_read(raw) == Message(b"kp", b"a.b", b"pay", 1, 2, bytes(20))
