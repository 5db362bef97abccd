"""Never silent and exact: what a subscriber is told is what it lost, no more, no less.

Each test checks both differences: lost - told = 0 (nothing lost untold) and
told - lost = 0 (nothing told that was not lost, nothing told twice), through the
SDK as an application uses it, against a real `broky serve`.

- A start's notices come one per vbucket: a vbucket whose count is not known
  (a start from a time, traffic before it) never makes the others' exact counts
  unknown, and a vbucket that took nothing after the time is told nothing.
- A start's notice names the last position it accounts for (`through`): the
  next resume goes on after it, so repeated cuts do not tell the same loss again.
- A subscriber that stops reading lags instead of losing (the replay buffer holds
  what it missed); one cut because the buffer evicted all it was owed is told
  exactly by its resume by positions.
- A server stopped with SIGTERM (Goodbye on every connection) and started again
  tells its subscribers nothing; one SIGKILLed tells each connection once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import broky
from bench.harness.servers import free_port
from broky.protocol import LossReason
from broky.protocol.routing import vbucket_of
from tests.support.faultproxy import FaultProxy
from tests.support.http import http_get
from tests.support.sdk import Received, partitions_by_worker, run
from tests.support.serverproc import ServerProcess, kill_worker

SEQ = struct.Struct(">II")  # key_partition index, sequence number within it


class Tally(Received):
    """What a subscriber received (per key_partition) and was told it lost."""

    sent: list[int]  # what was published per key_partition, where a test keeps it here

    def lost(self, sent: list[int]) -> int:
        return sum(n - len(set(self.by_kp.get(k, []))) for k, n in enumerate(sent))

    def assert_in_order(self) -> None:
        for seqs in self.by_kp.values():
            assert seqs == sorted(set(seqs))  # in order, no copies


class Publisher:
    """Publishes sequence-numbered messages over `partitions` key_partitions."""

    def __init__(self, client: broky.Client, prefix: bytes, partitions: int, key: bytes = b"ex.k") -> None:
        self.client = client
        self.kps = [prefix + b"-%d" % i for i in range(partitions)]
        self.sent = [0] * partitions
        self.key = key

    async def burst(self, n: int) -> None:
        for i in range(n):
            k = i % len(self.kps)
            await self.client.publish(self.key, SEQ.pack(k, self.sent[k]), partition=self.kps[k])
            self.sent[k] += 1
        await self.client.flush()


@pytest.fixture
def replay_off(start_server: Any) -> ServerProcess:
    server: ServerProcess = start_server("--replay-bytes", "0")
    return server


@pytest.fixture
def proxy_to(replay_off: ServerProcess) -> Iterator[FaultProxy]:
    p = FaultProxy(replay_off.address).start()
    yield p
    p.stop()


async def cut(proxy: FaultProxy, client: broky.Client, publish: Any = None) -> None:
    """Cut the subscriber's connections, run `publish` while it is down, let it back in and
    wait until it is connected again with its subscriptions in place (a round trip)."""
    reconnects = client.stats.reconnects
    proxy.refuse(True)
    proxy.cut()
    await asyncio.sleep(0.3)
    if publish is not None:
        await publish()
    proxy.refuse(False)
    deadline = time.monotonic() + 20
    while client.stats.reconnects < reconnects + 2 and time.monotonic() < deadline:  # 2 workers
        await asyncio.sleep(0.02)
    await client.flush()
    await asyncio.sleep(0.2)  # the answers to its Subscribes (notices) arrive


async def settle(got: Tally, total: int) -> None:
    deadline = time.monotonic() + 20
    while got.count + got.told_count() < total and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # anything more (a notice told twice, a copy) would arrive now


@pytest.mark.timeout(120)
def test_foreign_traffic_does_not_make_exact_counts_unknown(
    replay_off: ServerProcess, proxy_to: FaultProxy
) -> None:
    """Without a replay buffer: other vbuckets of the workers carried traffic before the
    subscriber started; a cut costs it what was published meanwhile, told exactly, per
    vbucket, with no "unknown" (before: one summed notice, "dropped 0")."""

    async def main() -> None:
        got = Tally()
        options: dict[str, Any] = {"on_loss": got.on_loss, "reconnect_min_delay": 0.05}
        async with (
            broky.connect(replay_off.url) as pub_client,
            broky.connect(proxy_to.address, **options) as subscriber,
        ):
            foreign = Publisher(pub_client, b"foreign", 64, key=b"other.k")
            await foreign.burst(2000)  # vbuckets the subscriber's keys never use
            await subscriber.subscribe("ex.>", callback=got.take)
            mine = Publisher(pub_client, b"mine", 40)
            await mine.burst(400)
            await settle(got, 400)
            await cut(proxy_to, subscriber, lambda: mine.burst(1200))
            await mine.burst(400)
            await settle(got, 2000)
            lost = got.lost(mine.sent)
            assert lost == 1200
            assert got.told_count() == lost, got.told  # lost - told = 0 and told - lost = 0
            assert all(dropped > 0 for dropped, _ in got.told), got.told  # never "unknown"
            assert {reason for _, reason in got.told} == {LossReason.EVICTED}
            # One notice per vbucket: as many as the vbuckets that lost something.
            assert len(got.told) == len({vbucket_of(kp) for kp in mine.kps})
            got.assert_in_order()

    run(main, timeout=100)


@pytest.mark.timeout(120)
def test_what_was_told_is_not_told_again_after_more_cuts(
    replay_off: ServerProcess, proxy_to: FaultProxy
) -> None:
    """Without a replay buffer: 50 lost in a cut, then three more cuts with nothing
    published: told 50, once (before: 50 after every cut, the resume asking again for
    the range it was told of)."""

    async def main() -> None:
        got = Tally()
        options: dict[str, Any] = {"on_loss": got.on_loss, "reconnect_min_delay": 0.05}
        async with (
            broky.connect(replay_off.url) as pub_client,
            broky.connect(proxy_to.address, **options) as subscriber,
        ):
            await subscriber.subscribe("ex.>", callback=got.take)
            mine = Publisher(pub_client, b"again", 5)
            await mine.burst(20)
            await settle(got, 20)
            await cut(proxy_to, subscriber, lambda: mine.burst(50))
            assert got.told_count() == 50, got.told
            for _ in range(3):
                await cut(proxy_to, subscriber)
            await mine.burst(10)
            await settle(got, 80)
            assert got.lost(mine.sent) == 50 and got.told_count() == 50, got.told
            got.assert_in_order()

    run(main, timeout=100)


def stalled_subscriber(server: ServerProcess, total: int, partitions: int, stall: float) -> Tally:
    """A subscriber whose process stops reading (its callback blocks the event loop) for
    `stall` seconds after 500 messages, while another thread publishes `total` messages
    of 1 KB over `partitions` key_partitions; what it received and was told."""
    sent = [0] * partitions
    padding = bytes(1000)

    def publish(first: int, last: int) -> None:  # another thread, its own client: never blocked
        with broky.connect_sync(server.url) as client:
            for i in range(first, last):
                k = i % partitions
                client.publish(b"ex.k", SEQ.pack(k, sent[k]) + padding, partition=b"slow-%d" % k)
                sent[k] += 1
            client.flush()

    got = Tally()

    async def main() -> None:
        blocked = [False]

        def take(msg: broky.Message) -> None:
            got.take(msg)
            if got.count == 500 and not blocked[0]:
                blocked[0] = True
                time.sleep(stall)  # the whole client stops reading

        options: dict[str, Any] = {"on_loss": got.on_loss, "reconnect_min_delay": 0.05}
        async with broky.connect(server.url, **options) as subscriber:
            await subscriber.subscribe("ex.>", callback=take)
            publishing = asyncio.get_running_loop().run_in_executor(None, publish, 0, total)
            await settle(got, total)
            await publishing
            await settle(got, total)
            assert blocked[0]

    run(main, timeout=100)
    got.sent = sent
    return got


@pytest.mark.timeout(120)
def test_a_subscriber_that_stops_reading_lags_and_loses_nothing(start_server: Any) -> None:
    """Its pending bound fills while it does not read, and it lags: as it reads again the
    server sends it the rest from the replay buffer, then live. Nothing lost, nothing
    told, nothing twice, in order (before: SLOW_CONSUMER, then a cut)."""
    server: ServerProcess = start_server(
        "--max-pending-bytes", "1M", "--slow-consumer-deadline", "1", "--replay-bytes", "64M"
    )
    got = stalled_subscriber(server, 20_000, 32, 3.0)
    _, body = _stats(server)
    workers = body["workers"]
    assert sum(w["lag_entered"] for w in workers) >= 1  # it lagged
    assert sum(w["lag_served"] for w in workers) > 0  # and was served from history
    assert sum(w["slow_consumer_disconnects"] for w in workers) == 0  # never cut
    assert sum(w["dropped"]["slow_consumer"] + w["dropped"]["evicted"] for w in workers) == 0
    assert got.told == []
    assert got.count == 20_000 and got.lost(got.sent) == 0
    got.assert_in_order()


@pytest.mark.timeout(120)
def test_a_lagging_subscriber_whose_history_was_evicted_is_cut_and_told_exactly(start_server: Any) -> None:
    """The same stall against a replay buffer far smaller than the burst: everything the
    subscriber was owed is evicted while it does not read, so it can no longer catch up
    and is cut after --slow-consumer-deadline. Its resume by positions is told exactly,
    per vbucket, what is gone (EVICTED) and gets the rest: every message received once or
    told once."""
    server: ServerProcess = start_server(
        "--max-pending-bytes", "1M", "--slow-consumer-deadline", "1", "--replay-bytes", "1M"
    )
    total = 20_000
    got = stalled_subscriber(server, total, 32, 6.0)  # the burst takes about 2 s of it
    _, body = _stats(server)
    assert sum(w["slow_consumer_disconnects"] for w in body["workers"]) >= 1  # it was cut
    lost = got.lost(got.sent)
    assert lost > 0
    assert got.told_count() == lost, (lost, got.told)  # lost - told = 0, told - lost = 0
    assert {reason for _, reason in got.told} <= {LossReason.EVICTED, LossReason.SLOW_CONSUMER}
    assert all(dropped > 0 for dropped, _ in got.told)
    assert got.count + lost == total  # no copy
    got.assert_in_order()


def _stats(server: ServerProcess) -> tuple[int, Any]:
    status, body = http_get(server, "/stats")
    return status, json.loads(body)


@pytest.mark.timeout(120)
def test_a_worker_killed_under_a_full_ack_group_tells_its_backlog_once(server: ServerProcess) -> None:
    """Three members of a load-balanced ack group, each at its max_in_flight, the rest of
    what was published waiting in the group's backlog, and the worker SIGKILLed: what the
    group held for nobody is told once (WORKER_RESTART, to the member carrying the group's
    account), and what the members hold unacknowledged is theirs, not lost (before: the
    backlog told to nobody, and UNACKED_LOST for what the members had received)."""

    async def main() -> None:
        members: list[tuple[broky.Client, Any, Tally]] = []
        async with broky.connect(server.url) as pub_client:
            assert pub_client.server_info is not None
            kps = partitions_by_worker(pub_client.server_info.map, 8)[0]  # worker 0's
            for i in range(3):
                got = Tally()
                options: dict[str, Any] = {"on_loss": got.on_loss, "reconnect_min_delay": 0.05}
                client = await broky.connect(server.url, name=f"member-{i}", **options).__aenter__()
                sub = await client.subscribe("gk.>", group="g", ack=True, max_in_flight=5)
                members.append((client, sub, got))
            try:
                publisher = Publisher(pub_client, b"", 0)
                publisher.kps = list(kps)
                publisher.sent = [0] * len(kps)
                publisher.key = b"gk.x"
                await publisher.burst(300)

                async def take(sub: Any, got: Tally) -> None:
                    while True:
                        got.take(await sub.next_msg(30))  # held, never acknowledged

                takers = [asyncio.create_task(take(sub, got)) for _, sub, got in members]
                deadline = time.monotonic() + 20
                while sum(g.count for _, _, g in members) < 15 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                received = sum(g.count for _, _, g in members)
                assert received == 15  # 5 each: the other 285 wait in the group's backlog
                await asyncio.to_thread(kill_worker, server, 0)
                deadline = time.monotonic() + 20
                while sum(g.told_count() for _, _, g in members) < 285 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # anything told twice would arrive now
                told = [t for _, _, g in members for t in g.told]
                assert sum(n for n, _ in told) == 300 - received, told  # lost - told = 0 both ways
                assert {reason for _, reason in told} == {LossReason.WORKER_RESTART}
                assert sum(c.stats.unacked_lost for c, _, _ in members) == 0
                assert sum(sub.in_flight for _, sub, _ in members) == 15  # still theirs to settle
                for task in takers:
                    task.cancel()
            finally:
                for client, _, _ in members:
                    await client.close()

    run(main, timeout=100)


def _restart(server: ServerProcess, sig: int, port: int) -> ServerProcess:
    """Stop `server` with `sig` (SIGKILL: the master and its workers at once) and start a
    new process on the same port; the old one's pid is reaped."""
    assert server.proc is not None
    if sig == signal.SIGKILL:
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.stop()  # SIGTERM: a shutdown, Goodbye on every connection
    return ServerProcess("--port", str(port)).start()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_restarted_server_tells_nothing_it_can_prove_and_the_rest_once(sig: int) -> None:
    """A server stopped with SIGTERM (a Goodbye after every delivery on every connection) and
    started again: its subscriber, which lost nothing, is told nothing. SIGKILLed: nobody
    can say what the dead process lost, and each of its connections is told so once
    (UNACCOUNTED), never again as EPOCH_CHANGED for the same epochs (before: 2 UNACCOUNTED
    and 2 EPOCH_CHANGED after either)."""
    port = free_port()
    servers = [ServerProcess("--port", str(port)).start()]
    try:

        async def main() -> None:
            got = Tally()
            options: dict[str, Any] = {"on_loss": got.on_loss, "reconnect_min_delay": 0.05}
            async with broky.connect(servers[0].url, **options) as subscriber:
                await subscriber.subscribe("ex.>", callback=got.take)
                async with broky.connect(servers[0].url) as pub_client:
                    mine = Publisher(pub_client, b"rs", 16)
                    await mine.burst(200)
                await settle(got, 200)
                reconnects = subscriber.stats.reconnects
                servers.append(await asyncio.to_thread(_restart, servers.pop(), sig, port))
                deadline = time.monotonic() + 20
                while subscriber.stats.reconnects < reconnects + 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await subscriber.flush()
                async with broky.connect(servers[0].url) as pub_client:
                    more = Publisher(pub_client, b"rs", 16)
                    more.sent = list(mine.sent)
                    await more.burst(200)
                await settle(got, 400)
                assert got.lost(more.sent) == 0 and got.count == 400
                got.assert_in_order()
                if sig == signal.SIGTERM:
                    assert got.told == []
                else:  # once per connection (one per worker), and no EPOCH_CHANGED
                    assert got.told == [(0, LossReason.UNACCOUNTED)] * 2, got.told
                assert subscriber.stats.epochs_changed > 0  # the starts did meet the new epochs

        run(main, timeout=100)
    finally:
        for server in servers:
            server.stop()


