"""Worker-kill benchmark: what a SIGKILLed worker costs SDK publishers and subscribers.

    python -m bench.worker_kill [--kills 10] [--interval 2] [--rate 5000] [--partitions 256]

One `broky serve --workers 2`, one SDK subscriber process on `w.>` and one
SDK publisher process publishing `--rate` msgs/s round-robin over
`--partitions` key_partitions, each payload carrying its partition and a
per-partition sequence number. Every `--interval` seconds one worker
(alternately 0 and 1) is killed with SIGKILL; the supervisor restarts it.
At the end the subscriber's sequences are checked against what was
published:

- lost: published, never received (per partition, by sequence number), and
  per worker (the owner of the partition: one node, so it never changes);
- told: the deliveries the subscriber was told it lost (LossNotice counts),
  per worker (the connection the notice came on);
- duplicates, messages out of order within a partition, strays (a
  sequence number that was never published) and corrupt deliveries (a key,
  key_partition or padding other than the publisher's);
- received: what the subscriber's callback got, which must also be what the
  SDK counted (its deliveries less the copies its duplicate filter dropped),
  and the copies that filter dropped (none: every resend was accounted for);
- the publisher's report: `stats.unconfirmed_lost` (publishes it says may
  not have reached the server), `stats.resent_after_loss` (sent again after
  the server's account said they were not processed) and whether `flush`
  raised;
- recovery: per kill, the time from the kill until the subscriber received
  the first message published after the kill to a partition of the killed
  worker.

With `--stall-subscriber S` the subscriber process is stopped (SIGSTOP) for S
seconds before each kill, so that the worker holds a backlog for it (and,
past --max-pending-bytes, drops some) when it dies: then the subscriber must
be told exactly what it lost (LossNotice WORKER_RESTART, and the
slow-consumer drops the dead worker had not told yet).

The promise checked: lost == told for every worker (nothing lost silently;
a total would let over-telling on one worker hide a silent loss on another),
no duplicate, no reordering, and the publisher's report bounds what its
publishes lost.
Results go to bench/results/worker_kill.md and .json with the machine
(worker_kill_stalled.* with --stall-subscriber).
`run` is also what tests/server/e2e/test_worker_kill.py calls, with one kill.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench.harness import options, roles, servers  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402

KEY = b"w.k"
_head = struct.Struct("<II")  # partition index, sequence number


def partition(i: int) -> bytes:
    return b"tenant-%d" % i


# ---------------------------------------------------------------- the two client processes

_tls_ca: str | None = None  # in a client process of a TLS run: trust this CA (--tls-ca)


def _ssl_context() -> Any:
    if _tls_ca is None:
        return None
    import ssl

    return ssl.create_default_context(cafile=_tls_ca)


async def publisher(url: str, rate: int, duration: float, partitions: int, size: int) -> dict[str, Any]:
    """Publish at `rate` for `duration` seconds (0: until a line, or EOF, on stdin), then flush."""
    errors: list[str] = []
    disconnects: list[str] = []
    refused: list[tuple[int, int]] = []  # (partition, sequence number) of publishes refused
    async with broky.connect(
        url,
        ssl_context=_ssl_context(),
        on_error=lambda e: errors.append(str(e)),
        on_disconnect=lambda ref, why: disconnects.append(f"{ref.worker}: {type(why).__name__}"),
    ) as client:
        kps = [partition(i) for i in range(partitions)]
        pad = b"x" * (size - _head.size)
        seq = [0] * partitions
        loop = asyncio.get_running_loop()
        stop = roles.next_line() if duration <= 0 else None
        roles.ready("publishing")
        start = loop.time()
        sent = 0
        while (elapsed := loop.time() - start) < duration or (stop is not None and not stop.done()):
            due = int(elapsed * rate)
            while sent < due:
                i = sent % partitions
                try:
                    await client.publish(KEY, _head.pack(i, seq[i]) + pad, partition=kps[i])
                except broky.PublishBufferFullError:
                    refused.append((i, seq[i]))  # not published: the caller knows (the number is skipped)
                seq[i] += 1
                sent += 1
            await asyncio.sleep(0.001)
        flush_error = None
        try:
            await client.flush(timeout=30)
        except broky.BrokyError as exc:
            flush_error = str(exc)
        stats = asdict(client.stats)
    return {
        "sent": sent,
        "per_partition": seq,
        "refused": len(refused),
        "refused_seqs": refused,
        "stats": stats,
        "flush_error": flush_error,
        "errors": errors[-20:],
        "disconnects": disconnects,
    }


async def subscriber(url: str) -> dict[str, Any]:
    received: list[tuple[int, int, float, int]] = []  # partition, seq, receive time, ts_producer
    # [node, worker], dropped, reason, time (the worker's node: in a cluster, several have a worker 0)
    losses: list[tuple[tuple[str, int], int, int, float]] = []
    disconnects: list[str] = []
    corrupt = 0  # a key, key_partition or padding other than the publisher's

    def on_message(msg: broky.Message) -> None:
        nonlocal corrupt
        i, s = _head.unpack_from(msg.payload)
        received.append((i, s, time.time(), msg.ts_producer or 0))
        if msg.key != KEY or msg.key_partition != partition(i) or msg.payload[_head.size :].strip(b"x"):
            corrupt += 1

    async with broky.connect(
        url,
        ssl_context=_ssl_context(),
        on_loss=lambda ref, n, reason: losses.append(((ref.node_id, ref.worker), n, reason, time.time())),
        on_disconnect=lambda ref, why: disconnects.append(f"{ref.worker}: {type(why).__name__}: {why}"),
    ) as client:
        await client.subscribe("w.>", callback=on_message)
        roles.ready()
        await roles.next_line()  # "stop", or EOF
        await asyncio.sleep(0.5)  # the last deliveries
        stats = asdict(client.stats)
    return {
        "received": received,
        "losses": losses,
        "disconnects": disconnects,
        "stats": stats,
        "corrupt": corrupt,
    }


# ---------------------------------------------------------------- the run


@dataclass
class Result:
    kills: list[dict[str, Any]] = field(default_factory=list)  # worker, time, recovery_s
    published: int = 0
    refused: int = 0
    received: int = 0
    lost: int = 0
    told: int = 0
    told_by_reason: dict[str, int] = field(default_factory=dict)
    lost_by_worker: list[int] = field(default_factory=list)
    told_by_worker: list[int] = field(default_factory=list)
    duplicates: int = 0
    out_of_order: int = 0
    stray: int = 0
    corrupt: int = 0  # deliveries whose key, key_partition or padding was not what was published
    subscriber_sdk_delivered: int = 0  # the SDK's count of what it handed to the callback
    subscriber_duplicates_dropped: int = 0
    subscriber_unaccounted: int = 0
    publisher_unconfirmed_lost: int = 0
    publisher_resent_after_loss: int = 0
    publisher_flush_error: str | None = None
    subscriber_disconnects: list[str] = field(default_factory=list)
    publisher_disconnects: list[str] = field(default_factory=list)
    server_log_tail: str = ""

    @property
    def recovery(self) -> list[float]:
        return [k["recovery_s"] for k in self.kills if k["recovery_s"] is not None]


def start_subscriber(procs: list[roles.Role], url: str, client_args: Sequence[str] = ()) -> roles.Role:
    """The SDK subscriber on `w.>`, a role process of the run's `procs`, ready."""
    argv = ("--role", "subscriber", "--server", url, *client_args)
    return roles.start(procs, "bench.worker_kill", *argv, what="the subscriber")


