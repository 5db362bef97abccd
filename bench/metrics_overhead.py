"""What do metrics cost? Throughput with /metrics scraped every second versus none.

`python -m bench.metrics_overhead` starts one `broky serve` and drives it with
the harness's raw load generator (bench/harness/loadgen.py: pre-encoded
publishes, counting subscribers, closed loop) in ONE long run, cut into
windows of a few seconds that alternate scraping on ("on": a thread GETs
/metrics every second, like Prometheus with scrape_interval 1s) and off. The
windows come in pairs (on/off, then off/on, ...) and each pair gives one
difference of throughput, (off - on) / off. Separate runs on this shared
2-core machine differ by 15-70 % from one to the next; neighbouring windows of
one run share the load, the connections and the scheduler's mood, so their
differences are far steadier, and many pairs give a mean with a standard
error.

The target is under 3 % throughput difference, either way. A window now and
then is hit by a scheduling stall of the VM (a pair can differ by 20 % either
way), so the verdict reads the median of the paired differences and its
distribution-free 95 % confidence interval (order statistics of the sign
test), which such outliers do not drag: "met" when the interval lies inside
(-3 %, +3 %), "not met" when it lies wholly beyond 3 % on one side, otherwise
(or with too few pairs for an interval) "not demonstrated". The mean and its
standard error are reported too.
The figure that needs no statistics is also reported: the server CPU one
scrape costs, measured on the idle server, as a share of the CPU the server
spends per second under the load.

Writes metrics_overhead.md and metrics_overhead.json into --out (default
bench/results).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

from bench.harness import loadgen, machine, options, procstat, servers
from bench.harness.loadgen import Load
from bench.harness.report import table, write_results

TARGET_PERCENT = 3.0
SCRAPES_FOR_COST = 200


class Scraper(threading.Thread):
    """GET /metrics every `interval` seconds while `active` is set; counts scrapes and their time."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.interval = interval
        self.active = threading.Event()
        self.stopping = threading.Event()
        self.scrapes = 0
        self.failures = 0
        self.seconds: list[float] = []

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.active.wait(0.05):
                continue
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    resp.read()
                self.scrapes += 1
                self.seconds.append(time.monotonic() - t0)
            except OSError:
                self.failures += 1
            # the next scrape one interval after this one started, unless scraping stops
            deadline = t0 + self.interval
            while self.active.is_set() and not self.stopping.is_set() and time.monotonic() < deadline:
                self.stopping.wait(min(0.01, max(0.0, deadline - time.monotonic())))

    def switch(self, on: bool) -> None:
        if on:
            self.active.set()
        else:
            self.active.clear()

    def stop(self) -> None:
        self.active.clear()
        self.stopping.set()
        self.join(10)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    server = servers.start_broky(args.workers)
    url = f"http://{server.host}:{server.metrics_port}/metrics"
    load = Load(args.publishers, args.subscribers, args.payload)
    try:
        driver = loadgen.BrokyDriver()
        driver.prepare(server.address)
        windows, run = run_windows(driver, server, load, url, args)
        scrape_cpu_ms = scrape_cost(url, server.pids(), SCRAPES_FOR_COST)
    finally:
        server.stop()
    result = summarize(args, load, windows, run)
    # What one scrape costs the server, measured on the idle server (CPU time is
    # far steadier than throughput on a shared machine), and that cost at the
    # scrape interval as a share of the CPU the server spent per second under load.
    busy_cpu_per_s = statistics.median(
        w["deliveries_per_s"] * w["server_cpu_us_per_delivery"] / 1e6 for w in windows
    )
    result["scrape_cpu_ms"] = scrape_cpu_ms
    result["scrape_share_percent"] = scrape_cpu_ms / 1e3 / args.interval / busy_cpu_per_s * 100
    return result


