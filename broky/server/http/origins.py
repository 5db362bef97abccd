"""Who may call the HTTP port from a web page: the Origin check and CORS (sans-IO).

Theory of operation
-------------------
A browser says which page a request comes from in its `Origin` header: on
every request that is not a GET or HEAD (a POST, even a `no-cors` one, and
a form's), and on every cross-origin request made with fetch() or
EventSource. Programs (curl, the SDK's users, webhooks) send none. So the
header is what tells a page's request from a program's, and the policy
(decided) is:

- No `Origin`: not a page's cross-origin request; served as always.
- The server's own origin (`scheme://` and the request's Host: the console,
  a page served by the port itself): served.
- An origin given with --http-allow-origin (a comma-separated list of
  `http[s]://host[:port]`, compared without case, a scheme's default port
  left out): served, and the answer carries `Access-Control-Allow-Origin:
  <that origin>`, `Access-Control-Allow-Credentials: true` and `Vary:
  Origin`, so that the page may read it, its token (the cookie, or a Bearer
  header) included. There is no wildcard: with one, every page on the web
  could publish with a visitor's cookie.
- Any other origin: 403, before the route is authorized or any of the body
  read, whatever the method and the credentials: nothing is done for it.
  That is the CSRF defence. The cookie's SameSite cannot be it: pages on
  other ports of the same host, or its other names, are the same site, and
  browsers send them a SameSite=Strict cookie (and the server does not set
  the cookie: whoever sets it chooses its attributes).

A preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`,
which browsers send without credentials before a cross-origin request that
is not "simple", e.g. one with an Authorization header) is answered 204 for
an allowed origin and a path that exists, naming the path's methods and
granting the headers asked for (`Access-Control-Max-Age` 600 s); 403 for
another origin. An OPTIONS that is no preflight is answered 204 with
`Allow` (RFC 9110 9.3.7).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

PREFLIGHT_MAX_AGE = 600  # seconds a browser may keep a preflight's answer
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HEADER_LIST = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+(\s*,\s*[!#$%&'*+\-.^_`|~0-9A-Za-z]+)*")


def normalize(origin: str) -> str:
    """An origin as compared: `scheme://host[:port]` in lower case, without a default port.

    Raises:
        ValueError: not an http(s) origin (a path, a query, user info, `*` and `null` are not).
    """
    text = origin.strip()
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{origin!r}: a bad port") from None
    if (
        scheme not in _DEFAULT_PORTS
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
        or text.endswith(("?", "#"))
    ):
        raise ValueError(f"{origin!r} is not an origin: expected http://host or https://host:port")
    host = parts.hostname.lower()
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{scheme}://{host}" + ("" if port in (None, _DEFAULT_PORTS[scheme]) else f":{port}")


def parse_list(text: str) -> tuple[str, ...]:
    """--http-allow-origin: comma-separated origins, normalized (an empty list: none).

    Raises:
        ValueError: one of them is not an origin.
    """
    return tuple(dict.fromkeys(normalize(o) for o in text.split(",") if o.strip()))


class OriginPolicy:
    """The Origin check of one HTTP server (see the theory of operation)."""

    def __init__(self, allowed: Iterable[str], scheme: str = "http") -> None:
        self.allowed = frozenset(normalize(o) for o in allowed)
        self.scheme = scheme  # the port's: https with a certificate

    def own(self, host: str | None) -> str | None:
        """The server's own origin for a request with this Host header (None: none given)."""
        if not host:
            return None
        try:
            return normalize(f"{self.scheme}://{host}")
        except ValueError:
            return None

    def verdict(self, origin: str | None, host: str | None) -> tuple[bool, tuple[tuple[str, str], ...]]:
        """(whether a request from `origin` to Host `host` is served, the CORS headers of its
        answer)."""
        if origin is None:
            return True, ()
        try:
            given = normalize(origin)
        except ValueError:  # "null" (a sandboxed page, a file), or nonsense
            return False, (("Vary", "Origin"),)
        if given == self.own(host):
            return True, ()
        if given in self.allowed:
            return True, (
                ("Access-Control-Allow-Origin", origin.strip()),
                ("Access-Control-Allow-Credentials", "true"),
                ("Vary", "Origin"),
            )
        return False, (("Vary", "Origin"),)

    def preflight(self, headers: dict[str, str], methods: Iterable[str]) -> tuple[tuple[str, str], ...]:
        """The headers of a 204 to an allowed origin's preflight for a path taking `methods`."""
        out = [
            ("Access-Control-Allow-Methods", ", ".join(methods)),
            ("Access-Control-Max-Age", str(PREFLIGHT_MAX_AGE)),
        ]
        asked = headers.get("access-control-request-headers", "").strip()
        if asked and _HEADER_LIST.fullmatch(asked):
            out.append(("Access-Control-Allow-Headers", asked))
        if headers.get("access-control-request-private-network", "").lower() == "true":
            out.append(("Access-Control-Allow-Private-Network", "true"))
        out.append(("Vary", "Access-Control-Request-Method, Access-Control-Request-Headers"))
        return tuple(out)