def start_publisher(
    procs: list[roles.Role],
    url: str,
    rate: int,
    partitions: int,
    duration: float = 0.0,
    payload_bytes: int = 100,
    client_args: Sequence[str] = (),
) -> roles.Role:
    """The SDK publisher, a role process of the run's `procs`, publishing: `rate` msgs/s over
    `partitions` key_partitions for `duration` s (0: until `Role.finish`), then it flushes."""
    argv = ("--role", "publisher", "--server", url, "--rate", str(rate), "--duration", str(duration),
            "--partitions", str(partitions), "--payload-bytes", str(payload_bytes), *client_args)  # fmt: skip
    return roles.start(procs, "bench.worker_kill", *argv, ready="publishing", what="the publisher")


class Load:
    """The SDK subscriber on `w.>` and the SDK publisher, role processes until `finish`: the
    load of the chaos, failover and drain benchmarks (seeds: one node's address or several)."""

    def __init__(self, sub_seeds: str, pub_seeds: str, rate: int, partitions: int, payload_bytes: int = 100):
        self.partitions = partitions
        self.procs: list[roles.Role] = []
        try:
            self.sub = start_subscriber(self.procs, sub_seeds)
            self.pub = start_publisher(self.procs, pub_seeds, rate, partitions, 0.0, payload_bytes)
        except BaseException:
            self.kill()
            raise

    def finish(self, timeout: float = 90.0) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stop publishing, flush, then stop the subscriber: what each reported."""
        try:
            return self.pub.finish(timeout=timeout), self.sub.finish(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        roles.kill_all(self.procs)


def run(
    kills: int,
    interval: float,
    rate: int,
    partitions: int,
    workers: int = 2,
    payload_bytes: int = 100,
    stall_subscriber: float = 0.0,
    tls: bool = False,
) -> Result:
    """One server, one subscriber, one publisher, `kills` SIGKILLs; see the module header.
    With `tls`, the server has a certificate and both clients connect over TLS."""
    ca, cert, key = servers.tls_files() if tls else ("", "", "")
    server = servers.start_broky(workers, ["--tls-cert", cert, "--tls-key", key] if tls else [])
    url = f"{'broky+tls://' if tls else ''}{server.host}:{server.port}"
    client_args = ["--tls-ca", ca] if tls else []
    procs: list[roles.Role] = []
    result = Result()
    try:
        sub = start_subscriber(procs, url, client_args)
        warmup, cooldown = 1.0, 2.0
        duration = warmup + kills * interval + cooldown
        pub = start_publisher(procs, url, rate, partitions, duration, payload_bytes, client_args)
        time.sleep(warmup)
        for k in range(kills):
            worker = k % workers
            if stall_subscriber:
                os.kill(sub.pid, signal.SIGSTOP)
                time.sleep(stall_subscriber)
            pids = server.worker_pids()
            killed_at = time.time()
            os.kill(pids[worker], signal.SIGKILL)
            result.kills.append({"worker": worker, "time": killed_at, "recovery_s": None})
            if stall_subscriber:
                time.sleep(0.2)
                os.kill(sub.pid, signal.SIGCONT)
            server.wait_worker_restarted(pids)
            time.sleep(max(0.0, interval - (time.time() - killed_at)))
        published = pub.finish(None, timeout=duration + 60)
        subscribed = sub.finish()
    finally:
        roles.kill_all(procs)
        result.server_log_tail = server.log()[-2000:]
        server.stop()
    _analyse(result, published, subscribed, partitions, workers)
    return result


def _owner_worker(kp: bytes, workers: int) -> int:
    from broky.protocol import vbucket_of

    return vbucket_of(kp) * workers // 1024


@dataclass
class Sequences:
    """What the subscriber's sequence numbers say, key_partition by key_partition."""

    received: list[list[int]]  # per partition: the sequence numbers, in the order they arrived
    lost: list[int]  # per partition: published (not refused), never received
    duplicates: int = 0
    out_of_order: int = 0  # below a sequence number received before it (copies not counted)
    stray: int = 0  # never published: past the publisher's count, refused, or an unknown partition


