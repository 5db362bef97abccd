"""Chaos runs: restarts, kills, freezes and etcd faults under SDK load, counted exactly.

    python -m bench.chaos [--scenario NAME ...] [--rate 2000] [--partitions 300]

Every scenario runs bench.worker_kill's two SDK client processes: a publisher
at `--rate` msgs/s round-robin over `--partitions` key_partitions, each
payload carrying its key_partition and a per-key_partition sequence number,
and a subscriber on `w.>`. Then it compares what the subscriber received
with what was published and prints, per scenario, one line per figure:

- published, received, lost (published, never received);
- told: what the subscriber was told it lost. A LossNotice with a count
  (SLOW_CONSUMER, CONNECTION_LOST, WORKER_RESTART, SHUTDOWN) tells that
  many; an UNACCOUNTED notice (a connection lost where nobody alive can say
  what it lost: a server or node restart, a node that died) tells "some may
  be lost, how many is unknown": it covers every lost message published up
  to COVER_SECONDS before it arrived. The publisher's `unconfirmed_lost`
  (publishes it says may not have reached a server) counts as told too;
- duplicates delivered to the application, and the copies the SDK dropped
  by uid on its own; out of order within a key_partition;
- recovery: per fault, from the fault until the subscriber received a
  message published after it.

and the promise as one line: `lost - told = N`, where N counts the lost
messages no notice covers (0: nothing lost silently).

Scenarios (each starts its own servers on free loopback ports, stops them by pid):

- server-restart: one `broky serve --workers 2`; SIGKILL of the master and
  workers, started again on the same port after `--down` seconds; repeated.
- node-kill-loop: etcd and 3 nodes x 2 workers; every 15 s a node is
  SIGKILLed and started again under its old id 3-5 s later, for `--minutes`.
- frozen-node: the same cluster; a node is SIGSTOPped for `--freeze` seconds
  (default 30, and once 10), then SIGCONTed.
- etcd-outage: the same cluster; etcd is SIGKILLed for 30 s, then started
  again on its data.
- etcd-wipe: the same cluster; etcd is stopped, its data removed, and a
  fresh etcd started on the same ports.

Results: bench/results/chaos.md and .json with the machine. `server_restart`
is also what tests/server/e2e/test_server_restart.py runs, short.

Counted exactly (issue 37, items 1-4): five more scenarios, each on one `broky
serve --workers 2`, whose promise is that the count told is the count lost,
both ways (`lost - told = 0`: nothing lost untold; `told - lost = 0`: nothing
told that was not lost, nothing told twice), per vbucket where the notices
name one (per worker for a group's, in total for an SSE stream's), with no
count left unknown. Cuts are `ss -K` of the client's sockets (root, or
CAP_NET_ADMIN), the SDK client's process stopped (SIGSTOP) for the outage,
the SSE reader waiting it out before it reconnects.

- group-worker-kill: three SDK members of a load-balanced ack group
  (max_in_flight 20) hold what they get under the publisher's load, so the
  group's backlog fills; a worker is SIGKILLed (0, then 1); once it is back
  the members ack what they hold. Lost: received by no member; told: the
  notices to all members; UNACKED_LOST must be 0 (they nacked nothing).
  group-worker-kill-key-shared: the same with a key-shared group.
- cuts-replay-off: `--replay-bytes 0`; 20,000 messages on other vbuckets of
  both workers first (key other.k); the subscriber's connections cut 10
  times under load, each a 0.3 s outage; told per vbucket is its
  subscription's `lost_by_vbucket`.
- cuts-idle: `--replay-bytes 0`; a subscriber that lost 1,000 messages in a
  cut, then cut 5 more times with nothing published: told once.
- sse-replay-off: `--replay-bytes 0`; foreign traffic first; an SSE reader
  (text/event-stream over http.client) cut 10 times under load, resuming
  with Last-Event-ID 0.3 s later; `event: loss` names no vbucket, so lost and
  told are compared in total, and a `"dropped": null` counts apart.

With `--stall S` the client of cuts-replay-off and sse-replay-off reads
nothing for S s before each cut (what the server sends meanwhile waits in the
buffers and is lost with the cut): a subscriber resuming by positions is told
exactly however far behind it was; an SSE reader more than the gateway's
ledger (1,024 events) behind is told `resume_unknown`, the count unknown.

Their results: bench/results/chaos_exact.md and .json (chaos_exact_stalled.*
with `--stall`; the other scenarios' files are left as they are when only
these run). tests/bench/test_chaos_exact.py runs them short.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench import worker_kill  # noqa: E402
from bench.cluster_failover import owned_partitions  # noqa: E402
from bench.harness import options, roles, servers  # noqa: E402
from bench.harness.cluster import ClusterRun, agreed, wait_for  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402
from bench.worker_kill import Load  # noqa: E402
from broky.protocol import LossReason, vbucket_of  # noqa: E402

# An UNACCOUNTED notice covers the lost messages published at most this long before it
# arrived: the notice comes once the lost connection is replaced (a reconnect, a move).
COVER_SECONDS = 30.0
# A message published at most this long before a fault may have been in flight in the
# server when it struck (queued, being written): the only ones a fault may lose.
IN_FLIGHT_SECONDS = 0.5


@dataclass
class Outcome:
    """What one scenario did and what the subscriber saw."""

    scenario: str
    faults: list[dict[str, Any]] = field(default_factory=list)  # what, time, recovery_s
    published: int = 0
    refused: int = 0  # publishes refused by the SDK (reconnect buffer full): never published
    received: int = 0
    lost: int = 0
    told: int = 0  # counted notices
    told_by_reason: dict[str, int] = field(default_factory=dict)
    unaccounted_notices: int = 0
    covered_by_unaccounted: int = 0  # lost messages an UNACCOUNTED notice covers
    publisher_unconfirmed_lost: int = 0
    publisher_resent_after_loss: int = 0
    publisher_flush_error: str | None = None
    duplicates: int = 0  # delivered to the application twice
    duplicates_dropped: int = 0  # copies the SDK dropped by uid
    out_of_order: int = 0
    # lost messages not in flight when a fault struck (published while a server was down,
    # or after): the graces and resends are there so that this stays 0
    lost_not_in_flight: int = 0
    max_gap_s: float = 0.0

    @property
    def untold(self) -> int:
        """Lost messages no notice covers: `lost - told`."""
        return self.lost - self.covered_by_unaccounted - self.told - self.publisher_unconfirmed_lost

    @property
    def promise_kept(self) -> bool:
        return self.untold <= 0 and self.duplicates == 0 and self.out_of_order == 0

    def recoveries(self) -> list[float]:
        """Per fault: until every key_partition it struck flowed again, if it struck some;
        else until the first message published after it arrived."""
        rec = [f.get("every_s", f.get("recovery_s")) for f in self.faults]
        return [r for r in rec if r is not None]

    def lines(self) -> list[str]:
        rec = self.recoveries()
        told = f"{self.told} {self.told_by_reason}" if self.told_by_reason else "0"
        return [
            f"published {self.published} (refused by the SDK: {self.refused})",
            f"received {self.received}",
            f"lost {self.lost} (not in flight when a fault struck: {self.lost_not_in_flight})",
            f"told {told}; UNACCOUNTED notices {self.unaccounted_notices}, covering "
            f"{self.covered_by_unaccounted} lost; publisher unconfirmed_lost "
            f"{self.publisher_unconfirmed_lost}",
            f"duplicates delivered {self.duplicates} (copies dropped by the SDK: {self.duplicates_dropped}); "
            f"out of order {self.out_of_order}",
            f"publisher: resent_after_loss {self.publisher_resent_after_loss}, final flush "
            + (f"raised: {self.publisher_flush_error}" if self.publisher_flush_error else "succeeded"),
            "recovery after each fault (s): " + (", ".join(f"{r:.2f}" for r in rec) or "-"),
            *(
                f"  {f['what']}: " + ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("what", "time"))
                for f in self.faults
            ),
            f"longest time without a delivery: {self.max_gap_s:.2f} s",
            f"lost - told = {max(self.untold, 0)}"
            + (f" (told {-self.untold} more than was lost)" if self.untold < 0 else ""),
        ]


def analyse(
    scenario: str,
    published: dict[str, Any],
    subscribed: dict[str, Any],
    partitions: int,
    rate: int,
    faults: list[dict[str, Any]],
) -> Outcome:
    """Count what was lost, told, duplicated or reordered (see the module header).

    A lost message's publish time is in no payload the subscriber kept. The
    publisher sends message n = s * partitions + i (sequence s of key_partition
    i) at about start + n / rate; the received messages give `start`, and the
    nearest received messages in that order bound the estimate.
    """
    out = Outcome(scenario, faults)
    out.published = published["sent"] - published["refused"]
    out.refused = published["refused"]
    stats = published["stats"]
    out.publisher_unconfirmed_lost = stats["unconfirmed_lost"]
    out.publisher_resent_after_loss = stats["resent_after_loss"]
    out.publisher_flush_error = published["flush_error"]
    out.duplicates_dropped = subscribed["stats"]["duplicates_dropped"]
    received = subscribed["received"]
    out.received = len(received)
    seen: list[dict[int, float]] = [{} for _ in range(partitions)]  # sequence -> publish time (s)
    last = [-1] * partitions
    for i, s, _, ts in received:
        if s in seen[i]:
            out.duplicates += 1
        seen[i][s] = ts / 1e9
        if s < last[i]:
            out.out_of_order += 1
        last[i] = max(last[i], s)
    notices = sorted(t for _, n, reason, t in subscribed["losses"] if reason == LossReason.UNACCOUNTED)
    out.unaccounted_notices = len(notices)
    for _, n, reason, _ in subscribed["losses"]:
        if reason != LossReason.UNACCOUNTED:
            out.told += n
            name = LossReason.name(reason)
            out.told_by_reason[name] = out.told_by_reason.get(name, 0) + n
    order = sorted((s * partitions + i, t) for i in range(partitions) for s, t in seen[i].items())
    numbers = [n for n, _ in order]
    start = sorted(t - n / rate for n, t in order)[len(order) // 2] if order else 0.0
    for i, count in enumerate(published["per_partition"]):
        for s in range(count):
            if s in seen[i]:
                continue
            out.lost += 1
            n = s * partitions + i
            k = bisect.bisect_left(numbers, n)
            low = order[k - 1][1] if k > 0 else 0.0
            high = order[k][1] if k < len(order) else float("inf")
            at = min(max(start + n / rate, low), high)  # its publish time, estimated
            j = bisect.bisect_left(notices, at)
            if j < len(notices) and notices[j] - at <= COVER_SECONDS:
                out.covered_by_unaccounted += 1
            if not any(f["time"] - IN_FLIGHT_SECONDS <= at <= f["time"] for f in faults):
                out.lost_not_in_flight += 1
    out.lost -= published["refused"]  # skipped sequence numbers: never published
    times_recv = sorted(t for _, _, t, _ in received)
    out.max_gap_s = round(max((b - a for a, b in itertools.pairwise(times_recv)), default=0.0), 3)
    for fault in faults:
        after = [t_recv - fault["time"] for _, _, t_recv, ts in received if ts / 1e9 > fault["time"]]
        fault["recovery_s"] = round(min(after), 3) if after else None
    return out


# ---------------------------------------------------------------- server restart


def server_restart(
    restarts: int = 3,
    interval: float = 6.0,
    down: float = 1.5,
    rate: int = 2000,
    partitions: int = 300,
    workers: int = 2,
    server_args: tuple[str, ...] = (),
) -> Outcome:
    """One server under load, SIGKILLed (master and workers) and started again on its
    port `down` seconds later, `restarts` times, `interval` seconds apart."""
    port = servers.free_port()
    args = ["--port", str(port), *server_args]
    server = servers.start_broky(workers, args)
    url = f"{server.host}:{port}"
    load: Load | None = None
    faults: list[dict[str, Any]] = []
    try:
        load = Load(url, url, rate, partitions)
        time.sleep(1.0)
        for _ in range(restarts):
            killed_at = time.time()
            os.killpg(server.pid, signal.SIGKILL)
            server.stop()
            time.sleep(down)
            server = servers.start_broky(workers, args)
            faults.append(
                {"what": "server restart", "time": killed_at, "down_s": round(time.time() - killed_at, 3)}
            )
            time.sleep(max(0.0, interval - (time.time() - killed_at)))
        published, subscribed = load.finish()
    finally:
        if load is not None:
            load.kill()
        server.stop()
    return analyse("server-restart", published, subscribed, partitions, rate, faults)


# ---------------------------------------------------------------- the cluster


def _cluster_run(
    scenario: str,
    faults_of: Any,
    nodes: int = 3,
    workers: int = 2,
    rate: int = 2000,
    partitions: int = 300,
    lease_ttl: int | None = None,
    node_args: tuple[str, ...] = (),
) -> Outcome:
    """A settled cluster under load; `faults_of(cluster)` injects the faults (returns them)."""
    cluster = ClusterRun(workers, lease_ttl, *node_args, keep_ports=True)
    load: Load | None = None
    try:
        for n in range(nodes):
            cluster.start(chr(ord("a") + n))
        cluster.wait_settled(90.0)
        load = Load(cluster.seeds("a"), cluster.seeds(chr(ord("a") + nodes - 1)), rate, partitions)
        time.sleep(1.0)
        faults = faults_of(cluster, partitions)
        cluster.wait_settled(90.0)
        wait_for(lambda: agreed(cluster.etcd, cluster.nodes), 90.0, "etcd holds the map the nodes run")
        time.sleep(2.0)
        published, subscribed = load.finish()
    finally:
        if load is not None:
            load.kill()
        cluster.stop()
    out = analyse(scenario, published, subscribed, partitions, rate, faults)
    _gaps(out, subscribed, partitions)
    return out


def _gaps(out: Outcome, subscribed: dict[str, Any], partitions: int) -> None:
    """Per fault with the key_partitions it struck ("struck"): the longest time the others
    went without a delivery while it lasted ("others_max_gap_s"), and when every struck one
    received a message published after the fault ("every_s")."""
    received = subscribed["received"]
    for fault in out.faults:
        struck = set(fault.pop("struck", ()))
        if not struck:
            continue
        start, end = fault["time"], fault["time"] + fault.get("lasted_s", 0.0) + 10.0
        times = sorted(t for i, _, t, _ in received if i not in struck and start <= t <= end)
        gaps = [b - a for a, b in itertools.pairwise([start, *times])]
        fault["others_max_gap_s"] = round(max(gaps, default=0.0), 3)
        first: dict[int, float] = {}
        for i, _, t_recv, ts in received:
            if i in struck and i not in first and ts / 1e9 > fault["time"]:
                first[i] = t_recv - fault["time"]
        fault["every_s"] = round(max(first.values()), 3) if len(first) == len(struck) else None


def node_kill_loop(
    minutes: float = 2.0,
    every: float = 15.0,
    down: tuple[float, float] = (3.0, 5.0),
    lease_ttl: int | None = None,
    node_args: tuple[str, ...] = (),
) -> Outcome:
    """A node SIGKILLed every `every` seconds (in turn), started again under its id and
    at its address after `down` (3-5) s; for `minutes`."""
    import random

    def faults(cluster: ClusterRun, partitions: int) -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        names = sorted(cluster.nodes)
        end = time.time() + minutes * 60
        for victim in itertools.cycle(names):
            if done and time.time() + every > end:
                break
            t0 = time.time()
            struck = owned_partitions(cluster.map(), victim, partitions)
            killed_at = cluster.kill(victim)
            time.sleep(random.uniform(*down))
            cluster.start(victim)
            done.append({"what": f"kill {victim}", "time": killed_at, "struck": struck,
                         "down_s": round(time.time() - killed_at, 3)})  # fmt: skip
            time.sleep(max(0.0, every - (time.time() - t0)))
        return done

    return _cluster_run("node-kill-loop", faults, lease_ttl=lease_ttl, node_args=node_args)


def frozen_node(
    freezes: tuple[float, ...] = (30.0, 10.0), lease_ttl: int | None = None, node_args: tuple[str, ...] = ()
) -> Outcome:
    """A node (not the leader) SIGSTOPped for each of `freezes` seconds, then SIGCONTed
    and left to rejoin."""

    def faults(cluster: ClusterRun, partitions: int) -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        for seconds in freezes:
            leader = cluster.leader()
            victim = next(n for n in sorted(cluster.nodes, reverse=True) if n != leader)
            struck = owned_partitions(cluster.map(), victim, partitions)
            pids = cluster.pids(victim)
            frozen_at = time.time()
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(seconds)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            done.append({"what": f"freeze {victim} {seconds:g} s", "time": frozen_at, "struck": struck,
                         "lasted_s": seconds})  # fmt: skip
            cluster.wait_settled(90.0)
            time.sleep(2.0)
        return done

    return _cluster_run("frozen-node", faults, lease_ttl=lease_ttl, node_args=node_args)


def etcd_outage(seconds: float = 30.0) -> Outcome:
    """etcd SIGKILLed for `seconds`, then started again on its data."""

    def faults(cluster: ClusterRun, partitions: int) -> list[dict[str, Any]]:
        at = time.time()
        cluster.etcd.kill()
        time.sleep(seconds)
        cluster.etcd.start()
        return [{"what": f"etcd down {seconds:g} s", "time": at, "lasted_s": seconds}]

    return _cluster_run("etcd-outage", faults)


def etcd_wipe(down: float = 2.0) -> Outcome:
    """etcd loses its data under the cluster: killed, its data removed, a fresh empty
    etcd started on the same ports `down` seconds later. Also records whether any map
    the nodes applied moved vbuckets without a prepare (there should be none)."""

    def faults(cluster: ClusterRun, partitions: int) -> list[dict[str, Any]]:
        before = cluster.map()
        wiped_at, back_at = cluster.etcd.wipe(down)
        vmap = wait_for(lambda: agreed(cluster.etcd, cluster.nodes), 90.0, "the map restored")
        same = [(vmap.nodes[n].node_id, w) for n, w in vmap.owners] == [
            (before.nodes[n].node_id, w) for n, w in before.owners
        ]
        return [
            {
                "what": f"etcd wiped, back after {down:g} s",
                "time": wiped_at,
                "lasted_s": round(back_at - wiped_at, 3),
                "restored_s": round(time.time() - back_at, 3),
                "owners_unchanged": same,
                "versions": f"{before.version} -> {vmap.version}",
            }
        ]

    return _cluster_run("etcd-wipe", faults)


# ---------------------------------------------------------------- exact counts (issue 37)
#
# Four scenarios whose promise is stronger than `lost - told = 0`: the count told is the
# count lost, per vbucket (per worker for a group's notices, which carry no vbucket), in
# both directions (lost - told = 0: nothing lost untold; told - lost = 0: nothing told
# that was not lost, nothing told twice), and no notice says "unknown" where the server
# can know. Their client processes are this module's (`--role`): a plain subscriber that
# also reports its subscription's `lost_by_vbucket`, and the members of an ack group.
# Cuts are real: `ss -K` destroys the client's sockets (the server gets a reset).

EXACT_PATTERN = "w.>"  # bench.worker_kill's publisher publishes to key w.k
FOREIGN_KEY = b"other.k"  # traffic no subscriber here matches
GROUP = "chaos"


@dataclass
class Exact:
    """What one exact-count scenario lost and told, per vbucket, per worker or in total.

    `by` says what `lost_by` and `told_by` are keyed by: "vbucket" (a start's notices
    carry one), "worker" (a group's: the connection they came on), or "total" (an SSE
    stream's `event: loss` carries no vbucket). A lost message is one published (not
    refused) that nobody received; told counts the notices with a count, UNACKED_LOST
    apart (a group member's message given back, not one it never received)."""

    scenario: str
    by: str = "vbucket"
    faults: int = 0  # cuts or kills
    published: int = 0
    received: int = 0  # distinct messages received
    lost: int = 0
    told: int = 0
    told_by_reason: dict[str, int] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)  # notices without a count, by reason
    lost_by: dict[str, int] = field(default_factory=dict)
    told_by: dict[str, int] = field(default_factory=dict)
    told_unplaced: int = 0  # told with a count, on no vbucket (a connection's notice)
    duplicates: int = 0
    out_of_order: int = 0  # within a key_partition (not for a load-balanced group)
    figures: dict[str, Any] = field(default_factory=dict)  # the scenario's own
    checks: dict[str, bool] = field(default_factory=dict)  # the scenario's own promises

    @property
    def lost_minus_told(self) -> int:
        """Per key, what was lost beyond what was told there, summed (0: nothing untold)."""
        return sum(max(n - self.told_by.get(k, 0), 0) for k, n in self.lost_by.items())

    @property
    def told_minus_lost(self) -> int:
        """Per key, what was told beyond what was lost there, summed, and what was told on
        no key (0: nothing told that was not lost, nothing told twice)."""
        over = sum(max(n - self.lost_by.get(k, 0), 0) for k, n in self.told_by.items())
        return over + self.told_unplaced

    @property
    def exact(self) -> bool:
        return (
            self.lost_minus_told == 0
            and self.told_minus_lost == 0
            and self.lost == self.told
            and not self.unknown
            and self.duplicates == 0
            and self.out_of_order == 0
            and all(self.checks.values())
        )

    def verdict(self) -> dict[str, Any]:
        """The differences and the verdict, for the JSON file."""
        return {
            "lost_minus_told": self.lost_minus_told,
            "told_minus_lost": self.told_minus_lost,
            "exact": self.exact,
        }

    def mismatches(self) -> list[str]:
        keys = sorted(set(self.lost_by) | set(self.told_by), key=lambda k: (len(k), k))
        return [
            f"{self.by} {k}: lost {self.lost_by.get(k, 0)}, told {self.told_by.get(k, 0)}"
            for k in keys
            if self.lost_by.get(k, 0) != self.told_by.get(k, 0)
        ]

    def lines(self) -> list[str]:
        told = f"{self.told} {self.told_by_reason}" if self.told_by_reason else "0"
        keyed = [
            k for k in set(self.lost_by) | set(self.told_by) if self.lost_by.get(k) or self.told_by.get(k)
        ]
        if self.by == "worker":
            per = "; ".join(
                f"worker {k}: lost {self.lost_by.get(k, 0)}, told {self.told_by.get(k, 0)}"
                for k in sorted(keyed)
            )
        else:
            per = f"{len(keyed)} vbuckets lost or were told something"
        wrong = self.mismatches()
        by = [
            f"per {self.by}: {per}",
            f"per {self.by}: lost - told = {self.lost_minus_told}, told - lost = {self.told_minus_lost}"
            + (f" ({'; '.join(wrong[:10])}{' ...' if len(wrong) > 10 else ''})" if wrong else ""),
        ]
        return [
            f"faults {self.faults}; published {self.published}, received {self.received}",
            f"lost {self.lost}; told {told}; notices without a count: {self.unknown or 'none'}"
            + (f"; told on no {self.by}: {self.told_unplaced}" if self.told_unplaced else ""),
            *(by if self.by != "total" else ["the stream's loss events name no vbucket: compared in total"]),
            f"in total: lost - told = {self.lost - self.told}, told - lost = {self.told - self.lost}",
            f"duplicates delivered {self.duplicates}; out of order {self.out_of_order}",
            *(f"{k}: {v}" for k, v in self.figures.items()),
            *(f"check {k}: {'yes' if v else 'NO'}" for k, v in self.checks.items()),
            f"exact: {'yes' if self.exact else 'NO'}",
        ]


