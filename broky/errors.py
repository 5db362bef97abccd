"""Every error Broky raises, rooted at BrokyError.

Protocol errors carry the wire ErrorCode (schema/broky.fbs) so the server can
send them back unchanged. They are split by who broke the rules:
RemoteProtocolError when the bytes came from the peer, LocalProtocolError when
our own caller asked for something the protocol cannot carry. The table of
classes and codes is in schema/README.md (section 9.1).

The errors of the other parts (the cluster's EtcdError and NodeIdInUse, the
Spark source's and sink's, the server's own) are defined beside their code,
under BrokyError too, and keep their other bases (ValueError...) for callers
that catch those: catch them by class. tests/repo/test_errors.py walks the package
to keep every exception class under BrokyError.
"""

from __future__ import annotations

import enum

from broky.fbs import ErrorCode as _WireErrorCode


class ErrorCode(enum.IntEnum):
    """Error codes of the Error frame; values are fixed by schema/broky.fbs."""

    NONE = _WireErrorCode.NONE
    MALFORMED_FRAME = _WireErrorCode.MALFORMED_FRAME
    FRAME_TOO_LARGE = _WireErrorCode.FRAME_TOO_LARGE
    UNKNOWN_FRAME = _WireErrorCode.UNKNOWN_FRAME
    TRUNCATED_FRAME = _WireErrorCode.TRUNCATED_FRAME
    EXPECTED_HELLO = _WireErrorCode.EXPECTED_HELLO
    HELLO_TIMEOUT = _WireErrorCode.HELLO_TIMEOUT
    UNSUPPORTED_VERSION = _WireErrorCode.UNSUPPORTED_VERSION
    AUTH_FAILED = _WireErrorCode.AUTH_FAILED
    NO_SUCH_WORKER = _WireErrorCode.NO_SUCH_WORKER
    NOT_MY_VBUCKET = _WireErrorCode.NOT_MY_VBUCKET
    BAD_PATTERN = _WireErrorCode.BAD_PATTERN
    DUPLICATE_SID = _WireErrorCode.DUPLICATE_SID
    UNKNOWN_SID = _WireErrorCode.UNKNOWN_SID
    SLOW_CONSUMER = _WireErrorCode.SLOW_CONSUMER
    UNEXPECTED_FRAME = _WireErrorCode.UNEXPECTED_FRAME
    SERVER_BUSY = _WireErrorCode.SERVER_BUSY
    INTERNAL = _WireErrorCode.INTERNAL
    SUBSCRIPTION_LIMIT = _WireErrorCode.SUBSCRIPTION_LIMIT
    BAD_SID = _WireErrorCode.BAD_SID
    TOO_MANY_CONNECTIONS = _WireErrorCode.TOO_MANY_CONNECTIONS
    BAD_POSITION = _WireErrorCode.BAD_POSITION
    READ_REFUSED = _WireErrorCode.READ_REFUSED
    BAD_GROUP = _WireErrorCode.BAD_GROUP
    TLS_REQUIRED = _WireErrorCode.TLS_REQUIRED
    TLS_UNAVAILABLE = _WireErrorCode.TLS_UNAVAILABLE
    PERMISSION_DENIED = _WireErrorCode.PERMISSION_DENIED


class BrokyError(Exception):
    """Root of every error raised by Broky."""


class ProtocolError(BrokyError):
    """A frame could not be read or written; `code` is the wire ErrorCode."""

    code: ErrorCode = ErrorCode.MALFORMED_FRAME

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""


class MalformedFrameError(RemoteProtocolError):
    """The bytes are not a valid Broky FlatBuffer frame."""

    code = ErrorCode.MALFORMED_FRAME


class FrameTooLargeError(RemoteProtocolError):
    """A size prefix announced more than the configured maximum frame size."""

    code = ErrorCode.FRAME_TOO_LARGE

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class UnknownFrameError(RemoteProtocolError):
    """A well-formed frame whose body type this version does not know."""

    code = ErrorCode.UNKNOWN_FRAME

    def __init__(self, body_type: int) -> None:
        super().__init__(f"unknown frame body type {body_type}")
        self.body_type = body_type


class TruncatedFrameError(RemoteProtocolError):
    """The stream ended inside a frame."""

    code = ErrorCode.TRUNCATED_FRAME

    def __init__(self, buffered: int) -> None:
        super().__init__(f"stream ended inside a frame ({buffered} bytes buffered)")
        self.buffered = buffered


class LocalProtocolError(ProtocolError):
    """We were asked to encode something the protocol cannot carry.

    Never sent on the wire: nothing was encoded. Its code, MALFORMED_FRAME,
    names the rule the frame would have broken (what a peer receiving it would
    report); subclasses narrow it. The class says whose mistake it was.
    """


class PayloadTooLargeError(LocalProtocolError):
    """A message would exceed the server's maximum frame size; nothing was sent."""

    code = ErrorCode.FRAME_TOO_LARGE

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message frame of {size} bytes exceeds the server limit of {limit} bytes")
        self.size = size
        self.limit = limit


class PayloadTypeError(LocalProtocolError, TypeError):
    """A payload that is not bytes (a str, say): encode it first (`text.encode()`).

    Also a TypeError, as Python raises for a wrong argument type. A payload is
    opaque bytes: the SDK does not guess an encoding for it (keys, which are
    names, take a str as UTF-8).
    """


class BadPatternError(LocalProtocolError):
    """A subscription pattern breaks the key pattern syntax."""

    code = ErrorCode.BAD_PATTERN


