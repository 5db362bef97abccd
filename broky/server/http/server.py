"""A small HTTP/1.1 server on the metrics port (asyncio, no dependency).

Theory of operation
-------------------
Routes map a path (or, for the gateway's /v1/ routes, a path prefix) and the
methods it takes to an async handler that gets the parsed `Request` and
returns (status, content type, body), or a `Stream` whose chunks are sent as
they come. The master registers /healthz and /readyz, broky.server.http.monitor
adds /metrics, /stats, /connections and /topics (see there for what each
lists, and which need the auth token), broky.server.http.gateway the /v1/ routes.
With --users, a private route also takes a user's 'Authorization: Basic'
credentials (checked by broky.server.security.users.admits; the request then names
its `user`).

A connection carries requests one after the other (HTTP/1.1 keep-alive; an
HTTP/1.0 request, or one with "Connection: close", is the last), at most
MAX_REQUESTS_PER_CONNECTION of them, each head due within REQUEST_TIMEOUT of
the previous answer (an idle connection is closed silently after that). A
Stream is always the last answer of its connection. At most `max_connections`
connections are served at once: one more is answered 503 and closed
(`refused_busy`, counted), but for an event stream's request (one that
accepts text/event-stream, as every EventSource's does: its head read within
REFUSED_HEAD_TIMEOUT, REFUSED_READS of them at once), which gets a 200 that
asks it to come back (`retry_later`): a browser's EventSource closes for
good on any status but 200, and reconnects after a stream that ends. When
the server closes, every connection still open (a stream, an idle one, one
lingering after its last answer) is ended quietly.

Every request takes the same steps, each of which may end it with a 4xx:

    read      bytes until the head ends (the first empty line; CRLF or bare
              LF, as h11 accepts); bytes that no request line holds (a
              control character but CR and LF, or a byte outside ASCII, in
              the first line: a Broky client's Hello, whose size prefix
              holds NULs, or a TLS ClientHello) end it at once with a 400
              that says so and, in a `Broky-Client-Port` header, which
              port the server's clients connect to (`not_http`; the SDK
              names that port in its error: broky.client.connection);
              at most MAX_REQUEST_BYTES (else 431) and
              within REQUEST_TIMEOUT seconds (else 408 when anything
              arrived, and the client counted in `cut_slow`; a connection
              that sent nothing is closed silently, as is one that ended
              before anything but empty lines)
    parse     `parse_head`, sans-IO (bytes in, a Request out or HttpError
              raised): "METHOD SP TARGET SP HTTP/1.x" (400; another major
              version 505; a method other than GET, HEAD, POST and OPTIONS
              405 with Allow, in the request's version), a target of visible ASCII that is a path or an
              absolute http(s) URL (400), header lines "name: value" with a
              token name and no control character (400; obsolete line
              folding too; a second Authorization, Host, Content-Length or
              Transfer-Encoding too). The query string is decoded
              (percent-escapes as UTF-8, invalid sequences replaced; the
              last value of a name wins); the path is matched as sent,
              undecoded (unknown: 404; a method the route does not take: 405
              with Allow)
    admit     from the head alone, before any of the body is read (`admit`):
              a page of another origin (its Origin header) that the server
              does not allow is refused (403; broky.server.http.origins, which
              also gives the CORS headers of an allowed one's answers); the
              path is routed (unknown: 404; OPTIONS: 204 with Allow, and a
              preflight's CORS headers; a method the route does not take:
              405 with Allow), and a route registered `private`
              needs, when the server has an auth token, the token
              (`Authorization: Bearer <token>`, or for a route registered
              `browser` also the "broky_token" cookie or ?access_token=;
              compared in constant time): 401 with WWW-Authenticate: Bearer
              and a body saying whether it was missing, malformed or wrong.
              So a client without the token cannot make the server hold a
              body. The body of a request answered here is read past (and
              the connection goes on) only if it has a Content-Length of at
              most SKIPPED_BODY bytes; else the answer is the connection's
              last, and the body is never read (the linger below discards
              it)
    body      (a request with Content-Length or "Transfer-Encoding: chunked"
              only; `body_framing` decides which, sans-IO, and
              `ChunkedDecoder` decodes chunks; any other Transfer-Encoding
              is a 501, both framings at once a 400): at most `max_body`
              bytes (413, said before any of it is read when Content-Length
              says so), each read within REQUEST_TIMEOUT and the whole body
              within BODY_TIMEOUT (408, counted in `cut_slow`). The bodies
              held at once, by all connections, share `body_memory` bytes
              (--http-body-memory): a body that would take more is answered
              503 with Retry-After (`refused_memory`, counted): a
              Content-Length body before any of it is read, a chunked one
              as it grows. A body is held until its handler returns.
              "Expect: 100-continue" (curl sends it with a body over 1 MiB,
              then waits a second for it) is answered "100 Continue" once
              the body will be read; any other expectation is a 417. A
              body sent to a route that takes none (GET) is treated as one
              answered from the head (read past if small, else never read)
    handle    the route's handler; its query-string checks are its own
              (a bad value is its 400)

Every error body is JSON, {"error": "<what was wrong>", "status": N}; one that
names what was wrong quotes the input escaped and cut to QUOTED_CHARS. A HEAD
request gets the same status and headers as a GET, without the body. After
the last answer of a connection the write side is shut, and input read and
discarded until the client closes (at most LINGER_SECONDS), so that bytes
the client sent beyond the head never turn the close into a reset that
destroys the answer.

A Stream is written chunked (HTTP/1.1; to an HTTP/1.0 client, without
framing, ended by the close): each chunk its handler gives is written as it
comes, and a write the client does not take within WRITE_TIMEOUT cuts the
stream (counted in `cut_slow`); the stream's own bound on what it holds for a
slow reader is its handler's (broky.server.http.gateway). A client that closes
its side ends the stream at once (a reader task watches for the end of its
input). A stream that ends writes the terminating zero-length chunk, so a
client can tell a clean end from a cut.

No input reaches a traceback or a 500: a handler that raises is a bug of
ours. It answers 500 with a short body, and is logged with its traceback at
most once per route per LOG_INTERVAL seconds, with the running count of its
failures (broky.server.logs.Throttle). Refused tokens are logged the same
way, once per cause per LOG_INTERVAL, never with what was sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from broky.errors import BrokyError
from broky.server.http.origins import OriginPolicy
from broky.server.logs import Throttle
from broky.server.security.users import Users, admits

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("broky.master")

Response = tuple[int, str, bytes]


@dataclass(frozen=True, slots=True)
class Request:
    method: str  # "GET", "HEAD" or "POST"
    path: str  # the target's path, as sent (not percent-decoded)
    query: dict[str, str]  # decoded; the last value of a name wins
    headers: dict[str, str]  # lower-case name -> value (bytes as latin-1, so nothing is lost)
    version: int = 1  # the minor version: HTTP/1.0 or HTTP/1.1
    body: bytes = b""
    user: str | None = None  # the user its Basic credentials named (--users), once authorized
    cors: tuple[tuple[str, str], ...] = ()  # the CORS headers of its answers (broky.server.http.origins)

    @property
    def keep_alive(self) -> bool:
        """The client lets the connection carry another request after this one."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        return self.version >= 1 and "close" not in tokens