def count_lost(
    out: Exact,
    published: dict[str, Any],
    received: list[tuple[int, int]],
    partitions: int,
    key_of_partition: Callable[[int], str] | None,
    ordered: bool = True,
) -> Exact:
    """The lost side of `out`, from what was published (bench.worker_kill's publisher
    report) and the (key_partition index, sequence number) pairs received: a lost message
    is counted under `key_of_partition(index)` (None: in total only)."""
    seqs = worker_kill.sequences(published, received, partitions)
    out.published = published["sent"] - published["refused"]
    out.lost = sum(seqs.lost)
    out.received = out.published - out.lost
    out.duplicates = seqs.duplicates
    out.out_of_order = seqs.out_of_order if ordered else 0
    out.checks["nothing received that was never published"] = seqs.stray == 0
    for i, n in enumerate(seqs.lost):
        if n:
            key = key_of_partition(i) if key_of_partition is not None else "all"
            out.lost_by[key] = out.lost_by.get(key, 0) + n
    return out


def count_told(out: Exact, notices: Iterable[tuple[str | None, int | None, str]]) -> Exact:
    """The told side of `out` from its notices (key, dropped, reason name): a key of None is
    told on no key; a dropped of 0 or None is a notice without a count."""
    for key, dropped, reason in notices:
        if not dropped:
            out.unknown[reason] = out.unknown.get(reason, 0) + 1
            continue
        out.told += dropped
        out.told_by_reason[reason] = out.told_by_reason.get(reason, 0) + dropped
        if key is None:
            out.told_unplaced += dropped
        else:
            out.told_by[key] = out.told_by.get(key, 0) + dropped
    return out


