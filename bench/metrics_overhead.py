"""What do metrics cost? Throughput with /metrics scraped every second versus none.

`python -m bench.metrics_overhead` starts one `broky serve` and drives it with
the harness's raw load generator (bench/harness/loadgen.py: pre-encoded
publishes, counting subscribers, closed loop), alternating runs without any
scrape ("off") and runs during which a thread GETs /metrics every second
("on", like Prometheus with scrape_interval 1s). Same server, same load, runs
interleaved off/on/off/on... so drift on the shared machine hits both alike.
It reports the median deliveries/s and server CPU per delivery of each side
and their difference; the target is under 3 % throughput difference, either
way. The verdict is read against the noise, the spread (max - min) / median
of the runs of one side: "met" only when |difference| + noise stays under
3 %, "not met" only when |difference| - noise is 3 % or more, and otherwise
"not demonstrated": when the noise alone exceeds 3 %, as it does on a busy
shared machine, "met" cannot be shown, nor can anything with a single run
per side (no noise estimate). The steadier figure is the server CPU one
scrape costs, measured on the idle server, as a share of the CPU the server
spends per second under the load.

Writes metrics_overhead.md and metrics_overhead.json into --out (default
bench/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness import loadgen, machine, procstat, servers
from bench.harness.loadgen import Load

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_PERCENT = 3.0


class Scraper(threading.Thread):
    """GET /metrics every `interval` seconds until stopped; counts scrapes and their time."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.interval = interval
        self.stopping = threading.Event()
        self.scrapes = 0
        self.failures = 0
        self.seconds: list[float] = []
        self.body_bytes = 0

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    self.body_bytes = len(resp.read())
                self.scrapes += 1
                self.seconds.append(time.monotonic() - t0)
            except OSError:
                self.failures += 1
            next_at += self.interval
            self.stopping.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    mport = servers.free_port()
    server = servers.start_broky(args.workers, ["--metrics-port", str(mport)])
    url = f"http://{servers.HOST}:{mport}/metrics"
    load = Load(args.publishers, args.subscribers, args.payload)
    runs: list[dict[str, Any]] = []
    try:
        driver = loadgen.BrokyDriver()
        driver.prepare(server.address)
        for r in range(args.rounds):
            for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
                scraper = Scraper(url, args.interval) if side == "on" else None
                if scraper is not None:
                    scraper.start()
                try:
                    res = loadgen.run_throughput(
                        driver, server.address, server.pids, load, args.warmup, args.duration
                    )
                finally:
                    if scraper is not None:
                        scraper.stop()
                res["side"] = side
                res["round"] = r
                if scraper is not None:
                    res["scrapes"] = scraper.scrapes
                    res["scrape_failures"] = scraper.failures
                    res["scrape_median_ms"] = (
                        statistics.median(scraper.seconds) * 1e3 if scraper.seconds else None
                    )
                    res["metrics_body_bytes"] = scraper.body_bytes
                runs.append(res)
                print(
                    f"round {r} {side:>3}: {res['deliveries_per_s']:,.0f} deliveries/s, "
                    f"{res['server_cpu_us_per_delivery']:.2f} us server CPU/delivery"
                    + (f", {res['scrapes']} scrapes" if side == "on" else ""),
                    file=sys.stderr,
                    flush=True,
                )
        scrape_cpu_ms = scrape_cost(url, server.pids(), SCRAPES_FOR_COST)
    finally:
        server.stop()
    result = summarize(args, load, runs)
    # What one scrape costs the server, measured on the idle server (CPU time is
    # far steadier than throughput on a shared machine), and that cost at the
    # scrape interval as a share of the CPU the server spent per second under load.
    busy_cpu_per_s = statistics.median(
        r["deliveries_per_s"] * r["server_cpu_us_per_delivery"] / 1e6 for r in runs
    )
    result["scrape_cpu_ms"] = scrape_cpu_ms
    result["scrape_share_percent"] = scrape_cpu_ms / 1e3 / args.interval / busy_cpu_per_s * 100
    return result


SCRAPES_FOR_COST = 200
VERDICTS = {
    "met": "|difference| + noise is under the target",
    "not met": "|difference| - noise reaches the target",
    "not demonstrated": "the noise, or too few runs to know it, leaves the answer open",
}


def scrape_cost(url: str, pids: list[int], count: int) -> float:
    """Server CPU milliseconds per /metrics scrape, over `count` back-to-back scrapes."""
    before = procstat.total_cpu_seconds(pids)
    for _ in range(count):
        with urllib.request.urlopen(url, timeout=5) as resp:
            resp.read()
    return (procstat.total_cpu_seconds(pids) - before) / count * 1e3


