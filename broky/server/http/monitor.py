"""Monitoring endpoints on the metrics port: the master's side (the worker's: broky.server.worker.views).

Theory of operation
-------------------
Workers count with plain integers (`WorkerStats`, per-connection attributes,
the `Matcher`'s pattern counts) and never talk to the master on their own.
When an endpoint is asked, the master sends each ready worker a STATS request
over its control channel (broky.server.handoff) naming the view it wants, and
each worker answers with `answer(shard, what)` (broky.server.worker.views: the
worker imports nothing of the HTTP side):

    b""                       the shard's counter snapshot (Shard.snapshot)
    b"connections:LIMIT"      its LIMIT busiest connections
    b"topics:LIMIT"           its LIMIT patterns with the most subscriptions

The master merges the answers into one response. A worker that is restarting
or does not answer within the timeout is reported as down (`"up": false` in
JSON, `broky_worker_up 0`), never waited for indefinitely. Every list is
bounded (`?limit=`, at most MAX_LIMIT, broky.server.handoff) and a worker's answer is trimmed to
fit one control message, so no endpoint can grow with the traffic.

Endpoints (JSON ones in the spirit of nats-server's /varz, /connz, /subsz; the
live console at / reads them, see broky.server.http.console):
    /metrics      Prometheus text format (broky.server.http.metrics)                          open
    /healthz      200 while the master runs (registered by the master)                   open
    /readyz       200 when every worker is ready, heard from and taking connections,     open
                  else 503 (master)
    /stats        {"node_id", "version", "map_version", "master", "workers": [...],      token
                   "totals", "cluster" (None for a single node; broky.cluster.node `view`)}
    /connections  {"total", "limit", "connections": [...]} busiest first                 token
    /topics       {"total", "limit", "topics": [...]} most subscriptions first           token

?limit= is a positive decimal integer in ASCII digits (`str.isdigit()` alone
would take "²", which int() refuses), of any length: over MAX_LIMIT it is
MAX_LIMIT, and a string of more digits than MAX_LIMIT has is never given to
int() (which refuses 4,301 digits or more). Anything else is a 400 (JSON, as
every error of broky.server.http.server) quoting the value cut short; other names in
the query string are ignored.

Exposure (decided). "open" endpoints answer anyone: Prometheus scrapes and
orchestrator probes usually carry no credential, and they list counters only
(per worker and reason, code, result or cause; the version; in a cluster the
node's own id and the leader's), never a client's address, name, pattern,
key_partition or connection id (tests/server/http/test_monitor_http.py holds /metrics to
it). "token" endpoints list more (pids, cluster members' addresses, clients'
addresses, names, patterns and connection ids): when the server has an
--auth-token, they need it as "Authorization: Bearer <token>" (the route is
registered `private`; broky.server.http.server answers 401 otherwise and says
whether it was missing, malformed or wrong). Without a token they are open,
like the client port, which is why such a server binds loopback only unless
started with --allow-unauthenticated (broky.server.security.exposure). Nothing
any endpoint lists lets a client claim another's connection: a resume needs
that connection's secret (Welcome.resume_token, broky.server.accounts), which
no endpoint and no log line shows; a connection id alone claims nothing.

/topics is exact by construction: an entry is one pattern on one worker (a
pattern subscribed on two workers is two entries), with the number of
subscriptions (sids, over all of that worker's connections) having exactly
that pattern. The node's `limit` busiest entries are each among their own
worker's `limit` busiest, so merging the workers' top lists loses nothing,
and "total" (entries on the node, the sum of broky_topics) counts every
pattern once per worker that has it. Summing one pattern's entries over the
workers is left to the reader: a pattern missing from a worker's list may
still exist there with fewer subscriptions.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from broky import __version__
from broky.protocol.routing import VBucketMap, to_ranges
from broky.server import handoff, histogram
from broky.server.config import ServerConfig
from broky.server.http import procstat
from broky.server.http.metrics import Exporter
from broky.server.http.server import HttpError, HttpServer, Request, Response, quote

if TYPE_CHECKING:
    from broky.server.master.supervisor import Supervisor


class ClusterView(Protocol):
    def view(self, workers: int) -> dict[str, Any]:
        """The node's part in the cluster, for /stats and /metrics (broky.cluster.node)."""


class Observed(Protocol):
    """What the endpoints read from the master (broky.server.master.process.Master is one; the
    master installs them, so this module does not import it back)."""

    config: ServerConfig
    vmap: VBucketMap
    http: HttpServer
    supervisor: Supervisor | None
    started: float
    handed_total: int
    refused_total: dict[str, int]
    handoffs_refused: dict[tuple[int, str], int]
    limits_refused: dict[str, int]
    unauthenticated_public: bool  # beyond loopback without a credential (broky.server.security.exposure)

    @property
    def cluster(self) -> ClusterView | None: ...

    async def worker_stats(self, what: bytes = b"") -> list[dict[str, Any] | None]:
        """Every worker's snapshot, or the view `what` (see `answer`); None: no answer."""


