"""The `broky` command: serve, pub, sub, info, cluster status, certs.

Each subcommand lives with its concern and registers itself here:
broky.server.master.cli (serve, passwd), broky.server.security.devcerts (certs),
broky.client.cli (pub, sub, info), broky.cluster.cli (cluster status). The benchmark
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

# the module that defines register(subparsers) for each command. `broky CMD` loads
# CMD's module alone: the server's master does not keep the SDK and urllib it
# never uses (3.9 MB resident); `broky`, `broky --help` or an unknown command
# load them all (tests/client/test_cli.py checks that this table names what they add).
COMMANDS = {
    "serve": "broky.server.master.cli",
    "passwd": "broky.server.master.cli",
    "certs": "broky.server.security.devcerts",
    "pub": "broky.client.cli",
    "sub": "broky.client.cli",
    "info": "broky.client.cli",
    "cluster": "broky.cluster.cli",
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2).

    argparse prints the usage before the error; the usage is one `--help` away.
    Subcommand parsers are made of the same class (add_subparsers' default).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, but arguments left over are an error of this parser.

        argparse hands a subcommand's leftovers up to `broky`, whose error would
        say `broky: error: unrecognized arguments` for a `broky serve` option.
        """
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `broky` parser: with every command, or with `command`'s alone if it is one."""
    parser = Parser(
        prog="broky",
        description="Broky: an in-memory, low-latency publish/subscribe server and its tools.",
    )
    parser.add_argument("--version", action="version", version=f"broky {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if command is not None and command in COMMANDS:
        names = [COMMANDS[command]]
    else:
        names = list(dict.fromkeys(COMMANDS.values()))
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    # options before the command (-h, --version) take no value: the first word is the command
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(args_list)
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
