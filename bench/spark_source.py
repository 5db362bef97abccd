"""Spark source benchmark: the ``broky`` streaming source vs Spark's ``rate`` source, into Parquet.

One local Spark session (``local[2]``, UI off, as `bench.spark_bench`), one
``broky serve --workers 2 --replay-bytes 256MiB`` started on free loopback
ports and stopped by pid. The broker is filled once with ``--rows`` messages
(default 1M: 100-byte payloads, 1024 key_partitions, one key) by the SDK's
``publish_many``; each worker retains its ~128 MB of frames (256 B per
message), hence the replay buffers of 256 MiB rather than the default 64 MiB;
every run checks that it read them all. Then, interleaved over ``--repeat``
rounds after one warm-up round, each of these writes ``--rows`` rows to a
fresh Parquet directory (and, streaming, a fresh checkpoint):

- ``broky stream``: ``spark.readStream.format("broky")`` from ``earliest``,
  ``writeStream.format("parquet")``, ``trigger(availableNow=True)``, until the
  query ends: the source under test;
- ``rate stream``: Spark's ``rate-micro-batch`` source (``rowsPerBatch`` =
  ``--rows``, 2 partitions: Trigger.AvailableNow makes it one micro-batch of
  exactly as many rows), the same way to the same sink, with 9 columns of the broky source's types and
  about its widths (`RATE_COLUMNS`): the ceiling of the machine for that sink;
- ``broky batch``: ``spark.read.format("broky").load().write.parquet(...)``;
- ``range batch``: the same 9 columns from ``spark.range`` written the same
  way: the batch ceiling;
- ``arrow stream`` and ``arrow batch``: a Python data source of the broky
  source's schema whose tasks (one per worker's share, as the broky source's:
  2) yield ready Arrow record batches of ``ARROW_BATCH_ROWS`` rows (`ArrowFloor`:
  the fill's values, made once per task), no I/O: what Spark's Python data
  source path costs by itself (the driver's Python process, the tasks' Arrow
  hand-off to the JVM, the JVM's conversion), the ceiling of any Python
  source into that sink.

rows/s = rows written / wall time of the query (from ``start()`` to its end,
or of the batch write); the streaming runs also give Spark's own
``processedRowsPerSecond`` (rows / the trigger's execution time, from
``recentProgress``). Server CPU (master and workers, /proc) is counted over
each broky run, and the share of the machine's CPU that other processes (not
this one's Spark JVM, Python workers, broker) used, per run.

    python -m bench.spark_source [--rows 1000000] [--repeat 3] [--max-offsets 100000]

A fifth run kind, ``broky stream limited``, reads in micro-batches of at most
``--max-offsets`` offsets (``maxOffsetsPerTrigger``; 0: no such run): what a
micro-batch's planning costs.

Results: bench/results/spark_source.md and spark_source.json (``--name``
changes the names), with the machine and versions.
"""

from __future__ import annotations

import os
import shutil
import statistics
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
from bench.spark_bench import spark_session, versions  # noqa: E402

KEY_PARTITIONS = 1024
KEY = b"bench.src"
PAYLOAD_BYTES = 100
REPLAY_BYTES = 256 * 1024 * 1024  # per worker: 1M messages of 256 B frames are ~128 MB each
FILL_CHUNK = 10_000
KINDS = ("broky stream", "rate stream", "arrow stream", "broky batch", "range batch", "arrow batch")
LIMITED = "broky stream limited"

# The rate rows: the broky source's 9 columns, its types, about its widths and variety
# (payload: the same bytes as the fill's; uid: 27 characters that differ per row, as a
# KSUID's text; epoch: one 19-digit string; timestamps a few µs apart).
RATE_COLUMNS = (
    "CAST(concat('kp', CAST(pmod(value, 1024) AS STRING)) AS BINARY) AS key_partition",
    f"CAST('{KEY.decode()}' AS BINARY) AS key",
    "CAST(concat(lpad(CAST(value AS STRING), 10, '0'), "
    f"repeat('x', {PAYLOAD_BYTES - 10})) AS BINARY) AS payload",
    "timestamp AS ts_producer",
    "timestamp + INTERVAL 5 MICROSECONDS AS ts_broker",
    "substr(sha1(CAST(value AS STRING)), 1, 27) AS uid",
    "CAST(pmod(value, 1024) AS INT) AS vbucket",
    "'1767225600123456789' AS epoch",
    "value DIV 1024 AS offset",
)


def payload(i: int) -> bytes:
    """Message i's payload: its number in 10 digits, then 'x' up to PAYLOAD_BYTES (as RATE_COLUMNS)."""
    return b"%010d" % i + b"x" * (PAYLOAD_BYTES - 10)