# Counters of a worker snapshot that /stats adds up into "totals".
TOTALS = (
    "connections", "connections_total", "subscriptions", "subscription_bytes", "topics",
    "messages_published", "messages_delivered", "bytes_received", "bytes_sent",
    "slow_consumer_disconnects", "bytes_discarded", "reads_stopped", "pending_bytes", "budget_cuts",
    "vbuckets_handed_over", "vbuckets_continued", "vbuckets_restarted",
    "lagging", "lag_entered", "lag_served", "lag_evicted",
)  # fmt: skip


# ---------------------------------------------------------------- master side


class Monitor:
    """The master's monitoring endpoints."""

    def __init__(self, master: Observed) -> None:
        self.master = master
        self.exporter = Exporter()

    async def metrics(self, request: Request) -> Response:
        snapshots = await self.master.worker_stats()
        body = self.exporter.render(snapshots, self._master_view(), self._cluster_view())
        return 200, self.exporter.content_type, body

    async def stats(self, request: Request) -> Response:
        snapshots = await self.master.worker_stats()
        workers: list[dict[str, Any]] = []
        totals: dict[str, Any] = dict.fromkeys(TOTALS, 0)
        dropped: dict[str, int] = {}
        master = self._master_view()
        vmap = self.master.vmap
        me = vmap.node_index(self.master.config.node_id)
        for index, snap in enumerate(snapshots):
            entry: dict[str, Any] = {
                "worker": index,
                "up": snap is not None,
                "vbuckets": [list(r) for r in to_ranges(vmap.vbuckets_of(me, index))]
                if me is not None
                else [],
                "restarts": master["worker_restarts"][index],
            }
            if snap is not None:
                entry.update(snap)
                entry.pop("latency_us", None)
                entry.pop("producer_us", None)
                entry["latency_seconds"] = _latency_summary(snap)
                entry["producer_latency_seconds"] = _producer_summary(snap)
                for name in TOTALS:
                    totals[name] += snap.get(name, 0)
                for reason, n in snap.get("dropped", {}).items():
                    dropped[reason] = dropped.get(reason, 0) + n
            workers.append(entry)
        totals["dropped"] = dropped
        totals["workers_up"] = sum(1 for s in snapshots if s is not None)
        body = {
            "node_id": self.master.config.node_id,
            "version": __version__,
            "map_version": vmap.version,
            "master": master,
            "workers": workers,
            "totals": totals,
            "cluster": self._cluster_view(),  # None for a single node (no --cluster)
        }
        return 200, "application/json", _json(body)

    async def connections(self, request: Request) -> Response:
        limit = _limit(request.query)
        views = await self.master.worker_stats(b"connections:%d" % limit)
        listed = [c for v in views if v is not None for c in v["connections"]]
        listed.sort(key=lambda c: c["messages_in"] + c["messages_out"], reverse=True)
        body = {
            "total": sum(v["total"] for v in views if v is not None),
            "limit": limit,
            "workers_up": sum(1 for v in views if v is not None),
            "connections": listed[:limit],
        }
        return 200, "application/json", _json(body)

    async def topics(self, request: Request) -> Response:
        limit = _limit(request.query)
        views = await self.master.worker_stats(b"topics:%d" % limit)
        # One entry per (pattern, worker): exact, see the theory of operation.
        topics = [t for v in views if v is not None for t in v["topics"]]
        topics.sort(key=lambda t: (-t["subscriptions"], t["pattern"], t["worker"]))
        body = {
            "total": sum(v["total"] for v in views if v is not None),  # (pattern, worker) entries
            "limit": limit,
            "workers_up": sum(1 for v in views if v is not None),
            "topics": topics[:limit],
        }
        return 200, "application/json", _json(body)

    def _master_view(self) -> dict[str, Any]:
        m = self.master
        sup = m.supervisor
        assert sup is not None
        return {
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - m.started, 3),
            "workers": m.config.workers,
            "workers_ready": sum(1 for wp in sup.workers if wp is not None and wp.ready),
            "worker_pids": [wp.pid if wp is not None else None for wp in sup.workers],
            "worker_restarts": list(sup.restarts_of),
            "connections_handed": m.handed_total,
            "handshakes_refused": dict(m.refused_total),
            "handoffs_pending": [len(wp.pending) if wp is not None else 0 for wp in sup.workers],
            "handoffs_refused": _by_worker(m.handoffs_refused, m.config.workers),
            "connections_refused": dict(m.limits_refused),
            "unauthenticated_public": m.unauthenticated_public,
            "vbuckets_owned": _owned(m),
            "http": _http_view(m),
            "processes": _processes(sup),
        }

    def _cluster_view(self) -> dict[str, Any] | None:
        cluster = self.master.cluster
        return None if cluster is None else cluster.view(self.master.config.workers)


