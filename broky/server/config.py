"""Server settings: `broky serve` flags, each also read from a BROKY_<NAME> variable.

Precedence: command-line flag, then environment variable, then default.
Defaults work with no flags at all. The environment is read only when `serve`
runs (`from_args`), never when the parser is built, so a bad BROKY_* variable
cannot break other broky commands. A port variable holding a service link
(`tcp://10.0.0.7:4777`, what Kubernetes injects as BROKY_PORT for a Service
named `broky`) is ignored with a warning: its port is the Service's, which
need not be the one this process should bind.

A bad value is one line naming the flag (or the variable and its flag) and
what it takes: the type functions below raise ArgumentTypeError with that
message, never a bare ValueError (argparse would name the function:
"invalid _positive_int value").
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from broky.protocol import DEFAULT_MAX_FRAME_BYTES

if TYPE_CHECKING:
    import argparse  # the master parses flags; workers only read a ServerConfig (0.6 MB less each)

DEFAULT_PORT = 4777
DEFAULT_METRICS_PORT = 9477
# One connection's pending outbound bytes. With a replay buffer a connection past its bound
# lags (broky.server.shard.lag): it costs its position, not copies, and reads on from the
# buffer, so the bound only has to cover a reader's jitter (4 MiB, the lag's window). With
# --replay-bytes 0 the bound is all a burst has before a slow reader loses: 64 MiB then,
# unless one is given (`from_args`).
DEFAULT_MAX_PENDING_BYTES = 4 << 20
DEFAULT_MAX_PENDING_BYTES_NO_REPLAY = 64 << 20
# Per-connection limits on subscriptions. Measured on CPython 3.11 (see
# broky.server.shard.control, "Limits"): a subscription with a short pattern costs a
# worker about 0.7-1 KB, one with a 4 KB pattern about 9.4 KB (the pattern and a
# copy in its tokens), and each token that needs a trie node of its own about
# 420 bytes; at these limits one connection holds at most about 13 MB of a
# worker's memory, whatever its patterns (measured: 8-9 MB with 10,000 short
# patterns, 12 MB with patterns of one-byte tokens).
DEFAULT_MAX_SUBSCRIPTIONS = 10_000
DEFAULT_MAX_SUBSCRIPTION_BYTES = 2 << 20
DEFAULT_MAX_REPLY_BYTES = 1 << 20
# Defaults a 2-core, 4 GiB host can afford (the arithmetic: docs/operations/limits.md,
# "Limits on a small host"; schema/README.md section 8). The memory budget bounds every worker's
# pending outbound bytes together (broky.server.shard.budget): 1 GiB, a quarter of the
# host. An idle connection costs about 2 KB of a worker's memory and 5 KB of the
# kernel's (measured), so 10,000 per worker cost about 140 MB on two workers.
DEFAULT_MEMORY_BUDGET = 1 << 30
DEFAULT_MAX_CONNECTIONS = 10_000  # per worker
# The replay buffer (broky.server.shard.replay), per worker: the most recent messages of its
# vbuckets, for subscribers that resume or start from a position, a time or the last N.
# It is also what a reader past its bound catches up from. 192 MiB of stamped reads is
# about 786,000 messages of 100 B (256-byte frames, as the SDK sends them) or 171,000 of
# 1 KiB: 79 s and 17 s at 10,000 msgs/s per worker, a tenth of that at 100,000
# (bench/results/replay_memory.md), and the README's 300,000 x 1 KiB burst whole on two
# workers; an idle server holds none of it. It is drawn from the worker's share of the
# memory budget (512 MiB each, two workers), which gives it back to queued bytes first.
DEFAULT_REPLAY_BYTES = 192 << 20
DEFAULT_GROUP_BACKLOG_BYTES = 16 << 20
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 1_000  # per client IP address, over the whole server
# Largest Hello the master reads (the frame carries a name and a token only).
MAX_HELLO_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Every setting of one `broky serve` (master and workers)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    metrics_port: int = DEFAULT_METRICS_PORT
    http_max_body: int = 16 << 20  # largest request body the HTTP port takes (broky.server.http.server)
    http_body_memory: int = 64 << 20  # request bodies the HTTP port holds at once, by all connections
    http_max_connections: int = 1024  # HTTP connections served at once (broky.server.http.server)
    http_allow_origin: tuple[str, ...] = ()  # other origins whose pages may call the HTTP port
    auth_token: str | None = None
    users: str | None = None  # a users file (TOML; broky.server.security.users), read again at SIGHUP
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES  # at most max_pending_bytes (see from_args)
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    max_subscription_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    memory_budget: int = DEFAULT_MEMORY_BUDGET  # server-wide; each worker gets memory_budget // workers
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # per worker; 0 = no limit
    max_connections_per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS  # 0 = no limit
    handshake_rate: float = 500.0  # handshakes per second from one client address; 0 = no limit
    handshake_burst: int = 1_000  # ... and at once (broky.server.master.rates)
    replay_bytes: int = DEFAULT_REPLAY_BYTES  # per worker; 0 = no replay buffer
    replay_max_age: float = 0.0  # seconds a retained message is kept at most; 0 = no age bound
    # Per consumer group and worker: what its messages waiting for a member with room take
    # (broky.server.shard.groups: a copy's bytes, RUN_BYTES per run of positions).
    group_backlog_bytes: int = DEFAULT_GROUP_BACKLOG_BYTES
    log_level: str = "info"
    log_format: str = "text"
    node_id: str = dataclasses.field(default_factory=socket.gethostname)
    advertise_host: str | None = None  # host put in the vbucket map; see advertised_host()
    hello_timeout: float = 5.0
    frame_timeout: float = 10.0
    slow_consumer_deadline: float = 10.0
    shutdown_timeout: float = 4.0
    restart_grace: float = 3.0
    # Cluster mode (broky.cluster.node): etcd://HOST:PORT[,HOST:PORT...][/PREFIX], None = a single node.
    cluster: str | None = None
    lease_ttl: int = 5  # seconds of the member key's etcd lease (kept alive every third of it)
    move_timeout: float = 10.0  # the leader commits a prepared move after this long without every ready
    # SIGTERM: seconds to hand the vbuckets over before stopping anyway. With drain_linger and the
    # shutdown's own 5 s it fits in the 30 s Kubernetes gives a pod between SIGTERM and SIGKILL.
    drain_timeout: float = 20.0
    # After a drain, seconds the node serves on while it retains messages of vbuckets it handed
    # over, so that readers behind the handover can fetch them (broky.server.master.process); 0: none.
    drain_linger: float = 5.0
    # TLS (broky.server.security.tls): the server's certificate chain and key (PEM); with them every
    # client connection must ask for TLS (unless tls_allow_plain) and the HTTP port serves https.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # CA bundle (PEM) that client certificates must chain to
    tls_verify_clients: bool = False  # mutual TLS: a client without a certificate from tls_ca is refused
    tls_allow_plain: bool = False  # with a certificate, plain connections are served too
    # Beyond loopback without --auth-token or --users: serve anyway (broky.server.security.exposure).
    allow_unauthenticated: bool = False

    def advertised_host(self) -> str:
        """The host clients should dial, as written in the vbucket map."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.host

    def to_worker_json(self) -> dict[str, Any]:
        """The settings a worker needs. The auth token stays in the master, except with
        TLS: a TLS connection's Hello is read, and its token checked, by its worker."""
        data = dataclasses.asdict(self)
        if not self.tls_cert:
            data["auth_token"] = None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerConfig:
        return cls(
            **{**data, "http_allow_origin": tuple(data.get("http_allow_origin", ()))}
        )  # (JSON: a list)


