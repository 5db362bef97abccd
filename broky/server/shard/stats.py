"""A worker's counters, and the snapshot of them that the master reads.

Theory of operation
-------------------
Every counter is a plain attribute of `WorkerStats`, bumped where the thing
happens (the read path adds up its counts and bumps them once per read) and
never locked: a worker is one thread. For /stats and /metrics the master
asks each worker over the control channel (a STATS request, answered by
broky.server.worker.views `answer`); broky.server.shard.monitoring copies the
counters and adds what is read only then.

Drops are counted by `DropReason`, the one list of why a worker dropped a
message or a delivery: the keys of `WorkerStats.dropped`, of /stats
"dropped" and the `reason` label of broky_messages_dropped_total. A drop that
a subscriber is told of (a LossNotice) carries the LossReason of the same
name (`DROPPED_AS`); the two stay two lists because each has members the
other lacks (see `DropReason`).
"""

from __future__ import annotations

import enum

from broky.errors import ErrorCode
from broky.protocol import LossReason
from broky.server import histogram

_LATENCY_BUCKETS = 32  # log2 buckets of microseconds


class DropReason(enum.StrEnum):
    """Why a worker dropped a message or a delivery; the value is the metric label.

    The wire's LossReason tells a subscriber what it lost. The drops a
    subscriber lost have a LossReason of the same name (`DROPPED_AS`); the
    others (no_subscribers, not_my_vbucket) are not a loss of any subscriber.
    LossReason's own others (unknown, unaccounted, epoch_changed) tell of
    messages nothing dropped here and now: how many is unknown, or a sequence
    restarted. EVICTED is both: told to a start from a position the replay
    buffer no longer holds (not a drop), and to a lagging connection whose
    owed messages it evicted (a drop: broky.server.shard.lag).
    """

    NO_SUBSCRIBERS = "no_subscribers"  # a publish that matched no subscription
    SLOW_CONSUMER = "slow_consumer"  # deliveries past a connection's pending bytes, or its cut
    NOT_MY_VBUCKET = "not_my_vbucket"  # a publish for a vbucket of another worker: refused
    SHUTDOWN = "shutdown"  # deliveries still queued when the worker stopped
    # Deliveries queued to a connection that dropped, never received (counted when
    # its client reconnects and says what it received: broky.server.accounts), by
    # whose account answered: this worker's, or a dead worker's.
    CONNECTION_LOST = "connection_lost"
    WORKER_RESTART = "worker_restart"
    # Consumer groups (broky.server.shard.groups): a group's messages that found every member at its
    # bound and the group's backlog full, or whose last member left; messages of an ack group
    # delivered max_deliveries times without an ack.
    GROUP_OVERFLOW = "group_overflow"
    MAX_DELIVERIES = "max_deliveries"
    # Deliveries a lagging connection was owed that the replay buffer evicted before it read
    # them (broky.server.shard.lag): told, LossReason EVICTED.
    EVICTED = "evicted"


# The drop a LossNotice's reason tells of, for those that are drops (see DropReason).
DROPPED_AS: dict[int, DropReason] = {
    LossReason.SLOW_CONSUMER: DropReason.SLOW_CONSUMER,
    LossReason.EVICTED: DropReason.EVICTED,
    LossReason.SHUTDOWN: DropReason.SHUTDOWN,
    LossReason.CONNECTION_LOST: DropReason.CONNECTION_LOST,
    LossReason.WORKER_RESTART: DropReason.WORKER_RESTART,
    LossReason.GROUP_OVERFLOW: DropReason.GROUP_OVERFLOW,
    LossReason.MAX_DELIVERIES: DropReason.MAX_DELIVERIES,
}