def run_windows(
    driver: loadgen.Driver, server: servers.Server, load: Load, url: str, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One closed-loop run cut into `args.pairs` pairs of windows, scraping on in one of each pair."""
    shared = loadgen.Shared.create(load)
    gen = loadgen.start_generator(
        loadgen.subscriber_main, loadgen.publisher_main, (driver, server.address, load, shared)
    )
    scraper = Scraper(url, args.interval)
    scraper.start()
    windows: list[dict[str, Any]] = []
    try:
        shared.phase.value = loadgen.RUN
        time.sleep(args.warmup)
        for pair in range(args.pairs):
            for side in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                scraper.switch(side == "on")
                pids = server.pids()
                scrapes0 = scraper.scrapes
                d0, t0, c0 = sum(shared.delivered), time.monotonic(), procstat.total_cpu_seconds(pids)
                time.sleep(args.window)
                d1, t1, c1 = sum(shared.delivered), time.monotonic(), procstat.total_cpu_seconds(pids)
                delivered = d1 - d0
                windows.append(
                    {
                        "pair": pair,
                        "side": side,
                        "deliveries_per_s": delivered / (t1 - t0),
                        "server_cpu_us_per_delivery": (c1 - c0) * 1e6 / delivered if delivered else None,
                        "scrapes": scraper.scrapes - scrapes0,
                    }
                )
            on, off = (
                (w for w in windows[-2:] if w["side"] == "on"),
                (w for w in windows[-2:] if w["side"] == "off"),
            )
            a, b = next(off)["deliveries_per_s"], next(on)["deliveries_per_s"]
            print(
                f"pair {pair}: off {a:,.0f}, on {b:,.0f} deliveries/s ({(a - b) / a * 100:+.2f} %)",
                file=sys.stderr,
                flush=True,
            )
        scraper.switch(False)
        shared.phase.value = loadgen.STOP
        pub = gen.expect(1, 15)
        sub = gen.expect(0, 15)
    except BaseException:
        loadgen.kill_generator(gen)
        raise
    finally:
        scraper.stop()
    gen.stop()
    run = {
        "published": pub["sent"],
        "delivered": sub["delivered"],
        "not_delivered": max(0, pub["sent"] * load.subscribers - sub["delivered"]),
        "errors": pub["errors"] + sub["errors"],
        "scrapes": scraper.scrapes,
        "scrape_failures": scraper.failures,
        "scrape_median_ms": statistics.median(scraper.seconds) * 1e3 if scraper.seconds else None,
    }
    return windows, run


def scrape_cost(url: str, pids: list[int], count: int) -> float:
    """Server CPU milliseconds per /metrics scrape, over `count` back-to-back scrapes."""
    before = procstat.total_cpu_seconds(pids)
    for _ in range(count):
        with urllib.request.urlopen(url, timeout=5) as resp:
            resp.read()
    return (procstat.total_cpu_seconds(pids) - before) / count * 1e3


def paired_differences(windows: list[dict[str, Any]]) -> list[float]:
    """(off - on) / off in percent, one per pair of windows: positive = slower with scraping."""
    by_pair: dict[int, dict[str, float]] = {}
    for w in windows:
        by_pair.setdefault(w["pair"], {})[w["side"]] = float(w["deliveries_per_s"])
    return [(p["off"] - p["on"]) / p["off"] * 100 for _, p in sorted(by_pair.items()) if len(p) == 2]


def median_interval(diffs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median: the k-th smallest and
    k-th largest values, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2.
    None when n is too small for any such interval (n < 6 at 95 %)."""
    n = len(diffs)
    tail = (1 - level) / 2
    below = 0.0  # P(Binomial(n, 1/2) <= i), accumulated
    k = 0
    for i in range(n):
        below += math.comb(n, i) / 2**n
        if below > tail:
            break
        k = i + 1
    if k == 0:
        return None
    ordered = sorted(diffs)
    return ordered[k - 1], ordered[n - k]


def verdict(low: float, high: float, target: float) -> str:
    """The verdict ("met", "not met" or "not demonstrated") of a confidence interval
    of the difference, in percent. Two-sided: scraping may not make throughput
    differ by `target` either way (a speed-up that large would be drift, not a
    benefit of scraping)."""
    if -target < low and high < target:
        return "met"
    if low >= target or high <= -target:
        return "not met"
    return "not demonstrated"


def summarize(
    args: argparse.Namespace, load: Load, windows: list[dict[str, Any]], run: dict[str, Any]
) -> dict[str, Any]:
    diffs = paired_differences(windows)
    mean = statistics.fmean(diffs) if diffs else 0.0
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) >= 2 else None
    interval = median_interval(diffs)

    def med(side: str, key: str) -> float:
        return float(statistics.median(w[key] for w in windows if w["side"] == side and w[key] is not None))

    return {
        "machine": machine.machine_info(),
        "command": options.command("bench.metrics_overhead", None),
        "load": vars(load),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "windows": windows,
        "run": run,
        "median_deliveries_per_s": {
            "off": med("off", "deliveries_per_s"),
            "on": med("on", "deliveries_per_s"),
        },
        "median_server_cpu_us_per_delivery": {
            "off": med("off", "server_cpu_us_per_delivery"),
            "on": med("on", "server_cpu_us_per_delivery"),
        },
        "paired_differences_percent": diffs,
        "median_difference_percent": statistics.median(diffs) if diffs else 0.0,
        "median_interval_95_percent": interval,
        "mean_difference_percent": mean,
        "standard_error_percent": se,
        "target_percent": TARGET_PERCENT,
        "verdict": verdict(*interval, TARGET_PERCENT) if interval is not None else "not demonstrated",
    }


