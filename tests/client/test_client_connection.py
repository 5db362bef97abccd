"""The client connection's inline frame cutting and delivery decoding agree with the codec."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.client.connection import WorkerProtocol
from broky.errors import FrameTooLargeError, MalformedFrameError
from broky.protocol import Frame, Message, Pong, decode_frame, encode_frame, encode_message
from tests.support.generated import Writer
from tests.support.sdk import MessageBatches

messages = st.builds(
    Message,
    st.binary(max_size=30),
    st.binary(max_size=30),
    st.binary(max_size=200),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**63 - 1),
    st.one_of(st.none(), st.binary(min_size=20, max_size=20)),
    vbucket=st.integers(0, 1023),
    epoch=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
)


class Recorder:
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.lost: list[BaseException | None] = []

    def on_message(self, msg: Message) -> None:
        self.frames.append(msg)

    def on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        self.lost.append(exc)


class FakeTransport:
    def __init__(self, proto: WorkerProtocol) -> None:
        self.proto = proto
        self.closed = False

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.proto.connection_lost(None)

    def is_closing(self) -> bool:
        return self.closed


ALL_U16 = b"\x01" * (1 << 16)  # a mask that passes over no vbucket (a u16 may name none)


class RunRecorder(Recorder):
    """A handler that takes runs of Message frames itself (attach's on_run, as a read in
    bulk does), through a decoder: the messages it takes and the frames it is handed, in
    one list, in the order they came."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = MessageBatches(1 << 20, 1 << 30)

    def on_run(self, data: bytes, pos: int, end: int) -> int:
        pos = self.decoder.scan(data, pos, end, ALL_U16, 64 << 20)
        self.frames.extend(self.decoder.take())
        return pos


def feed(chunks: list[bytes], runs: bool = False) -> tuple[Recorder, WorkerProtocol]:
    async def main() -> tuple[Recorder, WorkerProtocol]:
        proto = WorkerProtocol()
        proto.transport = FakeTransport(proto)  # type: ignore[assignment]
        rec = RunRecorder() if runs else Recorder()
        proto.attach(rec, on_run=rec.on_run if isinstance(rec, RunRecorder) else None)
        transport = proto.transport
        assert transport is not None
        for chunk in chunks:
            if transport.is_closing():  # like a real transport: nothing is read after abort()
                break
            proto.data_received(chunk)
        return rec, proto

    return asyncio.run(main())


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            messages,
            st.builds(
                Pong, st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**64 - 1)
            ),
        ),
        max_size=12,
    ),
    st.data(),
)
def test_any_split_gives_the_codec_frames(frames: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    rec, _ = feed(chunks)
    assert rec.frames == [decode_frame(encode_frame(f)) for f in frames]
    assert rec.lost == []


@st.composite
def read_answer(draw: st.DrawFn) -> bytes:
    """One frame of a read's answer: a Message in the canonical layout (to on_run), one a
    Builder wrote (another layout: the run stops at it), or a control frame."""
    kind = draw(st.sampled_from(["canonical", "builder", "control"]))
    if kind == "control":
        return encode_frame(
            draw(
                st.builds(
                    Pong, st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1), st.integers(0, 2**64 - 1)
                )
            )
        )
    msg = draw(messages)
    return Writer(draw).frame(msg) if kind == "builder" else encode_frame(msg)


