"""The ``broky`` Spark data source and `partition_writer` against a real broker and a real local Spark."""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import Row

import broky
from broky.protocol import ksuid_text, parse_ksuid
from broky.protocol.ksuid import ksuid_time
from broky.spark import partition_writer
from broky.spark.columns import SinkSpec
from broky.spark.sink import ClientConfig, UidPlan, write_task
from tests.serverproc import ServerProcess
from tests.spark_fixtures import spark  # noqa: F401  (the session-scoped fixture)

pytestmark = pytest.mark.spark

EVENTS = ("view", "click", "buy")


@contextmanager
def subscriber(server: ServerProcess, pattern: str = ">") -> Iterator[Any]:
    """A blocking SDK subscription that queues everything (up to 1M messages) until drained."""
    with broky.connect_sync(f"127.0.0.1:{server.port}", name="test-sub") as client:
        sub = client.subscribe(pattern, max_pending_msgs=1_000_000, max_pending_bytes=512 << 20)
        client.flush()
        yield sub


def drain(sub: Any, expected: int, idle: float = 5.0) -> list[broky.Message]:
    """Everything the subscription receives until `expected` arrived (or `idle` s of silence)."""
    got = list(sub.iter(timeout=idle, count=expected))
    got.extend(sub.iter(timeout=0.3))  # anything beyond `expected` is a duplicate or a stray
    return got


def servers(server: ServerProcess) -> str:
    return f"127.0.0.1:{server.port}"


def clickstream(spark: Any, rows: int) -> Any:  # noqa: F811
    return spark.range(rows).selectExpr(
        "CAST(id % 97 AS STRING) AS key_partition",
        "concat('clicks.', element_at(array('view', 'click', 'buy'), CAST(id % 3 AS INT) + 1)) AS key",
        "CAST(id AS STRING) AS payload",
    )


def test_batch_write_of_100k_rows_is_received_in_full(spark: Any, server: ServerProcess) -> None:  # noqa: F811
    rows = 100_000
    with subscriber(server, "clicks.>") as sub:
        started = time.monotonic()
        clickstream(spark, rows).write.format("broky").option("broky.servers", servers(server)).mode(
            "append"
        ).save()
        got = drain(sub, rows)
        elapsed = time.monotonic() - started
        assert sub.dropped == 0
    assert len(got) == rows, f"received {len(got)} of {rows} in {elapsed:.1f} s"
    ids = sorted(int(m.payload) for m in got)
    assert ids == list(range(rows))
    for m in got:
        i = int(m.payload)
        assert m.key_partition == str(i % 97).encode()
        assert m.key == f"clicks.{EVENTS[i % 3]}".encode()
        assert m.ts_producer and m.ts_broker
    uids = {m.uid for m in got}
    assert len(uids) == rows and None not in uids
    # valid KSUIDs whose time is the write's
    sample = next(iter(uids))
    assert sample is not None
    assert parse_ksuid(ksuid_text(sample)) == sample
    assert abs(ksuid_time(sample) - time.time()) < 600


def test_options_override_columns_and_ts_producer_column(spark: Any, server: ServerProcess) -> None:  # noqa: F811
    df = spark.createDataFrame(
        [(b"\x00\xffbin", "p1", 1_700_000_000_123_456_789), (b"u2", "p2", None)],
        "key_partition binary, payload string, ts_producer bigint",
    )
    with subscriber(server, "orders.*") as sub:
        df.write.format("broky").option("broky.servers", servers(server)).option(
            "key", "orders.created"
        ).option("broky.linger.ms", "1").option("broky.batch.size", "4096").mode("append").save()
        got = sorted(drain(sub, 2), key=lambda m: m.payload)
    assert [(m.key_partition, m.key, m.payload) for m in got] == [
        (b"\x00\xffbin", b"orders.created", b"p1"),
        (b"u2", b"orders.created", b"p2"),
    ]
    assert got[0].ts_producer == 1_700_000_000_123_456_789
    assert got[1].ts_producer is not None and abs(got[1].ts_producer - time.time_ns()) < 60e9


