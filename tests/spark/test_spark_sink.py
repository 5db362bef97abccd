"""The ``broky`` Spark data source and `partition_writer` against a real broker and a real local Spark."""

from __future__ import annotations

import os
import re
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.errors import PySparkException
from pyspark.sql import Row

import broky
from bench.harness.cluster import ClusterRun, http_get
from broky.errors import BrokyTimeoutError
from broky.protocol import ksuid_text, parse_ksuid
from broky.protocol.ksuid import ksuid_time
from broky.spark import SinkWriteError, partition_writer
from broky.spark.columns import SinkSpec
from broky.spark.sink import ClientConfig, UidPlan, write_task
from tests.support import requires
from tests.support.faultproxy import FaultProxy
from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess
from tests.support.spark_fixtures import SparkLog

pytestmark = pytest.mark.spark

EVENTS = ("view", "click", "buy")
PAGE = ROOT / "docs" / "spark" / "sink.md"


@contextmanager
def subscriber(server: ServerProcess, pattern: str = ">", **options: Any) -> Iterator[Any]:
    """A blocking SDK subscription that queues everything (up to 1M messages) until drained."""
    with broky.connect_sync(f"127.0.0.1:{server.port}", name="test-sub", **options) as client:
        sub = client.subscribe(pattern, max_pending_msgs=1_000_000, max_pending_bytes=512 << 20)
        client.flush()
        yield sub


COMMIT = r"broky sink: {what} published (\d+) rows in (\d+) tasks \(([^)]*)\)"


def commits(log: SparkLog, mark: int, what: str, count: int = 1) -> list[tuple[int, int, str]]:
    """(rows, tasks, the rest) of the driver's commit lines about `what` (a regex) since `mark`."""
    found = log.wait_for(mark, COMMIT.format(what=what), count)
    return [(int(f.group(1)), int(f.group(2)), f.group(3)) for f in found]


class KillAfter:
    """A thread that takes `count` messages from `sub`, then calls `kill` (mid-write).

    The Spark write itself stays in the test's thread: a ``save()`` called from
    another Python thread does not find the ``broky`` source (PySpark 4.3).
    """

    def __init__(self, sub: Any, count: int, kill: Callable[[], None], timeout: float = 60.0) -> None:
        self.sub = sub
        self.count = count
        self.kill = kill
        self.timeout = timeout
        self.got: list[broky.Message] = []
        self.killed_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.got = list(self.sub.iter(timeout=self.timeout, count=self.count))
        if len(self.got) == self.count:
            self.kill()
            self.killed_at = time.monotonic()

    def join(self) -> list[broky.Message]:
        """The messages taken before the kill; fails unless the kill happened."""
        self.thread.join(self.timeout + 10)
        assert self.killed_at is not None, f"received {len(self.got)} of {self.count}: no kill"
        return self.got


def throttled(df: Any, pause: float, every: int = 10_000) -> Any:
    """`df` (whose payload is its row number) with a pause of `pause` s every `every` rows.

    A write that lasts long enough to be broken mid-way. A plain Python UDF
    (mapInArrow and Arrow UDFs would need pandas); Spark pipelines it into the sink's tasks.
    """
    from pyspark.sql.functions import udf

    def slow(payload: str) -> str:
        import time

        if int(payload) % every == 0:
            time.sleep(pause)
        return payload

    return df.withColumn("payload", udf(slow, "string", useArrow=False)("payload"))


