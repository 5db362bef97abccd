"""The `broky serve` and `broky passwd` subcommands."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from broky.server import config


def register(subparsers: Any) -> None:
    """Add `serve` to the `broky` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run a Broky server",
        description=(
            "Run a Broky server: a master process that accepts clients and hands them to "
            "one worker process per shard. Every option can also be set with BROKY_<OPTION> "
            "(e.g. BROKY_PORT=4778, BROKY_MAX_PENDING_BYTES=16M); a flag wins over the variable."
        ),
    )
    config.add_arguments(parser)
    parser.set_defaults(func=run)
    passwd: argparse.ArgumentParser = subparsers.add_parser(
        "passwd",
        help="print the hash of a password for a users file (--users)",
        description=(
            "Read a password (a prompt on a terminal, else the first line of stdin) and print "
            "its salted hash (pbkdf2-sha256$ITERATIONS$SALT$HASH), for `password = ...` in a users file."
        ),
    )
    passwd.set_defaults(func=run_passwd)


def run_passwd(args: argparse.Namespace) -> int:
    from broky.server.security.users import hash_password

    if sys.stdin.isatty():
        import getpass

        password = getpass.getpass("password: ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("broky passwd: error: an empty password", file=sys.stderr)
        return 2
    print(hash_password(password))
    return 0


def run(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    try:
        cfg = config.from_args(args, warn=warnings.append)  # reads the BROKY_* variables
    except ValueError as exc:
        print(f"broky serve: error: {exc}", file=sys.stderr)
        return 2
    from broky.server.security.exposure import refusal

    refused = refusal(cfg)  # beyond loopback without a credential: not without --allow-unauthenticated
    if refused is not None:
        print(f"broky serve: error: {refused}", file=sys.stderr)
        return 2
    if cfg.cluster and not _etcd_client_installed():
        print(
            "broky serve: error: --cluster needs the etcd client, which is not installed: "
            "pip install 'broky[cluster]'",
            file=sys.stderr,
        )
        return 2
    from broky.server.logs import setup_logging
    from broky.server.master.process import serve

    setup_logging(cfg, "master")
    for message in warnings:
        logging.getLogger("broky.master").warning("%s", message)
    return serve(cfg)


def _etcd_client_installed() -> bool:
    try:
        import aetcd  # noqa: F401
    except ImportError:
        return False
    return True