def sequences(published: dict[str, Any], received: list[Any], partitions: int) -> Sequences:
    """Check every delivery (partition, sequence number, ...) against what was published."""
    counts: list[int] = published["per_partition"]
    refused: list[set[int]] = [set() for _ in range(partitions)]
    for i, s in published.get("refused_seqs", []):
        refused[i].add(s)
    out = Sequences([[] for _ in range(partitions)], [0] * partitions)
    seen: list[set[int]] = [set() for _ in range(partitions)]
    last = [-1] * partitions
    for i, s, *_ in received:
        if not 0 <= i < partitions or not 0 <= s < counts[i] or s in refused[i]:
            out.stray += 1
            continue
        if s in seen[i]:
            out.duplicates += 1
        elif s < last[i]:
            out.out_of_order += 1
        seen[i].add(s)
        out.received[i].append(s)
        last[i] = max(last[i], s)
    out.lost = [counts[i] - len(refused[i]) - len(seen[i]) for i in range(partitions)]
    return out


def sdk_delivered(stats: dict[str, Any]) -> int:
    """What a one-subscription client's SDK handed to the application, by its own counters."""
    return int(stats["received"] - stats["duplicates_dropped"] - stats["unmatched"] - stats["dropped_local"])


def _analyse(
    result: Result, published: dict[str, Any], subscribed: dict[str, Any], partitions: int, workers: int
) -> None:
    result.published = published["sent"] - published["refused"]
    result.refused = published["refused"]
    stats = published["stats"]
    result.publisher_unconfirmed_lost = stats["unconfirmed_lost"]
    result.publisher_resent_after_loss = stats["resent_after_loss"]
    result.publisher_flush_error = published["flush_error"]
    result.publisher_disconnects = published["disconnects"]
    result.subscriber_disconnects = subscribed["disconnects"]
    sub_stats = subscribed["stats"]
    result.subscriber_sdk_delivered = sdk_delivered(sub_stats)
    result.subscriber_duplicates_dropped = sub_stats["duplicates_dropped"]
    result.subscriber_unaccounted = sub_stats["unaccounted"]
    received = subscribed["received"]
    result.received = len(received)
    seqs = sequences(published, received, partitions)
    result.duplicates, result.out_of_order, result.stray = seqs.duplicates, seqs.out_of_order, seqs.stray
    result.corrupt = subscribed["corrupt"]
    result.lost = sum(seqs.lost)
    owner = [_owner_worker(partition(i), workers) for i in range(partitions)]
    result.lost_by_worker = [0] * workers
    for i, n in enumerate(seqs.lost):
        result.lost_by_worker[owner[i]] += n
    from broky.protocol import LossReason

    result.told_by_worker = [0] * workers
    for (_, worker), n, reason, _ in subscribed["losses"]:
        result.told += n
        result.told_by_worker[worker] += n
        name = LossReason.name(reason)
        result.told_by_reason[name] = result.told_by_reason.get(name, 0) + n
    for kill in result.kills:
        after = [
            t_recv - kill["time"]
            for i, _, t_recv, ts in received
            if owner[i] == kill["worker"] and ts / 1e9 > kill["time"]
        ]
        kill["recovery_s"] = round(min(after), 3) if after else None


