"""The SDK as the tests drive it: a coroutine run with a deadline, partitions per worker, what a
subscriber received, a Client wired to an in-memory link (no server, no socket), and a decoder
for reads in bulk that gives its batches as Messages.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import broky
from broky.client.client import Client, Link
from broky.errors import MalformedFrameError
from broky.protocol import VBUCKETS, Message, VBucketMap, decode_message, vbucket_of
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.protocol.layout import HEADER_AT, HEADER_END, HEADER_NO_UID, HEADER_UID


def partitions_by_worker(vmap: VBucketMap, per_worker: int = 2) -> dict[int, list[bytes]]:
    """Some key_partitions owned by each worker of the (single-node) map."""
    found: dict[int, list[bytes]] = {}
    workers = vmap.nodes[0].workers
    i = 0
    while any(len(found.get(w, [])) < per_worker for w in range(workers)):
        kp = f"p{i}".encode()
        w = vmap.owners[vbucket_of(kp)][1]
        if len(found.setdefault(w, [])) < per_worker:
            found[w].append(kp)
        i += 1
    return found


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 30) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(main())


async def take(sub: broky.Subscription, n: int, timeout: float = 5) -> list[broky.Message]:
    return [await sub.next_msg(timeout) for _ in range(n)]


SEQ = struct.Struct(">II")  # key_partition index, sequence number within it


class Received:
    """What a subscriber got, per key_partition, and what it was told it lost."""

    def __init__(self) -> None:
        self.by_kp: dict[int, list[int]] = {}
        self.count = 0
        self.told: list[tuple[int, int]] = []  # (dropped, reason)

    def take(self, msg: broky.Message) -> None:
        kp, n = SEQ.unpack_from(msg.payload)
        self.by_kp.setdefault(kp, []).append(n)
        self.count += 1

    def on_loss(self, ref: Any, dropped: int, reason: int) -> None:
        self.told.append((dropped, reason))

    def told_count(self) -> int:
        return sum(d for d, _ in self.told)


class FakeProto:
    write_paused = False

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, parts: list[bytes]) -> None:
        self.written.append(b"".join(parts))

    def close(self) -> None:
        pass


def unconnected_client(max_frame: int = 1 << 20) -> tuple[Client, Link]:
    client = Client("127.0.0.1:1", batch_size=1 << 40)
    client.loop = asyncio.get_running_loop()
    client._open = client._connected = True
    client._encoder.set_limit(max_frame)
    link = Link(client, "n", 0)
    link.proto = FakeProto()  # type: ignore[assignment]
    client.router.route = [link] * VBUCKETS
    return client, link


class MessageBatches:
    """A BulkDecoder (`Reading.batches`) whose batches are lists of Messages: it takes the
    whole Message frames in the canonical layout, as decode_message reads them, and stops at
    any other frame (what broky.spark.readcols's decoders take, as Messages)."""

    def __init__(self, batch_rows: int, batch_bytes: int) -> None:
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
        while not self.full and end - pos >= 4:
            size = struct.unpack_from("<I", data, pos)[0]
            stop = pos + 4 + size
            if not MIN_FRAME_SIZE <= size <= max_frame or stop > end:
                break
            if data[pos + HEADER_AT : pos + HEADER_END] not in (HEADER_UID, HEADER_NO_UID):
                break
            try:
                msg = decode_message(data, pos, stop)
            except MalformedFrameError:
                break
            if msg.vbucket < len(vbuckets) and vbuckets[msg.vbucket]:
                self.add(msg)
            pos = stop
        return pos

    def add(self, msg: Message) -> None:
        self.messages.append(msg)
        self.nbytes += len(msg.key_partition) + len(msg.key) + len(msg.payload)

    def take(self) -> list[Message]:
        msgs, self.messages, self.nbytes = self.messages, [], 0
        return msgs
