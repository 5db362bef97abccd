"""Broky: an in-memory, low-latency publish/subscribe server and its client.

The client SDK is re-exported here: ``broky.connect`` (asyncio),
``broky.connect_sync`` (blocking), ``broky.Message``, ``broky.GroupMessage``
(a consumer group member's, with `delivery_count` and `ack`), ``broky.Position``
(a message's place in its vbucket's sequence), ``broky.LossReason`` (the
reasons `on_loss` gives) and every error class.
"""

__version__ = "0.1.0"

import sys as _sys
import types as _types
from typing import TYPE_CHECKING, Any

# The flatbuffers runtime and the code flatc generates (the control frames' encoders)
# import numpy whenever it is installed, as it is beside pyspark and pyarrow, for
# helpers Broky never calls (the `...AsNumpy` accessors): 15 MB of resident memory
# and BLAS threads in each server process and in every SDK process. A process that
# has not loaded numpy yet lets them import a placeholder instead; numpy itself
# stays importable (the placeholder is gone once they are loaded).
if "flatbuffers" not in _sys.modules and "numpy" not in _sys.modules:
    _placeholder = _types.ModuleType("numpy", "stands in for numpy while flatbuffers is imported")
    _sys.modules["numpy"] = _placeholder
    try:
        import broky.fbs  # noqa: F401  (and flatbuffers)
    finally:
        if _sys.modules.get("numpy") is _placeholder:
            del _sys.modules["numpy"]
    del _placeholder

if TYPE_CHECKING:
    from broky.client import (
        Client,
        ClientStats,
        GroupMessage,
        Lag,
        RangeEnd,
        Reading,
        ReadResult,
        ReadVia,
        ServerInfo,
        Subscription,
        SyncClient,
        SyncSubscription,
        WorkerRef,
        connect,
        connect_sync,
    )
    from broky.errors import (
        AckError,
        AuthenticationError,
        BadKeyError,
        BadPatternError,
        BrokyConnectionError,
        BrokyError,
        BrokyTimeoutError,
        ClientClosedError,
        DrainExpiredError,
        ErrorCode,
        FrameTooLargeError,
        LocalProtocolError,
        MalformedFrameError,
        NoServerError,
        NotBrokyError,
        NotMyVBucketError,
        PayloadTooLargeError,
        PayloadTypeError,
        ProtocolError,
        PublishBufferFullError,
        RemoteProtocolError,
        SeedsDisagreeError,
        ServerError,
        ServerShutdownError,
        SlowConsumerError,
        TruncatedFrameError,
        UnknownFrameError,
        UntrustedCertificateError,
    )
    from broky.protocol import LossReason, Message, Position

# Imported when first used, not with the package: the server's processes import
# broky.server (and never the SDK), and each module they do not load is memory
# they do not keep (see broky.server).
_CLIENT = {
    "Client", "ClientStats", "GroupMessage", "Lag", "RangeEnd", "Reading", "ReadResult", "ReadVia",
    "ServerInfo", "Subscription", "SyncClient", "SyncSubscription", "WorkerRef", "connect", "connect_sync",
}  # fmt: skip
_PROTOCOL = {"LossReason", "Message", "Position"}


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
    "AckError",
    "AuthenticationError",
    "BadKeyError",
    "BadPatternError",
    "BrokyConnectionError",
    "BrokyError",
    "BrokyTimeoutError",
    "Client",
    "ClientClosedError",
    "ClientStats",
    "DrainExpiredError",
    "ErrorCode",
    "FrameTooLargeError",
    "GroupMessage",
    "Lag",
    "LocalProtocolError",
    "LossReason",
    "MalformedFrameError",
    "Message",
    "NoServerError",
    "NotBrokyError",
    "NotMyVBucketError",
    "UntrustedCertificateError",
    "PayloadTooLargeError",
    "PayloadTypeError",
    "Position",
    "ProtocolError",
    "PublishBufferFullError",
    "RangeEnd",
    "ReadResult",
    "Reading",
    "ReadVia",
    "RemoteProtocolError",
    "SeedsDisagreeError",
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