class Stream(Protocol):
    """A response sent as it comes (broky.server.http.gateway's subscriptions)."""

    content_type: str
    headers: tuple[tuple[str, str], ...]

    async def next(self) -> bytes | None:
        """The next bytes to send (coalesced), or None: the stream has ended."""

    def close(self) -> None:
        """The client went, or the server cut the stream: let go of what it holds."""


Handler = Callable[[Request], Awaitable[Response | Stream]]

_REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT = 5.0  # for a whole head, for each read of a body, and between two requests
BODY_TIMEOUT = 60.0  # for a whole body
WRITE_TIMEOUT = 10.0  # for a write the client does not take (the slow-consumer deadline's default)
MAX_REQUESTS_PER_CONNECTION = 1000
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_BODY = 16 << 20
DEFAULT_BODY_MEMORY = 64 << 20  # request bodies held at once, by all connections
LINGER_SECONDS = 1.0
SKIPPED_BODY = 65536  # a body refused from its head (or for a route that takes none) read past up to this
LOG_INTERVAL = 10.0  # seconds between two log lines about one route's failures (or one refusal cause)
QUOTED_CHARS = 40  # of the input quoted in an error body
SSE_RETRY_MS = 1000  # how long an event stream's client waits before it reconnects (its `retry:`)
EVENT_STREAM = "text/event-stream; charset=utf-8"
REFUSED_READS = 64  # connections over max_connections whose head is read at once (`_busy`)
REFUSED_HEAD_TIMEOUT = 1.0  # seconds for such a head (a browser sends it at once)
METHODS = ("GET", "HEAD", "POST", "OPTIONS")
READ_METHODS = ("GET", "HEAD")
_METHOD_BYTES = frozenset(m.encode() for m in METHODS)
TOKEN_COOKIE = "broky_token"
# Headers a request may carry once.
_SINGLE = frozenset({"authorization", "host", "content-length", "transfer-encoding"})

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token (methods, header names)
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # in a header value (HTAB is allowed)
_ABSOLUTE = re.compile(r"https?://[^/?]*", re.IGNORECASE)
_DIGITS = re.compile(r"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


class HttpError(BrokyError):
    """A request answered `status` with `message` before (or instead of) its handler."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: tuple[tuple[str, str], ...] = (),
        fields: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.fields = fields or {}  # more members of the JSON body
        self.send_body = True  # False once the method is known to be HEAD
        self.version = 0  # the minor version of the answer's status line, once the request's is known

    def answer_for(self, send_body: bool) -> Answer:
        self.send_body = send_body
        return self.answer()

    def answer(self) -> Answer:
        body = error_body(self.status, self.message, **self.fields)
        return Answer(
            self.status, "application/json", body, self.headers, self.send_body, version=self.version
        )


def error_body(status: int, message: str, **more: object) -> bytes:
    """The JSON body of an error answer."""
    return (json.dumps({"error": message, "status": status, **more}) + "\n").encode()


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    send_body: bool = True
    keep_alive: bool = False
    version: int = 0  # the minor version of the status line

    def encode(self) -> bytes:
        lines = [
            f"HTTP/1.{self.version} {self.status} {_REASONS.get(self.status, '')}",
            *(
                ()
                if self.status == 204  # no content, and no Content-Length (RFC 9110 8.6)
                else (f"Content-Type: {self.content_type}", f"Content-Length: {len(self.body)}")
            ),
            *(f"{name}: {value}" for name, value in self.headers),
            "Connection: keep-alive" if self.keep_alive else "Connection: close",
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        return head + self.body if self.send_body else head


@dataclass(frozen=True, slots=True)
class Route:
    handler: Handler
    private: bool  # needs the auth token when the server has one
    methods: tuple[str, ...] = READ_METHODS
    browser: bool = False  # the token may also come as a cookie or ?access_token= (EventSource)


@dataclass
class HttpCounters:
    """What the HTTP server refused or cut (plain integers, read at scrape time)."""

    connections: int = 0  # open now
    accepted: int = 0
    requests: int = 0  # heads read
    answered: dict[str, dict[str, int]] = field(default_factory=dict)  # method label -> status -> answers
    refused_busy: int = 0  # connections over max_connections, answered 503
    cut_slow: int = 0  # heads or bodies not sent in time, streams not read in time
    too_large: int = 0  # bodies over max_body (413)
    refused_memory: int = 0  # bodies refused while others held body_memory (503)
    failures: dict[str, int] = field(default_factory=dict)


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
    minor = 0 if major.group(2) == b"0" else 1
    try:
        if _TOKEN.fullmatch(method_bytes) is None:
            raise HttpError(400, f"malformed method {quote(method_bytes)}")
        method = method_bytes.decode("ascii")
        if method not in METHODS:
            raise HttpError(405, f"{', '.join(METHODS)} only", (("Allow", ", ".join(METHODS)),))
        try:
            path, query = _parse_target(target_bytes)
            headers = _parse_headers(header_lines)
        except HttpError as exc:
            exc.send_body = method != "HEAD"
            raise
    except HttpError as exc:
        exc.version = minor  # answered in the request's version
        raise
    return Request(method, path, query, headers, minor)


def body_framing(request: Request) -> int | None:
    """How the request's body is framed: its length (0: no body), or None: chunked.

    Raises:
        HttpError: 400 (a bad Content-Length, or both framings), 501 (another Transfer-Encoding).
    """
    coding = request.headers.get("transfer-encoding")
    length = request.headers.get("content-length")
    if coding is not None:
        if length is not None:
            raise HttpError(400, "both Content-Length and Transfer-Encoding")
        if coding.strip().lower() != "chunked":
            raise HttpError(501, f"Transfer-Encoding {quote(coding)}: only chunked is understood")
        return None
    if length is None:
        return 0
    if _DIGITS.fullmatch(length.strip()) is None:
        raise HttpError(400, f"malformed Content-Length {quote(length)}")
    return int(length)


class ChunkedDecoder:
    """Sans-IO decoder of a chunked body: `feed` bytes, read `body` once `done`.

    Chunk extensions are ignored, trailers read and dropped. The data held is
    bounded by `limit` (HttpError 413 past it) plus one chunk-size line.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0  # body bytes so far
        self.buffer = b""
        self.remaining = -1  # data bytes left of the current chunk; 0: its CRLF; -1: a size line
        self.trailers = False
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Take `data`; return what follows the body (once `done`).

        Raises:
            HttpError: 400 (malformed), 413 (over the limit).
        """
        self.buffer += data
        while not self.done:
            if self.remaining > 0:  # chunk data
                if not self.buffer:
                    return b""
                take = self.buffer[: self.remaining]
                self.buffer = self.buffer[len(take) :]
                self.remaining -= len(take)
                self.parts.append(take)
                self.size += len(take)
                continue
            end = self.buffer.find(b"\n")
            if end < 0:
                if len(self.buffer) > 1024:
                    raise HttpError(400, "a chunk-size line over 1024 bytes")
                return b""
            line, self.buffer = self.buffer[:end].removesuffix(b"\r"), self.buffer[end + 1 :]
            if self.remaining == 0:  # the end of a chunk's data
                if line:
                    raise HttpError(400, "a chunk's data longer than its size")
                self.remaining = -1
            elif self.trailers:
                self.done = not line
            else:
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if _HEX.fullmatch(size_text) is None:
                    raise HttpError(400, f"malformed chunk size {quote(size_text)}")
                size = int(size_text, 16)
                if size == 0:
                    self.trailers = True
                elif self.size + size > self.limit:
                    raise HttpError(413, f"body over {self.limit} bytes (--http-max-body)")
                else:
                    self.remaining = size
        rest, self.buffer = self.buffer, b""
        return rest

    @property
    def body(self) -> bytes:
        return b"".join(self.parts)


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
            headers[key] += ("; " if key == "cookie" else ", ") + value.decode("latin-1")
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


def wants_event_stream(request: Request) -> bool:
    """A GET that accepts an event stream (every EventSource's does)."""
    return request.method == "GET" and "text/event-stream" in request.headers.get("accept", "")


def retry_later(message: str, status: int = 503) -> bytes:
    """An event stream that tells its client to come back in SSE_RETRY_MS, and why (with the
    status it would have been answered otherwise): the answer that keeps a browser's
    EventSource reconnecting, where any status but 200 would close it for good (the HTML
    standard, "Server-sent events": a 200 whose stream ends is retried, a 503 is not)."""
    data = json.dumps({"error": message, "status": status})
    return f"retry: {SSE_RETRY_MS}\n\nevent: unavailable\ndata: {data}\n\n".encode()


def cookie(request: Request, name: str) -> str | None:
    """The value of cookie `name` in the request, if any (the first wins)."""
    for part in request.headers.get("cookie", "").split(";"):
        key, eq, value = part.strip().partition("=")
        if eq and key == name:
            return value.strip().strip('"')
    return None


# ---------------------------------------------------------------- the server


class BodyMemory:
    """The bytes of request bodies held at once, by all connections, bounded by `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def ticket(self) -> BodyTicket:
        return BodyTicket(self)


class BodyTicket:
    """One request's share of a BodyMemory: `hold` grows it, `release` gives it back."""

    __slots__ = ("memory", "held")

    def __init__(self, memory: BodyMemory) -> None:
        self.memory = memory
        self.held = 0

    def hold(self, size: int) -> None:
        """Hold `size` bytes in all (not more).

        Raises:
            HttpError: 503, when the bodies of other requests hold what is left.
        """
        more = size - self.held
        if more <= 0:
            return
        memory = self.memory
        if memory.held + more > memory.limit:
            raise HttpError(
                503,
                f"the server holds {memory.held} bytes of request bodies already, {memory.limit} at "
                "most (--http-body-memory); try again in a moment",
                (("Retry-After", "1"),),
            )
        memory.held += more
        self.held = size

    def release(self) -> None:
        self.memory.held -= self.held
        self.held = 0


class HttpServer:
    def __init__(
        self,
        token: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        body_memory: int = DEFAULT_BODY_MEMORY,
        allow_origins: tuple[str, ...] = (),
    ) -> None:
        self.origins = OriginPolicy(allow_origins)  # --http-allow-origin (broky.server.http.origins)
        self.routes: dict[str, Route] = {}
        self.prefixes: dict[str, Route] = {}  # path prefix -> route (the longest that matches wins)
        self.server: asyncio.AbstractServer | None = None
        self._token = token.encode() if token else None
        self.users: Callable[[], Users | None] = lambda: None  # --users: Basic credentials admit too
        self.max_body = max_body
        self.max_connections = max_connections
        self.bodies = BodyMemory(body_memory)
        self.counters = HttpCounters()
        self.failures = self.counters.failures  # route -> handler failures (answered 500)
        self.refused: dict[str, int] = {}  # cause -> requests refused for their token (401)
        self.log_throttle = Throttle(LOG_INTERVAL)
        self.streams: set[Stream] = set()  # streams being written
        self.tasks: set[asyncio.Task[None]] = set()  # one per connection, refused ones included
        self.refused_reading = 0  # refused connections whose head is being read (`_busy`)
        self.client_port = 0  # the server's port for Broky clients, once bound (`not_http`)

    def route(
        self,
        path: str,
        handler: Handler,
        private: bool = False,
        methods: tuple[str, ...] = READ_METHODS,
        prefix: bool = False,
        browser: bool = False,
    ) -> None:
        """Serve `path` (or, with `prefix`, every path starting with it) with `handler` for
        `methods`; `private`: only with the auth token, if the server has one; `browser`: the
        token may also come as the broky_token cookie or ?access_token= (EventSource sets no
        header)."""
        (self.prefixes if prefix else self.routes)[path] = Route(handler, private, methods, browser)

    def find(self, path: str) -> Route | None:
        route = self.routes.get(path)
        if route is None:
            matches = [p for p in self.prefixes if path.startswith(p)]
            if matches:
                route = self.prefixes[max(matches, key=len)]
        return route

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen (https with the context `tls`); return the bound port."""
        self.origins.scheme = "https" if tls is not None else "http"
        self.server = await asyncio.start_server(
            self._handle, host, port, reuse_address=True, limit=MAX_REQUEST_BYTES, ssl=tls
        )
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, end the streams, and end every connection still open (one that
        lingers after its last answer, a refused one, an idle one) before the loop ends."""
        for stream in list(self.streams):
            stream.close()
        if self.server is not None:
            self.server.close()
        await asyncio.sleep(0)  # the streams' writers take their ends
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=LINGER_SECONDS)
        if self.server is not None:
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, from its accept to its close. Cancelled only by `close` (or by the
        end of the loop): it then ends quietly, its connection closed. (It must not end
        cancelled: Python 3.11's asyncio.start_server logs a cancelled handler as an error
        with its traceback.)"""
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        counters = self.counters
        counters.accepted += 1
        try:
            if counters.connections >= self.max_connections:
                counters.refused_busy += 1
                await _last_answer(reader, writer, await self._busy(reader))
                return
            counters.connections += 1
            try:
                await self._serve(reader, writer)
            finally:
                counters.connections -= 1
        except asyncio.CancelledError:
            writer.close()  # (what it wrote still goes out, if the client takes it)
        finally:
            self.tasks.discard(task)

    def _answered(self, method: str, status: int) -> None:
        answered = self.counters.answered.setdefault(method, {})
        code = str(status)
        answered[code] = answered.get(code, 0) + 1

    async def _busy(self, reader: asyncio.StreamReader) -> Answer:
        """The answer to a connection over max_connections: 503 with Retry-After, or to an
        event stream's request (up to REFUSED_READS of them read at once, each head within
        REFUSED_HEAD_TIMEOUT), a stream that asks to be retried (`retry_later`): a browser's
        EventSource gives up for good on a 503."""
        why = f"the server serves {self.max_connections} HTTP connections already; try again later"
        busy = HttpError(503, why, (("Retry-After", "1"),))
        if self.refused_reading >= REFUSED_READS:
            return busy.answer()
        self.refused_reading += 1
        try:
            got = await _read_head(reader, timeout=REFUSED_HEAD_TIMEOUT, client_port=self.client_port)
        finally:
            self.refused_reading -= 1
        if not isinstance(got, tuple):
            return busy.answer()
        try:
            request = parse_head(got[0])
        except HttpError as exc:
            busy.version = exc.version
            return busy.answer()
        busy.version = request.version
        headers = request.headers
        served, cors = self.origins.verdict(headers.get("origin"), headers.get("host"))
        if not served or not wants_event_stream(request):
            busy.send_body = request.method != "HEAD"
            return busy.answer()
        return Answer(200, EVENT_STREAM, retry_later(why), (("Cache-Control", "no-cache"), *cors),
                      version=request.version)  # fmt: skip

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        data = b""  # read beyond the previous request (pipelined)
        while True:
            method = "other"
            try:
                got = await _read_head(reader, data, idle=served > 0, client_port=self.client_port)
                if got is None:
                    writer.close()
                    return
                if isinstance(got, HttpError):
                    if got.status == 408:
                        self.counters.cut_slow += 1
                    self._answered(method, got.status)
                    await _last_answer(reader, writer, got.answer())
                    return
                head, data = got
                served += 1
                self.counters.requests += 1
                method = _method_label(head)
                answer, data = await self._answer_with_body(reader, writer, head, data)
            except (OSError, TimeoutError):  # the client reset or vanished
                writer.close()
                return
            except Exception:  # a bug of ours outside any handler: logged like a handler's
                self._failed("(request)")
                answer = Answer(500, "application/json", error_body(500, "internal error"))
            if not isinstance(answer, Answer):
                self._answered(method, 200)
                await self._write_stream(reader, writer, *answer)
                return
            self._answered(method, answer.status)
            if answer.keep_alive and served < MAX_REQUESTS_PER_CONNECTION:
                try:
                    writer.write(answer.encode())
                    async with asyncio.timeout(WRITE_TIMEOUT):
                        await writer.drain()
                except TimeoutError:
                    self.counters.cut_slow += 1
                    writer.close()
                    return
                except (OSError, RuntimeError):
                    writer.close()
                    return
                continue
            await _last_answer(reader, writer, _closing(answer))
            return

    async def _answer_with_body(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, data: bytes
    ) -> tuple[Answer | tuple[Stream, Request], bytes]:
        """The answer to one request (a Stream with its request, or an Answer), and the bytes
        read beyond its body."""
        try:
            request = parse_head(head)
        except HttpError as exc:
            return exc.answer(), b""
        send_body = request.method != "HEAD"
        try:
            framing = body_framing(request)
        except HttpError as exc:
            exc.send_body = send_body
            return _versioned(exc.answer(), request, keep=False), b""
        route = self.find(request.path)
        refused, request = await self.admit(request, route)
        unused = refused is None and framing != 0 and route is not None and "POST" not in route.methods
        if refused is not None or unused:
            # Decided from the head, or a body the route does not take: a small body is
            # skipped (the connection goes on), a larger or chunked one never read.
            skipped = await _skip_body(reader, framing, data)
            keep = skipped is not None and request.keep_alive
            if refused is None:
                assert route is not None
                got = await self.handle(request, route)
                if not isinstance(got, Answer):
                    return (got, request), b""
                refused, keep = got, keep and got.status < 500
            return _versioned(refused, request, keep=keep), skipped or b""
        assert route is not None
        if framing == 0:
            got = await self.handle(request, route)
            if not isinstance(got, Answer):
                return (got, request), b""
            return _versioned(got, request, keep=request.keep_alive and got.status < 500), data
        ticket = self.bodies.ticket()
        try:
            try:
                limit = self.max_body
                if framing is not None and framing > limit:
                    raise HttpError(413, f"body of {framing} bytes over {limit} (--http-max-body)")
                expect = request.headers.get("expect") if request.version >= 1 else None
                if expect is not None and expect.strip().lower() != "100-continue":
                    raise HttpError(417, f"Expect {quote(expect)}: only 100-continue is understood")
                ticket.hold(framing or 0)  # chunked: as it grows
                if expect is not None:
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body, data = await _read_body(reader, framing, data, limit, ticket)
            except HttpError as exc:
                if exc.status == 408:
                    self.counters.cut_slow += 1
                elif exc.status == 413:
                    self.counters.too_large += 1
                elif exc.status == 503:
                    self.counters.refused_memory += 1
                exc.send_body = send_body
                return _versioned(exc.answer(), request, keep=False), b""
            request = dataclasses.replace(request, body=body)
            del body
            got = await self.handle(request, route)
        finally:
            ticket.release()
        if isinstance(got, Answer):
            return _versioned(got, request, keep=request.keep_alive and got.status < 500), data
        return (got, request), b""

    async def answer(self, head: bytes) -> Answer:
        """The answer to one request head without a body: parse, route, authorize, handle
        (a Stream is closed and answered 200 without its body: for tests of the routes)."""
        try:
            request = parse_head(head)
        except HttpError as exc:
            return exc.answer()
        got, request = await self.respond(request)
        if isinstance(got, Answer):
            return _with_cors(got, request)
        got.close()
        return Answer(200, got.content_type, b"", (*got.headers, *request.cors), send_body=False)

    async def respond(self, request: Request) -> tuple[Answer | Stream, Request]:
        """Route, authorize and handle a parsed request (its body, if any, already in it); and
        the request as admitted (its user, its CORS headers)."""
        route = self.find(request.path)
        refused, request = await self.admit(request, route)
        if refused is not None:
            return refused, request
        assert route is not None
        return await self.handle(request, route), request

    async def admit(self, request: Request, route: Route | None) -> tuple[Answer | None, Request]:
        """The answer that ends `request` from its head alone (403, 404, 204 to an OPTIONS,
        405, 401), or None; and the request, with the CORS headers of its answers, and its
        user once Basic credentials admitted it."""
        send_body = request.method != "HEAD"
        headers = request.headers
        served, cors = self.origins.verdict(headers.get("origin"), headers.get("host"))
        if cors:
            request = dataclasses.replace(request, cors=cors)
        if not served:
            why = (
                f"a request from a page of another origin ({quote(headers['origin'])}): refused unless "
                "the server allows it (--http-allow-origin)"
            )
            return HttpError(403, why).answer_for(send_body), request
        if route is None:
            return HttpError(404, f"no such path: {quote(request.path)}").answer_for(send_body), request
        if request.method == "OPTIONS":
            allow = ", ".join((*route.methods, "OPTIONS"))
            extra: tuple[tuple[str, str], ...] = (("Allow", allow),)
            if cors and "access-control-request-method" in headers:  # an allowed origin's preflight
                extra += self.origins.preflight(headers, route.methods)
            return Answer(204, "", b"", extra, send_body=False), request
        if request.method not in route.methods:
            allow = ", ".join(route.methods)
            allowed = (("Allow", f"{allow}, OPTIONS"),)
            return HttpError(405, f"{allow} only", allowed).answer_for(send_body), request
        if route.private and self._token is not None:
            users = self.users()
            if users is not None and request.headers.get("authorization", "")[:6].lower() == "basic ":
                user = await self._basic(request, users)
                if user is None:
                    return HttpError(
                        401, "wrong user or password", (("WWW-Authenticate", 'Basic realm="broky"'),)
                    ).answer_for(send_body), request
                request = dataclasses.replace(request, user=user)
            else:
                refused = self._authorize(request, route.browser)
                if refused is not None:
                    return refused.answer_for(send_body), request
        return None, request

    async def handle(self, request: Request, route: Route) -> Answer | Stream:
        """The answer of `route`'s handler to an admitted request."""
        send_body = request.method != "HEAD"
        try:
            got = await route.handler(request)
        except HttpError as exc:  # the handler's own 4xx (or 503)
            return exc.answer_for(send_body)
        except Exception:
            self._failed(request.path)
            return Answer(500, "application/json", error_body(500, "internal error"), send_body=send_body)
        if isinstance(got, tuple):
            status, ctype, body = got
            return Answer(status, ctype, body, send_body=send_body)
        return got

    async def _write_stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: Stream, request: Request
    ) -> None:
        """Write `stream` (the last answer of its connection) until it ends or the client goes."""
        chunked = request.version >= 1
        lines = [
            f"HTTP/1.{request.version} 200 OK",
            f"Content-Type: {stream.content_type}",
            *(f"{name}: {value}" for name, value in (*stream.headers, *request.cors)),
            "Cache-Control: no-cache",
            "X-Accel-Buffering: no",
            *(["Transfer-Encoding: chunked"] if chunked else []),
            "Connection: close",
        ]
        self.streams.add(stream)
        watcher = asyncio.get_running_loop().create_task(_watch_eof(reader, stream))
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            if request.method == "HEAD":
                return
            while (data := await stream.next()) is not None:
                if data:
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                    async with asyncio.timeout(WRITE_TIMEOUT):
                        await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
            async with asyncio.timeout(WRITE_TIMEOUT):
                await writer.drain()
        except TimeoutError:
            self.counters.cut_slow += 1
        except (OSError, RuntimeError):
            pass
        finally:
            self.streams.discard(stream)
            stream.close()
            watcher.cancel()
            writer.close()

    async def _basic(self, request: Request, users: Users) -> str | None:
        """The user that 'Authorization: Basic base64(user:password)' names, verified; or None."""
        import base64
        import binascii

        try:
            given = base64.b64decode(request.headers["authorization"][6:].strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            given = ""
        if not await admits(None, users, given):
            self.refused["wrong"] = self.refused.get("wrong", 0) + 1
            return None
        return given.partition(":")[0]

    def _authorize(self, request: Request, browser: bool) -> HttpError | None:
        """None when the request carries the token, else the 401 that says why not."""
        assert self._token is not None
        value = request.headers.get("authorization")
        scheme, _, credentials = (value or "").partition(" ")
        credentials = credentials.strip(" \t")
        if value is None and browser:  # EventSource sets no header: a cookie, or the query
            given = cookie(request, TOKEN_COOKIE)
            if given is None:
                given = request.query.get("access_token")
            if given is not None:
                value, scheme, credentials = given, "bearer", given
        if value is None:
            cause = "missing"
            also = f", the {TOKEN_COOKIE} cookie or ?access_token=<token>" if browser else ""
            why = f"{request.path} needs the server's auth token: send 'Authorization: Bearer <token>'{also}"
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


def _method_label(head: bytes) -> str:
    """The method of a request head as a metrics label: one this server takes (lower case), or
    "other" (any other, or none: a head that does not parse)."""
    method = head.lstrip(b"\r\n").split(b" ", 1)[0]
    return method.decode("ascii").lower() if method in _METHOD_BYTES else "other"


def _versioned(answer: Answer, request: Request, keep: bool) -> Answer:
    """The answer to `request`: in its version, with its CORS headers."""
    return Answer(answer.status, answer.content_type, answer.body, (*answer.headers, *request.cors),
                  answer.send_body, keep, request.version)  # fmt: skip


def _with_cors(answer: Answer, request: Request) -> Answer:
    return dataclasses.replace(answer, headers=(*answer.headers, *request.cors)) if request.cors else answer


def _closing(answer: Answer) -> Answer:
    return Answer(answer.status, answer.content_type, answer.body, answer.headers, answer.send_body,
                  False, answer.version)  # fmt: skip


async def _last_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: Answer) -> None:
    """Write the connection's last answer, shut the write side, linger, close."""
    try:
        writer.write(answer.encode())
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()
        writer.write_eof()  # then wait for the client to close: see the theory of operation
        await asyncio.wait_for(_discard(reader), LINGER_SECONDS)
    except (OSError, RuntimeError, TimeoutError):  # the client went away (RuntimeError: closed transport)
        pass
    finally:
        writer.close()


