"""The leader's next map: a pure function of the current map, the members and their readiness.

Theory of operation
-------------------
The leader (broky.cluster.node) calls `plan` whenever something changed and
writes what it returns, if anything, as the next version of the map. The
owners it aims at are always `assign(serving members, current owners)`
(broky.cluster.assignment: balanced over the workers, sticky, deterministic).

Vbuckets move in two steps, so that subscribers are where the messages will
go before the messages go there:

1. PREPARE (version v+1): the owners stay as they are, and `incoming` names,
   for every vbucket that moves, the worker it moves to (NO_OWNER for the
   others). Every node applies it and pushes it to its clients; subscribers
   subscribe at the incoming owners (a worker accepts subscriptions for its
   incoming vbuckets), answer MapApplied, and once every subscriber of a node
   has, the node writes <prefix>/ready/<node_id> = v+1.
2. COMMIT (version v+2): the owners become the target and `incoming` is
   gone. It is written once every member said ready for v+1, or when the
   leader has waited --move-timeout for them (the plan names the members that
   were not ready).

If the members change while a move is prepared, the target changes: the
leader prepares again from the current owners (a new version), or cancels
the move (CANCEL: `incoming` removed) when nothing has to move any more. A
change that moves nothing (a member's address, a gone node that owns
nothing) is one UPDATE. The first map of a cluster (FIRST) moves nothing
from anybody, so it needs no preparation.

`nodes` lists every member (serving or draining) and every node that still
owns a vbucket (a node that died keeps its vbuckets until the commit), in
node-id order; a node that is no member and owns nothing is dropped. Owners
are by (node_id, worker) here and become node indexes only in the map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from broky.cluster.assignment import Owner, assign
from broky.cluster.layout import SERVING, MemberRecord
from broky.protocol.routing import NO_OWNER, VBUCKETS, NodeInfo, VBucketMap

FIRST = "first"
PREPARE = "prepare"
COMMIT = "commit"
CANCEL = "cancel"
UPDATE = "update"


class Plan(NamedTuple):
    kind: str  # FIRST, PREPARE, COMMIT, CANCEL or UPDATE
    vmap: VBucketMap  # the map to write
    moving: int  # vbuckets that this plan prepares to move (PREPARE) or moves (COMMIT, FIRST)
    not_ready: tuple[str, ...] = ()  # COMMIT after the move timeout: members that were not ready


def plan(
    current: VBucketMap | None,
    members: Sequence[MemberRecord],
    ready: Mapping[str, int],
    move_timed_out: bool,
    first_version: int = 1,
) -> Plan | None:
    """The next map, or None when the current one stands (or nobody serves).

    Args:
        current: the map in etcd (None: there is none yet).
        members: every live member, serving or draining.
        ready: node id -> the last prepared map version it said it applied.
        move_timed_out: the current prepared map was written --move-timeout ago.
        first_version: the version of a first map.
    """
    serving = [m.info for m in members if m.state == SERVING]
    if not serving:
        return None
    if current is None:
        first = assign(serving, [None] * VBUCKETS)
        return Plan(FIRST, _build(first_version, members, None, first.owners, None), VBUCKETS)
    owners = [(current.nodes[n].node_id, w) for n, w in current.owners]
    target = assign(serving, owners)
    version = current.version + 1
    if target.moved == 0:
        settled = _build(version, members, current, target.owners, None)
        if _same(settled, current):
            return None
        return Plan(CANCEL if current.incoming is not None else UPDATE, settled, 0)
    incoming = [t if t != o else None for t, o in zip(target.owners, owners)]
    if current.incoming is not None and _incoming_of(current) == incoming:
        not_ready = tuple(sorted(m.node_id for m in members if ready.get(m.node_id, 0) < current.version))
        if not_ready and not move_timed_out:
            return None
        return Plan(COMMIT, _build(version, members, current, target.owners, None), target.moved, not_ready)
    return Plan(PREPARE, _build(version, members, current, owners, incoming), target.moved)


def _incoming_of(vmap: VBucketMap) -> list[Owner | None]:
    assert vmap.incoming is not None
    return [None if i == NO_OWNER else (vmap.nodes[i[0]].node_id, i[1]) for i in vmap.incoming]


def _same(a: VBucketMap, b: VBucketMap) -> bool:
    """Equal but for the version."""
    return a._replace(version=0) == b._replace(version=0)


def _build(
    version: int,
    members: Sequence[MemberRecord],
    current: VBucketMap | None,
    owners: Sequence[Owner],
    incoming: Sequence[Owner | None] | None,
) -> VBucketMap:
    """A map of these owners whose nodes are the members plus whoever else owns or receives."""
    infos = {m.node_id: m.info for m in members}
    known = {n.node_id: n for n in current.nodes} if current is not None else {}
    named = [o for o in (*owners, *(incoming or ())) if o is not None]
    needed: dict[str, int] = {}
    for node_id, worker in named:
        needed[node_id] = max(needed.get(node_id, 0), worker + 1)
    for node_id, workers in needed.items():
        info = infos.get(node_id) or known[node_id]
        if info.workers < workers:  # a member back with fewer workers, until the commit
            info = info._replace(workers=workers)
        infos[node_id] = info
    nodes: tuple[NodeInfo, ...] = tuple(infos[k] for k in sorted(infos))
    index = {n.node_id: i for i, n in enumerate(nodes)}
    by_index = tuple((index[n], w) for n, w in owners)
    moving = None
    if incoming is not None:
        moving = tuple(NO_OWNER if o is None else (index[o[0]], o[1]) for o in incoming)
    return VBucketMap(version, nodes, by_index, moving)
