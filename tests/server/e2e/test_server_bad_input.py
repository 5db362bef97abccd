"""Bad input: each gets a fatal Error frame and a close, one log line without a
traceback, and the server keeps serving every other connection."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Iterator

import flatbuffers
import pytest

from broky import fbs
from broky.errors import ErrorCode
from broky.protocol import Error, Goodbye, Hello, Ping, Welcome, encode_frame, encode_message
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

TOKEN = "s3cret"
KP0 = kp_for_worker(0, 2)
HELLO = encode_frame(Hello(auth_token=TOKEN, worker=0))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--auth-token", TOKEN, "--hello-timeout", "1", "--frame-timeout", "1")
    proc.start()
    yield proc
    proc.stop()


def unknown_frame() -> bytes:
    b = flatbuffers.Builder(32)
    b.StartObject(0)
    body = b.EndObject()
    fbs.FrameStart(b)
    fbs.FrameAddBodyType(b, 99)
    fbs.FrameAddBody(b, body)
    b.FinishSizePrefixed(fbs.FrameEnd(b), b"BRKY")
    return bytes(b.Output())


def malformed_frame() -> bytes:
    # A size prefix and a root offset pointing far outside the frame.
    body = struct.pack("<I4s", 1_000_000, b"BRKY") + b"\x00" * 16
    return struct.pack("<I", len(body)) + body


def half_message() -> bytes:
    frame = encode_message(KP0, b"k", b"x" * 100)
    return frame[: len(frame) // 2]


def oversize_prefix() -> bytes:
    return struct.pack("<I", (1 << 20) + 1) + b"\x00" * 64


def _before_hello(data: bytes) -> Callable[[socket.socket], None]:
    return lambda s: s.sendall(data)


def _after_hello(data: bytes) -> Callable[[socket.socket], None]:
    return lambda s: s.sendall(HELLO + data)


def _half_close(data: bytes) -> Callable[[socket.socket], None]:
    def act(s: socket.socket) -> None:
        s.sendall(HELLO + data)
        s.shutdown(socket.SHUT_WR)

    return act


def _reset(data: bytes) -> Callable[[socket.socket], None]:
    """Send data, then close with a TCP reset (SO_LINGER 0): the client is gone."""

    def act(s: socket.socket) -> None:
        s.sendall(data)
        time.sleep(0.05)  # the master is reading the Hello when the reset comes
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    return act


RESET = "lost during the handshake"  # the master's log line when the client is gone (no Error)

# (name, what the client does, the Error it gets; None: it reset, nothing to read)
CASES: list[tuple[str, Callable[[socket.socket], None], ErrorCode | None]] = [
    ("http instead of hello", _before_hello(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), ErrorCode.FRAME_TOO_LARGE),
    (
        "garbage before hello",
        _before_hello(b"\x20\x00\x00\x00" + b"\xab" * 32 + HELLO),
        ErrorCode.MALFORMED_FRAME,
    ),
    ("tiny size prefix", _before_hello(b"\x02\x00\x00\x00zz" + HELLO), ErrorCode.MALFORMED_FRAME),
    ("ping instead of hello", _before_hello(encode_frame(Ping(1))), ErrorCode.EXPECTED_HELLO),
    ("wrong token", _before_hello(encode_frame(Hello(auth_token="nope"))), ErrorCode.AUTH_FAILED),
    ("no token", _before_hello(encode_frame(Hello())), ErrorCode.AUTH_FAILED),
    # version 1 (or a Hello without the field): its 16-byte Stamps cannot be read as version 2's
    ("version 1", _before_hello(encode_frame(Hello(1, auth_token=TOKEN))), ErrorCode.UNSUPPORTED_VERSION),
    ("version 4", _before_hello(encode_frame(Hello(4, auth_token=TOKEN))), ErrorCode.UNSUPPORTED_VERSION),
    (
        "worker 7 of 2",
        _before_hello(encode_frame(Hello(worker=7, auth_token=TOKEN))),
        ErrorCode.NO_SUCH_WORKER,
    ),
    ("silence", lambda s: None, ErrorCode.HELLO_TIMEOUT),
    ("half a hello, then silence", _before_hello(HELLO[:10]), ErrorCode.HELLO_TIMEOUT),
    ("oversized prefix before hello", _before_hello(oversize_prefix()), ErrorCode.FRAME_TOO_LARGE),
    ("oversized prefix", _after_hello(oversize_prefix()), ErrorCode.FRAME_TOO_LARGE),
    ("malformed flatbuffer", _after_hello(malformed_frame()), ErrorCode.MALFORMED_FRAME),
    ("garbage frame", _after_hello(struct.pack("<I", 40) + bytes(range(40))), ErrorCode.MALFORMED_FRAME),
    ("unknown frame", _after_hello(unknown_frame()), ErrorCode.UNKNOWN_FRAME),
    ("half frame, then silence", _after_hello(half_message()), ErrorCode.TRUNCATED_FRAME),
    ("end of stream inside a frame", _half_close(half_message()), ErrorCode.TRUNCATED_FRAME),
    ("second hello", _after_hello(HELLO), ErrorCode.UNEXPECTED_FRAME),
    ("goodbye from a client", _after_hello(encode_frame(Goodbye("bye"))), ErrorCode.UNEXPECTED_FRAME),
    ("reset inside the hello", _reset(HELLO[:2]), None),
    ("reset before the hello", _reset(b""), None),
]


def log_lines(server: ServerProcess, code: ErrorCode | None) -> int:
    marker = RESET if code is None else f" {code.name}: "
    return sum(1 for line in server.log().splitlines() if marker in line)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def healthy_pubsub(server: ServerProcess, tag: bytes) -> None:
    with (
        Wire.hello(server.address, worker=0, token=TOKEN) as sub,
        Wire.hello(server.address, worker=0, token=TOKEN) as pub,
    ):
        sub.subscribe(1, b"health." + tag)
        sub.flush()
        pub.publish(KP0, b"health." + tag, tag)
        pub.flush()
        assert [m.payload for m in sub.messages()] == [tag]


@pytest.mark.parametrize(("name", "act", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_error_and_a_close(
    server: ServerProcess, name: str, act: Callable[[socket.socket], None], code: ErrorCode | None
) -> None:
    # A connection that stays open across the bad one.
    bystander = Wire.hello(server.address, worker=0, token=TOKEN)
    bystander.subscribe(1, b"bystander")
    bystander.flush()
    lines_before = log_lines(server, code)
    fds_before = open_fds(server.pid)  # the master's: a handshake that goes wrong must not leak

    w = Wire(server.address, timeout=5)
    act(w.sock)
    if code is None:  # the client reset: nothing to read
        assert w.sock.fileno() == -1
    else:
        frames = w.expect_closed()
        w.close()
        if frames and isinstance(frames[0], Welcome):
            frames = frames[1:]
        assert len(frames) == 1, frames
        error = frames[0]
        assert isinstance(error, Error)
        assert (error.code, error.fatal) == (code, True), error
        assert error.message

    deadline = time.monotonic() + 15
    while log_lines(server, code) != lines_before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log_lines(server, code) == lines_before + 1, server.log()
    assert "Traceback" not in server.log() and "never retrieved" not in server.log()
    while open_fds(server.pid) > fds_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds(server.pid) <= fds_before

    healthy_pubsub(server, name.replace(" ", "_").replace(",", "").encode())
    with Wire.hello(server.address, worker=0, token=TOKEN) as pub:
        pub.publish(KP0, b"bystander", b"still here")
        pub.flush()
    assert [m.payload for m in bystander.messages()] == [b"still here"]
    bystander.close()
