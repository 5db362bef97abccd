"""A burst, SDK to SDK, with default settings: Broky's SDK against nats.py and redis-py.

    python -m bench.sdk_burst [--messages 300000] [--runs 3] [--workers 2]
                              [--systems broky,nats,redis] [--partitions 256] [--size 100]

The scenario a new user tries: one asyncio publisher process publishes
`--messages` messages of `--size` bytes over `--partitions` key_partitions
as fast as it can, then flushes; one asyncio subscriber process reads them
with a wildcard subscription and `async for`. Every setting is the default,
on every side: the servers' pending bounds, the clients' queues.

- Broky: `await client.publish(partition, b"cpu.k", payload)` one by one, the
  subscriber on `cpu.>`.
- NATS (nats.py): `await nc.publish(subject, payload)` one by one, where the
  subject carries the partition as NATS users do (`cpu.k` for one,
  `cpu.k.tenant-N` for many); the subscriber on `cpu.>`.
- Redis (redis-py's asyncio client with hiredis, the maintained asyncio
  client): PUBLISH to the channel named as for NATS, pipelined 1,000 per round
  trip (one round trip per message would measure the network, not Redis); the
  subscriber on PSUBSCRIBE `cpu.*`.

Reported per system (runs alternate): messages received of those published,
what the subscriber was told it lost, the publisher's time, the time until
the subscriber had the last message, deliveries per second over that time,
the server's CPU per delivered message over the burst, and the server's peak
RSS (every process of it). MATRIX lists the SDK-to-SDK headline rows of
`python -m bench`. Results: bench/results/sdk_burst.md and .json, with the machine.

`one_run(..., check=True)` (tests/test_sdk_burst.py; Broky only) also puts
the key_partition's index and a sequence number per key_partition in the
first 8 bytes of every payload, and the subscriber checks every message it
takes: its key, key_partition and padding, and each key_partition's
sequence (copies, reordering, gaps). Benchmark runs leave it off: the checks
cost the subscriber CPU the peers' subscribers do not spend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import children, procstat, servers  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.report import SDK_TITLES, write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SYSTEMS = ("broky", "nats", "redis")
QUIET = 3.0  # seconds without a message after which the subscriber stops counting
REDIS_PIPELINE = 1000
_head = struct.Struct("<II")  # check mode: key_partition index, sequence number in it


def partitions(system: str, count: int) -> list[Any]:
    """What each system's publisher names the partitions by (precomputed on every side)."""
    if system == "broky":
        return [b"tenant-%d" % i for i in range(count)]
    return ["cpu.k"] if count == 1 else [f"cpu.k.tenant-{i}" for i in range(count)]


# ------------------------------------------------------------ subscribers


async def _broky_sub(
    address: str, expected: int, parts: int = 0, size: int = 0, check: bool = False
) -> dict[str, Any]:
    import broky

    told: list[int] = []
    checked: dict[str, Any] = {}
    async with broky.connect(address, on_loss=lambda ref, n, reason: told.append(n)) as client:
        sub = await client.subscribe("cpu.>")
        print("ready", flush=True)
        it = _checked(sub.__aiter__(), parts, size, checked) if check else sub.__aiter__()
        got, last, error = await _count(it, expected)
        return {"received": got, "told_lost": sum(told), "dropped_local": client.stats.dropped_local,
                "pauses": client.stats.pauses, "duplicates_dropped": client.stats.duplicates_dropped,
                "last_at": last, "error": error, **checked}  # fmt: skip


async def _checked(it: Any, parts: int, size: int, out: dict[str, Any]) -> Any:
    """Check mode: every message of `it`, checked (see the header), then passed on; the
    counts in `out` (per key_partition: the messages taken)."""
    names = partitions("broky", parts)
    pad = b"x" * (size - _head.size)
    nxt = [0] * parts  # the sequence number expected next, per key_partition
    out.update(corrupt=0, duplicates=0, out_of_order=0, gaps=0, per_partition=[0] * parts)
    async for msg in it:
        i, seq = _head.unpack_from(msg.payload)
        if i >= parts or msg.key != b"cpu.k" or msg.key_partition != names[i] or msg.payload[8:] != pad:
            out["corrupt"] += 1
        else:
            out["per_partition"][i] += 1
            if seq < nxt[i]:
                out["duplicates" if seq == nxt[i] - 1 else "out_of_order"] += 1
            else:
                out["gaps"] += seq - nxt[i]
                nxt[i] = seq + 1
        yield msg


