"""`broky pub`, `broky sub` and `broky info`: the SDK from the command line.

Every command takes `--server` (default $BROKY_SERVER, else 127.0.0.1:4777),
`--auth-token` (default $BROKY_AUTH_TOKEN), `--user` (default $BROKY_USER; the
password from $BROKY_PASSWORD, else a prompt) and, for TLS, `--tls-ca`,
`--tls-cert` and `--tls-key` (or a broky+tls:// server: the system's CAs). Errors are one line on stderr
and a non-zero exit status: 1 for a failure (no server, refused token, a refused
subscription, messages the server refused to `broky pub`, ...),
2 for bad arguments (checked by argparse `type` functions before anything
connects; see broky.cli.Parser for the one-line form).

Arguments are bytes where the protocol wants bytes: KEY, PAYLOAD, PATTERN and
--partition go through `os.fsencode`, so any byte the shell can pass arrives
unchanged (`$'a.\\xff'`).

`broky info` is broky.client.info (loaded by `cmd_info`).

`broky sub --group NAME` joins a consumer group (broky.client.groups):
several `broky sub` with one group share the messages; `--ack` acknowledges
each message once its line is written (a burst's acks go once its lines are
flushed: what a crash loses unprinted is redelivered, not lost).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from broky.client.commands import DEFAULT_METRICS_PORT, ENV_METRICS, ENV_PASSWORD, ENV_TOKEN, ENV_USER
from broky.client.commands import client_options as _options
from broky.client.commands import fail as _fail
from broky.client.commands import run as _run
from broky.client.url import parse_servers
from broky.errors import BrokyError, ErrorCode, ServerError
from broky.matching import key_problem, parse_pattern

if TYPE_CHECKING:
    from broky.protocol import Message

# The SDK (asyncio, ssl, the codec: most of a command's start-up) is imported by the
# command that connects, not with this module: `broky pub --help` and an argument error
# are answered without it.

# ---------------------------------------------------------------- argument types
# Each raises ArgumentTypeError with its own message: argparse prefixes the
# argument's name ("argument --count: must be at least 1, not 0").


def _server(text: str) -> str:
    try:
        parse_servers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _key(text: str) -> bytes:
    """A KEY to publish: literal tokens only (broky.matching.key_problem, the SDK's rule too)."""
    key = os.fsencode(text)
    problem = key_problem(key)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem if not key else f"{_show(key)} {problem}")
    return key


