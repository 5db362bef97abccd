"""Consumer groups and acknowledgements from the SDK and the CLI against a real
`broky serve` (2 workers): shared work, key-shared order, ack, nack,
in_progress, max_deliveries with a dead letter, pauses, and what a worker
restart does to unacked deliveries. The same SDK paths without a server are in
tests/client/test_client_groups.py; the server's own tests of groups are beside it.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import broky
from broky.client.groups import GroupMessage
from broky.errors import ErrorCode, ServerError
from broky.protocol import LossReason, Message
from tests.support.cli import SubProcess, broky_cli
from tests.support.faultproxy import FaultProxy
from tests.support.sdk import partitions_by_worker
from tests.support.serverproc import ServerProcess, kill_worker

_seq = struct.Struct(">II")  # key_partition index, sequence number within it


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 60) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(main())


async def publish(server: ServerProcess, n: int, partitions: int = 64, key: str = "jobs.run") -> None:
    """n messages over `partitions` key_partitions, each carrying (partition, its number there)."""
    sent = [0] * partitions
    async with broky.connect(server.url, name="publisher") as publisher:
        for i in range(n):
            k = i % partitions
            await publisher.publish(key, _seq.pack(k, sent[k]), partition=b"kp-%d" % k)
            sent[k] += 1
        await publisher.flush()


async def until(check: Callable[[], bool], timeout: float = 15, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.02)


def test_two_members_on_two_clients_share_the_messages_exactly_once(server: ServerProcess) -> None:
    """10,000 messages, a group of two members on two clients: each message reaches one of
    them, once; a plain subscription on the first member's client still gets every one."""
    n = 10_000

    async def main() -> None:
        got: dict[str, list[Message]] = {"a": [], "b": [], "plain": []}
        async with broky.connect(server.url, name="a") as a, broky.connect(server.url, name="b") as b:
            await a.subscribe("jobs.>", group="work", callback=got["a"].append)
            await a.subscribe("jobs.>", callback=got["plain"].append)
            await b.subscribe("jobs.>", group="work", callback=got["b"].append)
            await publish(server, n)
            await until(lambda: len(got["a"]) + len(got["b"]) >= n and len(got["plain"]) >= n, what=str(got))
            await asyncio.sleep(0.3)  # anything more (a copy) would come now
            shared = [_seq.unpack(m.payload) for m in got["a"] + got["b"]]
            assert len(shared) == n and len(set(shared)) == n  # each once, none twice
            assert {_seq.unpack(m.payload) for m in got["plain"]} == set(shared) and len(got["plain"]) == n
            assert all(isinstance(m, GroupMessage) and m.delivery_count == 1 for m in got["a"] + got["b"])
            assert not any(isinstance(m, GroupMessage) for m in got["plain"])
            # both work: neither is starved (the balance itself is the server's tests' and bench's)
            assert min(len(got["a"]), len(got["b"])) > n // 10, (len(got["a"]), len(got["b"]))
            assert a.stats.group_received == len(got["a"]) and a.stats.redeliveries == 0

    run(main)


def test_a_key_shared_group_keeps_each_key_partition_on_one_member_in_offset_order(
    server: ServerProcess,
) -> None:
    n = 6_000

    async def main() -> None:
        got: dict[str, list[Message]] = {"a": [], "b": []}
        async with broky.connect(server.url) as a, broky.connect(server.url) as b:
            await a.subscribe("jobs.>", group="ordered", key_shared=True, callback=got["a"].append)
            await b.subscribe("jobs.>", group="ordered", key_shared=True, callback=got["b"].append)
            await publish(server, n)
            await until(lambda: len(got["a"]) + len(got["b"]) >= n)
            owner: dict[bytes, str] = {}
            for name, msgs in got.items():
                seen: dict[bytes, list[int]] = {}
                for m in msgs:
                    assert owner.setdefault(m.key_partition, name) == name  # one member per key_partition
                    seen.setdefault(m.key_partition, []).append(m.offset)
                for kp, offsets in seen.items():
                    assert offsets == sorted(offsets), kp  # publish (offset) order
                    numbers = [_seq.unpack(m.payload)[1] for m in msgs if m.key_partition == kp]
                    assert numbers == list(range(len(numbers))), kp
            assert len(owner) == 64 and set(owner.values()) == {"a", "b"}  # spread over both

    run(main)