class WorkerStats:
    """Plain counters of one worker, read at scrape time (never locked)."""

    def __init__(self) -> None:
        self.messages_published = 0
        self.messages_delivered = 0
        self.dropped: dict[DropReason, int] = dict.fromkeys(DropReason, 0)
        # Reconnecting clients (Hello.previous) by whose account answered them:
        # this worker's own (connection_lost), a dead worker's (worker_restart), none.
        # "refused": claims that did not carry the connection's secret (they count as unknown too).
        self.resumes: dict[str, int] = {"connection_lost": 0, "worker_restart": 0, "unknown": 0, "refused": 0}
        # The restart grace of a worker that replaced a dead one (broky.server.shard.grace).
        self.restart_subscribers_expected = 0
        self.restart_subscribers_missing = 0
        self.restart_connections_held = 0
        self.restart_grace_seconds = 0.0
        self.node_restart_graces = 0  # graces given because the whole server restarted (`Grace.start_node`)
        self.bytes_received = 0
        self.bytes_sent = 0
        self.connections = 0  # open now
        self.connections_total = 0
        self.subscriptions = 0  # now
        self.subscription_bytes = 0  # now: summed `Subscription.size` of every connection
        self.subscriptions_refused: dict[str, int] = {"count": 0, "bytes": 0}  # SUBSCRIPTION_LIMIT, by limit
        self.permission_denied: dict[str, int] = {}  # PERMISSION_DENIED, by user (--users)
        self.reads_stopped = 0  # times a connection was read no more for its unread replies
        self.memory_trims = 0  # malloc_trim calls after subscription-heavy connections left
        self.budget_cuts = 0  # connections cut to keep the worker within its memory budget
        self.budget_cut_bytes = 0  # their pending bytes, freed by cutting them
        self.resumes_by_positions = 0  # resumes whose undelivered queue is replayed, not told lost
        self.messages_replayed = 0  # queued to a start from positions (broky.server.shard.positions)
        self.bounded_reads = 0  # Read frames served (broky.server.shard.positions)
        self.bounded_read_messages = 0  # messages queued to them
        self.replay_shrinks = 0  # times the replay buffer gave room back to pending bytes
        self.replay_dropped_messages = 0  # retained messages of former vbuckets, dropped when they came back
        # Planned moves (broky.server.shard.moves): vbuckets whose sequence this worker handed
        # over, continued (same epoch, next offset), or started again under a new epoch.
        self.vbuckets_handed_over = 0
        self.vbuckets_continued = 0
        self.vbuckets_restarted = 0
        self.slow_consumer_disconnects = 0
        # Lagging connections (broky.server.shard.lag): now, ever, messages sent to them from
        # the replay buffer, and messages they were owed that it evicted first (told).
        self.lagging = 0
        self.lag_entered = 0
        self.lag_served = 0
        self.lag_evicted = 0
        # Consumer groups (broky.server.shard.groups): now, and totals.
        self.groups = 0  # groups with a member on this worker now
        self.group_members = 0  # now
        self.group_delivered = 0  # messages queued to group members (redeliveries included)
        self.group_paused = 0  # PAUSED notices: a member reached max_in_flight
        self.group_drain_expired = 0  # vbucket moves that went ahead at drain_timeout
        self.group_vbuckets_moved = 0  # key-shared: vbuckets moved between members to balance them
        self.group_lost_no_member = 0  # held or in flight when the group's last member left
        # Ack deliveries not queued for a connection over its bound: not lost, in flight all the
        # same and delivered again at their deadline.
        self.group_deferred = 0
        # Messages of ack groups that waited as positions and left the replay buffer before a
        # member had room for them: told (LossNotice EVICTED), never delivered.
        self.group_evicted = 0
        self.acks = 0
        self.nacks = 0
        self.acks_in_progress = 0
        self.acks_unknown = 0  # Ack positions the group did not hold (settled already, unknown)
        self.ack_expired = 0  # deliveries not acknowledged within ack_wait
        self.redelivered = 0
        self.dead_lettered = 0  # published to a dead_letter key
        self.dead_letters_refused = 0  # not published: the vbucket was leaving this worker
        self.errors: dict[str, int] = {}  # Error frames sent, by code name
        # TLS (broky.server.security.tls): handshakes that reached a Hello inside TLS, and those
        # that failed, by reason (FAILURE_REASONS: timeout, certificate, protocol, closed).
        self.tls_handshakes = 0
        self.tls_failures: dict[str, int] = {}
        self.bytes_discarded = 0  # unsent bytes of connections reset at the linger deadline
        # Delivered messages by log2 of their read's receive-to-write time: bucket i
        # counts times under 2**(i+10) ns (about 2**i us; see broky.server.histogram).
        self.latency_us = [0] * _LATENCY_BUCKETS
        self.latency_ns_sum = 0  # sum of those times, one per delivered message
        # Published messages by log2 of ts_broker - ts_producer, when comparable; and those
        # whose ts_producer was not (broky.server.histogram).
        self.producer_us = [0] * _LATENCY_BUCKETS
        self.producer_ns_sum = 0
        self.producer_not_comparable = 0

    def count_error(self, code: ErrorCode) -> None:
        self.errors[code.name] = self.errors.get(code.name, 0) + 1

    def producer_outlier(self, ts_producer: int, age: int, count: int) -> None:
        """The rare path of the read path's producer histogram (broky.server.histogram):
        `count` messages whose read began with a ts_producer `age` ns old that is not
        between 0 and PRODUCER_BEHIND_NS."""
        if not ts_producer:
            return  # the publisher did not set one
        bucket = histogram.producer_bucket(age)
        if bucket is None:
            self.producer_not_comparable += count
        else:  # a producer clock a little ahead of this one: counted as 0
            self.producer_us[bucket] += count