def _invalid(message: str) -> Exception:
    """The error a flag's type function raises: argparse shows its message as it is."""
    import argparse

    return argparse.ArgumentTypeError(message)


def _whole(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _invalid(f"expected {expected}, got {text!r}") from None


def _number(text: str, expected: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _invalid(f"expected {expected}, got {text!r}") from None


# Each type function names what it expects: argparse would show a ValueError as
# "invalid _positive_int value", and the BROKY_* variables repeat its message.
def _positive_int(text: str) -> int:
    value = _whole(text, "a whole number >= 1")
    if value < 1:
        raise _invalid(f"must be >= 1, got {value}")
    return value


def _count_or_zero(text: str) -> int:
    value = _whole(text, "a whole number >= 0 (0: no limit)")
    if value < 0:
        raise _invalid(f"must be >= 0 (0: no limit), got {value}")
    return value


def _port(text: str) -> int:
    value = _whole(text, "a TCP port (0-65535; 0: any free port)")
    if not 0 <= value <= 65535:
        raise _invalid(f"not a TCP port: {value}")
    return value


def _seconds(text: str) -> float:
    value = _number(text, "a number of seconds > 0")
    if not value > 0:  # NaN too
        raise _invalid(f"must be > 0 seconds, got {value}")
    return value


def _seconds_or_zero(text: str) -> float:
    value = _number(text, "a number of seconds >= 0")
    if not value >= 0:  # NaN too
        raise _invalid(f"must be >= 0 seconds, got {value}")
    return value


def _rate_or_zero(text: str) -> float:
    value = _number(text, "a number per second >= 0 (0: no limit)")
    if not 0 <= value < float("inf"):  # NaN too
        raise _invalid(f"must be >= 0 per second (0: no limit), got {value}")
    return value


def _one_of(*choices: str) -> Callable[[str], str]:
    """A type function accepting `choices` in any case (lowercased)."""
    listed = ", ".join(choices[:-1]) + f" or {choices[-1]}"

    def check(text: str) -> str:
        if text.lower() not in choices:
            raise _invalid(f"expected {listed}, got {text!r}")
        return text.lower()

    return check


def _cluster(text: str) -> str:
    """An etcd://... cluster address, checked (broky.cluster.layout imports no etcd client)."""
    from broky.cluster.layout import parse_cluster_url

    try:
        parse_cluster_url(text)
    except ValueError as exc:
        raise _invalid(str(exc)) from None
    return text.strip()


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t and t[-1] in units:
        mult = units[t[-1]]
        t = t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise _invalid(f"not a size in bytes: {text!r}") from None
    if value < 1:
        raise _invalid(f"must be >= 1 byte, got {text!r}")
    return value


def _switch(text: str) -> bool:
    """A flag that takes no value (given alone: on), or yes/no, true/false, 1/0 (variables)."""
    value = text.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off", ""):
        return False
    raise _invalid(f"expected yes or no, got {text!r}")


def _readable_file(text: str) -> str:
    """A file this process can read (a certificate, a key, a CA bundle)."""
    if not os.path.isfile(text):
        raise _invalid(f"no such file: {text!r}")
    if not os.access(text, os.R_OK):
        raise _invalid(f"cannot read {text!r} (permission denied)")
    return text


def _origins(text: str) -> tuple[str, ...]:
    from broky.server.http.origins import parse_list

    try:
        return parse_list(text)
    except ValueError as exc:
        raise _invalid(str(exc)) from None


def _size_or_zero(text: str) -> int:
    """A size in bytes (`_size`), or 0."""
    if text.strip() == "0":
        return 0
    return _size(text)


# (flag, dest, type, help); the default comes from ServerConfig.
_FLAGS: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("--host", "host", str, "address to bind (default %(default)s)"),
    ("--port", "port", _port, "TCP port for clients, 0 = any free port (default %(default)s)"),
    ("--workers", "workers", _positive_int, "worker processes, one shard each (default: CPU cores)"),
    (
        "--metrics-port",
        "metrics_port",
        _port,
        "HTTP port for /metrics, /healthz, /readyz, /stats, /connections, /topics and /v1/ "
        "(publish and subscribe over HTTP) (default %(default)s)",
    ),
    (
        "--http-max-body",
        "http_max_body",
        _size,
        "largest request body on the HTTP port, e.g. a POST /v1/pub/...; larger: 413 (default %(default)s)",
    ),
    (
        "--http-body-memory",
        "http_body_memory",
        _size,
        "request bodies the HTTP port holds at once, all connections together (at least "
        "--http-max-body); a body beyond it: 503 with Retry-After (default %(default)s)",
    ),
    (
        "--http-max-connections",
        "http_max_connections",
        _positive_int,
        "HTTP connections served at once (streams included); more are answered 503 (default %(default)s)",
    ),
    (
        "--http-allow-origin",
        "http_allow_origin",
        _origins,
        "comma-separated origins (http[s]://host[:port]) of other sites whose pages may call the "
        "HTTP port, with credentials; a request from any other page's origin is refused 403 "
        "(default: none: the port's own pages only)",
    ),
    (
        "--auth-token",
        "auth_token",
        str,
        "token every Hello must carry, and every request for /stats, /connections and /topics "
        "(as 'Authorization: Bearer TOKEN'; default: none)",
    ),
    (
        "--allow-unauthenticated",
        "allow_unauthenticated",
        _switch,
        "serve without --auth-token or --users on a --host that is not loopback (0.0.0.0, ::, a "
        "LAN address), where anyone who reaches the ports may publish and subscribe; without it "
        "such a server refuses to start (default: off)",
    ),
    (
        "--users",
        "users",
        _readable_file,
        "users file (TOML): users, their password hashes (broky passwd) or certificate subjects, "
        "and what each may publish and subscribe to; clients connect as USER:PASSWORD; reloaded at "
        "SIGHUP (default: none)",
    ),
    ("--max-frame-bytes", "max_frame_bytes", _size, "largest accepted frame (default %(default)s)"),
    (
        "--max-pending-bytes",
        "max_pending_bytes",
        _size,
        "bound of one connection's pending outbound bytes; past it the connection lags: it is sent "
        "what it missed from the replay buffer as it drains (with --replay-bytes 0 it loses it, "
        f"slow_consumer) (default {DEFAULT_MAX_PENDING_BYTES}; {DEFAULT_MAX_PENDING_BYTES_NO_REPLAY} "
        "with --replay-bytes 0)",
    ),
    (
        "--max-reply-bytes",
        "max_reply_bytes",
        _size,
        "unread control replies (Pong, Error) of one connection before it is read no more "
        "(default %(default)s; at most --max-pending-bytes)",
    ),
    (
        "--max-subscriptions",
        "max_subscriptions",
        _positive_int,
        "most subscriptions one connection may hold (default %(default)s)",
    ),
    (
        "--max-subscription-bytes",
        "max_subscription_bytes",
        _size,
        "most subscription bytes one connection may hold: pattern + key_partition + 64 per "
        "pattern token, summed (default %(default)s)",
    ),
    (
        "--memory-budget",
        "memory_budget",
        _size,
        "server-wide bound of the outbound bytes queued to connections, every worker's together "
        "(each gets an equal share); over its share a worker closes the connections with the most "
        "pending bytes, which are told what they lost when they reconnect (default %(default)s)",
    ),
    (
        "--max-connections",
        "max_connections",
        _count_or_zero,
        "most connections one worker serves; a client asking for any worker goes to another one, "
        "one naming a full worker gets SERVER_BUSY; 0 = no limit (default %(default)s)",
    ),
    (
        "--max-connections-per-address",
        "max_connections_per_address",
        _count_or_zero,
        "most connections from one client IP address, over all workers; one more gets "
        "TOO_MANY_CONNECTIONS; 0 = no limit (default %(default)s)",
    ),
    (
        "--handshake-rate",
        "handshake_rate",
        _rate_or_zero,
        "connections one client IP address may open per second, after a burst of --handshake-burst; "
        "one more gets TOO_MANY_CONNECTIONS; 0 = no limit (default %(default)s)",
    ),
    (
        "--handshake-burst",
        "handshake_burst",
        _positive_int,
        "connections one client IP address may open at once before --handshake-rate applies "
        "(default %(default)s)",
    ),
    (
        "--replay-bytes",
        "replay_bytes",
        _size_or_zero,
        "per worker: bytes of the most recent messages kept for subscribers that resume or start "
        "from a position, a time or the last N (drawn from the memory budget); 0 = none "
        "(default %(default)s)",
    ),
    (
        "--replay-max-age",
        "replay_max_age",
        _seconds_or_zero,
        "seconds a message is kept for replay at most; 0 = only --replay-bytes bounds it "
        "(default %(default)s)",
    ),
    (
        "--group-backlog-bytes",
        "group_backlog_bytes",
        _size_or_zero,
        "per consumer group and worker: what an ack group keeps waiting while every member is at "
        "its bound (or a moving vbucket drains): 256 bytes per run of consecutive positions of a "
        "vbucket, read from the replay buffer when sent (what it evicted first is told, EVICTED), "
        "and the bytes of each copy (redeliveries; every message with --replay-bytes 0); past it "
        "they are dropped and counted as group_overflow (default %(default)s)",
    ),
    (
        "--log-level",
        "log_level",
        _one_of("debug", "info", "warning", "error"),
        "debug, info, warning or error (default %(default)s)",
    ),
    ("--log-format", "log_format", _one_of("text", "json"), "text or json (default %(default)s)"),
    ("--node-id", "node_id", str, "node id in the vbucket map (default: host name)"),
    (
        "--advertise-host",
        "advertise_host",
        str,
        "host clients should dial, put in the vbucket map (default: --host, or the host name for 0.0.0.0)",
    ),
    ("--hello-timeout", "hello_timeout", _seconds, "seconds to wait for the Hello (default %(default)s)"),
    (
        "--frame-timeout",
        "frame_timeout",
        _seconds,
        "seconds of silence inside a frame before TRUNCATED_FRAME (default %(default)s)",
    ),
    (
        "--slow-consumer-deadline",
        "slow_consumer_deadline",
        _seconds,
        "seconds over the pending bound before a connection is closed; one that lags, once the "
        "replay buffer evicted the oldest it was owed and it read nothing this long "
        "(default %(default)s)",
    ),
    (
        "--restart-grace",
        "restart_grace",
        _seconds_or_zero,
        "after a worker died, its successor holds publishes until the dead worker's subscribers "
        "are back, at most this many seconds; after the whole server restarted under its clients, "
        "every worker holds them this long once the first client names a connection of the "
        "earlier process; 0 = never hold (default %(default)s)",
    ),
    (
        "--cluster",
        "cluster",
        _cluster,
        "join the cluster held in etcd: etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (prefix default /broky; "
        "default: none, a single node)",
    ),
    (
        "--lease-ttl",
        "lease_ttl",
        _positive_int,
        "cluster: seconds of this node's etcd lease; a node silent that long is gone (default %(default)s)",
    ),
    (
        "--move-timeout",
        "move_timeout",
        _seconds,
        "cluster: seconds the leader waits for every node's subscribers to follow a prepared move "
        "before it commits anyway (default %(default)s)",
    ),
    (
        "--drain-timeout",
        "drain_timeout",
        _seconds,
        "cluster: at SIGTERM, seconds to hand this node's vbuckets over before stopping anyway "
        "(default %(default)s)",
    ),
    (
        "--drain-linger",
        "drain_linger",
        _seconds_or_zero,
        "cluster: after the drain, seconds the node serves on when it retains messages of the "
        "vbuckets it handed over, so that bounded reads behind the handover can fetch them; "
        "0 = stop at once (default %(default)s)",
    ),
    (
        "--tls-cert",
        "tls_cert",
        _readable_file,
        "PEM certificate chain of the server: with --tls-key, clients must connect with TLS "
        "(broky+tls://), and the HTTP port serves https; reloaded at SIGHUP (default: no TLS)",
    ),
    ("--tls-key", "tls_key", _readable_file, "PEM private key of --tls-cert (default: none)"),
    (
        "--tls-ca",
        "tls_ca",
        _readable_file,
        "PEM CA bundle that client certificates must chain to (with --tls-verify-clients) (default: none)",
    ),
    (
        "--tls-verify-clients",
        "tls_verify_clients",
        _switch,
        "mutual TLS: refuse a client without a certificate signed by --tls-ca (default: off)",
    ),
    (
        "--tls-allow-plain",
        "tls_allow_plain",
        _switch,
        "with --tls-cert, serve plain TCP connections too (default: off, TLS only)",
    ),
]


def env_name(dest: str) -> str:
    return "BROKY_" + dest.upper()


_PORTS = ("port", "metrics_port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every server flag. A flag not given is None: `from_args` fills it in."""
    defaults = ServerConfig()
    for flag, dest, kind, help_text in _FLAGS:
        shown = str(getattr(defaults, dest)).replace("%", "%%")
        text = help_text.replace("%(default)s", shown)
        if kind is _switch:  # given alone: on
            parser.add_argument(flag, dest=dest, type=kind, nargs="?", const=True, help=text)
        else:
            parser.add_argument(flag, dest=dest, type=kind, help=text)


def _from_environment(
    env: Mapping[str, str], flag: str, dest: str, kind: Callable[[str], Any], warn: Callable[[str], None]
) -> Any:
    """The value of BROKY_<DEST>, or None when it is unset, empty or ignored.

    Raises:
        ValueError: the value is not valid for the flag.
    """
    name = env_name(dest)
    raw = env.get(name)
    if not raw:
        return None
    if dest in _PORTS and "://" in raw:
        service = name.removesuffix("_PORT").lower().replace("_", "-")
        warn(
            f"ignoring {name}={raw!r}: a service link (Kubernetes sets it for a Service named "
            f"{service!r}), not a port number; set the port with {flag}"
        )
        return None
    import argparse

    try:
        return kind(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{name}={raw!r} (sets {flag}): {exc}") from None


def _stderr_warning(message: str) -> None:
    print(f"broky serve: warning: {message}", file=sys.stderr)


def from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    warn: Callable[[str], None] = _stderr_warning,
) -> ServerConfig:
    """Build and check a ServerConfig: flags, then BROKY_* variables (`environ`,
    default os.environ), then defaults. `warn` receives each ignored variable.

    Raises:
        ValueError: a variable does not parse, or a setting is out of range.
    """
    env = os.environ if environ is None else environ
    defaults = ServerConfig()
    values: dict[str, Any] = {}
    given: set[str] = set()
    for flag, dest, kind, _ in _FLAGS:
        value = getattr(args, dest, None)
        if value is None:
            value = _from_environment(env, flag, dest, kind, warn)
        if value is not None:
            given.add(dest)
        values[dest] = getattr(defaults, dest) if value is None else value
    if "max_pending_bytes" not in given and not values["replay_bytes"]:
        values["max_pending_bytes"] = DEFAULT_MAX_PENDING_BYTES_NO_REPLAY  # nothing to lag on
    if values["max_reply_bytes"] > values["max_pending_bytes"]:
        if "max_reply_bytes" in given:
            raise ValueError("--max-reply-bytes cannot exceed --max-pending-bytes")
        values["max_reply_bytes"] = values["max_pending_bytes"]  # the default, under a small bound
    if values["http_body_memory"] < values["http_max_body"]:
        if "http_body_memory" in given:
            raise ValueError("--http-body-memory cannot be less than --http-max-body")
        values["http_body_memory"] = values["http_max_body"]  # the default, under a large body bound
    config = ServerConfig(**values)
    if config.max_frame_bytes > 0xFFFFFFFF:
        raise ValueError("--max-frame-bytes must fit in 32 bits")
    if config.workers > 1024:
        raise ValueError("--workers cannot exceed the 1024 vbuckets")
    if config.memory_budget < config.workers:
        raise ValueError(f"--memory-budget must give each of the {config.workers} workers at least a byte")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: give both, or neither")
    if config.tls_verify_clients and not config.tls_ca:
        raise ValueError("--tls-verify-clients needs --tls-ca: the CA that client certificates chain to")
    if (config.tls_ca or config.tls_verify_clients or config.tls_allow_plain) and not config.tls_cert:
        raise ValueError("--tls-ca, --tls-verify-clients and --tls-allow-plain need --tls-cert and --tls-key")
    share = config.memory_budget // config.workers
    if share < config.max_pending_bytes:
        warn(
            f"--memory-budget gives each worker {share} bytes, less than --max-pending-bytes "
            f"({config.max_pending_bytes}): one slow connection can fill a worker's share alone"
        )
    return config
