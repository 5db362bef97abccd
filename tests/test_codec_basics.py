"""Round trips of every frame through the codec and the generated code check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broky.errors import FrameTooLargeError, MalformedFrameError
from broky.protocol import (
    NEED_DATA,
    Error,
    FrameReader,
    Goodbye,
    Hello,
    LossNotice,
    Message,
    NodeInfo,
    Pause,
    Ping,
    Pong,
    Resume,
    Subscribe,
    Unsubscribe,
    VBucketMap,
    Welcome,
    WelcomeTemplate,
    decode_frame,
    encode_frame,
    encode_message,
    new_ksuid,
    route_message,
)

ROOT = Path(__file__).resolve().parent.parent

CONTROL_FRAMES = [
    Hello(1, -1, "app", "secret"),
    Hello(),
    Subscribe(7, b"orders.*", b"tenant-1"),
    Subscribe(8, b"orders.>"),
    Unsubscribe(7),
    Pause(),
    Resume(),
    Ping(99),
    Pong(99),
    Error(10, "not my vbucket", 3, False, 0),
    LossNotice(12, 1),
    Goodbye("shutting down"),
]


@pytest.mark.parametrize("frame", CONTROL_FRAMES, ids=lambda f: type(f).__name__)
def test_control_frames_round_trip(frame: object) -> None:
    assert decode_frame(encode_frame(frame)) == frame  # type: ignore[arg-type]


def test_welcome_template_patches_connection_id() -> None:
    vmap = VBucketMap.single_node(NodeInfo("node-a", "127.0.0.1", 4777, 2))
    template = WelcomeTemplate(Welcome("node-a", 1, vmap, 1 << 20, 8 << 20))
    welcome = decode_frame(template.for_connection(42))
    assert isinstance(welcome, Welcome)
    assert welcome.connection_id == 42
    assert welcome.map == vmap
    assert welcome.map.owners[0] == (0, 0) and welcome.map.owners[1023] == (0, 1)


def test_message_round_trip_and_route() -> None:
    uid = new_ksuid()
    frame = encode_message(b"t1", b"orders.created", b"x" * 100, 5, 0, uid)
    assert decode_frame(frame) == Message(b"t1", b"orders.created", b"x" * 100, 5, 0, uid)
    kp, key, ts_pos = route_message(frame, 0, len(frame))
    assert (kp, key) == (b"t1", b"orders.created")
    assert frame[ts_pos : ts_pos + 8] == bytes(8)


def test_reader_splits_and_checks_prefix_before_buffering() -> None:
    frames = [encode_message(b"k", b"a.b", bytes([i]) * i) for i in range(5)]
    reader = FrameReader()
    for byte in b"".join(frames):
        reader.feed(bytes([byte]))
    assert reader.frames() == frames
    assert reader.next_frame() is NEED_DATA

    huge = FrameReader(max_frame_bytes=1 << 20)
    huge.feed((0xFFFF_FFFF).to_bytes(4, "little"))
    with pytest.raises(FrameTooLargeError) as info:
        huge.next_frame()
    assert info.value.size == 0xFFFF_FFFF and info.value.limit == 1 << 20


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(MalformedFrameError):
        decode_frame(b"\x10\x00\x00\x00" + b"\xff" * 16)


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
