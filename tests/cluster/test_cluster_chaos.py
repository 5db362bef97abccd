"""The cluster under faults, as SDK users see it (issue 26, findings 1, 3 and 4).

Short versions of bench/chaos.py's cluster scenarios: real etcd, three nodes
of two workers, an SDK publisher (a sequence number per key_partition in every
payload) and an SDK subscriber on `w.>`. Leases of 2 s keep them short.

- A frozen node (SIGSTOP of its master and workers) costs only its own
  vbuckets, and only until its lease expires and they move: before, the
  subscriber's MapApplied waited on round trips to the frozen node (a 10 s
  freeze never failed over), and at the commit the SDK fenced every new
  owner's traffic for 2 s, moved or not. One message delivered just before
  the freeze also came twice: the retired connection's last deliveries
  entered the duplicate filter only when the client had unconfirmed
  publishes of its own.
- A node killed and started again under its old id, before or after the
  leader moved its vbuckets, loses nothing silently.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

import broky
from bench import chaos
from bench.harness.cluster import ClusterRun
from bench.worker_kill import Load
from broky.protocol import vbucket_of


def check_promise(out: chaos.Outcome) -> str:
    summary = "\n".join(out.lines())
    assert out.published > 5_000, summary
    assert out.lost_not_in_flight == 0, summary  # published while a node was down: delivered
    assert out.untold <= 0, summary  # lost - told = 0
    assert out.duplicates == 0 and out.out_of_order == 0, summary
    assert out.publisher_flush_error is None, summary
    return summary


@pytest.mark.timeout(240)
def test_a_frozen_node_costs_only_its_own_vbuckets_until_they_move() -> None:
    # --move-timeout 4: an SDK that waited for the frozen node would let the leader
    # commit only after 4 s more, while the node is still frozen, and then fence the
    # new owners for the 2 s it gave the frozen node to answer.
    out = chaos.frozen_node(freezes=(10.0,), lease_ttl=2, node_args=("--move-timeout", "4"))
    summary = check_promise(out)
    (freeze,) = out.faults
    # Every key_partition of the frozen node is served again well before the SIGCONT:
    # its lease (2 s) and one move, not the move timeout, nor the end of the freeze.
    assert freeze["every_s"] is not None and freeze["every_s"] < 8.0, summary
    # The other key_partitions never wait for it (before: 2 s at the commit).
    assert freeze["others_max_gap_s"] < 1.5, summary
    assert out.unaccounted_notices >= 1, summary  # the subscriber was told the node went away


@pytest.mark.timeout(240)
def test_a_node_killed_and_started_again_under_its_id_loses_nothing_silently() -> None:
    # Started again 1-2 s after the kill: it registers again as soon as its old lease
    # (2 s) expires, often before the leader has moved its vbuckets away.
    out = chaos.node_kill_loop(minutes=0.5, every=10.0, down=(1.0, 2.0), lease_ttl=2)
    check_promise(out)
    assert len(out.faults) >= 2


@pytest.mark.timeout(240)
def test_a_subscriber_not_in_place_when_a_move_times_out_is_told_and_gets_it_replayed() -> None:
    """A move commits after --move-timeout without the MapApplied of a subscriber that
    is stopped (SIGSTOP) meanwhile: its subscriptions reach the new owner only once it
    runs again. The subscriber is told (UNACCOUNTED) when it adopts a map whose moves it
    did not say it was ready for; and since the new owner continues the sequences of the
    vbuckets it took (same epoch, next offset), the SDK subscribes there `since` what the
    old owners delivered (broky.client.link `carry_from`): what the new owner routed
    before is replayed from its buffer, and nothing is lost (before issue 22 it was)."""
    cluster = ClusterRun(2, 2, "--move-timeout", "2", keep_ports=True)
    load: Load | None = None
    try:
        cluster.start("a")
        cluster.start("b")
        cluster.wait_settled()
        load = Load(cluster.seeds("a"), cluster.seeds("b"), rate=2000, partitions=200)
        time.sleep(1.0)
        os.kill(load.sub.pid, signal.SIGSTOP)
        stopped_at = time.time()
        cluster.start("c")  # joins: its share is prepared, then committed after the move timeout
        cluster.wait_settled()
        time.sleep(1.0)
        os.kill(load.sub.pid, signal.SIGCONT)
        time.sleep(3.0)
        published, subscribed = load.finish()
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
    out = chaos.analyse(
        "move timeout", published, subscribed, 200, 2000, [{"what": "stop", "time": stopped_at}]
    )
    summary = "\n".join(out.lines())
    # what c routed before the subscriber's subscriptions were there: replayed
    assert out.lost == 0, summary
    assert out.unaccounted_notices >= 1, summary
    assert out.untold <= 0, summary
    assert out.duplicates == 0 and out.out_of_order == 0, summary


@pytest.mark.timeout(180)
def test_copies_of_what_a_frozen_node_delivered_are_dropped_for_a_pure_subscriber() -> None:
    """Finding 3: a publisher sends again, with their uids, the publishes a frozen node
    delivered but never confirmed; the subscriber (which publishes nothing) must drop
    the copies. Its retired connection's last deliveries used to enter the duplicate
    filter only when it had unconfirmed publishes of its own, so they reached the
    application twice. Made certain here: the publisher confirms rarely, so all its
    publishes to the frozen node are unconfirmed when it freezes."""
    cluster = ClusterRun(2, 2, keep_ports=True)
    try:
        cluster.start("a")
        cluster.start("b")
        cluster.wait_settled()
        vmap = cluster.map()
        b = vmap.node_index("b")
        kps = [k for k in (b"kp-%d" % i for i in range(2000)) if vmap.owners[vbucket_of(k)][0] == b][:200]
        firsts = list({vmap.owners[vbucket_of(k)]: k for k in kps}.values())  # one per worker of b
        seed = cluster.seeds("a")

        async def run() -> tuple[list[bytes], broky.ClientStats]:
            got: list[bytes] = []
            async with (
                broky.connect(seed) as sub_client,
                broky.connect(seed, confirm_interval=60.0, ping_interval=None) as pub,
            ):
                await sub_client.subscribe("f.>", callback=lambda m: got.append(m.payload))
                for kp in firsts:  # the first write to each worker of b carries the one Ping
                    await pub.publish("f.x", b"first", partition=kp)
                await pub.flush()
                for i, kp in enumerate(kps):
                    await pub.publish("f.x", b"%d" % i, partition=kp)  # written, delivered, never confirmed
                await wait_until(lambda: len(got) == len(kps) + len(firsts), 10.0)
                pids = cluster.pids("b")
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)  # b owned every one of them
                try:
                    # b's lease (2 s) expires, its vbuckets move to a, and the publisher
                    # sends its unconfirmed publishes again to a, with their uids.
                    await wait_until(lambda: pub.stats.resent_after_loss >= len(kps), 30.0)
                    await asyncio.sleep(1.0)
                finally:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                return got, sub_client.stats

        got, stats = asyncio.run(run())
        assert sorted(got) == sorted([b"first"] * len(firsts) + [b"%d" % i for i in range(len(kps))])
        assert stats.duplicates_dropped == len(kps)  # every copy arrived, and was dropped
    finally:
        cluster.stop()


async def wait_until(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.02)
