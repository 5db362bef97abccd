"""The cluster as SDK users see it: real etcd, real nodes, SDK publisher and subscriber processes.

The load is bench.worker_kill's (its Load: its client processes):
an SDK publisher at a steady rate over many key_partitions, a sequence number
per key_partition in every payload, and an SDK subscriber on `w.>`, each
given a different node as its seed. Leases of 2 s and moves committed after
4 s at most keep the tests short; bench/cluster_failover.py runs the failover
with the defaults and ten kills.

"Nothing lost" is checked key_partition by key_partition (each one's
sequence numbers, every one, once, ascending), what arrived is counted by
the subscriber's callback and by its SDK and compared with the publisher's
count, and the copies the SDK's duplicate filter dropped are counted too: a
server that delivered twice would otherwise pass as "no duplicates".
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from bench.cluster_drain import MapWatch, drain_once
from bench.cluster_failover import Result, analyse, run
from bench.harness.cluster import ClusterRun, agreed
from bench.worker_kill import Load
from broky.protocol import VBucketMap
from tests.support import requires
from tests.support.cluster import (
    assert_every_move_prepared,
    assert_versions_grow,
    map_history,
    moved_between,
    moving,
    owners_by_id,
    wait_for,
)

LEASE_TTL = 2


@pytest.fixture
def cluster() -> Iterator[ClusterRun]:
    requires.program("etcd")
    c = ClusterRun(2, LEASE_TTL, "--move-timeout", "4")
    yield c
    c.stop()


def finish(load: Load, partitions: int) -> Result:
    published, subscribed = load.finish()
    return analyse(published, subscribed, partitions, [])


def assert_nothing_lost(result: Result, resends: bool = False) -> None:
    """Nothing lost, nothing twice, in order; `resends`: the publisher may have sent some
    publishes again (a connection lost without an account), the subscriber dropping at
    most that many copies."""
    summary = f"{result}"
    assert result.lost == 0 and result.told == 0, summary  # on every key_partition (sums of counts)
    # counted, not derived from the sequences: the callback's count, the SDK's, the publisher's
    assert result.received == result.subscriber_sdk_delivered == result.published, summary
    assert result.duplicates == 0 and result.out_of_order == 0, summary
    assert result.stray == 0 and result.corrupt == 0, summary
    # a copy the SDK's filter dropped that no publisher sent twice would be a double delivery
    if resends:
        assert result.subscriber_duplicates_dropped <= result.publisher_resent_after_loss, summary
    else:
        assert result.subscriber_duplicates_dropped == 0 == result.publisher_resent_after_loss, summary
    assert result.publisher_flush_error is None and result.publisher_unconfirmed_lost == 0, summary


@pytest.mark.timeout(120)
def test_an_all_partition_subscriber_gets_500_key_partitions_in_order_through_another_seed(
    cluster: ClusterRun,
) -> None:
    for node_id in ("a", "b", "c"):
        cluster.start(node_id)
    views = cluster.wait_settled()
    counts = [n for v in views.values() for n in v["vbuckets"]]
    assert len(counts) == 6 and sum(counts) == 1024 and max(counts) - min(counts) <= 1, counts
    load = Load(cluster.seeds("a"), cluster.seeds("c"), rate=5000, partitions=500)
    time.sleep(3.0)
    result = finish(load, 500)
    assert result.published > 10_000, result
    assert_nothing_lost(result)
    # in order per key_partition: each one's sequence numbers, every one, ascending
    assert all(seqs == list(range(len(seqs))) for seqs in result.per_partition)
    assert all(result.per_partition)  # every key_partition, so every node and worker, delivered


@pytest.mark.timeout(180)
def test_a_node_joins_and_one_leaves_under_load_nothing_lost_nothing_twice(cluster: ClusterRun) -> None:
    for node_id in ("a", "b", "c"):
        cluster.start(node_id)
    cluster.wait_settled()
    load = Load(cluster.seeds("a"), cluster.seeds("c"), rate=3000, partitions=256)
    time.sleep(1.0)
    cluster.start("d")  # joins under load: takes its share
    cluster.wait_settled()
    time.sleep(1.0)
    assert cluster.leave("b") == 0  # SIGTERM under load: drains first, then Goodbye
    views = cluster.wait_settled()
    time.sleep(1.0)
    result = finish(load, 256)
    print(
        f"\njoin and leave under load: {result.published} published, {result.received} received, "
        f"{result.lost} lost, {result.duplicates} duplicates"
    )
    # Every hand-over is accounted for (MapApplied, round trips, the Goodbye's count of what
    # was processed), but for one race: the leaving node's workers exit once every final
    # byte was handed to the kernel and their clients closed (at most GOODBYE_LINGER later,
    # broky.server.worker.process), and a publish that reached one of them after its last read
    # makes the exit reset that connection, which can destroy the Goodbye on its way.
    # Then the client settles it without an account: publishes not confirmed are sent again
    # with their uids, and the subscriber drops the copies (seen once in ~20 runs under load
    # before the workers waited for their clients to close).
    assert_nothing_lost(result, resends=True)
    assert result.publisher_resent_after_loss <= result.published // 100, result
    assert sorted(n for v in views.values() for n in v["vbuckets"]) == [170, 170, 171, 171, 171, 171]

    history = map_history(cluster.etcd.endpoint)
    assert_versions_grow(history)
    three, four, back = _three_maps([m for m in history if not m.incoming])
    assert moved_between(three, four) == 256  # 3 -> 4 nodes: only d's share moves
    assert moved_between(four, back) == 256  # 4 -> 3: only b's share moves
    # each through a prepared map: same owners, the vbuckets that move named
    join, drain = (
        next(m for m in history if m.incoming and m.version < after.version and m.version > before.version)
        for before, after in ((three, four), (four, back))
    )
    assert moving(join) == {"d": 256} and owners_by_id(join) == owners_by_id(three)
    assert sum(moving(drain).values()) == 256 and "b" not in moving(drain)
    assert owners_by_id(drain) == owners_by_id(four)


def _three_maps(committed: list[VBucketMap]) -> tuple[VBucketMap, VBucketMap, VBucketMap]:
    """The last committed map of a, b, c; the first of a, b, c, d after it; the first without b."""
    ids = [[n.node_id for n in m.nodes] for m in committed]
    first = max(i for i, n in enumerate(ids) if n == ["a", "b", "c"])
    second = next(i for i, n in enumerate(ids) if n == ["a", "b", "c", "d"] and i > first)
    third = next(i for i, n in enumerate(ids) if "b" not in n and i > second)
    return committed[first], committed[second], committed[third]


@pytest.mark.timeout(240)
def test_a_node_then_the_leader_killed_under_load_flow_resumes_and_loss_is_counted() -> None:
    requires.program("etcd")
    result = run(kills=2, rate=5000, partitions=500, lease_ttl=LEASE_TTL)
    kills = [e for e in result.events if e["what"] == "kill"]
    print(
        f"\nnode kills: {result.published} published, {result.lost} lost, {result.told} told, "
        f"SDK possibly lost {result.publisher_unconfirmed_lost}, "
        f"resent {result.publisher_resent_after_loss}, "
        f"copies dropped {result.subscriber_duplicates_dropped}; every key_partition flowing again after "
        + ", ".join(f"{k['every']} s ({'leader ' if k['leader'] else ''}{k['node']})" for k in kills)
    )
    summary = f"{result}"
    assert [k["leader"] for k in kills] == [False, True], summary
    # Nothing lost silently, split as finely as the run allows (the map moves key_partitions
    # only at kills and joins): on the key_partitions of the killed nodes, what the SDK counted
    # as possibly lost and what their workers told; on the others, what their workers told.
    assert result.lost_on_killed == result.told_by_killed + result.publisher_unconfirmed_lost, summary
    assert result.lost_elsewhere == result.told_elsewhere, summary
    assert result.lost == result.told + result.publisher_unconfirmed_lost, summary
    # counted, not derived from the sequences: the callback's count, the SDK's, the publisher's
    assert result.received == result.published - result.told - result.publisher_unconfirmed_lost, summary
    assert result.received == result.subscriber_sdk_delivered, summary
    assert result.duplicates == 0 and result.out_of_order == 0, summary
    assert result.stray == 0 and result.corrupt == 0, summary
    # Copies come only from publishes sent again (a dead node confirmed no delivery of them):
    # the SDK's filter may drop at most one copy of each; more would be a double delivery.
    assert result.subscriber_duplicates_dropped <= result.publisher_resent_after_loss, summary
    assert result.publisher_flush_error is None, summary
    for k in kills:  # every key_partition of the dead node flows again: lease, then the leader's move
        assert k["every"] is not None and k["every"] < 3 * LEASE_TTL + 5, summary


@pytest.mark.timeout(180)
def test_etcd_stopped_and_restarted_under_load_publishing_never_stops(cluster: ClusterRun) -> None:
    for node_id in ("a", "b", "c"):
        cluster.start(node_id)
    cluster.wait_settled()
    before = cluster.map()
    load = Load(cluster.seeds("a"), cluster.seeds("b"), rate=3000, partitions=256)
    time.sleep(1.0)
    cluster.etcd.pause()  # longer than a lease: every membership lapses
    time.sleep(LEASE_TTL + 1.5)
    cluster.etcd.resume()
    cluster.wait_settled()
    cluster.etcd.kill()  # killed and started again on its data
    time.sleep(1.0)
    cluster.etcd.start()
    wait_for(lambda: cluster.wait_settled(), 60, "settled after etcd came back")
    time.sleep(1.0)
    result = finish(load, 256)
    print(f"\netcd outages: {result.published} published, longest silence {result.max_gap_s} s")
    assert_nothing_lost(result)
    # 3,000 msgs/s: the flow never waits for etcd. Its pause lasted LEASE_TTL + 1.5 s, so a flow
    # stopped by it would show a silence that long; a loaded 2-core machine running etcd, six
    # workers and both clients can show a silence of about a second without any such wait.
    assert result.max_gap_s < LEASE_TTL + 0.5, result
    assert owners_by_id(cluster.map()) == owners_by_id(before)  # nothing moved for an etcd outage


@pytest.mark.timeout(180)
def test_etcd_wiped_under_load_the_map_is_restored_nothing_moves_nothing_lost(cluster: ClusterRun) -> None:
    for node_id in ("a", "b", "c"):
        cluster.start(node_id)
    cluster.wait_settled()
    before = map_history(cluster.etcd.endpoint)
    load = Load(cluster.seeds("a"), cluster.seeds("b"), rate=3000, partitions=256)
    time.sleep(1.0)
    cluster.etcd.wipe(down=1.0)  # etcd back empty: no map, no members, no leases
    wait_for(lambda: agreed(cluster.etcd, cluster.nodes), 60, "the nodes settled on a map in etcd")
    after = map_history(cluster.etcd.endpoint)
    time.sleep(1.0)
    result = finish(load, 256)
    print(f"\netcd wiped: {result.published} published, longest silence {result.max_gap_s} s")
    assert_nothing_lost(result)
    assert result.publisher_resent_after_loss == 0 and result.subscriber_duplicates_dropped == 0, result
    history = before + after
    assert_versions_grow(history)
    assert_every_move_prepared(history)
    assert after[0].version == before[-1].version + 1  # the running map, restored
    assert all(owners_by_id(m) == owners_by_id(before[-1]) for m in after)  # nothing moved


@pytest.mark.timeout(150)
def test_the_leader_drains_like_any_node_in_a_rolling_restart_no_notice_nothing_lost() -> None:
    """A rolling restart under SDK load: another node, then the leader, drained (SIGTERM)
    and started again at its address as soon as it exited. The leader's drain hands the
    leadership over with the record that says it drains, so the member that stays
    prepares, commits and drops it at once, as for any node: the map no longer names it
    before it is back, so nobody's connection to its old process resumes at the new one,
    and the move back to it is prepared and committed as usual, without its timeout.
    (A draining leader that led on was dropped only by its successor, after that one's
    LEADER_SETTLE: the node restarted meanwhile was still in the map; the subscriber was
    told UNACCOUNTED twice or four times and the move back waited its timeout.)"""
    requires.program("etcd")
    cluster = ClusterRun(2, LEASE_TTL, "--move-timeout", "4", "--drain-linger", "0", keep_ports=True)
    load: Load | None = None
    watch: MapWatch | None = None
    try:
        for node_id in ("a", "b", "c"):
            cluster.start(node_id)
        cluster.wait_settled()
        assert cluster.leader() == "a"
        watch = MapWatch(cluster)
        load = Load(cluster.seeds("a"), cluster.seeds("c"), rate=300, partitions=100)
        time.sleep(1.0)
        other = drain_once(cluster, watch, "c", False, down=0.0, timeout=60.0)
        time.sleep(0.5)
        leader = drain_once(cluster, watch, "a", True, down=0.0, timeout=60.0)
        time.sleep(1.0)
        result = finish(load, 100)
        history = map_history(cluster.etcd.endpoint)
    finally:
        if load is not None:
            load.kill()
        if watch is not None:
            watch.stop()
        cluster.stop()
    summary = f"{result}\nanother node's drain: {other}\nthe leader's drain: {leader}"
    print(f"\nrolling restart: another node's drain {other}\nthe leader's {leader}")
    assert_nothing_lost(result)
    assert result.subscriber_unaccounted == [] and result.told_by_reason == {}, summary  # no notice
    for drain in (other, leader):
        assert drain.exit_code == 0 and drain.prepared and drain.move_timeouts == 0, summary
        # committed, then a map without it, before it was back (whole_s: None if it never left)
        assert drain.committed_s is not None and drain.whole_s is not None, summary
        assert drain.committed_s <= drain.whole_s <= drain.rejoined_s, summary  # type: ignore[operator]
    # how: the draining leader handed over at once, the next oldest member planned its drain
    assert "the leader is 'b': this node drains and handed the leadership over" in leader.leadership, summary
    assert "this node ('b') is the leader: 'a' drains and handed it over" in leader.leadership, summary
    # comparable to another node's drain (generous: a busy machine; the move timeout is 4 s, the
    # successor's settle 1 s, and what they would add is asserted above by mechanism)
    assert leader.whole_s < other.whole_s + 3.0, summary  # type: ignore[operator]
    assert_versions_grow(history)
    assert_every_move_prepared(history)


@pytest.mark.timeout(150)
def test_an_incoming_owner_back_after_the_prepare_the_move_commits_without_its_timeout() -> None:
    """A worker of c dies just as b drains, so the subscriber's connection to it is down
    when the prepare that moves b's vbuckets to c (and a) arrives. Once it is connected
    again and its subscriptions are in place, the subscriber says MapApplied on every
    connection (schema/README.md section 6.3): every node counts it ready, the leader
    commits without waiting for the move timeout, and the subscriber is told no loss.
    (It said it to the worker that came back only: the other nodes never counted it
    ready, the commit came after the move timeout, and having adopted it without its
    MapApplied the subscriber was told UNACCOUNTED for every new owner: four notices,
    nothing lost.)"""
    requires.program("etcd")
    cluster = ClusterRun(2, LEASE_TTL, "--move-timeout", "4", "--drain-linger", "0", keep_ports=True)
    load: Load | None = None
    try:
        for node_id in ("a", "b", "c"):
            cluster.start(node_id)
        cluster.wait_settled()
        assert cluster.leader() == "a"
        load = Load(cluster.seeds("a"), cluster.seeds("c"), rate=300, partitions=100)
        time.sleep(1.0)
        leader_node = cluster.nodes["a"]
        seen = len(leader_node.full_log())
        os.kill(cluster.pids("c")[1], signal.SIGKILL)  # a worker of c; its master starts it again
        assert cluster.leave("b") == 0  # SIGTERM at once: b drains to a and c
        cluster.wait_settled()
        time.sleep(1.0)
        result = finish(load, 100)
        log = leader_node.full_log()[seen:]
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
    summary = f"{result}\n{log}"
    assert re.search(r"prepared: \d+ vbuckets to move \(serving: a, c; draining: b\)", log), summary
    assert re.search(r"committed: \d+ vbuckets moved, every member ready after", log), summary
    assert "after the move timeout" not in log, summary
    assert result.subscriber_unaccounted == [], summary
    # the worker's death is told exactly (its account, WORKER_RESTART), if it lost anything
    assert result.lost == result.told and result.received == result.published - result.told, summary
    assert result.received == result.subscriber_sdk_delivered, summary
    assert result.duplicates == 0 and result.out_of_order == 0, summary


@pytest.mark.timeout(240)
def test_a_flush_pending_on_a_node_that_dies_ends_without_spinning() -> None:
    """Issue 37: a flush waiting for a worker whose node died spun in Link.round_trip once
    the node left the map (the retired Link's event was set, the loop never yielded), at a
    whole core, and never returned; the subscriber in the process stopped receiving. Two
    nodes, one SIGKILLed and started again 6 s later (past its 2 s lease: it leaves the
    map); an asyncio and a blocking client publish and flush every second
    (bench.kill_loop_flush, short)."""
    from bench import kill_loop_flush

    requires.program("etcd")
    out = kill_loop_flush.run(
        minutes=0.16, nodes=2, clients=2, every=15.0, down=(6.0, 6.0), lease_ttl=LEASE_TTL
    )
    summary = "\n".join(kill_loop_flush.lines(out))
    assert len(out.kills) == 1, summary
    for c in out.clients:
        assert not c.hung, summary  # it answered "stop" (a spinning client never does)
        assert c.spinning_seconds() == 0, summary  # no second at over half a core
        assert c.flushes and out.late_flushes(c) == 0, summary  # each ended within its timeout
        # the flush after the kill waited for the dead node until it left the map, then ended
        assert c.longest_flush() >= 1.0, summary
        assert set(c.outcomes()) == {"ok"}, summary  # what it carried went to the new owners
        assert c.received > 0 and c.longest_gap_s < 10.0, summary  # its subscriber kept receiving
