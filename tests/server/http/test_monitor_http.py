"""The HTTP port's request handling: no input gets a 500 or a traceback, private
endpoints need the token, and nothing any endpoint or log line shows helps a
resume claim.

In-process, the sans-IO parser (`parse_head`, `head_length`), the answer path
of `HttpServer` and the ?limit= check are fuzzed with hypothesis. Then a real
`broky serve` (with an auth token) gets generated requests over raw sockets on
every route: every answer must be a well-formed HTTP/1.x response with an
allowed status (the exact one for a request built well), the server must keep
answering, and its log must hold no traceback and no error.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broky.protocol import LossNotice, Message, PreviousConnection
from broky.server.http import monitor
from broky.server.http import server as httpd
from broky.server.http.server import HttpError, HttpServer, Request, Response, head_length, parse_head
from broky.server.worker import views
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

TOKEN = "t0ken-f7"
OPEN = ("/", "/healthz", "/readyz", "/metrics")  # "/": the console (broky.server.http.console)
PRIVATE = ("/stats", "/connections", "/topics")
ROUTES = OPEN + PRIVATE
PARSE_STATUSES = {400, 405, 505}
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9]) [A-Za-z ]*\r\n")

# ---------------------------------------------------------------- strategies

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
methods_ok = st.sampled_from(["GET", "HEAD", "GET", "HEAD", "OPTIONS"])
methods_any = st.one_of(
    methods_ok,
    st.sampled_from(["POST", "PUT", "DELETE", "OPTIONS", "get", "head", "PRI", "CONNECT", "TRACE"]),
    st.text(TOKEN_CHARS, min_size=1, max_size=8),
    st.binary(min_size=0, max_size=8).map(lambda b: b.decode("latin-1")),
)
paths_ok = st.one_of(  # two in three name a route
    st.sampled_from(ROUTES),
    st.sampled_from(ROUTES),
    st.sampled_from(["/index.html", "/nope", "/metrics/", "/stats/x", "/healthz.json", "/debug/stats"]),
)
paths_any = st.one_of(
    paths_ok,
    st.sampled_from(["*", "", "metrics", "//metrics", "/%6Detrics", "/met%00rics", "/metrics#x", "/\u00e9"]),
    st.text(max_size=30).map(lambda t: "/" + t),
)
limit_values = st.one_of(
    st.integers(min_value=-5, max_value=2000).map(str),
    st.sampled_from(
        ["%C2%B2", "%D9%A3", "%EF%BC%95", "%FF", "%ZZ", "%", "%2", "", "+5", "0x10", "1e3", "5.0"]
    ),
    st.integers(min_value=4290, max_value=4400).map(lambda n: "9" * n),
    st.text(max_size=12).map(lambda t: urllib.parse.quote(t, safe="")),
    st.binary(max_size=12).map(lambda b: "".join(f"%{x:02X}" for x in b)),
)
query_pairs = st.lists(
    st.tuples(st.sampled_from(["limit", "Limit", "x", "", "limit[]", "%6Cimit"]), limit_values), max_size=4
)
line_ends = st.sampled_from(["\r\n", "\n"])
SINGLE = ("host", "authorization", "content-length")  # a second one is a 400


@dataclass
class Generated:
    raw: bytes
    valid: bool  # every part well formed: the expected status is known
    method: str
    path: str
    query: dict[str, str]
    auth: str  # "none", "right", "wrong", "malformed"
    origin: str = "none"  # of a page: "none" (a program), "own" (the server's), "other" (refused: 403)


@st.composite
def requests(draw: st.DrawFn, token: str = TOKEN) -> Generated:
    valid = draw(st.booleans())
    method = draw(methods_ok if valid else methods_any)
    path = draw(paths_ok if valid else paths_any)
    pairs = draw(query_pairs)
    query = "&".join(f"{k}={v}" for k, v in pairs)
    with_query = bool(pairs) or draw(st.booleans())  # "/metrics?" too
    target = path + ("?" + query if with_query else "")
    if valid and draw(st.booleans()):
        target = "http://localhost:9477" + target
    version = draw(
        st.sampled_from(["HTTP/1.1", "HTTP/1.0"])
        if valid
        else st.sampled_from(
            ["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1", "http/1.1", "HTTP/1.1 ", ""]
        )
    )
    auth = draw(st.sampled_from(["none", "right", "right", "right", "wrong", "malformed"]))
    headers: list[str] = []
    host = draw(st.booleans())
    if host:
        headers.append("Host: localhost")
    origin = draw(
        st.sampled_from(["none", "none", "own", "other"]) if host else st.sampled_from(["none", "other"])
    )
    if origin != "none":
        headers.append(f"Origin: http://{'localhost' if origin == 'own' else 'localhost:8080'}")
    headers.append(
        {
            "none": "",
            "right": f"Authorization: {draw(st.sampled_from(['Bearer', 'bearer', 'BEARER']))} {token}",
            "wrong": f"Authorization: Bearer {draw(st.text(TOKEN_CHARS, min_size=1, max_size=40))}",
            "malformed": "Authorization: "
            + draw(st.sampled_from(["Bearer", "Basic dXNlcjpwdw==", "Token x", "", "Bearer  "])),
        }[auth]
    )
    headers += draw(
        st.lists(
            st.tuples(
                st.text(TOKEN_CHARS, min_size=1, max_size=20).filter(lambda n: n.lower() not in SINGLE),
                st.text("abc xyz=;,/\t", max_size=60),
            ).map(lambda kv: f"{kv[0]}: {kv[1]}"),
            max_size=4,
        )
    )
    if not valid:
        headers += draw(
            st.lists(
                st.one_of(
                    st.sampled_from(
                        [
                            "NoColon",
                            " folded: line",
                            "\tfolded",
                            "Bad Name: x",
                            ": empty name",
                            "X: a\x00b",
                            "X: a\rb",
                            "X: \x7f",
                            "Authorization: Bearer x",
                            "Host: a",
                            "Content-Length: 5",
                            "X-Big: " + "a" * 9000,
                        ]
                    ),
                    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                ),
                max_size=3,
            )
        )
    headers = [h for h in headers if h]
    end = draw(line_ends) if valid else draw(st.sampled_from(["\r\n", "\n", "\r"]))
    request_line = (
        f"{method} {target} {version}"
        if valid
        else draw(
            st.sampled_from(
                [f"{method} {target} {version}", f"{method}  {target} {version}", f"{method} {target}"]
            )
        )
    )
    raw = (request_line + end + "".join(h + end for h in headers) + end).encode("utf-8", "surrogatepass")
    if head_length(raw) < 0:  # "\r" alone ends no line: end the head (else the server waits for it)
        raw += b"\r\n\r\n"
    if valid and draw(st.booleans()):
        raw += draw(st.binary(max_size=64))  # a body or pipelined junk after the head
    decoded = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    return Generated(raw, valid, method, path, decoded, auth, origin)


def expected_status(g: Generated, limits_ok: bool) -> set[int]:
    """What the server must answer a valid request (see httpd's theory of operation)."""
    if g.origin == "other":
        return {403}
    if g.path not in ROUTES:
        return {404}
    if g.method == "OPTIONS":
        return {204}
    if g.path in PRIVATE and g.auth != "right":
        return {401}
    if g.path == "/readyz":
        return {200, 503}
    if g.path in ("/connections", "/topics") and not limits_ok:
        return {400}
    return {200}


def limit_ok(query: dict[str, str]) -> bool:
    raw = query.get("limit")
    return raw is None or (raw.isascii() and raw.isdigit() and raw.strip("0") != "")


# ---------------------------------------------------------------- in process


FAST = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_request_or_a_4xx(data: bytes) -> None:
    _parse_or_4xx(data)


@FAST
@given(requests())
def test_generated_heads_parse_to_a_request_or_a_4xx(g: Generated) -> None:
    end = head_length(g.raw)
    assert end > 0
    request = _parse_or_4xx(g.raw[:end])
    if g.valid and end <= httpd.MAX_REQUEST_BYTES:
        assert request is not None, g
        assert (request.method, request.path) == (g.method, g.path)
        assert request.query == g.query
        assert ("authorization" in request.headers) == (g.auth != "none")


def _parse_or_4xx(head: bytes) -> Request | None:
    try:
        request = parse_head(head)
    except HttpError as exc:
        assert exc.status in PARSE_STATUSES, exc.status
        assert 0 < len(exc.message) < 200, exc.message
        return None
    assert request.method in httpd.METHODS and request.path.startswith("/")
    assert all(k == k.lower() for k in request.headers)
    return request


@FAST
@given(st.binary(min_size=1, max_size=200), st.binary(max_size=50))
def test_head_length_finds_the_first_empty_line_and_nothing_before_it(line: bytes, tail: bytes) -> None:
    body = line.replace(b"\n", b" ").lstrip(b"\r") or b"X"
    head = b"\r\n" + body + b"\r\n\r\n"  # an empty line before the request line is skipped
    for k in range(len(head)):
        assert head_length(head[:k]) == -1, k
    assert head_length(head + tail) == len(head)
    assert head_length(head.replace(b"\r\n", b"\n") + tail) == len(head) - 3


@FAST
@given(
    st.one_of(
        st.text(max_size=20), st.integers(-10, 10**30).map(str), st.integers(4290, 4400).map("7".__mul__)
    )
)
def test_limit_is_a_clamped_positive_integer_or_a_400(raw: str) -> None:
    positive = raw.isascii() and raw.isdigit() and Decimal(raw) > 0  # Decimal: no 4,300-digit limit
    try:
        limit = monitor._limit({"limit": raw})
    except HttpError as exc:
        assert exc.status == 400 and exc.message.startswith("limit must be a positive integer")
        assert len(exc.message) < 200 and not positive
    else:
        assert positive and limit == min(Decimal(raw), views.MAX_LIMIT)


def _in_process_server() -> HttpServer:
    http = HttpServer(TOKEN)

    async def echo(request: Request) -> Response:
        return 200, "application/json", json.dumps(request.query).encode()

    for path in ROUTES:
        http.route(path, echo, private=path in PRIVATE)
    return http


@FAST
@given(requests())
def test_the_answer_to_a_generated_request_is_its_expected_status(g: Generated) -> None:
    http = _in_process_server()
    end = head_length(g.raw)
    answer = asyncio.run(http.answer(g.raw[:end]))
    assert answer.status in PARSE_STATUSES | {200, 204, 401, 403, 404, 431}
    if g.valid and end <= httpd.MAX_REQUEST_BYTES:
        assert answer.status in expected_status(g, True) - {503}
        assert answer.send_body == (g.method != "HEAD" and answer.status != 204)
        if answer.status == 401:
            assert dict(answer.headers)["WWW-Authenticate"].startswith("Bearer")
    _check_response(answer.encode(), head_only=not answer.send_body)


def test_a_failing_handler_answers_500_and_is_logged_once_per_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    http = HttpServer()

    async def broken(request: Request) -> Response:
        raise ValueError("a bug")

    http.route("/broken", broken)
    caplog.set_level(logging.ERROR, "broky.master")

    async def run(n: int) -> list[httpd.Answer]:
        return [await http.answer(b"GET /broken?x=%d HTTP/1.0\r\n\r\n" % i) for i in range(n)]

    answers = asyncio.run(run(50))
    assert {(a.status, a.body) for a in answers} == {(500, b'{"error": "internal error", "status": 500}\n')}
    lines = [r for r in caplog.records if "HTTP handler for /broken failed" in r.getMessage()]
    assert len(lines) == 1 and "(1 failures so far, 0 not logged" in lines[0].getMessage()
    assert lines[0].exc_info is not None  # a bug of ours: its traceback, once
    http.log_throttle.interval = 0.0  # the interval has passed
    asyncio.run(run(1))
    lines = [r for r in caplog.records if "HTTP handler for /broken failed" in r.getMessage()]
    assert len(lines) == 2 and "(51 failures so far, 49 not logged" in lines[1].getMessage()
    assert http.failures == {"/broken": 51}


@pytest.mark.timeout(30)
def test_a_head_that_never_ends_gets_408_and_one_cut_by_the_client_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpd, "REQUEST_TIMEOUT", 0.2)

    async def read(data: bytes, eof: bool) -> tuple[bytes, bytes] | HttpError | None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await httpd._read_head(reader)

    def status(data: bytes, eof: bool) -> int | None:
        got = asyncio.run(read(data, eof))
        return got.status if isinstance(got, HttpError) else None

    assert status(b"GET /healthz HTTP/1.0\r\n", eof=False) == 408
    assert status(b"GET /healthz HTTP/1.0\r\n", eof=True) == 400
    assert status(b"", eof=False) is None  # nothing sent: closed silently
    assert status(b"", eof=True) is None
    assert status(b"\r\n\r\n", eof=True) is None
    assert status(b"X" * 9000, eof=False) == 431
    assert asyncio.run(read(b"GET / HTTP/1.0\n\nrest", eof=False)) == (b"GET / HTTP/1.0\n\n", b"rest")


