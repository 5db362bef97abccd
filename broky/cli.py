"""The `broky` command: serve, pub, sub, info, cluster status.

Each subcommand lives with its concern and registers itself here:
broky.server.cli (serve), broky.client.cli (pub, sub, info),
broky.cluster.cli (cluster status). The benchmark
harness is `python -m bench` in a source checkout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from broky import __version__

# module that defines register(subparsers) for each group of subcommands
_COMMAND_MODULES = ("broky.server.cli", "broky.client.cli", "broky.cluster.cli")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2).

    argparse prints the usage before the error; the usage is one `--help` away.
    Subcommand parsers are made of the same class (add_subparsers' default).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="broky",
        description="Broky: an in-memory, low-latency publish/subscribe server and its tools.",
    )
    parser.add_argument("--version", action="version", version=f"broky {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`broky info | head`): stop quietly, as coreutils do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