def fill(address: str, rows: int) -> float:
    """Publish `rows` messages with publish_many; the seconds it took, flushed."""
    import broky

    started = time.perf_counter()
    with broky.connect_sync(address, name="bench-fill") as client:
        kps = [b"kp%d" % k for k in range(KEY_PARTITIONS)]
        keys = [KEY] * FILL_CHUNK
        for first in range(0, rows, FILL_CHUNK):
            n = min(FILL_CHUNK, rows - first)
            client.publish_many(
                keys[:n],
                [payload(i) for i in range(first, first + n)],
                partitions=[kps[i % KEY_PARTITIONS] for i in range(first, first + n)],
            )
        client.flush()
        retained = sum(p.offset for p in client.positions())
    if retained != rows:
        raise RuntimeError(f"the broker accepted {retained} messages, not {rows}")
    return time.perf_counter() - started


class ArrowFloor:
    """The ``arrow`` runs' Python data source (see the module's header), registered as
    ``broky_bench_arrow``; pickled by value (run as a script, or `register`), so Spark's
    Python workers need not import bench/."""

    @staticmethod
    def source(rows: int) -> type:
        from pyspark.sql.datasource import (
            DataSource,
            DataSourceReader,
            DataSourceStreamReader,
            InputPartition,
        )

        class Share(InputPartition):
            def __init__(self, first: int, rows: int) -> None:
                self.first = first
                self.rows = rows

        def shares(n: int) -> list[Share]:
            return [Share(0, n // 2), Share(n // 2, n - n // 2)] if n else []

        def batches(share: Share) -> Any:
            import os as os_

            import pyarrow as pa

            from broky.protocol.ksuid import ksuid_text
            from broky.spark import source as broky_source

            n = min(share.rows, broky_source.ARROW_BATCH_ROWS)
            first = share.first
            us = 1_767_225_600_000_000
            cols: tuple[list[Any], ...] = (
                [b"kp%d" % (i % KEY_PARTITIONS) for i in range(first, first + n)],
                [KEY] * n,
                [payload(i) for i in range(first, first + n)],
                [us + i for i in range(n)],
                [us + i + 5 for i in range(n)],
                [ksuid_text(os_.urandom(20)) for _ in range(n)],
                [i % 1024 for i in range(first, first + n)],
                ["1767225600123456789"] * n,
                [i // 1024 for i in range(first, first + n)],
            )
            schema = broky_source.arrow_schema(pa)  # the broky source's, column for column
            batch = pa.RecordBatch.from_arrays(
                [pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)], schema=schema
            )
            left = share.rows
            while left > 0:
                yield batch.slice(0, min(left, n))
                left -= n

        class Stream(DataSourceStreamReader):
            def initialOffset(self) -> dict[str, int]:
                return {"rows": 0}

            def latestOffset(self) -> dict[str, int]:
                return {"rows": rows}

            def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Share]:
                return shares(end["rows"] - start["rows"])

            def read(self, partition: Any) -> Any:
                return batches(partition)

            def commit(self, end: dict[str, int]) -> None:
                pass

        class Batch(DataSourceReader):
            def partitions(self) -> list[Share]:
                return shares(rows)

            def read(self, partition: Any) -> Any:
                return batches(partition)

        class Source(DataSource):
            @classmethod
            def name(cls) -> str:
                return "broky_bench_arrow"

            def schema(self) -> Any:
                from broky.spark.source import SCHEMA

                return SCHEMA

            def reader(self, schema: Any) -> Batch:
                return Batch()

            def streamReader(self, schema: Any) -> Stream:
                return Stream()

        return Source

    @staticmethod
    def register(spark: Any, rows: int) -> None:
        from pyspark import cloudpickle

        if __name__ != "__main__":  # (a script's classes are pickled by value already)
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
        spark.dataSource.register(ArrowFloor.source(rows))


def stream_reader(spark: Any, kind: str, address: str, rows: int, max_offsets: int) -> Any:
    if kind == "arrow stream":
        return spark.readStream.format("broky_bench_arrow").load()
    if kind == "rate stream":
        return (
            spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", rows)
            .option("numPartitions", 2)
            .load()
            .selectExpr(*RATE_COLUMNS)
        )
    reader = (
        spark.readStream.format("broky")
        .option("broky.servers", address)
        .option("startingOffsets", "earliest")
    )
    if kind == LIMITED:
        reader = reader.option("maxOffsetsPerTrigger", max_offsets)
    return reader.load()


def run_stream(spark: Any, kind: str, address: str, rows: int, max_offsets: int, d: str) -> dict[str, Any]:
    """One Trigger.AvailableNow query into Parquet, to its end; its figures."""
    df = stream_reader(spark, kind, address, rows, max_offsets)
    writer = (
        df.writeStream.format("parquet")
        .option("path", os.path.join(d, "out"))
        .option("checkpointLocation", os.path.join(d, "checkpoint"))
    )
    started = time.perf_counter()
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    seconds = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"{kind}: {query.exception()}")
    batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
    read = sum(p["numInputRows"] for p in batches)
    busy_ms = sum(p["durationMs"]["triggerExecution"] for p in batches)
    return {
        "seconds": seconds,
        "rows": read,
        "rows_per_s": read / seconds,
        "batches": len(batches),
        "spark_processed_rows_per_s": [round(p["processedRowsPerSecond"]) for p in batches],
        "spark_rows_per_trigger_s": read / (busy_ms / 1000) if busy_ms else 0.0,
        "duration_ms": [p["durationMs"] for p in batches],  # per batch: latestOffset, addBatch, ...
    }