def _check_response(data: bytes, head_only: bool | None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a well-formed HTTP/1.x response (the first of `data`: a
    kept-alive connection may answer junk after the request too), or AssertionError.
    head_only: no body (the answer to a HEAD), the whole body, or None: either."""
    match = _STATUS_LINE.match(data)
    assert match is not None, data[:200]
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, data[:200]
    headers: dict[str, str] = {}
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b": ")
        assert colon and re.fullmatch(rb"[A-Za-z-]+", name), line
        headers[name.decode().lower()] = value.decode("ascii")
    assert headers["connection"] in ("close", "keep-alive")
    status = int(match.group(1))
    if status == 204:  # no content: neither a Content-Length nor a Content-Type (RFC 9110 8.6)
        assert "content-length" not in headers and "content-type" not in headers, headers
        assert "allow" in headers, headers
        return status, headers, b""
    assert headers["content-type"]
    length = int(headers["content-length"])
    if headers["connection"] == "keep-alive":  # what follows is the answer to what followed
        body = body[: 0 if head_only else length]
    sizes = {0, length} if head_only is None else {0 if head_only else length}
    assert len(body) in sizes, (len(body), length, data[:300])
    if status >= 400:  # every error is JSON, {"error": ..., "status": N}
        assert headers["content-type"] == "application/json", (status, headers)
        if body:
            assert json.loads(body)["status"] == status, body[:300]
    return status, headers, body


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def token_server() -> Iterator[ServerProcess]:
    server = ServerProcess("--auth-token", TOKEN, "--log-level", "debug").start()
    try:
        yield server
    finally:
        server.stop()


def exchange(server: ServerProcess, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes to the HTTP port, end the sending side (so a kept-alive connection
    ends after its answers), and read until the server closes."""
    with socket.create_connection((server.host, server.metrics_port), timeout=timeout) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def http(
    server: ServerProcess, target: str, method: str = "GET", auth: str | None = TOKEN
) -> tuple[int, dict[str, str], bytes]:
    header = f"Authorization: Bearer {auth}\r\n" if auth is not None else ""
    raw = f"{method} {target} HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode()
    return _check_response(exchange(server, raw), head_only=method == "HEAD")


def assert_clean_log(server: ServerProcess) -> None:
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log and " CRITICAL " not in log, log[-4000:]
    assert max(len(line) for line in log.splitlines()) < 1000


@pytest.mark.timeout(120)
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(g=requests())
def test_fuzzed_requests_to_a_real_server_get_well_formed_answers_never_a_500(
    token_server: ServerProcess, g: Generated
) -> None:
    answer = exchange(token_server, g.raw)
    end = head_length(g.raw)
    too_long = end > httpd.MAX_REQUEST_BYTES  # 431 before the method is read: with a body
    head_only = g.method == "HEAD" and not too_long if g.valid else None
    status, headers, body = _check_response(answer, head_only)
    assert status in {200, 204, 400, 401, 403, 404, 405, 431, 503, 505}, (status, g.raw[:300])
    event(f"{'valid' if g.valid else 'invalid'} request: {status}")
    if g.valid:
        expected = {431} if too_long else expected_status(g, limit_ok(g.query))
        assert status in expected, (status, expected, g.raw[:300], answer[:300])
        if status == 200 and g.method == "GET" and g.path in PRIVATE:
            data = json.loads(body)
            if g.path != "/stats":
                assert data["limit"] == monitor._limit(g.query)
    if status == 401:
        assert headers["www-authenticate"].startswith("Bearer")
    if status == 405:
        assert headers["allow"] in ("GET, HEAD, OPTIONS", "GET, HEAD, POST, OPTIONS")


def test_after_the_fuzz_the_server_answers_and_logged_no_traceback(token_server: ServerProcess) -> None:
    # Runs after the fuzz (file order), on the same server.
    assert http(token_server, "/healthz", auth=None)[::2] == (200, b"ok\n")
    assert http(token_server, "/stats")[0] == 200
    assert_clean_log(token_server)


def test_request_parsing_edge_cases(token_server: ServerProcess) -> None:
    s = token_server
    assert _check_response(exchange(s, b"GET /healthz HTTP/1.0\n\n"), False)[::2] == (200, b"ok\n")
    assert _check_response(exchange(s, b"\r\nGET /healthz HTTP/1.0\r\n\r\n"), False)[0] == 200
    absolute = b"GET http://example.com/healthz?x=1 HTTP/1.1\r\n\r\n"
    assert _check_response(exchange(s, absolute), False)[0] == 200
    # Bytes after the head (a body, a pipelined request) do not reset the answer away.
    junk = b"GET /healthz HTTP/1.0\r\nContent-Length: 100000\r\n\r\n" + b"j" * 100_000
    assert _check_response(exchange(s, junk), False)[::2] == (200, b"ok\n")
    assert http(s, "/nope", "HEAD")[::2] == (404, b"")
    status, headers, body = http(s, "/metrics", "POST")
    assert (status, headers["allow"], json.loads(body)) == (
        405,
        "GET, HEAD, OPTIONS",
        {"error": "GET, HEAD only", "status": 405},
    )
    # OPTIONS says what a path takes, in the request's version; an unknown method is a 405 in it.
    for version in (b"1.1", b"1.0"):
        answer = exchange(s, b"OPTIONS /v1/pub/a.b HTTP/%s\r\nHost: x\r\n\r\n" % version)
        assert answer.startswith(b"HTTP/%s 204 No Content\r\n" % version), answer
        assert _check_response(answer, True)[1]["allow"] == "POST, OPTIONS"
        answer = exchange(s, b"PUT /metrics HTTP/%s\r\nHost: x\r\n\r\n" % version)
        assert answer.startswith(b"HTTP/%s 405 Method Not Allowed\r\n" % version), answer
        assert _check_response(answer, False)[1]["allow"] == "GET, HEAD, POST, OPTIONS"
    assert http(s, "/stats", "OPTIONS", auth=None)[:2] == (
        204,
        {"allow": "GET, HEAD, OPTIONS", "connection": "keep-alive"},
    )
    assert _check_response(exchange(s, b"GET /healthz HTTP/2.0\r\n\r\n"), False)[0] == 505
    for bad in (
        b"GET /healthz\r\n\r\n",
        b"GET  /healthz HTTP/1.1\r\n\r\n",
        b"GET /hea\x01lthz HTTP/1.1\r\n\r\n",
        b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n",
        b"GET healthz HTTP/1.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nNo colon\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nX: 1\r\n folded\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nX : 1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nX: a\x00b\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"G\xe9T /healthz HTTP/1.1\r\n\r\n",
    ):
        status, _, body = _check_response(exchange(s, bad), False)
        assert status == 400 and 0 < len(body) < 200, (bad, status, body)
    # A client that half-closes inside the head is told so.
    with socket.create_connection((s.host, s.metrics_port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, body = _check_response(answer, False)
    assert (status, json.loads(body)["error"]) == (400, "the connection ended inside the request head")
    assert_clean_log(s)


def test_private_endpoints_need_the_token_and_say_why_not(start_server: Callable[..., ServerProcess]) -> None:
    s = start_server("--auth-token", TOKEN)  # its own: refusals are logged once per interval per process
    for path in PRIVATE:
        status, headers, body = http(s, path, auth=None)
        assert status == 401 and headers["www-authenticate"] == 'Bearer realm="broky"'
        assert json.loads(body) == {
            "error": f"{path} needs the server's auth token: send 'Authorization: Bearer <token>'",
            "status": 401,
        }
        assert http(s, path, "HEAD", auth=None)[::2] == (401, b"")
        for malformed in ("Basic dXNlcjpwdw==", "Bearer", TOKEN):
            raw = f"GET {path} HTTP/1.1\r\nAuthorization: {malformed}\r\n\r\n".encode()
            status, headers, body = _check_response(exchange(s, raw), False)
            assert status == 401 and b"malformed Authorization header" in body
            assert 'error="invalid_request"' in headers["www-authenticate"]
        for wrong in (TOKEN + "x", TOKEN[:-1], TOKEN.upper(), "\u00e9"):
            status, headers, body = http(s, path, auth=wrong)
            assert (status, json.loads(body)) == (401, {"error": "wrong auth token", "status": 401})
            assert 'error="invalid_token"' in headers["www-authenticate"]
        assert http(s, path)[0] == 200
        raw = f"GET {path} HTTP/1.1\r\nauthorization:   bearer {TOKEN}  \r\n\r\n".encode()
        assert _check_response(exchange(s, raw), False)[0] == 200  # scheme and name in any case
    for path in OPEN:
        assert http(s, path, auth=None)[0] == 200
        assert http(s, path, auth="wrong")[0] == 200  # a token is not checked where none is needed
    # Each refusal cause is logged once per interval, without what was sent.
    new = s.wait_log("refused: wrong auth token")
    assert new.count("refused: wrong auth token") == 1 and new.count("refused: missing auth token") == 1
    assert TOKEN not in new and "dXNlcjpwdw" not in new
    assert_clean_log(s)


def test_without_a_token_every_endpoint_is_open(server: ServerProcess) -> None:
    for path in ROUTES:
        assert http(server, path, auth=None)[0] == 200
        assert http(server, path, auth="anything")[0] == 200


def test_metrics_and_probes_list_no_client_address_name_pattern_or_connection_id(
    token_server: ServerProcess,
) -> None:
    s = token_server
    kp = kp_for_worker(0, 2, prefix="kp-secret-zq")
    with (
        Wire.hello(s.address, worker=0, token=TOKEN, name="client-name-zq") as sub,
        Wire.hello(s.address, worker=0, token=TOKEN, name="other-name-zq") as pub,
    ):
        sub.subscribe(1, b"pattern-zq.*", kp)
        sub.subscribe(2, b"orders-zq.>")
        assert sub.flush() == []
        pub.publish(kp, b"pattern-zq.x", b"payload-zq")
        assert pub.flush() == []
        assert [m.payload for m in sub.messages()] == [b"payload-zq"]
        assert sub.welcome is not None and pub.welcome is not None
        ports = [str(w.sock.getsockname()[1]) for w in (sub, pub)]
        ids = [sub.welcome.connection_id, pub.welcome.connection_id]
        secrets = ["client-name-zq", "other-name-zq", "pattern-zq", "orders-zq", "kp-secret-zq", "payload-zq"]
        # The private endpoints do list them (so the search below can find them) ...
        listed = http(s, "/connections")[2].decode() + http(s, "/topics")[2].decode()
        for text in [*secrets[:4], *ports, *map(str, ids)]:
            assert text in listed, text
        # ... the open ones list counters only.
        for path in OPEN:
            status, _, body = http(s, path, auth=None)
            assert status == 200
            text = body.decode()
            for secret in secrets:
                assert secret not in text, (path, secret)
            for conn_id in ids:
                assert str(conn_id) not in text and f"{conn_id:x}" not in text, (path, conn_id)
            for port in ports:
                assert f":{port}" not in text and f'"{port}"' not in text, (path, "a client's port")


@pytest.mark.timeout(60)
def test_no_endpoint_and_no_log_line_shows_a_resume_token(token_server: ServerProcess) -> None:
    s = token_server
    kp = kp_for_worker(0, 2)
    first = Wire.hello(s.address, worker=0, token=TOKEN, name="resumer")
    first.subscribe(1, b"r.>")
    assert first.flush() == []
    assert first.welcome is not None and first.welcome.resume_token
    tokens = [first.welcome.resume_token]
    claim = PreviousConnection(first.welcome.connection_id, 0, 0, first.welcome.resume_token)
    first.close()
    time.sleep(0.2)
    # A claim with a wrong secret (refused, counted), then the right one (resumed).
    wrong = bytes(b ^ 1 for b in first.welcome.resume_token)
    with Wire.hello(s.address, worker=0, token=TOKEN, previous=claim._replace(resume_token=wrong)) as thief:
        assert thief.welcome is not None and thief.welcome.resumed is None
    second = Wire.hello(s.address, worker=0, token=TOKEN, name="resumer", previous=claim)
    assert second.welcome is not None and second.welcome.resumed is not None
    assert second.welcome.resume_token
    tokens.append(second.welcome.resume_token)
    with Wire.hello(s.address, worker=0, token=TOKEN) as pub:
        second.subscribe(1, b"r.>")
        assert [f for f in second.flush() if not isinstance(f, LossNotice)] == []
        pub.publish(kp, b"r.x", b"hello")
        pub.flush()
        assert [m.payload for m in second.messages() if isinstance(m, Message)] == [b"hello"]
        bodies = {
            path: http(s, path)[2] for path in (*ROUTES, "/connections?limit=1000", "/topics?limit=1000")
        }
    second.close()
    log = s.log().encode()
    for token in tokens:
        forms = {
            "raw": token,
            "hex": token.hex().encode(),
            "HEX": token.hex().upper().encode(),
            "base64": base64.b64encode(token).rstrip(b"="),
            "urlsafe base64": base64.urlsafe_b64encode(token).rstrip(b"="),
            "repr": repr(token)[2:-1].encode(),
            "list": str(list(token))[1:-1].encode(),
        }
        for form, needle in forms.items():
            for path, body in bodies.items():
                assert needle not in body, (form, path)
            assert needle not in log, (form, "the server log")
    assert json.loads(bodies["/stats"])["totals"]  # the bodies searched are real answers
    assert b"resumer" in bodies["/connections?limit=1000"]


# ---------------------------------------------------------------- bodies (sans-IO)


@st.composite
def chunked_bodies(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(a body, its chunked encoding: random chunk sizes, hex case, extensions, trailers)."""
    body = draw(st.binary(max_size=300))
    encoded = b""
    rest = body
    while rest:
        n = draw(st.integers(1, len(rest)))
        size = f"{n:x}"
        size = size.upper() if draw(st.booleans()) else size
        ext = draw(st.sampled_from([b"", b";x=1", b" ;name"]))
        encoded += size.encode() + ext + b"\r\n" + rest[:n] + b"\r\n"
        rest = rest[n:]
    encoded += b"0\r\n" + draw(st.sampled_from([b"", b"Trailer: x\r\n"])) + b"\r\n"
    return body, encoded


@FAST
@given(chunked_bodies(), st.binary(max_size=20), st.lists(st.integers(1, 50), max_size=30))
def test_a_chunked_body_fed_in_any_pieces_decodes_to_itself_and_leaves_what_follows(
    case: tuple[bytes, bytes], after: bytes, cuts: list[int]
) -> None:
    body, encoded = case
    data = encoded + after
    decoder = httpd.ChunkedDecoder(limit=10_000)
    rest = b""
    at = 0
    for size in [*cuts, len(data)]:
        if decoder.done:
            break
        rest = decoder.feed(data[at : at + size])
        at += size
    assert decoder.done and decoder.body == body
    assert rest + data[at:] == after
    if len(body) > 1:  # one byte under the body's size: 413, said before the body is kept
        with pytest.raises(HttpError) as exc:
            httpd.ChunkedDecoder(limit=len(body) - 1).feed(encoded)
        assert exc.value.status == 413


@FAST
@given(st.binary(max_size=200))
def test_any_bytes_as_a_chunked_body_decode_or_give_a_400(data: bytes) -> None:
    decoder = httpd.ChunkedDecoder(limit=100)
    try:
        decoder.feed(data)
    except HttpError as exc:
        assert exc.status in (400, 413) and 0 < len(exc.message) < 200
        return
    assert decoder.size <= 100 and len(decoder.body) == decoder.size


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["content-length", "transfer-encoding", "x"]),
        st.one_of(
            st.sampled_from(["0", "12", "chunked", "gzip", "Chunked", "-1", "1e3", " 7 "]),
            st.text(max_size=25),
        ),
    )
)
def test_body_framing_is_a_length_chunked_or_a_4xx_5xx(headers: dict[str, str]) -> None:
    request = Request("POST", "/v1/pub/x", {}, headers)
    try:
        framing = httpd.body_framing(request)
    except HttpError as exc:
        assert exc.status in (400, 501)
        return
    if framing is None:
        assert headers["transfer-encoding"].strip().lower() == "chunked" and "content-length" not in headers
    else:
        assert framing == int(headers.get("content-length", "0")) >= 0


def test_a_request_over_keep_alive_then_one_with_a_body_then_a_close(token_server: ServerProcess) -> None:
    s = token_server
    raw = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /healthz HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
        b"GET /healthz HTTP/1.1\r\n\r\n"  # after a close: never answered
    )
    answer = exchange(s, raw)
    assert answer.count(b"HTTP/1.1 ") == 3, answer
    first, second, third = answer.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and b"Connection: keep-alive" in first
    assert second.startswith(b"405 ") and b"Allow: GET, HEAD" in second
    assert third.startswith(b"200 ") and b"Connection: close" in third


def _read_answer(sock: socket.socket) -> bytes:
    """One answer with a Content-Length (or the 100 Continue interim), read off a live socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"Content-Length: ([0-9]+)", head)
    want = int(length.group(1)) if length else 0
    while len(body) < want:
        chunk = sock.recv(65536)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_body_is_never_read_before_its_token_is_checked(token_server: ServerProcess) -> None:
    """A client without the token cannot make the server hold a body: the 401 comes before it."""
    head = b"POST /v1/pub/k HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\nExpect: 100-continue\r\n\r\n"
    with socket.create_connection((token_server.host, token_server.metrics_port), timeout=10) as sock:
        sock.sendall(head)  # and not a byte of the body
        answer = _read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in answer, answer
        assert b"100 Continue" not in answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"].startswith("/v1/pub/k needs")


def test_expect_100_continue_is_answered_before_the_body(token_server: ServerProcess) -> None:
    """curl sends Expect: 100-continue with a body over 1 MiB and waits a second for it."""
    body = b"line\n" * 3
    head = (
        f"POST /v1/pub/exp HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    with socket.create_connection((token_server.host, token_server.metrics_port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        answer = _read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["published"] == 3
    odd = head.replace(b"100-continue", b"magic")
    answer = exchange(token_server, odd + body)
    assert answer.startswith(b"HTTP/1.1 417 ") and b"only 100-continue" in answer, answer


def test_bodies_held_at_once_are_bounded_and_a_body_past_the_bound_gets_503(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server("--http-max-body", "1M", "--http-body-memory", "1M")
    address = (server.host, server.metrics_port)

    def post_head(n: int) -> bytes:
        return f"POST /v1/pub/mem HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n\r\n".encode()

    with socket.create_connection(address, timeout=10) as slow:
        slow.sendall(post_head(700_000) + b"x" * 1000)  # holds 700,000 bytes until it ends
        deadline = time.monotonic() + 10
        while (held := _http_gauge(server, "broky_http_body_bytes")) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held == 700_000
        with socket.create_connection(address, timeout=10) as other:
            other.sendall(post_head(400_000))
            answer = _read_answer(other)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer, answer
        assert b"--http-body-memory" in answer
        small = exchange(server, post_head(6) + b"a\nb\nc\n")  # what is left still serves
        assert small.startswith(b"HTTP/1.1 200 ") and b'"published": 3' in small, small
        slow.sendall(b"x" * 699_000)
        answer = _read_answer(slow)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert _http_gauge(server, "broky_http_body_bytes") == 0
    assert _http_gauge(server, "broky_http_refused_memory_total") == 1
    again = exchange(server, post_head(400_000) + b"y" * 400_000)
    assert again.startswith(b"HTTP/1.1 200 "), again[:200]


def _http_gauge(server: ServerProcess, name: str) -> float:
    text = _check_response(exchange(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), head_only=False)[2]
    found = re.search(rb"^" + name.encode() + rb" ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))
