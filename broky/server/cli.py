"""The `broky serve` subcommand."""

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


def run(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    try:
        cfg = config.from_args(args, warn=warnings.append)  # reads the BROKY_* variables
    except ValueError as exc:
        print(f"broky serve: error: {exc}", file=sys.stderr)
        return 2
    if cfg.cluster and not _etcd_client_installed():
        print(
            "broky serve: error: --cluster needs the etcd client, which is not installed: "
            "pip install 'broky[cluster]'",
            file=sys.stderr,
        )
        return 2
    from broky.server.logs import setup_logging
    from broky.server.master import serve

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
