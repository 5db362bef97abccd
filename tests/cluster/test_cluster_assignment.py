"""The vbucket assignment: balanced over workers, deterministic, sticky (broky.cluster.assignment)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.cluster.assignment import Owner, assign, build_map, previous_owners
from broky.protocol.routing import VBUCKETS, NodeInfo


def nodes(*spec: tuple[str, int]) -> list[NodeInfo]:
    return [NodeInfo(node_id, "127.0.0.1", 4000 + i, workers) for i, (node_id, workers) in enumerate(spec)]


def counts(owners: tuple[Owner, ...]) -> Counter[Owner]:
    return Counter(owners)


def assert_balanced(owners: tuple[Owner, ...], members: list[NodeInfo]) -> None:
    per_worker = counts(owners)
    expected = {(m.node_id, w) for m in members for w in range(m.workers)}
    assert set(per_worker) == expected  # every worker owns something, nobody else does
    assert max(per_worker.values()) - min(per_worker.values()) <= 1
    assert sum(per_worker.values()) == VBUCKETS


NONE: list[Owner | None] = [None] * VBUCKETS


def test_three_nodes_of_two_workers_are_balanced() -> None:
    members = nodes(("a", 2), ("b", 2), ("c", 2))
    result = assign(members, NONE)
    assert_balanced(result.owners, members)
    assert sorted(counts(result.owners).values()) == [170] * 2 + [171] * 4
    assert result.moved == VBUCKETS


def test_weighted_by_workers() -> None:
    members = nodes(("a", 1), ("b", 3))
    per_node = Counter(node for node, _ in assign(members, NONE).owners)
    assert per_node == {"a": 256, "b": 768}


def test_deterministic_whatever_the_order_of_members() -> None:
    members = nodes(("a", 2), ("b", 3), ("c", 1))
    first = assign(members, NONE)
    again = assign(list(reversed(members)), NONE)
    assert first == again
    shuffled = previous_owners(build_map(5, members, first.owners))
    assert assign(members, shuffled) == assign(list(reversed(members)), shuffled)


def test_a_fourth_node_takes_exactly_its_share_256_move() -> None:
    three = nodes(("a", 2), ("b", 2), ("c", 2))
    before = assign(three, NONE).owners
    four = [*three, *nodes(("d", 2))]
    after = assign(four, list(before))
    assert after.moved == 256
    assert_balanced(after.owners, four)
    # only vbuckets going to the newcomer move; every other keeps its owner
    for vb in range(VBUCKETS):
        assert after.owners[vb] == before[vb] or after.owners[vb][0] == "d"


def test_a_node_leaving_moves_exactly_its_vbuckets_256_move() -> None:
    four = nodes(("a", 2), ("b", 2), ("c", 2), ("d", 2))
    before = assign(four, NONE).owners
    three = [m for m in four if m.node_id != "b"]
    after = assign(three, list(before))
    assert after.moved == 256
    assert_balanced(after.owners, three)
    for vb in range(VBUCKETS):
        assert after.owners[vb] == before[vb] or before[vb][0] == "b"


def test_same_members_move_nothing() -> None:
    members = nodes(("a", 2), ("b", 2), ("c", 2))
    owners = assign(members, NONE).owners
    assert assign(members, list(owners)).moved == 0


def test_previous_owners_round_trip_through_a_map() -> None:
    members = nodes(("b", 2), ("a", 1))
    owners = assign(members, NONE).owners
    vmap = build_map(7, members, owners)
    vmap.check()
    assert [n.node_id for n in vmap.nodes] == ["a", "b"]
    assert tuple(previous_owners(vmap)) == owners
    assert previous_owners(None) == NONE


def test_no_member_is_an_error() -> None:
    with pytest.raises(ValueError, match="no member"):
        assign([], NONE)
    with pytest.raises(ValueError, match="workers for"):
        assign(nodes(("a", 1025)), NONE)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=6),
    st.lists(st.integers(1, 8), min_size=1, max_size=6),
    st.integers(0, 2**32),
)
def test_any_change_is_balanced_and_moves_the_minimum(before: list[int], after: list[int], seed: int) -> None:
    """From any balanced map to any other member set: balanced, and nothing moves that need not.

    The minimum: a worker that stays keeps min(what it held, its new share), so
    at least sum(held - that) + what departed workers held must move, no more.
    """
    rng = random.Random(seed)
    old = nodes(*((f"n{i}", w) for i, w in enumerate(before)))
    new = nodes(*((f"n{i + rng.randrange(3)}", w) for i, w in enumerate(after)))
    new = list({m.node_id: m for m in new}.values())
    previous = assign(old, NONE).owners
    result = assign(new, list(previous))
    assert_balanced(result.owners, new)
    held = counts(previous)
    shares = counts(result.owners)
    kept = sum(min(held.get(w, 0), shares[w]) for w in shares)
    assert result.moved == VBUCKETS - kept