# The bytes a request line may hold (and the CR and LF that end it, or empty lines before it).
_REQUEST_LINE_BYTES = bytes(range(0x20, 0x7F)) + b"\r\n"


def not_http(data: bytes, client_port: int) -> HttpError | None:
    """The 400 for bytes that cannot begin an HTTP request (a byte no request line holds in
    the first line), said before waiting for more, or None. `client_port`: the port of the
    server's Broky clients, named in the message and in a Broky-Client-Port header (0: not
    known)."""
    line = data.lstrip(b"\r\n").split(b"\n", 1)[0]
    if not line.translate(None, _REQUEST_LINE_BYTES):
        return None
    where = f"; Broky clients connect to port {client_port}" if client_port else ""
    return HttpError(
        400,
        f"not an HTTP request (it starts {quote(data[:16])}): this is the HTTP port of a Broky server{where}",
        (("Broky-Client-Port", str(client_port)),) if client_port else (),
    )


async def _read_head(
    reader: asyncio.StreamReader,
    data: bytes = b"",
    idle: bool = False,
    timeout: float = REQUEST_TIMEOUT,
    client_port: int = 0,
) -> tuple[bytes, bytes] | HttpError | None:
    """The request head and the bytes read after it, the error that ends the request instead,
    or None: nothing to answer. `idle`: a kept-alive connection, whose silence is no error.
    `client_port`: see `not_http`."""
    try:
        async with asyncio.timeout(timeout):
            while (end := head_length(data)) < 0:
                if len(data) > MAX_REQUEST_BYTES:
                    break
                chunk = await reader.read(65536)
                if not chunk:
                    if not data.strip(b"\r\n"):
                        return None
                    return HttpError(400, "the connection ended inside the request head")
                data += chunk
                if (stranger := not_http(data, client_port)) is not None:
                    return stranger
    except TimeoutError:
        if not data.strip(b"\r\n") and (idle or not data):
            return None
        return HttpError(408, f"no complete request head within {timeout:g} s")
    if end < 0 or end > MAX_REQUEST_BYTES:
        return HttpError(431, f"request head over {MAX_REQUEST_BYTES} bytes")
    return data[:end], data[end:]


