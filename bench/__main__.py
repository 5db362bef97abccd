"""`python -m bench`: Broky side by side with nats-server and redis-server.

Starts the three servers on loopback ports of its own, drives each one with
the same load generator (bench/harness/loadgen.py) scenario by scenario —
systems interleaved, so drift on a shared machine hits all of them alike —
then writes bench.md (tables with ratios), bench.json and PNG plots into the
output directory. `--quick` is the CI smoke run (under a minute). A progress
line goes to stderr.

Only a full run (every system, scenario and section, full durations) writes
into bench/results by default, the committed figures the README quotes; any
other run writes into a directory of its own under the system's temporary
directory (printed), unless `--out` names one.

The method is "Benchmark method" in the design notes: peers in the same run,
ratios quoted, server CPU per delivered message from /proc as the steadiest
figure, latency open-loop from the intended send time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import latency, loadgen, machine, options, report, servers
from bench.harness.loadgen import Load

# scenarios also run with Broky's publisher going through the SDK
SDK_SCENARIOS = ("1to1_100", "1to4_16")


@dataclass
class Scenario:
    id: str
    title: str
    load: Load


def scenarios(quick: bool) -> list[Scenario]:
    out = [
        Scenario("1to1_100", "1 → 1, 100 B", Load(1, 1, 100)),
        Scenario("1to4_16", "1 → 4 fan-out, 16 B", Load(1, 4, 16)),
        Scenario("4to1_100", "4 → 1 fan-in, 100 B", Load(4, 1, 100)),
        Scenario(
            "keys256_100", "256 key_partitions, wildcard sub, 100 B", Load(1, 1, 100, keys=256, wildcard=True)
        ),
    ]
    sizes = (16, 16384) if quick else (16, 256, 1024, 4096, 16384)
    for size in sizes:
        out.append(Scenario(f"1to1_{size}", f"1 → 1, {size:,} B", Load(1, 1, size)))
    return out


class Progress:
    """One line on stderr, rewritten in place on a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()

    def show(self, text: str, step: bool = False) -> None:
        if step:
            self.done += 1
        line = f"[{self.done}/{self.total} {time.monotonic() - self.started:5.1f}s] {text}"
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def redis_py_publish(address: tuple[str, int], n: int) -> dict[str, float]:
    """redis-py publishing n 100-byte messages, pipelined 1,000 per round trip (not in sdk_bench)."""
    import redis

    client = redis.Redis(host=address[0], port=address[1])
    try:
        client.ping()
        payload = b"x" * 100
        start = time.perf_counter()
        for first in range(0, n, 1000):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(1000, n - first)):
                pipe.publish("bench.key", payload)
            pipe.execute()
        elapsed = time.perf_counter() - start
    finally:
        client.close()
    return {"rate": n / elapsed, "seconds": elapsed}


def sdk_section(running: dict[str, servers.Server], quick: bool) -> dict[str, Any]:
    """Client-side publish rates: Broky SDK vs nats.py (bench/sdk_bench.py's cases) and redis-py.

    One Python process each, 100-byte messages, publish then flush, against
    the servers of this run; the median of alternating runs.
    """
    try:
        from bench import sdk_bench
    except ImportError as exc:
        return {"skipped": f"bench/sdk_bench.py is not available ({exc})"}
    broky_publish = getattr(sdk_bench, "broky_publish", None)
    nats_publish = getattr(sdk_bench, "nats_publish", None)
    if broky_publish is None or nats_publish is None:
        return {"skipped": "bench/sdk_bench.py has no broky_publish/nats_publish"}
    import statistics

    import uvloop

    n, runs = (20_000, 1) if quick else (200_000, 3)
    clients: dict[str, Callable[[], dict[str, float]]] = {}
    if "broky" in running:
        url = "broky://{}:{}".format(*running["broky"].address)
        clients["broky SDK"] = lambda: uvloop.run(broky_publish(url, n))
    if "nats" in running:
        nurl = "nats://{}:{}".format(*running["nats"].address)
        clients["nats.py"] = lambda: uvloop.run(nats_publish(nurl, n))
    if "redis" in running:
        clients["redis-py (pipelined)"] = partial(redis_py_publish, running["redis"].address, n)
    rates: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for r in range(runs):
            for name in list(clients)[:: 1 if r % 2 == 0 else -1]:
                rates[name].append(clients[name]()["rate"])
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {
        "messages": n,
        "runs": runs,
        "rates": {name: statistics.median(v) for name, v in rates.items()},
    }
    if "broky SDK" in out["rates"] and "nats.py" in out["rates"]:
        out["broky_over_nats_py"] = out["rates"]["broky SDK"] / out["rates"]["nats.py"]
    if "broky SDK" in out["rates"] and "redis-py (pipelined)" in out["rates"]:
        out["broky_over_redis_py"] = out["rates"]["broky SDK"] / out["rates"]["redis-py (pipelined)"]
    return out