def worker_index(server: ServerProcess, pid: int, timeout: float = 10.0) -> int:
    """The index of the worker that had `pid`, from the supervisor's "died" line in the server's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(rf"worker (\d+) \(pid {pid}\) died", server.log())
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no death of pid {pid} in the server's log:\n{server.log()}")


def drain(sub: Any, expected: int, idle: float = 5.0) -> list[broky.Message]:
    """Everything the subscription receives until `expected` arrived (or `idle` s of silence)."""
    got = list(sub.iter(timeout=idle, count=expected))
    got.extend(sub.iter(timeout=0.3))  # anything beyond `expected` is a duplicate or a stray
    return got


def servers(server: ServerProcess) -> str:
    return f"127.0.0.1:{server.port}"


def clickstream(spark: Any, rows: int) -> Any:
    return spark.range(rows).selectExpr(
        "CAST(id % 97 AS STRING) AS key_partition",
        "concat('clicks.', element_at(array('view', 'click', 'buy'), CAST(id % 3 AS INT) + 1)) AS key",
        "CAST(id AS STRING) AS payload",
    )


def test_batch_write_of_100k_rows_is_received_in_full(spark: Any, server: ServerProcess) -> None:
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


@pytest.mark.timeout(240)
def test_batch_write_into_a_three_node_cluster_given_several_seeds(spark: Any) -> None:
    """etcd and three nodes; the seeds list a dead address first. Every row arrives once,
    and every node took its share (the sink follows the cluster's map, not the seed)."""
    rows = 30_000
    requires.program("etcd")
    cluster = ClusterRun(1, 2)
    try:
        for node_id in ("a", "b", "c"):
            cluster.start(node_id)
        cluster.wait_settled()
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        seeds = f"{dead},{cluster.seeds('b', 'c')}"
        with broky.connect_sync(cluster.seeds("a"), name="test-sub") as client:
            sub = client.subscribe("clicks.>", max_pending_msgs=1_000_000, max_pending_bytes=512 << 20)
            client.flush()
            clickstream(spark, rows).write.format("broky").option("broky.servers", seeds).mode(
                "append"
            ).save()
            got = drain(sub, rows)
        assert sorted(int(m.payload) for m in got) == list(range(rows))
        assert len({m.uid for m in got}) == rows
        for node_id, node in cluster.nodes.items():
            metrics = http_get(node.metrics_port, "/metrics")[1].decode()
            published = sum(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("broky_messages_published_total")
            )
            assert published > rows / 10, (node_id, published)  # a third each, give or take
    finally:
        cluster.stop()


def test_options_override_columns_and_ts_producer_column(spark: Any, server: ServerProcess) -> None:
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


def stream_to_broky(stream: Any, server: ServerProcess, batches: int) -> list[dict[str, Any]]:
    """Write a streaming DataFrame to the broker until `batches` non-empty micro-batches
    are done (60 s at most), stop the query; its progress reports."""
    with tempfile.TemporaryDirectory(prefix="broky-ckpt-") as ckpt:
        query = (
            stream.writeStream.format("broky")
            .option("broky.servers", servers(server))
            .option("checkpointLocation", ckpt)
            .trigger(processingTime="500 milliseconds")
            .start()
        )
        try:
            deadline = time.monotonic() + 60
            while len([p for p in query.recentProgress if p["numInputRows"] > 0]) < batches:
                assert time.monotonic() < deadline, (
                    f"fewer than {batches} non-empty micro-batches in 60 s: {query.recentProgress}"
                )
                assert query.exception() is None
                time.sleep(0.2)
        finally:
            query.stop()
        assert query.exception() is None
        return list(query.recentProgress)


def test_streaming_write_from_the_rate_source_is_received(spark: Any, server: ServerProcess) -> None:
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
    with subscriber(server, "rate.tick") as sub:
        progress = stream_to_broky(stream, server, batches=3)
        committed = sum(p["numInputRows"] for p in progress)
        got = drain(sub, committed)
    values = {int(m.payload) for m in got}
    # the rate source numbers its rows 0, 1, 2...: every committed micro-batch arrived in full
    assert set(range(committed)) <= values, f"committed {committed}, received {len(values)}"
    assert len(got) == len(values), "no duplicates without failures"
    assert len({m.uid for m in got}) == len(got), "uids are unique across micro-batches"
    for m in got:
        assert m.key_partition == str(int(m.payload) % 10).encode()
        assert m.ts_producer is not None and abs(m.ts_producer - time.time_ns()) < 300e9


def docs_example() -> str:
    """The Spark sink's example in the docs: the first Python block of its page."""
    return PAGE.read_text().split("```python\n", 1)[1].split("```\n", 1)[0]


def test_the_docs_example_runs_as_written_and_removes_its_checkpoint(
    spark: Any, server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = docs_example()
    assert code.count('"127.0.0.1:4777"') == 2 and "query.awaitTermination(10)" in code
    code = code.replace('"127.0.0.1:4777"', f'"{servers(server)}"')
    made: list[str] = []

    class Recorded(tempfile.TemporaryDirectory[str]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self.name)

    monkeypatch.setattr(tempfile, "TemporaryDirectory", Recorded)
    with subscriber(server) as sub:
        exec(compile(code, "docs/spark/sink.md", "exec"), {})  # its own session is the tests' (getOrCreate)
        got = drain(sub, 3)
    assert sorted(m.payload for m in got if m.key.startswith(b"orders.")) == [b'{"id": 1}', b'{"id": 2}']
    assert any(m.key == b"rate.tick" for m in got), got  # the streaming query ran
    (checkpoint,) = made
    assert Path(checkpoint).name.startswith("broky-checkpoint-") and not Path(checkpoint).exists()


@pytest.mark.parametrize("column", ["key_partition", "key"])
def test_a_null_in_a_required_column_fails_the_write_naming_it(
    spark: Any,
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
    spark: Any,
    select: list[str],
    column: str,
    words: str,
) -> None:
    df = spark.range(3).selectExpr(*select)
    with pytest.raises(PySparkException, match=f"column '{column}' {words}"):
        df.write.format("broky").option("broky.servers", "127.0.0.1:9").mode("append").save()


def test_overwrite_mode_and_missing_servers_are_refused(spark: Any) -> None:
    df = spark.range(1).selectExpr("'u' AS key_partition", "'k' AS key", "'p' AS payload")
    with pytest.raises(PySparkException, match="use mode\\('append'\\)"):
        df.write.format("broky").option("broky.servers", "127.0.0.1:9").mode("overwrite").save()
    with pytest.raises(PySparkException, match=r'option "broky\.servers" is required'):
        df.write.format("broky").mode("append").save()


def test_an_unreachable_broker_fails_the_task_quickly_and_clearly(spark: Any) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(PySparkException, match=f"no broker reachable.*127.0.0.1:{port}"):
        clickstream(spark, 1000).write.format("broky").option("broky.servers", f"127.0.0.1:{port}").option(
            "broky.connect.timeout.ms", "1000"
        ).mode("append").save()
    assert time.monotonic() - started < 30


def test_partition_writer_publishes_every_row(spark: Any, server: ServerProcess) -> None:
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
    by_row: dict[bytes, list[bytes | None]] = {}
    for m in got:  # (rows of different key_partitions arrive in any order)
        by_row.setdefault(m.payload, []).append(m.uid)
    assert all(len(uids) == 3 and len(set(uids)) == 2 for uids in by_row.values()), "a retry: the same uid"
    assert len({m.uid for m in got}) == 100, "another write carries other uids"


# ---------------------------------------------------------------- what the driver logs


def test_the_driver_logs_the_total_of_a_batch_write(
    spark: Any,
    spark_log: SparkLog,
    server: ServerProcess,
) -> None:
    rows = 12_345
    df = spark.range(0, rows, numPartitions=3).selectExpr(
        "CAST(id % 97 AS STRING) AS key_partition", "'total.row' AS key", "CAST(id AS STRING) AS payload"
    )
    mark = spark_log.mark()
    with subscriber(server, "total.row") as sub:
        df.write.format("broky").option("broky.servers", servers(server)).mode("append").save()
        got = drain(sub, rows)
    [(total, tasks, rest)] = commits(spark_log, mark, "batch write")
    assert (total, tasks) == (rows, 3)
    assert "retried" not in rest
    assert len(got) == rows


def test_the_driver_logs_the_total_of_each_micro_batch(
    spark: Any,
    spark_log: SparkLog,
    server: ServerProcess,
) -> None:
    stream = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 1000)
        .option("numPartitions", 2)
        .load()
        .selectExpr("CAST(value % 10 AS STRING) AS key_partition", "'rate.total' AS key", "'x' AS payload")
    )
    mark = spark_log.mark()
    with subscriber(server, "rate.total") as sub:
        progress = stream_to_broky(stream, server, batches=2)
        inputs = {p["batchId"]: p["numInputRows"] for p in progress if p["numInputRows"] > 0}
        got = drain(sub, sum(inputs.values()))
    found = spark_log.wait_for(mark, COMMIT.format(what=r"micro-batch (\d+)"), count=len(inputs))
    totals = {int(f.group(1)): (int(f.group(2)), int(f.group(3))) for f in found}
    assert {batch: totals.get(batch, (None, 0))[0] for batch in inputs} == inputs, totals
    assert len(got) == sum(inputs.values())


