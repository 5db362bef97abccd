"""Positions across the cluster's moves: real etcd, real nodes, SDK clients in this process.

A planned move (a node joins, a node drains) keeps each vbucket's sequence:
its new owner goes on with the same epoch and the next offset, which the old
owner hands over through etcd (broky.server.shard.moves). A node that dies
cannot: its vbuckets start new epochs at their new owners. What a subscriber
sees of both, with an SDK publisher over many key_partitions (a sequence
number per key_partition in every payload) and an SDK subscriber on `w.>`:

- join and drain under load: every message once, nothing told lost, one
  epoch per vbucket before and after, consecutive offsets across each move;
  then a new client resuming from positions taken before the moves gets what
  the current owners retain after them, and EVICTED with the exact count for
  what only the old owners had (retained messages are not copied between
  nodes, and a subscription reads each vbucket at its owner);
- a node SIGKILLed: the vbuckets it owned have new epochs at their new
  owners (at once: the commit no longer lists it), the others keep theirs,
  and a client resuming from positions taken before is told EPOCH_CHANGED.

Leases of 2 s and moves committed within 4 s keep it short; every process is
stopped by pid (tests/support/cluster.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest

import broky
from broky.client.link import WorkerRef
from broky.protocol import LossReason, Message, VBucketMap, vbucket_of
from broky.protocol.frames import Position
from tests.support.cluster import Cluster, owners_by_id

PARTITIONS = 128
KPS = [b"kp-%d" % i for i in range(PARTITIONS)]
RATE = 2000  # msgs/s


class Received:
    """What one subscription received, and the losses its client was told of."""

    def __init__(self) -> None:
        self.msgs: list[tuple[int, int, int, bytes, int]] = []  # vbucket, epoch, offset, kp, seq
        self.losses: list[tuple[WorkerRef, int, int]] = []

    def message(self, m: Message) -> None:
        self.msgs.append((m.vbucket, m.epoch, m.offset, m.key_partition, int(m.payload)))

    def loss(self, ref: WorkerRef, dropped: int, reason: int) -> None:
        self.losses.append((ref, dropped, reason))

    def told(self, reason: int) -> list[tuple[WorkerRef, int, int]]:
        return [loss for loss in self.losses if loss[2] == reason]

    def counted(self, reason: int) -> int:
        """The summed counts of the notices of `reason`."""
        return sum(dropped for _, dropped, _ in self.told(reason))

    def epochs(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = defaultdict(set)
        for vb, epoch, _, _, _ in self.msgs:
            out[vb].add(epoch)
        return out


class Publisher:
    """Publishes round-robin over KPS at RATE until stopped; the count per key_partition."""

    def __init__(self, client: broky.Client) -> None:
        self.client = client
        self.sent = [0] * PARTITIONS
        self.running = True

    async def burst(self, n: int = 1) -> None:
        """n messages to every key_partition."""
        for _ in range(n):
            for i, kp in enumerate(KPS):
                await self.client.publish("w.x", b"%d" % self.sent[i], partition=kp)
                self.sent[i] += 1
        await self.client.flush()

    async def run(self) -> None:
        i = 0
        while self.running:
            for _ in range(RATE // 100):
                kp = i % PARTITIONS
                await self.client.publish("w.x", b"%d" % self.sent[kp], partition=KPS[kp])
                self.sent[kp] += 1
                i += 1
            await asyncio.sleep(0.01)

    def total(self) -> int:
        return sum(self.sent)


async def until(
    check: Callable[[], bool], timeout: float, what: str, detail: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what} ({detail()})"
        await asyncio.sleep(0.05)


def assert_exactly_once(rec: Received, pub: Publisher) -> None:
    got = Counter((kp, seq) for _, _, _, kp, seq in rec.msgs)
    sent = {(kp, seq) for i, kp in enumerate(KPS) for seq in range(pub.sent[i])}
    assert set(got) == sent, f"missing {len(sent - set(got))}, stray {len(set(got) - sent)}"
    assert max(got.values()) == 1, f"{sum(n - 1 for n in got.values())} delivered twice"


def offsets_by_vbucket(rec: Received) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for vb, _, offset, _, _ in rec.msgs:
        out[vb].append(offset)
    return out


def owners_changed(before: VBucketMap, after: VBucketMap) -> set[int]:
    return {vb for vb, (a, b) in enumerate(zip(owners_by_id(before), owners_by_id(after))) if a != b}


def totals(cluster: Cluster, *node_ids: str) -> dict[str, int]:
    out: Counter[str] = Counter()
    for node_id in node_ids:
        t = cluster.stats(node_id)["totals"]
        out.update({k: t[k] for k in ("vbuckets_handed_over", "vbuckets_continued", "vbuckets_restarted")})
    return dict(out)


@pytest.mark.timeout(150)
def test_a_join_and_a_drain_under_load_keep_every_sequence_and_a_resume_is_told_exactly(
    cluster: Cluster,
) -> None:
    cluster.start("a")
    cluster.start("b")
    cluster.wait_settled()
    first_map = cluster.history()[-1]
    seed = f"{cluster.nodes['a'].host}:{cluster.nodes['a'].port}"
    handed: dict[str, dict[str, int]] = {}

    async def main() -> tuple[Received, Publisher, list[Position], broky.ClientStats, Received]:
        rec = Received()
        async with (
            broky.connect(seed, on_loss=rec.loss) as sub_client,
            broky.connect(seed) as pub_client,
        ):
            sub = await sub_client.subscribe("w.>", callback=rec.message)
            pub = Publisher(pub_client)
            await pub.burst()  # every key_partition's vbucket has a position before the moves
            await until(lambda: len(rec.msgs) == pub.total(), 10, "the first burst")
            before, since_time = sub.positions(), time.time_ns()
            load = asyncio.create_task(pub.run())
            await asyncio.to_thread(cluster.start, "c")  # joins under load
            await asyncio.to_thread(cluster.wait_settled)
            await asyncio.sleep(1.0)
            handed["after join"] = await asyncio.to_thread(totals, cluster, "a", "b", "c")
            assert await asyncio.to_thread(cluster.leave, "b") == 0  # drains under load
            await asyncio.to_thread(cluster.wait_settled)
            await asyncio.sleep(0.5)
            pub.running = False
            await load
            await pub_client.flush()
            await until(lambda: len(rec.msgs) >= pub.total(), 20, "every message")
            await asyncio.sleep(0.3)  # anything delivered twice would arrive now
            stats = sub_client.stats
            # A new client resumes from the positions taken before the moves.
            again = Received()
            async with broky.connect(seed, on_loss=again.loss) as resumed:
                await resumed.subscribe("w.>", callback=again.message, since=before, since_time=since_time)
                await until(
                    lambda: len(again.msgs) + again.counted(LossReason.EVICTED) >= pub.total() - PARTITIONS,
                    20,
                    "the resume",
                    lambda: (len(again.msgs), pub.total(), again.losses, resumed.stats),
                )
            return rec, pub, before, stats, again

    rec, pub, before, stats, again = asyncio.run(main())
    final_map = cluster.history()[-1]
    moved = owners_changed(first_map, final_map)
    used = {vbucket_of(kp) for kp in KPS}
    assert len(moved & used) > 20, sorted(moved & used)  # both moves moved vbuckets under load

    # The subscriber: every message once, nothing told lost, and the sequences went on.
    assert_exactly_once(rec, pub)
    assert rec.losses == [] and stats.unaccounted == 0
    for vb, epochs in rec.epochs().items():
        assert len(epochs) == 1, f"vbucket {vb} ({'moved' if vb in moved else 'stayed'}): epochs {epochs}"
    # Consecutive offsets from 1 in every vbucket, across the moves; a gap only for a copy
    # the SDK dropped by uid (a draining node's Goodbye destroyed by a reset, rare: see
    # tests/cluster/test_cluster_sdk.py; the publisher then sent again what it had not confirmed).
    gaps = 0
    for vb, offsets in offsets_by_vbucket(rec).items():
        assert len(set(offsets)) == len(offsets), f"vbucket {vb}: an offset twice"
        gaps += max(offsets) - len(offsets)
    assert gaps == stats.duplicates_dropped, (gaps, stats.duplicates_dropped)
    after = totals(cluster, "a", "c")
    assert after["vbuckets_restarted"] == 0 and handed["after join"]["vbuckets_restarted"] == 0, (
        handed,
        after,
    )
    assert after["vbuckets_continued"] >= len(moved), (after, len(moved))  # both moves, on the nodes left

    # The resume: per vbucket, what its current owner retains after the position, in order
    # (a tail of what followed it), and EVICTED with the count of the rest: what only an
    # old owner had (nothing is copied between nodes; a subscription starts at the owner, and
    # the old owner's retained messages are for a bounded Read that names the vbucket:
    # tests/cluster/test_cluster_former_reads.py).
    assert {r for _, _, r in again.losses} == {LossReason.EVICTED}, again.losses
    start = {p.vbucket: p.offset for p in before}
    full = offsets_by_vbucket(rec)
    replayed = offsets_by_vbucket(again)
    missing = 0
    for vb, offsets in full.items():
        wanted = sorted(o for o in offsets if o > start[vb])
        got = replayed.get(vb, [])
        assert got == wanted[len(wanted) - len(got) :], f"vbucket {vb}: not a tail of what followed"
        missing += len(wanted) - len(got)
        if vb not in moved:
            assert got == wanted, f"vbucket {vb} never moved, yet {len(wanted) - len(got)} were not replayed"
    assert missing > 0 and again.counted(LossReason.EVICTED) == missing, (missing, again.losses)
    assert Counter((kp, seq) for _, _, _, kp, seq in again.msgs).most_common(1)[0][1] == 1


@pytest.mark.timeout(120)
def test_a_killed_node_s_vbuckets_start_new_epochs_and_a_resume_is_told(cluster: Cluster) -> None:
    for node_id in ("a", "b", "c"):
        cluster.start(node_id)
    cluster.wait_settled()
    vmap = cluster.history()[-1]
    c = vmap.node_index("c")
    seed = f"{cluster.nodes['a'].host}:{cluster.nodes['a'].port}"
    of_c = {vbucket_of(kp) for kp in KPS if vmap.owners[vbucket_of(kp)][0] == c}

    async def main() -> tuple[Received, dict[int, set[int]], dict[str, int], Received]:
        rec = Received()
        async with (
            broky.connect(seed, on_loss=rec.loss) as sub_client,
            broky.connect(seed) as pub_client,
        ):
            sub = await sub_client.subscribe("w.>", callback=rec.message)
            pub = Publisher(pub_client)
            await pub.burst(2)
            await until(lambda: len(rec.msgs) == pub.total(), 10, "the first bursts")
            before, epochs = sub.positions(), rec.epochs()
            baseline = await asyncio.to_thread(totals, cluster, "a", "b")
            started = time.monotonic()
            await asyncio.to_thread(cluster.kill, "c")
            await asyncio.to_thread(cluster.wait_settled)
            assert time.monotonic() - started < 15
            rec.msgs.clear()
            await pub.burst(2)
            await until(lambda: len(rec.msgs) == 2 * PARTITIONS, 10, "the bursts after the kill")
            again = Received()
            async with broky.connect(seed, on_loss=again.loss) as resumed:
                await resumed.subscribe("w.>", callback=again.message, since=before)
                await until(lambda: len(again.msgs) >= 2 * PARTITIONS, 10, "the resume")
                await asyncio.sleep(0.2)
            return rec, epochs, baseline, again

    rec, before, baseline, again = asyncio.run(main())
    assert len(of_c) > 10
    now = rec.epochs()
    for vb, epochs in now.items():
        assert len(epochs) == 1
        if vb in of_c:  # taken over without its history: a new epoch, from offset 1
            assert epochs != before[vb], f"vbucket {vb} of the killed node kept its epoch"
        else:
            assert epochs == before[vb], f"vbucket {vb} changed epoch though its owner lived"
    for vb, offsets in offsets_by_vbucket(rec).items():
        if vb in of_c:
            assert sorted(offsets) == list(range(1, len(offsets) + 1)), f"vbucket {vb}: {sorted(offsets)}"
    left = totals(cluster, "a", "b")
    owned_by_c = sum(1 for node, _ in vmap.owners if node == c)
    assert left["vbuckets_restarted"] - baseline["vbuckets_restarted"] == owned_by_c, (baseline, left)
    assert left["vbuckets_continued"] == baseline["vbuckets_continued"], (baseline, left)
    # Resuming from before the kill: the new epochs from their first offset, and told of the
    # old ones' end (EPOCH_CHANGED, count unknown); the others go on where they were.
    changed = again.told(LossReason.EPOCH_CHANGED)
    assert changed and all(d == 0 for _, d, _ in changed), again.losses
    assert {ref.node_id for ref, _, _ in changed} <= {"a", "b"}
    assert sorted((vb, o) for vb, _, o, _, _ in again.msgs) == sorted((vb, o) for vb, _, o, _, _ in rec.msgs)


def test_a_subscription_that_reaches_a_new_owner_late_asks_since_what_the_old_one_delivered() -> None:
    """The SDK's side, without a cluster: a subscription the old owner's Link carried,
    not started at the new owner, is sent there `since` the old Link's positions of the
    moved vbuckets received after it started there, and `since_time` that start
    (broky.client.link `carry_from`); one that started there, or a new one, is not."""
    from types import SimpleNamespace

    from broky.client.link import Link
    from broky.client.stats import ClientStats
    from broky.client.subscription import Subscription

    owner: Any = SimpleNamespace(stats=ClientStats())  # only a Subscription's queue counts on it here
    old, new = Link(owner, "a", 0), Link(owner, "c", 0)
    moved = Subscription(owner, 1, b"w.>", None, None, 10, 10)
    scoped_elsewhere = Subscription(owner, 2, b"w.>", b"kp", None, 10, 10)
    fresh = Subscription(owner, 3, b"w.>", None, None, 10, 10, since_time=77)
    for sub in (moved, scoped_elsewhere, fresh):
        old.subs[sub.sid] = sub
    moved.starts[old.ref] = scoped_elsewhere.starts[old.ref] = 1_000
    for vb, epoch, offset, ts in ((5, 7, 42, 2_000), (6, 7, 9, 500)):  # vb 6: before it started
        old.pos_epoch[vb], old.pos_offset[vb], old.pos_ts[vb] = epoch, offset, ts
    new.carry_from(old, {5, 6, 7})
    first = new.resume_subscribe(moved)
    assert (first.since, first.since_time) == ((Position(5, 7, 42),), 1_000)
    assert vbucket_of(b"kp") not in {5, 6, 7} and scoped_elsewhere.sid not in new.carried
    assert new.resume_subscribe(fresh).since_time == 77  # made after: as asked
    new.started(new.next_ping + 1, 5_000)  # a Pong: it started at the new owner
    assert new.carried == {} and new.resume_subscribe(moved).since_time == 5_000
