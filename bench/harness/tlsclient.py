"""Raw benchmark connections: the next frame off a socket, the TLS upgrade, and reads that see what TLS holds.

Theory of operation
-------------------
`next_frame` is the one blocking read of a whole frame the benchmarks' raw
connections use (bench.soak, bench.memory_budget, bench.tail_sources, the load
generator's set-up).

The benchmarks that speak Broky frames on raw sockets (bench.soak, bench.memory_budget,
bench.harness.loadgen) reach a server with a certificate the way the SDK does
(schema/README.md 2.1): a plain Hello that asks for TLS and carries no secret, the
server's go-ahead (a size prefix of 0, or a fatal Error), then the TLS handshake on the
same socket; `upgrade` returns the SSLSocket and the caller sends its real Hello inside.

Non-blocking reads differ in two ways on an SSLSocket, and `recv_ready` hides both: a
read with nothing decrypted yet raises SSLWantReadError rather than BlockingIOError;
and a read may leave decrypted bytes inside OpenSSL (`pending()`) that no selector will
ever report, so it takes them in the same call (a caller that waited for the socket to
turn readable again would stall until the server wrote something more).

`context(ca)` trusts only the benchmark's own CA (bench.harness.servers.tls_files).
"""

from __future__ import annotations

import socket
import ssl

from broky.protocol import NEED_DATA, FrameReader, Hello, PreviousConnection, decode_frame, encode_frame

HOST = "127.0.0.1"


class UpgradeRefused(RuntimeError):
    """The server answered the Hello asking for TLS with something else than the go-ahead."""


def context(ca: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


def upgrade(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    worker: int = -1,
    previous: PreviousConnection | None = None,
    host: str = HOST,
) -> ssl.SSLSocket:
    """The TLS upgrade on a connected, blocking socket (the real Hello is the caller's)."""
    plain = Hello(
        worker=worker,
        previous=None if previous is None else PreviousConnection(previous.connection_id),
        tls=True,
    )
    sock.sendall(encode_frame(plain))
    head = _exactly(sock, 4)
    if head != b"\0\0\0\0":
        reader = FrameReader()
        reader.feed(head)
        try:
            answer: object = decode_frame(next_frame(sock, reader))
        except EOFError:
            answer = head
        raise UpgradeRefused(f"the server answered a Hello asking for TLS with {answer!r}")
    return ctx.wrap_socket(sock, server_hostname=host)


def next_frame(sock: socket.socket, reader: FrameReader) -> bytes:
    """The next whole frame's bytes from `reader`, reading the blocking `sock` as it needs.

    Raises:
        EOFError: the server closed the connection first.
    """
    while (raw := reader.next_frame()) is NEED_DATA:
        data = sock.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        reader.feed(data)
    assert isinstance(raw, bytes)
    return raw


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the server closed the connection before TLS started")
        data += chunk
    return data


def recv_ready(sock: socket.socket, size: int) -> bytes:
    """One non-blocking read of what is ready (b"": the peer closed).

    Raises:
        BlockingIOError: nothing is ready (a plain socket's or TLS's "try again").
    """
    try:
        data = sock.recv(size)
    except ssl.SSLWantReadError:
        raise BlockingIOError("nothing decrypted yet") from None
    if data and isinstance(sock, ssl.SSLSocket):
        while pending := sock.pending():
            data += sock.recv(pending)
    return data