def summarize(args: argparse.Namespace, load: Load, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(side: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs if r["side"] == side and r[key] is not None))

    off, on = med("off", "deliveries_per_s"), med("on", "deliveries_per_s")
    cpu_off, cpu_on = med("off", "server_cpu_us_per_delivery"), med("on", "server_cpu_us_per_delivery")
    diff = (off - on) / off * 100

    def spread(side: str) -> float:
        rates = [float(r["deliveries_per_s"]) for r in runs if r["side"] == side]
        return (max(rates) - min(rates)) / statistics.median(rates) * 100

    spreads = {"off": spread("off"), "on": spread("on")}
    counts = [sum(1 for r in runs if r["side"] == side) for side in ("off", "on")]
    noise = max(spreads.values()) if min(counts) >= 2 else None  # one run has no spread to read
    return {
        "machine": machine.machine_info(),
        "command": " ".join(["python -m bench.metrics_overhead", *sys.argv[1:]]),
        "load": vars(load),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
        "median_deliveries_per_s": {"off": off, "on": on},
        "median_server_cpu_us_per_delivery": {"off": cpu_off, "on": cpu_on},
        "throughput_difference_percent": diff,
        "target_percent": TARGET_PERCENT,
        "spread_percent": spreads,
        "noise_percent": noise,
        "verdict": verdict(diff, noise, TARGET_PERCENT) if noise is not None else "not demonstrated",
        "errors": sum(r["errors"] for r in runs),
        "not_delivered": sum(r["not_delivered"] for r in runs),
    }


def verdict(diff: float, noise: float, target: float) -> str:
    """The verdict ("met", "not met" or "not demonstrated") of |diff| against the noise, in percent.

    Two-sided: scraping may not make throughput differ by `target` either way
    (a speed-up that large would be drift, not a benefit of scraping).
    """
    if abs(diff) + noise < target:
        return "met"
    if abs(diff) - noise >= target:
        return "not met"
    return "not demonstrated"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    st = res["settings"]
    lines = [
        "# Metrics overhead: /metrics scraped every second vs none",
        "",
        f"Machine: {machine.describe(m)}; load average at start {m['load_average_at_start']}.",
        f"Command: `{res['command']}`",
        "",
        f"Load: {res['load']['publishers']} publisher -> {res['load']['subscribers']} subscriber(s), "
        f"{res['load']['payload']} B payloads, {st['workers']} workers, "
        f"{st['rounds']} rounds of off/on runs ({st['warmup']:g} s warm-up + "
        f"{st['duration']:g} s measured each), scrape interval {st['interval']:g} s.",
        "",
        "| run | round | deliveries/s | server CPU µs/delivery | scrapes | median scrape ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        scrape_ms = r.get("scrape_median_ms")
        lines.append(
            f"| {r['side']} | {r['round']} | {r['deliveries_per_s']:,.0f} | "
            f"{r['server_cpu_us_per_delivery']:.3f} | {r.get('scrapes', '-')} | "
            f"{f'{scrape_ms:.1f}' if scrape_ms is not None else '-'} |"
        )
    d, c = res["median_deliveries_per_s"], res["median_server_cpu_us_per_delivery"]
    lines += [
        "",
        f"Median deliveries/s: off {d['off']:,.0f}, on {d['on']:,.0f}: "
        f"**{res['throughput_difference_percent']:+.2f} %** with scraping.",
        f"Median server CPU per delivery: off {c['off']:.3f} µs, on {c['on']:.3f} µs.",
        f"Noise, the spread (max - min) / median of the runs of one side: off "
        f"{res['spread_percent']['off']:.1f} %, on {res['spread_percent']['on']:.1f} %"
        + ("." if res["noise_percent"] is not None else " (one run per side: no noise estimate)."),
        f"Target: throughput differs by under {res['target_percent']:g} % either way. "
        f"Verdict: **{res['verdict']}** ({VERDICTS[res['verdict']]}).",
        f"Errors: {res['errors']}; messages not delivered: {res['not_delivered']}.",
        "",
        f"One scrape costs the server {res['scrape_cpu_ms']:.2f} ms of CPU (master and workers, "
        f"{SCRAPES_FOR_COST} back-to-back scrapes of the idle server); at one scrape every "
        f"{st['interval']:g} s that is **{res['scrape_share_percent']:.2f} %** of the CPU the server "
        "spent per second under this load: the most scraping can take from a CPU-bound server.",
        "",
        "A positive difference means slower with scraping. Runs alternate off/on and on/off",
        "so that drift on the shared 2-core machine hits both sides alike; the spread",
        "between runs of the same side is the noise floor to read the difference against,",
        "and the scrape cost above is the figure that does not depend on it.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.metrics_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="off/on pairs (default %(default)s)")
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per run")
    p.add_argument("--interval", type=float, default=1.0, help="scrape interval in seconds")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--publishers", type=int, default=1)
    p.add_argument("--subscribers", type=int, default=1)
    p.add_argument("--payload", type=int, default=100)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    res = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics_overhead.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "metrics_overhead.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
