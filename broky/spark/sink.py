"""What one Spark task does: open a client, publish every row, flush, count.

Theory of operation
-------------------
A write is planned on the driver and run by tasks in the executors' Python
workers. Every task opens its own blocking SDK client (`broky.connect_sync`),
which is shard-aware: it reads the vbucket map and sends each message straight
to the worker that owns its key_partition, with the SDK's batching (options
``broky.batch.size`` and ``broky.linger.ms``, like Kafka's). The task publishes
every row, then flushes: the flush returns once every worker connection has
answered a Ping sent after the last publish, so every message has reached the
server when the task reports success. Its commit message carries its row count;
the driver adds them up and logs the total of each batch (or micro-batch).

Delivery is at-least-once. Any error (a bad row, the broker unreachable, a
connection lost before the flush completed) raises, the task fails and Spark
may run it again (``spark.task.maxFailures``; local mode does not retry unless
the master is ``local[N,F]``). A retried task publishes its rows again, so
subscribers may see a message twice: each publish carries a fresh KSUID `uid`
set by the SDK, but the retry gets new ones, so consumers that must not see
duplicates should deduplicate on a business key they put in the payload (or
on (key_partition, key, ts_producer) when ts_producer comes from a column,
which a retry reproduces exactly).

Nothing here waits without a bound: connecting gives up after
``broky.connect.timeout.ms``, and the final flush after ``broky.flush.timeout.ms``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import WriterCommitMessage

from broky.errors import BrokyConnectionError
from broky.spark.columns import SinkConfigError, SinkSpec

log = logging.getLogger("broky.spark")

DEFAULT_CONNECT_TIMEOUT_MS = 5_000
DEFAULT_FLUSH_TIMEOUT_MS = 60_000


@dataclass(frozen=True)
class ClientConfig:
    """The SDK settings every task uses; built on the driver from the options.

    Attributes:
        servers: ``host:port`` addresses to try in order (option ``broky.servers``,
            comma-separated, like Kafka's ``bootstrap.servers``).
        name: client name prefix; each task appends its partition and attempt.
        auth_token: option ``broky.auth.token``.
        connect_timeout: seconds, option ``broky.connect.timeout.ms``.
        flush_timeout: seconds, option ``broky.flush.timeout.ms``.
        sdk_options: passed to `broky.connect_sync` as is (``batch_size``, ``linger``).
    """

    servers: tuple[str, ...]
    name: str = "spark"
    auth_token: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_MS / 1000
    flush_timeout: float = DEFAULT_FLUSH_TIMEOUT_MS / 1000
    sdk_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ClientConfig:
        """Read the ``broky.*`` options of a writer.

        Raises:
            SinkConfigError: ``broky.servers`` is missing or a number is not a number.
        """
        opts = {k.lower(): v for k, v in options.items()}
        servers = tuple(s.strip() for s in opts.get("broky.servers", "").split(",") if s.strip())
        if not servers:
            raise SinkConfigError(
                'option "broky.servers" is required, e.g. .option("broky.servers", "host:4777")'
            )
        sdk: dict[str, Any] = {}
        if "broky.batch.size" in opts:
            sdk["batch_size"] = _number(opts, "broky.batch.size", int)
        if "broky.linger.ms" in opts:
            sdk["linger"] = _number(opts, "broky.linger.ms", float) / 1000
        return cls(
            servers=servers,
            name=opts.get("broky.client.name", "spark"),
            auth_token=opts.get("broky.auth.token") or None,
            connect_timeout=_number(opts, "broky.connect.timeout.ms", float, DEFAULT_CONNECT_TIMEOUT_MS)
            / 1000,
            flush_timeout=_number(opts, "broky.flush.timeout.ms", float, DEFAULT_FLUSH_TIMEOUT_MS) / 1000,
            sdk_options=sdk,
        )

    def connect(self, name: str) -> Any:
        """Connect to the first server that answers.

        Raises:
            BrokyConnectionError: no server answered; the message names every address tried.
        """
        import broky

        errors = []
        for server in self.servers:
            try:
                return broky.connect_sync(  # type: ignore[attr-defined]
                    server,
                    name=name,
                    auth_token=self.auth_token,
                    connect_timeout=self.connect_timeout,
                    **self.sdk_options,
                )
            except BrokyConnectionError as exc:
                errors.append(f"{server}: {exc}")
        raise BrokyConnectionError(f"broky sink: no broker reachable ({'; '.join(errors)})")


@dataclass
class BrokyCommitMessage(WriterCommitMessage):
    """What one task reports to the driver."""

    rows: int
    partition: int
    attempt: int
    seconds: float


def task_identity() -> tuple[int, int]:
    """(partition id, attempt number) of the running Spark task, or (-1, 0) outside one."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return -1, 0
    return ctx.partitionId(), ctx.attemptNumber()


def write_task(items: Iterable[Any], spec: SinkSpec, config: ClientConfig) -> BrokyCommitMessage:
    """Publish every row of one task and flush; the body of every writer's ``write``.

    Args:
        items: Arrow record batches (Arrow writers) or Spark Rows (row writers).
        spec: where each message field comes from.
        config: how to reach the broker.

    Returns:
        The task's commit message with its row count.

    Raises:
        BadColumnError: a row breaks the column rules.
        BrokyError: the broker could not be reached, or the flush did not complete.
    """
    partition, attempt = task_identity()
    started = time.perf_counter()
    rows = 0
    client = None  # connected at the first row: an empty partition costs nothing
    try:
        for item in items:
            if hasattr(item, "num_rows") and hasattr(item, "column"):  # a pyarrow.RecordBatch
                kps, keys, payloads, ts, n = spec.columns_of(item)
                if client is None:
                    client = config.connect(f"{config.name}-p{partition}-a{attempt}")
                publish = client.publish
                if ts is None:
                    for kp, key, payload in zip(kps, keys, payloads):
                        publish(kp, key, payload)
                else:
                    for kp, key, payload, t in zip(kps, keys, payloads, ts):
                        publish(kp, key, payload, ts_producer=t)
                rows += n
            else:
                kp, key, payload, t = spec.values_of(item)
                if client is None:
                    client = config.connect(f"{config.name}-p{partition}-a{attempt}")
                client.publish(kp, key, payload, ts_producer=t)
                rows += 1
        if client is not None:
            client.flush(timeout=config.flush_timeout)
    finally:
        if client is not None:
            client.close()
    return BrokyCommitMessage(rows, partition, attempt, time.perf_counter() - started)


def log_commit(messages: Iterable[BrokyCommitMessage | None], what: str) -> int:
    """Add up the tasks' counts and log the total on the driver; returns it."""
    done = [m for m in messages if m is not None]
    total = sum(m.rows for m in done)
    slowest = max((m.seconds for m in done), default=0.0)
    _ensure_handler()
    log.info(
        "broky sink: %s published %d rows in %d tasks (slowest task %.2f s)", what, total, len(done), slowest
    )
    return total


def log_abort(messages: Iterable[BrokyCommitMessage | None], what: str) -> None:
    """Log what the finished tasks of a failed write had already published."""
    done = [m for m in messages if m is not None]
    _ensure_handler()
    log.warning(
        "broky sink: %s aborted; %d finished tasks had published %d rows (they stay published)",
        what,
        len(done),
        sum(m.rows for m in done),
    )


def _ensure_handler() -> None:
    # commit/abort run in a Python worker that Spark starts for them, where
    # logging is not configured: without a handler the INFO line would vanish.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _number(opts: Mapping[str, str], name: str, kind: type, default: float | None = None) -> Any:
    raw = opts.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise SinkConfigError(f"option {name!r} must be a number, got {raw!r}") from None
    if value < 0:
        raise SinkConfigError(f"option {name!r} must not be negative, got {raw!r}")
    return value