# ---------------------------------------------------------------- the broker fails mid-write


def test_write_task_goes_on_through_a_worker_killed_mid_write(server: ServerProcess) -> None:
    """A worker SIGKILLed at row 50k of 200k: the SDK resends what it had not processed
    (its account says how much), and the task succeeds with every row delivered once."""
    spec = SinkSpec(None, None, "absent")
    config = ClientConfig.from_options({"broky.servers": servers(server)})
    killed: list[int] = []

    def batches() -> Iterator[pa.RecordBatch]:
        for b in range(20):
            if b == 5:
                killed.append(server.worker_pids()[0])
                os.kill(killed[0], signal.SIGKILL)
            ids = range(b * 10_000, (b + 1) * 10_000)
            yield pa.record_batch(
                {
                    "key_partition": [f"u{i % 97}" for i in ids],
                    "key": ["kill.row"] * len(ids),
                    "payload": [str(i) for i in ids],
                }
            )

    with subscriber(server, "kill.row", reconnect_min_delay=0.01, reconnect_max_delay=0.02) as sub:
        done = write_task(batches(), spec, config, UidPlan.new(streaming=False))
        got = drain(sub, 200_000)
        told = sub._client.stats.server_lost  # what the killed worker had queued for the subscriber
    assert killed and done.rows == 200_000
    payloads = [int(m.payload) for m in got]
    assert len(payloads) == len(set(payloads)), "a row arrived twice"
    assert 200_000 - len(payloads) == told, f"{200_000 - len(payloads)} rows never arrived, {told} told"


