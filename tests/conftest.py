from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.cluster import cluster  # noqa: F401  (real etcd and cluster nodes: see there)
from tests.serverproc import ServerProcess
from tests.spark_fixtures import spark, spark_log  # noqa: F401  (one session for every module: see there)


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
