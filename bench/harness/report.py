"""Reports: every benchmark's Markdown tables and result files, and `python -m bench`'s own.

Every benchmark program renders its report with `heading` (the title, the
machine and versions: machine.describe, the command) and `table` (a Markdown
table from its head, its rows and each column's alignment), and writes it
with `write_results`: NAME.md (the report) and NAME.json (the machine, the
command's settings and the program's figures) in its output directory, paths
inside the checkout written relative to it (no machine's directories in
committed files).

The rest is `python -m bench`'s report (`write`): bench.md with the ratios
Broky / peer (above 1 is better for Broky in deliveries per second, below 1
is better in CPU per delivery, latency and memory), bench.json and the plots.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.harness.machine import describe


def row(cells: Iterable[Any]) -> str:
    """One line of a Markdown table (an empty cell stays one space wide)."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table(head: Sequence[Any], rows: Iterable[Iterable[Any]], align: str = "") -> list[str]:
    """A Markdown table as lines: `head`, the alignment line (`align`: a letter per column,
    "l" left, "r" right; by default the first column left and the others right), a line
    per row of `rows` (any value, as str() gives it)."""
    align = align or "l" + "r" * (len(head) - 1)
    if len(align) != len(head):
        raise ValueError(f"{len(align)} alignments for {len(head)} columns")
    return [row(head), "|" + "".join("---|" if a == "l" else "---:|" for a in align), *map(row, rows)]


def heading(
    title: str, info: dict[str, Any], command: str | None = None, with_peers: bool = True
) -> list[str]:
    """A report's first lines: its title, the machine and versions, the command that ran it."""
    lines = [f"# {title}", "", f"Machine: {describe(info, with_peers)}.", ""]
    return lines + ([f"Command: `{command}`", ""] if command is not None else [])


SYSTEMS = ("broky", "nats", "redis")
TITLES = {"broky": "Broky", "nats": "NATS", "redis": "Redis", "broky_sdk": "Broky (SDK publisher)"}
COLORS = {"broky": "tab:blue", "nats": "tab:green", "redis": "tab:red"}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f} M"
    if v >= 1e3:
        return f"{v / 1e3:.1f} k"
    return f"{v:.0f}"


