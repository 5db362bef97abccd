"""SSE delivery (GET /v1/sub/PATTERN, text/event-stream) against the SDK's, on one `broky serve`.

    python -m bench.sse [--readers 1000] [--rate 20] [--rate-one 2000] [--rounds 5]
                        [--seconds 5] [--procs 2] [--workers 2] [--only sse|sdk] [--quick]
                        [--name sse] [--out DIR]

Cases, alternating within each round (a fresh server for each case of each round, so that
the machine's other load falls on both alike; medians and spread over the rounds):

- sse N: N event-stream readers (`--readers`, 1,000), HTTP/1.1 GET /v1/sub/bench.> with
  Accept: text/event-stream, spread over `--procs` reader processes. A reader is a raw
  asyncio Protocol that counts events by scanning each read for "\\n\\n" (a count carried
  over a read that ends in "\\n"), never parsing per event; the first reader of each process
  parses every event it gets (a sample: JSON, payload, id with five fields). "event: "
  lines (loss, cut) are counted apart.
- sdk N: N SDK clients (`broky.Client`, one connection per worker each), one callback
  subscription each to bench.>, spread the same way; the callback counts.
- sse 1 and sdk 1: one reader of each kind, at `--rate-one` msgs/s.

One SDK publisher process publishes 100-byte payloads (key bench.k, 8 key_partitions) at
`--rate` msgs/s (every 5 ms what is due), so N readers should get N x rate deliveries/s.
After WARMUP seconds the orchestrator takes the readers' counts and the server's CPU
(master and workers: the scheduler's ns of every thread, /proc/PID/task/*/schedstat),
waits `--seconds`, and takes them again: deliveries/s and server CPU µs per delivery in
that window, the master's share of that CPU (the HTTP gateway runs in the master; the SDK
case's master does nothing per message), the master's RSS with the streams open (and
before the first reader connected), the readers' own CPU. Then the publisher stops, the
readers get what is still coming (until their total stops moving for a second), and each
case reports what was published, delivered and missing (a reader cut as a slow consumer,
or a loss), and how busy the whole machine was (/proc/stat) during the window.

Results: bench/results/NAME.md and NAME.json with the machine and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import options, procstat, roles, servers  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.report import table, write_results  # noqa: E402

PATTERN = "bench.>"
KEY = b"bench.k"
PAYLOAD = b"x" * 100
PARTITIONS = [b"p-%d" % i for i in range(8)]
TICK = 0.005  # the publisher's pace: every TICK what is due
WARMUP = 1.5  # seconds of publishing before the window opens
CONNECT_BATCH = 50  # readers connecting at once, per process
DRAIN_QUIET = 2.0  # after the publisher stops: the readers' total still for this long, the case ends
SETUP_TIMEOUT = 120.0  # seconds for a process's readers to connect and subscribe


# ---------------------------------------------------------------- the readers' processes


class Tally:
    def __init__(self) -> None:
        self.events = 0  # "\n\n"-ended SSE events (the first, "retry:", subtracted) or SDK messages
        self.special = 0  # SSE "event: " (loss, cut)
        self.closed = 0  # readers whose stream ended
        self.sample_checked = 0  # events the sampled reader parsed
        self.sample_bad: list[str] = []


class SseReader(asyncio.Protocol):
    """One event-stream reader: counts events, parses them only when it is the sample."""

    def __init__(self, request: bytes, tally: Tally, sample: bool, ready: asyncio.Future[None]) -> None:
        self.request = request
        self.tally = tally
        self.sample = sample
        self.ready = ready
        self.head = b""  # until the response head ends
        self.nl = False  # the last read ended in "\n"
        self.text = b""  # the sampled reader's unparsed rest

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.WriteTransport, transport).write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.head is not None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4 :]
            self.head = None  # type: ignore[assignment]
            if not head.startswith(b"HTTP/1.1 200"):
                if not self.ready.done():
                    self.ready.set_exception(RuntimeError(head.split(b"\r\n")[0].decode(errors="replace")))
                return
            self.tally.events -= 1  # the stream's first event is its "retry:"
            if not self.ready.done():
                self.ready.set_result(None)
        n = data.count(b"\n\n")
        if self.nl and data[:1] == b"\n":
            n += 1
        self.nl = data[-1:] == b"\n"
        tally = self.tally
        tally.events += n
        if b"event: " in data:
            tally.special += data.count(b"event: ")
        if self.sample:
            self._check(data)

    def _check(self, data: bytes) -> None:
        """The sample: every event parsed (chunk framing removed first)."""
        self.text += data
        while True:
            end = self.text.find(b"\n\n")
            if end < 0:
                return
            block, self.text = self.text[:end], self.text[end + 2 :]
            fields: dict[bytes, bytes] = {}
            for line in block.split(b"\n"):
                if line.endswith(b"\r") or not line or b":" not in line:
                    continue  # a chunk-size line, or a chunk's CRLF
                name, _, value = line.partition(b": ")
                fields[name.rsplit(b"\r\n", 1)[-1]] = value
            if b"data" not in fields or b"event" in fields:
                continue
            self.tally.sample_checked += 1
            try:
                event = json.loads(fields[b"data"])
                assert event["payload"] == PAYLOAD.decode() and event["key"] == KEY.decode()
                assert len(fields[b"id"].split(b".")) == 5
            except (AssertionError, KeyError, ValueError) as exc:
                if len(self.tally.sample_bad) < 5:
                    self.tally.sample_bad.append(f"{exc!r}: {block[:200]!r}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.tally.closed += 1
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"closed before the head: {exc}"))


async def _control(tally: Tally) -> None:
    """Say "ready", then answer the orchestrator's "count" (events, special, closed, CPU s)
    until "stop"."""
    roles.ready()
    async for _ in roles.lines():
        roles.answer([tally.events, tally.special, tally.closed, procstat.own_cpu_seconds()])


async def _in_batches(make: Callable[[int], Any], n: int) -> list[Any]:
    out: list[Any] = []
    for first in range(0, n, CONNECT_BATCH):
        out += await asyncio.gather(*(make(i) for i in range(first, min(n, first + CONNECT_BATCH))))
    return out


async def sse_readers(host: str, http_port: int, n: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    tally = Tally()
    request = (f"GET /v1/sub/{PATTERN} HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n").encode()

    async def one(i: int) -> asyncio.Transport:
        ready: asyncio.Future[None] = loop.create_future()
        transport, _ = await loop.create_connection(
            lambda: SseReader(request, tally, i == 0, ready), host, http_port
        )
        await ready
        return transport

    async with asyncio.timeout(SETUP_TIMEOUT):
        transports = await _in_batches(one, n)
    await _control(tally)
    for t in transports:
        t.abort()
    return {"events": tally.events, "special": tally.special, "closed": tally.closed,
            "sample_checked": tally.sample_checked, "sample_bad": tally.sample_bad}  # fmt: skip


async def sdk_readers(address: str, n: int) -> dict[str, Any]:
    from broky.client.client import Client

    tally = Tally()

    def count(_msg: Any) -> None:
        tally.events += 1

    async def one(i: int) -> Client:
        client = Client(address, name=f"bench-sse-{i}")
        await client.connect()
        await client.subscribe(PATTERN, callback=count)
        return client

    async with asyncio.timeout(SETUP_TIMEOUT):
        clients = await _in_batches(one, n)
    await _control(tally)
    dropped = sum(c.stats.dropped_local for c in clients)
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    return {"events": tally.events, "special": 0, "closed": 0, "dropped_local": dropped}


async def publisher(address: str, rate: int) -> dict[str, Any]:
    """Publish at `rate` from "go" (a line on stdin) until "stop"; flush; say how many."""
    import broky

    loop = asyncio.get_running_loop()
    async with broky.connect(address) as client:
        await client.publish(b"warm", PAYLOAD, partition=PARTITIONS[0])  # (no reader matches it)
        await client.flush()
        await roles.ready_then_go()
        stop = roles.next_line()
        start, sent = loop.time(), 0
        while not stop.done():
            due = int((loop.time() - start) * rate) + 1
            while sent < due:
                await client.publish(KEY, PAYLOAD, partition=PARTITIONS[sent % 8])
                sent += 1
            await asyncio.sleep(TICK)
        await client.flush()
        return {"published": sent, "seconds": round(loop.time() - start, 3)}


# ---------------------------------------------------------------- the orchestrator


def _counts(procs: list[roles.Role]) -> tuple[int, int, int, float]:
    """(events, special, closed, the readers' CPU s), summed over the reader processes."""
    for p in procs:
        p.say("count")
    total = [0, 0, 0, 0.0]
    for p in procs:
        total = [a + b for a, b in zip(total, json.loads(p.read()), strict=True)]
    return int(total[0]), int(total[1]), int(total[2]), float(total[3])


def one_case(kind: str, readers: int, rate: int, seconds: float, procs: int, workers: int) -> dict[str, Any]:
    """Start the server, the readers and the publisher; measure the window; stop everything."""
    extra = ["--max-connections-per-address", "0", "--http-max-connections", str(readers + 64)]
    server = servers.start_broky(workers, extra)
    started: list[roles.Role] = []
    try:
        address = f"{server.host}:{server.port}"
        if kind == "sse":  # the gateway's client connects at the first /v1/ request: a warm one
            import urllib.request

            req = urllib.request.Request(f"http://{server.host}:{server.metrics_port}/v1/pub/warm",
                                         data=b"w", method="POST")  # fmt: skip
            urllib.request.urlopen(req, timeout=10).read()
        rss_before = procstat.rss_bytes(server.pid)
        shares = [readers // procs + (1 if i < readers % procs else 0) for i in range(procs)]
        reader_procs = []
        connect_start = time.perf_counter()
        for share in (s for s in shares if s):
            if kind == "sse":
                argv = ["--role", "sse", "--host", server.host, "--http-port", str(server.metrics_port)]
            else:
                argv = ["--role", "sdk", "--address", address]
            reader_procs.append(roles.start(started, "bench.sse", *argv, "--readers", str(share), ready=None,
                                            what=f"{kind} readers"))  # fmt: skip
        for p in reader_procs:  # they all connect at once
            p.ready()
        connect_s = time.perf_counter() - connect_start
        pub = roles.start(started, "bench.sse", "--role", "publisher", "--address", address, "--rate",
                          str(rate), what="the publisher")  # fmt: skip
        pids = server.pids()
        pub.say("go")
        time.sleep(WARMUP)
        busy0 = procstat.machine_cpu()
        sys0, user0 = procstat.system_cpu_seconds(server.pid), procstat.cpu_seconds(server.pid)
        events0, _, _, rcpu0 = _counts(reader_procs)
        cpu0, master0, t0 = (
            procstat.total_exact_cpu_seconds(pids),
            procstat.exact_cpu_seconds(server.pid),
            time.perf_counter(),
        )
        time.sleep(seconds)
        events1, special, closed, rcpu1 = _counts(reader_procs)
        cpu1, master1, t1 = (
            procstat.total_exact_cpu_seconds(pids),
            procstat.exact_cpu_seconds(server.pid),
            time.perf_counter(),
        )
        busy1 = procstat.machine_cpu()
        sys1, user1 = procstat.system_cpu_seconds(server.pid), procstat.cpu_seconds(server.pid)
        rss_open = procstat.rss_bytes(server.pid)
        published = pub.finish(timeout=30)["published"]
        last, still = -1, time.monotonic()
        while time.monotonic() - still < DRAIN_QUIET:  # what is still on its way
            time.sleep(0.25)
            events, special, closed, _ = _counts(reader_procs)
            if events != last:
                last, still = events, time.monotonic()
            if events >= published * readers:
                break
        counters = server_counters(server)
        finals = [p.finish(timeout=30) for p in reader_procs]
        delivered = events1 - events0
        window = t1 - t0
        cpu = cpu1 - cpu0
        result: dict[str, Any] = {
            "kind": kind,
            "readers": readers,
            "rate": rate,
            "deliveries_per_s": delivered / window,
            "offered_per_s": rate * readers,
            "cpu_us_per_delivery": cpu / delivered * 1e6 if delivered else None,
            "server_cpu_cores": cpu / window,
            "master_share": (master1 - master0) / cpu if cpu else None,
            "master_cpu_cores": (master1 - master0) / window,
            # the kernel's part of the master's CPU (clock ticks: /proc/PID/stat stime of utime+stime)
            "master_system_share": (sys1 - sys0) / (user1 - user0) if user1 > user0 else None,
            "readers_cpu_cores": (rcpu1 - rcpu0) / window,
            "machine_busy": procstat.busy_share(busy0, busy1),
            "master_rss_before": rss_before,
            "master_rss_open": rss_open,
            "connect_s": connect_s,
            "published": published,
            "delivered_total": last,
            "missing": published * readers - last,
            "special_events": special,
            "streams_closed": closed,
            "server_processes": len(pids),
            "server": counters,
        }
        if kind == "sse":
            result["sample_checked"] = sum(f.get("sample_checked", 0) for f in finals)
            result["sample_bad"] = [b for f in finals for b in f.get("sample_bad", [])]
        else:
            result["dropped_local"] = sum(f.get("dropped_local", 0) for f in finals)
        return result
    finally:
        roles.kill_all(started)
        server.stop()


def server_counters(server: servers.Server) -> dict[str, Any]:
    """What the server counted: the master's HTTP and gateway counters, and the workers'
    drops by reason and slow-consumer cuts (summed), from /stats."""
    stats = server.stats(timeout=30)
    dropped: dict[str, int] = {}
    for w in stats["workers"]:
        for reason, count in w.get("dropped", {}).items():
            if count:
                dropped[reason] = dropped.get(reason, 0) + count
    return {
        "http": stats["master"]["http"],
        "dropped": dropped,
        "slow_consumer_disconnects": sum(w.get("slow_consumer_disconnects", 0) for w in stats["workers"]),
    }


CASES = ("case", "offered deliveries/s", "deliveries/s", "server CPU µs per delivery", "master's share of it",
         "master RSS, streams open (before)", "missing / delivered", "machine busy")  # fmt: skip
SUMMED = ("deliveries_per_s", "cpu_us_per_delivery", "master_share", "master_rss_open", "master_rss_before",
          "machine_busy", "readers_cpu_cores", "server_cpu_cores", "master_cpu_cores",
          "master_system_share")  # fmt: skip


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            continue
        row: dict[str, Any] = {"rounds": len(ok)}
        for field in SUMMED:
            values = [r[field] for r in ok if r[field] is not None]
            row[field] = statistics.median(values) if values else None
            row[field + "_range"] = [min(values), max(values)] if values else None
        row["missing"] = sum(r["missing"] for r in ok)
        row["delivered_total"] = sum(r["delivered_total"] for r in ok)
        out[name] = row
    return out


def report(runs: dict[str, list[dict[str, Any]]], summary: dict[str, dict[str, Any]],
           args: argparse.Namespace, info: dict[str, Any]) -> str:  # fmt: skip
    lines = [
        "# SSE delivery against the SDK's",
        "",
        f"Machine: {describe(info)}; load at start {info['load_average_at_start']}.",
        f"`python -m bench.sse --readers {args.readers} --rate {args.rate} --rate-one {args.rate_one} "
        f"--rounds {args.rounds} --seconds {args.seconds:g} --procs {args.procs} --workers {args.workers}`: "
        f"a fresh server per case and round, the cases alternating within each round; medians, "
        f"[min, max] over the rounds; 100-byte payloads, one publisher at the rate given.",
        "",
    ]
    rows = []
    for name, s in summary.items():
        first = next(r for r in runs[name] if "error" not in r)
        lo, hi = s["deliveries_per_s_range"]
        clo, chi = s["cpu_us_per_delivery_range"]
        rows.append((
            name,
            f"{first['offered_per_s']:,}",
            f"{s['deliveries_per_s']:,.0f} [{lo:,.0f}, {hi:,.0f}]",
            f"{s['cpu_us_per_delivery']:,.2f} [{clo:,.2f}, {chi:,.2f}]",
            f"{s['master_share']:.0%}",
            f"{s['master_rss_open'] / 2**20:,.0f} MiB ({s['master_rss_before'] / 2**20:,.0f})",
            f"{s['missing']:,} / {s['delivered_total']:,}",
            f"{s['machine_busy']:.0%}" if s["machine_busy"] is not None else "?",
        ))  # fmt: skip
    lines += table(CASES, rows, "l" * len(CASES))
    errors = [(name, r["error"]) for name, rs in runs.items() for r in rs if "error" in r]
    lines += ["", "Failed rounds: " + ("none" if not errors else "; ".join(f"{n}: {e}" for n, e in errors))]
    samples = [r for rs in runs.values() for r in rs if r.get("kind") == "sse" and "error" not in r]
    checked = sum(r["sample_checked"] for r in samples)
    bad = [b for r in samples for b in r["sample_bad"]]
    lines.append(f"SSE sample (the first reader of each process parses every event): {checked:,} events "
                 f"parsed, {len(bad)} malformed.")  # fmt: skip
    lines.append("Reader processes' CPU (cores, median): " + ", ".join(
        f"{name} {s['readers_cpu_cores']:.2f}" for name, s in summary.items()) + ".")  # fmt: skip
    cores = [
        f"{name} {s['master_cpu_cores']:.2f} ({_pct(s['master_system_share'])})"
        for name, s in summary.items()
    ]
    lines.append(
        "The master's CPU (cores, median) and its kernel part (system time): " + ", ".join(cores) + "."
    )
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.sse", __doc__, out=options.RESULTS, workers=2, quick=True, name="sse",
                            role=("sse", "sdk", "publisher"),
                            helps={"quick": "tiny sizes, one round (the CI smoke run)"})  # fmt: skip
    parser.add_argument("--readers", type=int, default=1000, help="readers of each kind in the N cases")
    parser.add_argument("--rate", type=int, default=20, help="msgs/s published in the N cases")
    parser.add_argument("--rate-one", type=int, default=2000, help="msgs/s published in the 1 -> 1 cases")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0, help="the measured window")
    parser.add_argument("--procs", type=int, default=2, help="reader processes")
    parser.add_argument("--only", default="", help="the kinds of case to run: sse, sdk or sse,sdk (all)")
    options.role_options(parser, "address", "host", http_port=int)
    args = parser.parse_args(argv)
    if args.role:
        import uvloop

        if args.role == "sse":
            return roles.done(uvloop.run(sse_readers(args.host, args.http_port, args.readers)))
        if args.role == "sdk":
            return roles.done(uvloop.run(sdk_readers(args.address, args.readers)))
        return roles.done(uvloop.run(publisher(args.address, args.rate)))
    if args.quick:
        args.readers, args.rate, args.rate_one, args.rounds, args.seconds = 20, 50, 200, 1, 1.0
    info = machine_info()
    cases = {
        f"sse {args.readers}": ("sse", args.readers, args.rate),
        f"sdk {args.readers}": ("sdk", args.readers, args.rate),
        "sse 1": ("sse", 1, args.rate_one),
        "sdk 1": ("sdk", 1, args.rate_one),
    }
    if args.only:
        kinds = set(args.only.split(","))
        cases = {name: case for name, case in cases.items() if case[0] in kinds}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else [*reversed(list(cases)[:2]), *reversed(list(cases)[2:])]
        for name in order:
            kind, readers, rate = cases[name]
            try:
                got = one_case(kind, readers, rate, args.seconds, args.procs, args.workers)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                got = {"error": repr(exc)[:300]}
            runs[name].append(got)
            brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in got.items()
                     if k not in ("sample_bad",)}  # fmt: skip
            print(f"round {r + 1} {name}: {json.dumps(brief)}", file=sys.stderr, flush=True)
    summary = summarize(runs)
    write_results(args.out, args.name, report(runs, summary, args, info), info, args, summary=summary,
                  runs=runs)  # fmt: skip
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
