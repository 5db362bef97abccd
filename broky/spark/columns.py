"""Which column feeds which message field, and what a bad row is.

The sink reads Kafka-like columns:

==============  ===========================  ==========================================
column          Spark type                   message field
==============  ===========================  ==========================================
key_partition   string or binary, not null   key_partition (hashed to choose the shard)
key             string or binary, not null   key (matched against subscriptions)
payload         string or binary, not null   payload
ts_producer     long (ns), timestamp or      ts_producer; null or absent: the SDK's clock
                timestamp_ntz
==============  ===========================  ==========================================

Options ``key_partition`` and ``key`` give one constant value for every row and
override (and make optional) the column of the same name. Other columns are
ignored, as Spark's Kafka sink does.

Time zones: a TIMESTAMP is an instant and is sent as such. A TIMESTAMP_NTZ has
no zone; the sink reads its wall-clock value as UTC, on every path (Arrow
batches and Spark Rows alike). Why UTC and not the session time zone: the
tasks do not know the session's zone (an NTZ Arrow column carries none), and
UTC gives the same instant wherever the job runs. For another zone, convert it
in Spark first: ``CAST(ts AS TIMESTAMP)`` reads it in the session time zone,
``convert_timezone('Europe/Paris', 'UTC', ts)`` in a named one. Spark Rows
carry no types, so the row path is told which kind the column is
(`SinkSpec.ts_kind`): Spark hands a TIMESTAMP to Python as a naive datetime in
the worker's local time, a TIMESTAMP_NTZ as a naive datetime holding the
wall-clock value.

Checks happen in two places. On the driver, `SinkSpec.resolve` checks the
schema: a missing column or a column of the wrong type fails the write before
any task starts. In the tasks, `SinkSpec.columns_of` checks the values of each
Arrow record batch: a null in a required column fails the task (and so the
job), with an error that names the column. Strings are encoded as UTF-8 in
bulk by Arrow, never row by row in Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broky.errors import BrokyError

KEY_PARTITION = "key_partition"
KEY = "key"
PAYLOAD = "payload"
TS_PRODUCER = "ts_producer"

_TEXT_TYPES = ("string", "binary")
_TS_TYPES = ("bigint", "timestamp", "timestamp_ntz")


class SinkConfigError(BrokyError, ValueError):
    """The sink's options make no sense (missing broky.servers, a bad number...)."""


class BadColumnError(BrokyError, ValueError):
    """A column the sink needs is missing, has the wrong type, or holds a null.

    Attributes:
        column: the name of the offending column.
        reason: what is wrong with it.
    """

    def __init__(self, column: str, reason: str) -> None:
        super().__init__(f"broky sink: column {column!r} {reason}")
        self.column = column
        self.reason = reason


