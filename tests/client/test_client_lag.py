"""An SDK subscriber whose code falls behind: its queue pauses the connection, the server
lags it past its bound, `sub.lag` says how far behind it is, and it loses nothing."""

from __future__ import annotations

import asyncio
import struct
import threading
from typing import Any

import pytest

import broky
from tests.support.sdk import run
from tests.support.serverproc import ServerProcess

SEQ = struct.Struct(">II")


def publish(server: ServerProcess, total: int, partitions: int, sent: list[int]) -> None:
    with broky.connect_sync(server.url) as client:
        for i in range(total):
            k = i % partitions
            client.publish(b"lag.k", SEQ.pack(k, sent[k]) + bytes(200), partition=b"p-%d" % k)
            sent[k] += 1
        client.flush()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("blocking", [False, True])
def test_a_subscriber_behind_sees_its_lag_and_loses_nothing(start_server: Any, blocking: bool) -> None:
    server: ServerProcess = start_server("--max-pending-bytes", "256K")
    total, partitions = 40_000, 8
    sent = [0] * partitions
    seen_lag: list[broky.Lag] = []
    got: dict[int, list[int]] = {}
    losses: list[tuple[int, int]] = []

    def take(payload: bytes) -> None:
        k, n = SEQ.unpack_from(payload)
        got.setdefault(k, []).append(n)

    if blocking:
        with broky.connect_sync(
            server.url, ping_interval=0.1, on_loss=lambda *a: losses.append(a[1:])
        ) as client:
            sub = client.subscribe("lag.>", max_pending_msgs=200)
            writer = threading.Thread(target=publish, args=(server, total, partitions, sent))
            writer.start()
            writer.join(60)
            for _ in range(200):  # it has read nothing: the server owes it most of the burst
                seen_lag.append(sub.lag)
                if seen_lag[-1].messages > total // 2:
                    break
                threading.Event().wait(0.05)
            for _ in range(total):
                take(sub.next(timeout=10).payload)
            threading.Event().wait(0.3)  # a Pong or two
            after = sub.lag
    else:

        async def main() -> None:
            nonlocal after
            options: dict[str, Any] = {"ping_interval": 0.1, "on_loss": lambda *a: losses.append(a[1:])}
            async with broky.connect(server.url, **options) as client:
                sub = await client.subscribe("lag.>", max_pending_msgs=200)
                await asyncio.to_thread(publish, server, total, partitions, sent)
                for _ in range(200):
                    seen_lag.append(sub.lag)
                    if seen_lag[-1].messages > total // 2:
                        break
                    await asyncio.sleep(0.05)
                for _ in range(total):
                    take((await sub.next_msg(timeout=10)).payload)
                await asyncio.sleep(0.3)
                after = sub.lag

        after = broky.Lag(-1, -1.0)
        run(main, timeout=80)
    assert max(x.messages for x in seen_lag) > total // 2  # it could tell it was behind
    assert losses == []
    assert sum(len(v) for v in got.values()) == total
    for k, seqs in got.items():
        assert seqs == list(range(sent[k]))  # each once, in order
    assert after.messages == 0  # caught up, and told so