def sdk_to_sdk_rows(quick: bool) -> tuple[str, ...]:
    """The ids of bench.sdk_burst.MATRIX run by this mode (quick: two of the four)."""
    from bench import sdk_burst

    ids = tuple(row[0] for row in sdk_burst.MATRIX)
    return ("p256_100", "p1_1024") if quick else ids


def sdk_to_sdk_section(
    args: argparse.Namespace, systems: list[str], quick: bool, progress: Progress
) -> dict[str, Any]:
    """The headline rows: bursts SDK to SDK (bench.sdk_burst.matrix), each on fresh servers."""
    from bench import sdk_burst

    n = args.sdk_messages or (3_000 if quick else 300_000)
    runs = 1 if quick else 3
    wanted = sdk_to_sdk_rows(quick)
    rows = []
    for row_id, title, parts, size in sdk_burst.MATRIX:
        if row_id not in wanted:
            continue
        progress.show(f"SDK to SDK, {title}")
        got = sdk_burst.run(runs, n, args.workers, systems, parts, size)
        summary = sdk_burst.summarize(got)
        rows.append({"id": row_id, "title": title, "partitions": parts, "size": size, "messages": n,
                     "runs": runs, "summary": summary, "results": got})  # fmt: skip
        cpu = summary.get("broky", {}).get("server_cpu_us_per_delivery")
        progress.show(f"SDK to SDK, {title}: Broky {cpu} µs/delivery", step=True)
    return {"messages": n, "runs": runs, "rows": rows}