def test_ack_nack_in_progress_and_ack_wait_round_trips(server: ServerProcess) -> None:
    async def main() -> None:
        losses: list[tuple[int, int]] = []
        async with broky.connect(server.url, on_loss=lambda ref, n, why: losses.append((n, why))) as client:
            assert client.server_info is not None
            kp = partitions_by_worker(client.server_info.map, 1)[0][0]
            sub = await client.subscribe(
                "acks.>", group="g", ack=True, ack_wait=1.0, backoff=(0.3,), max_deliveries=5
            )
            for i in range(4):
                await client.publish("acks.k", b"%d" % i, partition=kp)
            await client.flush()
            first = {int(m.payload): m for m in [await sub.next_msg(5) for _ in range(4)]}
            assert all(m.delivery_count == 1 for m in first.values()) and sub.in_flight == 4
            first[0].ack()  # done
            first[1].nack()  # again after the backoff (0.3 s)
            started = time.monotonic()
            first[2].in_progress()  # kept past ack_wait by in_progress every 0.4 s
            # 3: not settled: again after ack_wait (1 s)
            assert sub.in_flight == 2
            again = await sub.next_msg(2)
            assert (int(again.payload), again.delivery_count) == (1, 2)
            assert 0.2 < time.monotonic() - started < 0.9
            again.ack()
            seen: list[GroupMessage] = []
            while time.monotonic() - started < 1.6:
                first[2].in_progress()
                try:
                    seen.append(await sub.next_msg(0.4))
                except broky.BrokyTimeoutError:
                    pass
            assert [(int(m.payload), m.delivery_count) for m in seen] == [(3, 2)]  # ack_wait passed
            first[2].ack()
            seen[0].ack()
            with pytest.raises(broky.BrokyTimeoutError):  # nothing more: every one is acked
                await sub.next_msg(1.5)
            assert sub.in_flight == 0 and losses == []
            stats = client.stats
            assert (stats.acks_sent, stats.nacks_sent, stats.redeliveries) == (4, 1, 2)
            assert stats.in_progress_sent >= 3

    run(main)


def test_max_deliveries_drops_tells_and_publishes_to_the_dead_letter(server: ServerProcess) -> None:
    async def main() -> None:
        losses: list[tuple[int, int]] = []
        async with broky.connect(server.url, on_loss=lambda ref, n, why: losses.append((n, why))) as client:
            dead = await client.subscribe("dead.>")
            sub = await client.subscribe(
                "work.>", group="g", ack=True, max_deliveries=3, dead_letter="dead.work"
            )
            await client.publish("work.k", b"poison", partition=b"kp-1")
            counts = []
            for _ in range(3):
                msg = await sub.next_msg(5)
                counts.append(msg.delivery_count)
                msg.nack(delay=0)
            assert counts == [1, 2, 3]
            letter = await dead.next_msg(5)
            assert (letter.key, letter.key_partition, letter.payload) == (b"dead.work", b"kp-1", b"poison")
            await until(lambda: (1, LossReason.MAX_DELIVERIES) in losses, what=str(losses))
            with pytest.raises(broky.BrokyTimeoutError):
                await sub.next_msg(0.5)

    run(main)


