"""A burst, SDK to SDK, with default settings: Broky's SDK against nats.py.

    python -m bench.sdk_burst [--messages 300000] [--runs 3] [--workers 2]

The scenario a new user tries: one asyncio publisher process publishes
`--messages` messages of 100 B over 256 key_partitions as fast as it can,
one by one (`await client.publish(b"tenant-%d" % (i & 255), b"cpu.k", ...)`)
then flushes; one asyncio subscriber process reads them with
`async for msg in sub`. Every setting is the default, on both sides: the
server's pending bound, the SDK's subscription queue (nats.py: one
subject, `cpu.k`; its subscriber on `cpu.>`). Reported per system (runs
alternate): messages received of those published, what the subscriber was
told it lost, the publisher's time, the time until the subscriber had the
last message, and the server's CPU per delivered message over the burst.
Results: bench/results/sdk_burst.md and .json, with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import children, procstat, servers  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.report import write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAYLOAD = b"x" * 100
QUIET = 3.0  # seconds without a message after which the subscriber stops counting


async def _broky_sub(address: str, expected: int) -> dict[str, Any]:
    import broky

    told: list[int] = []
    async with broky.connect(address, on_loss=lambda ref, n, reason: told.append(n)) as client:
        sub = await client.subscribe("cpu.>")
        print("ready", flush=True)
        got, last = await _count(sub.__aiter__(), expected)
        return {"received": got, "told_lost": sum(told), "dropped_local": client.stats.dropped_local,
                "pauses": client.stats.pauses, "last_at": last}  # fmt: skip


async def _nats_sub(address: str, expected: int) -> dict[str, Any]:
    import nats

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:  # nats.py reports its slow-consumer drops here
        errors.append(type(exc).__name__)

    nc = await nats.connect(f"nats://{address}", error_cb=on_error)
    sub = await nc.subscribe("cpu.>")
    await nc.flush()
    print("ready", flush=True)
    got, last = await _count(sub.messages.__aiter__(), expected)
    await nc.close()
    return {"received": got, "errors_reported": len(errors), "last_at": last}


async def _count(it: Any, expected: int) -> tuple[int, float]:
    got, last = 0, time.time()
    while got < expected:
        try:
            await asyncio.wait_for(it.__anext__(), QUIET if got else 60)
        except (TimeoutError, StopAsyncIteration):
            break
        got += 1
        last = time.time()
    return got, last


async def _broky_pub(address: str, n: int) -> dict[str, Any]:
    import broky

    async with broky.connect(address) as client:
        started = time.time()
        for i in range(n):
            await client.publish(b"tenant-%d" % (i & 255), b"cpu.k", PAYLOAD)
        await client.flush()
        return {"published": n, "started_at": started, "seconds": time.time() - started}


async def _nats_pub(address: str, n: int) -> dict[str, Any]:
    import nats

    nc = await nats.connect(f"nats://{address}")
    started = time.time()
    for _ in range(n):
        await nc.publish("cpu.k", PAYLOAD)
    await nc.flush()
    seconds = time.time() - started
    await nc.close()
    return {"published": n, "started_at": started, "seconds": seconds}


ROLES = {("broky", "sub"): _broky_sub, ("broky", "pub"): _broky_pub,
         ("nats", "sub"): _nats_sub, ("nats", "pub"): _nats_pub}  # fmt: skip


def _client(system: str, role: str, address: str, n: int) -> subprocess.Popen[str]:
    argv = ["--role", f"{system}:{role}", "--address", address, "--messages", str(n)]
    return subprocess.Popen(
        [sys.executable, "-m", "bench.sdk_burst", *argv],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def one_run(system: str, n: int, workers: int) -> dict[str, Any]:
    server = servers.start_broky(workers) if system == "broky" else servers.start_nats()
    procs: list[subprocess.Popen[str]] = []
    try:
        address = f"{server.host}:{server.port}"
        sub = _client(system, "sub", address, n)
        procs.append(sub)
        assert sub.stdout is not None
        if sub.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{system}: the subscriber did not start")
        cpu0 = procstat.total_cpu_seconds(server.pids())
        pub = _client(system, "pub", address, n)
        procs.append(pub)
        pub_out, _ = pub.communicate(timeout=600)
        sub_out, _ = sub.communicate(timeout=600)
        cpu = procstat.total_cpu_seconds(server.pids()) - cpu0
        published = children.last_json(pub_out)
        subscribed = children.last_json(sub_out)
    finally:
        children.kill_all(procs)
        server.stop()
    received = subscribed["received"]
    return {
        **published,
        **subscribed,
        "lost": published["published"] - received,
        "delivered_after_s": round(subscribed["last_at"] - published["started_at"], 3),
        "server_cpu_s": round(cpu, 3),  # includes QUIET idle seconds (a few ms for either)
        "server_cpu_us_per_delivery": round(cpu / max(received, 1) * 1e6, 3),
    }


def run(runs: int, n: int, workers: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {"broky": [], "nats": []}
    for r in range(runs):
        for system in ("broky", "nats") if r % 2 == 0 else ("nats", "broky"):
            got = one_run(system, n, workers)
            results[system].append(got)
            print(f"run {r + 1}, {system}: {got}", flush=True)
    return results


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    def med(system: str, key: str) -> float:
        return float(statistics.median(x[key] for x in results[system]))

    lines = [
        "# A burst, SDK to SDK, default settings: Broky SDK vs nats.py",
        "",
        f"Machine: {describe(info)}.",
        "",
        f"Command: `python -m bench.sdk_burst --messages {args.messages} --runs {args.runs} "
        f"--workers {args.workers}`",
        "",
        f"One asyncio publisher process publishes {args.messages:,} messages of 100 B one by one "
        "(Broky: over 256 key_partitions) and flushes; one asyncio subscriber process reads with "
        f"`async for`. Defaults everywhere. Broky with {args.workers} workers. Medians of "
        f"{args.runs} runs, the systems alternating.",
        "",
        "| | Broky SDK | nats.py | Broky / NATS |",
        "|---|---:|---:|---:|",
    ]
    rows: list[tuple[str, Callable[[str], float], str]] = [
        ("received (worst run)", lambda s: min(x["received"] for x in results[s]), "{:,.0f}"),
        ("lost (worst run)", lambda s: max(x["lost"] for x in results[s]), "{:,.0f}"),
        ("publisher: publish + flush (s)", lambda s: med(s, "seconds"), "{:.2f}"),
        ("subscriber had the last message after (s)", lambda s: med(s, "delivered_after_s"), "{:.2f}"),
        ("server CPU per delivered message (µs)", lambda s: med(s, "server_cpu_us_per_delivery"), "{:.2f}"),
    ]
    for name, value, fmt in rows:
        b, n = value("broky"), value("nats")
        ratio = f"{b / n:.2f}x" if n else "-"
        lines.append(f"| {name} | {fmt.format(b)} | {fmt.format(n)} | {ratio} |")
    lines += ["", "Every run:", "", "```"]
    for system, runs in results.items():
        for x in runs:
            lines.append(f"{system}: {json.dumps(x)}")
    lines += ["```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sdk_burst", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        system, role = args.role.split(":")
        import uvloop

        result = uvloop.run(ROLES[(system, role)](args.address, args.messages))
        print(json.dumps(result), flush=True)
        return 0
    info = machine_info()
    results = run(args.runs, args.messages, args.workers)
    write_results(args.out, "sdk_burst", report(results, args, info), info, args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
