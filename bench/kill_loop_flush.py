"""Node kill loop with clients that flush every second: no client ever busy-waits.

    python -m bench.kill_loop_flush [--minutes 2] [--nodes 3] [--clients 2] [--every 10]
                                    [--down 3 5] [--lease-ttl 2] [--rate 200] [--flush-timeout 20]

A real etcd and `--nodes` `broky serve --cluster` nodes x 2 workers
(bench.harness.cluster.ClusterRun, keep_ports: a node started again keeps its
ports). `--clients` SDK client
processes, alternately the asyncio client and the blocking one
(`broky.connect_sync`), each given every node as a seed: each subscribes to
`w.>`, publishes `--rate` msgs/s over `--partitions` key_partitions, and calls
`flush(timeout=--flush-timeout)` once a second (the next one a second after
the last began, or at once if it took longer). Every `--every` seconds one
node, in turn, is SIGKILLed and started again under its id `--down` seconds
later (with leases of `--lease-ttl` s, it leaves the map before it comes
back: the clients' Links to it are retired, schema/README.md 6.3), for
`--minutes`.

Measured, per client process:

- its CPU share in every second of the run (utime + stime of /proc/<pid>/stat,
  sampled by this process once a second): a client that busy-waits takes a
  whole core (issue 37: a flush pending on a node that died spun in
  `Link.round_trip` at 100 % and never returned);
- every flush: when it began, how long it took and how it ended (returned, or
  the class of the error it raised): a flush ends within its timeout, with
  the fate of the nodes it waited for;
- what its subscriber received, and the longest time without a delivery
  (the subscriber of a spinning client stopped receiving);
- whether it answered "stop" at the end (a client that spins never does: it is
  killed by pid and counted as hung).

The promise checked: no client hung, no second in which a client took more
than SPIN_SHARE of a core, every flush ended within its timeout (+ FLUSH_SLACK).
Results: bench/results/kill_loop_flush.md and .json with the machine.
`run` is also what tests/cluster/test_cluster_sdk.py runs, short (one kill).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench.harness import options, procstat, roles  # noqa: E402
from bench.harness.cluster import ClusterRun  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402
from broky.protocol import LossReason  # noqa: E402

KEY = b"w.k"
PAYLOAD = b"x" * 100
SAMPLE_SECONDS = 1.0
# A second in which a client process took more than this share of a core is a spin: the
# clients here use a few percent (a busy wait takes all of it, or all the machine gives).
SPIN_SHARE = 0.5
# A flush may end this long after its timeout (the loop turn that raises it, a busy machine).
FLUSH_SLACK = 2.0
DRAIN_SECONDS = 1.0  # a client that stopped publishing takes the last deliveries for this long
APIS = ("asyncio", "blocking")


# ---------------------------------------------------------------- the client processes


class Tally:
    """What a client's subscriber received: a count and the longest gap between deliveries."""

    def __init__(self) -> None:
        self.received = 0
        self.last = 0.0
        self.longest_gap = 0.0

    def add(self) -> None:
        now = time.monotonic()
        if self.last:
            self.longest_gap = max(self.longest_gap, now - self.last)
        self.last = now
        self.received += 1


def _report(
    api: str, tally: Tally, flushes: list[tuple[float, float, str]], published: int, refused: int,
    errors: Counter[str], losses: Counter[str], stats: broky.ClientStats,
) -> dict[str, Any]:  # fmt: skip
    return {
        "api": api,
        "published": published,
        "refused": refused,
        "received": tally.received,
        "longest_gap_s": round(tally.longest_gap, 3),
        "flushes": flushes,
        "errors": dict(errors),
        "losses": dict(losses),
        "stats": {
            name: getattr(stats, name)
            for name in ("reconnects", "map_refreshes", "unconfirmed_lost", "resent_after_loss", "refused")
        },
    }