def _fmt_num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _get(result: dict[str, Any] | None, name: str) -> float | None:
    if not result or "error" in result or "skipped" in result:
        return None
    value = result.get(name)
    return None if value is None else float(value)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured ratio and whether it is met."""
    out: list[dict[str, Any]] = []
    by_id = {s["id"]: s["results"] for s in results["throughput"]}
    for sid in ("1to1_100", "1to4_16"):
        res = by_id.get(sid)
        if res is None:
            continue
        cpu = ratio(
            _get(res.get("broky"), "server_cpu_us_per_delivery"),
            _get(res.get("redis"), "server_cpu_us_per_delivery"),
        )
        out.append(
            {
                "target": f"server CPU per delivery, {sid}: Broky <= Redis",
                "ratio": cpu,
                "met": None if cpu is None else cpu <= 1.0,
            }
        )
        nats = ratio(
            _get(res.get("broky"), "server_cpu_us_per_delivery"),
            _get(res.get("nats"), "server_cpu_us_per_delivery"),
        )
        out.append(
            {"target": f"server CPU per delivery, {sid}: Broky / NATS (reported)", "ratio": nats, "met": None}
        )
        rate = ratio(_get(res.get("broky"), "deliveries_per_s"), _get(res.get("redis"), "deliveries_per_s"))
        out.append(
            {
                "target": f"deliveries/s, {sid}: Broky >= Redis",
                "ratio": rate,
                "met": None if rate is None else rate >= 1.0,
            }
        )
    s2s = results.get("sdk_to_sdk") or {}
    for row in s2s.get("rows", []):
        summary = row["summary"]
        cpu = ratio(
            _get(summary.get("broky"), "server_cpu_us_per_delivery"),
            _get(summary.get("nats"), "server_cpu_us_per_delivery"),
        )
        out.append(
            {
                "target": f"SDK to SDK, {row['title']}: server CPU per delivered message <= 1.0x "
                "nats-server (1.5x accepted)",
                "ratio": cpu,
                "met": None if cpu is None else cpu <= 1.0,
            }
        )
        lost = _get(summary.get("broky"), "lost_worst")
        if row["size"] <= 100:  # the burst: 300,000 x 100 B fits in the default bounds
            out.append(
                {
                    "target": f"SDK to SDK, {row['title']}: nothing lost in a {row['messages']:,}-message "
                    "burst (Broky, worst run)",
                    "ratio": None,
                    "met": None if lost is None else lost == 0,
                }
            )
        untold = _get(summary.get("broky"), "untold_worst")
        out.append(
            {
                "target": f"SDK to SDK, {row['title']}: every lost message told to the subscriber (Broky)",
                "ratio": None,
                "met": None if untold is None else untold == 0,
            }
        )
    lat = results.get("latency", {}).get("results", {})
    p99 = ratio(_p(lat.get("broky"), "p99"), _p(lat.get("nats"), "p99"))
    out.append(
        {
            "target": "p99 latency at 5,000 msgs/s (100 B): Broky <= 1.5x NATS",
            "ratio": p99,
            "met": None if p99 is None else p99 <= 1.5,
        }
    )
    sdk = results.get("sdk", {})
    sdk_ratio = sdk.get("broky_over_nats_py") if isinstance(sdk, dict) else None
    out.append(
        {
            "target": "SDK publish rate >= 3x nats.py",
            "ratio": sdk_ratio,
            "met": None if sdk_ratio is None else sdk_ratio >= 3.0,
        }
    )
    return out


def _p(result: dict[str, Any] | None, name: str) -> float | None:
    if not result or "percentiles_us" not in result:
        return None
    return float(result["percentiles_us"][name])


def _cell_error(result: dict[str, Any] | None) -> str | None:
    if result is None:
        return "not run"
    if "skipped" in result:
        return "skipped"
    if "error" in result:
        return "failed"
    return None


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"# Broky benchmark ({results['mode']} run, {results['started']})",
        "",
        f"Machine: {describe(m)}. Broky ran with {results['settings']['broky_workers']} workers.",
        f"Load average when the run started: {m['load_average_at_start']}.",
        "",
        "Same load generator for every system (pre-encoded publishes, counting subscribers, "
        "`bench/harness/loadgen.py`), in the same run on the same machine. Throughput runs are "
        f"closed-loop with a bounded in-flight window, {results['settings']['warmup_s']} s warm-up then "
        f"{results['settings']['duration_s']} s measured. Ratios are Broky / peer.",
        "",
        *_sdk_to_sdk(results.get("sdk_to_sdk")),
        "## Deliveries per second (higher is better)",
        "",
    ]
    rows: list[list[Any]] = []
    for s in results["throughput"]:
        r = s["results"]
        cells = [_cell_error(r.get(n)) or _fmt_rate(_get(r.get(n), "deliveries_per_s")) for n in SYSTEMS]
        b = _get(r.get("broky"), "deliveries_per_s")
        to = [_fmt_ratio(ratio(b, _get(r.get(p), "deliveries_per_s"))) for p in ("nats", "redis")]
        rows.append([s["title"], *cells, *to])
    lines += table(("Scenario", "Broky", "NATS", "Redis", "Broky/NATS", "Broky/Redis"), rows)
    lines += [
        "",
        "## Server CPU µs per delivered message (lower is better)",
        "",
        "From `/proc/<pid>/stat` utime+stime of every server process (Broky: master and all workers). "
        "Last column: the load generator's own CPU per delivery (Broky / NATS / Redis runs).",
        "",
    ]
    key = "server_cpu_us_per_delivery"
    rows = []
    for s in results["throughput"]:
        r = s["results"]
        cells = [_cell_error(r.get(n)) or _fmt_num(_get(r.get(n), key)) for n in SYSTEMS]
        gen = " / ".join(_fmt_num(_get(r.get(n), "generator_cpu_us_per_delivery")) for n in SYSTEMS)
        b = _get(r.get("broky"), key)
        to = [_fmt_ratio(ratio(b, _get(r.get(p), key))) for p in ("nats", "redis")]
        rows.append([s["title"], *cells, *to, gen])
    lines += table(
        ("Scenario", "Broky", "NATS", "Redis", "Broky/NATS", "Broky/Redis", "generator B / N / R"), rows
    )
    lines += ["", "## Server peak RSS, MiB (all server processes, peak during the scenario)", ""]
    rows = []
    for s in results["throughput"]:
        r = s["results"]
        cells = []
        for n in SYSTEMS:
            v = _get(r.get(n), "server_peak_rss_bytes")
            cells.append(_cell_error(r.get(n)) or _fmt_num(None if v is None else v / 2**20, 1))
        rows.append([s["title"], *cells])
    lines += table(("Scenario", "Broky", "NATS", "Redis"), rows)
    sdk_rows = [s for s in results["throughput"] if "broky_sdk" in s["results"]]
    if sdk_rows:
        lines += [
            "",
            "## Broky with its publisher going through the SDK",
            "",
            "The same runs with the raw publisher replaced by the asyncio SDK (`await client.publish(...)` "
            "per message, a KSUID and ts_producer each); subscribers stay raw and counting.",
            "",
        ]
        rows = []
        for s in sdk_rows:
            sdk, raw = s["results"]["broky_sdk"], s["results"].get("broky")
            if _cell_error(sdk):
                rows.append([s["title"], _cell_error(sdk), "", "", ""])
                continue
            rate = _get(sdk, "deliveries_per_s")
            rows.append([s["title"], _fmt_rate(rate), _fmt_num(_get(sdk, "server_cpu_us_per_delivery")),
                         _fmt_num(_get(sdk, "generator_cpu_us_per_delivery")),
                         _fmt_ratio(ratio(rate, _get(raw, "deliveries_per_s")))])  # fmt: skip
        head = (
            "Scenario",
            "deliveries/s",
            "server CPU µs/delivery",
            "generator CPU µs/delivery",
            "vs raw publisher",
        )
        lines += table(head, rows)
    lat = results.get("latency")
    if lat:
        lines += [
            "",
            f"## End-to-end latency, µs, open loop at {lat['rate_per_s']:,.0f} msgs/s, "
            f"{lat['payload']} B, 1 → 1",
            "",
            f"{lat['duration_s']} s measured after {lat['warmup_s']} s warm-up; latency from the intended "
            "send time (HdrHistogram), generator delay included and equal for all systems.",
            "",
        ]
        rows = []
        for n in SYSTEMS:
            res = lat["results"].get(n)
            err = _cell_error(res)
            if err or res is None:
                rows.append([TITLES[n], err, "", "", "", "", ""])
                continue
            p = res["percentiles_us"]
            rows.append([TITLES[n], *(f"{p[q]:.0f}" for q in ("p50", "p90", "p99", "p99.9")),
                         f"{res['max_us']:.0f}", res["samples"]])  # fmt: skip
        for peer in ("nats", "redis"):
            cells = [
                _fmt_ratio(ratio(_p(lat["results"].get("broky"), q), _p(lat["results"].get(peer), q)))
                for q in ("p50", "p90", "p99", "p99.9")
            ]
            ours, theirs = lat["results"].get("broky") or {}, lat["results"].get(peer) or {}
            rows.append(
                [
                    f"Broky/{TITLES[peer]}",
                    *cells,
                    _fmt_ratio(ratio(ours.get("max_us"), theirs.get("max_us"))),
                    "",
                ]
            )
        lines += table(("System", "p50", "p90", "p99", "p99.9", "max", "samples"), rows)
    sdk = results.get("sdk") or {}
    lines += ["", "## Client side: SDK publish rate (100 B, one process)", ""]
    if "skipped" in sdk or "error" in sdk:
        lines.append(f"Not measured: {sdk.get('skipped') or sdk.get('error')}")
    else:
        lines += [
            f"{sdk.get('messages', 0):,} messages per run, median of {sdk.get('runs')} alternating runs; "
            "Broky SDK and nats.py cases from `bench/sdk_bench.py` (publish, then flush).",
            "",
        ]
        rates = sdk.get("rates", {})
        rows = [
            [name, _fmt_rate(v), _fmt_ratio(ratio(rates.get("broky SDK"), v))] for name, v in rates.items()
        ]
        lines += table(("Client", "msgs/s", "Broky SDK / this"), rows)
    rows = [
        [t["target"], _fmt_ratio(t["ratio"]), "-" if t["met"] is None else ("yes" if t["met"] else "**no**")]
        for t in results["targets"]
    ]
    lines += ["", "## Targets", "", *table(("Target", "Broky / peer", "Met"), rows, "lrl")]
    runs = [(s["title"], s["results"]) for s in results["throughput"]]
    if lat:
        runs.append(("latency", lat["results"]))
    problems = [
        f"- {title} / {TITLES[n]}: {_problem(res)}"
        for title, by_system in runs
        for n, res in by_system.items()
        if _problem(res)
    ]
    if problems:
        lines += ["", "## Problems seen during the run", "", *problems]
    lines += ["", f"Raw figures: `bench.json`. Reproduce: `{results['command']}`."]
    return "\n".join(lines) + "\n"


SDK_TITLES = {"broky": "Broky SDK", "nats": "nats.py", "redis": "redis-py"}  # the clients of SDK-to-SDK runs


def _sdk_to_sdk(s2s: dict[str, Any] | None) -> list[str]:
    """The headline section: bursts from an SDK publisher process to an SDK subscriber process."""
    if not s2s:
        return []
    if "skipped" in s2s or "error" in s2s:
        return ["## SDK to SDK", "", f"Not measured: {s2s.get('skipped') or s2s.get('error')}", ""]
    rows = s2s["rows"]
    lines = [
        "## SDK to SDK: a burst through the client libraries (the headline)",
        "",
        f"What users run: one asyncio publisher process publishes {s2s['messages']:,} messages as fast as "
        "it can, one call each (redis-py: pipelined 1,000 per round trip), then flushes; one asyncio "
        "subscriber process reads them with a wildcard subscription and `async for`. Broky SDK, nats.py "
        "and redis-py (asyncio, hiredis) on both sides, every setting at its default, a fresh server per "
        f"run; medians of {s2s['runs']} alternating runs (`bench/sdk_burst.py`).",
        "",
    ]
    tables = (
        ("Server CPU µs per delivered message (lower is better)", "server_cpu_us_per_delivery", 2, True),
        (
            "Deliveries per second, first publish to last delivery (higher is better)",
            "deliveries_per_s",
            0,
            True,
        ),
        (
            "Messages lost, worst run (of those published; Broky: how many the subscriber was not told of)",
            "lost_worst",
            0,
            False,
        ),
        ("Server peak RSS, MB (every server process)", "server_peak_rss_mb", 1, True),
    )
    for title, key, digits, with_ratios in tables:
        head = [
            "Scenario",
            *(SDK_TITLES[n] for n in SYSTEMS),
            *(("Broky/NATS", "Broky/Redis") if with_ratios else ()),
        ]
        cells_of_rows = []
        for row in rows:
            summary = row["summary"]
            cells = []
            for n in SYSTEMS:
                res = summary.get(n)
                v = _get(res, key)
                cell = _cell_error(res) or (f"{v:,.{digits}f}" if v is not None else "-")
                untold = _get(res, "untold_worst") if key == "lost_worst" else None
                cells.append(cell if untold is None else f"{cell} (untold: {untold:,.0f})")
            if with_ratios:
                b = _get(summary.get("broky"), key)
                cells += [_fmt_ratio(ratio(b, _get(summary.get(p), key))) for p in ("nats", "redis")]
            cells_of_rows.append([row["title"], *cells])
        lines += [f"### {title}", "", *table(head, cells_of_rows), ""]
    return lines


def _problem(res: dict[str, Any]) -> str:
    """What went wrong in one run, or "" if nothing did."""
    if "error" in res or "skipped" in res:
        return str(res.get("error") or res.get("skipped"))
    parts = []
    if res.get("not_delivered"):
        parts.append(f"{res['not_delivered']} deliveries missing ({res.get('published')} published)")
    if res.get("server_reported_lost"):
        parts.append(f"the server reported {res['server_reported_lost']} lost")
    if res.get("errors"):
        parts.append(f"{res['errors']} errors: {res.get('notes')}")
    return "; ".join(parts)


def _footer(fig: Any, results: dict[str, Any]) -> None:
    fig.text(0.01, 0.005, describe(results["machine"]), fontsize=6.5, color="0.35", ha="left", va="bottom")


def percentile_axes(ax: Any, top: float) -> None:
    """Log axes for a percentile plot whose x values are 1 / (1 - p), ticked in percentiles
    up to `top` (HdrHistogram's percentile distribution plot)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [2.0, 10.0, 100.0, 1e3, 1e4, 1e5]
    labels = ["50%", "90%", "99%", "99.9%", "99.99%", "99.999%"]
    keep = [i for i, t in enumerate(ticks) if t <= top * 1.01]
    ax.xaxis.set_major_locator(FixedLocator([ticks[i] for i in keep]))
    ax.xaxis.set_major_formatter(FixedFormatter([labels[i] for i in keep]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("percentile")


def plot_latency(results: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    lat = results["latency"]
    fig, ax = plt.subplots(figsize=(8, 5))
    top = 10.0
    for n in SYSTEMS:
        res = lat["results"].get(n)
        if not res or "distribution" not in res:
            continue
        xs, ys = [], []
        for p, v in res["distribution"]:
            if p >= 100:
                continue
            xs.append(1 / (1 - p / 100))
            ys.append(max(v, 0.001))
        top = max(top, xs[-1])
        ax.plot(xs, ys, marker=".", color=COLORS[n], label=f"{TITLES[n]} (max {res['max_us']:.0f} µs)")
    percentile_axes(ax, top)
    ax.set_ylabel("end-to-end latency (µs, log)")
    ax.set_title(
        f"Latency at {lat['rate_per_s']:,} msgs/s, {lat['payload']} B, open loop ({results['mode']} run)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _footer(fig, results)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_axis(values: list[float]) -> bool:
    """A log axis only where the bars span more than a decade: within one, a log axis makes a
    2.6x gap look like 10x (and labels ticks 3x10^-1)."""
    return bool(values) and max(values) > 10 * min(values)


def _bars(
    results: dict[str, Any],
    path: Path,
    key: str,
    ylabel: str,
    title: str,
    scen: list[dict[str, Any]] | None = None,
) -> None:
    """Bars of `key` per scenario (default: the pre-encoded runs; each {"title", "results"})."""
    import matplotlib.pyplot as plt

    scen = results["throughput"] if scen is None else scen
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(scen)), 5))
    width = 0.26
    values = []
    for i, n in enumerate(SYSTEMS):
        xs, ys = [], []
        for j, s in enumerate(scen):
            v = _get(s["results"].get(n), key)
            if v is not None and v > 0:
                xs.append(j + (i - 1) * width)
                ys.append(v)
        values += ys
        ax.bar(xs, ys, width, color=COLORS[n], label=TITLES[n])
    if log_axis(values):
        ax.set_yscale("log")
        ylabel += " (log)"
    ax.set_xticks(range(len(scen)))
    ax.set_xticklabels([s["title"].replace(", ", "\n", 1) for s in scen], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} ({results['mode']} run)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    _footer(fig, results)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """Write bench.json, bench.md and the PNGs into out; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=_json_default, allow_nan=False) + "\n")
    paths[1].write_text(markdown(results))
    if plots:
        if results.get("latency"):
            plot_latency(results, out / "latency.png")
            paths.append(out / "latency.png")
        _bars(
            results,
            out / "throughput.png",
            "deliveries_per_s",
            "deliveries per second",
            "Deliveries per second per scenario",
        )
        _bars(
            results,
            out / "cpu.png",
            "server_cpu_us_per_delivery",
            "server CPU µs per delivery",
            "Server CPU per delivered message",
        )
        paths += [out / "throughput.png", out / "cpu.png"]
        s2s = [
            {"title": r["title"], "results": r["summary"]}
            for r in (results.get("sdk_to_sdk") or {}).get("rows", [])
        ]
        if s2s:
            _bars(
                results,
                out / "sdk_cpu.png",
                "server_cpu_us_per_delivery",
                "server CPU µs per delivered message",
                "SDK to SDK: server CPU per delivered message",
                s2s,
            )
            _bars(
                results,
                out / "sdk_rate.png",
                "deliveries_per_s",
                "deliveries per second",
                "SDK to SDK: deliveries per second",
                s2s,
            )
            paths += [out / "sdk_cpu.png", out / "sdk_rate.png"]
    return paths


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")


def _path(path: Path) -> str:
    """A path as the results name it: relative to the checkout when inside it (no machine's
    directories in committed files)."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def write_results(
    out: Path, name: str, text: str, info: dict[str, Any], args: argparse.Namespace | None, **data: Any
) -> None:
    """A benchmark program's results: `name`.md (the report `text`) and `name`.json (the
    machine, the command's settings `args`, if any, and `data`) in directory `out`; the
    report on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    document: dict[str, Any] = {"machine": info}
    if args is not None:
        document["args"] = {k: _path(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document.update(data)
    (out / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    print(text)