@dataclass(frozen=True)
class SinkSpec:
    """Where each message field comes from; picklable, built on the driver.

    Attributes:
        key_partition: a constant key_partition for every row, or None to read the column.
        key: a constant key for every row, or None to read the column.
        ts_kind: "absent", "bigint" (nanoseconds), "timestamp" (an instant; in a Row a
            naive datetime is local time), "timestamp_ntz" (wall-clock read as UTC) or
            "auto" (rows only: an int is nanoseconds, a datetime is converted as for
            "timestamp", None or a missing field leaves it to the SDK).
        key_partition_col, key_col, payload_col, ts_producer_col: the column names.
    """

    key_partition: bytes | None
    key: bytes | None
    ts_kind: str
    key_partition_col: str = KEY_PARTITION
    key_col: str = KEY
    payload_col: str = PAYLOAD
    ts_producer_col: str = TS_PRODUCER

    @classmethod
    def resolve(cls, fields: Sequence[tuple[str, str]], options: Mapping[str, str]) -> SinkSpec:
        """Check a write's schema against the columns the sink needs.

        Args:
            fields: (name, Spark simpleString type) of every column, in order.
            options: the writer's options (case-insensitive keys, as Spark gives them).

        Returns:
            The spec every task uses to read its record batches.

        Raises:
            BadColumnError: a needed column is missing or has the wrong type.
        """
        types = {name: dtype for name, dtype in fields}
        opts = {k.lower(): v for k, v in options.items()}
        constants: dict[str, bytes | None] = {}
        for name in (KEY_PARTITION, KEY):
            value = opts.get(name)
            if value is not None:
                if value == "":
                    raise BadColumnError(name, "option is empty; give a value or drop the option")
                constants[name] = value.encode()
            else:
                constants[name] = None
                _check_type(name, types, _TEXT_TYPES)
        _check_type(PAYLOAD, types, _TEXT_TYPES)
        ts_kind = "absent"
        if TS_PRODUCER in types:
            check_ts_type(TS_PRODUCER, types)
            ts_kind = types[TS_PRODUCER]  # "bigint", "timestamp" or "timestamp_ntz"
        return cls(constants[KEY_PARTITION], constants[KEY], ts_kind)

    def columns_of(self, batch: Any) -> tuple[list[Any], list[Any], list[Any], list[Any] | None, int]:
        """Turn one Arrow record batch into Python lists, checking for nulls.

        Args:
            batch: a ``pyarrow.RecordBatch`` with (at least) the columns of the spec.

        Returns:
            (key_partitions, keys, payloads, ts_producers or None, rows); a constant
            key_partition or key comes back as a list that repeats it.

        Raises:
            BadColumnError: a required column holds a null.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        rows = batch.num_rows

        def as_bytes(name: str) -> list[Any]:
            column = batch.column(name)
            if column.null_count:
                first = pc.index(pc.is_null(column), True).as_py()
                raise BadColumnError(name, f"is null in row {first} of a batch; every row needs a {name}")
            if not pa.types.is_binary(column.type):
                column = column.cast(pa.binary())
            return column.to_pylist()  # type: ignore[no-any-return]

        kps = (
            [self.key_partition] * rows
            if self.key_partition is not None
            else as_bytes(self.key_partition_col)
        )
        keys = [self.key] * rows if self.key is not None else as_bytes(self.key_col)
        payloads = as_bytes(self.payload_col)
        ts: list[Any] | None = None
        if self.ts_kind != "absent":
            column = batch.column(self.ts_producer_col)
            if pa.types.is_timestamp(column.type):
                # microseconds since the epoch: a TIMESTAMP's instant, a TIMESTAMP_NTZ's
                # wall-clock as UTC (its Arrow column has no zone); the wire wants ns
                column = pc.multiply(column.cast(pa.timestamp("us")).cast(pa.int64()), 1000)
            ts = column.to_pylist()
        return kps, keys, payloads, ts, rows

    def values_of(self, row: Any) -> tuple[bytes, bytes, bytes, int | None]:
        """Read one Spark Row (the path of `partition_writer` and of row writers).

        Raises:
            BadColumnError: a required value is null or neither str nor bytes.
        """
        kp = self.key_partition if self.key_partition is not None else _text(row, self.key_partition_col)
        key = self.key if self.key is not None else _text(row, self.key_col)
        payload = _text(row, self.payload_col)
        ts: int | None = None
        if self.ts_kind != "absent":
            try:
                value = row[self.ts_producer_col]
            except (KeyError, ValueError):  # a Row raises ValueError for an unknown field
                if self.ts_kind != "auto":
                    raise BadColumnError(self.ts_producer_col, "is missing") from None
                value = None
            if isinstance(value, bool):
                raise BadColumnError(self.ts_producer_col, "holds a bool, expected a long or a timestamp")
            if isinstance(value, int):
                ts = value
            elif value is not None:
                ts = _datetime_ns(value, self.ts_producer_col, self.ts_kind == "timestamp_ntz")
        return kp, key, payload, ts


def check_ts_type(name: str, types: Mapping[str, str]) -> None:
    """Raise BadColumnError unless column `name` is a long or a timestamp (of either kind)."""
    _check_type(name, types, _TS_TYPES)


def _check_type(name: str, types: Mapping[str, str], allowed: tuple[str, ...]) -> None:
    if name not in types:
        hint = f" (or set option {name!r})" if name in (KEY_PARTITION, KEY) else ""
        raise BadColumnError(name, f"is missing{hint}; columns are {sorted(types)}")
    if types[name] not in allowed:
        target = "STRING" if allowed == _TEXT_TYPES else "TIMESTAMP"
        raise BadColumnError(
            name,
            f"has type {types[name]}, expected {' or '.join(allowed)}; cast it: CAST({name} AS {target})",
        )


def _text(row: Any, name: str) -> bytes:
    try:
        value = row[name]
    except (KeyError, ValueError):  # a Row raises ValueError for an unknown field
        raise BadColumnError(name, "is missing from the row") from None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray):
        return bytes(value)
    if value is None:
        raise BadColumnError(name, f"is null; every row needs a {name}")
    raise BadColumnError(name, f"holds a {type(value).__name__}, expected str or bytes")


def _datetime_ns(value: Any, column: str, ntz: bool) -> int:
    """Nanoseconds since the epoch of a datetime from a Row.

    A naive datetime is local time for a TIMESTAMP (what Spark hands out) and
    UTC wall-clock for a TIMESTAMP_NTZ (`ntz`); an aware one is its instant.
    """
    from datetime import UTC, datetime

    if isinstance(value, datetime):
        when: datetime = value.replace(tzinfo=UTC) if ntz and value.tzinfo is None else value
        aware = when.astimezone(UTC)  # a naive datetime is taken as local time
        delta = aware - datetime(1970, 1, 1, tzinfo=UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
    raise BadColumnError(column, f"holds a {type(value).__name__}, expected a long or a timestamp")
