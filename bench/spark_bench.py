"""Spark sink benchmark: the ``broky`` data source vs a sink that discards its rows.

One run, one local Spark session (``local[2]``), one ``broky serve`` (2 workers)
started on free loopback ports and stopped by pid. The same DataFrame, ``--rows``
rows (default 1M) in 2 partitions with a 100-byte binary payload, 1024 distinct
key_partitions and one key, is written to:

- ``broky``: the sink under test (Arrow batches, one SDK client per task, flush);
  nobody subscribes, so the server counts every message as no_subscribers;
- ``broky_discard`` in three modes, the cost of Spark itself:
  ``count`` counts the rows of each Arrow batch (Spark + the Arrow hand-off),
  ``arrow`` also reads every value into Python (what the broky sink does
  before it publishes), ``rows`` is a plain row-based Python data source.

Sinks are interleaved run by run (``--repeat`` rounds, after one warm-up
round that starts the Python workers), so load drift on a shared machine hits
them alike; the median rows/s of each is reported with the ratio
broky / discard. The target is that ``broky`` reaches at least half the
discard rate. With ``--with-subscriber`` a last run writes to ``broky`` while
``broky sub '>' --count N`` (another process) receives, and checks it got them all.

    python -m bench.spark_bench [--rows 1000000] [--repeat 3] [--with-subscriber]

Results: bench/results/spark.md and spark.json, with the machine and versions.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import machine, options, procstat, servers  # noqa: E402
from bench.harness.report import table, write_results  # noqa: E402

SINKS = ("discard:count", "discard:arrow", "discard:rows", "broky")


def spark_session() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("broky-spark-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.warehouse.dir", tempfile.mkdtemp(prefix="broky-spark-bench-"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def frame(spark: Any, rows: int) -> Any:
    return spark.range(0, rows, numPartitions=2).selectExpr(
        "CAST(pmod(id, 1024) AS STRING) AS key_partition",
        "'bench.spark' AS key",
        "CAST(repeat('x', 100) AS BINARY) AS payload",
    )


def write(df: Any, sink: str, address: str) -> None:
    if sink == "broky":
        df.write.format("broky").option("broky.servers", address).mode("append").save()
    else:
        df.write.format("broky_discard").option("mode", sink.split(":")[1]).mode("append").save()


def timed(df: Any, sink: str, address: str, rows: int, server_pids: list[int]) -> dict[str, float]:
    cpu0 = procstat.total_cpu_seconds(server_pids)
    started = time.perf_counter()
    write(df, sink, address)
    seconds = time.perf_counter() - started
    cpu = procstat.total_cpu_seconds(server_pids) - cpu0
    return {"seconds": seconds, "rows_per_s": rows / seconds, "server_cpu_s": cpu}


def with_subscriber(df: Any, address: str, rows: int) -> dict[str, Any]:
    """One write to broky while `broky sub '>' --count rows` receives in another process."""
    sub = subprocess.Popen(
        [sys.executable, "-m", "broky", "sub", ">", "--count", str(rows), "--server", address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert sub.stderr is not None
        sub.stderr.readline()  # the status line: subscribed
        started = time.perf_counter()
        write(df, "broky", address)
        written = time.perf_counter() - started
        try:
            code = sub.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        received_s = time.perf_counter() - started
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait(5)
        if sub.stderr is not None:
            sub.stderr.close()
    return {
        "write_seconds": written,
        "write_rows_per_s": rows / written,
        "all_received": code == 0,
        "received_seconds": received_s,
        "end_to_end_rows_per_s": rows / received_s if code == 0 else 0.0,
    }


def versions() -> dict[str, str]:
    """pyspark's, pyarrow's and Java's versions, for the report."""
    out = machine.versions("pyspark", "pyarrow")
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False).stderr
    out["java"] = java.strip().splitlines()[0] if java.strip() else "unknown"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.spark_bench", __doc__, out=options.RESULTS)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--with-subscriber", action="store_true")
    args = parser.parse_args(argv)

    import broky.spark

    info = {**machine.machine_info(), **versions()}
    server = servers.start_broky(2)
    address = f"{server.host}:{server.port}"
    spark = None
    runs: dict[str, list[dict[str, float]]] = {sink: [] for sink in SINKS}
    extra: dict[str, Any] = {}
    try:
        spark = spark_session()
        broky.spark.register(spark, discard=True)
        df = frame(spark, args.rows)
        warm = frame(spark, 50_000)
        for sink in SINKS:  # start the Python workers, load the modules
            write(warm, sink, address)
        for round_ in range(args.repeat):
            for sink in options.alternating(SINKS, round_):
                got = timed(df, sink, address, args.rows, server.pids())
                runs[sink].append(got)
                print(f"round {round_ + 1} {sink:<14} {got['rows_per_s']:>12,.0f} rows/s", file=sys.stderr)
        if args.with_subscriber:
            extra = with_subscriber(df, address, args.rows)
            print(f"with subscriber: {extra}", file=sys.stderr)
    finally:
        if spark is not None:
            spark.stop()
        server.stop()

    median = {sink: statistics.median(r["rows_per_s"] for r in runs[sink]) for sink in SINKS}
    ratios = {sink: median["broky"] / median[sink] for sink in SINKS if sink != "broky"}
    server_cpu_us = statistics.median(r["server_cpu_s"] for r in runs["broky"]) / args.rows * 1e6
    result: dict[str, Any] = {
        "rows": args.rows,
        "repeat": args.repeat,
        "runs": runs,
        "median_rows_per_s": median,
        "broky_over_discard": ratios,
        "broky_server_cpu_us_per_row": server_cpu_us,
        "with_subscriber": extra,
    }
    text = render({"machine": info, **result}, argv)
    write_results(args.out, "spark", text, info, args, **result)
    return 0


