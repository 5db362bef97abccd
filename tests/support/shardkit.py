"""The real Shard (broky.server.shard.core) with in-memory transports, for tests in one process.

`Recorder` is a transport that keeps what is written and reads it back as frames;
`attach` gives a shard a connection over one; `shard_with` builds a one-worker shard with
subscribers and a publisher; `loop` (a fixture, registered in tests/conftest.py) is the
event loop a shard is built on, closed after the test. The fuzz, twin and model tests of
the shard (tests/server/unit/) and the forwarding test build on these.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator

import pytest

from broky.protocol import NEED_DATA, Frame, FrameReader, Subscribe, decode_frame
from broky.server.config import ServerConfig
from broky.server.shard.connection import Connection
from broky.server.shard.core import Shard


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A new event loop for a shard, closed after the test (the shard runs no task on it)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Recorder:
    """An in-memory transport: keeps what is written."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.eof = False
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.eof or self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.limits = (high, low)  # a lagging connection's (broky.server.shard.lag)

    def pause_reading(self) -> None:  # a Read holds its connection's input for a turn of the loop
        pass

    def resume_reading(self) -> None:
        pass

    def frames(self) -> list[object]:
        reader = FrameReader(max_frame_bytes=1 << 30)
        reader.feed(bytes(self.data))
        out: list[object] = []
        while (raw := reader.next_frame()) is not NEED_DATA:
            out.append(decode_frame(raw))
        assert reader.buffered == 0, "a partial frame was written"
        return out


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def attach(shard: Shard, i: int) -> Connection:
    """Connection `i` of `shard`, over a Recorder."""
    c = Connection(shard, b"", i)
    c.transport = Recorder()  # type: ignore[assignment]
    shard.conns[i] = c
    return c


def received(c: Connection) -> list[Frame]:
    """Every frame written to `c` (over a Recorder) so far."""
    frames = c.transport.frames()  # type: ignore[attr-defined]
    assert isinstance(frames, list)
    return frames


def shard_with(
    loop: asyncio.AbstractEventLoop,
    patterns: list[tuple[bytes, bytes | None]],
    *,
    node_id: str,
    compiled: bool = False,
    replay_bytes: int | None = None,
) -> tuple[Shard, Connection, list[Connection]]:
    """A worker owning every vbucket, one subscriber per (pattern, key_partition) and a publisher;
    replay_bytes: its replay buffer's bound (None: the default; 0: none).

    The subscribers are connections 1..n (each subscription's id 1), the publisher n + 1.
    """
    config = ServerConfig(workers=1, node_id=node_id)
    if replay_bytes is not None:
        config = dataclasses.replace(config, replay_bytes=replay_bytes)
    shard = Shard(config, 0, loop, compiled=compiled)
    subs = [attach(shard, i) for i in range(1, len(patterns) + 1)]
    for sub, (pattern, kp) in zip(subs, patterns, strict=True):
        shard.subscribe(sub, Subscribe(1, pattern, kp))
    return shard, attach(shard, len(subs) + 1), subs
