"""FrameReader: any chunking of a valid stream yields the same frames as the whole."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broky.errors import FrameTooLargeError, MalformedFrameError, ProtocolError, TruncatedFrameError
from broky.protocol import NEED_DATA, Frame, FrameReader, decode_frame, encode_message
from broky.protocol.framing import MIN_FRAME_SIZE
from tests.support.generated import (
    all_frames,
    encoded_frames,
    large_control_frames,
    large_messages,
)

streams = st.lists(encoded_frames(), min_size=1, max_size=8)


def _read_all(reader: FrameReader) -> list[bytes]:
    out = []
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert isinstance(frame, bytes)
        out.append(frame)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams, st.data())
def test_any_chunking_yields_the_same_frames(stream: list[tuple[Frame, bytes]], data: st.DataObject) -> None:
    frames = [raw for _, raw in stream]
    whole = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=20)))
    reader = FrameReader()
    got: list[bytes] = []
    prev = 0
    for cut in [*cuts, len(whole)]:
        # bytes, bytearray and memoryview chunks are all accepted.
        chunk = whole[prev:cut]
        kind = data.draw(st.sampled_from([bytes, bytearray, memoryview]))
        reader.feed(kind(chunk))
        got.extend(_read_all(reader))
        prev = cut
        assert reader.buffered == cut - sum(map(len, got))
    assert got == frames
    assert [decode_frame(f) for f in got] == [value for value, _ in stream]
    reader.close()  # ended on a frame boundary: no error


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        encoded_frames(large_messages())
        | encoded_frames(large_control_frames())
        | encoded_frames(all_frames),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_frames_up_to_the_limit_and_welcomes_in_any_chunks(
    stream: list[tuple[Frame, bytes]], data: st.DataObject
) -> None:
    frames = [raw for _, raw in stream]
    whole = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=30)))
    reader = FrameReader()  # the default limit, 1 MiB
    got: list[bytes] = []
    prev = 0
    for cut in [*cuts, len(whole)]:
        reader.feed(whole[prev:cut])
        got.extend(_read_all(reader))
        prev = cut
    assert got == frames
    assert [decode_frame(f) for f in got] == [value for value, _ in stream]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
def test_one_byte_at_a_time(stream: list[tuple[Frame, bytes]]) -> None:
    frames = [raw for _, raw in stream]
    reader = FrameReader()
    got: list[bytes] = []
    for byte in b"".join(frames):
        reader.feed(bytes([byte]))
        got.extend(reader.frames())
    assert got == frames
    assert reader.next_frame() is NEED_DATA


@settings(max_examples=100, deadline=None)
@given(streams, st.data())
def test_stream_ending_inside_a_frame_is_truncated(
    stream: list[tuple[Frame, bytes]], data: st.DataObject
) -> None:
    whole = b"".join(raw for _, raw in stream)
    cut = data.draw(st.integers(1, len(whole) - 1))
    boundaries = set()
    pos = 0
    for _, raw in stream:
        pos += len(raw)
        boundaries.add(pos)
    reader = FrameReader()
    reader.feed(whole[:cut])
    reader.frames()
    if cut in boundaries:
        reader.close()
    else:
        with pytest.raises(TruncatedFrameError) as info:
            reader.close()
        assert info.value.buffered == reader.buffered > 0
        assert info.value.code.name == "TRUNCATED_FRAME"


def test_prefix_is_checked_before_the_body_arrives() -> None:
    reader = FrameReader(max_frame_bytes=100)
    reader.feed(b"\x65\x00")  # half a prefix: undecided
    assert reader.next_frame() is NEED_DATA
    reader.feed(b"\x00\x00")  # 101: refused with no body byte buffered
    with pytest.raises(FrameTooLargeError) as info:
        reader.next_frame()
    assert (info.value.size, info.value.limit) == (101, 100)
    assert isinstance(info.value, ProtocolError)


@pytest.mark.parametrize("size", [0, 1, MIN_FRAME_SIZE - 1])
def test_tiny_prefix_is_malformed(size: int) -> None:
    reader = FrameReader()
    reader.feed(size.to_bytes(4, "little") + b"\x00" * 16)
    with pytest.raises(MalformedFrameError):
        reader.next_frame()


def test_4gb_prefix_allocates_nothing() -> None:
    reader = FrameReader()
    reader.feed(b"\xff\xff\xff\xff" + b"x" * 10)
    with pytest.raises(FrameTooLargeError):
        reader.next_frame()
    assert reader.buffered == 14


def test_reader_compacts_consumed_bytes() -> None:
    frame = encode_message(b"p", b"k", b"x" * 100)
    reader = FrameReader()
    for _ in range(1000):
        reader.feed(frame + frame[:10])
        assert reader.next_frame() == frame
        reader.feed(frame[10:])
        assert reader.next_frame() == frame
        assert reader.buffered == 0
    # Consumed bytes are dropped on the next feed, so the buffer does not grow.
    assert len(reader._buf) <= 2 * len(frame) + 10
