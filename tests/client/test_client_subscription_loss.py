"""`subscribe(on_loss=...)`: the LossNotices naming a subscription go to its own hook, not the
client's `on_loss`; a real server tells them (a start from an epoch it never had)."""

from __future__ import annotations

import asyncio
from typing import Any

import broky
from broky.protocol import LossReason
from broky.protocol.frames import Position
from broky.protocol.routing import vbucket_of
from tests.support.serverproc import ServerProcess


def test_a_subscriptions_own_losses_go_to_its_hook_and_not_the_clients(server: ServerProcess) -> None:
    client_losses: list[tuple[Any, int, int]] = []
    mine: list[tuple[int, int]] = []
    other: list[tuple[int, int]] = []
    vb = vbucket_of(b"kp")

    async def main() -> None:
        async with broky.connect(server.url, on_loss=lambda *a: client_losses.append(a)) as client:
            await client.subscribe(
                "s.>", since=[Position(vb, 12345, 77)], on_loss=lambda d, r: mine.append((d, r))
            )
            await client.subscribe("t.>", on_loss=lambda d, r: other.append((d, r)))
            await client.publish("s.x", b"after", partition="kp")
            await client.flush()
            await asyncio.sleep(0.3)

    asyncio.run(main())
    assert mine == [(0, LossReason.EPOCH_CHANGED)]
    assert other == [] and client_losses == []