def run_batch(spark: Any, kind: str, address: str, rows: int, d: str) -> dict[str, Any]:
    if kind == "broky batch":
        df = spark.read.format("broky").option("broky.servers", address).load()
    elif kind == "arrow batch":
        df = spark.read.format("broky_bench_arrow").load()
    else:
        df = (
            spark.range(0, rows, numPartitions=2)
            .selectExpr("id AS value", "current_timestamp() AS timestamp")
            .selectExpr(*RATE_COLUMNS)
        )
    started = time.perf_counter()
    df.write.parquet(os.path.join(d, "out"))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "rows_per_s": rows / seconds}


def run(spark: Any, kind: str, address: str, rows: int, max_offsets: int, server: Any) -> dict[str, Any]:
    d = tempfile.mkdtemp(prefix="broky-spark-src-bench-")
    try:
        pids = server.pids()
        cpu0 = procstat.total_exact_cpu_seconds(pids)
        ours0 = procstat.tree_cpu_seconds(os.getpid())
        busy0, all0, _ = procstat.machine_cpu()
        if kind.endswith("stream") or kind == LIMITED:
            result = run_stream(spark, kind, address, rows, max_offsets, d)
        else:
            result = run_batch(spark, kind, address, rows, d)
        busy1, all1, _ = procstat.machine_cpu()
        ours = procstat.tree_cpu_seconds(os.getpid()) - ours0
        cpu = procstat.total_exact_cpu_seconds(pids) - cpu0
        written = spark.read.parquet(os.path.join(d, "out")).count()
        if written != rows:
            raise RuntimeError(f"{kind}: {written} rows written to Parquet, not {rows}")
        result["rows"] = written
        result["rows_per_s"] = written / result["seconds"]
        if kind.startswith("broky"):
            result["server_cpu_s"] = cpu
        result["others_cpu_share"] = max(0.0, (busy1 - busy0) - ours) / ((all1 - all0) or 1.0)
        return result
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.spark_source", __doc__, out=options.RESULTS, name="spark_source")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--max-offsets", type=int, default=100_000, help="also run with maxOffsetsPerTrigger N (0: not)"
    )
    args = parser.parse_args(argv)

    import broky.spark

    kinds = KINDS + ((LIMITED,) if args.max_offsets else ())
    info = {**machine.machine_info(), **versions()}
    server = servers.start_broky(2, ["--replay-bytes", str(REPLAY_BYTES)])
    address = f"{server.host}:{server.port}"
    spark = None
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    try:
        fill_s = fill(address, args.rows)
        print(f"filled {args.rows:,} messages in {fill_s:.1f} s", file=sys.stderr)
        spark = spark_session()
        broky.spark.register(spark)
        ArrowFloor.register(spark, args.rows)
        for kind in kinds:  # warm-up: the JVM's code, the Python workers, the modules
            run(spark, kind, address, args.rows, args.max_offsets, server)
        for round_ in range(args.repeat):
            for kind in options.alternating(kinds, round_):
                got = run(spark, kind, address, args.rows, args.max_offsets, server)
                runs[kind].append(got)
                print(f"round {round_ + 1} {kind:<22} {got['rows_per_s']:>12,.0f} rows/s", file=sys.stderr)
    finally:
        if spark is not None:
            spark.stop()
        server.stop()

    median = {kind: statistics.median(r["rows_per_s"] for r in runs[kind]) for kind in kinds}
    result: dict[str, Any] = {
        "rows": args.rows,
        "repeat": args.repeat,
        "max_offsets": args.max_offsets,
        "payload_bytes": PAYLOAD_BYTES,
        "key_partitions": KEY_PARTITIONS,
        "replay_bytes_per_worker": REPLAY_BYTES,
        "fill_seconds": fill_s,
        "rate_columns": list(RATE_COLUMNS),
        "runs": runs,
        "median_rows_per_s": median,
        "stream_broky_over_rate": median["broky stream"] / median["rate stream"],
        "batch_broky_over_range": median["broky batch"] / median["range batch"],
        "stream_arrow_over_rate": median["arrow stream"] / median["rate stream"],
        "batch_arrow_over_range": median["arrow batch"] / median["range batch"],
        "stream_broky_over_arrow": median["broky stream"] / median["arrow stream"],
        "batch_broky_over_arrow": median["broky batch"] / median["arrow batch"],
        "broky_stream_server_cpu_us_per_row": statistics.median(
            r["server_cpu_s"] for r in runs["broky stream"]
        )
        / args.rows
        * 1e6,
    }
    text = render({"machine": info, **result}, argv)
    write_results(args.out, args.name, text, info, args, **result)
    return 0


