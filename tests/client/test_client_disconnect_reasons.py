"""on_disconnect always says why: a Goodbye, a fatal error's code, or a lost connection."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import broky
from broky.errors import ErrorCode
from tests.support.faultproxy import FaultProxy
from tests.support.sdk import run
from tests.support.serverproc import ServerProcess


async def until(check: Any, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def test_a_goodbye_is_a_server_shutdown_with_what_was_processed(server: ServerProcess) -> None:
    reasons: list[BaseException] = []

    async def main() -> None:
        async with broky.connect(
            server.url,
            on_disconnect=lambda ref, why: reasons.append(why),
            reconnect_min_delay=5,
            reconnect_max_delay=5,
        ) as client:
            for i in range(7):
                await client.publish(b"g.x", b"%d" % i, partition=b"kp")
            await client.flush()
            links = len(client.router.links)
            server.signal(signal.SIGTERM)
            await until(lambda: len(reasons) == links)

    run(main)
    # the server's reason is "server shutting down": the message says it once
    assert all(isinstance(r, broky.ServerShutdownError) for r in reasons), reasons
    assert {str(r) for r in reasons} == {"the server is shutting down"}, reasons
    assert sorted(r.processed for r in reasons if isinstance(r, broky.ServerShutdownError))[-1] == 7


def test_the_blocking_client_gets_the_same_reasons(server: ServerProcess) -> None:
    reasons: list[BaseException] = []
    with broky.connect_sync(
        server.url,
        on_disconnect=lambda ref, why: reasons.append(why),
        reconnect_min_delay=5,
        reconnect_max_delay=5,
    ) as client:
        client.publish(b"g.x", b"x", partition=b"kp")
        client.flush()
        links = len(client._client.router.links)
        server.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while len(reasons) < links and time.monotonic() < deadline:
            time.sleep(0.01)
    assert all(isinstance(r, broky.ServerShutdownError) for r in reasons) and len(reasons) == links
    assert max(r.processed for r in reasons if isinstance(r, broky.ServerShutdownError)) == 1


def test_a_fatal_error_gives_its_code(start_server: Any) -> None:
    server = start_server("--max-pending-bytes", "64K", "--slow-consumer-deadline", "0.3")
    reasons: list[BaseException] = []
    stop = threading.Event()

    def flood() -> None:
        with broky.connect_sync(server.url) as pub:
            while not stop.is_set():
                for _ in range(200):
                    pub.publish(b"slow.x", bytes(1000), partition=b"kp")
                pub.flush()

    async def main() -> None:
        blocked = False

        def stall(msg: broky.Message) -> None:
            nonlocal blocked
            if not blocked:  # the loop stops reading: the server sees a slow consumer
                blocked = True
                time.sleep(1.5)

        async with broky.connect(
            server.url,
            on_disconnect=lambda ref, why: reasons.append(why),
            reconnect_min_delay=5,
            reconnect_max_delay=5,
        ) as client:
            await client.subscribe("slow.>", callback=stall)
            thread = threading.Thread(target=flood, daemon=True)
            thread.start()
            try:
                await until(lambda: reasons, timeout=20)
            finally:
                stop.set()
                await asyncio.to_thread(thread.join, 10)

    run(main, timeout=40)
    assert isinstance(reasons[0], broky.ServerError) and reasons[0].code == ErrorCode.SLOW_CONSUMER


def test_a_cut_is_a_lost_connection(server: ServerProcess) -> None:
    proxy = FaultProxy(server.address).start()
    reasons: list[BaseException] = []
    try:

        async def main() -> None:
            async with broky.connect(
                proxy.address,
                on_disconnect=lambda ref, why: reasons.append(why),
                reconnect_min_delay=5,
                reconnect_max_delay=5,
            ):
                proxy.cut()
                await until(lambda: reasons)

        run(main)
    finally:
        proxy.stop()
    assert type(reasons[0]) is broky.BrokyConnectionError
