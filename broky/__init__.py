"""Broky: an in-memory, low-latency publish/subscribe server and its client.

The client SDK is re-exported here: ``broky.connect`` (asyncio),
``broky.connect_sync`` (blocking), ``broky.Message``, ``broky.LossReason``
(the reasons `on_loss` gives) and every error class.
"""

__version__ = "0.1.0"

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
