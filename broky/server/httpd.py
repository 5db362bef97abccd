"""A minimal HTTP/1.0 server on the metrics port (asyncio, no dependency).

Theory of operation
-------------------
One request per connection, GET and HEAD only. Routes map a path to an async
handler that takes the parsed `Request` and returns (status, content type,
body); the master registers /healthz and /readyz, and broky.server.monitor
adds /metrics, /stats, /connections and /topics (see there for what each
lists, and which need the auth token).

Every request takes the same steps, each of which may end it with a 4xx:

    read      bytes until the head ends (the first empty line; CRLF or bare
              LF, as h11 accepts), at most MAX_REQUEST_BYTES (else 431) and
              within REQUEST_TIMEOUT seconds (else 408 when anything
              arrived; a connection that sent nothing is closed silently,
              as is one that ended before anything but empty lines)
    parse     `parse_head`, sans-IO (bytes in, a Request out or HttpError
              raised): "METHOD SP TARGET SP HTTP/1.x" (400; another major
              version 505; a method other than GET and HEAD 405 with
              Allow), a target of visible ASCII that is a path or an
              absolute http(s) URL (400), header lines "name: value" with a
              token name and no control character (400; obsolete line
              folding too; a second Authorization, Host or Content-Length
              too). The query string is decoded (percent-escapes as UTF-8,
              invalid sequences replaced; the last value of a name wins);
              the path is matched as sent, undecoded (unknown: 404)
    authorize a route registered `private` needs, when the server has an
              auth token, "Authorization: Bearer <token>" (compared in
              constant time): 401 with WWW-Authenticate: Bearer and a body
              saying whether it was missing, malformed or wrong
    handle    the route's handler; its query-string checks are its own
              (a bad value is its 400)

A body that names what was wrong quotes the input escaped and cut to
QUOTED_CHARS. A HEAD request gets the same status and headers as a GET,
without the body. The answer is written, the write side shut, and input read
and discarded until the client closes (at most LINGER_SECONDS), so that
bytes the client sent beyond the head never turn the close into a reset that
destroys the answer.

No input reaches a traceback or a 500: a handler that raises is a bug of
ours. It answers 500 with a short body, and is logged with its traceback at
most once per route per LOG_INTERVAL seconds, with the running count of its
failures (broky.server.logs.Throttle). Refused tokens are logged the same
way, once per cause per LOG_INTERVAL, never with what was sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from broky.errors import BrokyError
from broky.server.logs import Throttle

log = logging.getLogger("broky.master")

Response = tuple[int, str, bytes]


@dataclass(frozen=True, slots=True)
class Request:
    method: str  # "GET" or "HEAD"
    path: str  # the target's path, as sent (not percent-decoded)
    query: dict[str, str]  # decoded; the last value of a name wins
    headers: dict[str, str]  # lower-case name -> value (bytes as latin-1, so nothing is lost)


Handler = Callable[[Request], Awaitable[Response]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT = 5.0
LINGER_SECONDS = 1.0
LOG_INTERVAL = 10.0  # seconds between two log lines about one route's failures (or one refusal cause)
QUOTED_CHARS = 40  # of the input quoted in an error body
METHODS = ("GET", "HEAD")
_SINGLE = frozenset({"authorization", "host", "content-length"})  # headers a request may carry once

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token (methods, header names)
_VERSION = re.compile(rb"HTTP/([0-9])\.[0-9]")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # in a header value (HTAB is allowed)
_ABSOLUTE = re.compile(r"https?://[^/?]*", re.IGNORECASE)


class HttpError(BrokyError):
    """A request answered `status` with `message` before (or instead of) its handler."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.send_body = True  # False once the method is known to be HEAD

    def answer(self) -> Answer:
        body = (self.message + "\n").encode()
        return Answer(self.status, "text/plain", body, self.headers, self.send_body)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    send_body: bool = True

    def encode(self) -> bytes:
        lines = [
            f"HTTP/1.0 {self.status} {_REASONS.get(self.status, '')}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            *(f"{name}: {value}" for name, value in self.headers),
            "Connection: close",
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        return head + self.body if self.send_body else head


@dataclass(frozen=True, slots=True)
class Route:
    handler: Handler
    private: bool  # needs the auth token when the server has one


# ---------------------------------------------------------------- sans-IO


def head_length(data: bytes) -> int:
    """The length of the request head at the start of `data` (through its empty line), or -1
    while it is incomplete. Empty lines before the request line belong to the head."""
    start = len(data) - len(data.lstrip(b"\r\n"))
    ends = [i + len(mark) for mark in (b"\n\n", b"\n\r\n") if (i := data.find(mark, start)) >= 0]
    return min(ends) if ends else -1


def parse_head(head: bytes) -> Request:
    """The request in a head (as delimited by `head_length`).

    Raises:
        HttpError: a 4xx (or 505) saying what is wrong with it.
    """
    lines = [line.removesuffix(b"\r") for line in head.lstrip(b"\r\n").split(b"\n")]
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise HttpError(400, "empty request")
    request_line, *header_lines = lines
    parts = request_line.split(b" ")
    if len(parts) != 3 or not all(parts):
        raise HttpError(
            400, f"malformed request line {quote(request_line)}: expected 'METHOD /path HTTP/1.1'"
        )
    method_bytes, target_bytes, version = parts
    major = _VERSION.fullmatch(version)
    if major is None:
        raise HttpError(400, f"malformed HTTP version {quote(version)}")
    if major.group(1) != b"1":
        raise HttpError(505, "this server speaks HTTP/1.0 and HTTP/1.1 only")
    if _TOKEN.fullmatch(method_bytes) is None:
        raise HttpError(400, f"malformed method {quote(method_bytes)}")
    method = method_bytes.decode("ascii")
    if method not in METHODS:
        raise HttpError(405, "GET or HEAD only", (("Allow", ", ".join(METHODS)),))
    try:
        path, query = _parse_target(target_bytes)
        headers = _parse_headers(header_lines)
    except HttpError as exc:
        exc.send_body = method != "HEAD"
        raise
    return Request(method, path, query, headers)


def _parse_target(target_bytes: bytes) -> tuple[str, dict[str, str]]:
    if _TARGET.fullmatch(target_bytes) is None:
        raise HttpError(400, "the request target holds a control character or a byte outside ASCII")
    target = target_bytes.decode("ascii").partition("#")[0]
    absolute = _ABSOLUTE.match(target)
    if absolute is not None:  # absolute-form (RFC 9112 3.2.2): only the path and query count
        target = target[absolute.end() :]
        target = target if target.startswith("/") else "/" + target
    if not target.startswith("/"):
        raise HttpError(400, f"the request target {quote(target_bytes)} is not a path (/...)")
    path, _, query = target.partition("?")
    return path, dict(urllib.parse.parse_qsl(query, keep_blank_values=True))


def _parse_headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete line folding in the request headers")
        name, colon, raw = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise HttpError(400, f"malformed header line {quote(line)}: expected 'Name: value'")
        value = raw.strip(b" \t")
        shown = name.decode("ascii")
        if _CONTROL.search(value) is not None:
            raise HttpError(400, f"a control character in the value of the {shown} header")
        key = shown.lower()
        if key in headers:
            if key in _SINGLE:
                raise HttpError(400, f"more than one {shown} header")
            headers[key] += ", " + value.decode("latin-1")
        else:
            headers[key] = value.decode("latin-1")
    return headers


def quote(data: bytes | str) -> str:
    """Input shown in an error body: escaped (ASCII only) and cut to QUOTED_CHARS."""
    text = data.decode("latin-1") if isinstance(data, bytes) else data
    shown = ascii(text)
    if len(shown) <= QUOTED_CHARS:
        return shown
    return shown[:QUOTED_CHARS] + f"... ({len(text)} characters)"


# ---------------------------------------------------------------- the server


class HttpServer:
    def __init__(self, token: str | None = None) -> None:
        self.routes: dict[str, Route] = {}
        self.server: asyncio.AbstractServer | None = None
        self._token = token.encode() if token else None
        self.failures: dict[str, int] = {}  # route -> handler failures (answered 500)
        self.refused: dict[str, int] = {}  # cause -> requests refused for their token (401)
        self.log_throttle = Throttle(LOG_INTERVAL)

    def route(self, path: str, handler: Handler, private: bool = False) -> None:
        """Serve `path` with `handler`; `private`: only with the auth token, if the server has one."""
        self.routes[path] = Route(handler, private)

    async def start(self, host: str, port: int) -> int:
        """Listen; return the bound port."""
        self.server = await asyncio.start_server(
            self._handle, host, port, reuse_address=True, limit=MAX_REQUEST_BYTES
        )
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await _read_head(reader)
            if head is None:
                writer.close()
                return
            answer = head.answer() if isinstance(head, HttpError) else await self.answer(head)
        except (OSError, TimeoutError):  # the client reset or vanished
            writer.close()
            return
        except Exception:  # a bug of ours outside any handler: logged like a handler's
            self._failed("(request)")
            answer = Answer(500, "text/plain", b"internal error\n")
        try:
            writer.write(answer.encode())
            await writer.drain()
            writer.write_eof()  # then wait for the client to close: see the theory of operation
            await asyncio.wait_for(_discard(reader), LINGER_SECONDS)
        except (OSError, RuntimeError, TimeoutError):  # the client went away (RuntimeError: closed transport)
            pass
        finally:
            writer.close()

    async def answer(self, head: bytes) -> Answer:
        """The answer to one request head: parse, route, authorize, handle."""
        try:
            request = parse_head(head)
        except HttpError as exc:
            return exc.answer()
        send_body = request.method != "HEAD"
        route = self.routes.get(request.path)
        if route is None:
            return Answer(404, "text/plain", b"not found\n", send_body=send_body)
        if route.private and self._token is not None:
            refused = self._authorize(request)
            if refused is not None:
                refused.send_body = send_body
                return refused.answer()
        try:
            status, ctype, body = await route.handler(request)
        except Exception:
            self._failed(request.path)
            return Answer(500, "text/plain", b"internal error\n", send_body=send_body)
        return Answer(status, ctype, body, send_body=send_body)

    def _authorize(self, request: Request) -> HttpError | None:
        """None when the request carries the token, else the 401 that says why not."""
        assert self._token is not None
        value = request.headers.get("authorization")
        scheme, _, credentials = (value or "").partition(" ")
        credentials = credentials.strip(" \t")
        if value is None:
            cause = "missing"
            why = f"{request.path} needs the server's auth token: send 'Authorization: Bearer <token>'"
            challenge = 'Bearer realm="broky"'
        elif scheme.lower() != "bearer" or not credentials:
            cause = "malformed"
            why = "malformed Authorization header: expected 'Bearer <token>'"
            challenge = 'Bearer realm="broky", error="invalid_request"'
        else:
            import hmac  # here: a server without a token never loads hashlib's OpenSSL digests

            if hmac.compare_digest(credentials.encode("latin-1"), self._token):
                return None
            cause = "wrong"
            why = "wrong auth token"
            challenge = 'Bearer realm="broky", error="invalid_token"'
        self.refused[cause] = total = self.refused.get(cause, 0) + 1
        suppressed = self.log_throttle.allow(("refused", cause))
        if suppressed is not None:
            log.warning(
                "HTTP request for %s refused: %s auth token (%d refused for this cause so far, "
                "%d not logged since the last line)",
                request.path, cause, total, suppressed,
            )  # fmt: skip
        return HttpError(401, why, (("WWW-Authenticate", challenge),))

    def _failed(self, where: str) -> None:
        """Count a failure of ours (in the handler of route `where`) and log it, throttled."""
        self.failures[where] = total = self.failures.get(where, 0) + 1
        suppressed = self.log_throttle.allow(("failed", where))
        if suppressed is not None:
            log.exception(
                "HTTP handler for %s failed (%d failures so far, %d not logged since the last line)",
                where, total, suppressed,
            )  # fmt: skip


async def _read_head(reader: asyncio.StreamReader) -> bytes | HttpError | None:
    """The request head, the error that ends the request instead, or None: nothing to answer."""
    data = b""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT):
            while (end := head_length(data)) < 0:
                if len(data) > MAX_REQUEST_BYTES:
                    break
                chunk = await reader.read(65536)
                if not chunk:
                    if not data.strip(b"\r\n"):
                        return None
                    return HttpError(400, "the connection ended inside the request head")
                data += chunk
    except TimeoutError:
        if not data:
            return None
        return HttpError(408, f"no complete request head within {REQUEST_TIMEOUT:g} s")
    if end < 0 or end > MAX_REQUEST_BYTES:
        return HttpError(431, f"request head over {MAX_REQUEST_BYTES} bytes")
    return data[:end]


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass
