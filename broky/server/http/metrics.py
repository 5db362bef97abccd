"""Prometheus metrics, gathered from the workers only when scraped.

Theory of operation
-------------------
Nothing here runs per message. Workers keep plain integer counters
(`WorkerStats` in broky.server.shard.stats) and two log2 latency histograms,
the broker's and the producer's (broky.server.histogram). When
/metrics is scraped, the master asks every worker for its snapshot over the
control channel (broky.server.http.monitor), then this module turns the snapshots
into metric families and renders them in Prometheus' text format (0.0.4).
No multiprocess mode, no shared files, no lock.

The rendering is this module's own (`Family`, about forty lines): the format
is a few escaping rules, and prometheus_client, which rendered it before,
imports its push gateway's and HTTP server's stdlib (http.client,
urllib.request, http.server, wsgiref) with it, 4.6 MB of resident memory in
the master for a 4 KB text. The tests parse every scrape with
prometheus_client's parser and a real Prometheus scrapes a real server.

Names follow the Prometheus conventions: `broky_` prefix, base units
(seconds, bytes), `_total` on counters. Every worker series carries a
`worker` label; no label ever holds a key or a key_partition, so the number
of series is bounded by workers x reasons. A worker that restarted starts its
counters from zero again, which Prometheus' rate() treats as a counter reset;
`broky_worker_restarts_total` says when that happened. A worker that did not
answer the scrape has `broky_worker_up 0` and no other series in that scrape,
but for Prometheus' standard `process_*` metrics, which the master reads from
/proc for itself and every live worker (broky.server.http.procstat), one series per
process with a `process` label (`master`, `worker-0`, ..., as the JSON log
names them). Counters by a closed set of labels (drop reasons, error codes,
resume results, refusal limits, TLS failures) have every series from the
start, at 0 until it happens, so that alerts and dashboards need no `or
vector(0)` and show 0, not "No data"; `broky_http_requests_total{method,
code}` has a series per combination answered.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from broky import __version__
from broky.errors import ErrorCode
from broky.server import histogram
from broky.server.shard.stats import DropReason

TLS_FAILURE_REASONS = (
    "timeout",
    "certificate",
    "protocol",
    "closed",
)  # broky.server.security.tls FAILURE_REASONS

# (metric name, snapshot field, help) of the per-worker counters and gauges.
COUNTERS = (
    ("broky_messages_published_total", "messages_published", "Messages received from publishers."),
    (
        "broky_messages_delivered_total",
        "messages_delivered",
        "Messages queued to subscribing connections (one per connection).",
    ),
    ("broky_bytes_received_total", "bytes_received", "Bytes read from client connections."),
    ("broky_bytes_sent_total", "bytes_sent", "Bytes written to client connections."),
    ("broky_connections_opened_total", "connections_total", "Client connections adopted by the worker."),
    (
        "broky_tls_handshakes_total",
        "tls_handshakes",
        "TLS connections whose handshake, and Hello inside TLS, the worker completed.",
    ),
    (
        "broky_slow_consumer_disconnects_total",
        "slow_consumer_disconnects",
        "Connections closed for staying over their pending bound past the deadline.",
    ),
    (
        "broky_bytes_discarded_total",
        "bytes_discarded",
        "Unsent bytes of connections reset at the end of a lingering close.",
    ),
    (
        "broky_reads_stopped_total",
        "reads_stopped",
        "Times a connection was read no more because of its unread replies (--max-reply-bytes).",
    ),
    (
        "broky_memory_trims_total",
        "memory_trims",
        "Heap trims (malloc_trim) after connections with many subscription bytes or pending bytes left.",
    ),
    (
        "broky_budget_cuts_total",
        "budget_cuts",
        "Connections closed to keep the worker within its share of --memory-budget, the most "
        "pending bytes first (told what they lost, as slow_consumer, when they reconnect).",
    ),
    (
        "broky_budget_cut_bytes_total",
        "budget_cut_bytes",
        "Pending outbound bytes freed by closing connections for the memory budget.",
    ),
    (
        "broky_replay_evicted_messages_total",
        "replay_evicted_messages",
        "Messages that left the replay buffer for its bounds (--replay-bytes, --replay-max-age, "
        "the memory budget); a subscriber asking for one is told (evicted).",
    ),
    (
        "broky_replay_shrinks_total",
        "replay_shrinks",
        "Times the replay buffer gave memory back so that no connection had to be cut for the budget.",
    ),
    (
        "broky_replayed_messages_total",
        "messages_replayed",
        "Retained messages queued to subscriptions that started from positions (since, since_time, last).",
    ),
    (
        "broky_producer_latency_not_comparable_total",
        "producer_not_comparable",
        "Published messages whose read began with a ts_producer more than 1 s ahead of the "
        "broker's clock or 60 s behind it: not observed in broky_producer_latency_seconds.",
    ),
    (
        "broky_lag_entered_total",
        "lag_entered",
        "Times a connection reached its pending bound and began lagging: read on from the replay "
        "buffer as it drains instead of losing (without a replay buffer it loses, slow_consumer).",
    ),
    (
        "broky_lag_served_messages_total",
        "lag_served",
        "Messages sent to lagging connections from the replay buffer (served from history).",
    ),
    (
        "broky_lag_evicted_messages_total",
        "lag_evicted",
        "Messages lagging connections were owed that the replay buffer evicted before they read "
        'them (evicted before read; told, and counted in broky_messages_dropped_total{reason="evicted"}).',
    ),
    (
        "broky_bounded_reads_total",
        "bounded_reads",
        "Bounded reads (Read frames) served: a closed range of retained messages, then a ReadDone "
        "per vbucket.",
    ),
    (
        "broky_bounded_read_messages_total",
        "bounded_read_messages",
        "Retained messages queued to bounded reads.",
    ),
    (
        "broky_resumes_by_positions_total",
        "resumes_by_positions",
        "Resumed connections whose undelivered messages were left to the replay (Hello.positions), "
        "not told lost.",
    ),
    ("broky_match_cache_hits_total", "match_cache_hits", "Subscription matcher cache hits."),
    ("broky_match_cache_misses_total", "match_cache_misses", "Subscription matcher cache misses."),
    (
        "broky_vbuckets_handed_over_total",
        "vbuckets_handed_over",
        "Vbuckets whose sequence (epoch, next offset) this worker handed to their new owner.",
    ),
    (
        "broky_vbuckets_continued_total",
        "vbuckets_continued",
        "Vbuckets moved here whose sequence goes on here (same epoch, next offset).",
    ),
    (
        "broky_vbuckets_restarted_total",
        "vbuckets_restarted",
        "Vbuckets moved here whose sequence starts a new epoch here (a failover, or the old "
        "owner's record did not come within --move-timeout).",
    ),
    (
        "broky_server_restart_graces_total",
        "node_restart_graces",
        "Times publishes were held because a client showed that this server restarted under it.",
    ),
    (
        "broky_accounts_unavailable_total",
        "accounts_unavailable",
        "Connections served without an account (the table was full): they cannot be resumed.",
    ),
    (
        "broky_group_delivered_total",
        "group_delivered",
        "Messages queued to consumer group members (one member per group; redeliveries included).",
    ),
    (
        "broky_group_paused_total",
        "group_paused",
        "Times a group member reached its max_in_flight and was told so (GroupNotice PAUSED).",
    ),
    (
        "broky_group_drain_expired_total",
        "group_drain_expired",
        "Key-shared vbucket moves that went ahead at drain_timeout, before the old member was done.",
    ),
    (
        "broky_group_deferred_total",
        "group_deferred",
        "Deliveries of ack subscriptions not queued to a connection over its pending bound: "
        "not lost, delivered again at their ack deadline.",
    ),
    (
        "broky_group_evicted_total",
        "group_evicted",
        "Messages of ack groups that waited in a backlog as positions and left the replay buffer "
        "before a member had room for them (told as EVICTED).",
    ),
    ("broky_acks_total", "acks", "Deliveries of ack subscriptions acknowledged (Ack ACK)."),
    ("broky_nacks_total", "nacks", "Deliveries of ack subscriptions negatively acknowledged (Ack NACK)."),
    ("broky_acks_in_progress_total", "acks_in_progress", "Ack IN_PROGRESS: ack deadlines started again."),
    (
        "broky_acks_unknown_total",
        "acks_unknown",
        "Ack positions the group did not hold (settled already, or never delivered): ignored.",
    ),
    ("broky_ack_expired_total", "ack_expired", "Deliveries not acknowledged within ack_wait."),
    ("broky_redelivered_total", "redelivered", "Messages of ack subscriptions delivered again."),
    (
        "broky_dead_lettered_total",
        "dead_lettered",
        "Messages published to a group's dead_letter key after max_deliveries.",
    ),
)
GAUGES = (
    ("broky_connections", "connections", "Open client connections."),
    ("broky_subscriptions", "subscriptions", "Active subscriptions (sids of all connections)."),
    (
        "broky_subscription_bytes",
        "subscription_bytes",
        "Subscription bytes of all connections (pattern + key_partition + 64 per token).",
    ),
    ("broky_topics", "topics", "Distinct subscription patterns on the worker."),
    ("broky_worker_resident_memory_bytes", "rss_bytes", "Resident memory of the worker process."),
    (
        "broky_pending_bytes",
        "pending_bytes",
        "Outbound bytes queued to the worker's connections (as counted against its memory budget).",
    ),
    ("broky_replay_bytes", "replay_bytes", "Bytes of messages retained for replay."),
    (
        "broky_lagging_connections",
        "lagging",
        "Connections lagging now: past their pending bound, read on from the replay buffer.",
    ),
    ("broky_replay_messages", "replay_messages", "Messages retained for replay."),
    ("broky_groups", "groups", "Consumer groups with a member on the worker."),
    ("broky_group_members", "group_members", "Consumer group members on the worker."),
    ("broky_in_flight", "in_flight", "Delivered messages of ack subscriptions not yet acknowledged."),
    (
        "broky_memory_budget_bytes",
        "memory_budget",
        "The worker's share of --memory-budget.",
    ),
    (
        "broky_restart_grace_seconds",
        "restart_grace_seconds",
        "How long this worker last held publishes after it replaced a dead worker, or after the "
        "server restarted (0: it did not).",
    ),
    (
        "broky_restart_subscribers_missing",
        "restart_subscribers_missing",
        "Subscribing connections of the dead worker not back when the restart grace ended.",
    ),
)
# Whose account answered a reconnecting client (Hello.previous): see broky.server.accounts.
RESUME_RESULTS = ("connection_lost", "worker_restart", "unknown", "refused")
# Every error code, at 0 until it is sent (broky_errors_sent_total) or refuses a handshake
# (broky_handshakes_refused_total), as the drop reasons: a dashboard has a series to show.
ERROR_CODES = tuple(code.name for code in ErrorCode if code is not ErrorCode.NONE)
REFUSAL_REASONS = ("count", "bytes")  # the per-connection limit a refused Subscribe was over


def _number(value: float) -> str:
    """A sample value as the text format writes it (Go's ParseFloat reads it back)."""
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(value)


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Family:
    """One metric family of the text format: # HELP, # TYPE and its samples' lines."""

    __slots__ = ("name", "kind", "doc", "labels", "lines")

    def __init__(self, name: str, kind: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name = name  # a counter's ends in _total, as its samples'
        self.kind = kind  # "counter", "gauge" or "histogram"
        self.doc = doc
        self.labels = tuple(labels)
        self.lines: list[str] = []

    def add_metric(self, values: Sequence[str], value: float) -> None:
        """One sample of a counter or a gauge, with these label values."""
        self.lines.append(f"{self.name}{self._labels(values)} {_number(value)}\n")

    def add_histogram(
        self, values: Sequence[str], buckets: Sequence[tuple[str, float]], total: float
    ) -> None:
        """One histogram: cumulative (le, count) buckets ending with +Inf, and the sum."""
        for le, count in buckets:
            self.lines.append(f"{self.name}_bucket{self._labels(values, le)} {_number(count)}\n")
        count = buckets[-1][1] if buckets else 0
        self.lines.append(f"{self.name}_count{self._labels(values)} {_number(count)}\n")
        self.lines.append(f"{self.name}_sum{self._labels(values)} {_number(total)}\n")

    def _labels(self, values: Sequence[str], le: str | None = None) -> str:
        pairs = list(zip(self.labels, values, strict=True))
        if le is not None:
            pairs.append(("le", le))
        if not pairs:
            return ""
        return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(pairs)) + "}"

    def render(self) -> str:
        doc = self.doc.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {self.name} {doc}\n# TYPE {self.name} {self.kind}\n" + "".join(self.lines)


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Family:
    return Family(name, "gauge", doc, labels)


def _counter(name: str, doc: str, labels: Sequence[str] = ()) -> Family:
    return Family(name, "counter", doc, labels)


class SnapshotCollector:
    """The metric families of the snapshots of the latest scrape."""

    def __init__(self) -> None:
        self.snapshots: Sequence[dict[str, Any] | None] = ()
        self.master: dict[str, Any] = {}
        self.cluster: dict[str, Any] | None = None

    def collect(self) -> Iterator[Family]:
        snaps = [(str(i), s) for i, s in enumerate(self.snapshots) if s is not None]
        up = _gauge("broky_worker_up", "1 if the worker answered this scrape.", labels=["worker"])
        for i, s in enumerate(self.snapshots):
            up.add_metric([str(i)], 1.0 if s is not None else 0.0)
        yield up
        for name, field, doc in COUNTERS:
            counter = _counter(name, doc, labels=["worker"])
            for w, s in snaps:
                counter.add_metric([w], float(s.get(field, 0)))
            yield counter
        for name, field, doc in GAUGES:
            gauge = _gauge(name, doc, labels=["worker"])
            for w, s in snaps:
                gauge.add_metric([w], float(s.get(field, 0)))
            yield gauge
        dropped = _counter(
            "broky_messages_dropped_total",
            "Messages or deliveries dropped, by reason.",
            labels=["worker", "reason"],
        )
        refused = _counter(
            "broky_subscriptions_refused_total",
            "Subscribes refused with SUBSCRIPTION_LIMIT, by the limit: count "
            "(--max-subscriptions) or bytes (--max-subscription-bytes).",
            labels=["worker", "reason"],
        )
        denied = _counter(
            "broky_permission_denied_total",
            "Publishes and Subscribes refused with PERMISSION_DENIED (--users), by user.",
            labels=["worker", "user"],
        )
        errors = _counter(
            "broky_errors_sent_total", "Error frames sent to clients, by code.", labels=["worker", "code"]
        )
        tls_failed = _counter(
            "broky_tls_handshake_failures_total",
            "TLS handshakes that failed, by reason: timeout (--hello-timeout), certificate (one was "
            "refused: mutual TLS), protocol (not TLS, or none this server speaks), closed (the peer left).",
            labels=["worker", "reason"],
        )
        resumes = _counter(
            "broky_resumes_total",
            "Reconnecting clients naming their previous connection, by whose account answered: "
            "this worker's (connection_lost), a dead worker's (worker_restart), none (unknown); "
            "refused: claims of an account without its resume token (counted as unknown too).",
            labels=["worker", "result"],
        )
        latency = Family(
            "broky_broker_latency_seconds",
            "histogram",
            "Time inside the broker per delivered message: from the arrival of its read "
            "to that read's writes.",
            labels=["worker"],
        )
        producer = Family(
            "broky_producer_latency_seconds",
            "histogram",
            "Time from ts_producer (the publisher's clock) to ts_broker (the worker's, at the "
            "arrival of the read), per published message: the age of the read's first message, "
            "for each message of reads that begin with a Message with a ts_producer, when the "
            "clocks are comparable (1 s ahead to 60 s behind).",
            labels=["worker"],
        )
        for w, s in snaps:
            # Every DropReason (and ErrorCode, ...) is exported, at 0 until it happens.
            reasons = dict.fromkeys(DropReason, 0) | s.get("dropped", {})
            for reason, n in sorted(reasons.items()):
                dropped.add_metric([w, reason], float(n))
            limits = dict.fromkeys(REFUSAL_REASONS, 0) | s.get("subscriptions_refused", {})
            for reason, n in sorted(limits.items()):
                refused.add_metric([w, reason], float(n))
            for user, n in sorted(s.get("permission_denied", {}).items()):
                denied.add_metric([w, user], float(n))
            for code, n in sorted((dict.fromkeys(ERROR_CODES, 0) | s.get("errors", {})).items()):
                errors.add_metric([w, code.lower()], float(n))
            for reason, n in sorted(
                (dict.fromkeys(TLS_FAILURE_REASONS, 0) | s.get("tls_failures", {})).items()
            ):
                tls_failed.add_metric([w, reason], float(n))
            results = dict.fromkeys(RESUME_RESULTS, 0) | s.get("resumes", {})
            for result, n in sorted(results.items()):
                resumes.add_metric([w, result], float(n))
            counts = s.get("latency_us", [])
            latency.add_histogram(
                [w], histogram.prometheus_buckets(counts), float(s.get("latency_ns_sum", 0)) / 1e9
            )
            producer.add_histogram(
                [w],
                histogram.prometheus_buckets(s.get("producer_us", [])),
                float(s.get("producer_ns_sum", 0)) / 1e9,
            )
        yield dropped
        yield refused
        yield denied
        yield errors
        yield resumes
        yield tls_failed
        yield latency
        yield producer
        yield from self._master_metrics()

    def _master_metrics(self) -> Iterator[Family]:
        m = self.master
        if not m:
            return
        restarts = _counter(
            "broky_worker_restarts_total", "Times the worker was restarted after dying.", labels=["worker"]
        )
        for i, n in enumerate(m.get("worker_restarts", [])):
            restarts.add_metric([str(i)], float(n))
        yield restarts
        handed = _counter(
            "broky_connections_accepted_total", "Connections whose Hello the master accepted and handed over."
        )
        handed.add_metric([], float(m.get("connections_handed", 0)))
        yield handed
        refused = _counter(
            "broky_handshakes_refused_total",
            "Connections refused at the handshake, by code.",
            labels=["code"],
        )
        for code, n in sorted((dict.fromkeys(ERROR_CODES, 0) | m.get("handshakes_refused", {})).items()):
            refused.add_metric([code.lower()], float(n))
        yield refused
        handoffs = _counter(
            "broky_handoffs_refused_total",
            "Connections a worker did not take from the master, by cause: no_fd or an errno name "
            "(the worker refused it), no_answer, channel_full.",
            labels=["worker", "cause"],
        )
        for i, causes in enumerate(m.get("handoffs_refused", [])):
            for cause, n in sorted(causes.items()):
                handoffs.add_metric([str(i), cause], float(n))
        yield handoffs
        limits = _counter(
            "broky_connections_refused_total",
            "Handshakes refused for a connection limit, by the limit: max_connections (a worker's, "
            "SERVER_BUSY), max_connections_per_address or handshake_rate (TOO_MANY_CONNECTIONS).",
            labels=["reason"],
        )
        for limit, n in sorted(m.get("connections_refused", {}).items()):
            limits.add_metric([limit], float(n))
        yield limits
        ready = _gauge("broky_workers_ready", "Workers ready to serve.")
        ready.add_metric([], float(m.get("workers_ready", 0)))
        yield ready
        exposed = _gauge(
            "broky_unauthenticated_public",
            "1 when the server listens beyond loopback without --auth-token or --users "
            "(--allow-unauthenticated), else 0.",
        )
        exposed.add_metric([], float(m.get("unauthenticated_public", False)))
        yield exposed
        info = _gauge("broky_build_info", "Always 1; the version is a label.", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info
        owned = _gauge(
            "broky_vbuckets_owned", "Vbuckets the worker owns in the node's current map.", labels=["worker"]
        )
        for i, n in enumerate(m.get("vbuckets_owned", [])):
            owned.add_metric([str(i)], float(n))
        yield owned
        yield from _http_metrics(m.get("http", {}))
        yield from _process_metrics(m.get("processes", []))
        yield from self._cluster_metrics()

    def _cluster_metrics(self) -> Iterator[Family]:
        """broky_cluster_*: only in cluster mode (--cluster)."""
        c = self.cluster
        if c is None:
            return
        gauges = (
            ("broky_cluster_map_version", "Version of the vbucket map this node applied.", c["map_version"]),
            (
                "broky_cluster_map_moving",
                "1 while the applied map prepares a move (vbuckets incoming to new owners).",
                c["map_moving"],
            ),
            ("broky_cluster_members", "Live members this node sees in etcd.", len(c["members"])),
            ("broky_cluster_leader", "1 if this node is the cluster's leader.", c["is_leader"]),
            (
                "broky_cluster_etcd_up",
                "1 while this node is connected and registered in etcd.",
                c["etcd_connected"],
            ),
            (
                "broky_cluster_draining",
                "1 while this node hands its vbuckets over before it stops.",
                c["state"] == "draining",
            ),
        )
        info = _gauge(
            "broky_cluster_node_info",
            "Always 1; this node's id and the leader it sees (empty: none) are labels.",
            labels=["node_id", "leader"],
        )
        info.add_metric([c["node_id"], c["leader"] or ""], 1.0)
        yield info
        for name, doc, value in gauges:
            gauge = _gauge(name, doc)
            gauge.add_metric([], float(value))
            yield gauge


# The HTTP port (broky.server.http.server, broky.server.http.gateway): (name, key in the master's "http"
# view, help); a name ending in _total is a counter, else a gauge.
HTTP_METRICS = (
    ("broky_http_connections", "connections", "HTTP connections open now."),
    (
        "broky_http_refused_total",
        "refused_busy",
        "HTTP connections refused over --http-max-connections (503; an event stream: told to come back).",
    ),
    (
        "broky_http_cut_slow_total",
        "cut_slow",
        "HTTP clients cut for slowness: a head or body not sent in time (408), an answer not read in time.",
    ),
    ("broky_http_too_large_total", "too_large", "HTTP request bodies over --http-max-body (413)."),
    (
        "broky_http_refused_memory_total",
        "refused_memory",
        "HTTP request bodies refused (503) while others held --http-body-memory.",
    ),
    ("broky_http_body_bytes", "body_bytes", "Bytes of HTTP request bodies held now."),
    ("broky_http_published_total", "published", "Messages published through POST /v1/pub/."),
    (
        "broky_http_forwarded_total",
        "forwarded",
        "Messages of POST /v1/pub/ published at a worker of another node (the vbucket's owner).",
    ),
    (
        "broky_http_publish_retries_total",
        "publish_retries",
        "POST /v1/pub/ requests tried a second time: their vbucket moved, or its node went.",
    ),
    (
        "broky_http_publish_failed_total",
        "publish_failed",
        "POST /v1/pub/ requests answered 503: not every message could be placed.",
    ),
    ("broky_http_streams", "streams", "HTTP subscription streams open now (GET /v1/sub/)."),
    (
        "broky_http_streams_cut_total",
        "streams_cut",
        "HTTP streams cut: a slow reader without a replay buffer (--replay-bytes 0), or a failed "
        "read from history.",
    ),
    (
        "broky_http_streams_lagging",
        "lagging",
        "HTTP streams lagging now: past their pending bound, read on from the replay buffer.",
    ),
    ("broky_http_stream_lags_total", "lag_entered", "Times an HTTP stream started lagging."),
    (
        "broky_http_stream_history_messages_total",
        "from_history",
        "Messages sent to lagging HTTP streams from the replay buffer (bounded reads).",
    ),
    (
        "broky_http_stream_evicted_total",
        "lag_evicted",
        "Messages evicted from the replay buffer before a lagging HTTP stream read them (told to it).",
    ),
    ("broky_http_stream_losses_total", "losses_told", "Loss events written to HTTP streams (ndjson, SSE)."),
    ("broky_http_resumed_total", "resumed", "Event streams resumed from their Last-Event-ID."),
    (
        "broky_http_resume_unknown_total",
        "resume_unknown",
        "Last-Event-IDs the server could not use whole (told to the client as a loss).",
    ),
    (
        "broky_http_retry_later_total",
        "retry_later",
        "Event streams told to come back (200, retry: and event: unavailable): the workers were not "
        "ready, or the subscription failed.",
    ),
)


def _http_metrics(view: dict[str, Any]) -> Iterator[Family]:
    requests = _counter(
        "broky_http_requests_total",
        "HTTP requests answered, by method (get, head, post, options; other: any other method, or a "
        "request that did not parse) and status code (a stream: 200).",
        labels=["method", "code"],
    )
    for method, codes in sorted(view.get("answered", {}).items()):
        for code, n in sorted(codes.items()):
            requests.add_metric([method, code], float(n))
    yield requests
    for name, key, doc in HTTP_METRICS:
        family = _counter(name, doc) if name.endswith("_total") else _gauge(name, doc)
        family.add_metric([], float(view.get(key, 0)))
        yield family


# Prometheus' standard process metrics (broky.server.http.procstat): (name, figure, type, help).
PROCESS_METRICS = (
    (
        "process_cpu_seconds_total",
        "cpu_seconds",
        "counter",
        "Total user and system CPU time spent in seconds.",
    ),
    ("process_resident_memory_bytes", "resident_bytes", "gauge", "Resident memory size in bytes."),
    ("process_virtual_memory_bytes", "virtual_bytes", "gauge", "Virtual memory size in bytes."),
    ("process_open_fds", "open_fds", "gauge", "Number of open file descriptors."),
    ("process_max_fds", "max_fds", "gauge", "Maximum number of open file descriptors."),
    (
        "process_start_time_seconds",
        "start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    ),
)


def _process_metrics(processes: Sequence[dict[str, Any]]) -> Iterator[Family]:
    """One series per process of the server, labelled `process` (master, worker-0, ...)."""
    for name, key, kind, doc in PROCESS_METRICS:
        family = Family(name, kind, doc + " Per process of the server: master, worker-N.", ["process"])
        for proc in processes:
            if proc.get(key) is not None:
                family.add_metric([proc["process"]], float(proc[key]))
        yield family


class Exporter:
    """Renders /metrics from the snapshots of one scrape."""

    # The classic text format, understood by every Prometheus version; the
    # names we use need none of the newer format's UTF-8 quoting.
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.collector = SnapshotCollector()

    def render(
        self,
        snapshots: Sequence[dict[str, Any] | None],
        master: dict[str, Any],
        cluster: dict[str, Any] | None = None,
    ) -> bytes:
        """The Prometheus text exposition of these snapshots (and of the cluster view, if any)."""
        self.collector.snapshots = snapshots
        self.collector.master = master
        self.collector.cluster = cluster
        try:
            return "".join(f.render() for f in self.collector.collect()).encode()
        finally:
            self.collector.snapshots = ()
            self.collector.master = {}
            self.collector.cluster = None
