"""`broky certs` (broky.server.security.devcerts): a development CA and certificates,
used by a real `broky serve` and the SDK over broky+tls://, with mutual TLS; files
never overwritten without --force; keys 0600; the docs' first try run as written."""

from __future__ import annotations

import os
import re
import shlex
import ssl
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import broky
from broky.errors import BrokyConnectionError, ServerError
from tests.support.paths import ROOT
from tests.support.requires import program
from tests.support.serverproc import ServerProcess

BIN = str(Path(sys.executable).parent)


def env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BROKY_")}
    return {**clean, "PATH": f"{BIN}:{os.environ['PATH']}", **extra}


def certs(*args: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broky", "certs", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env=env(**extra),
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    program("openssl")
    d = tmp_path_factory.mktemp("certs")
    done = certs("out", "--client", "app", "--client", "reporting", "--host", "broky.test", cwd=d)
    assert done.returncode == 0, done.stderr
    return d / "out", done.stdout


def tls_args(d: Path) -> tuple[str, ...]:
    return ("--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"))


def context(d: Path, client: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    if client is not None:
        ctx.load_cert_chain(str(d / f"client-{client}.pem"), str(d / f"client-{client}.key"))
    return ctx


def round_trip(server: ServerProcess, d: Path, client: str | None = None, host: str = "localhost") -> bytes:
    """A message `broky pub` publishes and the SDK receives, both over broky+tls://`host`, the
    server's certificate checked against the CA (each presenting `client`'s certificate)."""
    url = f"broky+tls://{host}:{server.port}"
    with broky.connect_sync(url, ssl_context=context(d, client), connect_timeout=10) as subscriber:
        sub = subscriber.subscribe("devcerts.>")
        mine = ["--tls-cert", str(d / f"client-{client}.pem"), "--tls-key", str(d / f"client-{client}.key")]
        sent = subprocess.run(
            [sys.executable, "-m", "broky", "pub", "--server", url, "--tls-ca", str(d / "ca.pem"),
             *(mine if client else []), "devcerts.one", "over TLS"],
            capture_output=True, text=True, timeout=60, env=env(),
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        return sub.next(timeout=30).payload


def test_it_writes_a_ca_a_server_and_clients_with_private_keys(made: tuple[Path, str]) -> None:
    d, out = made
    names = sorted(p.name for p in d.iterdir())
    assert names == sorted(
        ["ca.pem", "ca.key", "server.pem", "server.key"]
        + [f"client-{c}.{e}" for c in ("app", "reporting") for e in ("pem", "key")]
    )
    for path in d.iterdir():
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o600 if path.suffix == ".key" else 0o644), (path.name, oct(mode))
    text = subprocess.run(
        [program("openssl"), "x509", "-in", str(d / "server.pem"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert {"DNS:localhost", "IP Address:127.0.0.1", "DNS:broky.test"} <= set(re.split(r",\s*|\n\s*", text))
    verify = subprocess.run(
        [program("openssl"), "verify", "-x509_strict", "-CAfile", str(d / "ca.pem"),
         *(str(d / n) for n in ("server.pem", "client-app.pem", "client-reporting.pem"))],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # it says what to run next, with these files
    assert f"broky serve --tls-cert {d.name}/server.pem --tls-key {d.name}/server.key" in out
    assert f"--tls-ca {d.name}/ca.pem --tls-verify-clients" in out
    assert f"--tls-cert {d.name}/client-app.pem --tls-key {d.name}/client-app.key" in out


def test_the_sdk_connects_over_tls_with_the_ca(
    made: tuple[Path, str], start_server: Callable[..., ServerProcess]
) -> None:
    d, _ = made
    server = start_server(*tls_args(d), workers=1)
    assert round_trip(server, d) == b"over TLS"
    assert round_trip(server, d, host="127.0.0.1") == b"over TLS"  # an IP subjectAltName
    # a client that does not trust the development CA refuses the server
    url = f"broky+tls://localhost:{server.port}"
    with pytest.raises(BrokyConnectionError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        broky.connect_sync(url, ssl_context=ssl.create_default_context(), connect_timeout=5).close()


def test_mutual_tls_with_a_client_certificate(
    made: tuple[Path, str], start_server: Callable[..., ServerProcess]
) -> None:
    d, _ = made
    server = start_server(*tls_args(d), "--tls-ca", str(d / "ca.pem"), "--tls-verify-clients", workers=1)
    assert round_trip(server, d, client="app") == b"over TLS"
    assert round_trip(server, d, client="reporting") == b"over TLS"
    url = f"broky+tls://localhost:{server.port}"
    with pytest.raises((BrokyConnectionError, ServerError)):  # no client certificate: refused
        broky.connect_sync(url, ssl_context=context(d), connect_timeout=5).close()
    server.wait_log("TLS handshake with")


def test_files_there_are_never_overwritten_without_force(tmp_path: Path) -> None:
    program("openssl")
    assert certs("--client", "app", cwd=tmp_path).returncode == 0
    d = tmp_path / "broky-certs"  # the default directory
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    again = certs(cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr == (
        "broky certs: error: broky-certs already holds ca.pem, ca.key, server.pem, server.key: "
        "pass --force to replace them\n"
    )
    # one file there is enough to refuse, and nothing is written beside it
    other = tmp_path / "other"
    other.mkdir()
    (other / "client-new.key").write_text("mine\n")
    assert certs("other", "--client", "new", cwd=tmp_path).returncode == 2
    assert sorted(p.name for p in other.iterdir()) == ["client-new.key"]
    assert (other / "client-new.key").read_text() == "mine\n"
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    forced = certs("--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (d / "ca.pem").read_bytes() != before["ca.pem"]  # a new CA
    assert (d / "client-app.pem").read_bytes() == before["client-app.pem"]  # not asked for: left alone
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_without_openssl_it_says_so(tmp_path: Path) -> None:
    done = certs(cwd=tmp_path, PATH=str(tmp_path))  # (the interpreter is started by its full path)
    assert done.returncode == 1
    assert done.stderr == (
        "broky certs: error: the openssl command is needed and not found "
        "(Debian, Ubuntu: apt install openssl)\n"
    )
    assert not (tmp_path / "broky-certs").exists()


# ---------------------------------------------------------------- the docs


def blocks() -> list[list[str]]:
    """The commands of the production page's first-try blocks, continuation lines joined."""
    text = (ROOT / "docs" / "operations" / "production.md").read_text()
    mark = (
        "<!-- example: tested by tests/server/e2e/test_dev_certs.py::test_the_first_try_runs_as_written -->"
    )
    found = []
    for part in text.split(mark)[1:]:
        code = part.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
        found.append(
            [" ".join(line.split("  #", 1)[0].split()) for line in code.splitlines() if line.strip()]
        )
    return found


def on(server: ServerProcess, command: str) -> str:
    return command.replace("localhost:4777", f"localhost:{server.port}")


def test_the_first_try_runs_as_written(tmp_path: Path) -> None:
    program("openssl")
    (make, serve, pub), (serve_mutual, pub_mutual) = blocks()
    shell = env()
    done = subprocess.run(["bash", "-c", make], cwd=tmp_path, env=shell, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert serve in done.stdout.decode() and serve_mutual.split(" --tls-ca")[0] in done.stdout.decode()
    d = tmp_path / "broky-certs"
    for command, publish, client in ((serve, pub, None), (serve_mutual, pub_mutual, "app")):
        words = shlex.split(command)
        assert words[:2] == ["broky", "serve"], command
        server = ServerProcess(*[str(tmp_path / w) if (tmp_path / w).exists() else w for w in words[2:]])
        try:
            server.start()
            with broky.connect_sync(
                f"broky+tls://localhost:{server.port}", ssl_context=context(d, client), connect_timeout=10
            ) as subscriber:
                sub = subscriber.subscribe("demo.>")
                sent = subprocess.run(
                    ["bash", "-c", on(server, publish)],
                    cwd=tmp_path,
                    env=shell,
                    capture_output=True,
                    timeout=60,
                )
                assert sent.returncode == 0, sent.stderr
                message = sub.next(timeout=30)
                assert (message.key, message.payload) == (b"demo.hello", b"hi")
        finally:
            server.stop()
