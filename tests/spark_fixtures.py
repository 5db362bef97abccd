"""One local Spark session for the whole test run (import `spark` into a test module).

``local[2]`` with the UI off, few shuffle partitions and WARN logging, so it
starts in seconds and stays quiet. Spark's Python workers run this very
interpreter (``PYSPARK_PYTHON``), which has pyarrow and broky installed. At the
end the session is stopped and the JVM that PySpark launched is ended by its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


def _start_session(warehouse: str) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
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
        .getOrCreate()
    )
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


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[2] SparkSession with the ``broky`` and ``broky_discard`` sinks registered."""
    import broky.spark

    with tempfile.TemporaryDirectory(prefix="broky-spark-") as warehouse:
        session = _start_session(warehouse)
        try:
            broky.spark.register(session, discard=True)
            yield session
        finally:
            stop_session(session)