async def _nats_sub(address: str, expected: int) -> dict[str, Any]:
    import nats

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:  # nats.py reports its slow-consumer drops here
        errors.append(type(exc).__name__)

    nc = await nats.connect(f"nats://{address}", error_cb=on_error)
    sub = await nc.subscribe("cpu.>")
    await nc.flush()
    print("ready", flush=True)
    got, last, error = await _count(sub.messages.__aiter__(), expected)
    await nc.close()
    return {"received": got, "errors_reported": len(errors), "last_at": last, "error": error}


async def _redis_sub(address: str, expected: int) -> dict[str, Any]:
    import redis.asyncio as redis

    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port))
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.psubscribe("cpu.*")
    print("ready", flush=True)

    async def messages() -> Any:
        async for m in pubsub.listen():
            if m is not None and m["type"] == "pmessage":
                yield m

    got, last, error = await _count(messages().__aiter__(), expected)
    try:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()
    except Exception:  # the server cut the connection (its output buffer limit): counted as error
        pass
    return {"received": got, "last_at": last, "error": error}


async def _count(it: Any, expected: int) -> tuple[int, float, str | None]:
    """Messages taken from `it` until `expected`, QUIET seconds of silence or an error."""
    got, last = 0, time.time()
    while got < expected:
        try:
            await asyncio.wait_for(it.__anext__(), QUIET if got else 60)
        except (TimeoutError, StopAsyncIteration):
            break
        except Exception as exc:  # the connection was closed under the subscriber
            return got, last, f"{type(exc).__name__}: {exc}"[:200]
        got += 1
        last = time.time()
    return got, last, None


# ------------------------------------------------------------ publishers


async def _broky_pub(address: str, n: int, parts: int, size: int, check: bool = False) -> dict[str, Any]:
    import broky

    names = partitions("broky", parts)
    payload = b"x" * size
    pad = payload[_head.size :]
    async with broky.connect(address) as client:
        started = time.time()
        if check:  # round robin: message i is number i // parts of key_partition i % parts
            for i in range(n):
                await client.publish(names[i % parts], b"cpu.k", _head.pack(i % parts, i // parts) + pad)
        else:
            for i in range(n):
                await client.publish(names[i % parts], b"cpu.k", payload)
        await client.flush()
        return {"published": n, "started_at": started, "seconds": time.time() - started}


async def _nats_pub(address: str, n: int, parts: int, size: int) -> dict[str, Any]:
    import nats

    names = partitions("nats", parts)
    payload = b"x" * size
    nc = await nats.connect(f"nats://{address}")
    started = time.time()
    for i in range(n):
        await nc.publish(names[i % parts], payload)
    await nc.flush()
    seconds = time.time() - started
    await nc.close()
    return {"published": n, "started_at": started, "seconds": seconds}


async def _redis_pub(address: str, n: int, parts: int, size: int) -> dict[str, Any]:
    import redis.asyncio as redis

    names = partitions("redis", parts)
    payload = b"x" * size
    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port))
    await client.ping()
    started = time.time()
    for first in range(0, n, REDIS_PIPELINE):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + REDIS_PIPELINE, n)):
            pipe.publish(names[i % parts], payload)
        await pipe.execute()
    seconds = time.time() - started
    await client.aclose()
    return {"published": n, "started_at": started, "seconds": seconds}


SUBSCRIBERS: dict[str, Callable[[str, int], Any]] = {
    "broky": _broky_sub, "nats": _nats_sub, "redis": _redis_sub,
}  # fmt: skip
PUBLISHERS: dict[str, Callable[[str, int, int, int], Any]] = {
    "broky": _broky_pub, "nats": _nats_pub, "redis": _redis_pub,
}  # fmt: skip


