"""What one Spark task does: open a client, publish every row, flush, count.

Theory of operation
-------------------
A write is planned on the driver and run by tasks in the executors' Python
workers. Every task runs its own asyncio SDK client (`broky.connect`) on an
event loop of its own (uvloop), driven from the task's thread: no I/O thread,
no lock per row. The client is shard-aware: it reads the vbucket map and sends each message straight
to the worker that owns its key_partition, with the SDK's batching (options
``broky.batch.size`` and ``broky.linger.ms``, like Kafka's). The task publishes
every row, then flushes: the flush returns once every worker connection has
answered a Ping sent after the last publish, so every message has reached the
server when the task reports success. Its commit message carries its row count;
the driver adds them up and logs the total of each batch (or micro-batch).

Delivery is at-least-once. Any error (a bad row, the broker unreachable, a
connection lost that the SDK could not settle) raises, the task fails and
Spark may run it again (``spark.task.maxFailures``; local mode does not retry
unless the master is ``local[N,F]``). A connection to a worker that drops while
the task publishes (the network, or the worker died and was restarted) costs
nothing: on the reconnect the server's account of the lost connection tells
the SDK which publishes it processed, and the SDK sends the others again
(schema/README.md section 7.1). Only when the server has no account of it (the
whole broker restarted) may written but unconfirmed publishes be lost; the
SDK counts them (``stats.unconfirmed_lost``) and its flush raises. The task checks
that count after every Arrow batch (or 1024 Rows): once it is not zero the task
cannot succeed, so it stops publishing, flushes at once (the flush waits for
the worker to come back, within the flush timeout, then raises) and fails with
a `SinkWriteError` naming the broker, the workers and how many rows may be
lost; the SDK's error is its ``__cause__``. The same for a broker that is gone:
the reconnect buffer fills (PublishBufferFullError) or the flush times out.

A retried task publishes its rows again, so subscribers may see a message
twice, with the same `uid`: the sink sets each message's uid (a valid KSUID)
itself, deterministically::

    uid = 4 bytes  KSUID seconds when the write was planned (driver)
        + 8 bytes  write id: a hash of a random number drawn when the write was
                   planned and the Spark stage id; for streaming, a hash of
                   the query id and the micro-batch id
        + 8 bytes  little-endian (Spark partition id << 32) + row index within
                   the partition (like the SDK's own KSUID counters, so the
                   uid is packed as a counter: no bytes made per row)

A retry of a task reads the same partition in the same order (Spark's
contract for deterministic input) and so republishes the same uids: consumers
drop duplicates by uid. A micro-batch replayed after a streaming query
restarts was planned at another second; its uids differ in their first 4
bytes only, so a consumer of a streaming sink that must survive restarts
deduplicates on ``uid[4:]``.

Nothing here waits without a bound: connecting gives up after
``broky.connect.timeout.ms``, and the final flush after ``broky.flush.timeout.ms``
(default 10 s, the SDK's own default, not Kafka's minutes: the flush comes after
the last publish, which the socket's back-pressure already paced, so a healthy
broker answers it in milliseconds, and a worker restarted by the server is back
in about a second; a broker that is gone fails the task within those 10 s, and
Spark's retry, not a longer wait, is what brings the rows through).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import WriterCommitMessage

from broky.errors import BrokyConnectionError, BrokyError, BrokyTimeoutError, PublishBufferFullError
from broky.spark.columns import SinkConfigError, SinkSpec

log = logging.getLogger("broky.spark")

DEFAULT_CONNECT_TIMEOUT_MS = 5_000
DEFAULT_FLUSH_TIMEOUT_MS = 10_000  # see the module's docstring
KSUID_EPOCH = 1_400_000_000


class SinkWriteError(BrokyError):
    """A task could not confirm that its rows reached the broker; Spark may retry it.

    Raised by `write_task` from the SDK's error (its ``__cause__``): a connection
    dropped with publishes unconfirmed, a worker stayed down until the reconnect
    buffer filled, or the final flush timed out.

    Attributes:
        server: the broker the task was connected to (``broky://host:port``).
        workers: the workers whose connection dropped during the task (or, for a
            timeout, that were down), sorted; empty if none did.
        rows_at_risk: rows that may not have reached the server.
        rows_published: rows the task had handed to the SDK when it failed.
        partition: the Spark partition id (-1 outside a task).
        attempt: the task's attempt number (0 for the first).
    """

    def __init__(
        self,
        reason: str,
        *,
        server: str,
        workers: tuple[int, ...],
        rows_at_risk: int,
        rows_published: int,
        partition: int,
        attempt: int,
        cause: BaseException,
    ) -> None:
        super().__init__(
            f"broky sink: Spark partition {partition} (attempt {attempt}) could not deliver to broker "
            f"{server}: {reason}; {rows_at_risk} of the {rows_published} rows it published may be lost. "
            "The task fails so that Spark retries it (at-least-once: a retry republishes the same "
            f"uids). Cause: {type(cause).__name__}: {cause}"
        )
        self.server = server
        self.workers = workers
        self.rows_at_risk = rows_at_risk
        self.rows_published = rows_published
        self.partition = partition
        self.attempt = attempt


@dataclass(frozen=True)
class ClientConfig:
    """The SDK settings every task uses; built on the driver from the options.

    Attributes:
        servers: ``host:port`` seeds (option ``broky.servers``, comma-separated, like
            Kafka's ``bootstrap.servers``): any node of a cluster, or the one server.
        name: client name prefix; each task appends its partition and attempt.
        auth_token: option ``broky.auth.token``; or, for a user of the server's users
            file (--users), ``broky.auth.user`` and ``broky.auth.password`` (USER:PASSWORD).
        connect_timeout: seconds, option ``broky.connect.timeout.ms``.
        flush_timeout: seconds, option ``broky.flush.timeout.ms``.
        sdk_options: passed to `broky.connect` as is (``batch_size``, ``linger``).
        tls_ca, tls_cert, tls_key: PEM files (options ``broky.tls.ca``, ``broky.tls.cert``,
            ``broky.tls.key``), read on each executor: any of them means TLS, as do
            ``broky+tls://`` seeds (then the system's CAs) or ``broky.tls`` = true.
    """

    servers: tuple[str, ...]
    name: str = "spark"
    auth_token: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_MS / 1000
    flush_timeout: float = DEFAULT_FLUSH_TIMEOUT_MS / 1000
    sdk_options: Mapping[str, Any] = field(default_factory=dict)
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

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
            auth_token=(
                f"{opts['broky.auth.user']}:{opts.get('broky.auth.password', '')}"  # a user (--users)
                if opts.get("broky.auth.user")
                else opts.get("broky.auth.token") or None
            ),
            connect_timeout=_number(opts, "broky.connect.timeout.ms", float, DEFAULT_CONNECT_TIMEOUT_MS)
            / 1000,
            flush_timeout=_number(opts, "broky.flush.timeout.ms", float, DEFAULT_FLUSH_TIMEOUT_MS) / 1000,
            sdk_options=sdk,
            tls=opts.get("broky.tls", "false").strip().lower() in ("true", "1", "yes"),
            tls_ca=opts.get("broky.tls.ca") or None,
            tls_cert=opts.get("broky.tls.cert") or None,
            tls_key=opts.get("broky.tls.key") or None,
        )

    def ssl_context(self) -> Any:
        """The ssl.SSLContext of the TLS options (made where the client runs), or None."""
        if not (self.tls or self.tls_ca or self.tls_cert):
            return None
        import ssl

        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    async def connect(self, name: str, **callbacks: Any) -> Any:
        """Connect through the seeds (the SDK tries them in turn); return the asyncio client.

        Args:
            name: the client's name.
            **callbacks: the SDK's ``on_disconnect``, ``on_reconnect``...

        Raises:
            BrokyConnectionError: no server answered; the message names every address tried.
        """
        import broky

        try:
            return await broky.connect(
                ",".join(self.servers),
                name=name,
                auth_token=self.auth_token,
                ssl_context=self.ssl_context(),
                connect_timeout=self.connect_timeout,
                flush_timeout=self.flush_timeout,
                **self.sdk_options,
                **callbacks,
            )
        except BrokyConnectionError as exc:
            raise BrokyConnectionError(f"broky sink: no broker reachable ({exc})") from None


@dataclass(frozen=True)
class UidPlan:
    """The first 12 bytes of every uid of one write, fixed on the driver.

    Attributes:
        seconds: KSUID time (seconds since 1400000000) when the write was planned.
        nonce: random bytes drawn on the driver; None for streaming, where each
            task derives the write id from the query id and micro-batch id.
    """

    seconds: int
    nonce: bytes | None

    @classmethod
    def new(cls, streaming: bool) -> UidPlan:
        seconds = max(0, int(time.time()) - KSUID_EPOCH)
        return cls(seconds, None if streaming else os.urandom(16))

    def prefix(self, partition: int) -> tuple[bytes, int]:
        """The first 12 bytes of every uid of one task, and the counter of its row 0
        (the uid's last 8 bytes, little-endian: partition << 32, plus the row index).

        The stage id keeps two jobs apart that reuse one writer (a function given
        to ``foreachPartition`` twice); a retried task keeps its stage id.
        """
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.nonce is None:
            query, batch = task_property("sql.streaming.queryId"), task_property("streaming.sql.batchId")
            key = f"{query}/{batch}".encode()
        else:
            key = self.nonce + str(-1 if ctx is None else ctx.stageId()).encode()
        write_id = hashlib.blake2b(key, digest_size=8).digest()
        return struct.pack(">I8s", self.seconds, write_id), (partition & 0xFFFFFFFF) << 32


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


def task_property(name: str) -> str | None:
    """A local property of the running Spark task (None outside a task)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return None if ctx is None else ctx.getLocalProperty(name)


def write_task(
    items: Iterable[Any], spec: SinkSpec, config: ClientConfig, uids: UidPlan | None = None
) -> BrokyCommitMessage:
    """Publish every row of one task and flush; the body of every writer's ``write``.

    Args:
        items: Arrow record batches (Arrow writers) or Spark Rows (row writers).
        spec: where each message field comes from.
        config: how to reach the broker.
        uids: how to make each message's uid; None: the SDK's random KSUIDs.

    Returns:
        The task's commit message with its row count.

    Raises:
        BadColumnError: a row breaks the column rules.
        BrokyConnectionError: no broker could be reached (the message names every address).
        SinkWriteError: rows may not have reached the broker (a connection dropped,
            a worker stayed down, the flush timed out); the SDK's error is its cause.
    """
    partition, attempt = task_identity()
    started = time.perf_counter()
    prefix = uids.prefix(partition) if uids is not None else None
    rows = 0
    loop = None
    client = None  # connected at the first row: an empty partition costs nothing
    watch = _Watch()
    failure: BrokyError | None = None
    try:
        for kps, keys, payloads, ts, n in _chunks(items, spec):
            if client is None:
                import uvloop

                loop = uvloop.new_event_loop()
                client = loop.run_until_complete(
                    config.connect(
                        f"{config.name}-p{partition}-a{attempt}",
                        on_disconnect=watch.on_disconnect,
                        on_reconnect=watch.on_reconnect,
                    )
                )
            loop.run_until_complete(  # type: ignore[union-attr]
                client.publish_rows(
                    kps,
                    keys,
                    payloads,
                    ts,
                    None if prefix is None else prefix[0],
                    0 if prefix is None else prefix[1] + rows,
                )
            )
            rows += n
            if client.stats.unconfirmed_lost:
                break  # this task cannot succeed: let the flush below raise the SDK's error now
        if client is not None:
            loop.run_until_complete(client.flush(timeout=config.flush_timeout))  # type: ignore[union-attr]
            if client.stats.unconfirmed_lost:  # the flush above raises first; never report success
                raise BrokyConnectionError(f"{client.stats.unconfirmed_lost} publishes unconfirmed")
    except (BrokyConnectionError, BrokyTimeoutError, PublishBufferFullError) as exc:
        if client is None:
            raise  # could not connect: that error names every address tried
        failure = exc
    finally:
        if loop is not None:
            if client is not None:
                loop.run_until_complete(client.close())
            loop.close()
    if failure is not None:
        raise watch.error(failure, client, config, partition, attempt) from failure
    return BrokyCommitMessage(rows, partition, attempt, time.perf_counter() - started)


class _Watch:
    """What the SDK tells one task through its callbacks (they run on the task's loop)."""

    def __init__(self) -> None:
        self.dropped: set[int] = set()  # workers whose connection dropped during the task
        self.down: set[int] = set()  # ... and have not reconnected yet

    def on_disconnect(self, ref: Any, exc: BaseException | None) -> None:
        self.dropped.add(ref.worker)
        self.down.add(ref.worker)

    def on_reconnect(self, ref: Any) -> None:
        self.down.discard(ref.worker)

    def error(
        self, exc: BrokyError, client: Any, config: ClientConfig, partition: int, attempt: int
    ) -> SinkWriteError:
        """The task's error for an SDK error, once the client is closed (its counts are final)."""
        stats = client.stats
        published = stats.published
        # written to a connection that dropped before a Pong confirmed them, or
        # still buffered for a worker that was down at close()
        at_risk = stats.unconfirmed_lost + stats.unsent_on_close
        workers = sorted(self.dropped)
        if isinstance(exc, PublishBufferFullError):
            workers = sorted(self.down or self.dropped)
            reason = (
                f"{_workers(workers)} down, and the publishes waiting for it filled the reconnect "
                f"buffer ({exc.pending_bytes} bytes, limit {exc.limit})"
            )
        elif isinstance(exc, BrokyTimeoutError):
            workers = sorted(self.down)
            down = f", {_workers(workers)} down" if workers else ""
            reason = f"the flush did not complete within {config.flush_timeout:g} s{down}"
            at_risk = published  # no flush confirmed any of them
        elif workers:
            reason = (
                f"the connection to {_workers(workers)} dropped before the server confirmed every publish"
            )
        else:
            reason = "a connection failed"
        return SinkWriteError(
            reason,
            server=str(client.address),
            workers=tuple(workers),
            rows_at_risk=min(at_risk, published),
            rows_published=published,
            partition=partition,
            attempt=attempt,
            cause=exc,
        )


def _workers(workers: list[int]) -> str:
    if not workers:
        return "a worker"
    if len(workers) == 1:
        return f"worker {workers[0]}"
    return "workers " + ", ".join(map(str, workers))


ROW_CHUNK = 1024  # Spark Rows published per turn of the task's event loop


def _chunks(
    items: Iterable[Any], spec: SinkSpec
) -> Iterator[tuple[list[Any], list[Any], list[Any], Any, int]]:
    """(key_partitions, keys, payloads, ts_producers or None, count) per Arrow batch
    or per ROW_CHUNK Spark Rows, checked by the column rules."""
    kps: list[Any] = []
    keys: list[Any] = []
    payloads: list[Any] = []
    ts: list[Any] = []
    for item in items:
        if hasattr(item, "num_rows") and hasattr(item, "column"):  # a pyarrow.RecordBatch
            yield spec.columns_of(item)
            continue
        kp, key, payload, t = spec.values_of(item)
        kps.append(kp)
        keys.append(key)
        payloads.append(payload)
        ts.append(t)
        if len(kps) >= ROW_CHUNK:
            yield kps, keys, payloads, ts, len(kps)
            kps, keys, payloads, ts = [], [], [], []
    if kps:
        yield kps, keys, payloads, ts, len(kps)


def log_commit(messages: Iterable[BrokyCommitMessage | None], what: str) -> int:
    """Add up the tasks' counts and log the total on the driver; returns it."""
    done = [m for m in messages if m is not None]
    total = sum(m.rows for m in done)
    slowest = max((m.seconds for m in done), default=0.0)
    retried = sum(1 for m in done if m.attempt > 0)
    again = f", {retried} of them retried: subscribers may see duplicates, same uid" if retried else ""
    _ensure_handler()
    log.info(
        "broky sink: %s published %d rows in %d tasks (slowest task %.2f s%s)",
        what,
        total,
        len(done),
        slowest,
        again,
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
    # logging is not configured: without a handler and the INFO level the line
    # would vanish. With spark.sql.pyspark.worker.logging.enabled (PySpark 4.1+)
    # Spark puts a handler on the root logger (its level stays WARNING) and
    # collects a batch commit's records in spark.tvf.python_worker_logs() (in
    # PySpark 4.3 a streaming commit's are lost that way).
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


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
