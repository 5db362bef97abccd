"""The leader's plans (broky.cluster.planner) and what the cluster keeps in etcd (broky.cluster.layout)."""

from __future__ import annotations

from collections import Counter

import pytest

from broky.cluster import planner
from broky.cluster.layout import (
    DRAINING,
    Keys,
    Member,
    MemberRecord,
    decode_ready,
    encode_ready,
    leader_of,
    parse_cluster_url,
)
from broky.protocol.routing import NO_OWNER, VBUCKETS, VBucketMap


def record(node_id: str, workers: int = 2, state: str = "serving", port: int = 0) -> MemberRecord:
    return MemberRecord(node_id, "127.0.0.1", port or 4000 + ord(node_id[0]), workers, 9000, "0.1.0", state)


def by_node(vmap: VBucketMap) -> Counter[str]:
    return Counter(vmap.nodes[n].node_id for n, _ in vmap.owners)


def settle(members: list[MemberRecord], current: VBucketMap | None = None) -> VBucketMap:
    """Run plans until none is left, every member always ready; the final map."""
    ready = {m.node_id: current.version for m in members} if current is not None else {}
    for _ in range(10):
        step = planner.plan(current, members, ready, move_timed_out=False)
        if step is None:
            assert current is not None
            return current
        step.vmap.check()
        current = step.vmap
        ready = {m.node_id: current.version for m in members}
    raise AssertionError("no stable map after 10 plans")


def test_first_map_then_nothing() -> None:
    members = [record("a"), record("b"), record("c")]
    first = planner.plan(None, members, {}, False)
    assert first is not None and first.kind == planner.FIRST
    assert first.vmap.version == 1 and first.vmap.incoming is None
    assert [n.node_id for n in first.vmap.nodes] == ["a", "b", "c"]
    assert planner.plan(first.vmap, members, {}, False) is None


def test_a_join_is_prepared_then_committed_when_every_member_is_ready() -> None:
    three = [record("a"), record("b"), record("c")]
    stable = settle(three)
    four = [*three, record("d")]
    prep = planner.plan(stable, four, {}, False)
    assert prep is not None and prep.kind == planner.PREPARE and prep.moving == 256
    vmap = prep.vmap
    assert vmap.version == stable.version + 1 and vmap.incoming is not None
    assert by_node(vmap) == by_node(stable)  # nothing moved yet
    moving = [vb for vb in range(VBUCKETS) if vmap.incoming[vb] != NO_OWNER]
    assert len(moving) == 256
    assert {vmap.nodes[vmap.incoming[vb][0]].node_id for vb in moving} == {"d"}
    # waits for every member, the newcomer included
    assert planner.plan(vmap, four, {"a": vmap.version, "b": vmap.version, "c": vmap.version}, False) is None
    ready = {m.node_id: vmap.version for m in four}
    commit = planner.plan(vmap, four, ready, False)
    assert commit is not None and commit.kind == planner.COMMIT and commit.moving == 256
    assert commit.not_ready == () and commit.vmap.incoming is None
    assert commit.vmap.version == vmap.version + 1
    assert by_node(commit.vmap) == {"a": 256, "b": 256, "c": 256, "d": 256}
    for vb in moving:  # the prepared owners are the committed ones
        assert commit.vmap.owners[vb] == vmap.incoming[vb]
    assert planner.plan(commit.vmap, four, ready, False) is None


def test_the_move_timeout_commits_without_the_lagging_members() -> None:
    three = [record("a"), record("b"), record("c")]
    prep = planner.plan(settle(three[:2]), three, {}, False)
    assert prep is not None and prep.kind == planner.PREPARE
    commit = planner.plan(prep.vmap, three, {"a": prep.vmap.version}, move_timed_out=True)
    assert commit is not None and commit.kind == planner.COMMIT and commit.not_ready == ("b", "c")


def test_a_draining_node_stays_in_nodes_until_it_leaves() -> None:
    four = [record("a"), record("b"), record("c"), record("d")]
    stable = settle(four)
    draining = [m if m.node_id != "b" else m._replace(state=DRAINING) for m in four]
    prep = planner.plan(stable, draining, {}, False)
    assert prep is not None and prep.kind == planner.PREPARE and prep.moving == 256
    commit = planner.plan(prep.vmap, draining, {m.node_id: prep.vmap.version for m in four}, False)
    assert commit is not None and commit.kind == planner.COMMIT
    assert "b" not in by_node(commit.vmap) and commit.vmap.node_index("b") is not None
    gone = [m for m in draining if m.node_id != "b"]
    update = planner.plan(commit.vmap, gone, {}, False)
    assert update is not None and update.kind == planner.UPDATE and update.moving == 0
    assert update.vmap.node_index("b") is None and update.vmap.owners != commit.vmap.owners  # reindexed
    assert by_node(update.vmap) == by_node(commit.vmap)


