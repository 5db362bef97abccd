"""Example pipeline: Spark generates a clickstream and pushes it into Broky.

    .venv/bin/python examples/clickstream.py                 # starts its own broky serve
    .venv/bin/python examples/clickstream.py --server 127.0.0.1:4777 --events 200000

Spark (``local[2]``) generates ``--events`` synthetic click events, one per
row: key_partition = the user id (``user-42``), key = the event type
(``clicks.view``, ``clicks.click``, ``clicks.add_to_cart``, ``clicks.purchase``)
and a small JSON payload. The ``broky`` data source publishes them while a
subscriber of ``clicks.>`` in this process counts what arrives, and the count
per event type is printed. Without ``--server`` it starts ``broky serve`` on
free loopback ports and stops it at the end. It exits 1 if any event is
missing, saying how many the server reported dropping.

What its two rates measure, both end to end and both on one machine whose
cores Spark's JVM, Spark's Python workers, the broker and the subscriber share:
``spark wrote`` is the events over the wall time of ``df.write...save()``, a
fresh Spark session's first job (starting its Python workers, generating the
rows, publishing them, each task's flush); ``subscriber received`` is the
events received over the time from the start of that write to the last one
received. Neither is the server's rate, nor the sink's rate measured by
``python -m bench.spark_bench`` (warmed up, nobody subscribed: see the
benchmarks' page).

Spark publishes the events faster than one Python subscriber reads them while
they share the cores, so the subscriber falls behind. The server queues up to
``--max-pending-bytes`` for its connection (4 MiB by default); past it the
connection lags: the server sends it the rest from its replay buffer as it
reads (``--replay-bytes``, 192 MiB per worker by default, holds the whole
default burst of 1M events of about 230 bytes even if the subscriber read
nothing until Spark is done; what the buffer evicted first would be told with
its count). The example's own server runs on the defaults; with ``--server``,
that server's settings apply.

It needs PySpark (the ``spark`` extra) and a Java runtime: ``./run test``
installs both; after ``./run serve`` alone, ``.venv/bin/pip install -e
".[spark]"`` and Debian's ``openjdk-17-jre-headless``. Without them it says so
and exits 1. Spark's scratch directory is a temporary one, removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

READY = re.compile(rb"listening on (\S+):(\d+)")
EVENT_TYPES = ("view", "click", "add_to_cart", "purchase")


def start_server(workers: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``broky serve`` on a free port; return it and its ``host:port``."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broky",
            "serve",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--workers",
            str(workers),
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        match = READY.search(line)
        if match:
            return proc, f"{match.group(1).decode()}:{match.group(2).decode()}"
    stop_server(proc)
    raise SystemExit("broky serve did not start")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    try:  # the workers share the server's process group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.stdout is not None:
        proc.stdout.close()


class Counter:
    """Counts what a ``clicks.>`` subscription receives.

    An asyncio client with a plain callback (called inline by the reader, no
    queue) on an event loop of its own thread, so counting keeps up with the
    publishers.
    """

    def __init__(self, server: str, expected: int) -> None:
        self.expected = expected
        self.by_type: collections.Counter[bytes] = collections.Counter()
        self.received = 0
        self.lost_reported = 0
        self.first = self.last = 0.0
        self.ready = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(server,), name="counter", daemon=True)
        self.thread.start()
        if not self.ready.wait(30) or self.error is not None:
            raise SystemExit(f"the subscriber could not start: {self.error}")

    def _on_message(self, msg: Any) -> None:
        self.last = time.perf_counter()
        if not self.received:
            self.first = self.last
        self.received += 1
        self.by_type[msg.key] += 1
        if self.received + self.lost_reported >= self.expected:
            self.done.set()

    def _on_loss(self, worker: Any, dropped: int, reason: int) -> None:
        self.lost_reported += dropped  # the server told us it dropped deliveries to us
        if self.received + self.lost_reported >= self.expected:  # every event accounted for
            self.done.set()

    def _run(self, server: str) -> None:
        import asyncio

        import uvloop

        import broky

        async def main() -> None:
            async with broky.connect(server, name="clickstream-counter", on_loss=self._on_loss) as client:
                await client.subscribe("clicks.>", callback=self._on_message)
                await client.flush()
                self.ready.set()
                while not self.done.is_set():
                    await asyncio.sleep(0.05)

        try:
            uvloop.run(main())
        except BaseException as exc:  # reported by __init__ or wait
            self.error = exc
            self.ready.set()

    def wait(self, timeout: float) -> None:
        self.done.wait(timeout)
        self.done.set()
        self.thread.join(10)


def missing() -> str | None:
    """What Spark needs that this machine lacks, or None."""
    if importlib.util.find_spec("pyspark") is None:
        return "PySpark is not installed (the spark extra)"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime (java is not on PATH and JAVA_HOME is not set)"
    return None


def spark_session(partitions: int, scratch: str) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{partitions}]")
        .appName("broky-clickstream")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(partitions))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.warehouse.dir", scratch)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def clickstream(spark: Any, events: int, users: int, partitions: int) -> Any:
    """``events`` rows: key_partition = user id, key = event type, a JSON payload."""
    types = ", ".join(f"'{t}'" for t in EVENT_TYPES)
    return spark.range(0, events, numPartitions=partitions).selectExpr(
        f"concat('user-', CAST(pmod(xxhash64(id), {users}) AS STRING)) AS key_partition",
        f"concat('clicks.', element_at(array({types}),"
        f" CAST(pmod(xxhash64(id, 7), {len(EVENT_TYPES)}) AS INT) + 1)) AS key",
        "to_json(named_struct('event', id, 'page', concat('/product/', CAST(id % 500 AS STRING)),"
        " 'session', CAST(pmod(xxhash64(id, 3), 100000) AS INT))) AS payload",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="host:port of a running broker (default: start one)")
    parser.add_argument("--events", type=int, default=1_000_000, help="rows to generate (default 1M)")
    parser.add_argument("--users", type=int, default=10_000, help="distinct user ids (default 10k)")
    parser.add_argument("--partitions", type=int, default=2, help="Spark partitions and cores (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the broker it starts (default 2)")
    args = parser.parse_args(argv)
    lacking = missing()
    if lacking is not None:
        print(
            f"clickstream.py: {lacking}. ./run test installs what Spark needs; after ./run serve alone: "
            ".venv/bin/pip install -e '.[spark]' and a Java runtime "
            "(Debian: apt-get install openjdk-17-jre-headless)",
            file=sys.stderr,
        )
        return 1

    import broky.spark

    proc = None
    server = args.server
    if server is None:
        proc, server = start_server(args.workers)
        print(f"started broky serve on {server} (pid {proc.pid})")
    spark = None
    scratch = tempfile.mkdtemp(prefix="broky-clickstream-")
    try:
        spark = spark_session(args.partitions, scratch)
        broky.spark.register(spark)
        df = clickstream(spark, args.events, args.users, args.partitions)
        counter = Counter(server, args.events)
        started = time.perf_counter()
        df.write.format("broky").option("broky.servers", server).mode("append").save()
        written = time.perf_counter() - started
        counter.wait(60)  # for the last events in flight: ends once each is received or reported lost
        delivered = (counter.last or time.perf_counter()) - started  # to the last event received
        print(f"spark wrote {args.events:,} events in {written:.2f} s: {args.events / written:,.0f} rows/s")
        print(
            f"subscriber received {counter.received:,} events in {delivered:.2f} s: "
            f"{counter.received / delivered:,.0f} rows/s"
        )
        for key, n in sorted(counter.by_type.items()):
            print(f"  {key.decode():<22} {n:>9,}")
        lost = args.events - counter.received
        if lost:
            print(
                f"MISSING {lost:,} events ({counter.lost_reported:,} reported dropped by the server: "
                "deliveries the subscriber had not read when its connection's queue reached the server's "
                "--max-pending-bytes; raise it, or lower --events)",
                file=sys.stderr,
            )
            return 1
        return 0
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