def test_a_member_at_max_in_flight_is_paused_and_told(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as client:
            assert client.server_info is not None
            kp = partitions_by_worker(client.server_info.map, 1)[0][0]
            sub = await client.subscribe("flow.>", group="g", ack=True, max_in_flight=5)
            for i in range(20):
                await client.publish("flow.k", b"%d" % i, partition=kp)
            await client.flush()
            held = [await sub.next_msg(5) for _ in range(5)]
            await until(lambda: sub.paused_by_server, what="PAUSED")
            assert client.stats.group_paused >= 1 and sub.in_flight == 5
            with pytest.raises(broky.BrokyTimeoutError):  # the worker holds the rest
                await sub.next_msg(0.3)
            for msg in held:
                msg.ack()
            rest: list[int] = []
            while len(rest) < 15:
                msg = await sub.next_msg(5)
                rest.append(int(msg.payload))
                msg.ack()
            assert sorted(rest) == list(range(5, 20))
            await until(lambda: not sub.paused_by_server, what="RESUMED")

    run(main)


def test_bad_group_refuses_a_member_whose_settings_differ(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url) as a, broky.connect(server.url) as b:
            await a.subscribe("x.>", group="g", ack=True)
            with pytest.raises(ServerError) as refused:
                await b.subscribe("x.>", group="g")  # without ack
            assert refused.value.code == ErrorCode.BAD_GROUP
            await b.flush()
            assert b.stats.errors == 0  # raised by subscribe: not also reported (told once)
            await b.subscribe("x.>", group="other")  # another group: fine

    run(main)


def test_a_worker_restart_tells_only_the_nacks_it_cannot_redeliver(server: ServerProcess) -> None:
    """The member holds 6 unacknowledged deliveries when its worker dies: they are in its
    hands, not lost (an ACK of them is dropped); a NACK of one is (nobody redelivers it)."""

    async def main() -> None:
        losses: list[tuple[int, int]] = []
        options: dict[str, Any] = {
            "on_loss": lambda ref, n, why: losses.append((n, why)),
            "reconnect_min_delay": 0.05,
            "reconnect_max_delay": 0.2,
        }
        async with broky.connect(server.url, **options) as client:
            assert client.server_info is not None
            kp = partitions_by_worker(client.server_info.map, 1)[0][0]
            sub = await client.subscribe("r.>", group="g", ack=True)
            for i in range(10):
                await client.publish("r.k", b"%d" % i, partition=kp)
            await client.flush()
            got = [await sub.next_msg(5) for _ in range(10)]
            for msg in got[:4]:
                msg.ack()
            await client.flush()  # the 4 acks reached the worker
            worker = client.server_info.map.owners[got[0].vbucket][1]
            reconnects = client.stats.reconnects
            await asyncio.to_thread(kill_worker, server, worker)
            await until(lambda: client.stats.reconnects > reconnects, what="the reconnect")
            await client.flush()
            assert losses == [] and client.stats.unacked_lost == 0 and sub.in_flight == 6
            dropped = client.stats.acks_dropped
            got[5].ack()  # for a worker process that is gone: dropped, nothing lost
            got[6].nack()  # a redelivery nobody can make: lost, told
            await until(lambda: (1, LossReason.UNACKED_LOST) in losses, what=str(losses))
            assert client.stats.acks_dropped == dropped + 1 and client.stats.unacked_lost == 1
            assert sub.in_flight == 4
            # the restarted worker delivers to the member again (it subscribed again)
            await client.publish("r.k", b"after", partition=kp)
            msg = await sub.next_msg(10)
            assert msg.payload == b"after" and msg.delivery_count == 1
            msg.ack()

    run(main, timeout=90)


def test_a_cut_to_a_live_worker_loses_no_ack(server: ServerProcess) -> None:
    """A member's connection is cut and comes back to the same worker process: nothing is
    told lost, what it settled while down is sent after it subscribed again, and what it
    had not settled comes back (the group kept it for the member: it was the last one)."""
    proxy = FaultProxy(server.address).start()
    try:

        async def main() -> None:
            losses: list[tuple[int, int]] = []
            options: dict[str, Any] = {
                "on_loss": lambda ref, n, why: losses.append((n, why)),
                "reconnect_min_delay": 0.05,
                "reconnect_max_delay": 0.2,
            }
            async with (
                broky.connect(proxy.address, **options) as client,
                broky.connect(server.url) as publisher,
            ):
                sub = await client.subscribe("cut.>", group="g", ack=True, ack_wait=5.0)
                for i in range(5):
                    await publisher.publish("cut.k", b"%d" % i, partition=b"kp-1")
                await publisher.flush()
                got = [await sub.next_msg(5) for _ in range(5)]
                proxy.refuse(True)
                proxy.cut()
                await until(lambda: all(link.proto is None for link in client.router.links.values()))
                got[0].ack()  # while down: kept for the reconnect
                got[1].ack()
                proxy.refuse(False)
                again: dict[int, GroupMessage] = {}
                while len(again) < 3:
                    msg = await sub.next_msg(5)
                    if int(msg.payload) >= 2:
                        assert msg.delivery_count == 2
                        again[int(msg.payload)] = msg
                    msg.ack()  # (0 and 1 may come back before their acks reached the group)
                assert sorted(again) == [2, 3, 4]
                for msg in got[2:]:
                    msg.ack()  # the first copies: settled already, nothing more
                await client.flush()
                with pytest.raises(broky.BrokyTimeoutError):
                    await sub.next_msg(1.0)
                assert losses == [] and client.stats.unacked_lost == 0 and sub.in_flight == 0
                assert client.stats.acks_dropped == 0

        run(main)
    finally:
        proxy.stop()


def test_the_blocking_client_acks_from_its_thread(server: ServerProcess) -> None:
    with broky.connect_sync(server.url) as client:
        sub = client.subscribe("sync.>", group="g", ack=True, ack_wait=1.0)
        for i in range(100):
            client.publish("sync.k", b"%d" % i, partition=b"kp-%d" % (i % 8))
        client.flush()
        got = [int(m.payload) for m in _ack_all(sub.iter(timeout=5, count=100))]
        assert sorted(got) == list(range(100))
        assert list(sub.iter(timeout=1.5)) == []  # acked: nothing comes again after ack_wait
        assert sub.in_flight == 0 and client.stats.acks_sent == 100


def _ack_all(msgs: Any) -> Any:
    for msg in msgs:
        msg.ack()
        yield msg


def test_cli_members_share_the_messages_and_ack(server: ServerProcess) -> None:
    n = 200
    members = [
        SubProcess("cli.>", "--group", "g", "--ack", "--json", "--server", server.url) for _ in range(2)
    ]
    try:
        pub = broky_cli("pub", "cli.k", "--server", server.url, stdin=b"".join(b"%d\n" % i for i in range(n)))
        assert pub.returncode == 0, pub.stderr
        time.sleep(2.0)
        records = []
        for member in members:
            member.proc.terminate()
            out, _ = member.proc.communicate(timeout=10)
            records += [json.loads(line) for line in out.splitlines()]
        assert sorted(int(r["payload"]) for r in records) == list(range(n))
        assert {r["delivery_count"] for r in records} == {1}
    finally:
        for member in members:
            member.kill()


HOARDER = """
import asyncio, sys
import broky

async def main() -> None:
    async with broky.connect(sys.argv[1], name="hoarder") as client:
        got = 0
        sub = await client.subscribe("jobs.>", group="workers", ack=True, max_in_flight=5000)
        print("ready", flush=True)
        async for _ in sub:  # never acks
            got += 1
            if got == 1000:
                print("holding 1000", flush=True)

asyncio.run(main())
"""


def test_a_member_sigkilled_with_1000_unacked_hands_them_all_to_the_others(server: ServerProcess) -> None:
    """A member process takes 1,000 messages and never acks; SIGKILLed, its connections
    close and the worker hands every one of them to the live members: none lost, none
    delivered twice to a live member."""
    import os
    import signal
    import subprocess
    import sys

    hoarder = subprocess.Popen(
        [sys.executable, "-c", HOARDER, server.url], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert hoarder.stdout is not None
        assert hoarder.stdout.readline().strip() == "ready"

        async def body() -> None:
            await publish(server, 1000)
            assert await asyncio.to_thread(hoarder.stdout.readline) == "holding 1000\n"  # type: ignore[union-attr]
            got: list[list[GroupMessage]] = [[], []]
            async with broky.connect(server.url) as a, broky.connect(server.url) as b:
                for client, sink in ((a, got[0]), (b, got[1])):

                    def take(msg: GroupMessage, sink: list[GroupMessage] = sink) -> None:
                        sink.append(msg)
                        msg.ack()

                    await client.subscribe("jobs.>", group="workers", ack=True, callback=take)
                os.killpg(hoarder.pid, signal.SIGKILL)
                await until(lambda: sum(map(len, got)) >= 1000, what="the hoarder's 1,000 redelivered")
                await asyncio.sleep(0.5)  # anything more would be a copy
            seqs = [_seq.unpack(m.payload) for sink in got for m in sink]
            assert len(seqs) == len(set(seqs)) == 1000, "lost or delivered twice"
            assert all(m.delivery_count == 2 for sink in got for m in sink)
            print(f"redelivered after SIGKILL: {[len(s) for s in got]}")
            assert min(map(len, got)) > 0

        run(body)
    finally:
        if hoarder.poll() is None:
            os.killpg(hoarder.pid, signal.SIGKILL)
        hoarder.wait(5)
        if hoarder.stdout is not None:
            hoarder.stdout.close()
