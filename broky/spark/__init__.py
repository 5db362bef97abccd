"""Spark and Broky, both ways, with the conventions of Spark's Kafka sink and source.

Reading (`broky.spark.source`)::

    spark.readStream.format("broky").option("broky.servers", "h1:4777")
         .option("pattern", "orders.>").load()

and ``spark.read.format("broky")`` for what is retained now. Writing:

Batch::

    import broky.spark
    broky.spark.register(spark)
    (df.write.format("broky")
       .option("broky.servers", "127.0.0.1:4777")
       .mode("append").save())

Streaming::

    (stream_df.writeStream.format("broky")
       .option("broky.servers", "127.0.0.1:4777")
       .option("checkpointLocation", path).start())

``foreachPartition``::

    df.foreachPartition(broky.spark.partition_writer(servers="127.0.0.1:4777"))

Columns ``key_partition``, ``key``, ``payload`` (string or binary) and an
optional ``ts_producer`` (long nanoseconds, timestamp or timestamp_ntz); see
`broky.spark.columns`. Delivery is at-least-once; see `broky.spark.sink`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from broky.spark.columns import (
    KEY,
    KEY_PARTITION,
    PAYLOAD,
    TS_PRODUCER,
    BadColumnError,
    SinkConfigError,
    SinkSpec,
    check_ts_type,
)
from broky.spark.sink import ClientConfig, SinkWriteError, UidPlan, log, write_task
from broky.spark.source import BrokyDataLossError, SourceConfigError

__all__ = [
    "BadColumnError",
    "BrokyDataLossError",
    "SinkConfigError",
    "SinkWriteError",
    "SourceConfigError",
    "partition_writer",
    "register",
]


def register(spark: Any, *, discard: bool = False) -> None:
    """Make ``format("broky")`` available in a Spark session.

    Args:
        spark: the ``pyspark.sql.SparkSession``.
        discard: also register ``broky_discard``, a sink that drops its rows
            (used to measure what Spark itself costs).
    """
    from broky.spark.datasource import BrokyDataSource

    spark.dataSource.register(BrokyDataSource)
    if discard:
        from broky.spark.discard import DiscardDataSource

        spark.dataSource.register(DiscardDataSource)


def partition_writer(
    servers: str,
    *,
    key_partition_col: str = KEY_PARTITION,
    key_col: str = KEY,
    payload_col: str = PAYLOAD,
    ts_producer_col: str | None = TS_PRODUCER,
    key_partition: str | bytes | None = None,
    key: str | bytes | None = None,
    schema: Any = None,
    **options: str,
) -> Callable[[Iterator[Any]], None]:
    """A function for ``df.foreachPartition`` that publishes every row to Broky.

    Each call (one per partition, in the executors) opens a blocking client,
    publishes every row, flushes and closes; any error raises so Spark fails
    (and may retry) the task: delivery is at-least-once, and a retried task
    republishes the same uids (see `broky.spark.sink`).

    Args:
        servers: ``host:port`` addresses, comma-separated, tried in order.
        key_partition_col: column holding the key_partition (str or bytes).
        key_col: column holding the key (str or bytes).
        payload_col: column holding the payload (str or bytes).
        ts_producer_col: column holding ts_producer (int nanoseconds or datetime);
            used when the row has it and it is not null, else the SDK's clock.
            None: never read it.
        key_partition: a constant key_partition for every row (the column is not read).
        key: a constant key for every row (the column is not read).
        schema: the DataFrame's schema (``df.schema``), optional. With it, the
            type of ts_producer_col is checked at once and known in the tasks: a
            TIMESTAMP_NTZ is read as UTC wall-clock, as the data source does.
            Without it, Spark Rows carry no types and a naive datetime is taken
            as a TIMESTAMP (the Python worker's local time).
        **options: the data source's other ``broky.*`` options, e.g.
            ``**{"broky.linger.ms": "5"}``.

    Returns:
        A picklable function of a partition's row iterator.

    Raises:
        SinkConfigError: an option is not valid (raised at once, on the driver).
        BadColumnError: `schema` gives ts_producer_col a type that is not a long
            or a timestamp (raised at once, on the driver).
    """
    config = ClientConfig.from_options({**options, "broky.servers": servers})
    ts_kind = "absent" if ts_producer_col is None else "auto"
    if schema is not None and ts_producer_col is not None:
        types = {f.name: f.dataType.simpleString() for f in schema.fields}
        if ts_producer_col in types:
            check_ts_type(ts_producer_col, types)
            ts_kind = types[ts_producer_col]
    spec = SinkSpec(
        key_partition=_constant(key_partition),
        key=_constant(key),
        ts_kind=ts_kind,
        key_partition_col=key_partition_col,
        key_col=key_col,
        payload_col=payload_col,
        ts_producer_col=ts_producer_col or TS_PRODUCER,
    )

    uids = UidPlan.new(streaming=False)

    def write_partition(rows: Iterator[Any]) -> None:
        done = write_task(rows, spec, config, uids)
        log.info("broky partition_writer: partition %d published %d rows", done.partition, done.rows)

    return write_partition


def _constant(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return value.encode()
