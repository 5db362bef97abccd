"""The SDK as the tests drive it: a coroutine run with a deadline, partitions per worker, what a
subscriber received, and a Client wired to an in-memory link (no server, no socket).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import broky
from broky.client.client import Client, Link
from broky.protocol import VBUCKETS, VBucketMap, vbucket_of


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
