"""HTTP publish (POST /v1/pub/...) against the SDK's per-call publish, on one `broky serve`.

Cases, each `--runs` times (median reported), on a server it starts itself:

- sdk per call: one SDK client, `await client.publish(...)` per message over
  8 partitions, then `flush`; msgs/s from the first publish to the flush.
- http 1 client: one keep-alive HTTP connection (what `curl` does with
  several URLs, or any HTTP client with a pool), one message per POST, each
  waited for (an HTTP client cannot pipeline usefully: each POST's answer
  carries its positions); requests/s = msgs/s.
- http 8 clients: eight such connections at once.
- http batch: one connection, POSTs of 1,000 lines each.
- positions(): `client.positions(partition=...)`, a bounded read on a
  connection of its own: what a POST would cost if the gateway learnt its
  positions so (it does not: it sends its Reads on its publish connection).
- GET /healthz: the HTTP server's own cost per request, for scale.

Server CPU per message (master + workers, /proc/<pid>/stat) for each case.
Results: bench/results/http.md and http.json with the machine.

    python -m bench.http_publish [--runs 3] [--messages 20000] [--seconds 5]

With --cluster: etcd and two nodes, a and b (--workers each, default 1 here),
one cluster for every run, and a POST for a vbucket that node b owns, made
where the client happens to be (node a) or at its owner (node b). Server CPU
is both nodes'. The cases, each `--runs` times in turn:

- forward: POST at a, vbucket of b: the gateway of a publishes on its lane
  to b's worker (what ships);
- direct: POST at b, vbucket of b: what a client that knows the owner pays,
  and the second leg of a redirect;
- local: POST at a, vbucket of a: the single-node case, for scale;
- 307 leg: POST at a, answered at once (a 400: the request and its body read,
  a small JSON answer): what node a would spend on a 307 and the client on its
  first round trip;
- forward / direct, 1000 msgs/POST: the same with batches;
- redirect (estimated): not built, so derived from its legs: CPU = 307 leg +
  direct, calls/s = 1 / (1/307 leg + 1/direct) (two round trips, one after
  the other, per POST).

Results: bench/results/http_cluster.md and http_cluster.json.

    python -m bench.http_publish --cluster [--runs 3] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench.harness import options, procstat  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.report import table, write_results  # noqa: E402
from bench.harness.servers import Server, start_broky  # noqa: E402

PAYLOAD = b"x" * 100
PARTITIONS = [f"partition-{i}" for i in range(8)]
Case = Callable[[], Coroutine[Any, Any, tuple[float, int]]]  # a case's run: (seconds, messages or calls)


class HttpConn:
    """One keep-alive HTTP/1.1 connection: POST, read the answer (Content-Length framed)."""

    def __init__(
        self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.address = (host, port)
        self.reader = reader
        self.writer = writer
        self.connections = 1

    @classmethod
    async def open(cls, host: str, port: int) -> HttpConn:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(host, port, reader, writer)

    async def post(self, target: str, body: bytes | None, status: bytes = b"200") -> dict[str, Any]:
        """POST (body None: GET), expecting `status`; a new connection when the server closed
        the last (as after 1,000 requests)."""
        if self.reader.at_eof():
            self.writer.close()
            self.reader, self.writer = await asyncio.open_connection(*self.address)
            self.connections += 1
        if body is None:
            self.writer.write(f"GET {target} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        else:
            head = f"POST {target} HTTP/1.1\r\nHost: bench\r\nContent-Length: {len(body)}\r\n\r\n"
            self.writer.write(head.encode() + body)
        status_and_headers = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in status_and_headers.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        answer = await self.reader.readexactly(length)
        if b"\r\nConnection: close" in status_and_headers:
            self.writer.close()
            await self.reader.read()  # at EOF: the next POST opens a new connection
        if not status_and_headers.startswith(b"HTTP/1.1 " + status):
            raise RuntimeError(f"{status_and_headers!r} {answer!r}")
        result: dict[str, Any] = json.loads(answer) if body is not None else {"published": 1}
        return result

    def close(self) -> None:
        self.writer.close()


def server_cpu(server: Server) -> float:
    return procstat.total_cpu_seconds(server.pids())


async def sdk_per_call(server: Server, n: int) -> tuple[float, int]:
    async with broky.connect(f"{server.host}:{server.port}") as client:
        await client.publish("bench.warm", PAYLOAD, partition=PARTITIONS[0])
        await client.flush()
        start = time.perf_counter()
        for i in range(n):
            await client.publish("bench.key", PAYLOAD, partition=PARTITIONS[i % 8])
        await client.flush()
        return time.perf_counter() - start, n


async def http_clients(
    server: Server,
    clients: int,
    seconds: float,
    lines: int,
    partitions: list[str] = PARTITIONS,
    query: str = "",
    status: bytes = b"200",
) -> tuple[float, int]:
    """`clients` keep-alive connections POSTing `lines` lines each to `partitions` in turn
    for `seconds`; (elapsed, messages published; with `status` other than 200: calls)."""
    conns = [await HttpConn.open(server.host, server.metrics_port) for _ in range(clients)]
    body = b"\n".join([PAYLOAD] * lines) + b"\n"
    for p in partitions:  # the gateway connects its client, and its lanes, once
        await conns[0].post(f"/v1/pub/bench.warm?partition={p}", PAYLOAD)
    published = 0
    start = time.perf_counter()
    deadline = start + seconds

    async def run(conn: HttpConn, k: int) -> None:
        nonlocal published
        i = k
        while time.perf_counter() < deadline:
            target = f"/v1/pub/bench.key?partition={partitions[i % len(partitions)]}{query}"
            answer = await conn.post(target, body, status)
            published += answer["published"] if status == b"200" else 1
            i += clients

    await asyncio.gather(*(run(c, k) for k, c in enumerate(conns)))
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    return elapsed, published


async def healthz(server: Server, seconds: float) -> tuple[float, int]:
    conn = await HttpConn.open(server.host, server.metrics_port)
    calls = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        await conn.post("/healthz", None)
        calls += 1
    conn.close()
    return time.perf_counter() - start, calls


async def positions(server: Server, seconds: float) -> tuple[float, int]:
    async with broky.connect(f"{server.host}:{server.port}") as client:
        calls = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            await client.positions(partition=PARTITIONS[calls % 8])
            calls += 1
        return time.perf_counter() - start, calls


def measure(server: Server, case: Case, others: tuple[Server, ...] = ()) -> dict[str, float]:
    """Run `case`; its rate and server CPU per message (`server`'s and `others`'), of which
    `server`'s master."""
    everyone = (server, *others)
    cpu0 = sum(server_cpu(s) for s in everyone)
    master0 = procstat.cpu_seconds(server.pid)
    elapsed, count = asyncio.run(case())
    cpu = sum(server_cpu(s) for s in everyone) - cpu0
    master = procstat.cpu_seconds(server.pid) - master0
    return {
        "rate": count / elapsed,
        "count": count,
        "cpu_us_per": cpu / count * 1e6,
        "master_us_per": master / count * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.http_publish", __doc__, out=options.RESULTS, runs=3, workers=None,
                            helps={"workers": "per node (default 2; 1 with --cluster)"})  # fmt: skip
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--cluster", action="store_true", help="two nodes: forward against redirect")
    args = parser.parse_args(argv)
    if args.cluster:
        return cluster_main(args)
    args.workers = args.workers or 2
    info = machine_info()
    cases: dict[str, Callable[[Server], Case]] = {
        "sdk per call": lambda s: lambda: sdk_per_call(s, args.messages),
        "http 1 client, 1 msg/POST": lambda s: lambda: http_clients(s, 1, args.seconds, 1),
        "http 8 clients, 1 msg/POST": lambda s: lambda: http_clients(s, 8, args.seconds, 1),
        "http 1 client, 1000 msgs/POST": lambda s: lambda: http_clients(s, 1, args.seconds, 1000),
        "positions() (bounded read)": lambda s: lambda: positions(s, args.seconds),
        "http 1 client, GET /healthz": lambda s: lambda: healthz(s, args.seconds),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for r in range(args.runs):
        for name, make in cases.items():
            # (positions() opens a connection per worker per call, faster than the handshake
            # limit lets one address: that limit is not what this measures)
            server = start_broky(args.workers, ["--handshake-rate", "0"])
            try:
                runs[name].append(measure(server, make(server)))
            finally:
                server.stop()
            print(f"run {r + 1} {name}: {runs[name][-1]}", flush=True)
    summary = medians(runs)
    text = report("http", runs, summary, args, info)
    write_results(args.out, "http", text, info, args, runs=runs, summary=summary)
    return 0


def medians(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per case, the median rate, server CPU and the master's share of it, over the runs."""
    keys = ("rate", "cpu_us_per", "master_us_per")
    return {
        name: {k: statistics.median(x[k] for x in results) for k in keys} for name, results in runs.items()
    }


def report(
    name: str,
    runs: dict[str, list[dict[str, float]]],
    summary: dict[str, dict[str, float]],
    args: argparse.Namespace,
    info: dict[str, Any],
) -> str:
    """http.md (`name` "http") or http_cluster.md: the medians of every case."""
    if name == "http":
        base, against = summary["sdk per call"]["rate"], "/ sdk per call"
        cpu = "server CPU µs per msg (call)"
        lines = [
            "# HTTP publish against the SDK's per-call publish",
            "",
            f"Machine: {describe(info)}; load at start {info['load_average_at_start']}.",
            f"`python -m bench.http_publish --runs {args.runs} --messages {args.messages} "
            f"--seconds {args.seconds:g} --workers {args.workers}`; medians; 100-byte payloads, "
            "8 partitions.",
            "",
        ]
    else:
        base, against = summary["forward: POST at a, vbucket of b"]["rate"], "/ forward"
        cpu = "both nodes' CPU µs per msg (call)"
        lines = [
            "# HTTP publish in a cluster: forward against redirect",
            "",
            f"Machine: {describe(info)}; load at start {info['load_average_at_start']}.",
            f"`python -m bench.http_publish --cluster --runs {args.runs} --seconds {args.seconds:g} "
            f"--workers {args.workers}`; two nodes on one etcd, one keep-alive client, medians; 100-byte "
            "payloads, 8 partitions.",
            "",
        ]
    digits = "3f" if name == "http" else "2f"
    rows = [
        (case, f"{x['rate']:,.0f}", f"{x['rate'] / base:.{digits}}", f"{x['cpu_us_per']:,.1f}",
         f"{x['master_us_per']:,.1f}")
        for case, x in summary.items()
    ]  # fmt: skip
    master = "of which the master" if name == "http" else "of which its master"
    lines += table(("case", "msgs/s (calls/s)", against, cpu, master), rows, "lllll")
    return "\n".join(lines) + "\n"


def owned_by(vmap: Any, node_id: str, count: int) -> list[str]:
    """`count` key_partitions whose vbuckets `vmap` gives to node `node_id`."""
    from broky.protocol.routing import vbucket_of

    index = vmap.node_index(node_id)
    found = [
        p
        for p in (f"partition-{i}" for i in range(100_000))
        if vmap.owners[vbucket_of(p.encode())][0] == index
    ]
    return found[:count]


def cluster_main(args: argparse.Namespace) -> int:
    from bench.harness.cluster import ClusterRun

    args.workers = args.workers or 1
    info = machine_info()
    cluster = ClusterRun(args.workers)
    try:
        a, b = cluster.start("a"), cluster.start("b")
        cluster.wait_settled(60)
        vmap = cluster.map()
        of_a, of_b = owned_by(vmap, "a", 8), owned_by(vmap, "b", 8)
        secs = args.seconds
        cases: dict[str, tuple[Server, Case]] = {
            "forward: POST at a, vbucket of b": (a, lambda: http_clients(a, 1, secs, 1, of_b)),
            "direct: POST at b, vbucket of b": (b, lambda: http_clients(b, 1, secs, 1, of_b)),
            "local: POST at a, vbucket of a": (a, lambda: http_clients(a, 1, secs, 1, of_a)),
            "307 leg: POST at a, answered at once": (
                a,
                lambda: http_clients(a, 1, secs, 1, of_b, "&lines=2", b"400"),
            ),
            "forward, 1000 msgs/POST": (a, lambda: http_clients(a, 1, secs, 1000, of_b)),
            "direct, 1000 msgs/POST": (b, lambda: http_clients(b, 1, secs, 1000, of_b)),
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for r in range(args.runs):
            for name, (at, case) in cases.items():
                other = b if at is a else a
                runs[name].append(measure(at, case, (other,)))
                print(f"run {r + 1} {name}: {runs[name][-1]}", flush=True)
    finally:
        cluster.stop()
    summary = medians(runs)
    leg, direct = summary["307 leg: POST at a, answered at once"], summary["direct: POST at b, vbucket of b"]
    summary["redirect (estimated: 307 leg + direct)"] = {
        "rate": 1 / (1 / leg["rate"] + 1 / direct["rate"]),
        "cpu_us_per": leg["cpu_us_per"] + direct["cpu_us_per"],
        "master_us_per": leg["master_us_per"] + direct["master_us_per"],
    }
    text = report("http_cluster", runs, summary, args, info)
    write_results(args.out, "http_cluster", text, info, args, runs=runs, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
