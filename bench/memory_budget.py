"""Memory budget benchmark: stalled subscribers under a burst, a healthy pair alongside.

    python -m bench.memory_budget [--stalled 100] [--megabytes 200] [--size 1024]
                                  [--partitions 256] [--workers 2] [--memory-budget SIZE]

One `broky serve --workers 2` with default settings (`--memory-budget`
passed on when given). `--stalled` subscribers each open one raw connection
to every worker, subscribe to `>` and never read (a 4 KiB receive buffer):
issue 26's finding, where 100 of them under a 200 MB burst of 1 KiB messages
took the server from 81 MB to 2.5 GB, and kept it there after they closed.
Alongside, a healthy pair: an SDK publisher process publishes `--megabytes`
MB of `--size`-byte payloads round-robin over `--partitions` key_partitions
(each payload carries its partition and a sequence number) and flushes; an
SDK subscriber process on `>` reads them as they come (`next_msg`).

Reported:
- the server's RSS (master and workers together): before the burst, at its
  peak (sampled every 50 ms), once the burst is over (the stalled still
  connected), and after the stalled connections are drained and closed
  (`--settle` seconds later: the heap trim runs at most every 5 s);
- the connections the workers cut for their budget, and the pending bytes
  that freed;
- the stalled subscribers, read at last: those the server closed reconnect
  naming their connection and add up what they are told (a cut one, closed
  without an Error, must be told SLOW_CONSUMER; one closed past
  --slow-consumer-deadline got a fatal SLOW_CONSUMER Error); for those still
  open, what they received plus what they were told equals what was
  published to their worker;
- the healthy pair: published, received, lost, told, duplicates, out of
  order. The promise: it loses nothing.

Results: bench/results/memory_budget.md and .json, with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import selectors
import socket
import ssl
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench.harness import options, procstat, roles, servers, tlsclient  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402
from broky.protocol import (  # noqa: E402
    NEED_DATA,
    Error,
    FrameReader,
    Hello,
    LossNotice,
    LossReason,
    Ping,
    Pong,
    PreviousConnection,
    Subscribe,
    Welcome,
    decode_frame,
    encode_frame,
    vbucket_of,
)
from broky.protocol.message import BODY_MESSAGE, body_type  # noqa: E402

MODULE = "bench.memory_budget"
KEY = b"b.k"
SETTLE = 12.0  # seconds after the stalled connections closed until RSS is read
QUIET = 2.0  # seconds without a byte after which a stalled connection counts as drained
_head = struct.Struct("<II")  # partition index, sequence number


def partition(i: int) -> bytes:
    return b"tenant-%d" % i


# ---------------------------------------------------------------- the healthy pair (SDK processes)


async def publisher(url: str, megabytes: int, size: int, partitions: int) -> dict[str, Any]:
    async with broky.connect(url) as client:
        kps = [partition(i) for i in range(partitions)]
        pad = b"x" * (size - _head.size)
        seq = [0] * partitions
        total = megabytes * 1_000_000 // size
        roles.ready("publishing")
        start = time.monotonic()
        for n in range(total):
            i = n % partitions
            await client.publish(KEY, _head.pack(i, seq[i]) + pad, partition=kps[i])
            seq[i] += 1
        flush_error = None
        try:
            await client.flush(timeout=120)
        except broky.BrokyError as exc:
            flush_error = str(exc)
        seconds = time.monotonic() - start
        stats = asdict(client.stats)
    return {
        "sent": total,
        "per_partition": seq,
        "seconds": seconds,
        "flush_error": flush_error,
        "stats": stats,
    }


async def subscriber(url: str) -> dict[str, Any]:
    received: list[tuple[int, int]] = []
    losses: list[tuple[int, int]] = []  # dropped, reason
    async with broky.connect(url, on_loss=lambda ref, n, reason: losses.append((n, reason))) as client:
        sub = await client.subscribe(">")
        roles.ready()
        stop = roles.next_line()  # "stop", or EOF
        while not stop.done():
            try:
                msg = await sub.next_msg(timeout=0.2)
            except broky.BrokyTimeoutError:
                continue
            received.append(_head.unpack_from(msg.payload))
        stats = asdict(client.stats)
    return {"received": received, "losses": losses, "stats": stats}


# ---------------------------------------------------------------- the stalled subscribers (raw sockets)


class Stalled:
    """One raw connection to one worker, subscribed to `>`, that reads nothing until `drain`."""

    def __init__(
        self,
        address: tuple[str, int],
        worker: int,
        previous: PreviousConnection | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.worker = worker
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(10)
        self.sock.connect(address)
        if tls is not None:  # bench.soak --tls
            self.sock = tlsclient.upgrade(self.sock, tls, worker, previous)
        self.reader = FrameReader(max_frame_bytes=1 << 30)
        self.sock.sendall(encode_frame(Hello(worker=worker, client_name="stalled", previous=previous)))
        welcome = self._next()
        assert isinstance(welcome, Welcome), welcome
        self.welcome = welcome
        self.received = 0
        self.told = 0
        self.error: Error | None = None
        self.closed = False

    def _next(self) -> Any:
        return decode_frame(tlsclient.next_frame(self.sock, self.reader))

    def subscribe(self) -> None:
        self.sock.sendall(encode_frame(Subscribe(1, b">")) + encode_frame(Ping(1)))
        while not isinstance(self._next(), Pong):
            pass

    def frames_after_welcome(self) -> list[Any]:
        """What follows the Welcome up to the Pong of a Ping (a resumed connection's notices)."""
        self.sock.sendall(encode_frame(Ping(7)))
        frames = []
        while not isinstance(frame := self._next(), Pong):
            frames.append(frame)
        return frames

    def take(self, data: bytes) -> None:
        """Count the whole frames of `data` (deliveries by their body type, without decoding)."""
        reader = self.reader
        reader.feed(data)
        while (raw := reader.next_frame()) is not NEED_DATA:
            assert isinstance(raw, bytes)
            if body_type(raw, 0, len(raw)) == BODY_MESSAGE:
                self.received += 1
                continue
            frame = decode_frame(raw)
            if isinstance(frame, LossNotice):
                self.told += frame.dropped
            elif isinstance(frame, Error):
                self.error = frame


def drain_all(stalled: list[Stalled]) -> None:
    """Read every stalled connection at once until it ends or stays silent for QUIET seconds."""
    sel = selectors.DefaultSelector()
    for s in stalled:
        s.sock.setblocking(False)
        sel.register(s.sock, selectors.EVENT_READ, s)
    quiet_since = time.monotonic()
    while sel.get_map():
        events = sel.select(0.1)
        if not events:
            if time.monotonic() - quiet_since > QUIET:
                break
            continue
        quiet_since = time.monotonic()
        for key, _ in events:
            s = key.data
            try:
                data = tlsclient.recv_ready(s.sock, 1 << 20)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if data:
                s.take(data)
            else:
                s.closed = True
                sel.unregister(s.sock)
    sel.close()


# ---------------------------------------------------------------- the run


@dataclass
class Result:
    rss_before: int = 0
    rss_peak: int = 0
    rss_after_burst: int = 0
    rss_after: int = 0
    memory_budget: int = 0
    cuts: int = 0
    cut_bytes: int = 0
    pending_bytes_after_burst: int = 0
    replay_bytes_after_burst: int = 0  # the replay buffers' fill, part of the RSS
    lag_entered: int = 0  # connections that began lagging (past their bound, with a replay buffer)
    lag_served: int = 0  # messages sent to them from the replay buffer
    lag_evicted: int = 0  # messages they were owed that the buffer evicted first (told)
    memory_trims: int = 0
    stalled_connections: int = 0
    stalled_cut: int = 0  # closed by the server without an Error: cut for the budget
    stalled_closed_deadline: int = 0  # closed with a fatal SLOW_CONSUMER Error
    stalled_deadline_published: int = 0  # published to their workers (routed to them, unless closed earlier)
    stalled_deadline_received_told: int = 0
    stalled_closed_received: int = 0
    stalled_closed_told: int = 0  # before and after reconnecting
    stalled_cut_reasons: dict[str, int] = field(default_factory=dict)  # told on reconnecting, cut ones
    stalled_open: int = 0
    stalled_open_published: int = 0
    stalled_open_received: int = 0
    stalled_open_told: int = 0
    published: int = 0
    publish_seconds: float = 0.0
    publisher_flush_error: str | None = None
    received: int = 0
    lost: int = 0
    told: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    server_log_tail: str = ""


def run(
    stalled_count: int, megabytes: int, size: int, partitions: int, workers: int, extra: list[str]
) -> Result:
    server = servers.start_broky(workers, extra)
    url = f"{server.host}:{server.port}"
    procs: list[roles.Role] = []
    result = Result()
    stalled: list[Stalled] = []
    sampler = procstat.RssSampler(server.pids)
    try:
        for _ in range(stalled_count):
            for w in range(workers):
                s = Stalled(server.address, w)
                s.subscribe()
                stalled.append(s)
        sub = roles.start(procs, MODULE, "--role", "subscriber", "--server", url, what="the subscriber")
        time.sleep(1.0)
        result.rss_before = server.rss_bytes()
        sampler.start()
        argv = ("--role", "publisher", "--server", url, "--megabytes", str(megabytes), "--size", str(size),
                "--partitions", str(partitions))  # fmt: skip
        pub = roles.start(procs, MODULE, *argv, ready="publishing", what="the publisher")
        published = pub.finish(None, timeout=600)
        time.sleep(QUIET)  # the healthy subscriber's last deliveries
        subscribed = sub.finish(timeout=120)
        sampler.stop()
        result.rss_peak = max(sampler.peak, server.rss_bytes())
        result.rss_after_burst = server.rss_bytes()
        snap = server.stats()["workers"]
        result.memory_budget = sum(w["memory_budget"] for w in snap)
        result.cuts = sum(w["budget_cuts"] for w in snap)
        result.cut_bytes = sum(w["budget_cut_bytes"] for w in snap)
        result.pending_bytes_after_burst = sum(w["pending_bytes"] for w in snap)
        result.replay_bytes_after_burst = sum(w["replay_bytes"] for w in snap)

        drain_all(stalled)
        _stalled_results(result, server.address, stalled, published, workers)
        for s in stalled:
            s.sock.close()
        time.sleep(SETTLE)
        result.rss_after = server.rss_bytes()
        result.memory_trims = server.workers_sum("memory_trims")["memory_trims"]
        lag = server.workers_sum("lag_entered", "lag_served", "lag_evicted")
        result.lag_entered, result.lag_served, result.lag_evicted = (
            lag["lag_entered"],
            lag["lag_served"],
            lag["lag_evicted"],
        )
    finally:
        sampler.stop()
        for s in stalled:
            s.sock.close()
        roles.kill_all(procs)
        result.server_log_tail = server.log()[-2000:]
        server.stop()
    _healthy(result, published, subscribed, partitions)
    return result


def _stalled_results(
    result: Result, address: tuple[str, int], stalled: list[Stalled], published: dict[str, Any], workers: int
) -> None:
    """Closed connections reconnect and add up what they are told; open ones must add up."""
    per_worker = [0] * workers
    for i, count in enumerate(published["per_partition"]):
        per_worker[vbucket_of(partition(i)) * workers // 1024] += count
    result.stalled_connections = len(stalled)
    for s in stalled:
        if not s.closed:
            result.stalled_open += 1
            result.stalled_open_published += per_worker[s.worker]
            result.stalled_open_received += s.received
            result.stalled_open_told += s.told
            continue
        cut = s.error is None  # closed without a word: cut by its worker for the budget
        if cut:
            result.stalled_cut += 1
        else:
            result.stalled_closed_deadline += 1
        told = s.told
        prev = PreviousConnection(s.welcome.connection_id, s.received, s.told, s.welcome.resume_token)
        back = Stalled(address, s.worker, previous=prev)
        for frame in back.frames_after_welcome():
            if isinstance(frame, LossNotice):
                told += frame.dropped
                if cut:
                    name = LossReason.name(frame.reason)
                    result.stalled_cut_reasons[name] = result.stalled_cut_reasons.get(name, 0) + frame.dropped
        back.sock.close()
        result.stalled_closed_received += s.received
        result.stalled_closed_told += told
        if not cut:
            result.stalled_deadline_published += per_worker[s.worker]
            result.stalled_deadline_received_told += s.received + told


def _healthy(result: Result, published: dict[str, Any], subscribed: dict[str, Any], partitions: int) -> None:
    result.published = published["sent"]
    result.publish_seconds = round(published["seconds"], 2)
    result.publisher_flush_error = published["flush_error"]
    received = subscribed["received"]
    result.received = len(received)
    seen: list[set[int]] = [set() for _ in range(partitions)]
    last = [-1] * partitions
    for i, s in received:
        if s in seen[i]:
            result.duplicates += 1
        seen[i].add(s)
        if s < last[i]:
            result.out_of_order += 1
        last[i] = max(last[i], s)
    result.lost = sum(
        1 for i, count in enumerate(published["per_partition"]) for s in range(count) if s not in seen[i]
    )
    result.told = sum(n for n, _ in subscribed["losses"])


# ---------------------------------------------------------------- report


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def report(result: Result, args: argparse.Namespace, info: dict[str, Any]) -> str:
    budget = args.memory_budget or "the default"
    command = (
        f"python -m bench.memory_budget --stalled {args.stalled} --megabytes {args.megabytes} "
        f"--size {args.size} --partitions {args.partitions}"
        + (f" --memory-budget {args.memory_budget}" if args.memory_budget else "")
        + (f" --max-pending-bytes {args.max_pending_bytes}" if args.max_pending_bytes else "")
        + (f" --name {args.name}" if args.name != "memory_budget" else "")
    )
    rss = [
        ("before the burst", _mb(result.rss_before)),
        ("peak (sampled every 50 ms)", _mb(result.rss_peak)),
        ("after the burst (stalled still connected)", _mb(result.rss_after_burst)),
        (f"after the stalled closed (+{SETTLE:g} s)", _mb(result.rss_after)),
    ]
    figures = [
        ("connections cut for the budget", result.cuts),
        ("pending bytes freed by the cuts", _mb(result.cut_bytes)),
        (f"pending bytes after the burst (budget {_mb(result.memory_budget)})",
         _mb(result.pending_bytes_after_burst)),
        ("replay buffers' fill after the burst (part of the RSS)", _mb(result.replay_bytes_after_burst)),
        ("connections that lagged / messages served from history / evicted before read (told)",
         f"{result.lag_entered} / {result.lag_served} / {result.lag_evicted}"),
        ("heap trims", result.memory_trims),
        ("stalled connections cut / closed past the slow-consumer deadline / open",
         f"{result.stalled_cut} / {result.stalled_closed_deadline} / {result.stalled_open}"),
        ("... the closed ones: received, told (their notices, then on reconnecting)",
         f"{result.stalled_closed_received}, {result.stalled_closed_told}"),
        ("... the cut ones, told on reconnecting, by reason", result.stalled_cut_reasons or "-"),
        ("... the ones closed past the deadline: published to their workers / received + told",
         f"{result.stalled_deadline_published} / {result.stalled_deadline_received_told}"),
        ("... the open ones: published to their workers / received + told",
         f"{result.stalled_open_published} / {result.stalled_open_received + result.stalled_open_told}"),
        ("healthy pair: published", f"{result.published} (in {result.publish_seconds:g} s)"),
        ("healthy pair: received", result.received),
        ("healthy pair: lost", result.lost),
        ("healthy pair: told", result.told),
        ("healthy pair: duplicates, out of order", f"{result.duplicates}, {result.out_of_order}"),
        ("publisher's final flush", result.publisher_flush_error or "succeeded"),
    ]  # fmt: skip
    lines = [
        *heading("Memory budget: stalled subscribers under a burst", info, command),
        f"One `broky serve --workers {args.workers}`, every setting default but the memory budget "
        f"({budget}: {_mb(result.memory_budget)} over the workers)"
        + (f" and --max-pending-bytes {args.max_pending_bytes}" if args.max_pending_bytes else "")
        + f". {args.stalled} stalled subscribers, "
        f"each with one raw connection to every worker on `>` ({result.stalled_connections} connections), "
        f"that never read; an SDK publisher publishing {args.megabytes} MB of {args.size}-byte payloads over "
        f"{args.partitions} key_partitions, and an SDK subscriber on `>`.",
        "",
        *table(("Server RSS (master and workers)", ""), rss),
        "",
        *table(("Figure", "Value"), figures),
        "",
        f"Verdict: {'met' if promise_kept(result) else 'NOT met'} (the healthy pair lost nothing; the cut "
        "connections were told SLOW_CONSUMER when they came back; the open ones received + told = "
        "published).",
        "",
    ]
    return "\n".join(lines)


def promise_kept(result: Result) -> bool:
    return (
        result.lost == 0
        and result.told == 0
        and result.duplicates == 0
        and result.out_of_order == 0
        and result.publisher_flush_error is None
        and set(result.stalled_cut_reasons) <= {"slow_consumer"}
        and result.stalled_open_received + result.stalled_open_told == result.stalled_open_published
    )


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "bench.memory_budget", __doc__, out=options.RESULTS, workers=2, role=("publisher", "subscriber")
    )
    parser.add_argument(
        "--stalled", type=int, default=100, help="stalled subscribers (one connection per worker)"
    )
    parser.add_argument("--megabytes", type=int, default=200, help="MB the healthy publisher sends")
    parser.add_argument("--size", type=int, default=1024, help="payload bytes")
    parser.add_argument("--partitions", type=int, default=256)
    parser.add_argument("--memory-budget", help="passed to broky serve (default: its default)")
    parser.add_argument("--max-pending-bytes", help="passed to broky serve (default: its default)")
    parser.add_argument("--name", default="memory_budget", help="results file name (bench/results/NAME.md)")
    options.role_options(parser, "server")
    args = parser.parse_args(argv)
    if args.role == "publisher":
        return roles.done(asyncio.run(publisher(args.server, args.megabytes, args.size, args.partitions)))
    if args.role == "subscriber":
        return roles.done(asyncio.run(subscriber(args.server)))
    info = machine_info()
    extra = ["--memory-budget", args.memory_budget] if args.memory_budget else []
    if args.max_pending_bytes:
        extra += ["--max-pending-bytes", args.max_pending_bytes]
    result = run(args.stalled, args.megabytes, args.size, args.partitions, args.workers, extra)
    write_results(args.out, args.name, report(result, args, info), info, args, **asdict(result))
    return 0 if promise_kept(result) else 1


if __name__ == "__main__":
    sys.exit(main())
