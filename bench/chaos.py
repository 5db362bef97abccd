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
is also what tests/test_server_restart.py runs, short.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import worker_kill  # noqa: E402
from bench.cluster_failover import ClusterRun, Load, owned_partitions  # noqa: E402
from bench.harness import children, servers  # noqa: E402
from bench.harness.cluster import agreed, start_node, wait_for  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.report import write_results  # noqa: E402
from broky.protocol import LossReason  # noqa: E402

RESULTS = ROOT / "bench" / "results"
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
    procs: list[subprocess.Popen[str]] = []
    faults: list[dict[str, Any]] = []
    try:
        sub = worker_kill._spawn("subscriber", url)
        procs.append(sub)
        assert sub.stdout is not None
        if sub.stdout.readline().strip() != "ready":
            raise RuntimeError("the subscriber did not start")
        pub = worker_kill._spawn(
            "publisher", url, "--rate", str(rate), "--duration", "0", "--partitions", str(partitions)
        )
        procs.append(pub)
        assert pub.stdout is not None
        if pub.stdout.readline().strip() != "publishing":
            raise RuntimeError("the publisher did not start")
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
        pub_out, _ = pub.communicate("stop\n", timeout=90)
        sub_out, _ = sub.communicate("stop\n", timeout=60)
        published, subscribed = children.last_json(pub_out), children.last_json(sub_out)
    finally:
        children.kill_all(procs)
        server.stop()
    return analyse("server-restart", published, subscribed, partitions, rate, faults)


# ---------------------------------------------------------------- the cluster


class Cluster(ClusterRun):
    """bench.cluster_failover's cluster, each node on ports of its own that it keeps
    when it is started again (a node restarted under its old id, at its old address)."""

    def __init__(self, workers: int = 2, lease_ttl: int | None = None, *node_args: str) -> None:
        super().__init__(workers, lease_ttl, *node_args)
        self.ports: dict[str, tuple[int, int]] = {}

    def start(self, node_id: str) -> servers.Server:
        port, metrics = self.ports.setdefault(node_id, (servers.free_port(), servers.free_port()))
        node = start_node(
            self.url, node_id, self.workers, self.lease_ttl, *self.node_args,
            "--port", str(port), "--metrics-port", str(metrics),
        )  # fmt: skip
        self.nodes[node_id] = node
        return node

    def pids(self, node_id: str) -> list[int]:
        """The node's master and workers."""
        node = self.nodes[node_id]
        children = Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split()
        return [node.pid, *map(int, children)]


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
    cluster = Cluster(workers, lease_ttl, *node_args)
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

    def faults(cluster: Cluster, partitions: int) -> list[dict[str, Any]]:
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

    def faults(cluster: Cluster, partitions: int) -> list[dict[str, Any]]:
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

    def faults(cluster: Cluster, partitions: int) -> list[dict[str, Any]]:
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

    def faults(cluster: Cluster, partitions: int) -> list[dict[str, Any]]:
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


# ---------------------------------------------------------------- main


SCENARIOS: dict[str, Callable[[], Outcome]] = {
    "server-restart": server_restart,
    "node-kill-loop": node_kill_loop,
    "frozen-node": frozen_node,
    "etcd-outage": etcd_outage,
    "etcd-wipe": etcd_wipe,
}


def report(outcomes: list[Outcome], scenarios: list[str], info: dict[str, Any]) -> str:
    lines = [
        "# Chaos: restarts, kills, freezes and etcd faults under SDK load",
        "",
        f"Machine: {describe(info)}.",
        "",
        f"Command: `python -m bench.chaos --scenario {' '.join(scenarios)}`",
        "",
        "An SDK publisher at 2,000 msgs/s over 300 key_partitions (a sequence number per "
        "key_partition in every payload), an SDK subscriber on `w.>`; the scenarios are in "
        "bench/chaos.py's header. Recovery: until every key_partition a fault struck flowed "
        "again (for a fault that struck none: until a message published after it arrived).",
        "",
        "| scenario | published | lost | told (counted) | UNACCOUNTED notices | duplicates delivered "
        "(copies dropped) | out of order | recovery (s) | lost - told |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for o in outcomes:
        rec = ", ".join(f"{r:.1f}" for r in o.recoveries()) or "-"
        lines.append(
            f"| {o.scenario} | {o.published:,} | {o.lost} | {o.told} | {o.unaccounted_notices} | "
            f"{o.duplicates} ({o.duplicates_dropped}) | {o.out_of_order} | {rec} | {max(o.untold, 0)} |"
        )
    lines.append("")
    for out in outcomes:
        lines += [f"## {out.scenario}", "", *(f"- {line}" for line in out.lines()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", nargs="+", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    info = machine_info()
    outcomes = []
    for name in args.scenario:
        out = SCENARIOS[name]()
        print(f"{name}:", *out.lines(), sep="\n  ", flush=True)
        outcomes.append(out)
    data = {o.scenario: asdict(o) for o in outcomes}
    write_results(args.out, "chaos", report(outcomes, args.scenario, info), info, args, **data)
    return 0 if all(o.promise_kept for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
