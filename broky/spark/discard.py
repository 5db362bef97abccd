"""``broky_discard``: a Python data source that drops its rows (the cost of Spark).

The Spark sink benchmark writes the same DataFrame to ``broky`` and to this
sink in one run: the difference is what Broky adds on top of Spark itself.
Option ``mode``: ``arrow`` (default) takes Arrow batches and reads every value
of every column into Python, as the ``broky`` sink does before it publishes;
``count`` only counts the batches' rows (the floor: Spark plus the Arrow hand-off);
``rows`` takes Spark Rows, the default path of a row-based Python sink.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from broky.spark.columns import SinkConfigError

MODES = ("arrow", "count", "rows")


@dataclass
class DiscardCommitMessage(WriterCommitMessage):
    rows: int


class DiscardDataSource(DataSource):
    """Accepts any schema, drops every row, counts them."""

    @classmethod
    def name(cls) -> str:
        return "broky_discard"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        mode = self.options.get("mode", "arrow")
        if mode not in MODES:
            raise SinkConfigError(f"broky_discard: option 'mode' must be one of {MODES}, got {mode!r}")
        if mode == "rows":
            return DiscardRowWriter()
        return DiscardArrowWriter(read_values=mode == "arrow")


class DiscardArrowWriter(DataSourceArrowWriter):
    def __init__(self, read_values: bool) -> None:
        self.read_values = read_values

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        rows = 0
        for batch in iterator:
            if self.read_values:
                for column in batch.columns:
                    for _ in column.to_pylist():
                        pass
            rows += batch.num_rows
        return DiscardCommitMessage(rows)


class DiscardRowWriter(DataSourceWriter):
    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        rows = 0
        for _ in iterator:
            rows += 1
        return DiscardCommitMessage(rows)