def _partition(text: str) -> bytes:
    """--partition: any bytes but none (the SDK refuses an empty partition too)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out: it defaults to KEY)")
    return os.fsencode(text)


def _pattern(text: str) -> bytes:
    pattern = os.fsencode(text)
    try:
        parse_pattern(pattern)
    except BrokyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return pattern


def _group(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _text(value: bytes) -> str:
    """Bytes as the user typed them (non-UTF-8 bytes as \\xNN)."""
    return value.decode(errors="backslashreplace")


def _show(value: bytes) -> str:
    """`_text`, quoted (for error messages)."""
    return f"'{_text(value)}'"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server",
        metavar="URL",
        type=_server,
        default=None,
        help=(
            "broky://host:port or host:port (broky+tls:// for TLS), or a comma-separated list of seeds "
            "(any nodes of a cluster) "
            "(default: $BROKY_SERVER, else 127.0.0.1:4777)"
        ),
    )
    p.add_argument(
        "--auth-token", metavar="TOKEN", default=None, help=f"the server's auth token (default: ${ENV_TOKEN})"
    )
    p.add_argument(
        "--user",
        metavar="NAME",
        default=None,
        help=f"connect as this user of the server's users file (default: ${ENV_USER}); the password "
        f"comes from ${ENV_PASSWORD}, else a prompt",
    )
    p.add_argument(
        "--connect-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=5.0,
        help="give up connecting after (5)",
    )
    p.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=None,
        help="connect with TLS, trusting the CAs of this bundle (default with broky+tls://: the system's)",
    )
    p.add_argument(
        "--tls-cert", metavar="PEM", default=None, help="client certificate (mutual TLS); implies TLS"
    )
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the private key of --tls-cert")


def register(subparsers: Any) -> None:
    """Add the pub, sub and info subcommands to the `broky` parser."""
    p = subparsers.add_parser(
        "pub",
        help="publish messages",
        description="Publish PAYLOAD under KEY; without PAYLOAD every line of stdin is one message "
        "(newline removed), published in order. Once the server has processed them, one line on stdout "
        "says what was published (count, key, partition and its vbucket; --quiet: nothing). Exit status "
        "1 when the server refused any of them (one line says how many, and why).",
    )
    p.add_argument(
        "key",
        metavar="KEY",
        type=_key,
        help="the message key: dot-separated literal tokens (no empty, `*` or `>` token)",
    )
    p.add_argument(
        "payload",
        metavar="PAYLOAD",
        nargs="?",
        help="message body (UTF-8); omit it to publish each line of stdin (piped, or with --stdin)",
    )
    p.add_argument(
        "--partition",
        metavar="P",
        type=_partition,
        help="key_partition (chooses the shard; ordering holds per partition). Default: KEY",
    )
    p.add_argument(
        "--stdin",
        action="store_true",
        help="read the lines from stdin even when it is a terminal (end with Ctrl-D); without it, "
        "`broky pub KEY` on a terminal refuses at once",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing on success (errors still go to stderr)"
    )
    _common(p)
    p.set_defaults(func=cmd_pub)

    s = subparsers.add_parser(
        "sub",
        help="print messages",
        description="Subscribe to PATTERN and print one line per message: its payload, or with --json "
        "a JSON object with every field. A status line goes to stderr once subscribed.",
    )
    s.add_argument(
        "pattern",
        metavar="PATTERN",
        type=_pattern,
        help="key pattern: `*` matches one token, `>` (last) the rest",
    )
    s.add_argument(
        "--partition",
        metavar="P",
        type=os.fsencode,
        help="only messages of this key_partition (default: all)",
    )
    s.add_argument(
        "--since-time",
        metavar="WHEN",
        type=_since_time,
        help="start with the retained messages published since WHEN: a duration ago (30s, 5m, 2h), "
        "an ISO 8601 time (2026-11-25T12:00:00Z; local time without a zone) or ns since the epoch",
    )
    s.add_argument(
        "--last",
        metavar="N",
        type=_count,
        default=0,
        help="start with the last N retained messages of each vbucket that match",
    )
    s.add_argument("--count", metavar="N", type=_count, help="exit after N messages")
    s.add_argument(
        "--group",
        metavar="NAME",
        type=_group,
        help="join consumer group NAME: each message goes to one of its members only "
        "(run several `broky sub --group NAME` to share the work)",
    )
    s.add_argument(
        "--key-shared",
        action="store_true",
        help="with --group: every message of one key_partition goes to the same member, in order",
    )
    s.add_argument(
        "--ack",
        action="store_true",
        help="with --group: acknowledge each message after printing it (unacknowledged ones are "
        "redelivered, to this member or another)",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="print every field as one JSON object per line, the position (vbucket, epoch, offset) too "
        "(and delivery_count with --group)",
    )
    _common(s)
    s.set_defaults(func=cmd_sub)

    i = subparsers.add_parser(
        "info",
        help="describe a server",
        description="Print the node, its workers, the vbucket map (version and ranges per worker), "
        "its limits, and a summary of what it is doing from its metrics port: per worker and in total, "
        "connections, subscriptions, groups, messages in and out per second, drops by reason, latency.",
    )
    i.add_argument(
        "--json",
        action="store_true",
        help="print everything as one JSON object instead: the map, the limits and every counter of /stats",
    )
    i.add_argument(
        "--interval",
        metavar="SECONDS",
        type=_seconds,
        default=1.0,
        help="the summary's rates are over this many seconds (1)",
    )
    i.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help=f"metrics endpoint for live counters (default: ${ENV_METRICS}, else the server host, port "
        f"{DEFAULT_METRICS_PORT}); a server started with another --metrics-port prints its metrics "
        "address in its ready line. Given here or in the variable, a failure to read it is an error. "
        "With a broky+tls:// server, HOST:PORT is read over https (a TLS server's HTTP port speaks https "
        "only).",
    )
    _common(i)
    i.set_defaults(func=cmd_info)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since_time(text: str) -> int:
    """--since-time: ns since the epoch, from a duration ago, an ISO 8601 time or ns."""
    text = text.strip()
    if text[-1:] in _UNITS and text[:-1].replace(".", "", 1).isdigit():
        return time.time_ns() - int(float(text[:-1]) * _UNITS[text[-1]] * 1e9)
    if text.isdigit():
        return int(text)
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (30s, 5m, 2h, 1d), an ISO 8601 time or ns since the epoch"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time
    return int(when.timestamp() * 1e9)


# ---------------------------------------------------------------- pub


def _refused_publish(exc: BaseException) -> bool:
    """A publish the server refused (PERMISSION_DENIED, or NOT_MY_VBUCKET that could not
    be sent to another owner), as the SDK reports it to on_error."""
    refusals = (ErrorCode.PERMISSION_DENIED, ErrorCode.NOT_MY_VBUCKET)
    return isinstance(exc, ServerError) and exc.code in refusals and not exc.sid


def cmd_pub(args: argparse.Namespace) -> int:
    """Publish, flush; a publish the server refused makes the exit status 1, told in one
    line with the count and the first refusal (the others, to the same KEY, say the same)."""
    key: bytes = args.key
    partition: bytes = args.partition if args.partition is not None else key
    if args.payload is None and not args.stdin and sys.stdin.isatty():
        print(
            "broky pub: give a PAYLOAD, or pipe the lines to publish on stdin "
            "(--stdin reads them from the terminal)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    refusals: list[BaseException] = []  # (appended by the client's I/O thread)

    def on_error(exc: BaseException) -> None:
        if _refused_publish(exc):
            refusals.append(exc)
        else:  # what the SDK would log (a worker lost and reconnected, ...)
            print(f"broky pub: {exc}", file=sys.stderr, flush=True)

    sent = 0
    try:
        parse_servers(args.server)  # $BROKY_SERVER
        from broky.client.sync import connect_sync

        with connect_sync(args.server, **_options(args, "broky-pub"), on_error=on_error) as client:
            if args.payload is not None:
                client.publish(key, os.fsencode(args.payload), partition=partition)
                sent = 1
            else:
                for line in sys.stdin.buffer:
                    client.publish(key, line[:-1] if line.endswith(b"\n") else line, partition=partition)
                    sent += 1
            client.flush()  # every refusal came before its Pong
            refused = client.stats.denied + client.stats.misrouted
    except (BrokyError, ValueError) as exc:
        return _fail("pub", exc)
    if refused:
        why = refusals[0] if refusals else "refused by the server"
        messages = "message" if sent == 1 else "messages"
        return _fail("pub", f"{refused} of {sent} {messages} refused, not published: {why}")
    if not args.quiet:
        # Publishes are confirmed by count (the flush's round trip), not one by one with
        # their offsets: the vbucket is the partition's (schema/README.md §6).
        from broky.protocol import vbucket_of

        where = f"partition {_text(partition)}, vbucket {vbucket_of(partition)}"
        print(f"published {sent} message{'' if sent == 1 else 's'} to {_text(key)} ({where})", flush=True)
    return 0


# ---------------------------------------------------------------- sub


def _field(value: bytes) -> str | dict[str, str]:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(value).decode()}


def message_json(msg: Message) -> str:
    """One JSON line with every field; bytes that are not UTF-8 become {"base64": ...};
    a group member's message also says its delivery_count.

    The nanosecond timestamps and the epoch are strings: they exceed 2**53, which
    JavaScript's JSON.parse (and any reader with float64 numbers) would round silently."""
    record: dict[str, Any] = {
        "key_partition": _field(msg.key_partition),
        "key": _field(msg.key),
        "payload": _field(msg.payload),
        "ts_producer": str(msg.ts_producer),
        "ts_broker": str(msg.ts_broker),
        "uid": msg.uid_text,
        "vbucket": msg.vbucket,
        "epoch": str(msg.epoch),
        "offset": msg.offset,
    }
    from broky.client.groups import GroupMessage

    if isinstance(msg, GroupMessage):
        record["delivery_count"] = msg.delivery_count
    return json.dumps(record, ensure_ascii=False)


