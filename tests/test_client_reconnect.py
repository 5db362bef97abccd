"""Reconnects: through a fault-injecting proxy and through a SIGKILLed worker.

Subscriptions must come back without user code, and publishing must resume
(publishes made while disconnected are buffered up to a bound).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import broky
from tests.faultproxy import FaultProxy
from tests.serverproc import ServerProcess
from tests.test_client import partitions_by_worker, run, take


@pytest.fixture
def proxy(server: ServerProcess) -> Iterator[FaultProxy]:
    p = FaultProxy(server.address).start()
    yield p
    p.stop()


class Events:
    def __init__(self) -> None:
        self.disconnects: list[int] = []
        self.reconnects: list[int] = []
        self.errors: list[BaseException] = []

    def options(self) -> dict[str, object]:
        return {
            "on_disconnect": lambda ref, exc: self.disconnects.append(ref.worker),
            "on_reconnect": lambda ref: self.reconnects.append(ref.worker),
            "on_error": self.errors.append,
            "reconnect_min_delay": 0.02,
            "reconnect_max_delay": 0.2,
        }


async def until(check: Callable[[], bool], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def test_subscriptions_come_back_after_a_network_cut(server: ServerProcess, proxy: FaultProxy) -> None:
    async def main() -> None:
        ev = Events()
        async with (
            broky.connect(proxy.address, **ev.options()) as subscriber,
            broky.connect(server.url) as publisher,
        ):
            assert publisher.server_info is not None
            by_worker = partitions_by_worker(publisher.server_info.map)
            every = await subscriber.subscribe("r.*")
            scoped = await subscriber.subscribe("r.>", partition=by_worker[1][0])
            kps = [by_worker[0][0], by_worker[1][0]]

            async def round_of(tag: bytes) -> None:
                for kp in kps:
                    await publisher.publish(kp, b"r.x", tag + kp)
                await publisher.flush()
                got = await take(every, 2)
                assert sorted(m.payload for m in got) == sorted(tag + kp for kp in kps)
                assert (await scoped.next_msg(5)).payload == tag + kps[1]

            await round_of(b"before ")
            accepted = proxy.accepted
            proxy.cut()
            await until(lambda: sorted(ev.reconnects) == [0, 1])
            assert sorted(ev.disconnects) == [0, 1]
            assert proxy.accepted >= accepted + 2
            await subscriber.flush()  # the re-sent Subscribe frames have been processed
            await round_of(b"after ")
            # the reconnected client publishes as well
            await subscriber.publish(kps[0], b"r.x", b"own")
            await subscriber.flush()
            assert (await every.next_msg(5)).payload == b"own"
            assert subscriber.stats.reconnects == 2

    run(main)


def test_publishes_made_while_disconnected_are_sent_after_reconnect(
    server: ServerProcess, proxy: FaultProxy
) -> None:
    async def main() -> None:
        ev = Events()
        async with (
            broky.connect(server.url) as subscriber,
            broky.connect(proxy.address, **ev.options()) as publisher,
        ):
            assert publisher.server_info is not None
            by_worker = partitions_by_worker(publisher.server_info.map)
            sub = await subscriber.subscribe("buf")
            kps = [by_worker[0][0], by_worker[1][0]]
            for kp in kps:  # open the connections to both workers
                await publisher.publish(kp, b"buf", b"warm")
            await publisher.flush()
            await take(sub, 2)
            proxy.refuse(True)
            await until(lambda: sorted(ev.disconnects) == [0, 1])
            for i in range(200):
                await publisher.publish(kps[i % 2], b"buf", b"%d" % i)
            assert ev.reconnects == []
            proxy.refuse(False)
            await publisher.flush(timeout=10)
            got = await take(sub, 200)
            for w in (0, 1):
                mine = [int(m.payload) for m in got if m.key_partition == kps[w]]
                assert mine == list(range(w, 200, 2))
            assert sorted(set(ev.reconnects)) == [0, 1]

    run(main)


def test_publish_raises_once_the_reconnect_buffer_is_full(server: ServerProcess, proxy: FaultProxy) -> None:
    async def main() -> None:
        ev = Events()
        async with broky.connect(proxy.address, max_reconnect_buffer_bytes=4000, **ev.options()) as client:
            proxy.refuse(True)
            await until(lambda: len(ev.disconnects) == 1)
            sent = 0
            with pytest.raises(broky.PublishBufferFullError) as info:
                for _ in range(1000):
                    await client.publish(b"kp", b"k", b"x" * 100)
                    sent += 1
            assert info.value.limit == 4000
            assert 4000 - 300 < info.value.pending_bytes <= 4000
            assert 10 < sent < 40
            assert client.stats.published == sent  # the refused publish is not counted
            proxy.refuse(False)
            await client.flush(timeout=10)
            await client.publish(b"kp", b"k", b"x" * 100)  # accepted again once reconnected

    run(main)


def test_flush_times_out_while_a_worker_is_unreachable(server: ServerProcess, proxy: FaultProxy) -> None:
    async def main() -> None:
        ev = Events()
        async with broky.connect(proxy.address, **ev.options()) as client:
            proxy.refuse(True)
            await until(lambda: len(ev.disconnects) == 1)
            await client.publish(b"kp", b"k", b"x")
            with pytest.raises(broky.BrokyTimeoutError, match="down"):
                await client.flush(timeout=0.3)
            proxy.refuse(False)
            await client.flush(timeout=10)

    run(main)


def test_subscriptions_come_back_after_a_worker_is_killed(server: ServerProcess) -> None:
    async def main() -> None:
        ev = Events()
        async with (
            broky.connect(server.url, **ev.options()) as subscriber,
            broky.connect(server.url, **Events().options()) as publisher,
        ):
            assert publisher.server_info is not None
            by_worker = partitions_by_worker(publisher.server_info.map)
            sub = await subscriber.subscribe("kill.>")
            kps = [by_worker[0][0], by_worker[1][0]]
            for kp in kps:
                await publisher.publish(kp, b"kill.me", b"before")
            await publisher.flush()
            await take(sub, 2)
            pids = server.worker_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            await until(lambda: len(ev.reconnects) == 1, timeout=20)
            assert ev.disconnects == ev.reconnects
            await until(lambda: len(server.worker_pids()) == 2 and pids[0] not in server.worker_pids())
            await subscriber.flush(timeout=10)
            await publisher.flush(timeout=10)  # waits for its own reconnect
            for kp in kps:
                await publisher.publish(kp, b"kill.me", b"after")
            await publisher.flush(timeout=10)
            got = await take(sub, 2)
            assert sorted(m.key_partition for m in got) == sorted(kps)
            assert {m.payload for m in got} == {b"after"}

    run(main, timeout=60)


def test_blocking_client_survives_a_cut(server: ServerProcess, proxy: FaultProxy) -> None:
    down = threading.Event()
    with (
        broky.connect_sync(proxy.address, reconnect_min_delay=0.02, on_disconnect=lambda *_: down.set()) as c,
        broky.connect_sync(server.url) as reader,
    ):
        sub = reader.subscribe("sync.cut")
        c.publish(b"kp", b"sync.cut", b"1")
        c.flush()
        proxy.cut()
        assert down.wait(5)
        c.publish(b"kp", b"sync.cut", b"2")  # buffered until the reconnect
        c.flush(timeout=10)
        assert [m.payload for m in sub.iter(timeout=2, count=2)] == [b"1", b"2"]
        # Every connection came back; links reconnect independently, each on its own backoff.
        deadline = time.monotonic() + 10
        while c.stats.reconnects < len(c._client._links) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats.reconnects == len(c._client._links)