# ------------------------------------------------------------ runs


def _client(
    role: str, system: str, address: str, n: int, parts: int, size: int, check: bool = False
) -> subprocess.Popen[str]:
    argv = ["--role", f"{system}:{role}", "--address", address, "--messages", str(n),
            "--partitions", str(parts), "--size", str(size), *(["--check"] if check else [])]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "bench.sdk_burst", *argv], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def _start(system: str, workers: int) -> servers.Server:
    if system == "broky":
        return servers.start_broky(workers)
    return servers.STARTERS[system]()


def one_run(
    system: str, n: int, workers: int, parts: int = 256, size: int = 100, check: bool = False
) -> dict[str, Any]:
    """One burst of `n` messages through `system`'s server and clients, on a fresh server
    (check: every message checked, see the header; Broky only)."""
    if check and (system != "broky" or size < _head.size):
        raise ValueError(f"check mode is for Broky and payloads of {_head.size} B or more")
    server = _start(system, workers)
    procs: list[subprocess.Popen[str]] = []
    try:
        address = f"{server.host}:{server.port}"
        sub = _client("sub", system, address, n, parts, size, check)
        procs.append(sub)
        assert sub.stdout is not None
        if sub.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{system}: the subscriber did not start")
        pids = server.pids()
        for pid in pids:
            procstat.reset_peak_rss(pid)
        cpu0 = procstat.total_cpu_seconds(pids)
        pub = _client("pub", system, address, n, parts, size, check)
        procs.append(pub)
        pub_out, _ = pub.communicate(timeout=600)
        sub_out, _ = sub.communicate(timeout=600)
        pids = server.pids()
        cpu = procstat.total_cpu_seconds(pids) - cpu0
        peak = sum(procstat.peak_rss_bytes(pid) for pid in pids)
        published = children.last_json(pub_out)
        subscribed = children.last_json(sub_out)
    finally:
        children.kill_all(procs)
        server.stop()
    received = subscribed["received"]
    after = subscribed["last_at"] - published["started_at"]
    return {
        **published,
        **subscribed,
        "lost": published["published"] - received,
        "delivered_after_s": round(after, 3),
        "deliveries_per_s": round(received / after) if after > 0 else None,
        "server_cpu_s": round(cpu, 3),  # includes QUIET idle seconds (a few ms for any of them)
        "server_cpu_us_per_delivery": round(cpu / max(received, 1) * 1e6, 3),
        "server_peak_rss_mb": round(peak / 1e6, 1),
    }


