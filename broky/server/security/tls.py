"""TLS: the server's contexts, and the worker's side of a TLS connection's handshake.

Theory of operation
-------------------
Where the handshake happens. The master reads one frame of every connection
and hands the socket to a worker (broky.server.handoff); an SSL session lives
in the process that made it and cannot follow the socket, and a master that
terminated TLS and relayed bytes would put every message through a second
process. So a TLS connection starts with a plain Hello that asks for TLS
(Hello.tls) and carries no secret (no auth_token, no previous.resume_token):
the master checks its version, picks the worker from it and hands the socket
over as it hands every other (schema/README.md section 2.1). The worker owns
the socket from then on: it answers ADOPTED before it reads a byte, writes
START_TLS (a size prefix of 0, which no frame has: the go-ahead, after which
the client starts the TLS handshake; a refusal of the master's is a plain
fatal Error frame instead, so a client always reads why), runs the server
side of the TLS handshake on it (`handshake`), reads the real Hello
inside TLS, checks it (version, auth token: the master never sees a TLS
client's token) and only then makes it a Connection, exactly as a plain one
(its Welcome, its hot path: the TLS transport is the connection's transport,
the shard sees no difference). --hello-timeout bounds each half: the plain
Hello at the master, the TLS handshake and the Hello inside it at the worker.

A failed handshake (timeout, a certificate refused, not TLS at all, the peer
gone) ends with the TLS layer's alert or a close, since no frame can reach the
client without TLS (a client without a Hello inside TLS within the deadline
gets HELLO_TIMEOUT, inside TLS); it costs its worker one counter bump (WorkerStats.tls_failures, by
`FAILURE_REASONS`, /metrics broky_tls_handshake_failures_total) and at most
one log line per LOG_INTERVAL per reason (`broky.server.logs.Throttle`);
a Hello inside TLS that is refused (AUTH_FAILED, ...) gets its fatal Error
inside TLS, as a plain one gets it from the master.

Contexts. `server_context` builds the SSLContext of the client port (and the
master's https port) from --tls-cert/--tls-key (and --tls-ca with
--tls-verify-clients: mutual TLS). `Certificates` holds a process's current
context: at SIGHUP the master asks every worker to `reload` (a TLS message on
the control channel) and reloads its own; a reload builds a new context from
the files and swaps it in, so handshakes that start later use it and
connections already open keep theirs (nothing is dropped). A reload that
fails (a missing file, a key that does not match) keeps the old context and
logs why.

`ssl` is imported only by a server that has a certificate (it loads OpenSSL:
a few MB per process).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from broky.errors import BrokyError, ErrorCode, ProtocolError
from broky.protocol import SERVED_VERSIONS, Hello, decode_frame
from broky.protocol.frames import error_frame
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.server.config import MAX_HELLO_BYTES, ServerConfig
from broky.server.logs import Throttle
from broky.server.security.users import Users, admits, subject_of

if TYPE_CHECKING:
    import socket
    import ssl

    from broky.server.shard.stats import WorkerStats

log = logging.getLogger("broky.tls")

LOG_INTERVAL = 10.0  # seconds between two log lines about failed handshakes of one reason
# Why a TLS handshake failed: the label of broky_tls_handshake_failures_total.
TIMEOUT = "timeout"  # no TLS handshake, or no Hello inside it, within --hello-timeout
CERTIFICATE = "certificate"  # a certificate was refused (mutual TLS: none, or not from --tls-ca)
PROTOCOL = "protocol"  # not TLS, or TLS this server does not speak (version, ciphers)
CLOSED = "closed"  # the peer closed or reset the connection during the handshake
FAILURE_REASONS = (TIMEOUT, CERTIFICATE, PROTOCOL, CLOSED)

_u32 = struct.Struct("<I").unpack_from
START_TLS = b"\0\0\0\0"  # the worker's go-ahead to a Hello asking for TLS: a size prefix of 0


def server_context(config: ServerConfig, verify_clients: bool = True) -> ssl.SSLContext:
    """The server side's SSLContext from the certificate options (`verify_clients`
    False: never ask for a client certificate, as the https port does).

    Raises:
        OSError, ssl.SSLError: a file is missing or unreadable, or the key does not
            match the certificate.
    """
    import ssl

    assert config.tls_cert and config.tls_key
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_ca:
        ctx.load_verify_locations(cafile=config.tls_ca)
    if config.tls_verify_clients and verify_clients:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class Certificates:
    """A process's current server SSLContext (`context`), swapped whole at a reload;
    and the https port's (`https`: no client certificate asked), which an asyncio
    server holds for good, so a reload loads the new files into it."""

    def __init__(self, config: ServerConfig, https: bool = False) -> None:
        self.config = config
        self.context = server_context(config)
        self.https = server_context(config, verify_clients=False) if https else None
        self.reloads = 0

    def reload(self) -> bool:
        """Build a new context from the files (SIGHUP); keep the old one if that fails."""
        try:
            context = server_context(self.config)
            if self.https is not None:
                server_context(self.config, verify_clients=False)  # loads: so will the next line
                self.https.load_cert_chain(self.config.tls_cert or "", self.config.tls_key)
        except Exception as exc:  # OSError, ssl.SSLError: the message names the file or the mismatch
            log.error("TLS certificates not reloaded (the previous ones stay in use): %s", exc)
            return False
        self.context = context
        self.reloads += 1
        return True


class HelloRefused(BrokyError):
    """The Hello inside TLS is refused with `code` (a fatal Error, inside TLS)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_hello(frame: bytes, config: ServerConfig, worker: int) -> Hello:
    """The Hello a TLS client sent inside TLS, checked as the master checks a plain one.

    Raises:
        HelloRefused: not a frame (its ProtocolError's code: MALFORMED_FRAME, ...), not a
            Hello, a version this server does not serve, or another worker.
    """
    try:
        hello = decode_frame(frame)
    except ProtocolError as exc:  # answered as the master answers a plain one that does not decode
        raise HelloRefused(exc.code, f"first frame inside TLS: {exc}") from None
    if not isinstance(hello, Hello):
        raise HelloRefused(
            ErrorCode.EXPECTED_HELLO,
            f"the first frame inside TLS must be a Hello, not {type(hello).__name__}",
        )
    if hello.protocol_version not in SERVED_VERSIONS:
        raise HelloRefused(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {hello.protocol_version} unsupported (this server: "
            f"{', '.join(map(str, sorted(SERVED_VERSIONS)))})",
        )
    if hello.worker not in (-1, worker):
        raise HelloRefused(
            ErrorCode.NO_SUCH_WORKER,
            f"the Hello inside TLS names worker {hello.worker}; the plain one named this one ({worker})",
        )
    return hello  # its credentials: `Handshakes.handshake` (broky.server.security.users.admits)


class _FirstFrame(asyncio.Protocol):
    """Collects the first frame inside TLS (the Hello), and what came after it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.done: asyncio.Future[tuple[bytes, bytes]] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            self.data += data  # (cannot happen: reading is paused once the Hello is complete)
            return
        self.data += data
        if len(self.data) < 4:
            return
        size = _u32(self.data)[0]
        limit = min(MAX_HELLO_BYTES, 1 << 20)
        if size > limit or size < MIN_FRAME_SIZE:
            self.done.set_exception(
                HelloRefused(
                    ErrorCode.FRAME_TOO_LARGE if size > limit else ErrorCode.MALFORMED_FRAME,
                    f"first frame inside TLS has size prefix {size} (a Hello is {MIN_FRAME_SIZE}..{limit})",
                )
            )
            return
        if len(self.data) >= 4 + size:
            if self.transport is not None:
                self.transport.pause_reading()
            self.done.set_result((bytes(self.data[: 4 + size]), bytes(self.data[4 + size :])))

    def eof_received(self) -> bool:
        if not self.done.done():
            self.done.set_exception(ConnectionResetError("end of stream before the Hello inside TLS"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionResetError("closed before the Hello inside TLS"))


class Handshakes:
    """A worker's TLS handshakes: its certificates, counters and throttled log."""

    def __init__(self, config: ServerConfig, index: int, stats: WorkerStats) -> None:
        self.config = config
        self.index = index
        self.certificates = Certificates(config)
        self.stats = stats  # tls_handshakes, tls_failures (by reason), errors (refused Hellos)
        self._log = Throttle(LOG_INTERVAL)
        self.users: Callable[[], Users | None] = lambda: None  # the worker's (--users)

    async def handshake(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str
    ) -> tuple[asyncio.Transport, Hello, bytes, bytes] | None:
        """The TLS handshake on an adopted socket, then the Hello inside it, checked
        (`check_hello`): (the TLS transport, reading paused; the Hello, its frame; the
        bytes read after it), or None when it failed (counted, logged throttled, closed; a
        refused Hello answered with its fatal Error inside TLS).
        --hello-timeout bounds the whole."""
        import ssl

        timeout = self.config.hello_timeout
        first = _FirstFrame(loop)
        transport: asyncio.Transport | None = None
        try:
            async with asyncio.timeout(timeout):
                transport, _ = await loop.connect_accepted_socket(
                    lambda: first, sock=sock, ssl=self.certificates.context, ssl_handshake_timeout=2 * timeout
                )
                frame, rest = await first.done
                hello = check_hello(frame, self.config, self.index)
                cert = transport.get_extra_info("peercert")
                users = self.users()
                if not await admits(
                    self.config.auth_token, users, hello.auth_token, subject_of(cert) if cert else None
                ):
                    raise HelloRefused(
                        ErrorCode.AUTH_FAILED, "wrong or missing auth token (or user:password)"
                    )
        except TimeoutError:
            self._failed(TIMEOUT, peer, f"no TLS handshake and Hello inside it within {timeout:g} s")
            if transport is not None:  # TLS is up: the client is told, as a plain one is
                self.stats.count_error(ErrorCode.HELLO_TIMEOUT)
                message = f"no Hello inside TLS within {timeout:g} s"
                transport.write(error_frame(ErrorCode.HELLO_TIMEOUT, message, fatal=True))
                transport.close()
                return None
        except HelloRefused as exc:
            assert transport is not None
            self.stats.count_error(exc.code)
            log.info("connection from %s refused inside TLS: %s: %s", peer, exc.code.name, exc)
            transport.write(error_frame(exc.code, str(exc), fatal=True))
            transport.close()
            return None
        except ssl.SSLCertVerificationError as exc:
            self._failed(CERTIFICATE, peer, exc.verify_message or str(exc))
        except ssl.SSLError as exc:  # TLS 1.3: a client certificate is checked after the client's Finished
            reason = CERTIFICATE if "CERTIFICATE" in (exc.reason or "") else PROTOCOL
            self._failed(reason, peer, exc.reason or str(exc))
        except OSError as exc:  # ConnectionResetError, or the end of the stream (_FirstFrame)
            self._failed(CLOSED, peer, str(exc) or type(exc).__name__)
        except Exception as exc:  # a bug: the connection goes (its transport too), the worker stays
            log.error("TLS connection from %s failed: %r", peer, exc)
            self._failed(PROTOCOL, peer, repr(exc))
        else:
            self.stats.tls_handshakes += 1
            return transport, hello, frame, rest
        if transport is not None:
            transport.abort()
        else:
            sock.close()  # (uvloop detached it if it had made a transport of it: then a no-op)
        return None

    def _failed(self, reason: str, peer: str, why: str) -> None:
        failures = self.stats.tls_failures
        failures[reason] = total = failures.get(reason, 0) + 1
        suppressed = self._log.allow(reason)
        if suppressed is not None:
            log.warning(
                "TLS handshake with %s failed (%s): %s; failed for this reason: %d so far, "
                "%d not logged since the last line",
                peer, reason, why, total, suppressed,
            )  # fmt: skip
