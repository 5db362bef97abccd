"""SDK benchmark: one Python process publishing through broky vs nats.py.

Runs in one go, on the same machine, against servers it starts itself on
free loopback ports and stops by pid:

- publish: one asyncio client publishes N 100-byte messages (64 key
  partitions) and flushes; msgs/s from the first publish to the flush's
  return. Broky SDK -> `broky serve` vs nats.py -> nats-server.
- bulk publish: the same N messages through `publish_many`, columns of
  BULK_ROWS; nats.py has no bulk call, so its side is the per-call publish.
- end-to-end: in the same process a subscriber (callback) and a publisher
  (a second client); msgs/s from the first publish until the subscriber has
  received the last one, plus how many were lost.

Each case runs `--runs` times, alternating Broky and NATS, and the median is
reported with the ratio Broky / NATS. Results go to bench/results/sdk.md and
sdk.json with the machine (CPU model, cores, memory, load) and versions.

    python -m bench.sdk_bench [--messages 200000] [--runs 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import broky  # noqa: E402
from bench.harness import machine, options, procstat, servers  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402

PAYLOAD = b"x" * 100
PARTITIONS = [b"partition-%d" % i for i in range(64)]
KEY = b"bench.key"


# ---------------------------------------------------------------- the cases


async def broky_publish(url: str, n: int) -> dict[str, float]:
    async with broky.connect(url, name="bench") as client:
        for kp in PARTITIONS:  # open every connection before timing
            await client.publish(KEY, PAYLOAD, partition=kp)
        await client.flush()
        publish = client.publish
        cpu = time.process_time()
        start = time.perf_counter()
        for i in range(n):
            await publish(KEY, PAYLOAD, partition=PARTITIONS[i & 63])
        await client.flush(timeout=120)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    return {"rate": n / elapsed, "seconds": elapsed, "client_cpu_us": cpu / n * 1e6}


BULK_ROWS = 10_000  # messages per publish_many call


async def broky_publish_many(url: str, n: int) -> dict[str, float]:
    # The bulk producer's call (Client.publish_many), columns of BULK_ROWS messages.
    async with broky.connect(url, name="bench") as client:
        for kp in PARTITIONS:  # open every connection before timing
            await client.publish(KEY, PAYLOAD, partition=kp)
        await client.flush()
        kps = [PARTITIONS[i & 63] for i in range(BULK_ROWS)]
        keys = [KEY] * BULK_ROWS
        payloads = [PAYLOAD] * BULK_ROWS
        publish_many = client.publish_many
        cpu = time.process_time()
        start = time.perf_counter()
        for done in range(0, n, BULK_ROWS):
            rows = min(BULK_ROWS, n - done)
            if rows == BULK_ROWS:
                await publish_many(keys, payloads, partitions=kps)
            else:
                await publish_many(keys[:rows], payloads[:rows], partitions=kps[:rows])
        await client.flush(timeout=120)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    return {"rate": n / elapsed, "seconds": elapsed, "client_cpu_us": cpu / n * 1e6}


async def nats_publish(url: str, n: int) -> dict[str, float]:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.publish("bench.key", PAYLOAD)
        await nc.flush()
        publish = nc.publish
        cpu = time.process_time()
        start = time.perf_counter()
        for _ in range(n):
            await publish("bench.key", PAYLOAD)
        await nc.flush(timeout=120)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        await nc.close()
    return {"rate": n / elapsed, "seconds": elapsed, "client_cpu_us": cpu / n * 1e6}


def e2e_result(n: int, received: int, seconds: float, cpu: float, reported_lost: int) -> dict[str, float]:
    return {
        "rate": received / seconds,
        "seconds": seconds,
        "received": received,
        "lost": n - received,
        "reported_lost": reported_lost,
        "client_cpu_us": cpu / max(received, 1) * 1e6,
    }


async def _wait_count(done: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        pass


async def broky_e2e(url: str, n: int) -> dict[str, float]:
    received = 0
    done = asyncio.Event()
    last = 0.0

    def on_message(msg: broky.Message) -> None:
        nonlocal received, last
        received += 1
        if received == n:
            last = time.perf_counter()
            done.set()

    async with broky.connect(url, name="bench-sub") as sub, broky.connect(url, name="bench-pub") as pub:
        await sub.subscribe(KEY, callback=on_message)
        for kp in PARTITIONS:
            await pub.publish(b"warm.up", PAYLOAD, partition=kp)
        await pub.flush()
        publish = pub.publish
        cpu = time.process_time()
        start = time.perf_counter()
        for i in range(n):
            await publish(KEY, PAYLOAD, partition=PARTITIONS[i & 63])
        await pub.flush(timeout=120)
        await _wait_count(done, 10)
        end = last if received == n else time.perf_counter()
        cpu = time.process_time() - cpu
        lost = sub.stats.server_lost + sub.stats.dropped_local
    return e2e_result(n, received, end - start, cpu, lost)


async def nats_e2e(url: str, n: int) -> dict[str, float]:
    import nats

    received = 0
    done = asyncio.Event()
    last = 0.0

    async def on_message(msg: Any) -> None:
        nonlocal received, last
        received += 1
        if received == n:
            last = time.perf_counter()
            done.set()

    errors: list[BaseException] = []

    async def on_error(exc: BaseException) -> None:
        errors.append(exc)

    sub_nc = await nats.connect(url, error_cb=on_error)
    pub_nc = await nats.connect(url, error_cb=on_error)
    try:
        await sub_nc.subscribe("bench.key", cb=on_message)
        await sub_nc.flush()
        publish = pub_nc.publish
        cpu = time.process_time()
        start = time.perf_counter()
        for _ in range(n):
            await publish("bench.key", PAYLOAD)
        await pub_nc.flush(timeout=120)
        await _wait_count(done, 10)
        end = last if received == n else time.perf_counter()
        cpu = time.process_time() - cpu
    finally:
        await pub_nc.close()
        await sub_nc.close()
    return e2e_result(n, received, end - start, cpu, len(errors))


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    out = {
        "rate": statistics.median(r["rate"] for r in runs),
        "client_cpu_us": statistics.median(r["client_cpu_us"] for r in runs),
        "server_cpu_us": statistics.median(r["server_cpu_us"] for r in runs),
        "runs": [round(r["rate"]) for r in runs],
    }
    if "lost" in runs[0]:
        out["lost"] = sum(r["lost"] for r in runs)
    return out  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = options.parser("bench.sdk_bench", __doc__, out=options.RESULTS, runs=3, workers=2,
                        helps={"runs": "runs per case; the median is reported (3)",
                               "workers": "broky serve --workers (2)"})  # fmt: skip
    ap.add_argument("--messages", type=int, default=200_000, help="messages per run (200000)")
    ap.add_argument("--no-save", action="store_true", help="print only, do not write the results")
    args = ap.parse_args(argv)
    info = {**machine.machine_info(), **machine.versions("uvloop", "nats-py")}
    running = {"broky": servers.start_broky(args.workers)}
    cases: dict[str, tuple[Callable[[str, int], Coroutine[Any, Any, dict[str, float]]], ...]] = {
        "publish": (broky_publish, nats_publish),
        # nats.py has no bulk call: its per-call publish is what a bulk producer has there
        "bulk publish": (broky_publish_many, nats_publish),
        "end-to-end": (broky_e2e, nats_e2e),
    }
    results: dict[str, dict[str, Any]] = {}
    try:
        running["nats"] = servers.start_nats()
        urls = {
            "broky": "{}:{}".format(*running["broky"].address),
            "nats": "nats://{}:{}".format(*running["nats"].address),
        }
        for case, (broky_fn, nats_fn) in cases.items():
            got: dict[str, list[dict[str, float]]] = {"broky": [], "nats": []}
            for r in range(args.runs):
                for which, fn in options.alternating([("broky", broky_fn), ("nats", nats_fn)], r):
                    pids = running[which].pids()
                    server_cpu = procstat.total_cpu_seconds(pids)
                    res = uvloop.run(fn(urls[which], args.messages))
                    res["server_cpu_us"] = (
                        (procstat.total_cpu_seconds(pids) - server_cpu) / args.messages * 1e6
                    )
                    got[which].append(res)
                    print(f"  {case:10} {fn.__name__:15} {res['rate']:>12,.0f} msgs/s"
                          f" {res['client_cpu_us']:6.2f} µs client CPU/msg"
                          f" {res['server_cpu_us']:6.2f} µs server CPU/msg", file=sys.stderr)  # fmt: skip
            results[case] = {"broky": median_of(got["broky"]), "nats": median_of(got["nats"])}
            results[case]["ratio"] = results[case]["broky"]["rate"] / results[case]["nats"]["rate"]
            # how much less client CPU one message costs (nats / broky)
            results[case]["cpu_ratio"] = (
                results[case]["nats"]["client_cpu_us"] / results[case]["broky"]["client_cpu_us"]
            )
    finally:
        for server in running.values():
            server.stop()
    text = render(info, args, results)
    if args.no_save:
        print(text)
    else:
        write_results(args.out, "sdk", text, info, args, messages=args.messages, runs=args.runs,
                      workers=args.workers, payload_bytes=len(PAYLOAD), results=results)  # fmt: skip
    return 0


def render(info: dict[str, Any], args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for case, r in results.items():
        b, n = r["broky"], r["nats"]
        rows.append((
            case, f"{b['rate']:,.0f}", f"{n['rate']:,.0f}", f"{r['ratio']:.2f}x",
            f"{b['client_cpu_us']:.2f} / {n['client_cpu_us']:.2f}", f"{r['cpu_ratio']:.2f}x",
            f"{b['server_cpu_us']:.2f} / {n['server_cpu_us']:.2f}",
            f"{b['lost']} / {n['lost']}" if "lost" in b else "n/a", b["runs"], n["runs"],
        ))  # fmt: skip
    head = ("case", "broky SDK msgs/s", "nats.py msgs/s", "ratio", "client CPU µs/msg broky / nats",
            "CPU ratio", "server CPU µs/msg broky / nats-server", "lost broky / nats", "runs broky",
            "runs nats")  # fmt: skip
    command = (
        f"python -m bench.sdk_bench --messages {args.messages} --runs {args.runs} --workers {args.workers}"
    )
    lines = [
        *heading("SDK benchmark: broky SDK vs nats.py, one Python process", info),
        f"`{command}` — {len(PAYLOAD)}-byte payloads, median of {args.runs} alternating runs, uvloop "
        f"{info.get('uvloop', '?')}, nats.py {info.get('nats-py', '?')}.",
        "",
        *table(head, rows, "lrrrrrrlll"),
        "",
        "- publish: publish N messages then flush (Ping/Pong on every worker; PING/PONG for NATS).",
        f"- bulk publish: the same through `publish_many` in columns of {BULK_ROWS:,} messages (nats.py has",
        "  no bulk call: its side is the per-call publish again).",
        "- end-to-end: subscriber and publisher clients in the same process and event loop; time until",
        "  the last message is received (broky: plain callback; nats.py: its coroutine callback).",
        "- client CPU: process time of the benchmark process per message (publish: publishing only;",
        "  end-to-end: publishing and receiving). Server CPU: user+system time of the server processes",
        "  (broky master and workers; nats-server) per message, from /proc/<pid>/stat.",
        "",
        "Where the time goes (medians above):",
        "",
    ]
    for case, r in results.items():
        b, n = r["broky"], r["nats"]
        b_total = b["client_cpu_us"] + b["server_cpu_us"]
        n_total = n["client_cpu_us"] + n["server_cpu_us"]
        lines.append(
            f"- {case}: CPU per message, client + server: broky {b['client_cpu_us']:.2f} + "
            f"{b['server_cpu_us']:.2f} = {b_total:.2f} µs; nats "
            f"{n['client_cpu_us']:.2f} + {n['server_cpu_us']:.2f} = {n_total:.2f} µs."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
