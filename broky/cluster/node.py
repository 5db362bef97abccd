"""This node's part in the cluster: membership, the map, the leader's duties, drain.

Theory of operation
-------------------
One `ClusterNode` runs in the master process of every `broky serve --cluster`
(workers know nothing of etcd: they get maps from the master, as before). It
owns the node's etcd session and a copy of what etcd holds under the prefix
(broky.cluster.layout): the live members, the map and the ready versions.
The data path never waits on it.

Session. `run` loops over sessions, one gRPC channel each
(broky.cluster.etcd), on the next endpoint after a failure:

1. Register: grant a lease of --lease-ttl seconds and create
   <prefix>/members/<node_id> with it, only if that key does not exist. A key
   held by another live lease is not stolen: the node waits for that lease to
   expire (its own previous incarnation, killed less than a TTL ago), logging
   it once; at startup it gives up after that lease's TTL + CLASH_GRACE
   seconds (NodeIdInUse: the master exits 1, another live node has this id).
   After an outage the node first checks whether its lease survived; if so it
   keeps its key (and its create_revision, its rank for leadership), if not it
   registers anew, as the youngest member.
2. Resync: read every key under the prefix, then watch the prefix from the
   next revision, so no change is missed between the two.
3. Three tasks until one fails: the keepalive (every TTL/3; a lease etcd no
   longer knows means registering again), the watch (updates the copy, wakes
   the loop) and the loop, which every TICK (IDLE_TICK when nothing is pending)
   or when woken:
   - writes this node's record to its member key when it changed (draining,
     or the version of the map it runs);
   - writes the handover records its workers reported (HANDED): the epoch and
     next offset of each vbucket a worker stopped accepting, for its new owner
     to continue the sequence (broky.server.shard.moves). Every handover record
     the watch shows (this node's too) goes to the workers (`sequences`);
   - for an applied map with vbuckets moving (`incoming`), asks the master
     whether every worker runs it and every subscriber follows it
     (`map_ready`); once so, writes <prefix>/ready/<node_id> = that version;
   - if this node is the leader, plans (broky.cluster.planner) and writes;
   - if draining, checks whether it is done.

Any etcd error ends the session: the node logs once that etcd is lost, keeps
serving with the map it applied last (the workers have it; nothing waits on
etcd), shows it in /readyz (503 with the reason) and /stats, and retries
after a backoff (RETRY_MIN doubling to RETRY_MAX), for as long as it takes: it
never gives up (SIGTERM or Ctrl-C stops it). While etcd stays away the log says
so again every STILL_JOINING seconds when the node has not joined yet (it serves
nothing meanwhile: "still waiting for etcd at ..., is etcd running there?"),
every STILL_SERVING seconds once it serves on with its map. It is ready again once it
is registered and resynced. Every map the node sees, from the resync or the
watch, is applied if newer than the one it runs (Master.apply_map), whatever
happened meanwhile: a node whose vbuckets were given away while it was cut
off stops owning them as soon as it reads that map.

Leader. The serving member with the lowest create_revision leads (Gazette's
rule; a draining member only while none serves: layout.leader_of); every
node computes it from its copy, and each logs when it changes. Only the
leader writes the map, in a transaction that holds only if its own member key
still has the create_revision it registered with and the map still has the
mod_revision the leader last read (0: no map yet). So versions only grow and
no two different maps ever carry one version, even when two nodes believe
they lead for a moment. A new leader waits LEADER_SETTLE seconds before its
first write, so that members coming back after an etcd outage re-register
before it plans without them; but not when the leader before it is still a
member and drains (a planned handover: nobody is coming back). For longer,
up to REJOIN_GRACE (at least one lease TTL) after this node's session
began, it does not plan away the vbuckets of a node that the map names as
an owner but that is no member (yet): after an etcd outage that outlived
the leases, every node registers
again after its own backoff, and the leader would otherwise move a slower
node's vbuckets and back, for nothing. It plans as soon as every such node is
back; a node that died during the outage loses its vbuckets once the grace
is over. It starts the move timeout of a prepared map when it first sees it.

etcd lost its data (restarted empty, or from an old backup): no map key, no
member key, no lease. Every session fails, every node registers again with
the version of the map it runs in its member record, and the first one back
leads. It must not plan a FIRST map (that would give it every vbucket in one
step): a FIRST map is only for a cluster whose nodes run no map yet. When
etcd's map is older than one a node runs (planner.behind), the leader waits
LEADER_SETTLE and the rejoin grace for the nodes its own map names, then
writes its running map again, unchanged, under a version above every
member's (planner RESTORE), so every node accepts it and nothing moves;
members that did not come back are planned away after the grace, through
prepare and commit like any departure. A leader whose map is older than a
member's does not restore it (the difference would move in one step): it
revokes its lease and registers again, so that it becomes the youngest
member, and the next oldest decides the same way, until a node with the
newest map leads and restores that.

Drain (SIGTERM, see broky.server.master.process). `drain` marks the member key
"draining"; the leader plans without the node (it stays in `nodes` while it
is a member), prepares and commits the move; once the node has applied a
map in which it owns no vbucket and receives none, every worker runs it and
the handover records they reported are written, `drain` returns and the
master stops as usual (Goodbye to every connection), then `leave` revokes the
lease, which deletes its keys, and the leader writes a map without the node
at once. With no other serving member there is nowhere to hand over to, and
the drain ends at once. It is bounded by --drain-timeout.

A draining node does not lead, so the leader's drain is the same: the
record that says it drains hands the leadership to the oldest serving
member, which plans at once (no LEADER_SETTLE: a planned handover). Were the
draining leader to lead on, it would prepare and commit its own move, but
the map that drops it could only come from its successor, once it had left
and after LEADER_SETTLE: a node restarted at its address within that second
(a rolling restart) would still be in the map, and its clients would resume
their connections to the old process at the new one, which has no account
of them (UNACCOUNTED, though the old one said Goodbye).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from broky.cluster import planner
from broky.cluster.etcd import DELETE, PUT, Etcd, EtcdError, Event, Guard, KeyValue
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
from broky.errors import BrokyError
from broky.protocol.routing import NO_OWNER, VBucketMap
from broky.server.config import ServerConfig

log = logging.getLogger("broky.cluster")

TICK = 0.1  # seconds between two looks at the state when the watch says nothing
IDLE_TICK = 1.0  # the same when nothing is pending (no move, no drain, a settled leader)
RETRY_MIN = 0.25  # backoff between two sessions, doubling up to RETRY_MAX
RETRY_MAX = 2.0
LEADER_SETTLE = 1.0  # a new leader waits this long before its first map write
REJOIN_GRACE = RETRY_MAX + 2 * LEADER_SETTLE  # at least; see ClusterNode.rejoin_grace
CLASH_GRACE = 2.0  # beyond the TTL of the lease that holds our node id, at startup
CLASH_POLL = 0.5
REVOKE_TIMEOUT = 1.0
STILL_JOINING = 5.0  # seconds between two "still waiting for etcd" lines before the node has joined
STILL_SERVING = 30.0  # the same once it serves on with the map it has


class MapHost(Protocol):
    """What the node needs of the master (broky.server.master.process.Master)."""

    vmap: VBucketMap

    def apply_map(self, vmap: VBucketMap) -> bool: ...

    async def map_ready(self, version: int) -> bool: ...

    def sequences(self, record: bytes) -> None: ...

    async def runs_map(self, version: int) -> bool: ...


class NodeIdInUse(BrokyError):
    """Another live member holds this node id."""


class _LeaseLost(BrokyError):
    """etcd no longer knows this node's lease (or its member key)."""