VERDICTS = {
    "met": "the 95 % interval of the median lies inside the target",
    "not met": "the 95 % interval of the median lies beyond the target",
    "not demonstrated": "the interval straddles the target, or too few pairs give none",
}


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    st = res["settings"]
    run = res["run"]
    diffs = res["paired_differences_percent"]
    se = res["standard_error_percent"]
    lines = [
        "# Metrics overhead: /metrics scraped every second vs none",
        "",
        f"Machine: {machine.describe(m)}; load average at start {m['load_average_at_start']}.",
        f"Command: `{res['command']}`",
        "",
        f"Load: {res['load']['publishers']} publisher -> {res['load']['subscribers']} subscriber(s), "
        f"{res['load']['payload']} B payloads, {st['workers']} workers, closed loop. One run: "
        f"{st['warmup']:g} s warm-up, then {st['pairs']} pairs of {st['window']:g} s windows, "
        f"scraping /metrics every {st['interval']:g} s in one window of each pair "
        "(on/off, then off/on, ...).",
        "",
    ]
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for w in res["windows"]:
        by_pair.setdefault(w["pair"], {})[w["side"]] = w
    rows = []
    for pair, sides in sorted(by_pair.items()):
        if len(sides) != 2:
            continue
        off, on = sides["off"]["deliveries_per_s"], sides["on"]["deliveries_per_s"]
        rows.append(
            (pair, f"{off:,.0f}", f"{on:,.0f}", f"{(off - on) / off * 100:+.2f} %", sides["on"]["scrapes"])
        )
    head = ("pair", "off deliveries/s", "on deliveries/s", "difference", "scrapes in the on window")
    lines += table(head, rows, "rrrrr")
    d, c = res["median_deliveries_per_s"], res["median_server_cpu_us_per_delivery"]
    spread = f"{min(diffs):+.2f} % to {max(diffs):+.2f} %" if diffs else "-"
    lines += [
        "",
        f"Paired difference, (off - on) / off, over {len(diffs)} pairs: median "
        f"**{res['median_difference_percent']:+.2f} %**, "
        + (
            "95 % interval {:+.2f} % to {:+.2f} %".format(*res["median_interval_95_percent"])
            if res["median_interval_95_percent"] is not None
            else "too few pairs for a 95 % interval"
        )
        + f"; mean {res['mean_difference_percent']:+.2f} %"
        + (f", standard error {se:.2f} %" if se is not None else "")
        + f"; range {spread}.",
        f"Target: throughput differs by under {res['target_percent']:g} % either way. "
        f"Verdict: **{res['verdict']}** ({VERDICTS[res['verdict']]}).",
        f"Medians of the windows: off {d['off']:,.0f}, on {d['on']:,.0f} deliveries/s; "
        f"server CPU per delivery off {c['off']:.3f} µs, on {c['on']:.3f} µs.",
        f"Scrapes: {run['scrapes']} (failed {run['scrape_failures']}), median "
        + (f"{run['scrape_median_ms']:.1f} ms" if run["scrape_median_ms"] is not None else "-")
        + f" under load. Errors: {run['errors']}; messages not delivered: {run['not_delivered']}.",
        "",
        f"One scrape costs the server {res['scrape_cpu_ms']:.2f} ms of CPU (master and workers, "
        f"{SCRAPES_FOR_COST} back-to-back scrapes of the idle server); at one scrape every "
        f"{st['interval']:g} s that is **{res['scrape_share_percent']:.2f} %** of the CPU the server "
        "spent per second under this load: the most scraping can take from a CPU-bound server.",
        "",
        "A positive difference means slower with scraping. Separate runs on this shared",
        "machine differ by far more than 3 %; the two windows of a pair are neighbours in",
        "one run, so drift hits both alike, and the order within pairs alternates.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = options.parser("bench.metrics_overhead", __doc__, out=options.RESULTS, workers=2)
    p.add_argument("--pairs", type=int, default=60, help="pairs of on/off windows (default %(default)s)")
    p.add_argument("--window", type=float, default=3.0, help="seconds per window (default %(default)s)")
    p.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds (default %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="scrape interval in seconds")
    p.add_argument("--publishers", type=int, default=1)
    p.add_argument("--subscribers", type=int, default=1)
    p.add_argument("--payload", type=int, default=100)
    args = p.parse_args(argv)
    res = measure(args)
    res["command"] = options.command("bench.metrics_overhead", argv)
    text = markdown(res)
    info = res.pop("machine")
    write_results(args.out, "metrics_overhead", text, info, None, **res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
