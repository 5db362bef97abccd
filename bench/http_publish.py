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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench.harness import procstat  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.servers import Server, start_broky  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAYLOAD = b"x" * 100
PARTITIONS = [f"partition-{i}" for i in range(8)]


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

    async def post(self, target: str, body: bytes | None) -> dict[str, Any]:
        """POST (body None: GET); a new connection when the server closed the last (as after
        1,000 requests)."""
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
        if not status_and_headers.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{status_and_headers!r} {answer!r}")
        result: dict[str, Any] = json.loads(answer) if body is not None else {"published": 1}
        return result

    def close(self) -> None:
        self.writer.close()


def server_cpu(server: Server) -> float:
    return procstat.total_cpu_seconds(server.pids())


async def sdk_per_call(server: Server, n: int) -> tuple[float, int]:
    async with broky.connect(f"{server.host}:{server.port}") as client:
        await client.publish(PARTITIONS[0], "bench.warm", PAYLOAD)
        await client.flush()
        start = time.perf_counter()
        for i in range(n):
            await client.publish(PARTITIONS[i % 8], "bench.key", PAYLOAD)
        await client.flush()
        return time.perf_counter() - start, n


async def http_clients(server: Server, clients: int, seconds: float, lines: int) -> tuple[float, int]:
    conns = [await HttpConn.open(server.host, server.metrics_port) for _ in range(clients)]
    body = b"\n".join([PAYLOAD] * lines) + b"\n"
    await conns[0].post("/v1/pub/bench.warm", PAYLOAD)  # the gateway connects its client once
    published = 0
    start = time.perf_counter()
    deadline = start + seconds

    async def run(conn: HttpConn, k: int) -> None:
        nonlocal published
        i = k
        while time.perf_counter() < deadline:
            answer = await conn.post(f"/v1/pub/bench.key?partition={PARTITIONS[i % 8]}", body)
            published += answer["published"]
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


def measure(server: Server, case: Any) -> dict[str, float]:
    cpu0 = server_cpu(server)
    master0 = procstat.cpu_seconds(server.pid)
    elapsed, count = asyncio.run(case())
    cpu = server_cpu(server) - cpu0
    master = procstat.cpu_seconds(server.pid) - master0
    return {
        "rate": count / elapsed,
        "count": count,
        "cpu_us_per": cpu / count * 1e6,
        "master_us_per": master / count * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    info = machine_info()
    cases = {
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
            server = start_broky(args.workers)
            try:
                runs[name].append(measure(server, make(server)))
            finally:
                server.stop()
            print(f"run {r + 1} {name}: {runs[name][-1]}", flush=True)
    summary = {
        name: {
            "rate": statistics.median(x["rate"] for x in results),
            "cpu_us_per": statistics.median(x["cpu_us_per"] for x in results),
            "master_us_per": statistics.median(x["master_us_per"] for x in results),
        }
        for name, results in runs.items()
    }
    sdk = summary["sdk per call"]["rate"]
    lines = [
        "# HTTP publish against the SDK's per-call publish",
        "",
        f"Machine: {describe(info)}; load at start {info['load_average_at_start']}.",
        f"`python -m bench.http_publish --runs {args.runs} --messages {args.messages} "
        f"--seconds {args.seconds:g} --workers {args.workers}`; medians; 100-byte payloads, 8 partitions.",
        "",
        "| case | msgs/s (calls/s) | / sdk per call | server CPU µs per msg (call) | of which the master |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        cells = [
            f"{s['rate']:,.0f}",
            f"{s['rate'] / sdk:.3f}",
            f"{s['cpu_us_per']:,.1f}",
            f"{s['master_us_per']:,.1f}",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "http.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "http.json").write_text(json.dumps({"machine": info, "args": vars(args), "runs": runs,
                                                   "summary": summary}, indent=2) + "\n")  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