@settings(max_examples=150, deadline=None)
@given(st.lists(read_answer(), max_size=12), st.data())
def test_runs_taken_by_the_handler_keep_every_frame_in_order_at_any_split(
    raw: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(raw)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    rec, proto = feed(chunks, runs=True)
    assert rec.frames == [decode_frame(f) for f in raw]
    assert rec.lost == [] and proto.failure is None and not proto.tail


def test_a_vector_overrunning_the_frame_is_malformed() -> None:
    frame = bytearray(encode_message(b"p", b"k", b"payload", 1, 2, bytes(20)))
    # payload length (just before the payload) made larger than the frame
    at = frame.index(b"payload") - 4
    frame[at : at + 4] = (1000).to_bytes(4, "little")
    rec, proto = feed([bytes(frame)])
    assert rec.frames == []
    assert isinstance(proto.failure, MalformedFrameError)


def test_an_oversized_prefix_fails_before_buffering() -> None:
    rec, proto = feed([(1 << 31).to_bytes(4, "little")])
    assert isinstance(proto.failure, FrameTooLargeError)
    assert rec.lost and isinstance(rec.lost[0], FrameTooLargeError)


# Deliveries of a few shapes (lengths that pad alike share a frame size and
# offsets), so the shape cache of the fast read is hit with other key and
# payload lengths than the ones it was made from.
shaped = st.builds(
    lambda kp, key, pay, ts, uid: Message(kp, key, pay, ts, ts + 1, uid),
    st.sampled_from([b"p1", b"p12", b"p123"]),
    st.sampled_from([b"k", b"k.a", b"k.ab", b"k.abc", b"k.abcd"]),
    st.sampled_from([b"", b"x", b"xy", b"xyz", b"w" * 9, b"w" * 12]),
    st.integers(0, 2**62),
    st.binary(min_size=20, max_size=20),
)


def codec_reading(stream: bytes) -> tuple[list[Frame], bool]:
    """What the codec reads from a stream: its frames, and whether it fails."""
    from broky.errors import ProtocolError
    from broky.protocol import NEED_DATA, FrameReader

    reader = FrameReader(max_frame_bytes=64 << 20)
    reader.feed(stream)
    frames: list[Frame] = []
    try:
        while (raw := reader.next_frame()) is not NEED_DATA:
            frames.append(decode_frame(raw))
    except ProtocolError:
        return frames, True
    return frames, False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(shaped, min_size=1, max_size=20),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=3),
    st.data(),
)
def test_repeated_shapes_and_mutations_read_like_the_codec(
    msgs: list[Message], edits: list[tuple[int, int]], data: st.DataObject
) -> None:
    stream = bytearray(b"".join(encode_frame(m) for m in msgs))
    for at, value in edits:
        stream[at % len(stream)] = value
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    chunks = [bytes(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    want, fails = codec_reading(bytes(stream))
    if not edits:
        assert want == msgs and not fails
    for runs in (False, True):  # (as a read in bulk takes them: the same frames, the same failure)
        rec, proto = feed(chunks, runs)
        assert rec.frames == want
        assert (proto.failure is not None) == fails


def test_a_run_is_not_taken_with_announced_deliveries() -> None:
    async def main() -> None:
        proto = WorkerProtocol()
        rec = RunRecorder()
        with pytest.raises(ValueError, match="on_run"):
            proto.attach(rec, on_replayed=lambda msg, sid: None, on_run=rec.on_run)

    asyncio.run(main())


def test_frames_right_after_the_welcome_wait_for_the_owner() -> None:
    """A resumed connection's LossNotices come in the Welcome's read, before the Link
    attaches: they are handed over at attach, in order, not taken for a broken handshake."""
    from broky.protocol import LossNotice, LossReason, NodeInfo, VBucketMap, Welcome

    welcome = Welcome("n", 0, VBucketMap.single_node(NodeInfo("n", "h", 1, 1)), 1 << 20, 8 << 20, 5)
    notice = LossNotice(7, LossReason.WORKER_RESTART)
    msg = Message(b"kp", b"k", b"v", 1, 2, bytes(20))

    async def main() -> tuple[Recorder, WorkerProtocol]:
        proto = WorkerProtocol()
        proto.transport = FakeTransport(proto)  # type: ignore[assignment]
        proto.data_received(encode_frame(welcome) + encode_frame(notice) + encode_frame(msg))
        assert (await proto.welcome) == welcome
        rec = Recorder()
        proto.attach(rec)
        return rec, proto

    rec, proto = asyncio.run(main())
    assert proto.failure is None
    assert rec.frames == [notice, msg]
