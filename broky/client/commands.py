"""What the `broky` commands share: environment names, the default metrics port, how a
command fails, the client options its arguments give, and how it runs a coroutine.

broky.client.cli (the commands) and broky.client.info (`broky info`) both use them, so
neither imports the other for them.

A command does not wait for a server that refuses the connection (the SDK's
`wait_for_server=False`): a person who typed it wants to hear at once that no
server listens there, and what starts one.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ENV_TOKEN = "BROKY_AUTH_TOKEN"
ENV_USER = "BROKY_USER"
ENV_PASSWORD = "BROKY_PASSWORD"  # the password of --user (never a flag: it would show in `ps`)
ENV_METRICS = "BROKY_METRICS"
DEFAULT_METRICS_PORT = 9477


def fail(command: str, message: object) -> int:
    """One error line on stderr; the exit status 1. (A NoServerError says what starts a
    server itself, NO_SERVER_HINT: the SDK's and the commands' errors read the same.)"""
    print(f"broky {command}: error: {message}", file=sys.stderr)
    return 1


def client_options(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """connect()'s options from a command's arguments (the token from the environment too).

    Raises:
        ValueError: --tls-cert without --tls-key (or the reverse), or a file that does not load.
    """
    user = getattr(args, "user", None) or os.environ.get(ENV_USER) or None
    password = None
    if user is not None:  # never on the command line: the environment, or a prompt
        password = os.environ.get(ENV_PASSWORD)
        if password is None:
            if not sys.stdin.isatty():
                raise ValueError(f"--user {user}: set ${ENV_PASSWORD}, or run on a terminal to be asked")
            import getpass

            password = getpass.getpass(f"password for {user}: ")
    return {
        "name": name,
        "auth_token": args.auth_token if args.auth_token is not None else os.environ.get(ENV_TOKEN),
        "user": user,
        "password": password,
        "connect_timeout": args.connect_timeout,
        # a refusal is an answer: nothing listens there, say so at once (see broky.connect)
        "wait_for_server": False,
        "ssl_context": tls_context(args),
    }


def tls_context(args: argparse.Namespace) -> Any:
    """The ssl.SSLContext --tls-ca, --tls-cert and --tls-key describe, or None (none given:
    a broky+tls:// server is checked against the system's CAs by the SDK).

    Raises:
        ValueError: --tls-cert without --tls-key (or the reverse), or a file that does not load.
    """
    ca, cert, key = (
        getattr(args, "tls_ca", None),
        getattr(args, "tls_cert", None),
        getattr(args, "tls_key", None),
    )
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    import ssl

    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS files: {exc}") from None
    return ctx


def run(coro: Any) -> int:
    """Run a command's coroutine on uvloop (asyncio without it); its exit status."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        import asyncio

        return int(asyncio.run(coro))
    return int(uvloop.run(coro))