class BadKeyError(BrokyError, ValueError):
    """`publish` was given a key or partition that `broky pub` refuses too (nothing sent).

    An empty key, an empty token (`a..b`) or a `*` / `>` token in the key
    (broky.matching.key_problem), or an empty partition. Also a ValueError.
    `argument` names the argument ("key" or "partition"), `value` is what it
    was given.
    """

    def __init__(self, call: str, argument: str, value: object, problem: str) -> None:
        super().__init__(f"{call}({argument}={value!r}): {problem}")
        self.argument = argument
        self.value = value


class ServerError(BrokyError):
    """The server answered with an Error frame."""

    def __init__(self, code: int, message: str, *, map_version: int = 0, sid: int = 0, rid: int = 0) -> None:
        try:
            self.code: ErrorCode | int = ErrorCode(code)
            name = self.code.name
        except ValueError:
            self.code = code
            name = str(code)
        super().__init__(f"{name}: {message}" if message else name)
        self.map_version = map_version
        self.sid = sid
        self.rid = rid  # the read concerned (a bounded read's Error), 0: none


class NotMyVBucketError(ServerError):
    """A frame reached a worker that does not own its key_partition's vbucket."""


class AuthenticationError(ServerError):
    """The server refused the auth token."""


class BrokyConnectionError(BrokyError, ConnectionError):
    """No connection to the server could be made or kept."""


# What to check when nothing answers as a Broky server: said by every NoServerError (the
# SDK's and the `broky` commands' alike).
NO_SERVER_HINT = "(is `broky serve` running? `./run serve` starts one)"


class NoServerError(BrokyConnectionError):
    """Every address tried refused the connection: no server listens there.

    Also raised when every address closed the connection without answering the
    Hello (a Broky server always answers one: a port forward or proxy with
    nothing behind it, or a TLS-only port, closes so). A host that does not
    answer at all is a BrokyConnectionError after the timeout; a refusal is
    immediate (see `wait_for_server` in `broky.connect`). The message ends with
    NO_SERVER_HINT; `refused` is False when an address closed without answering.
    """

    def __init__(self, message: str, refused: bool = True) -> None:
        super().__init__(message if message.endswith(NO_SERVER_HINT) else f"{message} {NO_SERVER_HINT}")
        self.refused = refused


class NotBrokyError(BrokyConnectionError):
    """The address answered, but not as a Broky client port: an HTTP server (Broky's own
    HTTP/metrics port among them), TLS from the first byte, or bytes that are no Broky
    frame. Raised at the first bytes, never retried: another try would get the same.
    `answered` holds the first bytes read (at most 64)."""

    def __init__(self, message: str, answered: bytes = b"") -> None:
        super().__init__(message)
        self.answered = answered


class UntrustedCertificateError(BrokyConnectionError):
    """The TLS handshake failed because the client does not trust the server's certificate
    (no CA it knows signed it, or it does not name the host dialled). Raised at once, never
    retried: another try would meet the same certificate."""


class SeedsDisagreeError(BrokyError, ValueError):
    """The seeds given to `connect` are not one server or cluster: one answered as a node
    that another's map does not know, and neither map names the other (a standalone
    server among a cluster's nodes, say). Going on with whichever answered first would
    serve only part of what was meant, without a word."""


class ServerShutdownError(BrokyConnectionError):
    """The server said Goodbye (it is shutting down) and closes the connection.

    `processed` is how many of the publishes sent on that connection it
    processed; the SDK sends the others again once it has reconnected.
    """

    def __init__(self, reason: str, processed: int = 0) -> None:
        # the server's own reason is "server shutting down": say it once
        said = reason and reason.lower().removeprefix("server ") != "shutting down"
        super().__init__(f"the server is shutting down: {reason}" if said else "the server is shutting down")
        self.reason = reason
        self.processed = processed


class ClientClosedError(BrokyError):
    """The client was used after close()."""


class PublishBufferFullError(BrokyError):
    """The client is disconnected and its publish buffer is full."""

    def __init__(self, pending_bytes: int, limit: int) -> None:
        super().__init__(f"disconnected, and {pending_bytes} bytes already wait to be sent (limit {limit})")
        self.pending_bytes = pending_bytes
        self.limit = limit


class SlowConsumerError(BrokyError):
    """A subscription dropped messages because its local queue was full."""

    def __init__(self, sid: int, dropped: int) -> None:
        super().__init__(f"subscription {sid} dropped {dropped} messages: its queue was full")
        self.sid = sid
        self.dropped = dropped


class BrokyTimeoutError(BrokyError, TimeoutError):
    """An operation did not complete within its timeout."""


class AckError(BrokyError):
    """A message was acknowledged (ack, nack, in_progress) that its subscription does not
    acknowledge: only a group member made with ack=True does."""


class DrainExpiredError(BrokyError):
    """A key-shared ack group moved vbucket `vbucket` to this member (`sid`) before its
    previous member had settled `messages` of its messages (the group's drain_timeout
    passed): those may now come after newer messages of the same key_partitions.
    Reported to `on_error` (GroupNotice DRAIN_EXPIRED); nothing is lost."""

    def __init__(self, sid: int, vbucket: int, messages: int) -> None:
        super().__init__(
            f"subscription {sid}: vbucket {vbucket} moved to it with {messages} messages of its previous "
            "member unacknowledged (drain_timeout): they may be redelivered after newer ones"
        )
        self.sid = sid
        self.vbucket = vbucket
        self.messages = messages
