"""Broky: an in-memory, low-latency publish/subscribe server and its client.

The client SDK is re-exported here: ``broky.connect`` (asyncio),
``broky.connect_sync`` (blocking), ``broky.Message``, ``broky.LossReason``
(the reasons `on_loss` gives) and every error class.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broky.client import (
        Client,
        ClientStats,
        ServerInfo,
        Subscription,
        SyncClient,
        SyncSubscription,
        WorkerRef,
        connect,
        connect_sync,
    )
    from broky.errors import (
        AuthenticationError,
        BadPatternError,
        BrokyConnectionError,
        BrokyError,
        BrokyTimeoutError,
        ClientClosedError,
        ErrorCode,
        FrameTooLargeError,
        LocalProtocolError,
        MalformedFrameError,
        NotMyVBucketError,
        PayloadTooLargeError,
        ProtocolError,
        PublishBufferFullError,
        RemoteProtocolError,
        ServerError,
        ServerShutdownError,
        SlowConsumerError,
        TruncatedFrameError,
        UnknownFrameError,
    )
    from broky.protocol import LossReason, Message

# Imported when first used, not with the package: the server's processes import
# broky.server (and never the SDK), and each module they do not load is memory
# they do not keep (see broky.server).
_CLIENT = {
    "Client", "ClientStats", "ServerInfo", "Subscription", "SyncClient",
    "SyncSubscription", "WorkerRef", "connect", "connect_sync",
}  # fmt: skip
_PROTOCOL = {"LossReason", "Message"}


if not TYPE_CHECKING:  # (mypy reads the imports above)

    def __getattr__(name: str) -> Any:
        import importlib

        if name in _CLIENT:
            module = "broky.client"
        elif name in _PROTOCOL:
            module = "broky.protocol"
        elif name.endswith("Error") or name == "ErrorCode":
            module = "broky.errors"
        else:
            raise AttributeError(f"module 'broky' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


__all__ = [
    "AuthenticationError",
    "BadPatternError",
    "BrokyConnectionError",
    "BrokyError",
    "BrokyTimeoutError",
    "Client",
    "ClientClosedError",
    "ClientStats",
    "ErrorCode",
    "FrameTooLargeError",
    "LocalProtocolError",
    "LossReason",
    "MalformedFrameError",
    "Message",
    "NotMyVBucketError",
    "PayloadTooLargeError",
    "ProtocolError",
    "PublishBufferFullError",
    "RemoteProtocolError",
    "ServerError",
    "ServerShutdownError",
    "SlowConsumerError",
    "SyncClient",
    "SyncSubscription",
    "Subscription",
    "TruncatedFrameError",
    "UnknownFrameError",
    "WorkerRef",
    "ServerInfo",
    "__version__",
    "connect",
    "connect_sync",
]
