from __future__ import annotations

import compileall
import sys
from collections.abc import Callable, Iterator

import pytest

from tests.support.cluster import cluster  # noqa: F401  (real etcd and cluster nodes: see there)
from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess
from tests.support.shardkit import loop  # noqa: F401  (the event loop a shard in this process runs on)
from tests.support.spark_fixtures import spark, spark_log  # noqa: F401  (one session for every module: see there)
from tests.support.tls import certs  # noqa: F401  (a throw-away CA and certificates, one per module)
from tests.support.wire import opened  # noqa: F401  (the raw wires a test opens, closed after it)


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the project once, before any test starts a Python process.

    The tests start well over a thousand Python processes (every `broky serve` is a
    master and its workers; CLIs, SDK programs, Spark's Python workers, bench runs), and
    each imports broky. Under PYTHONDONTWRITEBYTECODE=1 (set on the machines CI runs on,
    as in many container images) no import writes its .pyc, so each of them compiled
    every module it imported from source: ~0.15 s of CPU per process, 30 % of the time of
    a file of server tests. Importing reads .pyc files whatever that variable says; this
    writes them (into the __pycache__ directories git ignores), once: an up-to-date file
    costs a stat. Not in xdist's workers (their controller did it), nor when Python
    writes .pyc itself anyway.
    """
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):
        for name in ("broky", "bench", "examples", "tests"):
            compileall.compile_dir(ROOT / name, quiet=1)


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """Factory: start_server(*extra_args, workers=2) -> a ready ServerProcess."""
    started: list[ServerProcess] = []

    def start(*args: str, workers: int = 2, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(*args, workers=workers, env=env)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A real `broky serve` with 2 workers on free loopback ports."""
    return start_server()
