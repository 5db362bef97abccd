"""Cluster drain loop: what a node's drain (SIGTERM) costs SDK users, the leader's and the others'.

    python -m bench.cluster_drain [--drains 15] [--rate 300] [--partitions 100] [--down 0]
                                  [--node-arg=--drain-linger=0 ...] [--name cluster_drain]
                                  [--logs DIR]

A real etcd and three `broky serve --cluster` nodes (a, b, c) with 2 workers
each on loopback, default settings (plus `--node-arg`s), each on ports of its
own that it keeps when it is started again (bench.harness.cluster.ClusterRun
with keep_ports). Under
bench.worker_kill's SDK publisher (`--rate` msgs/s round-robin over
`--partitions` key_partitions, a sequence number per key_partition; seed: c)
and SDK subscriber on `w.>` (seed: a), every round drains a node (SIGTERM:
its vbuckets move to the others, it says Goodbye and leaves) and, once it
exited, starts it again under its id and at its address `--down` seconds
later (a rolling restart), then waits until the three agree on a balanced
map again. Every third round drains the leader (the member that writes the
map), the others one of the other two in turn.

A thread watches the map key in etcd and notes when each version was
written. Per drain, from the SIGTERM:

- committed: the move that takes the node's vbuckets is committed (a map
  without `incoming` in which it owns none): every vbucket is served by the
  others from then on;
- exited: the node's process exited (after --drain-linger, if it retained
  messages of what it handed over);
- whole: the map that no longer names the node is written (its last map:
  the drain is over for the cluster), if one is before the node is back;
- rejoined: the node, started again, has its share back (the three settled
  on one balanced map: the rolling restart of that node is done);
- whether the move was prepared first (a map naming the node's vbuckets in
  `incoming` before the commit) and whether any node logged a commit after
  the move timeout, or a leadership change, during the round;
- the loss notices the subscriber got during the round (UNACCOUNTED: "some
  may be lost, how many is unknown").

And over the run: published, received, lost (published, never received),
told, duplicates, out of order (bench.chaos.analyse). Results:
bench/results/`--name`.md and .json with the machine and commit; `--logs`
keeps every node's whole log. tests/cluster/test_cluster_sdk.py drains a node and
the leader with `drain_once`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.chaos import Outcome, analyse  # noqa: E402
from bench.harness import options  # noqa: E402
from bench.harness.cluster import ClusterRun  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402
from bench.worker_kill import Load  # noqa: E402
from broky.protocol import NO_OWNER, LossReason, VBucketMap  # noqa: E402

NAMES = ("a", "b", "c")


class MapWatch:
    """A thread that watches <prefix>/map in etcd: (time written, map) of every version."""

    def __init__(self, cluster: ClusterRun, prefix: str = "/broky") -> None:
        self.endpoint = ("127.0.0.1", cluster.etcd.client_port)
        self.key = f"{prefix}/map"
        self.maps: list[tuple[float, VBucketMap]] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._watch())
        finally:
            self.loop.close()

    async def _watch(self) -> None:
        from broky.cluster.etcd import PUT, Etcd, EtcdError

        etcd = Etcd(self.endpoint, 3.0)
        try:
            revision, _ = await etcd.get_prefix(self.key)
            async for event in etcd.watch(self.key, revision + 1):
                if event.kind == PUT and event.kv.key == self.key:
                    vmap = VBucketMap.from_json(json.loads(event.kv.value))
                    with self.lock:
                        self.maps.append((time.time(), vmap))
        except (EtcdError, asyncio.CancelledError):
            pass
        finally:
            await etcd.close()

    def since(self, t: float) -> list[tuple[float, VBucketMap]]:
        with self.lock:
            return [(at, m) for at, m in self.maps if at >= t]

    def stop(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(self.loop)])
        self.thread.join(10)


def names(vmap: VBucketMap) -> set[str]:
    return {n.node_id for n in vmap.nodes}


def owns(vmap: VBucketMap, node_id: str) -> bool:
    index = vmap.node_index(node_id)
    return index is not None and any(n == index for n, _ in vmap.owners)


def receives_from(vmap: VBucketMap, node_id: str) -> bool:
    """`vmap` prepares to move vbuckets of `node_id` elsewhere."""
    index = vmap.node_index(node_id)
    if index is None or vmap.incoming is None:
        return False
    return any(o[0] == index and i != NO_OWNER for o, i in zip(vmap.owners, vmap.incoming))


@dataclass
class Drain:
    node: str
    leader: bool
    time: float  # the SIGTERM
    committed_s: float | None = None
    exited_s: float | None = None
    whole_s: float | None = None  # None: the node was back before a map dropped it
    rejoined_s: float | None = None  # started again, the three settled on a balanced map
    prepared: bool = False  # the commit followed a map that prepared the node's vbuckets to move
    move_timeouts: int = 0  # commits after the move timeout logged during the round
    exit_code: int | None = None
    notices: dict[str, int] = field(default_factory=dict)  # loss reason -> notices during the round
    leadership: list[str] = field(default_factory=list)  # leadership lines logged during the round


def drain_once(
    cluster: ClusterRun,
    watch: MapWatch,
    victim: str,
    leader: bool,
    down: float,
    timeout: float,
    logs: Path | None = None,
) -> Drain:
    """Drain `victim`, start it again `down` s after it exited, wait until the three settled
    (`logs`: a directory to keep the victim's whole log in)."""
    node = cluster.nodes[victim]
    assert node.proc is not None
    logs_before = {n: s.full_log() for n, s in cluster.nodes.items()}
    drain = Drain(victim, leader, time.time())
    node.proc.send_signal(signal.SIGTERM)
    drain.exit_code = node.proc.wait(timeout)
    drain.exited_s = round(time.time() - drain.time, 3)
    whole_log = node.full_log()
    victim_log = whole_log[len(logs_before.pop(victim)) :]
    if logs is not None:
        (logs / f"{victim}-until-{time.strftime('%H%M%S')}.log").write_text(whole_log)
    del cluster.nodes[victim]
    node.stop()
    time.sleep(down)
    cluster.start(victim)  # again, under its id, at its address
    cluster.wait_settled(timeout)
    drain.rejoined_s = round(time.time() - drain.time, 3)
    maps = watch.since(drain.time)
    commit = next(((at, m) for at, m in maps if m.incoming is None and not owns(m, victim)), None)
    if commit is not None:
        drain.committed_s = round(commit[0] - drain.time, 3)
        drain.prepared = any(receives_from(m, victim) for at, m in maps if at <= commit[0])
    gone = next((at for at, m in maps if victim not in names(m)), None)
    drain.whole_s = None if gone is None else round(gone - drain.time, 3)
    texts = [
        victim_log,
        *(s.full_log()[len(logs_before.get(n, "")) :] for n, s in cluster.nodes.items() if n != victim),
    ]
    for text in texts:
        drain.move_timeouts += text.count("after the move timeout")
        drain.leadership += [
            line.split("broky.cluster: ", 1)[-1] for line in text.splitlines() if "leader" in line
        ]
    return drain


def run(
    drains: int = 15,
    rate: int = 300,
    partitions: int = 100,
    down: float = 0.0,
    node_args: tuple[str, ...] = (),
    timeout: float = 90.0,
    logs: Path | None = None,
) -> tuple[list[Drain], Outcome]:
    """`drains` rounds of drain and restart under SDK load (see the header)."""
    cluster = ClusterRun(2, None, *node_args, keep_ports=True)
    load: Load | None = None
    watch: MapWatch | None = None
    done: list[Drain] = []
    try:
        for name in NAMES:
            cluster.start(name)
        cluster.wait_settled(timeout)
        watch = MapWatch(cluster)
        load = Load(cluster.seeds("a"), cluster.seeds("c"), rate, partitions)
        time.sleep(2.0)
        for k in range(drains):
            leader = cluster.leader()
            others = sorted(n for n in cluster.nodes if n != leader)
            victim = leader if k % 3 == 2 else others[(k // 3) % len(others)]
            drain = drain_once(cluster, watch, victim, victim == leader, down, timeout, logs)
            done.append(drain)
            time.sleep(2.0)
            print(f"round {len(done)}: drained {victim}{' (the leader)' if drain.leader else ''}", flush=True)
        published, subscribed = load.finish()
    finally:
        if logs is not None:
            for name, node in cluster.nodes.items():
                (logs / f"{name}-last.log").write_text(node.full_log())
        if load is not None:
            load.kill()
        if watch is not None:
            watch.stop()
        cluster.stop()
    for d, following in itertools.zip_longest(done, done[1:]):
        end = following.time if following is not None else float("inf")
        for _, _, reason, t in subscribed["losses"]:
            if d.time <= t < end:
                name = LossReason.name(reason)
                d.notices[name] = d.notices.get(name, 0) + 1
    outcome = analyse("drain-loop", published, subscribed, partitions, rate, [{"time": d.time} for d in done])
    return done, outcome


GROUPS = ("drains", "n", "committed (s): min / median / max", "exited (s)", "whole (s)", "rejoined (s)",
          "prepared first", "move timeouts", "loss notices")  # fmt: skip
ROUNDS = ("round", "node", "leader", "committed (s)", "exited (s)", "whole (s)", "rejoined (s)",
          "prepared first", "move timeouts", "loss notices")  # fmt: skip


def _row(d: Drain, n: int) -> tuple[Any, ...]:
    notices = ", ".join(f"{v} {k}" for k, v in sorted(d.notices.items())) or "none"
    whole = "never (back first)" if d.whole_s is None else d.whole_s
    return (n, d.node, "yes" if d.leader else "no", d.committed_s, d.exited_s, whole, d.rejoined_s,
            "yes" if d.prepared else "NO", d.move_timeouts, notices)  # fmt: skip


def _spread(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    never = len(values) - len(known)
    text = f"{min(known):.2f} / {statistics.median(known):.2f} / {max(known):.2f}" if known else "-"
    return text + (f" (never: {never})" if never else "")


def report(drains: list[Drain], outcome: Outcome, args: argparse.Namespace, info: dict[str, Any]) -> str:
    node_args = "".join(f" --node-arg={a}" for a in args.node_arg)
    command = (
        f"python -m bench.cluster_drain --drains {args.drains} --rate {args.rate} "
        f"--partitions {args.partitions} --down {args.down:g}{node_args}"
        + (f" --name {args.name}" if args.name != "cluster_drain" else "")
    )
    leader = [d for d in drains if d.leader]
    other = [d for d in drains if not d.leader]
    groups = [
        (
            label, len(group), _spread([d.committed_s for d in group]), _spread([d.exited_s for d in group]),
            _spread([d.whole_s for d in group]), _spread([d.rejoined_s for d in group]),
            f"{sum(d.prepared for d in group)} of {len(group)}", sum(d.move_timeouts for d in group),
            sum(sum(d.notices.values()) for d in group),
        )
        for label, group in (("the leader", leader), ("another node", other))
    ]  # fmt: skip
    lines = [
        *heading("Cluster drain loop: the leader's drain and the others'", info, command, with_peers=False),
        "etcd and three `broky serve --cluster` nodes with 2 workers each, default settings"
        + (f" but `{' '.join(args.node_arg)}`" if args.node_arg else "")
        + f"; an SDK publisher at {args.rate} msgs/s over {args.partitions} key_partitions (seed: c), "
        f"an SDK subscriber on `w.>` (seed: a). {args.drains} rounds: a node drained (SIGTERM), "
        f"started again at its address {args.down:g} s after it exited (a rolling restart), the three "
        "settled; every third round the leader. Times from the SIGTERM: committed (the map that takes "
        "the node's vbuckets is written: the others serve them all), exited (the process; after "
        "`--drain-linger` when it retained messages), whole (the map that no longer names the node "
        "is written: the drain is over; never, when the node was back before such a map), rejoined "
        "(started again, the three settled on one balanced map).",
        "",
        *table(GROUPS, groups, "lrlllllrr"),
        "",
        *table(ROUNDS, [_row(d, n + 1) for n, d in enumerate(drains)], "rllrrrrlrl"),
        "",
        f"Over the run: published {outcome.published:,}, received {outcome.received:,}, lost {outcome.lost}, "
        f"told {outcome.told}, UNACCOUNTED notices {outcome.unaccounted_notices}, duplicates delivered "
        f"{outcome.duplicates} (copies dropped by the SDK: {outcome.duplicates_dropped}), out of order "
        f"{outcome.out_of_order}, publisher's unconfirmed_lost {outcome.publisher_unconfirmed_lost}.",
        "",
        "Leadership during the rounds of the leader's drain (as the nodes logged it):",
        "",
        *(f"- round {drains.index(d) + 1} ({d.node}): " + "; ".join(d.leadership) for d in leader),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.cluster_drain", __doc__, out=options.RESULTS, name="cluster_drain")
    parser.add_argument("--drains", type=int, default=15)
    parser.add_argument("--rate", type=int, default=300, help="msgs/s published")
    parser.add_argument("--partitions", type=int, default=100)
    parser.add_argument(
        "--down", type=float, default=0.0, help="seconds between a node's exit and its restart"
    )
    parser.add_argument(
        "--node-arg",
        action="append",
        default=[],
        help="an argument for every node (repeat; e.g. --drain-linger=0)",
    )
    parser.add_argument("--logs", type=Path, default=None, help="keep every node's log in this directory")
    args = parser.parse_args(argv)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    drains, outcome = run(
        args.drains, args.rate, args.partitions, args.down, tuple(args.node_arg), logs=args.logs
    )
    data = {"drains": [asdict(d) for d in drains], "outcome": asdict(outcome)}
    write_results(args.out, args.name, report(drains, outcome, args, info), info, args, **data)
    quiet = all(not d.notices for d in drains) and outcome.lost == 0
    return 0 if quiet and all(d.prepared and not d.move_timeouts for d in drains) else 1


if __name__ == "__main__":
    sys.exit(main())
