"""TLS for the tests: a throw-away CA and certificates made with openssl (the `certs` fixture,
one directory per module, registered in tests/conftest.py), the server's flags, a client's
SSL context and a server's URL.
"""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest

from tests.support.requires import program
from tests.support.serverproc import ServerProcess


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([program("openssl"), *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d,
    )  # fmt: skip


def _cert(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d,
    )  # fmt: skip


SERVER_EXT = "subjectAltName=IP:127.0.0.1,DNS:localhost"


CLIENT_EXT = "extendedKeyUsage=clientAuth"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _cert(d, "server", "ca", SERVER_EXT)
    _cert(d, "server2", "other-ca", SERVER_EXT)  # the certificate a reload brings
    _cert(d, "client", "ca", CLIENT_EXT)
    _cert(d, "stranger", "other-ca", CLIENT_EXT)
    return d


def tls_args(d: Path, *extra: str) -> tuple[str, ...]:
    return ("--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"), *extra)


def client_context(d: Path, ca: str = "ca", cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / f"{ca}.pem"))
    if cert is not None:
        ctx.load_cert_chain(str(d / f"{cert}.pem"), str(d / f"{cert}.key"))
    return ctx


def tls_url(server: ServerProcess) -> str:
    return f"broky+tls://127.0.0.1:{server.port}"
