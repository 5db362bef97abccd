"""Raw-socket send/expect helpers on top of the codec, for tests of the wire.

`Wire` is a blocking TCP connection that speaks frames: `send` any frame
value (or raw bytes), `expect(Type)` the next frame and check its type,
`flush()` with a Ping to know every earlier frame was processed, and
`expect_closed()` for the end of the stream. Every read is bounded in time.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from broky.protocol import (
    NEED_DATA,
    Frame,
    FrameReader,
    Hello,
    Message,
    Ping,
    Pong,
    PreviousConnection,
    Subscribe,
    Unsubscribe,
    Welcome,
    decode_frame,
    encode_frame,
    encode_message,
    vbucket_of,
)

F = TypeVar("F")
_ids = itertools.count(1)


def kp_for_worker(worker: int, workers: int, prefix: str = "kp") -> bytes:
    """A key_partition whose vbucket belongs to `worker` of `workers` (single-node map)."""
    for i in itertools.count():
        kp = f"{prefix}-{i}".encode()
        if vbucket_of(kp) * workers // 1024 == worker:
            return kp
    raise AssertionError("unreachable")


class Wire:
    def __init__(self, address: tuple[str, int], timeout: float = 5.0, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect(address)
        self.timeout = timeout
        self.reader = FrameReader(max_frame_bytes=1 << 30)
        self.eof = False
        self.welcome: Welcome | None = None

    @classmethod
    def hello(
        cls,
        address: tuple[str, int],
        worker: int = -1,
        token: str | None = None,
        name: str | None = "test",
        previous: PreviousConnection | None = None,
        positions: bool = False,
        **kwargs: Any,
    ) -> Wire:
        """Connect, send Hello (naming `previous`, for a reconnect) and expect the Welcome."""
        w = cls(address, **kwargs)
        w.send(
            Hello(worker=worker, client_name=name, auth_token=token, previous=previous, positions=positions)
        )
        w.welcome = w.expect(Welcome)
        return w

    # ------------------------------------------------------------ sending

    def send(self, *frames: Frame | bytes) -> None:
        self.sock.sendall(
            b"".join(f if isinstance(f, bytes | bytearray) else encode_frame(f) for f in frames)
        )

    def publish(self, key_partition: bytes, key: bytes, payload: bytes = b"x", **kw: Any) -> None:
        self.sock.sendall(encode_message(key_partition, key, payload, **kw))

    def subscribe(self, sid: int, pattern: bytes, key_partition: bytes | None = None) -> None:
        self.send(Subscribe(sid, pattern, key_partition))

    def unsubscribe(self, sid: int) -> None:
        self.send(Unsubscribe(sid))

    # ------------------------------------------------------------ receiving

    def next(self, timeout: float | None = None) -> Frame:
        """The next frame; raises TimeoutError or EOFError."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            raw = self.reader.next_frame()
            if raw is not NEED_DATA:
                assert isinstance(raw, bytes)
                return decode_frame(raw)
            if self.eof:
                raise EOFError("connection closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame in time")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                raise TimeoutError("no frame in time") from None
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
            self.reader.feed(data)

    def expect(self, kind: type[F], timeout: float | None = None) -> F:
        frame = self.next(timeout)
        assert isinstance(frame, kind), f"expected {kind.__name__}, got {frame!r}"
        return frame

    def flush(self, timeout: float | None = None) -> list[Frame]:
        """Ping and collect every frame that arrives before the matching Pong."""
        ping_id = next(_ids)
        self.send(Ping(ping_id))
        frames: list[Frame] = []
        while True:
            frame = self.next(timeout)
            if isinstance(frame, Pong) and frame.id == ping_id:
                return frames
            frames.append(frame)

    def messages(self, timeout: float | None = None) -> list[Message]:
        """Flush and return the deliveries received before the Pong (only deliveries allowed)."""
        frames = self.flush(timeout)
        assert all(isinstance(f, Message) for f in frames), frames
        return frames  # type: ignore[return-value]

    def expect_silence(self, seconds: float = 0.2) -> None:
        try:
            frame = self.next(seconds)
        except TimeoutError:
            return
        raise AssertionError(f"expected nothing, got {frame!r}")

    def expect_closed(self, timeout: float | None = None) -> list[Frame]:
        """Read until the server closes; return the frames seen on the way."""
        frames: list[Frame] = []
        while True:
            try:
                frames.append(self.next(timeout))
            except EOFError:
                return frames

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def opened() -> Iterator[list[Wire]]:
    """The wires a test opens (it appends them): each closed when the test ends."""
    wires: list[Wire] = []
    yield wires
    for w in wires:
        w.close()
