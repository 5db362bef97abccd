"""The sink's column rules and options, without a Spark session."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampNTZType, TimestampType

from broky.spark import partition_writer
from broky.spark.columns import BadColumnError, SinkConfigError, SinkSpec
from broky.spark.sink import ClientConfig

TEXT = [("key_partition", "string"), ("key", "binary"), ("payload", "string")]


def test_resolve_accepts_kafka_like_columns_and_ignores_others() -> None:
    spec = SinkSpec.resolve([*TEXT, ("extra", "int")], {"broky.servers": "h:1"})
    assert spec == SinkSpec(key_partition=None, key=None, ts_kind="absent")


@pytest.mark.parametrize(
    ("ts_type", "kind"),
    [("bigint", "bigint"), ("timestamp", "timestamp"), ("timestamp_ntz", "timestamp_ntz")],
)
def test_resolve_reads_ts_producer_type(ts_type: str, kind: str) -> None:
    assert SinkSpec.resolve([*TEXT, ("ts_producer", ts_type)], {}).ts_kind == kind


@pytest.mark.parametrize(
    ("fields", "column", "words"),
    [
        (
            [("key_partition", "int"), ("key", "string"), ("payload", "string")],
            "key_partition",
            "has type int",
        ),
        ([("key_partition", "string"), ("key", "array<string>"), ("payload", "string")], "key", "has type"),
        (
            [("key_partition", "string"), ("key", "string"), ("payload", "double")],
            "payload",
            "has type double",
        ),
        ([("key_partition", "string"), ("key", "string")], "payload", "is missing"),
        ([("key", "string"), ("payload", "string")], "key_partition", "is missing"),
        ([*TEXT, ("ts_producer", "string")], "ts_producer", "has type string"),
    ],
)
def test_resolve_names_the_bad_column(fields: list[tuple[str, str]], column: str, words: str) -> None:
    with pytest.raises(BadColumnError, match=f"column '{column}' {words}") as info:
        SinkSpec.resolve(fields, {})
    assert info.value.column == column


def test_options_override_and_replace_columns() -> None:
    spec = SinkSpec.resolve([("payload", "binary")], {"KEY_PARTITION": "user-1", "key": "clicks.view"})
    assert (spec.key_partition, spec.key) == (b"user-1", b"clicks.view")
    batch = pa.record_batch({"payload": pa.array([b"a", b"b"])})
    assert spec.columns_of(batch) == ([b"user-1"] * 2, [b"clicks.view"] * 2, [b"a", b"b"], None, 2)
    with pytest.raises(BadColumnError, match="'key' option is empty"):
        SinkSpec.resolve([("payload", "binary")], {"key_partition": "u", "key": ""})


def test_columns_of_encodes_strings_and_converts_timestamps() -> None:
    spec = SinkSpec.resolve([*TEXT, ("ts_producer", "timestamp")], {})
    when = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    batch = pa.record_batch(
        {
            "key_partition": pa.array(["u1", "ü2"]),
            "key": pa.array([b"k.a", b"k.b"]),
            "payload": pa.array(["p1", "p2"]),
            "ts_producer": pa.array([when, None], type=pa.timestamp("us", tz="UTC")),
        }
    )
    kps, keys, payloads, ts, rows = spec.columns_of(batch)
    assert (kps, keys, payloads, rows) == (
        [b"u1", "ü2".encode()],
        [b"k.a", b"k.b"],
        [b"p1", b"p2"],
        2,
    )
    assert ts == [int(when.timestamp()) * 1_000_000_000 + 123456000, None]


@pytest.mark.parametrize("column", ["key_partition", "key", "payload"])
def test_columns_of_refuses_a_null_naming_the_column(column: str) -> None:
    spec = SinkSpec.resolve(TEXT, {})
    data: dict[str, list[Any]] = {"key_partition": ["a", "b"], "key": [b"k", b"k"], "payload": ["x", "y"]}
    data[column] = [data[column][0], None]
    batch = pa.record_batch({name: pa.array(values) for name, values in data.items()})
    with pytest.raises(BadColumnError, match=f"column '{column}' is null in row 1"):
        spec.columns_of(batch)


def test_values_of_reads_rows_and_checks_them() -> None:
    spec = SinkSpec(None, None, "auto", "user", "event", "body", "at")
    when = datetime(2026, 1, 2, tzinfo=UTC)
    row = Row(user="u1", event=b"clicks.view", body="hello", at=when)
    assert spec.values_of(row) == (b"u1", b"clicks.view", b"hello", int(when.timestamp()) * 1_000_000_000)
    assert spec.values_of(Row(user="u1", event="e", body=b"b", at=7)) == (b"u1", b"e", b"b", 7)
    assert spec.values_of(Row(user="u1", event="e", body=b"b")) == (b"u1", b"e", b"b", None)
    with pytest.raises(BadColumnError, match="column 'event' is null"):
        spec.values_of(Row(user="u1", event=None, body="x"))
    with pytest.raises(BadColumnError, match="column 'user' holds a int"):
        spec.values_of(Row(user=3, event="e", body="x"))
    with pytest.raises(BadColumnError, match="column 'body' is missing"):
        spec.values_of(Row(user="u", event="e"))
    with pytest.raises(BadColumnError, match="column 'at' holds a str"):
        spec.values_of(Row(user="u", event="e", body="x", at="yesterday"))


@pytest.fixture
def away_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time is UTC-3 during the test."""
    monkeypatch.setenv("TZ", "America/Sao_Paulo")  # no daylight saving time since 2019
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("spark_type", ["timestamp", "timestamp_ntz"])
def test_arrow_batches_and_rows_give_the_same_ts_producer(spark_type: str, away_from_utc: None) -> None:
    """A TIMESTAMP is its instant, a TIMESTAMP_NTZ its wall-clock read as UTC, on both paths."""
    micros = 1_767_323_045_123_456  # 2026-01-02 03:04:05.123456 (UTC; for an NTZ, the wall-clock)
    spec = SinkSpec.resolve([*TEXT, ("ts_producer", spark_type)], {})
    assert spec.ts_kind == spark_type
    # what Spark hands a sink: in Arrow, a TIMESTAMP carries the session's zone, an NTZ none...
    arrow_type = pa.timestamp("us", tz="Asia/Kolkata") if spark_type == "timestamp" else pa.timestamp("us")
    batch = pa.record_batch(
        {
            "key_partition": ["u"],
            "key": [b"k"],
            "payload": ["p"],
            "ts_producer": pa.array([micros], type=arrow_type),
        }
    )
    # ...in a Row, a naive datetime: local time for a TIMESTAMP, the wall-clock for an NTZ
    value = (TimestampType() if spark_type == "timestamp" else TimestampNTZType()).fromInternal(micros)
    assert value.tzinfo is None
    row = Row(key_partition="u", key=b"k", payload="p", ts_producer=value)
    assert spec.columns_of(batch)[3] == [micros * 1000]
    assert spec.values_of(row)[3] == micros * 1000


