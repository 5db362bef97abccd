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
from anybody, so it needs no preparation: it is what a brand-new cluster
gets, one whose nodes run no map yet.

etcd lost the map (RESTORE). Every node runs a map and says which in its
member record (MemberRecord.map_version). If etcd holds no map, or one older
than a map some node runs (etcd restarted empty, or restored from an old
backup), a FIRST map would give the leader every vbucket in one step. So
`behind` names the newest version the nodes run, and the leader writes the
map it runs itself, unchanged (owners, `incoming` if a move was prepared),
under the version above every one the nodes and etcd hold: every node
accepts it as newer, and nothing moves. From then on the plans above move
only what must move, through PREPARE and COMMIT (members that did not come
back are planned away only after the node's rejoin grace,
broky.cluster.node). A leader whose own map is older than a member's does
not restore (`plan` returns None): restoring it would move, in one step,
whatever changed between the two. It yields instead (broky.cluster.node:
it registers again, as the youngest member), until the leader is a member
that runs the newest map, and that one restores. A node back after the
leader's wait with a newer map than the restored one makes etcd's map
behind again, and the same rule restores the newer one (what differs moves
in one step: the wait is what makes that rare). Not covered: such a node
whose map carries exactly the restored version; it keeps its own map until
the next version (a member record carries no digest of its map to tell).

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
RESTORE = "restore"


class Plan(NamedTuple):
    kind: str  # FIRST, PREPARE, COMMIT, CANCEL, UPDATE or RESTORE
    vmap: VBucketMap  # the map to write
    moving: int  # vbuckets that this plan prepares to move (PREPARE) or moves (COMMIT, FIRST)
    not_ready: tuple[str, ...] = ()  # COMMIT after the move timeout: members that were not ready


def behind(current: VBucketMap | None, members: Sequence[MemberRecord], running: int) -> int:
    """The newest map version that a member or the leader (`running`) runs, when etcd's
    map (`current`, None for none) is older than it: etcd lost it. Else 0."""
    newest = max([running, *(m.map_version for m in members)])
    return newest if newest > (0 if current is None else current.version) else 0


def plan(
    current: VBucketMap | None,
    members: Sequence[MemberRecord],
    ready: Mapping[str, int],
    move_timed_out: bool,
    running: VBucketMap | None = None,
) -> Plan | None:
    """The next map, or None when the current one stands (or nobody serves, or a member
    runs a newer map than the leader's while etcd's is behind: the leader yields).

    Args:
        current: the map in etcd (None: there is none yet).
        members: every live member, serving or draining.
        ready: node id -> the last prepared map version it said it applied.
        move_timed_out: the current prepared map was written --move-timeout ago.
        running: the map the leader runs (None: none yet).
    """
    serving = [m.info for m in members if m.state == SERVING]
    if not serving:
        return None
    newest = behind(current, members, 0 if running is None else running.version)
    if newest:
        if running is None or running.version < newest:
            return None
        return Plan(RESTORE, running._replace(version=newest + 1), 0)
    if current is None:
        first = assign(serving, [None] * VBUCKETS)
        return Plan(FIRST, _build(1, members, None, first.owners, None), VBUCKETS)
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
