"""TLS's cost, SDK to SDK: server CPU per delivered message with TLS against plain TCP,
Broky and nats-server, in the same run.

    python -m bench.tls [--messages 300000] [--runs 3] [--workers 2] [--partitions 256] [--size 100]

The burst of bench/sdk_burst.py (one asyncio publisher process, one asyncio
subscriber process on `cpu.>`, defaults everywhere, a fresh server per run),
through four systems that alternate run by run: Broky plain (`broky`), Broky
with TLS (`broky_tls`: `broky serve --tls-cert --tls-key`, the SDK on
broky+tls:// with the CA), nats-server plain (`nats`) and with TLS
(`nats_tls`: `nats-server --tls --tlscert --tlskey`, nats.py on tls:// with
the CA). The certificate is an ECDSA P-256 one made with `openssl` for
127.0.0.1 (bench.harness.servers `tls_files`); TLS 1.3 on both sides.

A TLS run's subscriber stops after 15 s without a message, not 3 s
(bench.sdk_burst TLS_QUIET: nats.py's TLS subscriber was seen silent for
over 3 s mid-burst on a busy machine).

Reported: each system's medians (bench/sdk_burst.py's figures), and per run
the ratios TLS / plain of each server and Broky TLS / NATS TLS. Results:
bench/results/tls.md and tls.json, with the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import sdk_burst  # noqa: E402
from bench.harness import options  # noqa: E402
from bench.harness.machine import machine_info  # noqa: E402
from bench.harness.report import heading, table, write_results  # noqa: E402

SYSTEMS = ("broky", "broky_tls", "nats", "nats_tls")
CPU = "server_cpu_us_per_delivery"
PAIRS = (("broky_tls", "broky"), ("nats_tls", "nats"), ("broky_tls", "nats_tls"), ("broky", "nats"))


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    summary = sdk_burst.summarize(results)
    titles = sdk_burst.TITLES
    command = (
        f"python -m bench.tls --messages {args.messages} --runs {args.runs} "
        f"--workers {args.workers} --partitions {args.partitions} --size {args.size}"
    )
    lines = [
        *heading("TLS's cost, SDK to SDK: Broky and nats-server, TLS against plain TCP", info, command),
        f"The burst of bench/sdk_burst.py: {args.messages:,} messages of {args.size} B over "
        f"{args.partitions} key_partitions, one publisher process, one subscriber process, defaults "
        f"everywhere, a fresh server per run, Broky with {args.workers} workers; TLS 1.3 with an ECDSA "
        f"P-256 certificate. Medians of {args.runs} runs, the four systems alternating.",
        "",
    ]
    figures = (
        ("received (worst run)", "received_worst", "{:,.0f}"),
        ("lost (worst run)", "lost_worst", "{:,.0f}"),
        ("subscriber had the last message after (s)", "delivered_after_s", "{:.2f}"),
        ("deliveries per second", "deliveries_per_s", "{:,.0f}"),
        ("server CPU per delivered message (µs)", CPU, "{:.2f}"),
        ("server peak RSS (MB)", "server_peak_rss_mb", "{:.1f}"),
    )
    rows = []
    for name, key, fmt in figures:
        values = [summary.get(s, {}).get(key) for s in SYSTEMS]
        rows.append([name, *(fmt.format(v) if v is not None else "-" for v in values)])
    lines += [*table(["", *(titles[s] for s in SYSTEMS)], rows), ""]
    lines += ["Server CPU per delivered message, ratios within each run (then their median):", ""]
    rows = []
    for a, b in PAIRS:
        ratios = sdk_burst.paired_ratios(results, a, b, CPU)
        cells = [f"{r:.2f}x" for r in ratios] + ["-"] * (args.runs - len(ratios))
        med = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        rows.append([f"{titles[a]} / {titles[b]}", *cells, med])
    lines += [*table(["", *(f"run {i + 1}" for i in range(args.runs)), "median"], rows), ""]
    return "\n".join([*lines, *sdk_burst.every_run(results), ""])


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.tls", __doc__, out=options.RESULTS, runs=3, workers=2, name="tls")
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--partitions", type=int, default=256)
    parser.add_argument("--size", type=int, default=100)
    args = parser.parse_args(argv)
    info = machine_info()

    def show(system: str, r: int, got: dict[str, Any]) -> None:
        print(
            f"run {r + 1}, {system}: {got.get(CPU)} µs/delivery, lost {got.get('lost')}",
            got.get("error", ""),
        )

    results = sdk_burst.run(args.runs, args.messages, args.workers, SYSTEMS, args.partitions, args.size, show)
    write_results(args.out, args.name, report(results, args, info), info, args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