def _stderr_line(line: str) -> None:
    print(f"broky sub: {line}", file=sys.stderr, flush=True)


def _disconnected(ref: Any, why: BaseException) -> None:
    print(
        f"broky sub: worker {ref.worker} of {ref.node_id} disconnected: {why}; reconnecting", file=sys.stderr
    )


async def _sub(args: argparse.Namespace) -> int:
    from broky.client.losses import LossLog
    from broky.protocol import LossReason

    out = sys.stdout.buffer
    losses = LossLog(_stderr_line)  # a line per worker and reason every few seconds, not per notice

    def told_loss(ref: Any, dropped: int, reason: int) -> None:
        label = f"worker {ref.worker} of {ref.node_id} ({LossReason.name(reason)})"
        if reason == LossReason.UNACCOUNTED:  # a count of 0: some may be lost, how many is unknown
            label += ": some may have been lost, how many is unknown"
            losses.add((ref, reason), label, 1, ("connection unaccounted", "connections unaccounted"))
            return
        if not dropped:  # EVICTED from a time, EPOCH_CHANGED: a gap whose size nobody knows
            label += ": some were lost, how many is unknown"
            losses.add((ref, reason), label, 1, ("gap", "gaps"))
            return
        losses.add((ref, reason), label, dropped)

    options = {**_options(args, "broky-sub"), "on_loss": told_loss, "on_disconnect": _disconnected}
    try:
        return await _print_messages(args, options, out)
    finally:
        losses.close()