def test_streaming_write_from_the_rate_source_is_received(spark: Any, server: ServerProcess) -> None:  # noqa: F811
    stream = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 2000)
        .option("numPartitions", 2)
        .load()
        .selectExpr(
            "CAST(value % 10 AS STRING) AS key_partition",
            "'rate.tick' AS key",
            "CAST(value AS STRING) AS payload",
            "timestamp AS ts_producer",
        )
    )
    with subscriber(server, "rate.tick") as sub, tempfile.TemporaryDirectory(prefix="broky-ckpt-") as ckpt:
        query = (
            stream.writeStream.format("broky")
            .option("broky.servers", servers(server))
            .option("checkpointLocation", ckpt)
            .trigger(processingTime="500 milliseconds")
            .start()
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
                if len(progress) >= 3:
                    break
                assert query.exception() is None
                time.sleep(0.2)
            else:
                pytest.fail(f"fewer than 3 non-empty micro-batches in 60 s: {query.recentProgress}")
        finally:
            query.stop()
        committed = sum(p["numInputRows"] for p in query.recentProgress)
        assert query.exception() is None
        got = drain(sub, committed)
    values = {int(m.payload) for m in got}
    # the rate source numbers its rows 0, 1, 2...: every committed micro-batch arrived in full
    assert set(range(committed)) <= values, f"committed {committed}, received {len(values)}"
    assert len(got) == len(values), "no duplicates without failures"
    for m in got:
        assert m.key_partition == str(int(m.payload) % 10).encode()
        assert m.ts_producer is not None and abs(m.ts_producer - time.time_ns()) < 300e9


@pytest.mark.parametrize("column", ["key_partition", "key"])
def test_a_null_in_a_required_column_fails_the_write_naming_it(
    spark: Any,  # noqa: F811
    server: ServerProcess,
    column: str,
) -> None:
    bad = ("u1", None, "bad") if column == "key" else (None, "clicks.view", "bad")
    df = spark.createDataFrame(
        [("u1", "clicks.view", "ok"), ("u2", "clicks.view", "ok"), bad],
        "key_partition string, key string, payload string",
    )
    with pytest.raises(PySparkException, match=f"column '{column}' is null"):
        df.write.format("broky").option("broky.servers", servers(server)).mode("append").save()


@pytest.mark.parametrize(
    ("select", "column", "words"),
    [
        (["id AS key_partition", "'k' AS key", "'p' AS payload"], "key_partition", "has type bigint"),
        (
            ["'u' AS key_partition", "'k' AS key", "CAST(id AS DOUBLE) AS payload"],
            "payload",
            "has type double",
        ),
        (["'u' AS key_partition", "'p' AS payload"], "key", "is missing"),
        (
            ["'u' AS key_partition", "'k' AS key", "'p' AS payload", "'now' AS ts_producer"],
            "ts_producer",
            "has type string, expected bigint or timestamp",
        ),
    ],
)
def test_wrong_column_types_fail_before_any_task_naming_the_column(
    spark: Any,  # noqa: F811
    select: list[str],
    column: str,
    words: str,
) -> None:
    df = spark.range(3).selectExpr(*select)
    with pytest.raises(PySparkException, match=f"column '{column}' {words}"):
        df.write.format("broky").option("broky.servers", "127.0.0.1:9").mode("append").save()


def test_overwrite_mode_and_missing_servers_are_refused(spark: Any) -> None:  # noqa: F811
    df = spark.range(1).selectExpr("'u' AS key_partition", "'k' AS key", "'p' AS payload")
    with pytest.raises(PySparkException, match="use mode\\('append'\\)"):
        df.write.format("broky").option("broky.servers", "127.0.0.1:9").mode("overwrite").save()
    with pytest.raises(PySparkException, match=r'option "broky\.servers" is required'):
        df.write.format("broky").mode("append").save()


def test_an_unreachable_broker_fails_the_task_quickly_and_clearly(spark: Any) -> None:  # noqa: F811
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(PySparkException, match=f"no broker reachable.*127.0.0.1:{port}"):
        clickstream(spark, 1000).write.format("broky").option("broky.servers", f"127.0.0.1:{port}").option(
            "broky.connect.timeout.ms", "1000"
        ).mode("append").save()
    assert time.monotonic() - started < 30


def test_partition_writer_publishes_every_row(spark: Any, server: ServerProcess) -> None:  # noqa: F811
    df = spark.range(5000).selectExpr(
        "concat('user-', CAST(id % 7 AS STRING)) AS user", "CAST(id AS STRING) AS body"
    )
    writer = partition_writer(servers(server), key_partition_col="user", key="audit.row", payload_col="body")
    with subscriber(server, "audit.row") as sub:
        df.foreachPartition(writer)
        got = drain(sub, 5000)
    assert sorted(int(m.payload) for m in got) == list(range(5000))
    assert all(m.key_partition == f"user-{int(m.payload) % 7}".encode() for m in got)


def test_a_retried_task_republishes_the_same_uids(server: ServerProcess) -> None:
    """What a Spark retry does, without Spark: the same task twice with the same plan."""
    spec = SinkSpec(None, None, "auto")
    config = ClientConfig.from_options({"broky.servers": servers(server)})
    plan = UidPlan.new(streaming=False)
    rows = [Row(key_partition=f"u{i}", key="retry.row", payload=str(i)) for i in range(50)]
    with subscriber(server, "retry.row") as sub:
        first = write_task(iter(rows), spec, config, plan)
        again = write_task(iter(rows), spec, config, plan)
        other = write_task(iter(rows), spec, config, UidPlan.new(streaming=False))
        got = drain(sub, 150)
    assert (first.rows, again.rows, other.rows) == (50, 50, 50)
    assert len(got) == 150
    uids = [m.uid for m in got]
    assert uids[:50] == uids[50:100], "a retry carries the same uids"
    assert len(set(uids)) == 100, "another write carries other uids"
