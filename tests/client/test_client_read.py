"""Bounded reads from the SDK (broky.client.reader) against a real `broky serve`:
`client.read` across workers, awaited or iterated, `client.positions`, the
blocking client's, and what a read says of what is gone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

import broky
from broky.client.reader import Reading
from broky.errors import ErrorCode, ServerError
from broky.protocol import VBUCKETS, Message, vbucket_of
from broky.protocol.frames import Position
from tests.support.http import http_get
from tests.support.sdk import MessageBatches, partitions_by_worker
from tests.support.serverproc import ServerProcess


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 60) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(main())


def numbers(messages: list[Message], kp: bytes) -> list[int]:
    return [int(m.payload.split(b".")[0]) for m in messages if m.key_partition == kp]


def open_connections(server: ServerProcess, name: str) -> int:
    body = json.loads(http_get(server, "/connections?limit=1000")[1])
    return sum(1 for c in body["connections"] if c["name"] == name)


async def connections_back_to(server: ServerProcess, name: str, n: int) -> None:
    """Wait (2 s at most) until the server holds `n` connections of client `name`: the
    read connections are closed (the server sees it a moment later)."""
    for _ in range(100):
        if open_connections(server, name) == n:
            return
        await asyncio.sleep(0.02)
    assert open_connections(server, name) == n


def test_a_read_across_two_workers_returns_a_known_range_twice(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(workers=2)

    async def main() -> None:
        async with broky.connect(server.url, name="reader") as client:
            assert client.server_info is not None
            kps = [kp for kps in partitions_by_worker(client.server_info.map, 2).values() for kp in kps]
            for i in range(200):
                await client.publish("r.k", b"%d" % i, partition=kps[i % 4])
            await client.flush()
            stop = await client.positions()  # where every vbucket stands: the end of the range
            assert len(stop) == VBUCKETS and [p.vbucket for p in stop] == list(range(VBUCKETS))
            for i in range(200, 250):  # after the range
                await client.publish("r.k", b"%d" % i, partition=kps[i % 4])
            await client.flush()
            links = open_connections(server, "reader")

            first = await client.read(">", stop=stop)
            for n, kp in enumerate(kps):
                assert numbers(first.messages, kp) == list(range(n, 200, 4))
            assert len(first.ends) == VBUCKETS and first.evicted == 0
            assert first.positions == stop
            again = await client.read("r.*", stop=stop)
            assert [m.uid for m in again.messages] == [m.uid for m in first.messages]
            assert {m.vbucket for m in first.messages} == {vbucket_of(kp) for kp in kps}
            # From where it ended, up to now: the 50 after the range.
            # (given as `broky sub --json` writes a position: issue 37)
            start = [
                {"vbucket": p.vbucket, "epoch": str(p.epoch), "offset": p.offset} for p in first.positions
            ]
            rest = await client.read(">", start=start)
            for n, kp in enumerate(kps):
                assert numbers(rest.messages, kp) == list(range(200 + n, 250, 4))
            assert rest.positions == await client.positions()
            await connections_back_to(server, "reader", links)  # each read's connections are closed

    run(main)


def test_a_read_streams_and_follows_pattern_and_partition(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(workers=2)

    async def main() -> None:
        async with broky.connect(server.url, name="streamer") as client:
            kp = b"stream-kp"
            for i in range(300):
                await client.publish("s.a" if i % 3 else "s.b", b"%d." % i + bytes(1000), partition=kp)
            await client.publish("s.a", b"-1.", partition=b"elsewhere")
            await client.flush()
            reading = client.read("s.a", partition=kp)
            got = [msg async for msg in reading]
            assert numbers(got, kp) == [i for i in range(300) if i % 3]
            assert list(reading.ends) == [vbucket_of(kp)] and reading.ends[vbucket_of(kp)].next == 301
            # Slowly, with a small queue: the read connections pause and resume (flow control).
            slow = Reading(client, b">", kp, max_pending_msgs=16)
            got = []
            async for msg in slow:
                got.append(msg)
                if len(got) % 50 == 0:
                    await asyncio.sleep(0.01)
            assert numbers(got, kp) == list(range(300)) and slow.positions == reading.positions
            # Leaving early closes the read's connections.
            links = open_connections(server, "streamer")
            async for _ in client.read(">"):
                break
            await connections_back_to(server, "streamer", links)

    run(main)


def test_what_is_gone_is_told_per_vbucket(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--replay-bytes", "64K", workers=1)

    async def main() -> None:
        async with broky.connect(server.url) as client:
            kp = b"gone-kp"
            vb = vbucket_of(kp)
            [before] = await client.positions(partition=kp)
            assert before.offset == 0
            for i in range(200):
                await client.publish("g.k", b"%d." % i + bytes(1000), partition=kp)
                await client.flush()  # one read each: the buffer evicts segment by segment
            result = await client.read(">", partition=kp, start=[before])
            end = result.ends[vb]
            assert end.evicted > 0 and len(result.messages) + end.evicted == 200
            assert numbers(result.messages, kp) == list(range(end.evicted, 200))
            assert (end.epoch, end.next, end.epoch_changed) == (before.epoch, 201, False)
            # A start in an epoch that is gone: told, and the current epoch from its start.
            result = await client.read(">", partition=kp, start=[Position(vb, before.epoch ^ 1, 7)])
            assert result.ends[vb].epoch_changed and result.ends[vb].evicted == end.evicted
            # A position the server never gave: refused.
            with pytest.raises(ServerError) as info:
                await client.read(">", partition=kp, stop=[Position(vb, before.epoch, 500)])
            assert info.value.code == ErrorCode.BAD_POSITION and info.value.rid == 1
            with pytest.raises(ValueError):
                client.read(">", start=[(VBUCKETS, 1, 1)])

    run(main)


def test_the_blocking_client_reads(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(workers=2)
    with broky.connect_sync(server.url) as client:
        for i in range(20):
            client.publish("b.k", b"%d" % i, partition=b"sync-kp")
        client.flush()
        stop = client.positions()
        client.publish("b.k", b"20", partition=b"sync-kp")
        client.flush()
        result = client.read("b.>", stop=stop, timeout=10)
        assert numbers(result.messages, b"sync-kp") == list(range(20))
        assert result.ends[vbucket_of(b"sync-kp")].next == 21
        assert numbers(client.read(">", start=stop).messages, b"sync-kp") == [20]


def bounded_read_messages(server: ServerProcess) -> int:
    """Messages the server's workers sent in bounded reads, all of them together."""
    return sum(w["bounded_read_messages"] for w in json.loads(http_get(server, "/stats")[1])["workers"])