async def asyncio_client(seeds: str, rate: int, partitions: int, flush_timeout: float) -> dict[str, Any]:
    """The asyncio client's loop: subscribe, publish at `rate`, flush every second, until stdin says stop."""
    tally = Tally()
    errors: Counter[str] = Counter()
    losses: Counter[str] = Counter()
    flushes: list[tuple[float, float, str]] = []
    kps = [b"tenant-%d" % i for i in range(partitions)]
    published = refused = 0
    async with broky.connect(seeds, flush_timeout=flush_timeout, **_callbacks(errors, losses)) as client:
        await client.subscribe("w.>", callback=lambda msg: tally.add())
        loop = asyncio.get_running_loop()
        stop = roles.next_line()

        async def publishing() -> None:
            nonlocal published, refused
            start = loop.time()
            while not stop.done():
                due = int((loop.time() - start) * rate)
                while published + refused < due:
                    try:
                        await client.publish(KEY, PAYLOAD, partition=kps[(published + refused) % partitions])
                        published += 1
                    except broky.PublishBufferFullError:
                        refused += 1
                await asyncio.sleep(0.005)

        async def flushing() -> None:
            while not stop.done():
                began, t0 = time.time(), loop.time()
                try:
                    await client.flush(timeout=flush_timeout)
                    outcome = "ok"
                except broky.BrokyError as exc:
                    outcome = type(exc).__name__
                flushes.append((began, round(loop.time() - t0, 3), outcome))
                await asyncio.wait([stop], timeout=max(0.0, SAMPLE_SECONDS - (loop.time() - t0)))

        roles.ready()
        await asyncio.gather(publishing(), flushing())
        await asyncio.sleep(DRAIN_SECONDS)  # the last deliveries
        stats = client.stats
    return _report("asyncio", tally, flushes, published, refused, errors, losses, stats)


def blocking_client(seeds: str, rate: int, partitions: int, flush_timeout: float) -> dict[str, Any]:
    """The same with the blocking client: a thread publishes, one reads, this one flushes."""
    tally = Tally()
    errors: Counter[str] = Counter()
    losses: Counter[str] = Counter()
    flushes: list[tuple[float, float, str]] = []
    kps = [b"tenant-%d" % i for i in range(partitions)]
    counts = [0, 0]  # published, refused
    stop = threading.Event()
    client = broky.connect_sync(seeds, flush_timeout=flush_timeout, **_callbacks(errors, losses))
    try:
        sub = client.subscribe("w.>")

        def reading() -> None:  # until DRAIN_SECONDS without a delivery once stopped
            while True:
                try:
                    sub.next(timeout=DRAIN_SECONDS)
                except broky.BrokyTimeoutError:
                    if stop.is_set():
                        return
                    continue
                except broky.ClientClosedError:
                    return
                tally.add()

        def publishing() -> None:
            start = time.monotonic()
            while not stop.is_set():
                due = int((time.monotonic() - start) * rate)
                while sum(counts) < due:
                    try:
                        client.publish(KEY, PAYLOAD, partition=kps[sum(counts) % partitions])
                        counts[0] += 1
                    except broky.PublishBufferFullError:
                        counts[1] += 1
                time.sleep(0.005)

        def until_stop() -> None:
            sys.stdin.readline()
            stop.set()

        threads = [threading.Thread(target=f, daemon=True) for f in (reading, publishing, until_stop)]
        for t in threads:
            t.start()
        roles.ready()
        while not stop.is_set():
            began, t0 = time.time(), time.monotonic()
            try:
                client.flush(timeout=flush_timeout)
                outcome = "ok"
            except broky.BrokyError as exc:
                outcome = type(exc).__name__
            flushes.append((began, round(time.monotonic() - t0, 3), outcome))
            stop.wait(max(0.0, SAMPLE_SECONDS - (time.monotonic() - t0)))
        threads[1].join(10)
        threads[0].join(10 + DRAIN_SECONDS)
        stats = client.stats
    finally:
        client.close()
    return _report("blocking", tally, flushes, counts[0], counts[1], errors, losses, stats)


def _callbacks(errors: Counter[str], losses: Counter[str]) -> dict[str, Any]:
    """on_error and on_loss counting, by class and by reason (no lines on stderr)."""

    def told(ref: broky.WorkerRef, dropped: int, reason: int) -> None:
        losses[LossReason.name(reason)] += dropped or 1  # (UNACCOUNTED, a gap of unknown size: 1)

    return {"on_error": lambda e: errors.update([type(e).__name__]), "on_loss": told}


def _start(
    procs: list[roles.Role], api: str, seeds: str, rate: int, partitions: int, flush_timeout: float
) -> roles.Role:
    argv = ("--role", api, "--seeds", seeds, "--rate", str(rate), "--partitions", str(partitions),
            "--flush-timeout", str(flush_timeout))  # fmt: skip
    return roles.start(procs, "bench.kill_loop_flush", *argv, what=f"the {api} client")


# ---------------------------------------------------------------- the run


@dataclass
class ClientOutcome:
    """One client process: its API, CPU share per second, flushes and deliveries."""

    api: str
    hung: bool = False  # did not answer "stop" within the flush timeout and a margin: killed
    cpu_shares: list[float] = field(default_factory=list)  # of one core, per sample
    flushes: list[tuple[float, float, str]] = field(
        default_factory=list
    )  # began (s into the run), s, outcome
    published: int = 0
    refused: int = 0
    received: int = 0
    longest_gap_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    losses: dict[str, int] = field(default_factory=dict)  # told, by reason (notices without a count: 1)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_max(self) -> float:
        return max(self.cpu_shares, default=0.0)

    @property
    def cpu_mean(self) -> float:
        return sum(self.cpu_shares) / len(self.cpu_shares) if self.cpu_shares else 0.0

    def spinning_seconds(self) -> int:
        return sum(1 for s in self.cpu_shares if s > SPIN_SHARE)

    def longest_flush(self) -> float:
        return max((s for _, s, _ in self.flushes), default=0.0)

    def outcomes(self) -> dict[str, int]:
        return dict(Counter(o for _, _, o in self.flushes))


