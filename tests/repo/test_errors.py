"""Every exception class Broky defines is a BrokyError (broky.errors).

So one `except BrokyError` catches whatever Broky raises, and an error is
caught by its class, never by its name. Each class keeps its other bases
(ValueError, ConnectionError, TimeoutError) for callers that catch those.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import broky
from broky.errors import BrokyError

# Exception classes of broky/ that are not BrokyErrors, each with why. None today:
# even the ones that never leave their module (master's _WorkerGone, node's
# _Yielded) are BrokyErrors, as nothing is gained by an exception.
NOT_BROKY_ERRORS: dict[str, str] = {}
SKIPPED = {"broky.__main__": "importing it runs the CLI"}


def modules() -> Iterator[ModuleType]:
    """Every module of the broky package (its C twins too), imported."""
    for info in pkgutil.walk_packages(broky.__path__, "broky."):
        if info.name not in SKIPPED:
            yield importlib.import_module(info.name)


def exception_classes() -> dict[str, type[BaseException]]:
    """'module.Class' -> each exception class defined at the top of a broky module."""
    found = {}
    for module in modules():
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_exception_class_of_broky_is_a_broky_error() -> None:
    found = exception_classes()
    # the walk reaches every part of the package: SDK, server, cluster, Spark
    assert {
        "broky.errors.SlowConsumerError",
        "broky.server.master.process.Refused",
        "broky.server.http.server.HttpError",
        "broky.cluster.etcd.EtcdError",
        "broky.cluster.node.NodeIdInUse",
        "broky.spark.offsets.OffsetError",
        "broky.spark.sink.SinkWriteError",
    } <= set(found)
    strays = sorted(
        n for n, cls in found.items() if not issubclass(cls, BrokyError) and n not in NOT_BROKY_ERRORS
    )
    assert strays == []
    assert set(NOT_BROKY_ERRORS) <= set(found)  # no stale entry


def test_the_value_errors_are_still_value_errors() -> None:
    found = exception_classes()
    for name in (
        "spark.offsets.OffsetError",
        "spark.source.SourceConfigError",
        "spark.columns.BadColumnError",
    ):
        assert issubclass(found[f"broky.{name}"], ValueError), name


def test_a_shutdown_says_its_reason_once() -> None:
    from broky.errors import ServerShutdownError

    # what broky serve sends says nothing more than the class: not "shutting down: server shutting down"
    assert str(ServerShutdownError("server shutting down")) == "the server is shutting down"
    assert str(ServerShutdownError("")) == "the server is shutting down"
    assert str(ServerShutdownError("drained")) == "the server is shutting down: drained"