def test_write_task_sends_again_what_a_broker_that_forgot_the_connection_never_processed(
    server: ServerProcess, start_server: Callable[..., ServerProcess]
) -> None:
    """Reconnected to a broker process that never saw the lost connection (as after a
    restart of the whole broker), the SDK cannot know what was processed: it sends
    again the rows no Pong confirmed (with their uids, so that copies can be dropped),
    and the task succeeds with every row delivered."""
    other = start_server()
    proxy = FaultProxy(server.address).start()
    spec = SinkSpec(None, None, "absent")
    config = ClientConfig.from_options({"broky.servers": proxy.address})

    def batches() -> Iterator[pa.RecordBatch]:
        for b in range(20):
            if b == 5:
                proxy.stall(True)  # written from now on, never processed by `server`
            if b == 6:
                proxy.target = other.address
                proxy.cut()
                proxy.stall(False)
            ids = range(b * 10_000, (b + 1) * 10_000)
            yield pa.record_batch(
                {
                    "key_partition": [f"u{i % 97}" for i in ids],
                    "key": ["kill.row"] * len(ids),
                    "payload": [str(i) for i in ids],
                }
            )

    try:
        with subscriber(server, "kill.row") as first, subscriber(other, "kill.row") as second:
            done = write_task(batches(), spec, config, UidPlan.new(streaming=False))
            got = drain(first, 50_000) + drain(second, 150_000)
    finally:
        proxy.stop()
    assert done.rows == 200_000
    uids: dict[int, set[bytes | None]] = {}
    for m in got:
        uids.setdefault(int(m.payload), set()).add(m.uid)
    assert sorted(uids) == list(range(200_000)), "every row, at one broker or the other"
    # Rows `server` had processed before the cut, unconfirmed, went to `other` too: the
    # same row with the same uid (a subscriber of both would drop the copy).
    assert all(len(u) == 1 for u in uids.values())