async def _print_messages(args: argparse.Namespace, options: dict[str, Any], out: Any) -> int:
    from broky.client.client import connect

    async with connect(args.server, **options) as client:
        sub = await client.subscribe(
            args.pattern,
            partition=args.partition,
            since_time=args.since_time,
            last=args.last,
            group=args.group,
            key_shared=args.key_shared,
            ack=args.ack,
        )
        scope = f" partition {_text(args.partition)}" if args.partition is not None else ""
        if args.group is not None:
            scope += f" in group {args.group}" + " (key-shared)" * args.key_shared + " (ack)" * args.ack
        print(
            f"broky sub: subscribed to {_text(args.pattern)}{scope} on {client.address}",
            file=sys.stderr,
            flush=True,
        )
        n = 0
        ack = args.ack
        async for msg in sub:
            if args.json:
                out.write(message_json(msg).encode() + b"\n")
            else:
                out.write(msg.payload + b"\n")
            if ack:  # sent at the next loop iteration: after the flush below, when the queue is empty
                msg.ack()
            n += 1
            if n == args.count:
                break
            if not sub.pending:
                out.flush()
        out.flush()
    return 0


def _sub_conflict(args: argparse.Namespace) -> str | None:
    """What is wrong with this combination of arguments (argparse checks each alone)."""
    if args.group is None and (args.key_shared or args.ack):
        return "--key-shared and --ack need --group NAME"
    if args.group is not None and (args.since_time is not None or args.last):
        return "a group member starts live: --since-time and --last are not for --group"
    return None


def cmd_sub(args: argparse.Namespace) -> int:
    conflict = _sub_conflict(args)
    if conflict is not None:  # as argparse reports a bad argument: one line, status 2
        print(f"broky sub: error: {conflict}", file=sys.stderr)
        return 2
    try:
        parse_servers(args.server)  # $BROKY_SERVER
        return _run(_sub(args))
    except (BrokyError, ValueError) as exc:
        return _fail("sub", exc)
    except BrokenPipeError:
        # the reader went away (e.g. `broky sub k | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# ---------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    from broky.client import info  # (loaded only for `broky info`)

    try:
        parse_servers(args.server)
        return info.main(args)
    except (BrokyError, ValueError) as exc:
        return _fail("info", exc)
