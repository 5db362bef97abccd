"""The ``broky`` Python data source: batch and streaming writers (PySpark >= 4.0), and
the readers of `broky.spark.source`.

``df.write.format("broky")`` and ``df.writeStream.format("broky")`` both land
here. On the driver, `BrokyDataSource.writer` / `streamWriter` check the schema
and the options once (a bad column or a missing ``broky.servers`` fails the
write before any task runs); the writer object is then pickled to every task,
whose ``write`` is `broky.spark.sink.write_task`. The writers take Arrow record
batches (``DataSourceArrowWriter``; for streaming ``DataSourceStreamArrowWriter``
from PySpark 4.1, row batches on 4.0), so strings are encoded in bulk and Spark
skips building a Row per record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from broky.spark.columns import SinkConfigError, SinkSpec
from broky.spark.sink import BrokyCommitMessage, ClientConfig, UidPlan, log_abort, log_commit, write_task
from broky.spark.source import SCHEMA, BrokyBatchReader, BrokyStreamReader, SourceOptions

try:
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase
except ImportError:  # PySpark 4.0: rows instead of Arrow batches; write_task takes both
    from pyspark.sql.datasource import DataSourceStreamWriter as _StreamWriterBase  # type: ignore[assignment]


def _fields(schema: StructType) -> list[tuple[str, str]]:
    return [(f.name, f.dataType.simpleString()) for f in schema.fields]


class BrokyDataSource(DataSource):
    """Writes each row of a DataFrame as one Broky message; reads messages as rows.

    Options: ``broky.servers`` (required), ``key_partition`` / ``key`` (constants that
    override the columns), ``broky.batch.size``, ``broky.linger.ms``,
    ``broky.auth.token`` (or ``broky.auth.user`` and ``broky.auth.password``),
    ``broky.connect.timeout.ms``, ``broky.flush.timeout.ms``,
    ``broky.client.name``. Columns: see `broky.spark.columns`.
    """

    @classmethod
    def name(cls) -> str:
        return "broky"

    def schema(self) -> StructType:
        """What the source reads (see `broky.spark.source`); a write takes its DataFrame's."""
        return SCHEMA

    def reader(self, schema: StructType) -> BrokyBatchReader:
        return BrokyBatchReader(SourceOptions.from_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> BrokyStreamReader:
        return BrokyStreamReader(SourceOptions.from_options(self.options, streaming=True))

    def _resolve(self, schema: StructType, overwrite: bool) -> tuple[SinkSpec, ClientConfig]:
        if overwrite:
            raise SinkConfigError(
                "broky sink: overwrite has no meaning for a message stream; use mode('append')"
            )
        return SinkSpec.resolve(_fields(schema), self.options), ClientConfig.from_options(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> BrokyBatchWriter:
        return BrokyBatchWriter(*self._resolve(schema, overwrite), UidPlan.new(streaming=False))

    def streamWriter(self, schema: StructType, overwrite: bool) -> BrokyStreamWriter:
        return BrokyStreamWriter(*self._resolve(schema, overwrite), UidPlan.new(streaming=True))


class BrokyBatchWriter(DataSourceArrowWriter):
    """Batch writer: every task publishes its partition, flushes, reports its count."""

    def __init__(self, spec: SinkSpec, config: ClientConfig, uids: UidPlan) -> None:
        self.spec = spec
        self.config = config
        self.uids = uids

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return write_task(iterator, self.spec, self.config, self.uids)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        log_commit(_ours(messages), "batch write")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log_abort(_ours(messages), "batch write")


class BrokyStreamWriter(_StreamWriterBase):
    """Streaming writer: the same per task, the total logged per micro-batch id."""

    def __init__(self, spec: SinkSpec, config: ClientConfig, uids: UidPlan) -> None:
        self.spec = spec
        self.config = config
        self.uids = uids

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return write_task(iterator, self.spec, self.config, self.uids)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log_commit(_ours(messages), f"micro-batch {batchId}")

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log_abort(_ours(messages), f"micro-batch {batchId}")


def _ours(messages: list[WriterCommitMessage | None]) -> list[BrokyCommitMessage | None]:
    return [m if isinstance(m, BrokyCommitMessage) else None for m in messages]