def test_a_read_of_some_vbuckets_across_two_workers(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(workers=2)

    async def main() -> None:
        async with broky.connect(server.url) as client:
            assert client.server_info is not None
            by_worker = partitions_by_worker(client.server_info.map, 3)
            kps = by_worker[0] + by_worker[1]
            assert len({vbucket_of(kp) for kp in kps}) == 6
            for i in range(60):
                await client.publish("v.k", b"%d" % i, partition=kps[i % 6])
            await client.flush()
            # Two of each worker's three, and an empty vbucket: exactly those, from both.
            wanted = [by_worker[0][0], by_worker[0][2], by_worker[1][1]]
            empty = next(vb for vb in range(VBUCKETS) if vb not in {vbucket_of(kp) for kp in kps})
            asked = [vbucket_of(kp) for kp in wanted] + [empty]
            before = bounded_read_messages(server)
            result = await client.read(">", vbuckets=iter(asked))  # any iterable
            assert list(result.ends) == sorted(asked) and result.ends[empty].next == 1
            assert {m.vbucket for m in result.messages} == {vbucket_of(kp) for kp in wanted}
            for kp in wanted:
                n = kps.index(kp)
                assert numbers(result.messages, kp) == list(range(n, 60, 6))
                assert result.ends[vbucket_of(kp)].next == 11
            # Each worker was asked for its own of them only: it sent nothing else.
            assert bounded_read_messages(server) - before == 30
            # Iterated, the same; `positions` of the same vbuckets are where those ended.
            reading = client.read(">", vbuckets=asked)
            streamed = [(m.vbucket, m.offset) async for m in reading]
            assert sorted(streamed) == [(m.vbucket, m.offset) for m in result.messages]
            assert await client.positions(vbuckets=asked) == result.positions
            # With a partition among them: that partition only.
            kp = wanted[2]
            result = await client.read(">", partition=kp, vbuckets=[vbucket_of(kp), empty])
            assert list(result.ends) == [vbucket_of(kp)] and numbers(result.messages, kp) == list(
                range(kps.index(kp), 60, 6)
            )
            for bad, why in [
                ([1, VBUCKETS], "not a vbucket"),
                ([-1], "not a vbucket"),
                ([5, 6, 5], "named twice"),
                ([], "empty"),
            ]:
                with pytest.raises(ValueError, match=why):
                    client.read(">", vbuckets=bad)
            with pytest.raises(ValueError, match="not among `vbuckets`"):
                client.read(">", partition=kp, vbuckets=[empty])
            with pytest.raises(ValueError, match="named twice"):
                await client.positions(vbuckets=[empty, empty])

    run(main)


def test_the_blocking_client_reads_some_vbuckets(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(workers=2)
    with broky.connect_sync(server.url) as client:
        for kp in (b"sync-a", b"sync-b"):
            for i in range(5):
                client.publish("b.k", b"%d" % i, partition=kp)
        client.flush()
        vb = vbucket_of(b"sync-a")
        assert vb != vbucket_of(b"sync-b")
        result = client.read(">", vbuckets=[vb], timeout=10)
        assert list(result.ends) == [vb] and numbers(result.messages, b"sync-a") == list(range(5))
        assert len(result.messages) == 5
        assert client.positions(vbuckets=[vb]) == result.positions
        with pytest.raises(ValueError, match="not a vbucket"):
            client.read(">", vbuckets=[VBUCKETS])


class CountingReading(Reading):
    """A Reading that counts the times its connections were paused."""

    pauses = 0

    def pause(self) -> None:
        self.pauses += 1
        super().pause()


class FailingBatches(MessageBatches):
    """A decoder that cannot hold the message after its first `after`."""

    def __init__(self, after: int) -> None:
        super().__init__(1 << 20, 1 << 30)
        self.left = after

    def add(self, msg: Message) -> None:
        if self.left == 0:
            raise OverflowError(f"message {msg.offset} of vbucket {msg.vbucket} does not fit")
        self.left -= 1
        super().add(msg)


def test_a_read_in_bulk_gives_the_read_in_full_batches_and_fails_with_its_decoder(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(workers=2)

    async def main() -> None:
        async with broky.connect(server.url, name="bulk") as client:
            assert client.server_info is not None
            by_worker = partitions_by_worker(client.server_info.map, 3)
            kps = by_worker[0] + by_worker[1]
            for i in range(600):
                await client.publish("bulk.k", b"%d" % i, partition=kps[i % 6])
            await client.flush()
            whole = await client.read(">")
            assert len(whole.messages) == 600
            # Few messages may wait: the connections pause and resume as the batches are taken.
            reading = CountingReading(client, b">", max_pending_msgs=16)
            batches = [b async for b in reading.batches(MessageBatches(7, 1 << 30))]
            assert [len(b) for b in batches] == [7] * 85 + [5]
            got = sorted((m for b in batches for m in b), key=lambda m: (m.vbucket, m.offset))
            assert got == whole.messages and reading.ends == whole.ends
            assert reading.pauses > 0
            # A share of the vbuckets, by bytes as well: as the read of them.
            asked = [vbucket_of(kp) for kp in (by_worker[0][1], by_worker[1][2])]
            share = await client.read(">", vbuckets=asked)
            share_reading = client.read(">", vbuckets=asked)
            batches = [b async for b in share_reading.batches(MessageBatches(1000, 250))]

            def size(msgs: list[Message]) -> int:
                return sum(len(m.key_partition) + len(m.key) + len(m.payload) for m in msgs)

            assert len(batches) > 2 and all(size(b) >= 250 > size(b[:-1]) for b in batches[:-1])
            got = sorted((m for b in batches for m in b), key=lambda m: (m.vbucket, m.offset))
            assert got == share.messages and share_reading.ends == share.ends
            # One way per read.
            with pytest.raises(RuntimeError, match="already"):
                share_reading.batches(MessageBatches(7, 1 << 30))
            bulk = client.read(">")
            bulk.batches(MessageBatches(7, 1 << 30))
            with pytest.raises(RuntimeError, match="in batches"):
                await bulk
            # A value the decoder cannot hold ends the read with its error; the connections close.
            with pytest.raises(OverflowError, match="does not fit"):
                async for _ in client.read(">").batches(FailingBatches(after=250)):
                    pass
            await connections_back_to(server, "bulk", 2)

    run(main)