# ---------------------------------------------------------------- report


def report(result: Result, args: argparse.Namespace, info: dict[str, Any]) -> str:
    rec = result.recovery
    flush = f"raised: {result.publisher_flush_error}" if result.publisher_flush_error else "succeeded"
    command = (
        f"python -m bench.worker_kill --kills {args.kills} --interval {args.interval:g} "
        f"--rate {args.rate} --partitions {args.partitions} --payload-bytes {args.payload_bytes}"
        + (f" --stall-subscriber {args.stall_subscriber:g}" if args.stall_subscriber else "")
    )
    figures = [
        ("messages published", result.published),
        ("received by the subscriber", result.received),
        ("lost (published, never received)", result.lost),
        ("told lost (LossNotice counts)", f"{result.told} {result.told_by_reason or ''}"),
        ("lost, per worker", " / ".join(map(str, result.lost_by_worker))),
        ("told lost, per worker", " / ".join(map(str, result.told_by_worker))),
        ("subscriber: copies its duplicate filter dropped", result.subscriber_duplicates_dropped),
        ("duplicates delivered", result.duplicates),
        ("out of order within a partition", result.out_of_order),
        ("never published, or corrupt", f"{result.stray} / {result.corrupt}"),
        (
            "publisher: `unconfirmed_lost` (may not have reached the server)",
            result.publisher_unconfirmed_lost,
        ),
        ("publisher: `resent_after_loss` (not processed, sent again)", result.publisher_resent_after_loss),
        ("publisher: final flush", flush),
        ("publishes refused (reconnect buffer full)", result.refused),
    ]
    if rec:
        figures.append((
            "recovery after a kill: min / median / max",
            f"{min(rec):.3f} / {statistics.median(rec):.3f} / {max(rec):.3f} s",
        ))  # fmt: skip
    kills = [(n + 1, k["worker"], k["recovery_s"]) for n, k in enumerate(result.kills)]
    return "\n".join([
        *heading("Worker kill: nothing lost silently", info, command),
        f"One `broky serve --workers 2`; an SDK publisher at {args.rate} msgs/s over {args.partitions} "
        f"key_partitions; an SDK subscriber on `w.>`; {len(result.kills)} SIGKILLs of a worker, "
        f"one every {args.interval:g} s, alternately worker 0 and 1.",
        "",
        *table(("Figure", "Value"), figures),
        "",
        "Recovery: from the SIGKILL until the subscriber received the first message published after it "
        "to a key_partition of the killed worker (restart, reconnects, the restart grace).",
        "",
        *table(("Kill", "Worker", "Recovery (s)"), kills, "rrr"),
        "",
        f"Verdict: {'met' if promise_kept(result) else 'NOT met'} (lost == told for every worker, no "
        "duplicate, in order, nothing corrupt, the publisher's report bounds its losses).",
        "",
    ])  # fmt: skip


def promise_kept(result: Result) -> bool:
    return (
        result.lost_by_worker == result.told_by_worker
        and result.received == result.subscriber_sdk_delivered == result.published - result.told
        and result.duplicates == 0
        and result.out_of_order == 0
        and result.stray == 0
        and result.corrupt == 0
        and result.publisher_flush_error is None
    )


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "bench.worker_kill", __doc__, out=options.RESULTS, role=("publisher", "subscriber")
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--rate", type=int, default=5000, help="msgs/s published")
    parser.add_argument("--partitions", type=int, default=256)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument(
        "--stall-subscriber",
        type=float,
        default=0.0,
        help="seconds the subscriber is stopped before each kill",
    )
    options.role_options(parser, "server", "tls_ca", duration=float)
    args = parser.parse_args(argv)
    global _tls_ca
    _tls_ca = args.tls_ca
    if args.role == "publisher":
        return roles.done(
            asyncio.run(publisher(args.server, args.rate, args.duration, args.partitions, args.payload_bytes))
        )
    if args.role == "subscriber":
        return roles.done(asyncio.run(subscriber(args.server)))
    info = machine_info()
    result = run(
        args.kills, args.interval, args.rate, args.partitions, 2, args.payload_bytes, args.stall_subscriber
    )
    name = "worker_kill_stalled" if args.stall_subscriber else "worker_kill"
    write_results(args.out, name, report(result, args, info), info, args, **asdict(result))
    return 0 if promise_kept(result) else 1


if __name__ == "__main__":
    sys.exit(main())
