"""A client pointed at something that is not a Broky client port says what it reached,
at once (broky.client.connection `not_broky`; docs/sdk/errors.md).

Real processes: `broky serve` (its client port, its HTTP port, with and without TLS),
the `broky` command, and throwaway asyncio servers in the test's own loop (an HTTP
server, a TLS alert, a banner, a peer that closes). Every connect is given a
connect_timeout of 10 s, so an answer that was retried until then (as before) fails
the bound of 4 s these assert.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

import broky
from broky.errors import NO_SERVER_HINT, NoServerError, NotBrokyError, ServerError, UntrustedCertificateError
from tests.support.serverproc import ServerProcess
from tests.support.tls import client_context, tls_args

TIMEOUT = 10.0  # what the client would retry for
FAST = 4.0  # generous: an answer at the first bytes takes milliseconds

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def tls_server(start_server: Callable[..., ServerProcess], certs: Path) -> ServerProcess:
    """A TLS server with the shared test certificates (tests/support/tls.py `certs`)."""
    return start_server(*tls_args(certs))


def run(main: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(60):
            await main()

    asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[int]:
    """A throwaway TCP server in this loop, serving each connection with `handler`, then
    holding it until the client closes it; its port. Every connection is ended on exit."""
    writers: list[asyncio.StreamWriter] = []
    ended: list[asyncio.Future[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        done = asyncio.get_running_loop().create_future()
        ended.append(done)
        try:
            await handler(reader, writer)
            await reader.read()  # until the client closes
        except OSError:
            pass
        finally:
            writer.close()
            done.set_result(None)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()
        await asyncio.wait_for(asyncio.gather(*ended), 10)
        await server.wait_closed()


async def connect_error(url: str, **options: object) -> tuple[BaseException, float]:
    """The error connecting to `url` raises, and the seconds it took."""
    start = time.monotonic()
    try:
        client = await broky.connect(url, connect_timeout=TIMEOUT, **options)
    except broky.BrokyError as exc:
        return exc, time.monotonic() - start
    await client.close()
    raise AssertionError(f"{url} connected")


def cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "broky", *args, "--connect-timeout", str(TIMEOUT)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "BROKY_METRICS": ""},
    )
    return done, time.monotonic() - start


def _private(text: str) -> None:
    assert "None" not in text and "._" not in text, text


# ---------------------------------------------------------------- HTTP


def test_the_sdk_at_brokys_own_http_port_names_the_client_port_at_once(server: ServerProcess) -> None:
    async def main() -> None:
        exc, took = await connect_error(f"127.0.0.1:{server.metrics_port}")
        assert isinstance(exc, NotBrokyError), exc
        assert took < FAST, (took, exc)
        assert f"broky://127.0.0.1:{server.metrics_port} is the HTTP port of a Broky server" in str(exc)
        assert str(exc).endswith(f"connect to broky://127.0.0.1:{server.port}"), exc
        assert exc.answered.startswith(b"HTTP/1.")

    run(main)


@pytest.mark.parametrize("command", [["pub", "orders.created", "x"], ["sub", "orders.>"], ["info"]])
def test_the_commands_at_brokys_own_http_port_fail_at_once_naming_it(
    server: ServerProcess, command: list[str]
) -> None:
    done, took = cli(*command, "--server", f"127.0.0.1:{server.metrics_port}")
    assert done.returncode == 1, done
    assert took < FAST + 2, (took, done.stderr)  # (the command's own start-up, on a busy machine)
    assert "is the HTTP port of a Broky server" in done.stderr, done.stderr
    assert f"connect to broky://127.0.0.1:{server.port}" in done.stderr, done.stderr


def test_another_http_server_is_named_at_once_with_the_scheme_used() -> None:
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with serving(http) as port:
            exc, took = await connect_error(f"broky://127.0.0.1:{port}")
            assert isinstance(exc, NotBrokyError) and took < FAST, (took, exc)
            assert str(exc) == (
                f"broky://127.0.0.1:{port} is an HTTP server, not a Broky client port "
                "(it answered 'HTTP/1.1 400 Bad Request')"
            )
            exc, took = await connect_error(f"broky+tls://127.0.0.1:{port}")  # its plain Hello is answered so
            assert isinstance(exc, NotBrokyError) and took < FAST, (took, exc)
            assert str(exc).startswith(f"broky+tls://127.0.0.1:{port} is an HTTP server"), exc

    run(main)


# ---------------------------------------------------------------- TLS and plain


def test_a_tls_alert_says_the_port_speaks_tls() -> None:
    async def alert(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"\x15\x03\x03\x00\x02\x02\x46")  # fatal protocol_version alert; left open
        await writer.drain()

    async def main() -> None:
        async with serving(alert) as port:
            exc, took = await connect_error(f"127.0.0.1:{port}")
            assert isinstance(exc, NotBrokyError) and took < FAST, (took, exc)
            assert f"broky://127.0.0.1:{port} speaks TLS from its first byte" in str(exc), exc
            assert "broky+tls://" in str(exc)

    run(main)


def test_a_plain_server_reached_with_tls_says_use_broky(server: ServerProcess, certs: Path) -> None:
    async def main() -> None:
        exc, took = await connect_error(
            f"broky+tls://127.0.0.1:{server.port}", ssl_context=client_context(certs)
        )
        assert isinstance(exc, ServerError) and took < FAST, (took, exc)
        assert "does not offer TLS" in str(exc) and "connect with broky://" in str(exc), exc

    run(main)


def test_an_untrusted_certificate_is_said_at_once_not_retried(tls_server: ServerProcess) -> None:
    """The system's CAs did not sign the test CA's certificate: a definite answer, told at
    once (it was retried until connect_timeout), with what to give the client."""

    async def main() -> None:
        import ssl

        url = f"broky+tls://127.0.0.1:{tls_server.port}"
        exc, took = await connect_error(url, ssl_context=ssl.create_default_context())
        assert isinstance(exc, UntrustedCertificateError) and took < FAST, (took, exc)
        assert "CERTIFICATE_VERIFY_FAILED" in str(exc) and "give its CA" in str(exc), exc
        assert url in str(exc), exc

    run(main)


def test_a_tls_servers_https_port_reached_by_a_command_is_told_at_once(tls_server: ServerProcess) -> None:
    """The https port closes on a plain Hello without a byte: said so, without "None", at once
    for a command (which does not wait for a server); the SDK's default retries it (a port
    forward closes so while its server starts)."""
    done, took = cli("pub", "k", "x", "--server", f"127.0.0.1:{tls_server.metrics_port}")
    assert done.returncode == 1 and took < FAST + 2, (took, done.stderr)
    assert (
        f"broky://127.0.0.1:{tls_server.metrics_port} closed the connection without answering the Hello"
        in (done.stderr)
    ), done.stderr
    assert NO_SERVER_HINT in done.stderr
    _private(done.stderr)

    async def main() -> None:
        exc, took = await connect_error(f"127.0.0.1:{tls_server.metrics_port}", wait_for_server=False)
        assert isinstance(exc, NoServerError) and not exc.refused and took < FAST, (took, exc)
        _private(str(exc))

    run(main)


# ---------------------------------------------------------------- other peers


def test_a_peer_that_is_not_broky_is_named_by_its_first_bytes() -> None:
    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()

    async def main() -> None:
        async with serving(banner) as port:
            exc, took = await connect_error(f"127.0.0.1:{port}")
            assert isinstance(exc, NotBrokyError) and took < FAST, (took, exc)
            said = "b'SSH-2.0-OpenSSH_9.2\\r\\n'"
            assert str(exc) == f"broky://127.0.0.1:{port} is not a Broky client port (it answered {said})"

    run(main)


def test_a_peer_that_closes_in_the_handshake_is_said_so_without_none() -> None:
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)  # the Hello read: the close is a clean one, no reset
        writer.close()
        await writer.wait_closed()

    async def main() -> None:
        async with serving(closes) as port:
            exc, took = await connect_error(f"127.0.0.1:{port}", wait_for_server=False)
            assert isinstance(exc, NoServerError) and took < FAST, (took, exc)
            assert f"broky://127.0.0.1:{port} closed the connection without answering the Hello" in str(exc)
            assert str(exc).endswith(NO_SERVER_HINT)
            _private(str(exc))
            # the default waits for a server (a port forward closes so until its server listens)
            start = time.monotonic()
            with pytest.raises(broky.BrokyConnectionError) as raised:
                await broky.connect(f"127.0.0.1:{port}", connect_timeout=1.0)
            assert time.monotonic() - start >= 0.9  # retried until connect_timeout
            assert "closed the connection without answering the Hello" in str(raised.value), raised.value
            _private(str(raised.value))

    run(main)


# ---------------------------------------------------------------- refusals


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def nothing() -> Iterator[int]:
    yield _free_port()


def test_the_sdks_no_server_error_carries_the_commands_hint_and_the_scheme(nothing: int) -> None:
    async def main() -> None:
        exc, took = await connect_error(f"127.0.0.1:{nothing}", wait_for_server=False)
        assert isinstance(exc, NoServerError) and exc.refused and took < FAST, (took, exc)
        assert (
            str(exc)
            == f"connection refused at broky://127.0.0.1:{nothing}: no server listens there {NO_SERVER_HINT}"
        )
        exc, _ = await connect_error(f"broky+tls://127.0.0.1:{nothing}", wait_for_server=False)
        assert str(exc).startswith(f"connection refused at broky+tls://127.0.0.1:{nothing}:"), exc
        assert str(exc).endswith(NO_SERVER_HINT)

    run(main)
    done, _ = cli("pub", "k", "x", "--server", f"127.0.0.1:{nothing}")
    assert done.stderr.count(NO_SERVER_HINT) == 1, done.stderr  # said once, by the error itself


# ---------------------------------------------------------------- broky info --metrics, TLS


def test_info_reads_a_tls_servers_metrics_over_https_and_says_so_for_http(
    tls_server: ServerProcess, certs: Path
) -> None:
    server = f"broky+tls://127.0.0.1:{tls_server.port}"
    ca = ("--tls-ca", str(certs / "ca.pem"))
    done, _ = cli("info", "--server", server, *ca, "--metrics", f"127.0.0.1:{tls_server.metrics_port}")
    assert done.returncode == 0, done.stderr
    assert f"https://127.0.0.1:{tls_server.metrics_port}" in done.stdout, done.stdout
    done, _ = cli("info", "--server", server, *ca, "--metrics", f"http://127.0.0.1:{tls_server.metrics_port}")
    assert done.returncode == 1, done
    assert f"use https://127.0.0.1:{tls_server.metrics_port}" in done.stderr, done.stderr


# ---------------------------------------------------------------- private names


def test_publish_with_a_missing_argument_names_publish_not_a_private_method() -> None:
    client = broky.Client("127.0.0.1:4777")
    with pytest.raises(TypeError) as raised:
        client.publish("orders.created")  # type: ignore[call-arg,unused-coroutine]
    assert "publish() missing 1 required positional argument: 'payload'" in str(raised.value)
    assert "_publish" not in str(raised.value)
    with pytest.raises(TypeError) as raised:
        client.publish_nowait("orders.created")  # type: ignore[call-arg]
    assert "_publish" not in str(raised.value)
