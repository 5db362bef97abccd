"""Server addresses: `broky://host:port`, `host:port`, `host` or `[v6]:port`;
a cluster's seeds are several, separated by commas (`h1:4777,h2:4777`).
`broky+tls://host:port` asks for TLS (schema/README.md section 2.1)."""

from __future__ import annotations

import os
from typing import NamedTuple

DEFAULT_PORT = 4777
DEFAULT_HOST = "127.0.0.1"
SCHEME = "broky://"
TLS_SCHEME = "broky+tls://"
ENV_SERVER = "BROKY_SERVER"


class ServerAddress(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return self.url()

    def url(self, tls: bool = False) -> str:
        """The address as a URL: broky+tls://host:port for a TLS connection, else broky://."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{TLS_SCHEME if tls else SCHEME}{host}:{self.port}"


def parse_server(url: str | None) -> ServerAddress:
    """Parse a server address; None means $BROKY_SERVER or 127.0.0.1:4777.

    Accepted forms: ``broky://host:port``, ``host:port``, ``host``,
    ``broky://host``, ``[::1]:4777``; the port defaults to 4777.
    ``broky+tls://`` instead of ``broky://`` asks for TLS (see `wants_tls`).

    Raises:
        ValueError: the text is not a server address (the message says why).
    """
    if url is None:
        url = os.environ.get(ENV_SERVER) or f"{DEFAULT_HOST}:{DEFAULT_PORT}"
    text = url.strip()
    tls = text.lower().startswith(TLS_SCHEME)
    if "://" in text:
        if not text.lower().startswith(SCHEME) and not tls:
            raise ValueError(f"unsupported scheme in {url!r}: use broky://host:port or broky+tls://host:port")
        text = text[len(TLS_SCHEME if tls else SCHEME) :]
    text = text.rstrip("/")
    if not text:
        raise ValueError(f"no host in server address {url!r}")
    if "/" in text or "@" in text or "?" in text:
        raise ValueError(f"server address {url!r} must be host[:port] (no path, user or query)")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in server address {url!r}")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after the host in {url!r}")
        port_text = rest[1:] if rest else ""
    elif text.count(":") > 1:
        raise ValueError(f"write IPv6 addresses in brackets: [{text}]:{DEFAULT_PORT}")
    else:
        host, _, port_text = text.partition(":")
        if _ and not port_text:
            raise ValueError(f"empty port in server address {url!r}")
    if not host:
        raise ValueError(f"no host in server address {url!r}")
    if not port_text:
        return ServerAddress(host, DEFAULT_PORT)
    if not port_text.isdigit():
        raise ValueError(f"port {port_text!r} in {url!r} is not a number")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} in {url!r} is out of range 1..65535")
    return ServerAddress(host, port)


def parse_servers(text: str | None) -> list[ServerAddress]:
    """Parse one address or a comma-separated list of seeds (any node of a cluster);
    None means $BROKY_SERVER (which may hold a list too) or 127.0.0.1:4777.

    ``broky://h1:4777,h2:4777`` gives the scheme once, for every seed; so does
    ``broky://h1,broky://h2``.

    Raises:
        ValueError: an entry is not a server address, or the list is empty.
    """
    if text is None:
        text = os.environ.get(ENV_SERVER) or f"{DEFAULT_HOST}:{DEFAULT_PORT}"
    body = text.strip()
    scheme = ""
    for known in (SCHEME, TLS_SCHEME):
        if body.lower().startswith(known):
            scheme, body = known, body[len(known) :]
    parts = [p.strip() for p in body.split(",")]
    if not any(parts):
        raise ValueError(f"no server address in {text!r}")
    if not all(parts):
        raise ValueError(f"empty entry in the server list {text!r}")
    seeds: list[ServerAddress] = []
    for part in parts:
        address = parse_server(part if "://" in part else scheme + part)
        if address not in seeds:
            seeds.append(address)
    return seeds


def wants_tls(text: str | None) -> bool:
    """Whether a server address (or list of seeds; None: $BROKY_SERVER) asks for TLS:
    it starts with ``broky+tls://``, which then holds for every seed, or any seed does."""
    if text is None:
        text = os.environ.get(ENV_SERVER) or ""
    return any(part.strip().lower().startswith(TLS_SCHEME) for part in text.split(","))