@dataclass
class Outcome:
    seconds: float = 0.0
    flush_timeout: float = 0.0
    kills: list[dict[str, Any]] = field(default_factory=list)  # node, at (s into the run), down_s
    clients: list[ClientOutcome] = field(default_factory=list)

    @property
    def published(self) -> int:
        """By every client: what each subscriber would receive if nothing was lost."""
        return sum(c.published for c in self.clients)

    def late_flushes(self, client: ClientOutcome) -> int:
        return sum(1 for _, s, _ in client.flushes if s > self.flush_timeout + FLUSH_SLACK)

    @property
    def promise_kept(self) -> bool:
        return all(
            not c.hung and c.spinning_seconds() == 0 and self.late_flushes(c) == 0 and c.flushes
            for c in self.clients
        )


def run(
    minutes: float = 2.0,
    nodes: int = 3,
    clients: int = 2,
    every: float = 10.0,
    down: tuple[float, float] = (3.0, 5.0),
    lease_ttl: int = 2,
    rate: int = 200,
    partitions: int = 100,
    flush_timeout: float = 20.0,
) -> Outcome:
    """The kill loop (see the module's header); every process is stopped by pid at the end."""
    cluster = ClusterRun(2, lease_ttl, keep_ports=True)
    procs: list[roles.Role] = []
    out = Outcome(flush_timeout=flush_timeout)
    sampler: procstat.CpuSampler | None = None
    try:
        names = [chr(ord("a") + n) for n in range(nodes)]
        for name in names:
            cluster.start(name)
        cluster.wait_settled(90.0)
        seeds = cluster.seeds()
        for i in range(clients):
            _start(procs, APIS[i % len(APIS)], seeds, rate, partitions, flush_timeout)
        sampler = procstat.CpuSampler([p.pid for p in procs], SAMPLE_SECONDS)
        sampler.start()
        start = time.time()
        end = start + minutes * 60
        time.sleep(1.0)
        for victim in itertools.cycle(names):  # a kill while the node can be back before the end
            t0 = time.time()
            if out.kills and t0 + down[1] > end:
                break
            killed_at = cluster.kill(victim)
            time.sleep(random.uniform(*down))
            cluster.start(victim)
            out.kills.append(
                {
                    "node": victim,
                    "at": round(killed_at - start, 3),
                    "down_s": round(time.time() - killed_at, 3),
                }
            )
            time.sleep(max(0.0, min(every - (time.time() - t0), end - time.time())))
        time.sleep(max(0.0, end - time.time()))
        cluster.wait_settled(90.0)
        time.sleep(2.0)
        out.seconds = round(time.time() - start, 1)
        reports: list[dict[str, Any] | None] = []
        for proc in procs:  # all at once
            proc.say("stop")
        deadline = time.monotonic() + flush_timeout + 30.0
        for proc in procs:
            try:
                reports.append(proc.finish(None, timeout=max(deadline - time.monotonic(), 1.0)))
            except (subprocess.TimeoutExpired, roles.RoleError):
                reports.append(None)
        sampler.stop()
        for i, said in enumerate(reports):
            c = ClientOutcome(APIS[i % len(APIS)], hung=said is None, cpu_shares=sampler.shares[i])
            if said is not None:
                c.flushes = [(round(b - start, 3), s, o) for b, s, o in said["flushes"]]
                for name in (
                    "published",
                    "refused",
                    "received",
                    "longest_gap_s",
                    "errors",
                    "losses",
                    "stats",
                ):
                    setattr(c, name, said[name])
            out.clients.append(c)
    finally:
        if sampler is not None:
            sampler.stop()
        roles.kill_all(procs)  # (and their pipes: a client killed while hung still holds them)
        cluster.stop()
    return out