def render(result: dict[str, Any], argv: list[str] | None) -> str:
    info = result["machine"]
    median = result["median_rows_per_s"]
    lines = [
        "# Spark sink: `broky` data source vs a sink that discards its rows",
        "",
        f"Command: `{options.command('bench.spark_bench', argv)}`",
        "",
        f"Machine: {machine.describe(info)}; pyspark {info['pyspark']}, pyarrow {info['pyarrow']}, "
        f"{info['java']}; load average at start {info['load_average_at_start']}.",
        "",
        f"{result['rows']:,} rows of 100-byte binary payloads, 1024 key_partitions, Spark `local[2]`, "
        f"2 partitions, `broky serve --workers 2` on the same machine, nobody subscribed; "
        f"median of {result['repeat']} interleaved runs after a warm-up.",
        "",
    ]
    rows = [
        (sink, f"{median[sink]:,.0f}", ", ".join(f"{r['rows_per_s']:,.0f}" for r in result["runs"][sink]),
         "" if sink == "broky" else f"{result['broky_over_discard'][sink]:.2f}")
        for sink in SINKS
    ]  # fmt: skip
    lines += table(("sink", "rows/s (median)", "runs", "broky / this"), rows, "lrlr")
    lines += [
        "",
        f"Server CPU per row published through the sink: {result['broky_server_cpu_us_per_row']:.2f} µs.",
        "",
    ]
    sub = result["with_subscriber"]
    if sub:
        lines += [
            f"With `broky sub '>' --count {result['rows']}` receiving in another process: the write took "
            f"{sub['write_seconds']:.2f} s ({sub['write_rows_per_s']:,.0f} rows/s); all received: "
            f"{sub['all_received']}, after {sub['received_seconds']:.2f} s "
            f"({sub['end_to_end_rows_per_s']:,.0f} rows/s end to end).",
            "",
        ]
    target = {sink: ratio >= 0.5 for sink, ratio in result["broky_over_discard"].items()}
    lines += [
        "Target: `broky` reaches at least half the discard rate. "
        + "; ".join(f"vs {sink}: {'met' if ok else 'NOT met'}" for sink, ok in target.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