def render(result: dict[str, Any], argv: list[str] | None) -> str:
    info = result["machine"]
    median = result["median_rows_per_s"]
    rows = result["rows"]
    lines = [
        "# Spark source: the `broky` streaming source vs Spark's `rate` source, into Parquet",
        "",
        f"Command: `{options.command('bench.spark_source', argv)}`",
        "",
        f"Machine: {machine.describe(info)}; pyspark {info['pyspark']}, pyarrow {info['pyarrow']}, "
        f"{info['java']}; load average at start {info['load_average_at_start']}.",
        "",
        f"{rows:,} messages of {result['payload_bytes']} B payloads over {result['key_partitions']} "
        f"key_partitions, retained by `broky serve --workers 2 --replay-bytes "
        f"{result['replay_bytes_per_worker'] // 2**20}MiB` on the same machine (filled once with "
        f"`publish_many` in {result['fill_seconds']:.1f} s); Spark `local[2]`; every run writes all "
        f"{rows:,} rows to a fresh Parquet directory (streaming: and checkpoint), checked by "
        f"counting them back; median of {result['repeat']} interleaved runs after a warm-up round. "
        "rows/s = rows / wall time of the query (streaming: `start()` to its end).",
        "",
    ]
    cells = []
    for kind, runs in result["runs"].items():
        listed = ", ".join(f"{r['rows_per_s']:,.0f}" for r in runs)
        spark_rate = (
            f"{statistics.median(r['spark_rows_per_trigger_s'] for r in runs):,.0f}"
            if "spark_rows_per_trigger_s" in runs[0]
            else ""
        )
        cpu = (
            f"{statistics.median(r['server_cpu_s'] for r in runs) / rows * 1e6:.2f}"
            if "server_cpu_s" in runs[0]
            else ""
        )
        others = ", ".join(f"{r['others_cpu_share']:.0%}" for r in runs)
        cells.append((kind, f"{median[kind]:,.0f}", listed, spark_rate, cpu, others))
    head = ("run", "rows/s (median)", "runs", "Spark's rows/s of trigger time", "server CPU µs/row",
            "others' CPU share")  # fmt: skip
    lines += table(head, cells, "lrlrrr")
    lines += [
        "",
        f"**broky stream / rate stream: {result['stream_broky_over_rate']:.2f}**; "
        f"broky batch / range batch: {result['batch_broky_over_range']:.2f}.",
        "",
        *(
            [
                "The ceiling of a Python data source into this sink (`arrow`: ready Arrow batches, "
                f"no I/O): arrow stream / rate stream {result['stream_arrow_over_rate']:.2f}, "
                f"arrow batch / range batch {result['batch_arrow_over_range']:.2f}; broky stream / "
                f"arrow stream {result['stream_broky_over_arrow']:.2f}, broky batch / arrow batch "
                f"{result['batch_broky_over_arrow']:.2f}.",
                "",
            ]
            if "stream_arrow_over_rate" in result
            else []
        ),
        "The rate rows have the broky source's 9 columns and types, the same payload bytes "
        "(the message's number in 10 digits, then 90 'x'), a 27-character uid that differs per row "
        "and the same key_partitions:",
        "",
        "```sql",
        *(f"{c}," for c in result["rate_columns"][:-1]),
        result["rate_columns"][-1],
        "```",
        "",
        "Both streaming queries run with Trigger.AvailableNow; `rate-micro-batch` "
        "(`rowsPerBatch` = all the rows, `numPartitions` 2) makes it one micro-batch. "
        "Spark's rows/s of trigger time is rows / "
        "`durationMs.triggerExecution` summed over the batches with rows (Spark's "
        "`processedRowsPerSecond`; every run's per batch is in the JSON). Others' CPU share: "
        "the machine's busy CPU (/proc/stat) less this benchmark's processes (driver, JVM, "
        "Python workers, broker), over all cores.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