def lines(out: Outcome) -> list[str]:
    """The outcome, one line per figure (printed, and the report's body)."""
    kills = ", ".join(f"{k['node']} at {k['at']:.0f} s (down {k['down_s']:.1f} s)" for k in out.kills)
    text = [f"{out.seconds:.0f} s, {len(out.kills)} kills: {kills}"]
    for i, c in enumerate(out.clients):
        text += [
            f"client {i} ({c.api}): " + ("HUNG (killed)" if c.hung else "answered stop"),
            f"  CPU per second: mean {c.cpu_mean:.1%}, max {c.cpu_max:.1%}, "
            f"seconds above {SPIN_SHARE:.0%}: {c.spinning_seconds()} of {len(c.cpu_shares)}",
            f"  flushes {len(c.flushes)}: {c.outcomes()}; longest {c.longest_flush():.2f} s; "
            f"past the timeout: {out.late_flushes(c)}",
            f"  published {c.published} (refused {c.refused}), received {c.received} of the "
            f"{out.published} every client published, longest time without a delivery "
            f"{c.longest_gap_s:.2f} s",
            f"  told lost {c.losses}; stats {c.stats}; errors reported {c.errors}",
        ]
    text.append("promise kept (no spin, no hang, every flush ended in time): " + str(out.promise_kept))
    return text


def report(out: Outcome, args: argparse.Namespace, info: dict[str, Any]) -> str:
    rows = [
        (i, c.api, "yes" if c.hung else "no", f"{c.cpu_mean:.1%}", f"{c.cpu_max:.1%}", c.spinning_seconds(),
         len(c.flushes), ", ".join(f"{k} {v}" for k, v in sorted(c.outcomes().items())),
         f"{c.longest_flush():.2f}", f"{c.received:,}", f"{c.longest_gap_s:.2f}")
        for i, c in enumerate(out.clients)
    ]  # fmt: skip
    head = ("client", "API", "hung", "CPU mean", "CPU max (1 s)", f"seconds > {SPIN_SHARE:.0%}", "flushes",
            "ended", "longest flush (s)", f"received (of {out.published:,})",
            "longest without a delivery (s)")  # fmt: skip
    slow = [
        f"- client {i} ({c.api}): "
        + ", ".join(f"at {b:.0f} s: {s:.2f} s, {o}" for b, s, o in c.flushes if s > 1.0 or o != "ok")
        for i, c in enumerate(out.clients)
    ]
    command = (
        f"python -m bench.kill_loop_flush --minutes {args.minutes:g} --nodes {args.nodes} "
        f"--clients {args.clients} --every {args.every:g} --down {args.down[0]:g} {args.down[1]:g} "
        f"--lease-ttl {args.lease_ttl} --rate {args.rate} --flush-timeout {args.flush_timeout:g}"
    )
    return "\n".join([
        *heading("Node kill loop with flushing clients: CPU per client process", info, command, False),
        f"{args.nodes} nodes x 2 workers and etcd; every {args.every:g} s a node, in turn, SIGKILLed "
        f"and started again under its id {args.down[0]:g}-{args.down[1]:g} s later (leases of "
        f"{args.lease_ttl} s: it leaves the map meanwhile). {args.clients} SDK client processes "
        f"(asyncio and blocking in turn), each on every node as a seed, subscribed to `w.>`, "
        f"publishing {args.rate} msgs/s over {args.partitions} key_partitions and calling "
        f"`flush(timeout={args.flush_timeout:g})` once a second. CPU: utime + stime of each client "
        f"process, sampled once a second, as a share of one core; a spin is a whole core (before "
        "issue 37, a flush pending on a node that died spun in `Link.round_trip` and never returned).",
        "",
        *table(head, rows, "rllrrrrlrrr"),
        "",
        "Flushes that took over a second or raised (s into the run, duration, outcome):",
        "",
        *slow,
        "",
        *(f"- {line}" for line in lines(out)),
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.kill_loop_flush", __doc__, out=options.RESULTS, role=APIS)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between kills")
    parser.add_argument("--down", type=float, nargs=2, default=(3.0, 5.0), help="seconds a node stays down")
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument("--rate", type=int, default=200, help="msgs/s published by each client")
    parser.add_argument("--partitions", type=int, default=100)
    parser.add_argument("--flush-timeout", type=float, default=20.0)
    options.role_options(parser, "seeds")
    args = parser.parse_args(argv)
    if args.role == "asyncio":
        return roles.done(
            asyncio.run(asyncio_client(args.seeds, args.rate, args.partitions, args.flush_timeout))
        )
    if args.role == "blocking":
        return roles.done(blocking_client(args.seeds, args.rate, args.partitions, args.flush_timeout))
    info = machine_info()
    out = run(
        args.minutes, args.nodes, args.clients, args.every, tuple(args.down), args.lease_ttl,
        args.rate, args.partitions, args.flush_timeout,
    )  # fmt: skip
    print(*lines(out), sep="\n", flush=True)
    data = asdict(out)
    write_results(args.out, "kill_loop_flush", report(out, args, info), info, args, **data)
    return 0 if out.promise_kept else 1


if __name__ == "__main__":
    sys.exit(main())
