"""`broky certs`: a development CA and its certificates, for a first try of TLS.

Writes into a directory (default ./broky-certs): ca.pem and ca.key (a CA made
for this directory alone), server.pem and server.key (signed by it, for
localhost, 127.0.0.1 and ::1 and each --host), and for each --client NAME
client-NAME.pem and client-NAME.key (CN=NAME: a users file's
`cert_subject = "CN=NAME"`). Then it prints the `broky serve` and client
commands that use them. Keys are EC P-256, written 0600; certificates 0644.
The certificates carry what strict verifiers ask for (the CA's key usage and
basic constraints, each certificate's key identifiers, the server's names as
subjectAltName, the extended key usage of each end).

It shells out to the `openssl` command (Debian's `openssl` package; no Python
dependency), as a user would: the files are made in a private temporary
directory inside the target (mode 0700), the keys' modes set there, and only
then renamed into place, so a failure leaves no half-written file. Files
already there are never overwritten without --force (all are checked before
anything is made). A development CA signs anything: trust ca.pem in test
clients only, never in a system's store; production certificates come from
your own CA or a public one (docs/operations/production.md).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from broky.errors import BrokyError

DEFAULT_DIR = "broky-certs"
DEFAULT_DAYS = 365
SERVER_NAMES = ("localhost", "127.0.0.1", "::1")
_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CertsError(BrokyError):
    """What stopped `broky certs`: one line for the user, and the exit status (2: what was
    asked cannot be done as asked; 1: openssl is missing or failed)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def register(subparsers: Any) -> None:
    """Add `certs` to the `broky` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "certs",
        help="make a development CA, a server certificate and client certificates for TLS",
        description=(
            "Make a development CA (ca.pem, ca.key), a server certificate signed by it for "
            "localhost, 127.0.0.1 and ::1 (server.pem, server.key) and, with --client, client "
            "certificates (client-NAME.pem, client-NAME.key), in DIR; then print the commands "
            "that use them. For a first try of TLS: trust ca.pem in test clients only. Needs "
            "the openssl command."
        ),
    )
    parser.add_argument(
        "dir", metavar="DIR", nargs="?", default=DEFAULT_DIR, help=f"where to write (default {DEFAULT_DIR})"
    )
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        type=_san,
        metavar="NAME",
        help="another name or IP address of the server certificate (repeatable)",
    )
    parser.add_argument(
        "--client",
        action="append",
        default=[],
        type=_client_name,
        metavar="NAME",
        help="also make a client certificate with CN=NAME, for mutual TLS (repeatable)",
    )
    parser.add_argument(
        "--days", type=_days, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})"
    )
    parser.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    parser.set_defaults(func=run)


def _san(text: str) -> str:
    if _is_ip(text) or re.fullmatch(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", text):
        return text
    raise argparse.ArgumentTypeError(f"not a host name or IP address: {text!r}")


def _client_name(text: str) -> str:
    if _NAME.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"a client name is letters, digits, '.', '_' and '-' (at most 64), not {text!r}"
    )


def _days(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of days, got {text!r}") from None
    if not 1 <= value <= 3650:
        raise argparse.ArgumentTypeError(f"must be 1 to 3650 days, got {value}")
    return value


def _is_ip(text: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, text)
        except OSError:
            continue
        return True
    return False


def files(clients: list[str]) -> list[str]:
    """The names `make` writes, in the order it writes them."""
    names = ["ca.pem", "ca.key", "server.pem", "server.key"]
    for client in clients:
        names += [f"client-{client}.pem", f"client-{client}.key"]
    return names


def _program() -> str:
    program = shutil.which("openssl")
    if program is None:
        raise CertsError("the openssl command is needed and not found (Debian, Ubuntu: apt install openssl)")
    return program


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run([_program(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CertsError(f"openssl {args[0]} failed: {last}")


def _signed(tmp: Path, name: str, subject: str, days: int, extensions: list[str]) -> None:
    """`name`.key and `name`.pem, CN=`subject`, signed by the CA in `tmp`."""
    (tmp / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={subject}", cwd=tmp)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(days), "-sha256",
        "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=tmp,
    )  # fmt: skip


def make(directory: Path, hosts: list[str], clients: list[str], days: int, force: bool) -> list[Path]:
    """Write the CA, the server's and the clients' certificates into `directory`.

    Raises:
        CertsError: a file is there already (and not `force`), openssl is missing or failed.
    """
    names = files(clients)
    if len(set(names)) != len(names):
        raise CertsError("a client name is given twice", 2)
    _program()  # before anything is made
    there = [n for n in names if (directory / n).exists()]
    if there and not force:
        raise CertsError(f"{directory} already holds {', '.join(there)}: pass --force to replace them", 2)
    directory.mkdir(parents=True, exist_ok=True)
    sans = list(dict.fromkeys([*SERVER_NAMES, *hosts]))
    alt = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in sans)
    end = ["basicConstraints=critical,CA:FALSE", "subjectKeyIdentifier=hash", "authorityKeyIdentifier=keyid"]
    tmp = Path(tempfile.mkdtemp(prefix=".broky-certs-", dir=directory))  # 0700, on the same file system
    try:
        _openssl(
            "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(days), "-sha256",
            "-subj", f"/CN=Broky development CA {secrets.token_hex(4)}",
            "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-addext", "subjectKeyIdentifier=hash", cwd=tmp,
        )  # fmt: skip
        _signed(
            tmp,
            "server",
            sans[0] if not hosts else hosts[0],
            days,
            [
                *end,
                "keyUsage=critical,digitalSignature",
                "extendedKeyUsage=serverAuth",
                f"subjectAltName={alt}",
            ],
        )
        for client in clients:
            _signed(
                tmp,
                f"client-{client}",
                client,
                days,
                [*end, "keyUsage=critical,digitalSignature", "extendedKeyUsage=clientAuth"],
            )
        written = []
        for name in names:
            os.chmod(tmp / name, 0o600 if name.endswith(".key") else 0o644)
            os.replace(tmp / name, directory / name)
            written.append(directory / name)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def next_steps(directory: Path, clients: list[str]) -> str:
    """What to run with the files, as `broky certs` prints it."""
    d = directory.as_posix().rstrip("/")
    q = _quote
    serve = f"broky serve --tls-cert {q(f'{d}/server.pem')} --tls-key {q(f'{d}/server.key')}"
    lines = [
        f"wrote {d}/: ca.pem, server.pem, server.key" + "".join(f", client-{c}.pem" for c in clients),
        "",
        "Serve TLS, and connect with the CA (broky+tls://localhost:4777 in the SDK, with",
        f"ssl.create_default_context(cafile={d + '/ca.pem'!r})):",
        f"  {serve}",
        f"  broky sub --server broky+tls://localhost:4777 --tls-ca {q(f'{d}/ca.pem')} 'demo.>'",
        f"  broky pub --server broky+tls://localhost:4777 --tls-ca {q(f'{d}/ca.pem')} demo.hello hi",
    ]
    if clients:
        c = clients[0]
        lines += [
            "",
            "Mutual TLS (clients present a certificate of this CA):",
            f"  {serve} --tls-ca {q(f'{d}/ca.pem')} --tls-verify-clients",
            f"  broky pub --server broky+tls://localhost:4777 --tls-ca {q(f'{d}/ca.pem')} "
            f"--tls-cert {q(f'{d}/client-{c}.pem')} --tls-key {q(f'{d}/client-{c}.key')} demo.hello hi",
        ]
    lines += [
        "",
        f"This CA is for development: trust {d}/ca.pem in test clients only.",
    ]
    return "\n".join(lines)


def _quote(path: str) -> str:
    import shlex

    return shlex.quote(path)


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    try:
        make(directory, args.host, args.client, args.days, args.force)
    except (CertsError, OSError) as exc:
        print(f"broky certs: error: {exc}", file=sys.stderr)
        return exc.status if isinstance(exc, CertsError) else 1
    print(next_steps(directory, args.client))
    return 0