def _http_view(master: Observed) -> dict[str, Any]:
    """The HTTP port's counters (broky.server.http.server) and the gateway's (broky.server.http.gateway)."""
    c = master.http.counters
    view: dict[str, Any] = {
        "connections": c.connections,
        "requests": c.requests,
        "answered": {method: dict(codes) for method, codes in c.answered.items()},  # method -> status -> n
        "refused_busy": c.refused_busy,
        "cut_slow": c.cut_slow,
        "too_large": c.too_large,
        "refused_memory": c.refused_memory,
        "body_bytes": master.http.bodies.held,
    }
    gw = getattr(master, "gateway", None)
    if gw is not None:
        g = gw.counters
        view.update(
            published=g.published,
            publish_requests=g.publish_requests,
            forwarded=g.forwarded,
            publish_retries=g.publish_retries,
            publish_failed=g.publish_failed,
            streams=g.streams,
            streams_total=g.streams_total,
            delivered=g.delivered,
            streams_cut=g.cut_slow,
            lagging=g.lagging,
            lag_entered=g.lag_entered,
            from_history=g.from_history,
            lag_evicted=g.lag_evicted,
            losses_told=g.losses_told,
            resumed=g.resumed,
            resume_unknown=g.resume_unknown,
            retry_later=g.retry_later,
        )
    return view


def _processes(sup: Supervisor) -> list[dict[str, Any]]:
    """The master's and each live worker's CPU, memory and descriptors (broky.server.http.procstat)."""
    named = [("master", os.getpid())]
    named += [(f"worker-{wp.index}", wp.pid) for wp in sup.workers if wp is not None]
    listed = []
    for name, pid in named:
        figures = procstat.read(pid)
        if figures is not None:
            listed.append({"process": name, "pid": pid, **figures})
    return listed


def _owned(master: Observed) -> list[int]:
    """The vbuckets each worker of this node owns in the node's current map."""
    vmap = master.vmap
    me = vmap.node_index(master.config.node_id)
    owned = [0] * master.config.workers
    for node, worker in vmap.owners:
        if node == me and worker < len(owned):
            owned[worker] += 1
    return owned


def _by_worker(counts: dict[tuple[int, str], int], workers: int) -> list[dict[str, int]]:
    """{(worker, cause): n} as one {cause: n} per worker index."""
    listed: list[dict[str, int]] = [{} for _ in range(workers)]
    for (index, cause), n in sorted(counts.items()):
        listed[index][cause] = n
    return listed


def install(master: Observed) -> Monitor:
    """Register the monitoring endpoints on the master's HTTP server."""
    mon = Monitor(master)
    http = master.http
    http.route("/metrics", mon.metrics)  # counters only: open, see the theory of operation
    http.route("/stats", mon.stats, private=True)
    http.route("/connections", mon.connections, private=True)
    http.route("/topics", mon.topics, private=True)
    return mon


def _limit(query: dict[str, str]) -> int:
    """?limit=: a positive decimal integer (ASCII digits; any length, clamped to handoff.MAX_LIMIT).

    Raises:
        HttpError: 400 (a JSON body, as every error of the HTTP server) for anything else.
    """
    raw = query.get("limit")
    if raw is None:
        return handoff.DEFAULT_LIMIT
    digits = raw.lstrip("0")
    if not raw.isascii() or not raw.isdigit() or not digits:  # str.isdigit() alone takes "²"
        raise HttpError(
            400,
            f"limit must be a positive integer (at most {handoff.MAX_LIMIT} are listed), not {quote(raw)}",
        )
    if len(digits) > len(str(handoff.MAX_LIMIT)):  # never int() of a huge string (4,301 digits raise)
        return handoff.MAX_LIMIT
    return min(int(digits), handoff.MAX_LIMIT)


def _latency_summary(snap: dict[str, Any]) -> dict[str, Any]:
    counts = snap.get("latency_us", [])
    deliveries = sum(counts)
    return {
        "deliveries": deliveries,
        "mean": (snap.get("latency_ns_sum", 0) / deliveries / 1e9) if deliveries else None,
        "p50_le": histogram.quantile(counts, 0.5),
        "p99_le": histogram.quantile(counts, 0.99),
        "p999_le": histogram.quantile(counts, 0.999),
    }


def _producer_summary(snap: dict[str, Any]) -> dict[str, Any]:
    counts = snap.get("producer_us", [])
    messages = sum(counts)
    return {
        "messages": messages,
        "not_comparable": snap.get("producer_not_comparable", 0),
        "mean": (snap.get("producer_ns_sum", 0) / messages / 1e9) if messages else None,
        "p50_le": histogram.quantile(counts, 0.5),
        "p99_le": histogram.quantile(counts, 0.99),
        "p999_le": histogram.quantile(counts, 0.999),
    }


def _json(body: Any) -> bytes:
    return (json.dumps(body, indent=1) + "\n").encode()
