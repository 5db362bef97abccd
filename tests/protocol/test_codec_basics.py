"""Round trips of every frame through the codec and the generated code check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broky import fbs
from broky.errors import ErrorCode, FrameTooLargeError, LocalProtocolError, MalformedFrameError
from broky.protocol import (
    NEED_DATA,
    Ack,
    AckKind,
    Delivery,
    Error,
    Frame,
    FrameReader,
    Goodbye,
    GroupEvent,
    GroupNotice,
    Hello,
    LossNotice,
    LossReason,
    Message,
    NodeInfo,
    Pause,
    Ping,
    Pong,
    Position,
    Read,
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
from broky.protocol.frames import error_frame
from tests.support import requires
from tests.support.paths import ROOT

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
    Subscribe(9, b"orders.>", group="billing"),
    Subscribe(10, b"orders.>", group="billing", key_shared=True),
    Subscribe(
        11,
        b"orders.>",
        group="billing",
        ack=True,
        ack_wait_ms=30_000,
        max_deliveries=5,
        backoff_ms=(1000, 5000, 30_000),
        max_in_flight=1000,
        max_in_flight_bytes=16 << 20,
        dead_letter=b"orders.dead",
        drain_timeout_ms=10_000,
    ),
    Delivery(9, 8),
    Delivery(11, 1, 2),
    Ack(11, AckKind.ACK, (Position(517, 1, 2), Position(828, 3, 4))),
    Ack(11, AckKind.NACK, (Position(517, 1, 2),), 250),
    Ack(11, AckKind.IN_PROGRESS, ()),
    GroupNotice(11, GroupEvent.PAUSED, 1000),
    GroupNotice(11, GroupEvent.RESUMED),
    GroupNotice(10, GroupEvent.DRAIN_EXPIRED, 3, 517),
    LossNotice(4, LossReason.GROUP_OVERFLOW, 11),
    Error(23, "group settings differ", 1, False, 9),
]


@pytest.mark.parametrize("frame", CONTROL_FRAMES, ids=lambda f: type(f).__name__)
def test_control_frames_round_trip(frame: object) -> None:
    assert decode_frame(encode_frame(frame)) == frame  # type: ignore[arg-type]


def test_welcome_template_patches_connection_id() -> None:
    vmap = VBucketMap.single_node(NodeInfo("node-a", "127.0.0.1", 4777, 2))
    template = WelcomeTemplate(Welcome("node-a", 1, vmap, 1 << 20, 8 << 20))
    welcome = decode_frame(template.for_connection(42, b"t" * 16))
    assert isinstance(welcome, Welcome)
    assert welcome.connection_id == 42
    assert welcome.resume_token == b"t" * 16
    assert welcome.map == vmap
    assert welcome.map.owners[0] == (0, 0) and welcome.map.owners[1023] == (0, 1)


def test_message_round_trip_and_route() -> None:
    uid = new_ksuid()
    frame = encode_message(b"t1", b"orders.created", b"x" * 100, 5, 0, uid)
    assert decode_frame(frame) == Message(b"t1", b"orders.created", b"x" * 100, 5, 0, uid)
    kp, key, ts_pos = route_message(frame, 0, len(frame))
    assert (kp, key) == (b"t1", b"orders.created")
    assert ts_pos is not None  # the canonical layout is stamped in place
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


@pytest.mark.parametrize(
    "frame",
    [
        Subscribe(-1, b"a.b"),
        Subscribe(1, "a.b"),  # type: ignore[arg-type]
        Subscribe(1, b"a.b", "kp"),  # type: ignore[arg-type]
        Unsubscribe(2**32),
        Ping(-1),
        Ping(1.5),  # type: ignore[arg-type]
        Pong(2**64),
        Read(1, b">", vbuckets=(65536,)),
        Read(1, b">", vbuckets=(3, -1)),
        Hello(worker=40000),
        Hello(protocol_version=-1),
        Hello(client_name=7),  # type: ignore[arg-type]
        Hello(auth_token="\ud800"),  # not encodable as UTF-8
        Error(70000),
        Error(1, "x", fatal="yes"),  # type: ignore[arg-type]
        LossNotice(1, 256),
        Goodbye(b"bytes"),  # type: ignore[arg-type]
        Welcome("n", 0, VBucketMap.single_node(NodeInfo("n", "h", 70000, 1)), 1, 1),
        Message(b"k", b"k", b"v", 2**63),
        Message(b"k", b"k", b"v", uid=b"short"),
        Message(b"k", "k", b"v"),  # type: ignore[arg-type]
        Message(None, b"k", b"v"),  # type: ignore[arg-type]
        # Version 3: each field of a group member, and the three new frames.
        Subscribe(1, b"a", group=b"billing"),  # type: ignore[arg-type]
        Subscribe(1, b"a", group="\ud800"),
        Subscribe(1, b"a", key_shared="yes"),  # type: ignore[arg-type]
        Subscribe(1, b"a", ack=2),  # type: ignore[arg-type]
        Subscribe(1, b"a", ack_wait_ms=2**32),
        Subscribe(1, b"a", ack_wait_ms=-1),
        Subscribe(1, b"a", ack_wait_ms=1.5),  # type: ignore[arg-type]
        Subscribe(1, b"a", max_deliveries=2**32),
        Subscribe(1, b"a", max_deliveries=-1),
        Subscribe(1, b"a", backoff_ms=(1000, 2**32)),
        Subscribe(1, b"a", backoff_ms=(-1,)),
        Subscribe(1, b"a", backoff_ms=("1000",)),  # type: ignore[arg-type]
        Subscribe(1, b"a", max_in_flight=2**32),
        Subscribe(1, b"a", max_in_flight=-1),
        Subscribe(1, b"a", max_in_flight_bytes=2**64),
        Subscribe(1, b"a", max_in_flight_bytes=-1),
        Subscribe(1, b"a", dead_letter="orders.dead"),  # type: ignore[arg-type]
        Subscribe(1, b"a", drain_timeout_ms=2**32),
        Subscribe(1, b"a", drain_timeout_ms=-1),
        Delivery(-1, 1),
        Delivery(2**32, 1),
        Delivery(1, 2**32),
        Delivery(1, 1, -1),
        Delivery(1, 1, None),  # type: ignore[arg-type]
        Ack(-1, AckKind.ACK, ()),
        Ack(1, 256, ()),
        Ack(1, -1, ()),
        Ack(1, AckKind.NACK, (), 2**31),
        Ack(1, AckKind.NACK, (), -(2**31) - 1),
        Ack(1, AckKind.NACK, (), 0.5),  # type: ignore[arg-type]
        Ack(1, AckKind.ACK, (Position(65536, 0, 0),)),
        Ack(1, AckKind.ACK, (Position(0, -1, 0),)),
        Ack(1, AckKind.ACK, (Position(0, 0, 2**64),)),
        GroupNotice(-1, GroupEvent.PAUSED),
        GroupNotice(1, 256),
        GroupNotice(1, GroupEvent.PAUSED, 2**64),
        GroupNotice(1, GroupEvent.PAUSED, -1),
        GroupNotice(1, GroupEvent.DRAIN_EXPIRED, 1, 65536),
        "not a frame",
    ],
    ids=repr,
)
def test_values_the_schema_cannot_carry_raise_local_protocol_error(frame: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(frame)  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.MALFORMED_FRAME


def test_the_edges_of_the_version_3_fields_are_carried() -> None:
    # The refusals above are exactly past the edges: the edges themselves go through.
    top = Subscribe(
        2**32 - 1,
        b"a",
        group="",
        key_shared=True,
        ack=True,
        ack_wait_ms=2**32 - 1,
        max_deliveries=2**32 - 1,
        backoff_ms=(0, 2**32 - 1),
        max_in_flight=2**32 - 1,
        max_in_flight_bytes=2**64 - 1,
        dead_letter=b"",
        drain_timeout_ms=2**32 - 1,
    )
    edges: list[Frame] = [
        top,
        Delivery(2**32 - 1, 2**32 - 1, 2**32 - 1),
        Delivery(0, 0, 0),
        Ack(2**32 - 1, 255, (Position(65535, 2**64 - 1, 2**64 - 1),), 2**31 - 1),
        Ack(0, 0, (Position(0, 0, 0),), -(2**31)),
        GroupNotice(2**32 - 1, 255, 2**64 - 1, 65535),
    ]
    for frame in edges:
        assert decode_frame(encode_frame(frame)) == frame


def test_the_enumerations_name_every_value_of_the_schema() -> None:
    # LossReason.NAMES (metric labels, the SDK's on_loss) and the value classes of the
    # version-3 enums agree with the generated enums, member for member.
    def members(enum: type) -> dict[str, int]:
        return {k: v for k, v in vars(enum).items() if type(v) is int}

    wire = members(fbs.LossReason)
    assert {v: k.lower() for k, v in wire.items()} == LossReason.NAMES
    assert {k: getattr(LossReason, k) for k in wire} == wire
    assert LossReason.name(10) == "unacked_lost" and LossReason.name(200) == "reason_200"
    assert members(AckKind) == members(fbs.AckKind) == {"ACK": 0, "NACK": 1, "IN_PROGRESS": 2}
    assert members(GroupEvent) == members(fbs.GroupEvent) == {"PAUSED": 0, "RESUMED": 1, "DRAIN_EXPIRED": 2}
    assert {e.name: int(e) for e in ErrorCode} == members(fbs.ErrorCode)


def test_the_error_frame_shortcut_is_checked_too() -> None:
    with pytest.raises(LocalProtocolError, match="cannot encode Error"):
        error_frame(ErrorCode.INTERNAL, "x", fatal=True, sid=-1)


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(MalformedFrameError):
        decode_frame(b"\x10\x00\x00\x00" + b"\xff" * 16)


def test_generated_code_is_current() -> None:
    requires.program("flatc")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_names_its_flatc_version() -> None:
    flatc = requires.program("flatc")
    version = subprocess.run([flatc, "--version"], capture_output=True, text=True, check=True).stdout
    header = (ROOT / "broky" / "fbs" / "broky_generated.py").read_text().splitlines()[:3]
    assert f"# flatc version: {version.removeprefix('flatc version').strip()}" in header


def test_check_with_another_flatc_release_names_both_versions(tmp_path: Path) -> None:
    # A flatc that reports another version but generates exactly what the real one does.
    real = requires.program("flatc")
    fake = tmp_path / "flatc"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "flatc version 99.1.2"; exit 0; fi\n'
        f'exec "{real}" "$@"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 1
    committed = (ROOT / "broky" / "fbs" / "broky_generated.py").read_text().splitlines()[1]
    assert committed.startswith("# flatc version: ")
    assert "flatc version mismatch" in result.stdout
    assert f"generated with flatc {committed.removeprefix('# flatc version: ')}" in result.stdout
    assert "the installed flatc is 99.1.2" in result.stdout


@given(st.integers(0, 2**64 - 1))
def test_ping_id_reads_the_pings_encode_ping_writes(value: int) -> None:
    from broky.protocol.frames import PING_SIZE_PREFIX, encode_ping, ping_id

    frame = encode_ping(Ping(value))
    assert len(frame) - 4 == PING_SIZE_PREFIX
    assert ping_id(frame, 0, len(frame)) == value == decode_frame(frame).id  # type: ignore[union-attr]
    padded = b"\x00" * 5 + frame + b"\x01" * 3
    assert ping_id(padded, 5, 5 + len(frame)) == value
    assert ping_id(memoryview(padded), 5, 5 + len(frame)) == value
    # anything else is left to decode_frame
    pong = encode_frame(Pong(value))
    assert ping_id(pong, 0, len(pong)) is None
    assert ping_id(frame[:-1], 0, len(frame) - 1) is None