@pytest.mark.parametrize(
    ("sig", "when"),
    [
        (signal.SIGTERM, "mid-write"),
        (signal.SIGKILL, "mid-write"),
        # not SIGTERM before the flush: a broker stopping gracefully may still answer it, and then
        # every row did reach it (it counts those it could not deliver as dropped at shutdown)
        (signal.SIGKILL, "before the flush"),
    ],
    ids=["SIGTERM-mid-write", "SIGKILL-mid-write", "SIGKILL-before-the-flush"],
)
def test_write_task_fails_in_bounded_time_naming_the_broker_when_it_dies(
    server: ServerProcess, sig: int, when: str
) -> None:
    spec = SinkSpec(None, None, "absent")
    config = ClientConfig.from_options(
        {
            "broky.servers": servers(server),
            "broky.flush.timeout.ms": "1500",
            "broky.connect.timeout.ms": "500",
        }
    )
    kill_at = 3 if when == "mid-write" else 10

    def kill() -> None:
        if sig == signal.SIGKILL:
            os.killpg(server.pid, signal.SIGKILL)  # master and workers at once
        else:
            server.signal(signal.SIGTERM)
            # gone before the next batch: on a loaded machine a server slow to act on the
            # signal took every row before its Goodbye, and the write rightly succeeded
            assert server.proc is not None
            server.proc.wait(10)

    def batches() -> Iterator[pa.RecordBatch]:
        for b in range(10):
            if b == kill_at:
                kill()
            yield pa.record_batch(
                {
                    "key_partition": [f"u{i}" for i in range(5_000)],
                    "key": ["die.row"] * 5_000,
                    "payload": ["x"] * 5_000,
                }
            )
        if kill_at == 10:
            kill()  # every row published, none confirmed: only the flush can tell

    started = time.monotonic()
    with pytest.raises(SinkWriteError) as info:
        write_task(batches(), spec, config, UidPlan.new(streaming=False))
    elapsed = time.monotonic() - started
    err = info.value
    text = str(err)
    assert elapsed < 15, f"took {elapsed:.1f} s"
    assert f"could not deliver to broker broky://127.0.0.1:{server.port}: " in text
    assert "the flush did not complete within 1.5 s, workers 0, 1 down" in text
    assert err.workers == (0, 1)
    assert err.rows_at_risk == err.rows_published > 0
    assert isinstance(err.__cause__, BrokyTimeoutError)


def test_a_worker_killed_mid_write_costs_no_row_and_no_retry(
    spark: Any,
    spark_log: SparkLog,
    server: ServerProcess,
) -> None:
    """The SDK settles what the killed worker had not processed (its account says
    how much it had): the tasks succeed at once and every row arrives exactly once."""
    rows = 200_000
    df = throttled(clickstream(spark, rows), pause=0.3)  # 2 tasks of 100k rows: 3 s each at least
    # the subscriber reconnects within 20 ms, long before the publishers
    fast = {"reconnect_min_delay": 0.01, "reconnect_max_delay": 0.02}
    killed: list[int] = []

    def kill_a_worker() -> None:
        killed.append(server.worker_pids()[0])
        os.kill(killed[0], signal.SIGKILL)

    mark = spark_log.mark()
    with subscriber(server, "clicks.>", **fast) as sub:
        killer = KillAfter(sub, 30_000, kill_a_worker)
        df.write.format("broky").option("broky.servers", servers(server)).mode("append").save()
        got = killer.join() + list(sub.iter(timeout=3))
        # deliveries the killed worker had queued for the subscriber are lost, and it is told
        told = sub._client.stats.server_lost
    assert killed
    uids = [m.uid for m in got]
    assert len(uids) == len(set(uids)), f"{len(uids) - len(set(uids))} rows arrived twice"
    assert rows - len(uids) == told, f"{rows - len(uids)} rows never arrived, {told} told"
    assert set(int(m.payload) for m in got) <= set(range(rows))
    [(total, tasks, rest)] = commits(spark_log, mark, "batch write")
    assert (total, tasks) == (rows, 2)
    assert "retried" not in rest and "SinkWriteError" not in spark_log.since(mark)


