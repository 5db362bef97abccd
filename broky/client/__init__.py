"""The Broky client SDK: asyncio (`connect`, `Client`) and blocking (`connect_sync`).

Its names are imported when first used, not with the package: `broky pub --help`
imports broky.client.url and broky.client.cli without asyncio and the codec
(broky.cli's start-up), and `broky.client.X` still works for every name below.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broky.client.client import Client, ClientStats, ServerInfo, WorkerRef, connect
    from broky.client.groups import GroupMessage
    from broky.client.inbox import Lag
    from broky.client.reader import RangeEnd, Reading, ReadResult, ReadVia
    from broky.client.subscription import Subscription
    from broky.client.sync import SyncClient, SyncSubscription, connect_sync
    from broky.client.url import ServerAddress, parse_server, parse_servers

_MODULES = {
    "Client": "client", "ClientStats": "client", "ServerInfo": "client", "WorkerRef": "client",
    "connect": "client", "GroupMessage": "groups", "Lag": "inbox", "RangeEnd": "reader", "Reading": "reader",
    "ReadResult": "reader", "ReadVia": "reader", "Subscription": "subscription",
    "SyncClient": "sync", "SyncSubscription": "sync", "connect_sync": "sync",
    "ServerAddress": "url", "parse_server": "url", "parse_servers": "url",
}  # fmt: skip

if not TYPE_CHECKING:  # (mypy reads the imports above)

    def __getattr__(name: str) -> Any:
        import importlib

        module = _MODULES.get(name)
        if module is None:
            raise AttributeError(f"module 'broky.client' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"broky.client.{module}"), name)
        globals()[name] = value
        return value


__all__ = [
    "Client",
    "ClientStats",
    "GroupMessage",
    "Lag",
    "RangeEnd",
    "ReadResult",
    "Reading",
    "ReadVia",
    "ServerAddress",
    "ServerInfo",
    "Subscription",
    "SyncClient",
    "SyncSubscription",
    "WorkerRef",
    "connect",
    "connect_sync",
    "parse_server",
    "parse_servers",
]
