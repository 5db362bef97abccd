"""Reconnects: through a fault-injecting proxy and through a SIGKILLed worker.

Subscriptions must come back without user code, and publishing must resume
(publishes made while disconnected are buffered up to a bound).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import broky
from broky.client import pubpack
from tests.support.faultproxy import FaultProxy
from tests.support.http import debug_stats
from tests.support.sdk import partitions_by_worker, run, take
from tests.support.serverproc import ServerProcess


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
                    await publisher.publish(b"r.x", tag + kp, partition=kp)
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
            await subscriber.publish(b"r.x", b"own", partition=kps[0])
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
                await publisher.publish(b"buf", b"warm", partition=kp)
            await publisher.flush()
            await take(sub, 2)
            proxy.refuse(True)
            await until(lambda: sorted(ev.disconnects) == [0, 1])
            for i in range(200):
                await publisher.publish(b"buf", b"%d" % i, partition=kps[i % 2])
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
        # flush_timeout: how long a publish into the full buffer waits for the worker
        # before it is refused (default 10 s); 1 s proves the same, sooner
        async with broky.connect(
            proxy.address, max_reconnect_buffer_bytes=4000, flush_timeout=1.0, **ev.options()
        ) as client:
            proxy.refuse(True)
            await until(lambda: len(ev.disconnects) == 1)
            sent = 0
            with pytest.raises(broky.PublishBufferFullError) as info:
                for _ in range(1000):
                    await client.publish(b"k", b"x" * 100, partition=b"kp")
                    sent += 1
            assert info.value.limit == 4000
            assert 4000 - 300 < info.value.pending_bytes <= 4000
            assert 10 < sent < 40
            assert client.stats.published == sent  # the refused publish is not counted as published
            assert client.stats.refused == 1
            proxy.refuse(False)
            await client.flush(timeout=10)
            await client.publish(b"k", b"x" * 100, partition=b"kp")  # accepted again once reconnected

    run(main)


def test_flush_times_out_while_a_worker_is_unreachable(server: ServerProcess, proxy: FaultProxy) -> None:
    async def main() -> None:
        ev = Events()
        async with broky.connect(proxy.address, **ev.options()) as client:
            proxy.refuse(True)
            await until(lambda: len(ev.disconnects) == 1)
            await client.publish(b"k", b"x", partition=b"kp")
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
            # one partition-scoped subscription per worker: whichever dies, one lives on it
            scoped = [await subscriber.subscribe("kill.*", partition=kp) for kp in kps]
            for kp in kps:
                await publisher.publish(b"kill.me", b"before", partition=kp)
            await publisher.flush()
            await take(sub, 2)
            for one in scoped:
                assert (await one.next_msg(5)).payload == b"before"
            pids = server.worker_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            await until(lambda: len(ev.reconnects) == 1, timeout=20)
            assert ev.disconnects == ev.reconnects
            await until(lambda: len(server.worker_pids()) == 2 and pids[0] not in server.worker_pids())
            await subscriber.flush(timeout=10)
            await publisher.flush(timeout=10)  # waits for its own reconnect
            for kp in kps:
                await publisher.publish(b"kill.me", b"after", partition=kp)
            await publisher.flush(timeout=10)
            got = await take(sub, 2)
            assert sorted(m.key_partition for m in got) == sorted(kps)
            assert {m.payload for m in got} == {b"after"}
            for kp, one in zip(kps, scoped, strict=True):
                msg = await one.next_msg(5)
                assert (msg.key_partition, msg.payload) == (kp, b"after")
            killed = ev.reconnects[0]
            assert subscriber._subscriptions.links[scoped[killed].sid][0].ref.worker == killed

    run(main, timeout=60)


def test_blocking_client_survives_a_cut(server: ServerProcess, proxy: FaultProxy) -> None:
    down = threading.Event()
    with (
        broky.connect_sync(proxy.address, reconnect_min_delay=0.02, on_disconnect=lambda *_: down.set()) as c,
        broky.connect_sync(server.url) as reader,
    ):
        sub = reader.subscribe("sync.cut")
        c.publish(b"sync.cut", b"1", partition=b"kp")
        c.flush()
        proxy.cut()
        assert down.wait(5)
        c.publish(b"sync.cut", b"2", partition=b"kp")  # buffered until the reconnect
        c.flush(timeout=10)
        assert [m.payload for m in sub.iter(timeout=2, count=2)] == [b"1", b"2"]
        # Every connection came back; links reconnect independently, each on its own backoff.
        deadline = time.monotonic() + 10
        while c.stats.reconnects < len(c._client.router.links) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats.reconnects == len(c._client.router.links)


@pytest.mark.parametrize("bulk", [False, True], ids=["publish", "publish_many"])
def test_a_killed_worker_loses_no_publish(server: ServerProcess, bulk: bool) -> None:
    """Publishes written to a worker that dies before processing them are sent again,
    exactly those (the dead worker's account says how many it processed): the
    subscriber gets every publish once, and flush succeeds. publish_many's writes
    are several chunks each (a writev), kept as such until confirmed."""

    async def main() -> None:
        ev = Events()
        # no keepalive and no confirmations: nothing confirms the publishes but the flush
        options = {"ping_interval": None, "confirm_interval": 3600.0, **ev.options()}
        async with (
            broky.connect(server.url, **options) as client,
            broky.connect(server.url) as watcher,
        ):
            assert client.server_info is not None
            by_worker = partitions_by_worker(client.server_info.map)
            kps = [by_worker[0][0], by_worker[1][0]]
            sub = await watcher.subscribe("lost.>")
            for kp in kps:
                await client.publish(b"lost.x", b"warm", partition=kp)
            await client.flush()
            assert len(await take(sub, 2)) == 2
            victim = server.worker_pids()[0]
            os.kill(victim, signal.SIGSTOP)  # it will read none of what follows
            if bulk:  # 2 x 1500 rows of ~120 bytes: writes of several chunks
                n = 1500
                rows = [(kp, b"%d" % i) for i in range(n) for kp in kps]
                parts, payloads = zip(*rows)
                keys = [b"lost.x"] * len(rows)
                task = asyncio.ensure_future(  # may wait to drain
                    client.publish_many(keys, payloads, partitions=parts)
                )
            else:
                n = 50
                for i in range(n):
                    for kp in kps:
                        await client.publish(b"lost.x", b"%d" % i, partition=kp)
            await asyncio.sleep(0.1)  # written (linger 0); the stopped worker processed none
            if bulk and pubpack.compiled is not None:  # writes of several chunks are kept
                kept = [w for link in client.router.links.values() for w in link.retained]
                assert any(len(w.chunks) > 1 for w in kept)
            os.kill(victim, signal.SIGKILL)
            if bulk:
                assert await task == 2 * n
            await until(lambda: len(ev.reconnects) == 1, timeout=20)
            await client.flush(timeout=20)
            killed = ev.reconnects[0]
            assert client.stats.resent_after_loss == n
            assert client.stats.unconfirmed_lost == 0
            got = await take(sub, 2 * n, timeout=10)
            assert sorted((m.key_partition, int(m.payload)) for m in got) == sorted(
                (kp, i) for kp in kps for i in range(n)
            )
            per_kp = [int(m.payload) for m in got if m.key_partition == kps[killed]]
            assert per_kp == list(range(n))  # in order
            with pytest.raises(broky.BrokyTimeoutError):
                await sub.next_msg(timeout=0.3)  # nothing twice
            assert not [e for e in ev.errors if "may not have reached" in str(e)]

    run(main, timeout=60)


def test_publishes_a_cut_kept_from_the_server_are_sent_again(
    server: ServerProcess, proxy: FaultProxy
) -> None:
    async def main() -> None:
        ev = Events()
        options = {"ping_interval": None, "confirm_interval": 3600.0, **ev.options()}
        async with (
            broky.connect(proxy.address, **options) as client,
            broky.connect(server.url) as watcher,
        ):
            sub = await watcher.subscribe("cut.>")
            await client.publish(b"cut.x", b"warm", partition=b"kp")
            await client.flush()
            proxy.stall(True)  # what is written now stays in the proxy...
            for i in range(20):
                await client.publish(b"cut.x", b"%d" % i, partition=b"kp")
            await asyncio.sleep(0.1)
            proxy.cut()  # ...and is gone with the cut
            proxy.stall(False)
            await until(lambda: len(ev.reconnects) >= 1)
            await client.flush()
            assert client.stats.resent_after_loss == 20 and client.stats.unconfirmed_lost == 0
            got = await take(sub, 21)
            assert [m.payload for m in got] == [b"warm", *(b"%d" % i for i in range(20))]
            with pytest.raises(broky.BrokyTimeoutError):
                await sub.next_msg(timeout=0.3)

    run(main)


def test_without_an_account_publishes_are_sent_again_and_subscribers_drop_the_copies(
    server: ServerProcess, start_server: Callable[..., ServerProcess]
) -> None:
    """Reconnected to a server process that never saw the lost connections (as after a
    restart of the whole server), nobody can say what they delivered: the publisher
    sends again the publishes no Pong confirmed that carry a uid, the subscriber drops
    the copies of what it had received (by uid), and those without a uid are reported
    as possibly lost."""
    other = start_server()
    to_sub, to_pub = FaultProxy(server.address).start(), FaultProxy(server.address).start()
    try:

        async def main() -> None:
            sev, pev = Events(), Events()
            quiet = {"ping_interval": None, "confirm_interval": 3600.0}
            async with (
                broky.connect(to_sub.address, **sev.options()) as subscriber,
                broky.connect(to_pub.address, **quiet, **pev.options()) as publisher,
            ):
                sub = await subscriber.subscribe("x.>")
                await publisher.publish(b"x.y", b"warm", partition=b"kp")
                await publisher.flush()
                assert len(await take(sub, 1)) == 1
                for i in range(30):  # received, never confirmed to the publisher
                    await publisher.publish(b"x.y", b"%d" % i, partition=b"kp")
                for i in range(5):
                    await publisher.publish(b"x.y", b"no-uid %d" % i, partition=b"kp", uid=False)
                got = await take(sub, 35)
                # Both move to a server process that knows nothing of them: the subscriber first.
                to_sub.target = other.address
                to_sub.cut()
                await until(lambda: len(sev.reconnects) >= 1)
                await subscriber.flush()
                to_pub.target = other.address
                to_pub.cut()
                await until(lambda: len(pev.reconnects) >= 1)
                with pytest.raises(broky.BrokyConnectionError) as info:
                    await publisher.flush(timeout=20)
                assert "5 publishes may not have reached the server" in str(info.value)
                assert "without a uid" in str(info.value) or any(
                    "without a uid" in str(e) for e in pev.errors
                )
                assert publisher.stats.resent_after_loss == 30 and publisher.stats.unconfirmed_lost == 5
                await publisher.flush()  # reported once
                with pytest.raises(broky.BrokyTimeoutError):
                    await sub.next_msg(timeout=0.5)  # the 30 copies were dropped
                assert subscriber.stats.duplicates_dropped == 30
                assert [m.payload for m in got[:30]] == [b"%d" % i for i in range(30)]

        run(main, timeout=60)
    finally:
        to_sub.stop()
        to_pub.stop()


def test_control_frames_are_not_counted_as_unconfirmed_publishes(
    server: ServerProcess, proxy: FaultProxy
) -> None:
    async def main() -> None:
        ev = Events()
        async with broky.connect(proxy.address, ping_interval=None, **ev.options()) as client:
            for i in range(5):
                sub = await client.subscribe(f"c.{i}")  # Subscribe + Ping per worker
                await client.publish(b"c.x", b"x", partition=b"kp")
                await sub.unsubscribe()
            await client.flush()
            last = await client.subscribe("c.>")
            await last.unsubscribe()  # written after the last Pong: a control frame, not a publish
            proxy.cut()
            await until(lambda: len(ev.reconnects) == 2)
            await client.flush()  # nothing written was unconfirmed: no error
            assert client.stats.unconfirmed_lost == 0
            await client.publish(b"c.x", b"unconfirmed", partition=b"kp")
            await asyncio.sleep(0.05)
            proxy.cut()
            await until(lambda: len(ev.reconnects) >= 3)
            await client.flush(timeout=10)  # the server says it processed that publish: not lost
            assert client.stats.unconfirmed_lost == 0 and client.stats.resent_after_loss == 0

    run(main)


def test_blocking_publish_raises_once_the_reconnect_buffer_is_full(
    server: ServerProcess, proxy: FaultProxy
) -> None:
    down = threading.Event()
    with broky.connect_sync(
        proxy.address,
        max_reconnect_buffer_bytes=4000,
        flush_timeout=1.0,  # each refused publish waits this long for the worker first (default 10 s)
        reconnect_min_delay=0.02,
        reconnect_max_delay=0.2,
        on_disconnect=lambda *_: down.set(),
    ) as c:
        proxy.refuse(True)
        assert down.wait(5)
        sent = 0
        with pytest.raises(broky.PublishBufferFullError) as info:
            for _ in range(1000):
                c.publish(b"k", b"x" * 100, partition=b"kp")
                sent += 1
        assert info.value.limit == 4000
        assert 4000 - 300 < info.value.pending_bytes <= 4000
        assert 10 < sent < 40
        with pytest.raises(broky.PublishBufferFullError):  # still full: raised again (after its own wait)
            c.publish(b"k", b"x" * 100, partition=b"kp")
        proxy.refuse(False)
        c.flush(timeout=10)  # nothing raised in the I/O thread is left over
        assert c.stats.published == sent
        assert c.stats.refused == 2
        c.publish(b"k", b"x" * 100, partition=b"kp")  # accepted again once reconnected
        c.flush(timeout=10)
        assert c.stats.published == sent + 1


def test_giving_up_drops_counts_and_makes_publish_and_flush_raise(
    server: ServerProcess, proxy: FaultProxy
) -> None:
    async def main() -> None:
        ev = Events()
        async with broky.connect(proxy.address, max_reconnect_attempts=3, **ev.options()) as client:
            proxy.refuse(True)
            await until(lambda: len(ev.disconnects) == 1)
            for i in range(7):
                await client.publish(b"k", b"%d" % i, partition=b"kp")
            await until(lambda: any("gave up" in str(e) for e in ev.errors))
            await until(lambda: all(link.failed is not None for link in client.router.links.values()))
            assert client.stats.unsent_gave_up == 7
            with pytest.raises(broky.BrokyConnectionError, match="gave up on worker"):
                await client.flush(timeout=5)
            with pytest.raises(broky.BrokyConnectionError, match="7 buffered publishes dropped"):
                await client.flush(timeout=5)  # every flush, as long as the worker is given up
            with pytest.raises(broky.BrokyConnectionError, match="gave up"):
                await client.publish(b"k", b"late", partition=b"kp")
            assert client.stats.refused == 1
            assert client.stats.published == 7

    run(main)


def test_a_silent_network_cut_is_noticed_by_pings(server: ServerProcess, proxy: FaultProxy) -> None:
    async def main() -> None:
        ev = Events()
        async with (
            broky.connect(
                proxy.address, ping_interval=0.1, max_outstanding_pings=2, connect_timeout=1, **ev.options()
            ) as subscriber,
            broky.connect(server.url) as publisher,
        ):
            assert publisher.server_info is not None
            by_worker = partitions_by_worker(publisher.server_info.map)
            kps = [by_worker[0][0], by_worker[1][0]]
            every = await subscriber.subscribe("stall.*")
            scoped = await subscriber.subscribe("stall.*", partition=kps[1])
            await asyncio.sleep(0.5)  # several keepalive rounds on a healthy connection: no drop
            assert ev.disconnects == [] and subscriber.stats.ping_timeouts == 0
            proxy.stall(True)  # bytes held both ways, nothing closed: only Pings can tell
            await until(lambda: sorted(ev.disconnects) == [0, 1])
            assert subscriber.stats.ping_timeouts == 2
            assert any("the connection is stale" in str(e) for e in ev.errors)
            proxy.stall(False)
            await until(lambda: sorted(ev.reconnects) == [0, 1])
            await subscriber.flush(timeout=10)
            for kp in kps:
                await publisher.publish(b"stall.x", kp, partition=kp)
            await publisher.flush()
            got = await take(every, 2)
            assert sorted(m.payload for m in got) == sorted(kps)
            assert (await scoped.next_msg(5)).payload == kps[1]

    run(main)


def test_subscribe_does_not_wait_for_a_worker_that_is_down(server: ServerProcess, proxy: FaultProxy) -> None:
    async def main() -> None:
        ev = Events()
        async with (
            broky.connect(proxy.address, flush_timeout=5, **ev.options()) as subscriber,
            broky.connect(server.url) as publisher,
        ):
            assert publisher.server_info is not None
            by_worker = partitions_by_worker(publisher.server_info.map)
            kps = [by_worker[0][0], by_worker[1][0]]
            await subscriber.subscribe("warm")  # opens the connections to both workers
            proxy.refuse(True)
            await until(lambda: sorted(ev.disconnects) == [0, 1])
            loop = asyncio.get_running_loop()
            started = loop.time()
            every = await subscriber.subscribe("down.*")
            scoped = await subscriber.subscribe("down.*", partition=kps[0])
            assert loop.time() - started < 4  # not flush_timeout (5 s) per subscribe (or even one)
            assert not any(isinstance(e, broky.BrokyTimeoutError) for e in ev.errors)
            proxy.refuse(False)
            await until(lambda: sorted(ev.reconnects) == [0, 1])
            await subscriber.flush(timeout=10)  # the restored Subscribe frames are processed
            for kp in kps:
                await publisher.publish(b"down.x", kp, partition=kp)
            await publisher.flush()
            assert sorted(m.payload for m in await take(every, 2)) == sorted(kps)
            assert (await scoped.next_msg(5)).payload == kps[0]

    run(main)


def test_the_proxy_refuses_at_once(proxy: FaultProxy) -> None:
    proxy.refuse(True)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        try:
            assert sock.recv(1) == b""  # closed (or reset) right after the accept, not held open
        except ConnectionResetError:
            pass
    assert proxy.refused == 1


def test_a_subscription_over_the_server_limit_is_reported_once_and_not_resent(start_server: Any) -> None:
    server = start_server("--max-subscriptions", "2")
    proxy = FaultProxy(server.address).start()

    def refusals() -> list[broky.ServerError]:
        return [
            e
            for e in ev.errors
            if isinstance(e, broky.ServerError) and e.code == broky.ErrorCode.SUBSCRIPTION_LIMIT
        ]

    async def main() -> None:
        async with (
            broky.connect(proxy.address, **ev.options()) as subscriber,
            broky.connect(server.url) as publisher,
        ):
            assert publisher.server_info is not None
            kp = partitions_by_worker(publisher.server_info.map)[1][0]
            warm = await subscriber.subscribe("warm")
            await subscriber.subscribe("second")  # each worker's connection is at its limit now
            proxy.refuse(True)
            await until(lambda: sorted(ev.disconnects) == [0, 1])
            over = await subscriber.subscribe("over")  # sent when the links come back
            proxy.refuse(False)
            await until(lambda: len(ev.reconnects) == 2)
            await subscriber.flush(timeout=10)  # both workers refused it (before their Pongs)
            assert len(refusals()) == 1, refusals()  # reported to on_error once, not once per worker
            assert {e.sid for e in refusals()} == {over.sid}
            assert subscriber._subscriptions.links[over.sid] == []
            # Not sent again by the next reconnect.
            proxy.cut()
            await until(lambda: len(ev.reconnects) == 4)
            await subscriber.flush(timeout=10)
            assert len(refusals()) == 1
            # Refused while connected: subscribe raises (not also on_error), and nothing of it stays.
            with pytest.raises(broky.ServerError) as info:
                await subscriber.subscribe("third")
            assert info.value.code == broky.ErrorCode.SUBSCRIPTION_LIMIT
            await subscriber.flush(timeout=10)
            assert info.value.sid not in subscriber._subscriptions.subs and len(refusals()) == 1
            # The connections keep working.
            await publisher.publish(b"warm", b"still", partition=kp)
            await publisher.flush()
            assert (await warm.next_msg(5)).payload == b"still"

    ev = Events()
    try:
        run(main)
    finally:
        proxy.stop()
    for worker in debug_stats(server)["workers"]:
        assert worker["errors"]["SUBSCRIPTION_LIMIT"] == 2


@pytest.mark.timeout(30)
def test_a_round_trip_waiting_on_a_worker_whose_node_left_the_map_ends_at_once() -> None:
    # Issue 37: a retired Link's `up` is set for good and it has no connection; its round
    # trip went round that loop without ever yielding (a core at 100 %, no timeout could
    # fire, `flush` never returned). It must end at once, naming the node's fate; and so
    # must one waiting when the client closes.
    from broky.client.client import Client
    from broky.client.link import Link

    async def main() -> None:
        client = Client("127.0.0.1:1")
        client.loop = asyncio.get_running_loop()
        link = Link(client, "n", 0)  # never connected: down
        trip = asyncio.ensure_future(link.round_trip())
        await asyncio.sleep(0.05)
        assert not trip.done()  # waits for the connection
        link.retire()  # its node is no longer in the map
        with pytest.raises(broky.BrokyConnectionError, match="n left the cluster"):
            async with asyncio.timeout(5):
                await trip
        other = Link(client, "n", 1)
        trip = asyncio.ensure_future(other.round_trip())
        await asyncio.sleep(0.05)
        client._closed = True
        other.close()
        with pytest.raises(broky.ClientClosedError):
            async with asyncio.timeout(5):
                await trip

    asyncio.run(main())