def test_partition_writer_checks_the_ts_producer_type_of_a_schema() -> None:
    schema = StructType([StructField("body", StringType()), StructField("at", LongType())])
    partition_writer("a:1", payload_col="body", ts_producer_col="at", schema=schema)
    bad = StructType([StructField("body", StringType()), StructField("at", StringType())])
    with pytest.raises(BadColumnError, match="column 'at' has type string"):
        partition_writer("a:1", payload_col="body", ts_producer_col="at", schema=bad)


def test_client_options() -> None:
    config = ClientConfig.from_options(
        {
            "broky.servers": " a:1, b:2 ,",
            "broky.batch.size": "65536",
            "broky.linger.ms": "5",
            "broky.connect.timeout.ms": "1500",
            "broky.auth.token": "s3cret",
        }
    )
    assert config.servers == ("a:1", "b:2")
    assert config.sdk_options == {"batch_size": 65536, "linger": 0.005}
    assert (config.connect_timeout, config.auth_token) == (1.5, "s3cret")
    assert config.flush_timeout == 10.0  # the default: a broker that is gone fails a task within 10 s
    user = ClientConfig.from_options(
        {"broky.servers": "a:1", "broky.auth.user": "etl", "broky.auth.password": "pw"}
    )
    assert user.auth_token == "etl:pw"  # a user of the server's users file (--users): USER:PASSWORD
    with pytest.raises(SinkConfigError, match=r"broky\.servers"):
        ClientConfig.from_options({})
    with pytest.raises(SinkConfigError, match=r"'broky\.linger\.ms' must be a number"):
        ClientConfig.from_options({"broky.servers": "a:1", "broky.linger.ms": "soon"})
    with pytest.raises(SinkConfigError, match="must not be negative"):
        partition_writer("a:1", **{"broky.batch.size": "-1"})
