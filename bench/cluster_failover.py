"""Cluster failover benchmark: what a SIGKILLed node costs SDK publishers and subscribers.

    python -m bench.cluster_failover [--kills 10] [--nodes 3] [--workers 2] [--rate 5000]
                                     [--partitions 500] [--lease-ttl 5]

A real etcd and `--nodes` `broky serve --cluster` nodes (a, b, c, ...) on
loopback, `--workers` each, default settings but `--lease-ttl`. An SDK
subscriber process on `w.>` whose seed is the first node, and an SDK
publisher process whose seed is the last one, publishing `--rate` msgs/s
round-robin over `--partitions` key_partitions, a per-partition sequence
number in every payload (bench.worker_kill's two client processes). Every
round SIGKILLs one node, alternately the leader and another one, waits until
the others agree on a map without it, starts it again (same node id) and
waits until it has its share back: each round is a failover and a planned
join, under load.

Measured, from the subscriber's sequences against what was published:

- lost (published, never received), told (LossNotice counts), duplicates,
  out of order within a key_partition, strays (never published) and corrupt
  deliveries; what the subscriber received, also by the SDK's own count, and
  the copies the SDK's duplicate filter dropped;
- lost and told apart for the killed nodes and for the others: a loss on a
  key_partition a node owned when it was killed, a notice from a worker of a
  killed node (the map moves key_partitions only at kills and joins, so this
  is as fine a split as the run allows: a total would let over-telling on
  one node hide a silent loss on another); the subscriber's UNACCOUNTED
  notices (a connection lost with no account: count unknown);
- the publisher's report: `stats.unconfirmed_lost` (may not have reached a
  server), `stats.resent_after_loss` (sent again: the node that had them
  died without confirming them; the subscriber drops copies by uid) and
  whether its final `flush` raised;
- per kill, recovery: from the SIGKILL until the subscriber received a
  message published after it to every key_partition the dead node owned
  ("every"), and to the first of them ("first"). It is about the lease TTL
  (etcd notices the death) plus the leader's move, prepared and committed
  once every subscriber follows it.

The promise checked: on the killed nodes' key_partitions, lost == told by
their workers + the publisher's `unconfirmed_lost` (the SDK's count is what
the subscriber missed); elsewhere, lost == told; no duplicate delivered, no
more copies dropped than were sent again, no reordering. Results:
bench/results/cluster_failover.md and .json with the machine. `run` is also
what tests/cluster/test_cluster_sdk.py uses (with bench.harness.cluster's ClusterRun
and bench.worker_kill's Load), with short leases and fewer kills.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import worker_kill  # noqa: E402
from bench.harness import options  # noqa: E402
from bench.harness.cluster import ClusterRun  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402
from bench.worker_kill import Load  # noqa: E402
from broky.protocol import LossReason, VBucketMap, vbucket_of  # noqa: E402


@dataclass
class Result:
    events: list[dict[str, Any]] = field(default_factory=list)  # what, node, time, recovery
    published: int = 0
    refused: int = 0
    received: int = 0
    lost: int = 0
    told: int = 0
    told_by_reason: dict[str, int] = field(default_factory=dict)
    # lost on a key_partition a node owned when it was killed; told by a killed node's workers
    lost_on_killed: int = 0
    told_by_killed: int = 0
    told_by_worker: dict[str, int] = field(default_factory=dict)  # "node/worker": deliveries told lost
    duplicates: int = 0
    out_of_order: int = 0
    stray: int = 0  # received, never published
    corrupt: int = 0  # a key, key_partition or padding other than the publisher's
    publisher_unconfirmed_lost: int = 0
    publisher_resent_after_loss: int = 0
    publisher_flush_error: str | None = None
    subscriber_sdk_delivered: int = 0  # the SDK's own count of what it handed to the callback
    subscriber_duplicates_dropped: int = 0
    subscriber_unaccounted: list[str] = field(default_factory=list)  # "node/worker" of UNACCOUNTED notices
    max_gap_s: float = 0.0  # longest time the subscriber received nothing, after the first message
    per_partition: list[list[int]] = field(default_factory=list, repr=False)  # received sequences
    lost_by_partition: list[int] = field(default_factory=list, repr=False)

    @property
    def lost_elsewhere(self) -> int:
        """Lost on key_partitions no killed node owned when it was killed."""
        return self.lost - self.lost_on_killed

    @property
    def told_elsewhere(self) -> int:
        """Told by workers of nodes that were never killed."""
        return self.told - self.told_by_killed

    def recovery(self, which: str = "every") -> list[float]:
        return [e[which] for e in self.events if e.get(which) is not None]

    @property
    def promise_kept(self) -> bool:
        return (
            self.lost_on_killed == self.told_by_killed + self.publisher_unconfirmed_lost
            and self.lost_elsewhere == self.told_elsewhere
            and self.received == self.subscriber_sdk_delivered
            and self.duplicates == 0
            and self.subscriber_duplicates_dropped <= self.publisher_resent_after_loss
            and self.out_of_order == 0
            and self.stray == 0
            and self.corrupt == 0
        )


def analyse(
    published: dict[str, Any], subscribed: dict[str, Any], partitions: int, events: list[dict[str, Any]]
) -> Result:
    """Count lost, told, duplicates and reordering; the recovery after each kill (events with
    "time" and "partitions": the key_partition indexes the dead node owned)."""
    result = Result(events=events)
    result.published = published["sent"] - published["refused"]
    result.refused = published["refused"]
    stats = published["stats"]
    result.publisher_unconfirmed_lost = stats["unconfirmed_lost"]
    result.publisher_resent_after_loss = stats["resent_after_loss"]
    result.publisher_flush_error = published["flush_error"]
    sub_stats = subscribed["stats"]
    result.subscriber_sdk_delivered = worker_kill.sdk_delivered(sub_stats)
    result.subscriber_duplicates_dropped = sub_stats["duplicates_dropped"]
    received = subscribed["received"]
    result.received = len(received)
    seqs = worker_kill.sequences(published, received, partitions)
    result.per_partition, result.lost_by_partition = seqs.received, seqs.lost
    result.duplicates, result.out_of_order, result.stray = seqs.duplicates, seqs.out_of_order, seqs.stray
    result.corrupt = subscribed["corrupt"]
    result.lost = sum(seqs.lost)
    killed = [e for e in events if e.get("what") == "kill"]
    on_killed: set[int] = set()
    for e in killed:
        on_killed.update(e.get("partitions", ()))
    result.lost_on_killed = sum(seqs.lost[i] for i in on_killed)
    killed_nodes = {e["node"] for e in killed}
    for (node, worker), n, reason, _ in subscribed["losses"]:
        ref = f"{node}/{worker}"
        if reason == LossReason.UNACCOUNTED:
            result.subscriber_unaccounted.append(ref)
        result.told += n
        result.told_by_worker[ref] = result.told_by_worker.get(ref, 0) + n
        if node in killed_nodes:
            result.told_by_killed += n
        name = LossReason.name(reason)
        result.told_by_reason[name] = result.told_by_reason.get(name, 0) + n
    times = sorted(t for _, _, t, _ in received)
    result.max_gap_s = round(max((b - a for a, b in itertools.pairwise(times)), default=0.0), 3)
    for event in events:
        if "partitions" not in event:
            continue
        owned = set(event.pop("partitions"))
        first: dict[int, float] = {}
        for i, _, t_recv, ts in received:
            if i in owned and i not in first and ts / 1e9 > event["time"]:
                first[i] = t_recv - event["time"]
        event["every"] = round(max(first.values()), 3) if len(first) == len(owned) else None
        event["first"] = round(min(first.values()), 3) if first else None
    return result


def owned_partitions(vmap: VBucketMap, node_id: str, partitions: int) -> list[int]:
    """Indexes of the key_partitions (worker_kill.partition) whose vbucket `node_id` owns."""
    index = vmap.node_index(node_id)
    return [i for i in range(partitions) if vmap.owners[vbucket_of(worker_kill.partition(i))][0] == index]


def run(
    kills: int,
    rate: int = 5000,
    partitions: int = 500,
    nodes: int = 3,
    workers: int = 2,
    lease_ttl: int | None = None,
    settle_timeout: float = 90.0,
) -> Result:
    """`kills` rounds of SIGKILL, failover, restart and join under SDK load (see the header)."""
    names = [chr(ord("a") + n) for n in range(nodes)]
    cluster = ClusterRun(workers, lease_ttl)
    events: list[dict[str, Any]] = []
    load: Load | None = None
    try:
        for name in names:
            cluster.start(name)
        cluster.wait_settled(settle_timeout)
        load = Load(cluster.seeds(names[0]), cluster.seeds(names[-1]), rate, partitions)
        time.sleep(1.0)
        for k in range(kills):
            leader = cluster.leader()
            victim = leader if k % 2 else next(n for n in reversed(names) if n != leader)
            owned = owned_partitions(cluster.map(), victim, partitions)
            killed_at = cluster.kill(victim)
            event = {"what": "kill", "node": victim, "leader": victim == leader, "time": killed_at}
            events.append({**event, "partitions": owned})
            cluster.wait_settled(settle_timeout)
            event_done = time.time()
            events[-1]["failover_s"] = round(event_done - killed_at, 3)
            cluster.start(victim)  # back, under the same id: a planned join
            cluster.wait_settled(settle_timeout)
            events.append(
                {
                    "what": "join",
                    "node": victim,
                    "time": event_done,
                    "join_s": round(time.time() - event_done, 3),
                }
            )
            time.sleep(1.0)
        published, subscribed = load.finish()
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
    return analyse(published, subscribed, partitions, events)


# ---------------------------------------------------------------- report


def report(result: Result, args: argparse.Namespace, info: dict[str, Any]) -> str:
    every, first = result.recovery("every"), result.recovery("first")
    flush = f"raised: {result.publisher_flush_error}" if result.publisher_flush_error else "succeeded"
    kills = [e for e in result.events if e["what"] == "kill"]
    joins = [e for e in result.events if e["what"] == "join"]
    command = (
        f"python -m bench.cluster_failover --kills {args.kills} --nodes {args.nodes} "
        f"--workers {args.workers} --rate {args.rate} --partitions {args.partitions} "
        f"--lease-ttl {args.lease_ttl}"
    )
    figures: list[tuple[str, Any]] = [
        ("messages published", result.published),
        ("received by the subscriber", result.received),
        ("lost (published, never received)", result.lost),
        ("told lost (LossNotice counts)", f"{result.told} {result.told_by_reason or ''}"),
        ("lost / told, key_partitions and workers of the killed nodes",
         f"{result.lost_on_killed} / {result.told_by_killed}"),
        ("lost / told, elsewhere", f"{result.lost_elsewhere} / {result.told_elsewhere}"),
        ("subscriber: connections lost with no account (UNACCOUNTED)", len(result.subscriber_unaccounted)),
        ("publisher: `unconfirmed_lost` (may not have reached a server)", result.publisher_unconfirmed_lost),
        ("publisher: `resent_after_loss` (sent again to the new owners)", result.publisher_resent_after_loss),
        ("subscriber: copies dropped by uid", result.subscriber_duplicates_dropped),
        ("duplicates delivered", result.duplicates),
        ("out of order within a key_partition", result.out_of_order),
        ("never published, or corrupt", f"{result.stray} / {result.corrupt}"),
        ("publisher: final flush", flush),
        ("publishes refused (reconnect buffer full)", result.refused),
    ]  # fmt: skip
    if every:
        figures.append((
            "recovery, every key_partition of the dead node: min / median / max",
            f"{min(every):.2f} / {statistics.median(every):.2f} / {max(every):.2f} s",
        ))  # fmt: skip
    if first:
        figures.append((
            "recovery, its first key_partition: min / median / max",
            f"{min(first):.2f} / {statistics.median(first):.2f} / {max(first):.2f} s",
        ))  # fmt: skip
    rounds = [
        (n + 1, k["node"], "yes" if k["leader"] else "no", k.get("every"), k.get("first"),
         k.get("failover_s"), joins[n]["join_s"] if n < len(joins) else None)
        for n, k in enumerate(kills)
    ]  # fmt: skip
    head = ("Round", "Node", "Leader", "Recovery, every (s)", "first (s)", "Failover (s)", "Join (s)")
    lines = [
        *heading("Cluster failover: a node SIGKILLed under SDK load", info, command),
        f"etcd and {args.nodes} `broky serve --cluster` nodes with {args.workers} workers each, "
        f"`--lease-ttl {args.lease_ttl}`, other settings default; an SDK publisher at {args.rate} msgs/s "
        f"over {args.partitions} key_partitions (seed: the last node), an SDK subscriber on `w.>` "
        f"(seed: the first node). {len(kills)} rounds: SIGKILL of a node (alternately another node and "
        "the leader), failover, the node started again under the same id (a planned join).",
        "",
        *table(("Figure", "Value"), figures),
        "",
        "Recovery: from the SIGKILL until the subscriber received a message published after it, to every "
        "key_partition the dead node owned (and to the first of them). Failover: until every surviving "
        "node runs the committed map without it. Join: from then until the node, started again, has its "
        "share back (prepared, followed by the subscriber, committed).",
        "",
        *table(head, rounds, "rllrrrr"),
        "",
        f"Verdict: {'met' if result.promise_kept else 'NOT met'} (on the killed nodes' key_partitions "
        "lost == told + the publisher's unconfirmed_lost, elsewhere lost == told; no duplicate, no more "
        "copies dropped than sent again, in order per key_partition, nothing corrupt).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.cluster_failover", __doc__, out=options.RESULTS, workers=2)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rate", type=int, default=5000, help="msgs/s published")
    parser.add_argument("--partitions", type=int, default=500)
    parser.add_argument("--lease-ttl", type=int, default=5, help="seconds (broky serve's default: 5)")
    args = parser.parse_args(argv)
    info = machine_info()
    result = run(args.kills, args.rate, args.partitions, args.nodes, args.workers, args.lease_ttl)
    data = {k: v for k, v in asdict(result).items() if k not in ("per_partition", "lost_by_partition")}
    write_results(args.out, "cluster_failover", report(result, args, info), info, args, **data)
    return 0 if result.promise_kept else 1


if __name__ == "__main__":
    sys.exit(main())
