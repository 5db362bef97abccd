"""Server CPU per delivered message: a three-node cluster against one node.

    python -m bench.cluster_cpu [--runs 3] [--rate 20000] [--seconds 5] [--partitions 256]

Nothing on the data path crosses nodes: a publish goes from the SDK to the
worker that owns its vbucket, which delivers it to its own subscribers'
connections. So a cluster should cost what one node with as many workers
costs, per message. Measured with the same load on each setup, alternating
setups in every round (the machine is shared and noisy):

- one node with 3 workers, and three nodes with 1 worker each (the same
  number of shards: the comparison that isolates the cluster);
- one node with 3 workers in a cluster of its own (etcd, lease, map watch:
  what the control plane costs a node, apart from having several nodes);
- one node with 6 workers, the single-node twin of three nodes with 2;
- three nodes with 2 workers each (what examples/cluster/ runs: twice the
  shards, each with half the traffic);

each with bench.worker_kill's SDK subscriber (on `w.>`, seed: the first
node) and SDK publisher (`--rate` msgs/s over `--partitions` key_partitions,
100-byte payloads, seed: the last node) for `--seconds`. Server CPU is user
+ system time of every Broky process (masters and workers of every node)
from the publisher's start until the subscriber has everything; etcd's own
CPU over the same time is shown apart (the control plane, idle while the map
holds). Each master and worker also costs a little CPU when idle (timers,
the supervisor, the cluster node's lease and watch): that is measured before
the load and subtracted for the "data path" figure, so that the fixed cost
of three masters is not mistaken for a cost per message. Results:
bench/results/cluster_cpu.md and .json with the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import worker_kill  # noqa: E402
from bench.harness import options, procstat, roles, servers  # noqa: E402
from bench.harness.cluster import ClusterRun  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402

SETUPS = {  # name -> (nodes, workers per node, in a cluster)
    "1 node x 3 workers": (1, 3, False),
    "1-node cluster x 3 workers": (1, 3, True),
    "3 nodes x 1 worker": (3, 1, True),
    "3 nodes x 2 workers": (3, 2, True),
    "1 node x 6 workers": (1, 6, False),
}
IDLE_SECONDS = 3.0  # the servers' idle CPU is measured over this long before the load
MEDIANS = ("Setup", "Delivered", "Server CPU per delivery", "vs one node", "Idle server CPU",
           "Data-path CPU per delivery", "vs one node", "etcd CPU (s)")  # fmt: skip
EVERY = ("Setup", "Run", "Published", "Delivered", "Time (s)", "Server CPU (s)", "of it, masters (s)",
         "Idle (ms/s)", "µs per delivery", "data path")  # fmt: skip


def one_run(
    nodes: int, workers: int, clustered: bool, rate: int, seconds: float, partitions: int
) -> dict[str, Any]:
    """Start the setup, run the load, stop everything: the figures of this run."""
    cluster: ClusterRun | None = None
    single: servers.Server | None = None
    procs: list[roles.Role] = []
    try:
        if not clustered:
            single = servers.start_broky(workers)
            seeds_sub = seeds_pub = f"{single.host}:{single.port}"
            server_pids = single.pids
            master_pids = [single.pid]
            etcd_pids: list[int] = []
        else:
            cluster = ClusterRun(workers)
            names = [chr(ord("a") + n) for n in range(nodes)]
            for name in names:
                cluster.start(name)
            cluster.wait_settled()
            seeds_sub, seeds_pub = cluster.seeds(names[0]), cluster.seeds(names[-1])

            def server_pids() -> list[int]:
                assert cluster is not None
                return [pid for node in cluster.nodes.values() for pid in node.pids()]

            master_pids = [node.pid for node in cluster.nodes.values()]
            assert cluster.etcd.proc is not None
            etcd_pids = [cluster.etcd.proc.pid]
        sub = worker_kill.start_subscriber(procs, seeds_sub)
        time.sleep(0.5)
        idle0 = procstat.total_cpu_seconds(server_pids())
        time.sleep(IDLE_SECONDS)
        idle_per_s = (procstat.total_cpu_seconds(server_pids()) - idle0) / IDLE_SECONDS
        cpu0, etcd0 = procstat.total_cpu_seconds(server_pids()), procstat.total_cpu_seconds(etcd_pids)
        masters0 = procstat.total_cpu_seconds(master_pids)
        t0 = time.monotonic()
        pub = worker_kill.start_publisher(procs, seeds_pub, rate, partitions, seconds)
        published = pub.finish(None, timeout=seconds + 120)
        time.sleep(0.3)  # the last deliveries (the subscriber keeps up at this rate)
        cpu = procstat.total_cpu_seconds(server_pids()) - cpu0
        elapsed = time.monotonic() - t0
        masters_cpu = procstat.total_cpu_seconds(master_pids) - masters0
        etcd_cpu = procstat.total_cpu_seconds(etcd_pids) - etcd0
        subscribed = sub.finish(timeout=120)
    finally:
        roles.kill_all(procs)
        if single is not None:
            single.stop()
        if cluster is not None:
            cluster.stop()
    delivered = len(subscribed["received"])
    data_path = max(cpu - idle_per_s * elapsed, 0.0)
    return {
        "published": published["sent"],
        "delivered": delivered,
        "elapsed_s": round(elapsed, 3),
        "server_cpu_s": round(cpu, 3),
        "idle_server_cpu_per_s": round(idle_per_s, 4),
        "masters_cpu_s": round(masters_cpu, 3),
        "etcd_cpu_s": round(etcd_cpu, 3),
        "server_cpu_us_per_delivery": round(cpu / max(delivered, 1) * 1e6, 3),
        "data_path_cpu_us_per_delivery": round(data_path / max(delivered, 1) * 1e6, 3),
    }


def run(runs: int, rate: int, seconds: float, partitions: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
    for r in range(runs):
        for name in options.alternating(list(SETUPS), r):
            nodes, workers, clustered = SETUPS[name]
            got = one_run(nodes, workers, clustered, rate, seconds, partitions)
            results[name].append(got)
            print(f"round {r + 1}, {name}: {got}", flush=True)
    return results


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    def median(name: str, key: str) -> float:
        return float(statistics.median(x[key] for x in results[name]))

    base = median("1 node x 3 workers", "server_cpu_us_per_delivery")
    base_data = median("1 node x 3 workers", "data_path_cpu_us_per_delivery")
    command = (
        f"python -m bench.cluster_cpu --runs {args.runs} --rate {args.rate} "
        f"--seconds {args.seconds:g} --partitions {args.partitions}"
    )
    medians = []
    for name in SETUPS:
        per = median(name, "server_cpu_us_per_delivery")
        data = median(name, "data_path_cpu_us_per_delivery")
        medians.append((
            name, f"{median(name, 'delivered'):,.0f}", f"{per:.2f} µs", f"{per / base:.2f}x",
            f"{median(name, 'idle_server_cpu_per_s') * 1000:.1f} ms/s", f"{data:.2f} µs",
            f"{data / base_data:.2f}x", f"{median(name, 'etcd_cpu_s'):.2f}",
        ))  # fmt: skip
    every = [
        (name, i + 1, x["published"], x["delivered"], x["elapsed_s"], x["server_cpu_s"], x["masters_cpu_s"],
         f"{x['idle_server_cpu_per_s'] * 1000:.1f}", x["server_cpu_us_per_delivery"],
         x["data_path_cpu_us_per_delivery"])
        for name in SETUPS
        for i, x in enumerate(results[name])
    ]  # fmt: skip
    lines = [
        *heading("Server CPU per delivered message: a three-node cluster against one node", info, command),
        f"Each setup gets the same load, {args.runs} times, the setups alternating within every round: an "
        f"SDK publisher process at {args.rate} msgs/s over {args.partitions} key_partitions (100-byte "
        f"payloads) for {args.seconds:g} s, an SDK subscriber process on `w.>`, their seeds on different "
        "nodes. Server CPU: user + system time of every Broky process (masters and workers of every node) "
        "from the publisher's start until the subscriber had everything. Idle: the same processes' CPU per "
        f"second over {IDLE_SECONDS:g} s before the load, subscriber connected. Data path: server CPU minus "
        "idle CPU over the same time. Medians of the runs.",
        "",
        *table(MEDIANS, medians),
        "",
        "Every run:",
        "",
        *table(EVERY, every),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.cluster_cpu", __doc__, out=options.RESULTS, runs=3)
    parser.add_argument("--rate", type=int, default=20000, help="msgs/s published")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--partitions", type=int, default=256)
    args = parser.parse_args(argv)
    info = machine_info()
    results = run(args.runs, args.rate, args.seconds, args.partitions)
    write_results(args.out, "cluster_cpu", report(results, args, info), info, args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