async def _read_body(
    reader: asyncio.StreamReader, framing: int | None, data: bytes, limit: int, ticket: BodyTicket
) -> tuple[bytes, bytes]:
    """(the body, the bytes read beyond it) of a request framed `framing` (body_framing); a
    chunked body is held in `ticket` as it grows (a Content-Length one was held before).

    Raises:
        HttpError: 400 (malformed chunks, or the connection ended inside the body), 408 (too
            slow), 413 (over `limit`), 503 (the body memory is held by others).
    """
    if framing == 0:
        return b"", data
    try:
        async with asyncio.timeout(BODY_TIMEOUT):
            if framing is not None:
                parts = [data[:framing]]
                got = len(parts[0])
                rest = data[framing:]
                while got < framing:
                    chunk = await asyncio.wait_for(reader.read(min(framing - got, 1 << 20)), REQUEST_TIMEOUT)
                    if not chunk:
                        raise HttpError(
                            400, f"the connection ended inside the body ({got} of {framing} bytes)"
                        )
                    parts.append(chunk)
                    got += len(chunk)
                return b"".join(parts), rest
            decoder = ChunkedDecoder(limit)
            rest = decoder.feed(data)
            ticket.hold(decoder.size)
            while not decoder.done:
                chunk = await asyncio.wait_for(reader.read(1 << 20), REQUEST_TIMEOUT)
                if not chunk:
                    raise HttpError(400, "the connection ended inside the chunked body")
                rest = decoder.feed(chunk)
                ticket.hold(decoder.size)
            return decoder.body, rest
    except TimeoutError:
        raise HttpError(408, "the request body did not arrive in time") from None


async def _skip_body(reader: asyncio.StreamReader, framing: int | None, data: bytes) -> bytes | None:
    """Read past a body that will not be used, if it is a Content-Length one of at most
    SKIPPED_BODY bytes: the bytes read beyond it; None when the body is left unread (the
    connection must end), or it did not arrive in time."""
    if framing == 0:
        return data
    if framing is None or framing > SKIPPED_BODY:
        return None
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT):
            while len(data) < framing:
                chunk = await reader.read(framing - len(data))
                if not chunk:
                    return None
                data += chunk
    except TimeoutError:
        return None
    return data[framing:]


async def _watch_eof(reader: asyncio.StreamReader, stream: Stream) -> None:
    """Close `stream` once its client closes (what it sends meanwhile is dropped)."""
    try:
        while await reader.read(65536):
            pass
    except (OSError, RuntimeError):
        pass
    stream.close()


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass
