"""Who can reach an unauthenticated server: `broky serve`'s default beyond loopback.

Theory of operation
-------------------
A server without --auth-token and without --users admits every client that
can open a connection to it, and serves /v1/pub, /v1/sub, /stats,
/connections and /topics to anyone who reaches its HTTP port. On loopback
that is this machine's users only, as for a development server; bound to any
other address (0.0.0.0, ::, a LAN address, a name that resolves to one) it is
the network's. So, as Redis does in its "protected mode", `broky serve`
refuses to start there (exit status 2, one line naming the choices:
`refusal`) unless the server has a credential or is told, with
--allow-unauthenticated, that this is meant. With that flag it serves, logs a
WARNING at start (`warning`) and says so in /metrics
(broky_unauthenticated_public 1) and /stats ("unauthenticated_public": true),
so that a dashboard or an alert sees it too.

What counts as a credential: --auth-token or --users, which guard both the
client port and the HTTP port's private routes (broky.server.http.server).
Mutual TLS alone (--tls-verify-clients) does not: the https port asks for no
client certificate (broky.server.security.tls), so its /v1/ routes would be
open; and with --tls-allow-plain plain clients need no certificate either.
A server certificate alone encrypts, it admits anyone.

Both ports bind --host, so one address is judged. Loopback: 127.0.0.0/8, ::1
(and ::ffff:127.x.x.x), or a name whose every address is one of those
(`localhost`); a name that does not resolve is not known to be loopback, so it
counts as beyond it (the bind would fail anyway). A container binds 0.0.0.0
inside its network namespace, and what reaches it is decided by the host's
port publishing, which the server cannot see: the image sets
BROKY_ALLOW_UNAUTHENTICATED=1, and the docs publish its ports on 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import socket

from broky.server.config import ServerConfig

OPT_OUT = "--allow-unauthenticated"


def _loopback_address(address: str) -> bool:
    """Whether an IP address literal is a loopback address (an IPv4-mapped IPv6 one too).

    Raises:
        ValueError: `address` is not an IPv4 or IPv6 literal.
    """
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (see the theory of operation)."""
    if not host:
        return False  # every interface
    try:
        return _loopback_address(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return bool(addresses) and all(_loopback_address(a) for a in addresses)


def authenticated(config: ServerConfig) -> bool:
    """Whether every client and every private HTTP request needs a credential."""
    return bool(config.auth_token or config.users)


def unauthenticated_public(config: ServerConfig) -> bool:
    """Whether the server serves anyone beyond loopback without a credential."""
    return not authenticated(config) and not is_loopback(config.host)


def refusal(config: ServerConfig) -> str | None:
    """The one-line error `broky serve` exits with (status 2), or None when it may serve."""
    if config.allow_unauthenticated or not unauthenticated_public(config):
        return None
    where = f"--host {config.host}" if config.host else "--host '' (every interface)"
    why = ""
    if config.tls_verify_clients:
        why = " (--tls-verify-clients guards the client port only: the HTTP port asks for no certificate)"
    return (
        f"{where} is not a loopback address and the server has no authentication{why}: set "
        f"--auth-token or --users, bind --host 127.0.0.1, or pass {OPT_OUT} to serve anyone "
        "who can reach its ports"
    )


def warning(config: ServerConfig, metrics_port: int) -> str:
    """The WARNING a server started with the opt-out logs once it listens."""
    return (
        f"serving WITHOUT authentication beyond loopback ({OPT_OUT}): anyone who reaches "
        f"{config.host or '*'}:{config.port} (clients) or :{metrics_port} (HTTP) may publish, "
        "subscribe and read /stats; set --auth-token or --users to require a credential"
    )