class _Yielded(BrokyError):
    """This leader revoked its lease to give the leadership to a node with a newer map."""


class ClusterNode:
    def __init__(self, config: ServerConfig, host: MapHost, record: MemberRecord) -> None:
        assert config.cluster is not None
        self.url = parse_cluster_url(config.cluster)
        self.keys = Keys(self.url.prefix)
        self.ttl = config.lease_ttl
        self.move_timeout = config.move_timeout
        self.call_timeout = max(1.0, self.ttl / 3)
        # how long after a session began owners that are no members are waited for
        self.rejoin_grace = max(float(self.ttl), REJOIN_GRACE)
        self.host = host
        self.record = record
        self.node_id = record.node_id
        self.member_key = self.keys.member(record.node_id)
        # etcd's state under the prefix, as of the last resync and watch event
        self.members: dict[str, Member] = {}
        self.map: VBucketMap | None = None
        self.map_revision = 0  # mod_revision of the map key (0: none)
        self.ready: dict[str, int] = {}
        # this node's registration
        self.lease = 0
        self.create_revision = 0
        self.registered: MemberRecord | None = None  # what our member key holds
        self.reported_ready = 0  # the last version written to our ready key
        self.handovers: list[tuple[int, bytes]] = []  # (worker, Handed record) not written yet
        # what /readyz and /stats show
        self.etcd_up = False
        self.etcd_error = ""
        self.lost_at = 0.0  # monotonic time etcd was lost (0: never connected)
        self.joined = asyncio.Event()  # a map from etcd is applied
        self.draining = False
        self.drained = asyncio.Event()
        self.leader: str | None = None
        self.leading_since = 0.0
        self.session_since = 0.0  # monotonic time this node last resynced with etcd
        self.prepared: tuple[int, float] | None = None  # (version, monotonic time first seen) as leader
        self._wake = asyncio.Event()
        self._endpoint = 0
        self._lost_logged = False
        self._told_at = 0.0  # monotonic time etcd's absence was last logged
        self._was_up = False  # connected once at least (then a reconnection is "etcd is back")
        self._generation = 0  # changes seen in etcd (watch events, resyncs)
        self._planned = -1  # the generation the leader last planned from

    @property
    def is_leader(self) -> bool:
        me = self.members.get(self.node_id)
        return (
            self.etcd_up
            and me is not None
            and me.create_revision == self.create_revision
            and leader_of(self.members.values()) == self.node_id
        )

    # ------------------------------------------------------------ sessions

    async def run(self) -> None:
        """Take part until cancelled.

        Raises:
            NodeIdInUse: at startup, another live member holds this node id.
        """
        delay = RETRY_MIN
        while True:
            endpoint = self.url.endpoints[self._endpoint % len(self.url.endpoints)]
            etcd = Etcd(endpoint, self.call_timeout)
            try:
                await self._session(etcd)
            except EtcdError as exc:
                if self.etcd_up:
                    delay = RETRY_MIN
                self._lost(etcd, exc)
                self._still_lost(exc, RETRY_MAX)
            except _LeaseLost:
                log.warning("this node's lease is gone (etcd lost it or expired it): registering again")
                self._forget_lease()
                delay = RETRY_MIN
            except _Yielded:
                self._forget_lease()
                delay = RETRY_MIN
            finally:
                await etcd.close()
            if not self.etcd_up:
                self._endpoint += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _session(self, etcd: Etcd) -> None:
        await self._register(etcd)
        revision = await self._resync(etcd)
        self.session_since = time.monotonic()
        self._up(etcd)
        await _first_failure(self._keepalive(etcd), self._watch(etcd, revision + 1), self._loop(etcd))

    async def _register(self, etcd: Etcd) -> None:
        if self.lease:
            if await etcd.keepalive(self.lease) > 0:
                kv = await etcd.get(self.member_key)
                if kv is not None and kv.lease == self.lease:
                    self.create_revision = kv.create_revision
                    self.registered = _record_of(kv)
                    return
            log.warning("this node's lease expired while etcd was unreachable: joining again as a new member")
            self._forget_lease()
        self.lease, granted = await etcd.grant(self.ttl)
        waiting_since = 0.0
        limit = 0.0
        while True:
            record = self._record()
            created, kv = await etcd.create(self.member_key, record.encode(), self.lease)
            if created:
                assert kv is not None
                self.create_revision = kv.create_revision
                self.registered = record
                log.info(
                    "registered as member %r of %s (lease %x, ttl %d s)",
                    self.node_id, self.url, self.lease, granted,
                )  # fmt: skip
                return
            if kv is None:  # deleted meanwhile: try again at once
                continue
            now = time.monotonic()
            if not waiting_since:
                left, granted = await etcd.lease_ttl(kv.lease)
                waiting_since, limit = now, max(granted, left, 1) + CLASH_GRACE
                log.warning(
                    "node id %r is held by a live member (%s, lease %x, %d s left): waiting for that lease "
                    "to expire (a previous run of this node?)%s",
                    self.node_id, _holder(kv), kv.lease, left,
                    f", at most {limit:.0f} s" if not self.joined.is_set() else "",
                )  # fmt: skip
            elif now - waiting_since > limit and not self.joined.is_set():
                await _quietly(etcd.revoke(self.lease))
                self.lease = 0
                raise NodeIdInUse(
                    f"node id {self.node_id!r} is in use by a live member ({_holder(kv)}) of {self.url}: "
                    "give this node another --node-id"
                )
            await etcd.keepalive(self.lease)
            await asyncio.sleep(CLASH_POLL)

    def _forget_lease(self) -> None:
        self.lease = 0
        self.create_revision = 0
        self.registered = None
        self.reported_ready = 0

    async def _resync(self, etcd: Etcd) -> int:
        revision, kvs = await etcd.get_prefix(self.keys.prefix)
        self.members.clear()
        self.ready.clear()
        self.map, self.map_revision = None, 0  # as etcd has it now (applied only if newer)
        for kv in kvs:
            self._take(Event(PUT, kv))
        return revision

    def _up(self, etcd: Etcd) -> None:
        if self.etcd_up:
            return
        if self._was_up:
            log.warning(
                "etcd is back (%s) after %.1f s; member %r (lease %x)",
                etcd, time.monotonic() - self.lost_at, self.node_id, self.lease,
            )  # fmt: skip
        else:
            log.info("connected to etcd at %s", etcd)
        self.etcd_up = True
        self._was_up = True
        self.etcd_error = ""
        self._lost_logged = False
        self.leader = None  # leadership starts again (and settles) with every session
        self._planned = -1
        self._wake.set()

    def _lost(self, etcd: Etcd, exc: EtcdError) -> None:
        self.etcd_error = str(exc)
        if self.etcd_up:
            self.lost_at = time.monotonic()
        self.etcd_up = False
        if self._lost_logged:
            return
        self._lost_logged = True
        self._told_at = time.monotonic()
        if self.joined.is_set():
            log.error(
                "etcd unreachable (%s: %s): serving on with map version %d until it is back",
                etcd, exc, self.host.vmap.version,
            )  # fmt: skip
        else:
            log.error("cannot join the cluster: etcd unreachable (%s: %s); retrying", etcd, exc)
        if not self.lost_at:
            self.lost_at = time.monotonic()

    def _still_lost(self, exc: EtcdError, retry: float) -> None:
        """Say again, every STILL_JOINING (STILL_SERVING once joined) seconds, that etcd is
        still away, for how long and what to check: the only line in the log otherwise."""
        now = time.monotonic()
        joined = self.joined.is_set()
        if now - self._told_at < (STILL_SERVING if joined else STILL_JOINING):
            return
        self._told_at = now
        away = now - self.lost_at
        if joined:
            log.warning(
                "etcd at %s still unreachable after %.0f s (%s): serving on with map version %d; "
                "retrying every %g s",
                self.url, away, exc, self.host.vmap.version, retry,
            )  # fmt: skip
        else:
            log.warning(
                "still waiting for etcd at %s to join the cluster: %.0f s so far (%s); is etcd running "
                "there? retrying every %g s until it answers (SIGTERM or Ctrl-C stops the server)",
                self.url, away, exc, retry,
            )  # fmt: skip

    async def _keepalive(self, etcd: Etcd) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            if await etcd.keepalive(self.lease) <= 0:
                raise _LeaseLost

    async def _watch(self, etcd: Etcd, start: int) -> None:
        async for event in etcd.watch(self.keys.prefix, start):
            self._take(event)
            self._wake.set()

    async def _loop(self, etcd: Etcd) -> None:
        while True:
            self._wake.clear()
            await self._step(etcd)
            try:
                await asyncio.wait_for(self._wake.wait(), TICK if self._pending() else IDLE_TICK)
            except TimeoutError:
                pass

    def _pending(self) -> bool:
        """Something the loop must look at again soon though etcd may say nothing: a move
        (readiness, the move timeout), a drain, a leader that has not settled or has no map."""
        if self.draining or self.handovers or self.host.vmap.incoming is not None:
            return True
        if self.map is not None and self.map.incoming is not None:
            return True
        if not self.is_leader:
            return False
        return (
            self.map is None
            or time.monotonic() - self.leading_since < LEADER_SETTLE
            or self._rejoining(self.map)
            or self._behind() > 0
        )

    def _rejoining(self, vmap: VBucketMap | None) -> bool:
        """Within the rejoin grace of this session, a node `vmap` names as an owner (or an
        incoming owner) is no member: it may be registering again after an etcd outage."""
        if vmap is None or time.monotonic() - self.session_since >= self.rejoin_grace:
            return False
        return bool(_owner_ids(vmap) - self.members.keys())

    def _behind(self) -> int:
        """The newest map version a node runs when etcd's map is older (planner.behind)."""
        records = [m.record for m in self.members.values()]
        return planner.behind(self.map, records, self.host.vmap.version)

    def _record(self) -> MemberRecord:
        """This node's member record as it should be in etcd now."""
        return self.record._replace(map_version=self.host.vmap.version)

    # ------------------------------------------------------------ etcd's state

    def _take(self, event: Event) -> None:
        """Update the copy of etcd's state with one event (a resync feeds every key as a PUT)."""
        self._generation += 1
        kv = event.kv
        key = kv.key
        if key.startswith(self.keys.members):
            node_id = key[len(self.keys.members) :]
            if event.kind == DELETE:
                self.members.pop(node_id, None)
                return
            try:
                record = MemberRecord.decode(kv.value)
            except ValueError as exc:
                log.error("ignoring member key %s: %s", key, exc)
                return
            self.members[node_id] = Member(record, kv.create_revision, kv.lease)
        elif key.startswith(self.keys.ready):
            node_id = key[len(self.keys.ready) :]
            if event.kind == DELETE:
                self.ready.pop(node_id, None)
            else:
                self.ready[node_id] = decode_ready(kv.value)
        elif key.startswith(self.keys.handover):
            if event.kind == PUT:
                self.host.sequences(kv.value)
        elif key == self.keys.map:
            if event.kind == DELETE:
                log.warning(
                    "the map was deleted from etcd; serving on with map version %d", self.host.vmap.version
                )
                self.map, self.map_revision = None, 0
                return
            if kv.mod_revision <= self.map_revision:
                return  # seen already (our own write, read back in its transaction)
            try:
                vmap = VBucketMap.from_json(json.loads(kv.value))
            except ValueError as exc:
                log.error("ignoring the map in etcd: %s", exc)
                return
            self.map, self.map_revision = vmap, kv.mod_revision
            self._apply(vmap)

    def _apply(self, vmap: VBucketMap) -> None:
        current = self.host.vmap.version
        if vmap.version > current:
            self.host.apply_map(vmap)
            me = vmap.node_index(self.node_id)
            owned = 0 if me is None else sum(1 for node, _ in vmap.owners if node == me)
            moving = "" if vmap.incoming is None else ", vbuckets moving"
            log.info("applied map version %d: %d vbuckets owned here%s", vmap.version, owned, moving)
        elif vmap.version < current:
            log.warning("etcd's map version %d is older than this node's %d: ignored", vmap.version, current)
        if not self.joined.is_set():
            self.joined.set()

    # ------------------------------------------------------------ the loop

    async def _step(self, etcd: Etcd) -> None:
        record = self._record()
        if self.registered != record:
            guard = Guard("create", self.member_key, self.create_revision)
            ok, _ = await etcd.put_if([guard], self.member_key, record.encode(), self.lease)
            if not ok:
                raise _LeaseLost
            if self.registered is None or self.registered.state != record.state:
                log.info("member %r is now %s", self.node_id, record.state)
            self.registered = record
        while self.handovers:
            worker, handed = self.handovers[0]
            await etcd.put(self.keys.handover_of(self.node_id, worker), handed, self.lease)
            self.handovers.pop(0)
        if await self._ready_for_move():
            version = self.host.vmap.version
            await etcd.put(self.keys.ready_of(self.node_id), encode_ready(version), self.lease)
            self.reported_ready = version
            log.info("ready for map version %d: every worker and subscriber follows it", version)
        leader = leader_of(self.members.values())
        if leader != self.leader:
            before = self.members.get(self.leader) if self.leader is not None else None
            # the leader before it drains and is still a member: a planned handover
            handing = before.node_id if before is not None and not before.serving else None
            self.leader = leader
            if leader == self.node_id:
                self.leading_since = time.monotonic() - (LEADER_SETTLE if handing else 0.0)
                if handing:
                    log.info("this node (%r) is the leader: %r drains and handed it over", leader, handing)
                else:
                    log.info("this node (%r) is the leader", leader)
            elif handing == self.node_id:
                log.info("the leader is %r: this node drains and handed the leadership over", leader)
            else:
                log.info("the leader is %r", leader)
        if self.is_leader:
            await self._lead(etcd)
        if self.draining and not self.drained.is_set():
            await self._check_drained()

    async def _ready_for_move(self) -> bool:
        """The applied map prepares a move, not reported yet, and every worker and subscriber
        follows it (and it was not overtaken while the workers answered)."""
        vmap = self.host.vmap
        if vmap.incoming is None or vmap.version <= self.reported_ready:
            return False
        return await self.host.map_ready(vmap.version) and self.host.vmap.version == vmap.version

    async def _lead(self, etcd: Etcd) -> None:
        now = time.monotonic()
        current = self.map
        moving = current is not None and current.incoming is not None
        if moving and current is not None and (self.prepared is None or self.prepared[0] != current.version):
            self.prepared = (current.version, now)
        running = self.host.vmap
        newest = self._behind()
        if newest:  # etcd lost the map the nodes run: restore it (see the header)
            if now - self.leading_since < LEADER_SETTLE or self._rejoining(running):
                return
            if running.version < newest:
                await self._yield(etcd, newest)
        else:
            if current is not None and now - self.leading_since < LEADER_SETTLE:
                return
            if self._rejoining(current):
                return
            if current is not None and current.incoming is None and self._generation == self._planned:
                return  # nothing changed since the last plan (a prepared move is looked at every time)
        self._planned = self._generation
        timed_out = (
            current is not None
            and self.prepared is not None
            and self.prepared[0] == current.version
            and now - self.prepared[1] >= self.move_timeout
        )
        records = [m.record for m in self.members.values()]
        step = planner.plan(current, records, self.ready, timed_out, running if running.version else None)
        if step is None:
            return
        guards = [
            Guard("create", self.member_key, self.create_revision),
            Guard("mod", self.keys.map, self.map_revision),
        ]
        ok, kv = await etcd.put_if(guards, self.keys.map, json.dumps(step.vmap.to_json()).encode())
        if not ok or kv is None:
            log.info("map version %d not written: etcd changed meanwhile", step.vmap.version)
            return
        self._describe(step, now)
        self._take(Event(PUT, kv))

    async def _yield(self, etcd: Etcd, newest: int) -> None:
        """Leading with a map older than a member's while etcd has lost the newer one:
        give the leadership up (revoke the lease, register again as the youngest member)."""
        ahead = sorted(m.node_id for m in self.members.values() if m.record.map_version == newest)
        log.warning(
            "etcd has no map as new as the ones the nodes run; %s run%s map version %d, newer than "
            "this node's %d: registering again as the youngest member, so that a node with the newest "
            "map leads and restores it",
            ", ".join(ahead), "s" if len(ahead) == 1 else "", newest, self.host.vmap.version,
        )  # fmt: skip
        await etcd.revoke(self.lease)
        raise _Yielded

    def _describe(self, step: planner.Plan, now: float) -> None:
        vmap = step.vmap
        version = vmap.version
        serving = sorted(m.node_id for m in self.members.values() if m.serving)
        draining = sorted(m.node_id for m in self.members.values() if not m.serving)
        who = f"serving: {', '.join(serving)}" + (f"; draining: {', '.join(draining)}" if draining else "")
        if step.kind == planner.FIRST:
            log.info("map version %d written: the first map (%s)", version, who)
        elif step.kind == planner.RESTORE:
            log.warning(
                "map version %d written: the running map restored (etcd had %s; this node ran "
                "version %d, as new as any member's), nothing moved (%s)",
                version, "no map" if self.map is None else f"version {self.map.version}",
                self.host.vmap.version, who,
            )  # fmt: skip
        elif step.kind == planner.PREPARE:
            log.info("map version %d prepared: %d vbuckets to move (%s)", version, step.moving, who)
        elif step.kind == planner.COMMIT:
            waited = now - self.prepared[1] if self.prepared is not None else 0.0
            if step.not_ready:
                log.warning(
                    "map version %d committed: %d vbuckets moved after the move timeout (%.1f s); "
                    "not ready: %s",
                    version, step.moving, waited, ", ".join(step.not_ready),
                )  # fmt: skip
            else:
                log.info(
                    "map version %d committed: %d vbuckets moved, every member ready after %.2f s",
                    version, step.moving, waited,
                )  # fmt: skip
        elif step.kind == planner.CANCEL:
            log.info(
                "map version %d: the prepared move is cancelled, nothing has to move now (%s)", version, who
            )
        else:
            nodes = ", ".join(n.node_id for n in vmap.nodes)
            log.info("map version %d: nodes %s (%s)", version, nodes, who)

    # ------------------------------------------------------------ drain and leave

    async def drain(self, timeout: float) -> None:
        """Hand this node's vbuckets to the other members; return once it owns none
        (or after `timeout` seconds, logged)."""
        self.draining = True
        self.record = self.record._replace(state=DRAINING)
        log.info("draining: handing this node's vbuckets to the other members (at most %g s)", timeout)
        self._wake.set()
        try:
            await asyncio.wait_for(self.drained.wait(), timeout)
        except TimeoutError:
            me = self.host.vmap.node_index(self.node_id)
            owned = sum(1 for node, _ in self.host.vmap.owners if node == me) if me is not None else 0
            log.warning(
                "drain timed out after %g s: stopping with %d vbuckets still owned here", timeout, owned
            )

    def handed(self, worker: int, record: bytes) -> None:
        """Worker `worker` handed sequences over (a `Handed` record): written to etcd by
        the loop, for the new owners (leased: the keys go with this node)."""
        self.handovers.append((worker, record))
        self._wake.set()

    async def _check_drained(self) -> None:
        vmap = self.host.vmap
        me = vmap.node_index(self.node_id)
        holds = me is not None and (
            any(node == me for node, _ in vmap.owners) or any(node == me for node, _ in vmap.incoming or ())
        )
        if not holds:
            # every worker runs it, so each reported what it handed over; all of it written
            if not await self.host.runs_map(vmap.version) or self.handovers:
                return
            log.info("drained: map version %d gives this node no vbucket", vmap.version)
            self.drained.set()
        elif not any(m.serving for m in self.members.values() if m.node_id != self.node_id):
            log.warning("no other serving member to hand the vbuckets to: stopping with them")
            self.drained.set()

    async def leave(self) -> None:
        """Revoke the lease (etcd deletes this node's keys with it); bounded, errors logged."""
        if not self.lease:
            return
        lease, self.lease = self.lease, 0
        endpoint = self.url.endpoints[self._endpoint % len(self.url.endpoints)]
        etcd = Etcd(endpoint, REVOKE_TIMEOUT)
        try:
            await etcd.revoke(lease)
            log.info("left the cluster: lease %x revoked", lease)
        except EtcdError as exc:
            log.warning("could not revoke lease %x (%s): it expires within %d s", lease, exc, self.ttl)
        finally:
            await etcd.close()

    # ------------------------------------------------------------ what /readyz and /stats show

    def not_ready(self) -> str | None:
        """Why /readyz should answer 503, or None."""
        if not self.joined.is_set():
            if self.etcd_error:
                return f"joining the cluster: etcd unreachable ({self.etcd_error})"
            return "joining the cluster: waiting for the map"
        if not self.etcd_up:
            lost = time.monotonic() - self.lost_at
            return (
                f"etcd unreachable for {lost:.1f} s ({self.etcd_error}): serving with map version "
                f"{self.host.vmap.version}; this node may have lost its membership"
            )
        if self.draining:
            return "draining: handing its vbuckets to the other members before it stops"
        return None

    def view(self, workers: int) -> dict[str, Any]:
        """The "cluster" object of /stats (and the source of the broky_cluster_* metrics)."""
        vmap = self.host.vmap
        me = vmap.node_index(self.node_id)
        owned = [0] * workers
        incoming = [0] * workers
        for node, worker in vmap.owners:
            if node == me and worker < workers:
                owned[worker] += 1
        for node, worker in vmap.incoming or ():
            if node == me and worker < workers:
                incoming[worker] += 1
        members = sorted(self.members.values(), key=lambda m: m.create_revision)
        return {
            "node_id": self.node_id,
            "cluster": str(self.url),
            "state": "joining" if not self.joined.is_set() else self.record.state,
            "etcd_connected": self.etcd_up,
            "etcd_error": self.etcd_error or None,
            "etcd_down_seconds": None
            if self.etcd_up or not self.lost_at
            else round(time.monotonic() - self.lost_at, 3),
            "lease": f"{self.lease:x}" if self.lease else None,
            "lease_ttl_seconds": self.ttl,
            "leader": self.leader,
            "is_leader": self.is_leader,
            "map_version": vmap.version,
            "map_moving": vmap.incoming is not None,
            "ready_version": self.reported_ready,
            "members": [
                {
                    **m.record._asdict(),
                    "create_revision": m.create_revision,
                    "ready_version": self.ready.get(m.node_id, 0),
                }
                for m in members
            ],
            "vbuckets": owned,
            "vbuckets_incoming": incoming,
        }


def _owner_ids(vmap: VBucketMap) -> set[str]:
    """The node ids that own or receive a vbucket in `vmap`."""
    indexes = {node for node, _ in vmap.owners}
    indexes.update(i[0] for i in vmap.incoming or () if i != NO_OWNER)
    return {vmap.nodes[i].node_id for i in indexes}


def _record_of(kv: KeyValue) -> MemberRecord | None:
    try:
        return MemberRecord.decode(kv.value)
    except ValueError:
        return None


def _holder(kv: KeyValue) -> str:
    try:
        record = MemberRecord.decode(kv.value)
    except ValueError:
        return "an unreadable record"
    return f"{record.host}:{record.port}, {record.state}"


async def _quietly(call: Coroutine[Any, Any, Any]) -> None:
    try:
        await call
    except EtcdError:
        pass


async def _first_failure(*calls: Coroutine[Any, Any, None]) -> None:
    """Run the calls together until the first one ends; cancel the others; re-raise its error."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        error = t.exception() if t in done and not t.cancelled() else None
        if error is not None:
            raise error
    raise EtcdError("the session ended")