def _safe(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return call()
    except (loadgen.LoadError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}".strip()[:2000]}


def _full_run(argv: Sequence[str] | None) -> bool:
    """Whether this run is the whole benchmark with its default settings (what bench/results
    holds): no --quick, nothing left out, no duration, rate or size shortened."""
    given = options.given(argv)
    changes = {
        *("--quick", "--only", "--systems", "--warmup", "--duration", "--rate", "--latency-duration"),
        *("--sdk-messages", "--workers", "--no-latency", "--no-sdk", "--no-sdk-to-sdk", "--no-plots"),
    }
    return not any(arg.split("=", 1)[0] in changes for arg in given)


def _scratch(mode: str) -> Path:
    """A new directory for a run whose figures must not replace the committed ones."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"broky-bench-{mode}-"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = options.parser(
        "bench", __doc__, out=None, systems=",".join(report.SYSTEMS), workers=os.cpu_count() or 1, quick=True,
        helps={"quick": "short runs for CI (under a minute)",
               "out": "output directory (default: bench/results for a full run, else a temporary directory)",
               "systems": "comma-separated subset of broky,nats,redis",
               "workers": "Broky workers (default: cores)"},
    )  # fmt: skip
    parser.add_argument("--warmup", type=float, help="seconds before measuring each run")
    parser.add_argument("--duration", type=float, help="measured seconds of each throughput run")
    parser.add_argument("--rate", type=float, default=5000.0, help="latency run publish rate (msgs/s)")
    parser.add_argument("--latency-duration", type=float, help="measured seconds of each latency run")
    parser.add_argument(
        "--only", help="comma-separated scenario ids (e.g. 1to1_100,1to4_16); 'none' skips them"
    )
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--no-sdk", action="store_true", help="skip the client-side SDK comparison")
    parser.add_argument(
        "--no-sdk-to-sdk", action="store_true", help="skip the SDK-to-SDK bursts (bench/sdk_burst.py)"
    )
    parser.add_argument("--sdk-messages", type=int, help="messages per SDK-to-SDK burst (default 300,000)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    quick = args.quick
    warmup = args.warmup if args.warmup is not None else (0.3 if quick else 1.0)
    duration = args.duration if args.duration is not None else (0.6 if quick else 4.0)
    lat_duration = args.latency_duration if args.latency_duration is not None else (1.0 if quick else 10.0)
    systems = options.systems(parser, args.systems, report.SYSTEMS)
    chosen = scenarios(quick)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [s for s in chosen if s.id in wanted]
    if args.out is None:
        args.out = options.RESULTS if _full_run(argv) else _scratch("quick" if quick else "partial")

    # SIGTERM (e.g. a test timeout) unwinds through the finally below: no server outlives us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.datetime.now(datetime.UTC)
    info = machine.machine_info()
    with_sdk = not args.no_sdk and "broky" in systems
    sdk_runs = sum(s.id in SDK_SCENARIOS for s in chosen) if with_sdk else 0
    s2s_rows = 0 if args.no_sdk_to_sdk else len(sdk_to_sdk_rows(quick))
    progress = Progress(
        s2s_rows + len(chosen) * len(systems) + sdk_runs + (0 if args.no_latency else len(systems)) + 1
    )
    running: dict[str, servers.Server] = {}
    drivers: dict[str, loadgen.Driver] = {}
    failed: dict[str, str] = {}
    results: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "command": options.command("bench", argv),
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": info,
        "settings": {
            "broky_workers": args.workers,
            "warmup_s": warmup,
            "duration_s": duration,
            "batch_bytes": loadgen.BATCH_BYTES,
            "window_bytes": loadgen.WINDOW_BYTES,
            "systems": systems,
        },
        "throughput": [],
    }
    try:
        if args.no_sdk_to_sdk:
            results["sdk_to_sdk"] = {"skipped": "--no-sdk-to-sdk"}
        else:  # first, before the shared servers start: each burst runs on a fresh server of its own
            results["sdk_to_sdk"] = sdk_to_sdk_section(args, systems, quick, progress)
        for name in systems:
            progress.show(f"starting {name}")
            try:
                server = servers.start_broky(args.workers) if name == "broky" else servers.STARTERS[name]()
                running[name] = server
                driver = loadgen.DRIVERS[name]()
                driver.prepare(server.address)
                drivers[name] = driver
            except (servers.ServerError, loadgen.LoadError, OSError) as exc:
                failed[name] = f"could not start: {exc}"
        for scen in chosen:
            entry: dict[str, Any] = {
                "id": scen.id,
                "title": scen.title,
                "load": asdict(scen.load),
                "results": {},
            }
            for name in systems:
                progress.show(f"{scen.title}: {name}")
                if name in failed:
                    entry["results"][name] = {"skipped": failed[name]}
                else:
                    server, driver = running[name], drivers[name]
                    run = partial(loadgen.run_throughput, driver, server.address, server.pids, scen.load)
                    entry["results"][name] = _safe(partial(run, warmup, duration))
                res = entry["results"][name]
                progress.show(
                    f"{scen.title}: {name} {report._fmt_rate(res.get('deliveries_per_s'))}/s", step=True
                )
            if scen.id in SDK_SCENARIOS and with_sdk:
                # Broky again, its publisher going through the SDK instead of pre-encoded frames
                progress.show(f"{scen.title}: broky through the SDK")
                if "broky" in failed:
                    res = {"skipped": failed["broky"]}
                else:
                    server = running["broky"]
                    sdk_driver = loadgen.BrokySdkDriver()
                    sdk_driver.prepare(server.address)
                    run = partial(loadgen.run_throughput, sdk_driver, server.address, server.pids)
                    res = _safe(partial(run, scen.load, warmup, duration, loadgen.sdk_publisher_main))
                entry["results"]["broky_sdk"] = res
                progress.show(
                    f"{scen.title}: broky_sdk {report._fmt_rate(res.get('deliveries_per_s'))}/s", step=True
                )
            results["throughput"].append(entry)
        if not args.no_latency:
            lat: dict[str, Any] = {
                "rate_per_s": args.rate,
                "payload": 100,
                "warmup_s": warmup,
                "duration_s": lat_duration,
                "results": {},
            }
            for name in systems:
                progress.show(f"latency at {args.rate:,.0f} msgs/s: {name}")
                if name in failed:
                    lat["results"][name] = {"skipped": failed[name]}
                else:
                    server, driver = running[name], drivers[name]
                    run = partial(latency.run_latency, driver, server.address, server.pids, 100)
                    lat["results"][name] = _safe(partial(run, args.rate, warmup, lat_duration))
                progress.show(f"latency: {name} done", step=True)
            results["latency"] = lat
        progress.show("client-side SDK publish rates")
        if not with_sdk:
            results["sdk"] = {"skipped": "--no-sdk, or Broky not among --systems"}
        else:
            results["sdk"] = sdk_section(running, quick)
        progress.show("SDK done", step=True)
    except KeyboardInterrupt:
        print("\ninterrupted; no results written", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        for server in running.values():
            server.stop()
        progress.end()
    results["elapsed_s"] = round(time.monotonic() - progress.started, 1)
    paths = report.write(results, args.out, plots=not args.no_plots)
    print(report.markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    bad = [
        f"{s['id']}/{n}"
        for s in results["throughput"]
        for n, r in s["results"].items()
        if "error" in r or "skipped" in r
    ] + [
        f"latency/{n}"
        for n, r in results.get("latency", {}).get("results", {}).items()
        if "error" in r or "skipped" in r
    ]
    bad += [
        f"sdk_to_sdk/{row['id']}/{n}"
        for row in results["sdk_to_sdk"].get("rows", [])
        for n, r in row["summary"].items()
        if "error" in r or r.get("errors")
    ]
    if bad:
        print(f"runs that failed or were skipped: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