def run(
    runs: int, n: int, workers: int, systems: Sequence[str] = SYSTEMS, parts: int = 256, size: int = 100,
    on_run: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """`runs` bursts per system, the systems in turn (their order reversed every other run)."""
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(runs):
        for system in systems if r % 2 == 0 else tuple(reversed(systems)):
            try:
                got = one_run(system, n, workers, parts, size)
            except (servers.ServerError, RuntimeError, OSError, ValueError) as exc:
                got = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            results[system].append(got)
            if on_run is not None:
                on_run(system, r, got)
    return results


# (id, title, key_partitions, payload bytes) of the headline rows of `python -m bench`
MATRIX = (
    ("p1_100", "1 key_partition, 100 B", 1, 100),
    ("p256_100", "256 key_partitions, 100 B", 256, 100),
    ("p1_1024", "1 key_partition, 1 KiB", 1, 1024),
    ("p256_1024", "256 key_partitions, 1 KiB", 256, 1024),
)


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system: medians over its runs, the worst loss and the errors, if any."""
    out: dict[str, dict[str, Any]] = {}
    for system, runs in results.items():
        ok = [x for x in runs if "published" in x]
        errors = [x["error"] for x in runs if x.get("error")]
        if not ok:
            out[system] = {"error": errors[0] if errors else "no run"}
            continue

        def med(key: str, ok: list[dict[str, Any]] = ok) -> float:
            return float(statistics.median(x[key] for x in ok if x.get(key) is not None))

        out[system] = {
            "received_worst": min(x["received"] for x in ok),
            "lost_worst": max(x["lost"] for x in ok),
            # what the subscriber lost and was not told of (Broky's on_loss; None for the others)
            "untold_worst": max(x["lost"] - x["told_lost"] for x in ok) if "told_lost" in ok[0] else None,
            "published": ok[0]["published"],
            "publish_s": med("seconds"),
            "delivered_after_s": med("delivered_after_s"),
            "deliveries_per_s": med("deliveries_per_s"),
            "server_cpu_us_per_delivery": med("server_cpu_us_per_delivery"),
            "server_peak_rss_mb": med("server_peak_rss_mb"),
            "errors": errors,
        }
    return out


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    summary = summarize(results)
    systems = list(results)
    peers = [s for s in systems if s != "broky"]
    lines = [
        "# A burst, SDK to SDK, default settings: " + " vs ".join(SDK_TITLES[s] for s in systems),
        "",
        f"Machine: {describe(info)}.",
        "",
        f"Command: `python -m bench.sdk_burst --messages {args.messages} --runs {args.runs} "
        f"--workers {args.workers} --systems {','.join(systems)} --partitions {args.partitions} "
        f"--size {args.size}`",
        "",
        f"One asyncio publisher process publishes {args.messages:,} messages of {args.size:,} B over "
        f"{args.partitions} key_partition(s) and flushes (redis-py: pipelined {REDIS_PIPELINE:,} per "
        "round trip); one asyncio subscriber process reads with a wildcard subscription and `async for`. "
        f"Defaults everywhere. Broky with {args.workers} workers. Medians of {args.runs} runs, the "
        "systems alternating.",
        "",
        "| | "
        + " | ".join(SDK_TITLES[s] for s in systems)
        + "".join(f" | Broky / {SDK_TITLES[p]}" for p in peers)
        + " |",
        "|---|" + "---:|" * (len(systems) + len(peers)),
    ]
    rows: list[tuple[str, str, str]] = [
        ("received (worst run)", "received_worst", "{:,.0f}"),
        ("lost (worst run)", "lost_worst", "{:,.0f}"),
        ("publisher: publish + flush (s)", "publish_s", "{:.2f}"),
        ("subscriber had the last message after (s)", "delivered_after_s", "{:.2f}"),
        ("deliveries per second", "deliveries_per_s", "{:,.0f}"),
        ("server CPU per delivered message (µs)", "server_cpu_us_per_delivery", "{:.2f}"),
        ("server peak RSS (MB)", "server_peak_rss_mb", "{:.1f}"),
    ]
    for name, key, fmt in rows:
        values = {s: summary[s].get(key) for s in systems}
        cells = [fmt.format(values[s]) if values[s] is not None else "-" for s in systems]
        ratios = []
        for p in peers:
            b, n = values.get("broky"), values.get(p)
            ratios.append(f"{b / n:.2f}x" if b is not None and n and key not in ("lost_worst",) else "-")
        lines.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
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
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated subset of broky,nats,redis"
    )
    parser.add_argument("--partitions", type=int, default=256, help="key_partitions (NATS, Redis: subjects)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        system, role = args.role.split(":")
        import uvloop

        if args.check:  # Broky only (one_run says so)
            if role == "sub":
                result = uvloop.run(_broky_sub(args.address, args.messages, args.partitions, args.size, True))
            else:
                result = uvloop.run(_broky_pub(args.address, args.messages, args.partitions, args.size, True))
        elif role == "sub":
            result = uvloop.run(SUBSCRIBERS[system](args.address, args.messages))
        else:
            result = uvloop.run(PUBLISHERS[system](args.address, args.messages, args.partitions, args.size))
        print(json.dumps(result), flush=True)
        return 0
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems in {args.systems!r}")
    info = machine_info()

    def show(system: str, r: int, got: dict[str, Any]) -> None:
        print(f"run {r + 1}, {system}: {got}", flush=True)

    results = run(args.runs, args.messages, args.workers, systems, args.partitions, args.size, show)
    write_results(args.out, "sdk_burst", report(results, args, info), info, args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
