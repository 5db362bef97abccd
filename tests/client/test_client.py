"""The asyncio and blocking clients against a real `broky serve` with 2 workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable

import pytest

import broky
from bench.harness.cluster import http_get
from broky.protocol import LossReason, encode_message
from tests.support.sdk import partitions_by_worker, run, take
from tests.support.serverproc import ServerProcess


def test_routes_each_publish_to_its_owner_and_subscribes_on_every_worker(server: ServerProcess) -> None:
    async def main() -> None:
        errors: list[BaseException] = []
        async with broky.connect(server.url, name="t", on_error=errors.append) as client:
            assert client.server_info is not None
            vmap = client.server_info.map
            assert client.server_info.workers == 2
            # only the first connection exists until something needs another worker
            assert len(client.router.links) == 1
            by_worker = partitions_by_worker(vmap)
            sub = await client.subscribe("orders.*")
            assert sorted(ref.worker for ref, link in client.router.links.items() if link.proto) == [0, 1]
            sent = []
            for w in (0, 1):
                for kp in by_worker[w]:
                    await client.publish(b"orders.created", b"from " + kp, partition=kp)
                    sent.append(kp)
            await client.flush()
            got = await take(sub, len(sent))
            assert sorted(m.key_partition for m in got) == sorted(sent)
            assert {m.payload for m in got} == {b"from " + kp for kp in sent}
            # every publish reached its owner: no NOT_MY_VBUCKET, nothing else
            assert client.stats.misrouted == 0
            assert errors == []
            assert client.stats.published == len(sent)

    run(main)


def test_refresh_map_asks_a_node_once_for_every_caller_meanwhile(server: ServerProcess) -> None:
    def handed() -> int:
        status, body = http_get(server.metrics_port, "/stats")
        assert status == 200
        count: int = json.loads(body)["master"]["connections_handed"]
        return count

    async def main() -> None:
        async with broky.connect(server.url) as client:
            before = handed()
            first, second = await asyncio.gather(client.refresh_map(), client.refresh_map())
            assert first is second and client.server_info is not None
            assert first == client.server_info.map == client.router.map
            assert handed() == before + 1  # one Hello, on a connection of its own
            await client.refresh_map()
            assert handed() == before + 2

    run(main)


def test_message_fields_are_filled_and_stamped(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.address[0] + f":{server.port}") as client:
            sub = await client.subscribe("k")
            before = time.time_ns()
            await client.publish("k", b"x", partition="t1")
            await client.publish(b"k", b"y", partition=b"t1", ts_producer=0, uid=False)
            uid = bytes(range(20))
            await client.publish(b"k", b"z", partition=b"t1", ts_producer=123, uid=uid)
            a, b, c = await take(sub, 3)
            after = time.time_ns()
            assert isinstance(a, broky.Message)
            assert (a.key_partition, a.key, a.payload) == (b"t1", b"k", b"x")
            assert before <= a.ts_producer <= a.ts_broker <= after
            assert a.uid is not None and len(a.uid) == 20
            assert a.uid_text is not None and len(a.uid_text) == 27
            assert (b.ts_producer, b.uid, b.uid_text) == (0, None, None)
            assert before <= b.ts_broker <= after
            assert (c.ts_producer, c.uid) == (123, uid)
            with pytest.raises(AttributeError):
                a.payload = b"changed"  # type: ignore[misc]

    run(main)


def test_partition_subscription_gets_only_its_partition(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as client:
            assert client.server_info is not None
            by_worker = partitions_by_worker(client.server_info.map)
            mine = by_worker[1][0]
            other = by_worker[0][0]
            one = await client.subscribe("orders.>", partition=mine)
            every = await client.subscribe("orders.>")
            for kp in (other, mine, other, mine):
                await client.publish(b"orders.eu.created", kp, partition=kp)
            await client.flush()
            got = await take(one, 2)
            assert [m.key_partition for m in got] == [mine, mine]
            assert sorted(m.key_partition for m in await take(every, 4)) == sorted([other, mine] * 2)
            with pytest.raises(broky.BrokyTimeoutError):
                await one.next_msg(0.2)
            # one message matching two subscriptions crossed the wire once per connection
            assert client.stats.received == 4

    run(main)


def test_publish_order_is_kept_per_partition(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as sub_client, broky.connect(server.url) as pub_client:
            sub = await sub_client.subscribe("seq")
            n = 3000
            for i in range(n):
                await pub_client.publish(b"seq", str(i).encode(), partition=b"one")
            await pub_client.flush()
            got = await take(sub, n)
            assert [int(m.payload) for m in got] == list(range(n))

    run(main)


def test_publish_many_delivers_every_column_row_in_order_per_partition(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as sub_client, broky.connect(server.url) as pub_client:
            sub = await sub_client.subscribe("bulk.>")
            n = 5000
            kps = [b"tenant-%d" % (i % 256) for i in range(n)]
            keys: list[bytes | str] = ["bulk.a" if i % 2 else b"bulk.b" for i in range(n)]  # str and bytes
            payloads = [str(i).encode() for i in range(n)]
            stamps: list[int | None] = [None if i % 3 else 42 for i in range(n)]
            assert await pub_client.publish_many(keys, payloads, partitions=kps, ts_producers=stamps) == n
            assert await pub_client.publish_many([], []) == 0
            with pytest.raises(ValueError, match="one length"):
                await pub_client.publish_many(keys[:-1], payloads, partitions=kps)
            await pub_client.flush()
            got = await take(sub, n)
            assert pub_client.stats.published == n
            assert sorted(int(m.payload) for m in got) == list(range(n))
            for m in got:
                i = int(m.payload)
                assert m.key_partition == kps[i] and m.key == (b"bulk.a" if i % 2 else b"bulk.b")
                assert (m.ts_producer == 42) == (i % 3 == 0) and m.uid is not None
            by_kp: dict[bytes, list[int]] = {}
            for m in got:
                by_kp.setdefault(m.key_partition, []).append(int(m.payload))
            assert all(seq == sorted(seq) for seq in by_kp.values()) and len(by_kp) == 256
            assert len({m.uid for m in got}) == n

    run(main)


def test_a_burst_to_a_worker_not_connected_yet_waits_for_its_connection(server: ServerProcess) -> None:
    # The first publish for a worker opens its connection; a tight loop fills the buffer
    # kept meanwhile (here 16 KiB) long before it is open. `publish` waits for it;
    # `publish_nowait`, which cannot wait, refuses with PublishBufferFullError.
    async def main() -> None:
        async with broky.connect(server.url) as sub_client:
            sub = await sub_client.subscribe("burst.>")
            async with broky.connect(server.url, max_reconnect_buffer_bytes=16 << 10) as client:
                assert client.router.map is not None
                kps = [p[0] for p in partitions_by_worker(client.router.map, 1).values()]
                n = 2000
                for i in range(n):
                    await client.publish(b"burst.k", b"%d" % i + b"x" * 100, partition=kps[i % len(kps)])
                await client.flush()
                assert client.stats.refused == 0 and client.stats.published == n
                got = await take(sub, n)
                assert sorted(int(m.payload.rstrip(b"x")) for m in got) == list(range(n))
            async with broky.connect(server.url, max_reconnect_buffer_bytes=16 << 10) as client:
                assert client.router.map is not None
                kps = [p[0] for p in partitions_by_worker(client.router.map, 1).values()]
                with pytest.raises(broky.PublishBufferFullError):
                    for i in range(n):
                        client.publish_nowait(b"burst.k", b"x" * 100, partition=kps[i % len(kps)])
                assert client.stats.refused == 1

    run(main)


def test_a_blocking_burst_to_a_worker_not_connected_yet_waits_for_its_connection(
    server: ServerProcess,
) -> None:
    with broky.connect_sync(server.url) as sub_client:
        sub = sub_client.subscribe("burst.>")
        with broky.connect_sync(server.url, max_reconnect_buffer_bytes=16 << 10) as client:
            vmap = client._client.router.map
            assert vmap is not None
            kps = [p[0] for p in partitions_by_worker(vmap, 1).values()]
            n = 2000
            for i in range(n):
                client.publish(b"burst.k", b"%d" % i + b"x" * 100, partition=kps[i % len(kps)])
            client.flush()
            assert client.stats.refused == 0 and client.stats.published == n
        got = [sub.next(5) for _ in range(n)]
        assert sorted(int(m.payload.rstrip(b"x")) for m in got) == list(range(n))


def test_blocking_publish_many(server: ServerProcess) -> None:
    with broky.connect_sync(server.url) as c:
        sub = c.subscribe("bulk.sync")
        n = 2000
        assert (
            c.publish_many(
                ["bulk.sync"] * n,
                [b"%d" % i for i in range(n)],
                partitions=[b"p%d" % (i % 7) for i in range(n)],
            )
            == n
        )
        c.flush()
        got = list(sub.iter(timeout=5, count=n))
        assert sorted(int(m.payload) for m in got) == list(range(n))
        with pytest.raises(ValueError):
            c.publish_many([b"b"], [], partitions=[b"a"])


def test_callbacks_plain_and_async_and_unsubscribe_ends_iteration(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as client:
            plain: list[bytes] = []
            awaited: list[bytes] = []
            done = asyncio.Event()

            async def slow(msg: broky.Message) -> None:
                await asyncio.sleep(0.001)
                awaited.append(msg.payload)
                if len(awaited) == 3:
                    done.set()

            await client.subscribe("a.*", callback=lambda m: plain.append(m.payload))
            await client.subscribe("a.b", callback=slow)
            it = await client.subscribe("a.>")
            for p in (b"1", b"2", b"3"):
                await client.publish(b"a.b", p, partition=b"kp")
            await client.flush()
            await asyncio.wait_for(done.wait(), 5)
            assert plain == [b"1", b"2", b"3"]
            assert awaited == [b"1", b"2", b"3"]
            received = []
            async for msg in it:
                received.append(msg.payload)
                if len(received) == 3:
                    await it.unsubscribe()
            assert received == [b"1", b"2", b"3"]
            await client.publish(b"a.b", b"4", partition=b"kp")
            await client.flush()
            assert it.pending == 0
            with pytest.raises(broky.ClientClosedError):
                await it.next_msg(0.1)

    run(main)


def test_a_full_queue_pauses_its_connections_and_loses_nothing(server: ServerProcess) -> None:
    """A subscription whose queue is full pauses its connections (Pause): the server keeps
    the deliveries, and they come once the consumer has taken the queue down to half."""

    async def main() -> None:
        errors: list[BaseException] = []
        async with broky.connect(server.url, on_error=errors.append) as client:
            sub = await client.subscribe("s", max_pending_msgs=5)
            small = await client.subscribe("s", max_pending_bytes=10)
            for i in range(50):
                await client.publish(b"s", b"%03d" % i, partition=b"kp")
            await client.flush()  # Pongs are never kept back
            await asyncio.sleep(0.05)
            assert client.stats.pauses >= 1
            assert 5 <= sub.pending <= 50 and 3 <= small.pending <= 50
            want = [b"%03d" % i for i in range(50)]
            assert [m.payload for m in await take(sub, 50)] == want
            assert [m.payload for m in await take(small, 50)] == want
            assert sub.dropped == small.dropped == client.stats.dropped_local == 0
            assert client.stats.server_lost == 0 and errors == []
            # resumed: the queue takes messages again
            await client.publish(b"s", b"new", partition=b"kp")
            assert (await sub.next_msg(5)).payload == b"new"

    run(main)


def test_a_stalled_subscriber_is_told_what_the_server_could_not_keep(
    start_server: Callable[..., ServerProcess],
) -> None:
    """Paused, the server keeps deliveries under its own bound and counts what does not
    fit: what the subscriber gets plus what it is told it lost is what was published."""
    server = start_server(
        "--max-pending-bytes", "64K", "--replay-bytes", "0", workers=1
    )  # (a buffer: it lags)

    async def main() -> None:
        told: list[int] = []
        async with (
            broky.connect(server.url, on_loss=lambda ref, n, reason: told.append(n)) as subscriber,
            broky.connect(server.url) as publisher,
        ):
            sub = await subscriber.subscribe("s", max_pending_msgs=10)
            for i in range(5000):
                await publisher.publish(b"s", b"%04d" % i + b"x" * 96, partition=b"kp")
            await publisher.flush()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            got: list[int] = []
            while len(got) + sum(told) < 5000:  # what arrives and what it is told, until all
                assert loop.time() < deadline, (len(got), told)
                with contextlib.suppress(broky.BrokyTimeoutError):
                    got.append(int((await sub.next_msg(timeout=0.2)).payload[:4]))
            assert subscriber.stats.pauses >= 1
            assert got == sorted(got) and len(set(got)) == len(got)  # in order, no copies
            assert sum(told) > 0 and len(got) + sum(told) == 5000, (len(got), told)
            assert sub.dropped == subscriber.stats.dropped_local == 0

    run(main)


def test_payload_over_the_server_limit_raises_before_sending(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server("--max-frame-bytes", "4096")

    async def main() -> None:
        async with broky.connect(server.url) as client:
            sub = await client.subscribe("big")
            with pytest.raises(broky.PayloadTooLargeError) as info:
                await client.publish(b"big", b"x" * 5000, partition=b"kp")
            assert info.value.limit == 4096 and info.value.size > 5000
            assert "4096" in str(info.value)
            await client.publish(b"big", b"x" * 3000, partition=b"kp")
            await client.flush()
            assert len((await sub.next_msg(5)).payload) == 3000
            assert client.stats.published == 1

    run(main)
    with broky.connect_sync(server.url) as c, pytest.raises(broky.PayloadTooLargeError):
        c.publish(b"big", b"x" * 5000, partition=b"kp")


def test_auth_token(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--auth-token", "s3cret")

    async def main() -> None:
        with pytest.raises(broky.AuthenticationError):
            await broky.connect(server.url, auth_token="wrong")
        with pytest.raises(broky.AuthenticationError):
            await broky.connect(server.url)
        async with broky.connect(server.url, auth_token="s3cret") as client:
            sub = await client.subscribe("x")
            await client.publish(b"x", b"ok", partition=b"kp")
            assert (await sub.next_msg(5)).payload == b"ok"

    run(main)
    with pytest.raises(broky.AuthenticationError):
        broky.connect_sync(server.url, auth_token="wrong")


def test_a_str_payload_is_a_type_error_that_says_to_encode_it(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as client:
            sub = await client.subscribe("text")
            for _ in range(3):  # the first publish of a shape, then its template's fast path
                with pytest.raises(TypeError, match=r"payload must be bytes, not str: encode it"):
                    await client.publish(b"text", "héllo", partition=b"kp")  # type: ignore[arg-type]
                await client.publish(b"text", "héllo".encode(), partition=b"kp")
            with pytest.raises(broky.PayloadTypeError):  # a LocalProtocolError too, as before
                client.publish_nowait(b"text", "x", partition=b"kp")  # type: ignore[arg-type]
            assert [m.payload for m in await take(sub, 3)] == ["héllo".encode()] * 3

    run(main)
    assert issubclass(broky.PayloadTypeError, broky.LocalProtocolError)
    with broky.connect_sync(server.url) as c, pytest.raises(TypeError, match="encode it"):
        c.publish(b"text", "x", partition=b"kp")  # type: ignore[arg-type]


def test_a_refused_first_connection_waits_for_a_starting_server_unless_told_not_to(
    start_server: Callable[..., ServerProcess],
) -> None:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"

    async def main() -> None:
        began = time.monotonic()
        with pytest.raises(
            broky.NoServerError,
            match=re.escape(f"connection refused at broky://{address}: no server listens"),
        ):
            await broky.connect(address, wait_for_server=False)
        assert time.monotonic() - began < 1  # at once, not after connect_timeout
        with pytest.raises(broky.NoServerError, match=r"within 0\.3 s"):  # the default: it kept trying
            await broky.connect(address, connect_timeout=0.3)
        assert time.monotonic() - began >= 0.3
        # a server that starts while the client is refused is found (compose, systemd, a fixture)
        connecting = asyncio.ensure_future(broky.connect(address, connect_timeout=20).__aenter__())
        await asyncio.sleep(0.2)
        assert not connecting.done()
        await asyncio.to_thread(start_server, "--port", str(port))
        client = await connecting
        try:
            sub = await client.subscribe("up")
            await client.publish(b"up", b"found", partition=b"kp")
            assert (await sub.next_msg(5)).payload == b"found"
        finally:
            await client.close()

    run(main)


def test_closed_client_is_a_clear_error(server: ServerProcess) -> None:
    async def main() -> None:
        client = await broky.connect(server.url)
        sub = await client.subscribe("x")
        await client.close()
        await client.close()
        for call in (
            lambda: client.publish(b"x", b"1", partition=b"a"),
            lambda: client.flush(),
            lambda: client.subscribe("x"),
        ):
            with pytest.raises(broky.ClientClosedError, match="closed"):
                await call()
        assert [m async for m in sub] == []

    run(main)
    c = broky.connect_sync(server.url)
    c.close()
    with pytest.raises(broky.ClientClosedError):
        c.publish(b"x", b"1", partition=b"a")
    with pytest.raises(broky.ClientClosedError):
        c.flush()


def test_close_delivers_publishes_waiting_for_a_first_connection(server: ServerProcess) -> None:
    """Publish to many partitions, close at once: a worker's connection opens at its first
    publish, and close() waits for it (it dropped them, counted in unsent_on_close)."""

    async def main() -> None:
        async with broky.connect(server.url) as subscriber:
            sub = await subscriber.subscribe("closing.>")
            for round in range(4):  # the master gives each a worker: some rounds race the other's
                client = await broky.connect(server.url)
                assert sum(link.proto is not None for link in client.router.links.values()) == 1
                keys = [b"closing.%d.%d" % (round, i) for i in range(200)]
                for i, key in enumerate(keys):
                    client.publish_nowait(key, b"x", partition=b"p%d" % i)
                await client.close()
                assert client.stats.unsent_on_close == 0
                got = await take(sub, 200)
                assert sorted(m.key for m in got) == sorted(keys)

    run(main)


def test_not_my_vbucket_refreshes_the_map_and_moves_the_subscription(server: ServerProcess) -> None:
    """A client whose map is wrong (every vbucket shifted to the other worker) recovers."""

    async def main() -> None:
        errors: list[BaseException] = []
        async with broky.connect(server.url, on_error=errors.append) as client:
            assert client.router.map is not None
            good = client.router.map
            client.router.map = good._replace(owners=tuple((n, 1 - w) for n, w in good.owners))
            client.router.route = [None] * len(client.router.route)
            by_worker = partitions_by_worker(good)
            kp = by_worker[0][0]
            sub = await client.subscribe("m", partition=kp)
            for i in range(3):  # go to the wrong worker, which returns them in its Errors
                await client.publish(b"m", b"refused %d" % i, partition=kp)
            # flush waits for the map refresh and the resend of the refused publishes
            await client.flush()
            assert client.router.map == good and client._subscriptions.links[sub.sid][0].ref.worker == 0
            assert client.stats.resent == 3 and client.stats.misrouted == 0
            assert errors == []  # handled: nothing for on_error
            await client.publish(b"m", b"found", partition=kp)
            await client.flush()
            got = [(await sub.next_msg(5)).payload for _ in range(4)]
            assert got == [b"refused 0", b"refused 1", b"refused 2", b"found"]
            assert client.stats.resent == 3 and client.stats.misrouted == 0

    run(main)


def test_blocking_client(server: ServerProcess) -> None:
    errors: list[BaseException] = []
    with broky.connect_sync(server.url, name="sync", on_error=errors.append) as c:
        assert isinstance(c, broky.SyncClient)
        assert c.server_info is not None and c.server_info.workers == 2
        by_worker = partitions_by_worker(c.server_info.map)
        sub = c.subscribe("jobs.*")
        one = c.subscribe("jobs.>", partition=by_worker[1][0])
        for w in (0, 1):
            for kp in by_worker[w]:
                c.publish("jobs.done", kp, partition=kp, ts_producer=None)
        c.flush()
        got = list(sub.iter(timeout=2, count=4))
        assert sorted(m.key_partition for m in got) == sorted(by_worker[0] + by_worker[1])
        assert [m.key_partition for m in one.iter(timeout=0.5)] == [by_worker[1][0]]
        with pytest.raises(broky.BrokyTimeoutError):
            sub.next(timeout=0.1)

        # publish from several threads at once: nothing lost
        def burst(t: int) -> None:
            for i in range(500):
                c.publish(b"jobs.bulk", b"%d" % i, partition=b"t%d" % t)

        threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c.flush()
        got = list(sub.iter(timeout=2, count=2000))
        assert len(got) == 2000
        for n in range(4):
            mine = [int(m.payload) for m in got if m.key_partition == b"t%d" % n]
            assert mine == list(range(500))
        sub.unsubscribe()
        assert list(sub) == []
        assert errors == []


def test_sync_iteration_with_a_consumer_thread(server: ServerProcess) -> None:
    with broky.connect_sync(server.url) as c:
        sub = c.subscribe("it")
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.extend(m.payload for m in sub))
        reader.start()
        for i in range(100):
            c.publish(b"it", b"%d" % i, partition=b"p")
        c.flush()
        deadline = time.monotonic() + 5
        while len(received) < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
    reader.join(5)
    assert not reader.is_alive()
    assert received == [b"%d" % i for i in range(100)]


def test_linger_keeps_a_publish_back(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as reader, broky.connect(server.url, linger=0.3) as lingering:
            sub = await reader.subscribe("linger")
            await lingering.subscribe("unused")  # its connections to both workers are up
            loop = asyncio.get_running_loop()
            started = loop.time()
            await lingering.publish(b"linger", b"late", partition=b"kp")
            with pytest.raises(broky.BrokyTimeoutError):
                await sub.next_msg(0.15)  # still waiting for others to share its write
            assert (await sub.next_msg(5)).payload == b"late"
            assert loop.time() - started >= 0.29

    run(main)


def test_batch_size_writes_a_full_batch_at_once(server: ServerProcess) -> None:
    async def main() -> None:
        # a linger far beyond the test: only a full batch (or a flush) can write
        async with (
            broky.connect(server.url) as reader,
            broky.connect(server.url, linger=60, batch_size=1000) as batching,
        ):
            sub = await reader.subscribe("batch")
            await batching.subscribe("unused")  # its connections to both workers are up
            frame = len(encode_message(b"kp", b"batch", bytes(100), 1, 0, bytes(20)))
            per_batch = -(-1000 // frame)  # publishes that fill a batch
            for i in range(3 * per_batch):
                await batching.publish(b"batch", b"%03d" % i + bytes(97), partition=b"kp")
            got = await take(sub, 3 * per_batch)  # written as each batch filled, not after 60 s
            assert [m.payload[:3] for m in got] == [b"%03d" % i for i in range(3 * per_batch)]
            await batching.publish(b"batch", b"tail", partition=b"kp")
            with pytest.raises(broky.BrokyTimeoutError):
                await sub.next_msg(0.2)  # below batch_size: it lingers
            await batching.flush()  # a flush writes what waits
            assert (await sub.next_msg(5)).payload == b"tail"

    run(main)


def test_on_loss_reports_what_the_server_dropped(start_server: Callable[..., ServerProcess]) -> None:
    """A subscriber whose reader is stuck (a slow plain callback) loses deliveries; it is told how many."""
    server = start_server(
        "--max-pending-bytes", "64K", "--slow-consumer-deadline", "60", "--replay-bytes", "0"
    )
    n = 4000
    losses: list[tuple[int, int, int]] = []
    published = threading.Event()

    def publish_all() -> None:
        with broky.connect_sync(server.url) as pub:
            kp = partitions_by_worker(pub.server_info.map)[0][0]  # type: ignore[union-attr]
            for i in range(n):
                pub.publish(b"loss", b"%05d" % i + bytes(10_000), partition=kp)
            pub.flush()  # the server has handled every publish: queued for us, or dropped
        published.set()

    async def main() -> None:
        async with broky.connect(
            server.url, on_loss=lambda ref, dropped, reason: losses.append((ref.worker, dropped, reason))
        ) as client:
            received: list[bytes] = []

            def stuck(msg: broky.Message) -> None:
                if not received:
                    assert published.wait(30)  # blocks this client's reader meanwhile
                received.append(msg.payload[:5])

            await client.subscribe("loss", callback=stuck)
            publisher = threading.Thread(target=publish_all)
            publisher.start()
            try:
                async with asyncio.timeout(30):
                    while len(received) + client.stats.server_lost < n:
                        await asyncio.sleep(0.02)
            finally:
                publisher.join(30)
            assert losses and {w for w, _, _ in losses} == {0}
            assert {reason for _, _, reason in losses} == {LossReason.SLOW_CONSUMER}
            assert sum(d for _, d, _ in losses) == client.stats.server_lost > 0
            assert len(received) + client.stats.server_lost == n  # every message: received or reported
            assert received == sorted(received)  # what arrived kept its order

    run(main, timeout=60)


def test_a_full_blocking_subscription_pauses_its_connections_and_loses_nothing(
    server: ServerProcess,
) -> None:
    errors: list[BaseException] = []
    with broky.connect_sync(server.url, on_error=errors.append) as c:
        by_count = c.subscribe("bs", max_pending_msgs=5)
        by_bytes = c.subscribe("bs", max_pending_bytes=10)
        for i in range(50):
            c.publish(b"bs", b"%03d" % i, partition=b"kp")
        c.flush()
        deadline = time.monotonic() + 5
        while c.stats.pauses == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        want = [b"%03d" % i for i in range(50)]
        assert [m.payload for m in by_count.iter(timeout=2, count=50)] == want
        assert [m.payload for m in by_bytes.iter(timeout=2, count=50)] == want
        assert by_count.dropped == by_bytes.dropped == c.stats.dropped_local == 0 and errors == []
        # resumed: the queue takes messages again
        c.publish(b"bs", b"new", partition=b"kp")
        c.flush()
        assert by_count.next(5).payload == b"new"


def test_callbacks_returning_awaitables_are_awaited_in_order(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as client:
            seen: dict[str, list[bytes]] = {"lambda": [], "object": []}

            async def record(name: str, msg: broky.Message) -> None:
                await asyncio.sleep(0.02 if msg.payload == b"0" else 0)  # the first one is slowest
                seen[name].append(msg.payload)

            class Handler:
                async def __call__(self, msg: broky.Message) -> None:
                    await record("object", msg)

            await client.subscribe("aw", callback=lambda msg: record("lambda", msg))
            await client.subscribe("aw", callback=Handler())
            for i in range(5):
                await client.publish(b"aw", b"%d" % i, partition=b"kp")
            await client.flush()
            async with asyncio.timeout(5):
                while len(seen["lambda"]) < 5 or len(seen["object"]) < 5:
                    await asyncio.sleep(0.01)
            expected = [b"%d" % i for i in range(5)]
            assert seen == {"lambda": expected, "object": expected}

    run(main)