def test_a_broker_stopped_mid_write_fails_the_write_in_bounded_time(
    spark: Any,
    spark_log: SparkLog,
    server: ServerProcess,
) -> None:
    df = throttled(clickstream(spark, 100_000), pause=0.3)
    mark = spark_log.mark()
    with subscriber(server, "clicks.>") as sub:
        killer = KillAfter(sub, 10_000, lambda: server.signal(signal.SIGTERM))
        with pytest.raises(PySparkException) as info:
            df.write.format("broky").option("broky.servers", servers(server)).option(
                "broky.flush.timeout.ms", "2000"
            ).option("broky.connect.timeout.ms", "2000").mode("append").save()
        failed_at = time.monotonic()
        killer.join()
    assert killer.killed_at is not None
    elapsed = failed_at - killer.killed_at
    assert elapsed < 45, f"the write failed {elapsed:.1f} s after the broker stopped"
    # 3 attempts: the first loses the broker (or, for a task that had not started, cannot connect), the
    # others cannot connect (2 s each: the first attempt's 2 s flush timeout ends first); the job's error
    # is the last one
    assert f"127.0.0.1:{server.port}" in str(info.value)
    # attempt 0 names the broker and why, whichever the stop hit first: its flush timed out
    # with the workers down, a connection dropped with publishes not yet confirmed, or the
    # reconnect buffer of a down worker filled up
    failures = spark_log.wait_for(
        mark,
        r"SinkWriteError: broky sink: Spark partition \d \(attempt 0\) could not deliver to broker "
        rf"broky://127\.0\.0\.1:{server.port}: (the flush did not complete within 2 s, workers? [\d, ]+ down"
        r"|the connection to workers? [\d, ]+ dropped before the server confirmed every publish"
        r"|workers? [\d, ]+ down, and the publishes waiting for it filled the reconnect buffer)",
    )
    assert failures, spark_log.since(mark)[-5000:]


# ---------------------------------------------------------------- timestamps


@pytest.mark.parametrize(
    ("column", "spark_type"),
    [
        ("timestamp_micros(1767323045123456)", "timestamp"),
        ("make_timestamp_ntz(2026, 1, 2, 3, 4, 5.123456)", "timestamp_ntz"),
    ],
)
def test_timestamps_give_the_same_ts_producer_through_arrow_batches_and_rows(
    spark: Any,
    server: ServerProcess,
    column: str,
    spark_type: str,
) -> None:
    """A TIMESTAMP is its instant, a TIMESTAMP_NTZ its wall-clock as UTC, on both paths.

    The session's time zone and the Python workers' are both away from UTC (see
    tests/support/spark_fixtures.py), so a value read in the wrong zone is hours off.
    """
    expected = int(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()) * 10**9 + 123_456_000
    df = spark.range(0, 4, numPartitions=2).selectExpr(
        "CAST(id AS STRING) AS key_partition", "CAST(id AS STRING) AS payload", f"{column} AS ts_producer"
    )
    assert df.schema["ts_producer"].dataType.simpleString() == spark_type
    with subscriber(server, "ts.*") as sub:
        df.write.format("broky").option("broky.servers", servers(server)).option("key", "ts.arrow").mode(
            "append"
        ).save()
        df.foreachPartition(partition_writer(servers(server), key="ts.rows", schema=df.schema))
        got = drain(sub, 8)
    assert (
        sorted((m.key, m.ts_producer) for m in got)
        == [(b"ts.arrow", expected)] * 4 + [(b"ts.rows", expected)] * 4
    )
