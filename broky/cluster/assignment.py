"""Who owns which vbucket: a pure function of the members and the previous map.

Theory of operation
-------------------
The 1024 vbuckets are shared by every worker of every member node (a node
with more workers gets more vbuckets: the unit of balance is the worker).
`assign(members, previous)` returns the owner of each vbucket such that:

- balanced: with W workers, every worker owns 1024 // W or 1024 // W + 1
  vbuckets (any two differ by at most one);
- sticky: a vbucket keeps its owner whenever that owner is still a member
  and not over its share, so only what must move, moves. When a node joins,
  exactly its share moves to it; when one leaves, exactly its vbuckets move;
- deterministic: the same members and previous map give the same owners, on
  every node (workers are ordered by (node_id, worker)).

How. Workers are ordered by (node_id, worker). The `1024 % W` workers that get
one vbucket more are those that already own the most (ties: that order), so
that the remainder does not force moves. Each worker keeps its current
vbuckets up to its share (the lowest-numbered ones); every other vbucket (of
a departed node, or over a share) is free, and the free vbuckets, in
ascending order, fill the workers under their share, in worker order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from broky.protocol.routing import VBUCKETS, NodeInfo, VBucketMap

Owner = tuple[str, int]  # (node_id, worker)


class Assignment(NamedTuple):
    owners: tuple[Owner, ...]  # by vbucket
    moved: int  # vbuckets whose owner differs from the previous map's


def previous_owners(vmap: VBucketMap | None) -> list[Owner | None]:
    """The owners of a map by node id (None for a map-less start)."""
    if vmap is None:
        return [None] * VBUCKETS
    return [(vmap.nodes[node].node_id, worker) for node, worker in vmap.owners]


def assign(members: Sequence[NodeInfo], previous: Sequence[Owner | None]) -> Assignment:
    """The owners of the 1024 vbuckets for these members (see the module's header).

    Raises:
        ValueError: no member, or more workers than vbuckets.
    """
    workers = sorted((m.node_id, w) for m in members for w in range(m.workers))
    if not workers:
        raise ValueError("no member has a worker")
    if len(workers) > VBUCKETS:
        raise ValueError(f"{len(workers)} workers for {VBUCKETS} vbuckets")
    held: dict[Owner, list[int]] = {w: [] for w in workers}
    for vb, owner in enumerate(previous):
        if owner in held:
            held[owner].append(vb)
    base, extra = divmod(VBUCKETS, len(workers))
    by_holding = sorted(workers, key=lambda w: (-len(held[w]), w))
    share = {w: base + (1 if i < extra else 0) for i, w in enumerate(by_holding)}
    owners: list[Owner | None] = [None] * VBUCKETS
    for w in workers:
        for vb in held[w][: share[w]]:
            owners[vb] = w
    free = iter(vb for vb in range(VBUCKETS) if owners[vb] is None)
    for w in workers:
        for _ in range(share[w] - min(len(held[w]), share[w])):
            owners[next(free)] = w
    final = tuple(o for o in owners if o is not None)
    assert len(final) == VBUCKETS
    moved = sum(1 for vb in range(VBUCKETS) if previous[vb] != final[vb])
    return Assignment(final, moved)


def build_map(version: int, members: Sequence[NodeInfo], owners: Sequence[Owner]) -> VBucketMap:
    """A VBucketMap of these members (in node-id order) and owners."""
    nodes = tuple(sorted(members, key=lambda m: m.node_id))
    index = {n.node_id: i for i, n in enumerate(nodes)}
    return VBucketMap(version, nodes, tuple((index[node], worker) for node, worker in owners))