_PUBLISH_FOREVER = r"""
import asyncio, sys, broky
async def main():
    async with broky.connect(sys.argv[1]) as pub:
        i = 0
        while True:
            for _ in range(20):
                await pub.publish("o.k", b"%d" % i, partition="kp%d" % (i % 7))
                i += 1
            await asyncio.sleep(0.001)
asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_a_started_subscription_beside_a_live_one_takes_no_copy_at_the_seam(start_server: Any) -> None:
    """The seam (schema/README.md 5.1): a subscription whose Subscribe names a start takes
    no bare delivery before its Replay, since those are also in the replay. Beside a live
    subscription on the same connection, under a steady publish (before: 160 copies and
    28 order violations in 30 rounds)."""
    server: ServerProcess = start_server(workers=1)
    publisher = subprocess.Popen([sys.executable, "-c", _PUBLISH_FOREVER, server.url])
    try:

        async def main() -> None:
            copies = order = total = 0
            async with broky.connect(server.url) as client:
                await client.subscribe("o.>", callback=lambda m: None)
                await asyncio.sleep(0.5)
                for _ in range(30):
                    started = await client.subscribe("o.>", last=100)
                    seen: set[tuple[int, int]] = set()
                    last: dict[int, int] = {}
                    end = time.monotonic() + 0.2
                    while time.monotonic() < end:
                        try:
                            m = await started.next_msg(0.2)
                        except broky.BrokyTimeoutError:
                            break
                        total += 1
                        copies += (m.vbucket, m.offset) in seen
                        seen.add((m.vbucket, m.offset))
                        order += m.vbucket in last and m.offset <= last[m.vbucket]
                        last[m.vbucket] = m.offset
                    await started.unsubscribe()
            assert total > 3000  # the replays and the live stream after them
            assert (copies, order) == (0, 0)

        run(main, timeout=100)
    finally:
        publisher.kill()
        publisher.wait()


@pytest.mark.timeout(120)
def test_the_group_account_moves_to_the_next_member_when_the_first_leaves(server: ServerProcess) -> None:
    """The group's backlog is counted on its first member's account (its teller); when that
    member leaves, the count moves to the next one, whose client is told it when the worker
    dies: the backlog, and what the member that left held unacknowledged (the group kept
    those for a redelivery it can no longer make), WORKER_RESTART, once."""

    async def main() -> None:
        async with broky.connect(server.url) as pub_client:
            assert pub_client.server_info is not None
            kps = partitions_by_worker(pub_client.server_info.map, 8)[0]  # worker 0's
            first_told, second_told = Tally(), Tally()
            opts: dict[str, Any] = {"reconnect_min_delay": 0.05}
            first = await broky.connect(server.url, on_loss=first_told.on_loss, **opts).__aenter__()
            second = await broky.connect(server.url, on_loss=second_told.on_loss, **opts).__aenter__()
            try:
                sub1 = await first.subscribe("gt.>", group="g", ack=True, max_in_flight=5)
                sub2 = await second.subscribe("gt.>", group="g", ack=True, max_in_flight=5)
                publisher = Publisher(pub_client, b"", 0)
                publisher.kps, publisher.sent, publisher.key = list(kps), [0] * len(kps), b"gt.x"
                await publisher.burst(100)
                held1 = [await sub1.next_msg(5) for _ in range(5)]
                held2 = [await sub2.next_msg(5) for _ in range(5)]
                assert len({(m.vbucket, m.offset) for m in held1 + held2}) == 10
                await first.close()  # the teller leaves: its 5 go back to the group, which keeps 95
                await second.flush()
                await asyncio.to_thread(kill_worker, server, 0)
                deadline = time.monotonic() + 20
                while second_told.told_count() < 95 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # anything told twice would arrive now
                assert second_told.told == [(95, LossReason.WORKER_RESTART)], second_told.told
                assert first_told.told == [] and second.stats.unacked_lost == 0
            finally:
                await first.close()
                await second.close()

    run(main, timeout=100)


@pytest.mark.timeout(120)
def test_what_a_group_keeps_in_vain_for_its_last_member_is_told_when_it_comes_back(
    server: ServerProcess,
) -> None:
    """The group's last member is cut off longer than ack_wait: the group keeps what it held
    and its backlog for ack_wait, for the member to come back, then drops them. They are
    lost for good with no member to tell: counted on the member's connection's account and
    told to its client when it comes back (CONNECTION_LOST), once (before: told nobody)."""
    proxy = FaultProxy(server.address).start()
    try:

        async def main() -> None:
            got = Tally()
            opts: dict[str, Any] = {"on_loss": got.on_loss, "reconnect_min_delay": 0.05}
            async with (
                broky.connect(server.url) as pub_client,
                broky.connect(proxy.address, **opts) as member,
            ):
                assert pub_client.server_info is not None
                kps = partitions_by_worker(pub_client.server_info.map, 8)[0]
                sub = await member.subscribe("go.>", group="g", ack=True, max_in_flight=5, ack_wait=1.0)
                publisher = Publisher(pub_client, b"", 0)
                publisher.kps, publisher.sent, publisher.key = list(kps), [0] * len(kps), b"go.x"
                await publisher.burst(25)
                held = [await sub.next_msg(5) for _ in range(5)]  # the other 20 wait in the backlog
                reconnects = member.stats.reconnects
                proxy.refuse(True)
                proxy.cut()
                await asyncio.sleep(2.5)  # past ack_wait: the group drops what it kept
                proxy.refuse(False)
                deadline = time.monotonic() + 20
                while member.stats.reconnects < reconnects + 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                while got.told_count() < 25 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                assert got.told == [(25, LossReason.CONNECTION_LOST)], got.told
                assert len(held) == 5 and member.stats.unacked_lost == 0

        run(main, timeout=100)
    finally:
        proxy.stop()