def test_a_dead_node_keeps_its_vbuckets_until_the_commit() -> None:
    three = [record("a"), record("b"), record("c")]
    stable = settle(three)
    survivors = three[:2]
    prep = planner.plan(stable, survivors, {}, False)
    assert prep is not None and prep.kind == planner.PREPARE and prep.moving == by_node(stable)["c"]
    assert prep.vmap.node_index("c") is not None  # still the owner of what moves
    commit = planner.plan(prep.vmap, survivors, {"a": prep.vmap.version, "b": prep.vmap.version}, False)
    assert commit is not None and commit.vmap.node_index("c") is None
    assert by_node(commit.vmap) == {"a": 512, "b": 512}


def test_members_changing_during_a_move_replan_or_cancel() -> None:
    three = [record("a"), record("b"), record("c")]
    stable = settle(three)
    prep = planner.plan(stable, [*three, record("d")], {}, False)
    assert prep is not None
    replan = planner.plan(prep.vmap, [*three, record("d"), record("e")], {}, False)
    assert replan is not None and replan.kind == planner.PREPARE
    assert replan.vmap.version == prep.vmap.version + 1
    cancel = planner.plan(prep.vmap, three, {}, False)  # d left before the commit
    assert cancel is not None and cancel.kind == planner.CANCEL and cancel.vmap.incoming is None
    assert cancel.vmap.owners == stable.owners and cancel.vmap.nodes == stable.nodes


def test_an_address_change_is_one_update() -> None:
    two = [record("a"), record("b")]
    stable = settle(two)
    moved = [two[0], record("b", port=5555)]
    update = planner.plan(stable, moved, {}, False)
    assert update is not None and update.kind == planner.UPDATE
    assert update.vmap.nodes[1].port == 5555 and update.vmap.owners == stable.owners


def test_a_member_back_with_fewer_workers_keeps_the_map_valid_until_the_commit() -> None:
    stable = settle([record("a", 4), record("b", 2)])
    fewer = [record("a", 2), record("b", 2)]
    prep = planner.plan(stable, fewer, {}, False)
    assert prep is not None and prep.kind == planner.PREPARE
    prep.vmap.check()
    assert prep.vmap.nodes[0].workers == 4
    final = settle(fewer, prep.vmap)
    assert final.nodes[0].workers == 2 and set(by_node(final).values()) == {512}


def running(members: list[MemberRecord], versions: dict[str, int]) -> list[MemberRecord]:
    """The members as they register again after etcd lost its data: each with the map it runs."""
    return [m._replace(map_version=versions.get(m.node_id, 0)) for m in members]


def test_etcd_without_the_map_the_nodes_run_gets_it_back_under_a_newer_version() -> None:
    three = [record("a"), record("b"), record("c")]
    stable = settle(three)
    v = stable.version
    members = running(three, dict.fromkeys("abc", v))
    assert planner.behind(None, members, v) == v and planner.behind(stable, members, v) == 0
    step = planner.plan(None, members, {}, False, stable)  # etcd restarted empty
    assert step is not None and step.kind == planner.RESTORE and step.moving == 0
    assert step.vmap == stable._replace(version=v + 1)  # the same map, nothing moves
    assert planner.plan(step.vmap, members, {}, False, step.vmap) is None  # and it stands
    # the first node back: the others are not members yet; still nothing moves at once
    alone = planner.plan(None, members[:1], {}, False, stable)
    assert alone is not None and alone.kind == planner.RESTORE and alone.vmap.owners == stable.owners
    after = planner.plan(alone.vmap, members[:1], {}, False, alone.vmap)  # the others never came back
    assert after is not None and after.kind == planner.PREPARE and after.vmap.owners == stable.owners
    # above every version a node runs, and above an older map etcd still holds (a backup)
    ahead = running(three, {"a": v, "b": v + 5, "c": v})
    old = stable._replace(version=2)
    behind = running(three, {"a": v + 5, "b": v + 5, "c": v})
    restored = planner.plan(old, behind, {}, False, stable._replace(version=v + 5))
    assert restored is not None and restored.kind == planner.RESTORE and restored.vmap.version == v + 6
    # a leader whose map is older than a member's restores nothing: it yields (the node)
    assert planner.behind(None, ahead, v) == v + 5
    assert planner.plan(None, ahead, {}, False, stable) is None
    assert planner.plan(None, ahead, {}, False, None) is None


def test_a_prepared_move_is_restored_prepared() -> None:
    three = [record("a"), record("b"), record("c")]
    prep = planner.plan(settle(three), [*three, record("d")], {}, False)
    assert prep is not None and prep.kind == planner.PREPARE
    v = prep.vmap.version
    four = running([*three, record("d")], {"a": v, "b": v - 1, "c": v})  # b missed the prepare
    step = planner.plan(None, four, {}, False, prep.vmap)
    assert step is not None and step.kind == planner.RESTORE
    assert step.vmap == prep.vmap._replace(version=prep.vmap.version + 1)
    ready = {m.node_id: step.vmap.version for m in four}
    commit = planner.plan(step.vmap, four, ready, False, step.vmap)  # then committed as usual
    assert commit is not None and commit.kind == planner.COMMIT and commit.moving == 256


def test_a_first_map_only_when_no_node_runs_one() -> None:
    members = [record("a"), record("b")]
    assert planner.behind(None, members, 0) == 0
    first = planner.plan(None, members, {}, False, None)
    assert first is not None and first.kind == planner.FIRST and first.vmap.version == 1
    # a new node leads, but a member runs a map: no first map (the new node yields)
    assert planner.plan(None, running(members, {"b": 4}), {}, False, None) is None


def test_nobody_serving_plans_nothing() -> None:
    stable = settle([record("a")])
    assert planner.plan(stable, [record("a", state=DRAINING)], {}, False) is None
    assert planner.plan(None, [], {}, False) is None


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize(
    ("text", "endpoints", "prefix"),
    [
        ("etcd://127.0.0.1:2379", [("127.0.0.1", 2379)], "/broky"),
        ("etcd://h1:1,h2:2/prod/broky/", [("h1", 1), ("h2", 2)], "/prod/broky"),
        ("etcd://etcd", [("etcd", 2379)], "/broky"),
        ("ETCD://[::1]:23/x", [("::1", 23)], "/x"),
    ],
)
def test_cluster_urls(text: str, endpoints: list[tuple[str, int]], prefix: str) -> None:
    url = parse_cluster_url(text)
    assert list(url.endpoints) == endpoints and url.prefix == prefix
    assert parse_cluster_url(str(url)) == url


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1:2379", "etcd://", "etcd://h:0", "etcd://h:x", "etcd://h,/p", "etcd://::1", "etcd://h/"],
)
def test_bad_cluster_urls(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cluster_url(text)


def test_keys_records_and_leader() -> None:
    keys = Keys("/broky")
    assert keys.member("a") == "/broky/members/a" and keys.ready_of("a") == "/broky/ready/a"
    assert keys.map == "/broky/map" and keys.prefix == "/broky/"
    rec = record("a")
    assert MemberRecord.decode(rec.encode()) == rec
    with pytest.raises(ValueError):
        MemberRecord.decode(b'{"node_id": "a"}')
    with pytest.raises(ValueError):
        MemberRecord.decode(rec._replace(state="odd").encode())
    assert MemberRecord.decode(rec._replace(map_version=12).encode()).map_version == 12
    assert MemberRecord.decode(b'{"node_id": "a", "host": "h", "port": 1, "workers": 1}').map_version == 0
    with pytest.raises(ValueError):
        MemberRecord.decode(rec._replace(map_version=-1).encode())
    assert decode_ready(encode_ready(7)) == 7 and decode_ready(b"junk") == 0
    members = [Member(record("b"), 5, 1), Member(record("a"), 9, 2)]
    assert leader_of(members) == "b" and leader_of([]) is None
    # a draining member does not lead while another serves (the oldest serving one does);
    # while none serves, the oldest draining one does
    draining = [Member(record("b", state="draining"), 5, 1), Member(record("c"), 12, 3), *members[1:]]
    assert leader_of(draining) == "a"
    assert leader_of([draining[0], Member(record("a", state="draining"), 9, 2)]) == "b"