def count_subscriber_told(out: Exact, subscribed: dict[str, Any]) -> Exact:
    """The told side of `out` for an exact_subscriber: per vbucket, what its subscription's
    starts were told (`lost_by_vbucket`); in total and by reason, every notice on_loss was
    given. What on_loss was told beyond the per-vbucket counts came with no vbucket (a
    connection's notice), and per-vbucket counts on_loss never saw would be a fault too."""
    count_told(out, [(None, n, LossReason.name(reason)) for _, n, reason in subscribed["losses"]])
    out.told_by = {str(vb): n for vb, n in subscribed["lost_by_vbucket"].items() if n}
    out.told_unplaced = out.told - sum(out.told_by.values())
    out.checks["every per-vbucket count also reached on_loss"] = out.told_unplaced >= 0
    out.told_unplaced = max(out.told_unplaced, 0)
    return out


# -------------------------------- sockets: who is connected, and cutting them


def client_sockets(pid: int, server_port: int) -> set[tuple[int, int]]:
    """Process `pid`'s established TCP connections to `server_port`: (local port, socket
    inode) each (the inode tells a new connection from an old one on a port used again)."""
    out = subprocess.run(
        ["ss", "-tnpeH", "state", "established", "dport", "=", f":{server_port}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            fields = line.split()
            ino = next(f for f in fields if f.startswith("ino:"))
            found.add((int(fields[2].rsplit(":", 1)[1]), int(ino[4:])))
    return found


def cut_ports(ports: set[int], server_port: int) -> None:
    """Destroy the connections from `ports` to `server_port` (`ss -K`: the client's socket
    fails, the server gets a reset). Needs CAP_NET_ADMIN and a kernel with sock_destroy."""
    for port in ports:
        subprocess.run(
            ["ss", "-K", "-tnH", "dport", "=", f":{server_port}", "sport", "=", f":{port}"],
            capture_output=True, check=True,
        )  # fmt: skip
    deadline = time.monotonic() + 5.0
    while ports & _established(server_port):
        if time.monotonic() > deadline:
            raise RuntimeError(
                "ss -K did not cut the connections (it needs CAP_NET_ADMIN and a kernel "
                "with CONFIG_INET_DIAG_DESTROY)"
            )
        time.sleep(0.01)


def _established(server_port: int) -> set[int]:
    out = subprocess.run(
        ["ss", "-tnH", "state", "established", "dport", "=", f":{server_port}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {int(line.split()[2].rsplit(":", 1)[1]) for line in out.splitlines()}


def can_cut() -> bool:
    """Whether `ss -K` can cut a loopback connection here (tests skip the cuts if not)."""
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            with socket.create_connection(listener.getsockname()) as conn:
                cut_ports({conn.getsockname()[1]}, listener.getsockname()[1])
        return True
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        return False


def wait_reconnected(
    pid: int, server_port: int, old: set[tuple[int, int]], count: int, timeout: float = 30.0
) -> float:
    """Wait until process `pid` has `count` connections to `server_port`, none of `old`
    (client_sockets); then a moment for its Subscribes' answers. Returns the seconds it
    took."""
    t0 = time.monotonic()
    while True:
        now = client_sockets(pid, server_port)
        if len(now) >= count and not now & old:
            break
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"process {pid} did not reconnect within {timeout:g} s")
        time.sleep(0.01)
    took = time.monotonic() - t0
    time.sleep(0.3)
    return round(took, 3)


def cut_process(
    proc: roles.Role,
    server_port: int,
    workers: int,
    down: float,
    during: Callable[[], Any] | None = None,
    stall: float = 0.0,
) -> float:
    """A network cut of a client process's connections: stopped (SIGSTOP) for `stall` s
    (what the server sends meanwhile waits in the sockets' buffers), its sockets
    destroyed, `during()` run and `down` seconds gone by, continued. Returns the seconds
    from then until it was connected again to every worker."""
    old = client_sockets(proc.pid, server_port)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(stall)
        t0 = time.monotonic()
        cut_ports({port for port, _ in old}, server_port)
        if during is not None:
            during()
        time.sleep(max(0.0, down - (time.monotonic() - t0)))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    return wait_reconnected(proc.pid, server_port, old, workers)


# -------------------------------- the client processes


def _start_role(procs: list[roles.Role], role: str, url: str, **settings: Any) -> roles.Role:
    """One of this module's role processes (`exact_role`), ready."""
    argv = ("--role", role, "--server", url, "--settings", json.dumps(settings))
    return roles.start(procs, "bench.chaos", *argv, what=f"the {role}")


async def exact_subscriber(url: str) -> dict[str, Any]:
    """A subscriber on `w.>` that resumes by positions (the SDK's default): what it received
    (key_partition index, sequence number), every notice (worker, dropped, reason), and
    what its subscription's starts were told per vbucket (`lost_by_vbucket`)."""
    received: list[tuple[int, int]] = []
    losses: list[tuple[int, int, int]] = []
    unpack = worker_kill._head.unpack_from

    async with broky.connect(
        url,
        reconnect_min_delay=0.05,
        on_loss=lambda ref, n, reason: losses.append((ref.worker, n, reason)),
    ) as client:
        sub = await client.subscribe(EXACT_PATTERN, callback=lambda m: received.append(unpack(m.payload)))
        roles.ready()
        async for line in roles.lines():
            if line == "told":  # what on_loss was told so far
                roles.answer([sum(n for _, n, _ in losses), len(losses)])
        await asyncio.sleep(0.5)  # the last deliveries
        return {
            "received": received,
            "losses": losses,
            # (an SDK older than issue 37 has none: its notices then count on no vbucket)
            "lost_by_vbucket": getattr(sub, "lost_by_vbucket", {}),
            "stats": asdict(client.stats),
        }


async def group_members(url: str, members: int, max_in_flight: int, key_shared: bool) -> dict[str, Any]:
    """`members` clients in one ack group on `w.>`, each holding what it is given (never
    settling: each reaches max_in_flight on each worker and the rest waits in the group's
    backlog) until told "ack": then it acks what it holds and what comes, until "hold".
    Answers "held" with the vbuckets of the messages it holds, "ack" with how many it
    acked; reports what each member received and was told."""
    received: list[tuple[int, int, int, int, int]] = []  # member, partition, seq, vbucket, attempt
    losses: list[tuple[int, int, int, int]] = []  # member, worker, dropped, reason
    held: list[Any] = []
    acking = [False]
    unpack = worker_kill._head.unpack_from

    def take(member: int, msg: Any) -> None:
        i, s = unpack(msg.payload)
        received.append((member, i, s, msg.vbucket, msg.delivery_count))
        if acking[0]:
            msg.ack()
        else:
            held.append(msg)

    def told(member: int) -> Callable[[Any, int, int], None]:
        return lambda ref, n, reason: losses.append((member, ref.worker, n, reason))

    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for m in range(members):
            client = await stack.enter_async_context(
                broky.connect(url, name=f"member-{m}", reconnect_min_delay=0.05, on_loss=told(m))
            )
            await client.subscribe(
                EXACT_PATTERN, group=GROUP, ack=True, key_shared=key_shared, max_in_flight=max_in_flight,
                ack_wait=300.0, callback=functools.partial(take, m),
            )  # fmt: skip
            clients.append(client)
        roles.ready()
        async for line in roles.lines():
            if line == "held":
                roles.answer([msg.vbucket for msg in held])
            elif line == "ack":
                acking[0] = True
                for msg in held:
                    msg.ack()
                roles.answer(len(held))
                held.clear()
            elif line == "hold":
                acking[0] = False
                roles.answer("holding")
        await asyncio.sleep(0.5)
        stats = [asdict(c.stats) for c in clients]
    return {"received": received, "losses": losses, "stats": stats}


def exact_role(args: argparse.Namespace) -> int:
    """`python -m bench.chaos --role NAME --server URL --settings JSON`: a scenario's client process."""
    settings = json.loads(args.settings or "{}")
    if args.role == "subscriber":
        return roles.done(asyncio.run(exact_subscriber(args.server)))
    return roles.done(asyncio.run(group_members(args.server, **settings)))


# -------------------------------- the scenarios


def _vbucket_key(i: int) -> str:
    return str(vbucket_of(worker_kill.partition(i)))


def foreign_traffic(url: str, partitions: int, messages: int, kps: int = 64) -> int:
    """Publish `messages` to key other.k (which `w.>` does not match) over `kps`
    key_partitions of vbuckets that none of the publisher's `partitions` uses, so that
    other vbuckets of both workers carried traffic first; returns their vbuckets' count."""
    mine = {vbucket_of(worker_kill.partition(i)) for i in range(partitions)}
    foreign = [kp for kp in (b"foreign-%d" % j for j in range(100 * kps)) if vbucket_of(kp) not in mine][:kps]
    with broky.connect_sync(url) as client:
        for n in range(messages):
            client.publish(FOREIGN_KEY, b"f" * 100, partition=foreign[n % kps])
        client.flush()
    return len({vbucket_of(kp) for kp in foreign})


class Bursts:
    """Sequence-numbered publishes, as bench.worker_kill's publisher makes them (the same
    keys, key_partitions and payloads), in bursts from this process, each flushed."""

    def __init__(self, client: broky.SyncClient, partitions: int, payload_bytes: int = 100) -> None:
        self.client = client
        self.seq = [0] * partitions
        self.sent = 0
        self.pad = b"x" * (payload_bytes - worker_kill._head.size)

    def burst(self, n: int) -> None:
        for _ in range(n):
            i = self.sent % len(self.seq)
            payload = worker_kill._head.pack(i, self.seq[i]) + self.pad
            self.client.publish(worker_kill.KEY, payload, partition=worker_kill.partition(i))
            self.seq[i] += 1
            self.sent += 1
        self.client.flush()

    def report(self) -> dict[str, Any]:
        """What bench.worker_kill's publisher reports, for `count_lost`."""
        return {"sent": self.sent, "per_partition": self.seq, "refused": 0, "refused_seqs": []}


def _publisher_figures(out: Exact, published: dict[str, Any]) -> None:
    stats = published["stats"]
    out.figures["publisher: unconfirmed_lost, resent_after_loss, final flush"] = (
        f"{stats['unconfirmed_lost']}, {stats['resent_after_loss']}, "
        + (f"raised: {published['flush_error']}" if published["flush_error"] else "succeeded")
    )
    out.checks["the publisher lost nothing it published"] = (
        stats["unconfirmed_lost"] == 0 and published["flush_error"] is None and published["refused"] == 0
    )


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[0]:.2f} / {ordered[len(ordered) // 2]:.2f} / {ordered[-1]:.2f}"


def cuts_replay_off(
    cuts: int = 10,
    interval: float = 2.0,
    down: float = 0.3,
    rate: int = 2000,
    partitions: int = 300,
    foreign: int = 20_000,
    workers: int = 2,
    stall: float = 0.0,
) -> Exact:
    """`--replay-bytes 0`; `foreign` messages on other vbuckets of both workers first; then
    the subscriber's connections cut `cuts` times, `interval` s apart, under load (each a
    `down`-second outage, after `stall` s of reading nothing). Issue 37 item 2: before,
    once another vbucket of a worker had carried traffic, a resume's loss was told as
    "dropped 0 (count unknown)" per worker."""
    server = servers.start_broky(workers, ["--replay-bytes", "0"])
    url = f"{server.host}:{server.port}"
    out = Exact("cuts-replay-off", "vbucket", cuts)
    procs: list[roles.Role] = []
    back: list[float] = []
    try:
        vbuckets = foreign_traffic(url, partitions, foreign)
        out.figures["foreign traffic first"] = (
            f"{foreign} messages to key other.k on {vbuckets} other vbuckets"
        )
        sub = _start_role(procs, "subscriber", url)
        pub = worker_kill.start_publisher(procs, url, rate, partitions)
        time.sleep(1.0)
        for _ in range(cuts):
            t0 = time.monotonic()
            back.append(cut_process(sub, server.port, workers, down, stall=stall))
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
        published = pub.finish(timeout=90)
        time.sleep(0.5)
        subscribed = sub.finish()
    finally:
        roles.kill_all(procs)
        server.stop()
    count_lost(out, published, [(i, s) for i, s in subscribed["received"]], partitions, _vbucket_key)
    count_subscriber_told(out, subscribed)
    out.figures[
        "cut: reading nothing before (s), outage (s), then connected again after (s): min / median / max"
    ] = f"{stall:g}, {down:g}, {_spread(back)}"
    out.figures["subscriber: reconnects, epochs_changed, unaccounted"] = ", ".join(
        str(subscribed["stats"][k]) for k in ("reconnects", "epochs_changed", "unaccounted")
    )
    _publisher_figures(out, published)
    return out


def cuts_idle(
    idle_cuts: int = 5,
    before: int = 2000,
    lost: int = 1000,
    after: int = 300,
    down: float = 0.3,
    partitions: int = 300,
    workers: int = 2,
) -> Exact:
    """`--replay-bytes 0`; `before` messages received, then a cut while `lost` more are
    published (all lost: nothing retains them), then `idle_cuts` more cuts with nothing
    published, then `after` messages received. Issue 37 item 3: before, the loss was told
    again after every idle cut (the resume asked for the range it had been told of)."""
    server = servers.start_broky(workers, ["--replay-bytes", "0"])
    url = f"{server.host}:{server.port}"
    out = Exact("cuts-idle", "vbucket", 1 + idle_cuts)
    procs: list[roles.Role] = []
    told_after: list[int] = []
    try:
        sub = _start_role(procs, "subscriber", url)
        with broky.connect_sync(url) as client:
            pub = Bursts(client, partitions)
            pub.burst(before)
            time.sleep(0.5)
            cut_process(sub, server.port, workers, down, lambda: pub.burst(lost))
            told_after.append(_told_settled(sub))
            for _ in range(idle_cuts):
                cut_process(sub, server.port, workers, down)
                told_after.append(_told_settled(sub))
            pub.burst(after)
            published = pub.report()
        time.sleep(0.5)
        subscribed = sub.finish()
    finally:
        roles.kill_all(procs)
        server.stop()
    count_lost(out, published, [(i, s) for i, s in subscribed["received"]], partitions, _vbucket_key)
    count_subscriber_told(out, subscribed)
    out.figures["published before, during the first cut, after the idle cuts"] = f"{before}, {lost}, {after}"
    out.figures["told after the first cut, then after each idle cut"] = ", ".join(map(str, told_after))
    out.checks["what was published during the cut is what was lost"] = out.lost == lost
    out.checks["nothing told again by an idle cut"] = len(set(told_after)) == 1
    return out


def _told_settled(sub: roles.Role, quiet: float = 0.5, timeout: float = 15.0) -> int:
    """What a subscriber process was told so far, once it stays the same for `quiet` s."""
    told = json.loads(sub.ask("told"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(quiet)
        again = json.loads(sub.ask("told"))
        if again == told:
            break
        told = again
    return int(told[0])


def group_worker_kill(
    kills: int = 2,
    hold: float = 2.0,
    settle: float = 2.0,
    rate: int = 2000,
    partitions: int = 300,
    members: int = 3,
    max_in_flight: int = 20,
    key_shared: bool = False,
    workers: int = 2,
) -> Exact:
    """One server; `members` members of an ack group (load-balanced, or `key_shared`) on
    `w.>` that settle nothing for `hold` s under the publisher's load, so each reaches
    `max_in_flight` on each worker and the rest waits in the group's backlog; then a
    worker (0, then 1, ...) is SIGKILLed; once it is back the members ack what they hold
    and whatever comes for `settle` s, and hold again before the next kill. Lost: never
    received by any member; told: the notices to all members together. Issue 37 item 1:
    before, the backlog died untold, and the members were told UNACKED_LOST for what
    they held."""
    server = servers.start_broky(workers)
    url = f"{server.host}:{server.port}"
    name = "group-worker-kill" + ("-key-shared" if key_shared else "")
    out = Exact(name, "worker", kills)
    procs: list[roles.Role] = []
    held: list[str] = []
    try:
        group = _start_role(
            procs, "members", url, members=members, max_in_flight=max_in_flight, key_shared=key_shared
        )
        pub = worker_kill.start_publisher(procs, url, rate, partitions)
        for k in range(kills):
            worker = k % workers
            if k:
                group.ask("hold")
            time.sleep(hold)
            vbuckets = json.loads(group.ask("held"))  # at max_in_flight: nothing more comes
            theirs = sum(1 for vb in vbuckets if vb * workers // 1024 == worker)
            held.append(f"{len(vbuckets)} ({theirs} of worker {worker})")
            pids = server.worker_pids()
            os.kill(pids[worker], signal.SIGKILL)
            server.wait_worker_restarted(pids)
            time.sleep(0.5)  # the members are back
            group.ask("ack")
            time.sleep(settle)
        published = pub.finish(timeout=90)
        time.sleep(1.0)  # what the groups still hold goes to members that ack
        acked = group.finish()
    finally:
        roles.kill_all(procs)
        server.stop()

    def worker_of(i: int) -> str:
        return str(vbucket_of(worker_kill.partition(i)) * workers // 1024)

    count_lost(out, published, [(i, s) for _, i, s, _, _ in acked["received"]], partitions, worker_of, False)
    unacked = [n for *_, n, reason in acked["losses"] if reason == LossReason.UNACKED_LOST]
    notices = [
        (str(w), n, LossReason.name(reason))
        for _, w, n, reason in acked["losses"]
        if reason != LossReason.UNACKED_LOST
    ]
    count_told(out, notices)
    stats = {
        k: sum(s[k] for s in acked["stats"])
        for k in ("group_paused", "acks_dropped", "unacked_lost", "redeliveries")
    }
    kind = "key-shared" if key_shared else "load-balanced"
    out.figures["group"] = f"{members} members, {kind}, ack, max_in_flight {max_in_flight}"
    out.figures["held by the members at each kill (of the killed worker)"] = ", ".join(held)
    out.figures["members: group_paused, acks_dropped (acks of a dead worker's deliveries), redeliveries"] = (
        f"{stats['group_paused']}, {stats['acks_dropped']}, {stats['redeliveries']}"
    )
    out.figures["UNACKED_LOST told (the members nacked nothing)"] = (
        f"{sum(unacked)} in {len(unacked)} notices"
    )
    out.checks["the members were at max_in_flight"] = stats["group_paused"] > 0
    out.checks["UNACKED_LOST 0 for what the members held"] = not unacked and stats["unacked_lost"] == 0
    _publisher_figures(out, published)
    return out


def group_worker_kill_key_shared() -> Exact:
    """group_worker_kill with a key-shared group."""
    return group_worker_kill(key_shared=True)


class SseReader(threading.Thread):
    """An event-stream reader as a browser's EventSource is one: GET /v1/sub/PATTERN with
    Accept: text/event-stream; when its connection ends, `down` s later, the same request
    with Last-Event-ID (the last message event's id). Keeps what it received
    (key_partition index, sequence number), each `event: loss` (dropped, reason, scope)
    and each `event: cut`."""

    def __init__(self, host: str, port: int, pattern: str, down: float) -> None:
        super().__init__(name="sse-reader", daemon=True)
        self.host, self.port, self.pattern, self.down = host, port, pattern, down
        self.received: list[tuple[int, int]] = []
        self.losses: list[tuple[int | None, str, str]] = []
        self.cuts: list[Any] = []
        self.other: list[str] = []  # unavailable, denied, or a status other than 200
        self.last_id: str | None = None
        self.connects = 0
        self.local_port = 0
        self.stopping = threading.Event()
        self.stalled = threading.Event()  # set: it reads nothing (what comes waits in buffers)
        self._sock: Any = None

    def run(self) -> None:
        import http.client
        import urllib.parse

        while not self.stopping.is_set():
            conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                headers = {"Accept": "text/event-stream"}
                if self.last_id is not None:
                    headers["Last-Event-ID"] = self.last_id
                conn.request("GET", "/v1/sub/" + urllib.parse.quote(self.pattern), headers=headers)
                self._sock = conn.sock  # (the response keeps it: the connection closes after it)
                self.local_port = conn.sock.getsockname()[1]
                resp = conn.getresponse()
                if resp.status != 200:
                    self.other.append(f"status {resp.status}")
                else:
                    self.connects += 1
                    self._read(resp)
            except (OSError, http.client.HTTPException):
                pass
            finally:
                self._sock = None
                self.local_port = 0
                conn.close()
            if not self.stopping.is_set():
                time.sleep(self.down)

    def _read(self, resp: Any) -> None:
        event, eid = "", None
        data: list[bytes] = []
        while True:
            while self.stalled.is_set() and not self.stopping.is_set():
                time.sleep(0.005)
            line = resp.readline()
            if not line:
                return
            line = line.rstrip(b"\r\n")
            if not line:
                self._dispatch(event, data, eid)
                event, data, eid = "", [], None
            elif not line.startswith(b":"):
                name, _, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                if name == b"event":
                    event = value.decode()
                elif name == b"data":
                    data.append(value)
                elif name == b"id":
                    eid = value.decode()

    def _dispatch(self, event: str, data: list[bytes], eid: str | None) -> None:
        if not data:
            return
        body = json.loads(b"\n".join(data))
        if event == "loss":
            self.losses.append((body["dropped"], body["reason"], body["scope"]))
        elif event == "cut":
            self.cuts.append(body)
        elif event:
            self.other.append(event)
        else:
            payload = (
                base64.b64decode(body["payload_base64"])
                if "payload_base64" in body
                else body["payload"].encode()
            )
            self.received.append(worker_kill._head.unpack_from(payload))
            if eid is not None:
                self.last_id = eid

    def stop(self) -> None:
        self.stopping.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.join(30)


def sse_replay_off(
    cuts: int = 10,
    interval: float = 2.0,
    down: float = 0.3,
    rate: int = 2000,
    partitions: int = 300,
    foreign: int = 20_000,
    workers: int = 2,
    stall: float = 0.0,
) -> Exact:
    """`--replay-bytes 0`; `foreign` messages on other vbuckets first; an SSE reader on
    `w.>` whose connection is cut `cuts` times under load (after `stall` s of reading
    nothing) and that resumes with Last-Event-ID `down` s later each time. Issue 37 item
    4: before, such a reader was told less than it lost, and `"dropped": 0` for counts
    the server did not know."""
    server = servers.start_broky(workers, ["--replay-bytes", "0"])
    url = f"{server.host}:{server.port}"
    out = Exact("sse-replay-off", "total", cuts)
    procs: list[roles.Role] = []
    reader = SseReader(server.host, server.metrics_port, EXACT_PATTERN, down)
    back: list[float] = []
    try:
        vbuckets = foreign_traffic(url, partitions, foreign)
        out.figures["foreign traffic first"] = (
            f"{foreign} messages to key other.k on {vbuckets} other vbuckets"
        )
        reader.start()
        wait_for(lambda: reader.connects == 1, 30.0, "the SSE reader's first stream", 0.01)
        pub = worker_kill.start_publisher(procs, url, rate, partitions)
        time.sleep(1.0)
        for n in range(cuts):
            if stall:
                reader.stalled.set()
                time.sleep(stall)
            t0 = time.monotonic()
            cut_ports({reader.local_port}, server.metrics_port)
            reader.stalled.clear()
            wait_for(lambda n=n: reader.connects == n + 2, 30.0, "the SSE reader's resume", 0.01)  # type: ignore[misc]
            back.append(time.monotonic() - t0)
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
        published = pub.finish(timeout=90)
        count = -1
        while count != len(reader.received):  # until what is still coming has come
            count = len(reader.received)
            time.sleep(1.0)
    finally:
        reader.stop()
        roles.kill_all(procs)
        server.stop()
    count_lost(out, published, reader.received, partitions, None)
    # (a "dropped" of 0 says "none lost" where it means a loss: named apart from null)
    count_told(
        out, [("all", n, f'{reason} ("dropped": 0)' if n == 0 else reason) for n, reason, _ in reader.losses]
    )
    scopes: dict[str, int] = {}
    for _, _, scope in reader.losses:
        scopes[scope] = scopes.get(scope, 0) + 1
    lost_vbuckets = {vbucket_of(worker_kill.partition(i)) for i in range(partitions)}
    out.figures["loss events by scope"] = scopes or "none"
    out.figures["vbuckets the publisher used"] = len(lost_vbuckets)
    out.figures[
        "cut: reading nothing before (s), the reader's reconnect delay (s), then streaming again after (s): "
        "min / median / max"
    ] = f"{stall:g}, {down:g}, {_spread(back)}"
    out.figures["stream cut as a slow reader (event: cut), other events or statuses"] = (
        f"{len(reader.cuts)}, {reader.other or 'none'}"
    )
    _publisher_figures(out, published)
    return out


EXACT: dict[str, Callable[..., Exact]] = {
    "group-worker-kill": group_worker_kill,
    "group-worker-kill-key-shared": group_worker_kill_key_shared,
    "cuts-replay-off": cuts_replay_off,
    "cuts-idle": cuts_idle,
    "sse-replay-off": sse_replay_off,
}
STALLED = ("cuts-replay-off", "sse-replay-off")  # the scenarios `--stall` applies to


def exact_report(
    outcomes: list[Exact], scenarios: list[str], info: dict[str, Any], stall: float = 0.0
) -> str:
    from broky.server.http.gateway import LEDGER_EVENTS, STREAM_MAX_PENDING

    command = f"python -m bench.chaos --scenario {' '.join(scenarios)}" + (
        f" --stall {stall:g}" if stall else ""
    )
    rows = [
        (
            o.scenario, o.faults, f"{o.published:,}", f"{o.lost:,}",
            f"{o.told:,} ({', '.join(f'{k} {v:,}' for k, v in o.told_by_reason.items()) or '0'})",
            sum(o.unknown.values()), o.lost_minus_told, o.told_minus_lost, "yes" if o.exact else "NO",
        )
        for o in outcomes
    ]  # fmt: skip
    head = ("scenario", "faults", "published", "lost", "told (by reason)", "without a count",
            "lost - told", "told - lost", "exact")  # fmt: skip
    lines = [
        *heading("Chaos, counted exactly: lost and told per vbucket (issue 37, items 1-4)", info, command),
        "One `broky serve --workers 2` per scenario; bench.worker_kill's SDK publisher (2,000 msgs/s "
        "over 300 key_partitions, a sequence number per key_partition in every payload) unless "
        "said otherwise; cuts are `ss -K` of the client's sockets. Lost: published, received by "
        "nobody; told: the notices' counts. `lost - told` and `told - lost` are summed per "
        "vbucket (per worker for a group, whose notices name no vbucket; in total for an SSE "
        "stream, whose `event: loss` names none), so that over-telling in one place cannot hide "
        "a silent loss in another. The scenarios are in bench/chaos.py's header.",
        *(
            [
                "",
                f"With `--stall {stall:g}`: before each cut the client reads nothing for {stall:g} s "
                f"(what the server sends meanwhile waits in its buffers and the sockets', and is lost "
                f"with the cut) in {', '.join(STALLED)}.",
            ]
            if stall
            else []
        ),
        "",
        *table(head, rows, "lrrrlrrrl"),
        "",
    ]
    for o in outcomes:
        lines += [f"## {o.scenario}", "", *(f"- {line}" for line in o.lines()), ""]
        if "resume_unknown" in o.unknown:
            lines += [
                f'Why {o.scenario} is not exact here: each `resume_unknown` (`"dropped": null`) '
                f"answered a Last-Event-ID older than the last {LEDGER_EVENTS:,} events the gateway "
                f"had given the stream: its ledger keeps the positions of those only "
                '(broky/server/http/gateway.py `Ledger`, LEDGER_EVENTS; schema/HTTP.md "Event ids and '
                'resuming"). A reader that has read nothing for a while is that far behind: '
                f"what the stream was given waits in its buffer (up to {STREAM_MAX_PENDING:,} bytes "
                "before it is cut as slow) and in both kernels' socket buffers, and is lost with the "
                "cut. The gateway then resumes the id's own vbucket from its position and every "
                "other from the time of the resume, and says once that how many were lost there is "
                "not known; the EVICTED notices without a count are that restart's (a start from "
                "a time that finds the vbucket's earlier messages gone, with nothing retained). The "
                "server cannot count those: it no longer holds the positions the id stood for.",
                "",
            ]
    return "\n".join(lines)


def run_exact(names: list[str], out_dir: Path, info: dict[str, Any], args: argparse.Namespace) -> bool:
    """Run the exact-count scenarios `names` (`args.stall` for those of STALLED); results in
    chaos_exact.md and .json (chaos_exact_stalled.* with a stall)."""
    stall = getattr(args, "stall", 0.0)
    outcomes = []
    for name in names:
        out = EXACT[name](stall=stall) if stall and name in STALLED else EXACT[name]()
        print(f"{name}:", *out.lines(), sep="\n  ", flush=True)
        outcomes.append(out)
    data = {o.scenario: {**asdict(o), **o.verdict()} for o in outcomes}
    name = "chaos_exact_stalled" if stall else "chaos_exact"
    write_results(out_dir, name, exact_report(outcomes, names, info, stall), info, args, **data)
    return all(o.exact for o in outcomes)


# ---------------------------------------------------------------- main


SCENARIOS: dict[str, Callable[[], Outcome]] = {
    "server-restart": server_restart,
    "node-kill-loop": node_kill_loop,
    "frozen-node": frozen_node,
    "etcd-outage": etcd_outage,
    "etcd-wipe": etcd_wipe,
}


def report(outcomes: list[Outcome], scenarios: list[str], info: dict[str, Any]) -> str:
    rows = [
        (
            o.scenario, f"{o.published:,}", o.lost, o.told, o.unaccounted_notices,
            f"{o.duplicates} ({o.duplicates_dropped})", o.out_of_order,
            ", ".join(f"{r:.1f}" for r in o.recoveries()) or "-", max(o.untold, 0),
        )
        for o in outcomes
    ]  # fmt: skip
    head = ("scenario", "published", "lost", "told (counted)", "UNACCOUNTED notices",
            "duplicates delivered (copies dropped)", "out of order", "recovery (s)",
            "lost - told")  # fmt: skip
    command = f"python -m bench.chaos --scenario {' '.join(scenarios)}"
    lines = [
        *heading("Chaos: restarts, kills, freezes and etcd faults under SDK load", info, command),
        "An SDK publisher at 2,000 msgs/s over 300 key_partitions (a sequence number per "
        "key_partition in every payload), an SDK subscriber on `w.>`; the scenarios are in "
        "bench/chaos.py's header. Recovery: until every key_partition a fault struck flowed "
        "again (for a fault that struck none: until a message published after it arrived).",
        "",
        *table(head, rows, "lrrrrrrlr"),
        "",
    ]
    for out in outcomes:
        lines += [f"## {out.scenario}", "", *(f"- {line}" for line in out.lines()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.chaos", __doc__, out=options.RESULTS, role=("subscriber", "members"))
    every = sorted(SCENARIOS) + sorted(EXACT)
    parser.add_argument("--scenario", nargs="+", choices=every, default=every)
    parser.add_argument(
        "--stall",
        type=float,
        default=0.0,
        help=f"seconds the client reads nothing before each cut ({', '.join(STALLED)})",
    )
    options.role_options(parser, "server", "settings")  # a scenario's client process
    args = parser.parse_args(argv)
    if args.role:
        return exact_role(args)
    chosen = args.scenario
    args.scenario = [name for name in chosen if name in SCENARIOS]  # (chaos.json's settings)
    info = machine_info()
    outcomes = []
    for name in args.scenario:
        out = SCENARIOS[name]()
        print(f"{name}:", *out.lines(), sep="\n  ", flush=True)
        outcomes.append(out)
    data = {o.scenario: asdict(o) for o in outcomes}
    if outcomes:
        write_results(args.out, "chaos", report(outcomes, args.scenario, info), info, args, **data)
    args.scenario = [name for name in chosen if name in EXACT]  # (chaos_exact.json's)
    kept = run_exact(args.scenario, args.out, info, args) if args.scenario else True
    return 0 if all(o.promise_kept for o in outcomes) and kept else 1


if __name__ == "__main__":
    sys.exit(main())
