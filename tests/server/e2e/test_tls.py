"""TLS against a real `broky serve` (broky.server.security.tls; schema/README.md 2.1).

Certificates are made here with the `openssl` command (a CA, a server certificate
for 127.0.0.1, client certificates of that CA and of a stranger's CA).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import broky
from broky.errors import BrokyConnectionError, ErrorCode, ServerError
from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess
from tests.support.tls import (
    client_context,
    tls_args,
    tls_url,
)

DOCKERFILE = ROOT / "Dockerfile"


def run(main: Callable[[], object], timeout: float = 30) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await main()  # type: ignore[misc]

    asyncio.run(bounded())


async def roundtrip(url: str, ctx: ssl.SSLContext, n: int = 200, **options: object) -> None:
    """Publish n messages over 64 key_partitions (every worker) and receive them all."""
    async with broky.connect(url, ssl_context=ctx, connect_timeout=5, **options) as client:
        sub = await client.subscribe("t.>")
        for i in range(n):
            await client.publish(f"t.{i}", b"x" * 100, partition=f"kp{i % 64}")
        await client.flush()
        got = [await sub.next_msg(5) for _ in range(n)]
        assert sorted(int(m.key.split(b".")[1]) for m in got) == list(range(n))
        assert len([ref for ref, link in client.router.links.items() if link.proto]) == 2  # both workers


def metric(server: ServerProcess, name: str, ctx: ssl.SSLContext, **labels: str) -> float:
    with urllib.request.urlopen(f"https://127.0.0.1:{server.metrics_port}/metrics", context=ctx) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_publish_and_subscribe_over_tls_and_https_metrics(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    server = start_server(*tls_args(certs), "--auth-token", "s3cret")
    ctx = client_context(certs)
    run(lambda: roundtrip(tls_url(server), ctx, auth_token="s3cret"))
    with broky.connect_sync(tls_url(server), ssl_context=ctx, auth_token="s3cret") as client:
        sub = client.subscribe("s")
        client.publish("s", b"sync", partition="kp")
        client.flush()
        assert sub.next(5).payload == b"sync"
        # a bounded read opens connections of its own: over TLS too
        assert [m.payload for m in client.read("s", partition="kp", timeout=10).messages] == [b"sync"]
    # the token travels inside TLS only, and the worker checks it
    with pytest.raises(ServerError) as refused:
        broky.connect_sync(tls_url(server), ssl_context=ctx, auth_token="wrong", connect_timeout=3)
    assert refused.value.code == ErrorCode.AUTH_FAILED
    # the HTTP port serves https with the same certificate
    with urllib.request.urlopen(f"https://127.0.0.1:{server.metrics_port}/healthz", context=ctx) as r:
        assert r.read() == b"ok\n"
    assert metric(server, "broky_tls_handshakes_total", ctx) >= 3
    # the Dockerfile's health check asks https when BROKY_TLS_CERT is set
    health = re.search(r"^HEALTHCHECK .+?CMD (\[[^\n]+\])$", DOCKERFILE.read_text(), re.M | re.S)
    assert health
    env = {"BROKY_METRICS_PORT": str(server.metrics_port), "BROKY_TLS_CERT": str(certs / "server.pem")}
    probe = json.loads(health.group(1))
    assert (
        subprocess.run([sys.executable, *probe[1:]], env=env, timeout=30, capture_output=True).returncode == 0
    )


def test_plain_and_tls_clients_refused_with_a_clear_error(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    tls_server = start_server(*tls_args(certs))
    with pytest.raises(ServerError, match="requires TLS") as plain:
        broky.connect_sync(tls_server.url, connect_timeout=3)
    assert plain.value.code == ErrorCode.TLS_REQUIRED
    plain_server = start_server()
    with pytest.raises(ServerError, match="does not offer TLS") as no_tls:
        broky.connect_sync(tls_url(plain_server), ssl_context=client_context(certs), connect_timeout=3)
    assert no_tls.value.code == ErrorCode.TLS_UNAVAILABLE
    # a certificate the client does not trust: the handshake fails, and says so
    with pytest.raises(BrokyConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        broky.connect_sync(
            tls_url(tls_server), ssl_context=client_context(certs, "other-ca"), connect_timeout=0.5
        )
    # --tls-allow-plain serves both
    both = start_server(*tls_args(certs, "--tls-allow-plain"))
    run(lambda: roundtrip(tls_url(both), client_context(certs), n=20))
    broky.connect_sync(both.url, connect_timeout=3).close()


def test_mutual_tls_refuses_a_client_without_the_right_certificate(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    server = start_server(*tls_args(certs, "--tls-ca", str(certs / "ca.pem"), "--tls-verify-clients"))
    for who in (None, "stranger"):
        with pytest.raises(BrokyConnectionError, match=r"(?i)certificate"):
            broky.connect_sync(
                tls_url(server), ssl_context=client_context(certs, cert=who), connect_timeout=0.5
            )
    # (the SDK tried again within connect_timeout: each attempt is counted)
    run(lambda: roundtrip(tls_url(server), client_context(certs, cert="client")))  # the others are served
    assert (
        metric(server, "broky_tls_handshake_failures_total", client_context(certs), reason="certificate") >= 2
    )
    assert len(re.findall("TLS handshake with .* failed", server.log())) >= 1
    # the HTTP gateway reaches its own workers over TLS (presenting the server's certificate)
    ctx = client_context(certs)
    post = urllib.request.Request(f"https://127.0.0.1:{server.metrics_port}/v1/pub/g?lines=0", data=b"hi")
    with urllib.request.urlopen(post, context=ctx) as r:
        assert json.loads(r.read())["published"] == 1


def test_sighup_reloads_the_certificate_without_dropping_connections(
    start_server: Callable[..., ServerProcess], certs: Path, tmp_path: Path
) -> None:
    for suffix in ("pem", "key"):
        (tmp_path / f"live.{suffix}").write_bytes((certs / f"server.{suffix}").read_bytes())
    server = start_server("--tls-cert", str(tmp_path / "live.pem"), "--tls-key", str(tmp_path / "live.key"))

    async def main() -> None:
        async with broky.connect(tls_url(server), ssl_context=client_context(certs)) as old:
            sub = await old.subscribe("r")
            for suffix in ("pem", "key"):
                (tmp_path / f"live.{suffix}").write_bytes((certs / f"server2.{suffix}").read_bytes())
            os.kill(server.pid, signal.SIGHUP)
            deadline = time.monotonic() + 5
            while (
                "reloaded its TLS certificates" not in server.log() or server.log().count("reloaded its") < 2
            ):
                assert time.monotonic() < deadline, server.log()
                await asyncio.sleep(0.05)
            with pytest.raises(BrokyConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await broky.connect(tls_url(server), ssl_context=client_context(certs), connect_timeout=0.5)
            await roundtrip(tls_url(server), client_context(certs, "other-ca"), n=20)  # the new one
            await old.publish("r", b"still here", partition="kp")  # the old connection is untouched
            assert (await sub.next_msg(5)).payload == b"still here"

    run(main)


def test_cli_commands_take_tls_options(start_server: Callable[..., ServerProcess], certs: Path) -> None:
    server = start_server(*tls_args(certs))
    cli = [sys.executable, "-m", "broky"]
    tls = ["--server", tls_url(server), "--tls-ca", str(certs / "ca.pem")]
    sub = subprocess.Popen([*cli, "sub", *tls, "--count", "1", "c.>"], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while "c.>" not in json.dumps(metric_topics(server, client_context(certs))):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pub = subprocess.run(
            [*cli, "pub", *tls, "c.1", "over tls"], capture_output=True, text=True, timeout=20
        )
        assert pub.returncode == 0, pub.stderr
        out, _ = sub.communicate(timeout=10)
        assert "over tls" in out
    finally:
        sub.kill()
        sub.wait()
    metrics = f"https://127.0.0.1:{server.metrics_port}"
    info = subprocess.run(
        [*cli, "info", *tls, "--metrics", metrics, "--json"], capture_output=True, text=True
    )
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["stats"]["master"]["workers"] == 2
    plain = subprocess.run([*cli, "pub", "--server", server.url, "c.1", "x"], capture_output=True, text=True)
    assert plain.returncode == 1 and "requires TLS" in plain.stderr


def metric_topics(server: ServerProcess, ctx: ssl.SSLContext) -> object:
    with urllib.request.urlopen(f"https://127.0.0.1:{server.metrics_port}/topics", context=ctx) as r:
        return json.loads(r.read())


def test_spark_options_make_a_tls_client(start_server: Callable[..., ServerProcess], certs: Path) -> None:
    from broky.spark.sink import ClientConfig

    server = start_server(*tls_args(certs))
    config = ClientConfig.from_options(
        {"broky.servers": f"127.0.0.1:{server.port}", "broky.tls.ca": str(certs / "ca.pem")}
    )

    async def main() -> None:
        client = await config.connect("spark-tls")
        assert client.tls is not None and client.server_info is not None
        await client.close()

    run(main)


def test_a_stalled_or_garbled_tls_handshake_is_closed_and_counted(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    from broky.protocol import Error, Hello, decode_frame, encode_frame

    server = start_server(*tls_args(certs, "--hello-timeout", "0.5"))
    plain_hello = encode_frame(Hello(tls=True))
    # TLS up, then no Hello inside it: HELLO_TIMEOUT, inside TLS (the handshake succeeded)
    with pytest.raises(ServerError) as late:
        run(lambda: _tls_without_hello(server.port, client_context(certs)))
    assert late.value.code == ErrorCode.HELLO_TIMEOUT
    for then in (b"", b"GET / HTTP/1.1\r\n\r\n"):  # nothing (a timeout); not TLS (protocol)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(plain_hello)
            assert s.recv(4) == b"\0\0\0\0"  # the go-ahead
            s.sendall(then)
            s.settimeout(5)
            while s.recv(4096):  # the server closes it
                pass
    # a Hello asking for TLS may not carry a secret: it crossed the network in clear
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(encode_frame(Hello(tls=True, auth_token="s3cret")))
        refusal = decode_frame(s.recv(65536))
    assert isinstance(refusal, Error) and refusal.code == ErrorCode.TLS_REQUIRED and refusal.fatal
    ctx = client_context(certs)
    run(lambda: roundtrip(tls_url(server), ctx, n=20))  # the others are served
    assert metric(server, "broky_tls_handshake_failures_total", ctx, reason="timeout") == 2
    assert metric(server, "broky_tls_handshake_failures_total", ctx, reason="protocol") == 1


def test_handshake_refusals_come_in_the_documented_order(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    # schema/README.md 2 and 2.1: when several refusals apply, the first in the order
    # wins; TLS_UNAVAILABLE is checked before TLS_REQUIRED.
    from broky.protocol import Error, Hello, decode_frame, encode_frame

    def refusal(server: ServerProcess, hello: Hello) -> int:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(encode_frame(hello))
            data = b""
            while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
                chunk = s.recv(65536)
                assert chunk, f"closed without an Error: {data!r}"
                data += chunk
        frame = decode_frame(data)
        assert isinstance(frame, Error) and frame.fatal, frame
        return frame.code

    plain = start_server("--auth-token", "t0ken", workers=1)
    tls = start_server(*tls_args(certs, "--auth-token", "t0ken"), workers=1)
    # a Hello asking for TLS with a secret, of a worker that does not exist
    assert refusal(plain, Hello(1, tls=True, auth_token="s")) == ErrorCode.UNSUPPORTED_VERSION
    assert refusal(plain, Hello(worker=7, auth_token="s", tls=True)) == ErrorCode.TLS_UNAVAILABLE
    assert refusal(tls, Hello(worker=7, auth_token="s", tls=True)) == ErrorCode.TLS_REQUIRED
    # a plain Hello with a wrong token, of a worker that does not exist
    assert refusal(tls, Hello(worker=7, auth_token="wrong")) == ErrorCode.TLS_REQUIRED
    assert refusal(plain, Hello(worker=7, auth_token="wrong")) == ErrorCode.AUTH_FAILED
    assert refusal(plain, Hello(worker=7, auth_token="t0ken")) == ErrorCode.NO_SUCH_WORKER


def test_a_malformed_hello_inside_tls_is_refused_and_its_connection_closed(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    """A first frame inside TLS that does not decode gets the Error a plain one gets, and
    the connection goes (it used to stay open, unanswered, after its client was gone: the
    soak's TLS fuzz found 3 to 17 such connections per run)."""
    from broky.protocol import Hello, Ping, encode_frame

    server = start_server(*tls_args(certs))
    ctx = client_context(certs)
    hello = bytearray(encode_frame(Hello(client_name="fuzz")))
    hello[8:12] = b"XXXX"  # the file identifier (BRKY)
    for frame in (bytes(hello), b"\x0c\x00\x00\x00" + b"\xff" * 12):
        data = frame + encode_frame(Ping(1))
        with pytest.raises(ServerError) as refused:
            run(lambda: _tls_first_frame(server.port, ctx, data))  # noqa: B023 (run at once)
        assert refused.value.code == ErrorCode.MALFORMED_FRAME
    deadline = time.monotonic() + 5
    while (open_now := _connections(server, ctx)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_now == 0
    run(lambda: roundtrip(tls_url(server), ctx, n=20))  # the others are served


def _connections(server: ServerProcess, ctx: ssl.SSLContext) -> int:
    url = f"https://127.0.0.1:{server.metrics_port}/stats"
    with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
        return sum(w["connections"] for w in json.loads(resp.read())["workers"])


async def _tls_first_frame(port: int, ctx: ssl.SSLContext, data: bytes) -> None:
    """The plain Hello, the go-ahead, the TLS handshake, then `data` inside TLS: raises the
    server's fatal answer."""
    from broky.client.connection import server_error
    from broky.protocol import Error, Hello, decode_frame, encode_frame

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode_frame(Hello(tls=True)))
        assert await reader.readexactly(4) == b"\0\0\0\0"
        await writer.start_tls(ctx, server_hostname="127.0.0.1")
        writer.write(data)
        answer = decode_frame(await asyncio.wait_for(reader.read(65536), 5))
    finally:
        writer.transport.abort()
        await asyncio.sleep(0)
    assert isinstance(answer, Error)
    raise server_error(answer)


def test_a_tls_client_resumes_its_account_after_its_worker_dies(
    start_server: Callable[..., ServerProcess], certs: Path
) -> None:
    """The dead worker's account travels with the hand-off unproven (the master cannot see
    the resume token inside TLS); the new worker checks the token against it."""
    server = start_server(*tls_args(certs))
    ctx = client_context(certs)

    async def main() -> None:
        async with broky.connect(tls_url(server), ssl_context=ctx) as client:
            sub = await client.subscribe("k.>")
            for i in range(64):
                await client.publish(f"k.{i}", b"before", partition=f"kp{i}")
            await client.flush()
            assert len([await sub.next_msg(5) for _ in range(64)]) == 64
            os.kill(server.worker_pids()[0], signal.SIGKILL)
            for i in range(64):
                await client.publish(f"k.{i}", b"after", partition=f"kp{i}")
            await client.flush()
            got = [await sub.next_msg(10) for _ in range(64)]
            assert {m.payload for m in got} == {b"after"}

    run(main)
    assert metric(server, "broky_resumes_total", ctx, result="worker_restart") >= 1
    assert metric(server, "broky_resumes_total", ctx, result="refused") == 0


async def _tls_without_hello(port: int, ctx: ssl.SSLContext) -> None:
    """The plain Hello, the go-ahead, the TLS handshake, then silence: the server's answer."""
    from broky.client.connection import server_error
    from broky.protocol import Error, Hello, decode_frame, encode_frame

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode_frame(Hello(tls=True)))
        assert await reader.readexactly(4) == b"\0\0\0\0"
        await writer.start_tls(ctx, server_hostname="127.0.0.1")
        answer = decode_frame(await reader.read(65536))
    finally:
        writer.transport.abort()  # (a TLS close would wait for the peer's close_notify)
        await asyncio.sleep(0)
    assert isinstance(answer, Error)
    raise server_error(answer)
