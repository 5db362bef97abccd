"""The Broky client SDK: asyncio (`connect`, `Client`) and blocking (`connect_sync`)."""

from broky.client.client import Client, ClientStats, ServerInfo, WorkerRef, connect
from broky.client.groups import GroupMessage
from broky.client.reader import RangeEnd, Reading, ReadResult, ReadVia
from broky.client.subscription import Subscription
from broky.client.sync import SyncClient, SyncSubscription, connect_sync
from broky.client.url import ServerAddress, parse_server, parse_servers

__all__ = [
    "Client",
    "ClientStats",
    "GroupMessage",
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
