"""One local Spark session for the whole test run (the `spark` fixture, in conftest.py).

The fixtures are registered once, in tests/conftest.py: a session-scoped
fixture imported into two test modules would be two fixtures, the second
getting the first's session (getOrCreate) with a log file its JVM never writes.

``local[2,3]``: two cores, and a failed task is tried up to 3 times, as on a
cluster (plain ``local[2]`` never retries), so the sink's at-least-once path
runs for real; a test that expects a write to fail pays for 3 attempts, so it
keeps its timeouts short. The UI is off, few shuffle partitions and WARN
logging, so it starts in seconds and stays quiet. Spark's Python workers run
this very interpreter (``PYSPARK_PYTHON``), which has pyarrow and broky
installed. Time zones are set away from UTC and from each other (the session's
for Arrow batches, the Python workers' local time for Spark Rows), so a
timestamp taken in the wrong zone shows. The JVM's stderr (Spark's WARN log,
and everything Spark's Python workers print or log, such as the sink's commit
lines and failed tasks' tracebacks) goes to a file that tests read through the
`spark_log` fixture. At the end the session is stopped and the JVM that PySpark
launched is ended by its pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MASTER = "local[2,3]"  # 2 cores, 3 attempts per task
SESSION_TIME_ZONE = "Asia/Kolkata"  # UTC+05:30
WORKER_TIME_ZONE = "America/Sao_Paulo"  # UTC-03:00, no daylight saving time since 2019


class SparkLog:
    """The stderr of the session's JVM and of its Python workers, in a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        """Where the log ends now; pass it to `since` or `wait_for`."""
        return self.path.stat().st_size

    def since(self, mark: int) -> str:
        with self.path.open("rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def wait_for(self, mark: int, pattern: str, count: int = 1, timeout: float = 10.0) -> list[re.Match[str]]:
        """The matches of `pattern` after `mark`, once there are `count` of them.

        Python workers' output reaches the file through a JVM thread, a moment
        after the Spark call that caused it has returned: poll for it.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = list(re.finditer(pattern, self.since(mark)))
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def _start_session(warehouse: str, log: Path) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(MASTER)
        .appName("broky-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.warehouse.dir", warehouse)
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .config("spark.sql.session.timeZone", SESSION_TIME_ZONE)
        .config("spark.executorEnv.TZ", WORKER_TIME_ZONE)
    )
    # the JVM inherits this process's fd 2 when PySpark launches it: point it at the log meanwhile
    saved = os.dup(2)
    try:
        with log.open("ab") as out:
            os.dup2(out.fileno(), 2)
            spark = builder.getOrCreate()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    spark.sparkContext.setLogLevel("WARN")
    return spark


def stop_session(spark: Any) -> None:
    """Stop the session and end the JVM PySpark started, by its pid."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
    spark.stop()
    if gateway is not None:
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc is not None:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


_log: SparkLog | None = None


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[2,3] SparkSession with the ``broky`` and ``broky_discard`` sinks registered."""
    import broky.spark

    global _log
    with tempfile.TemporaryDirectory(prefix="broky-spark-") as warehouse:
        path = Path(warehouse) / "spark-stderr.log"
        session = _start_session(warehouse, path)
        _log = SparkLog(path)
        try:
            broky.spark.register(session, discard=True)
            yield session
        finally:
            _log = None
            stop_session(session)


@pytest.fixture
def spark_log(spark: Any) -> SparkLog:
    """The session's stderr log (see `SparkLog`); import it with `spark`."""
    assert _log is not None
    return _log
