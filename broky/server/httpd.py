"""A minimal HTTP/1.0 server on the metrics port (asyncio, no dependency).

Routes are a dict path -> async handler returning (status, content type,
body); the master registers /healthz and /readyz, and broky.server.monitor
adds /metrics, /stats, /connections and /topics. A handler in
`query_routes` gets the query string as a dict (last value of each name wins;
an empty value is kept, so `?limit=` is the handler's to refuse).
GET and HEAD only; one request per connection. A request head (request line
and headers) longer than MAX_REQUEST_BYTES gets 431 and the connection is
closed; one that does not arrive within REQUEST_TIMEOUT seconds is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Awaitable, Callable

log = logging.getLogger("broky.master")

Response = tuple[int, str, bytes]
Handler = Callable[[], Awaitable[Response]]
QueryHandler = Callable[[dict[str, str]], Awaitable[Response]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT = 5.0
LINGER_SECONDS = 1.0


class HttpServer:
    def __init__(self) -> None:
        self.routes: dict[str, Handler] = {}
        self.query_routes: dict[str, QueryHandler] = {}
        self.server: asyncio.AbstractServer | None = None

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
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
        except asyncio.LimitOverrunError:
            head = b""
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.close()
            return
        if head:
            status, ctype, body, send_body = await self._respond(head)
        else:
            status, ctype, send_body = 431, "text/plain", True
            body = f"request head over {MAX_REQUEST_BYTES} bytes\n".encode()
        reason = _REASONS.get(status, "")
        header = (
            f"HTTP/1.0 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(header + (body if send_body else b""))
            await writer.drain()
            if not head:  # unread input: let the client read the answer before the close resets it
                writer.write_eof()
                await asyncio.wait_for(_discard(reader), LINGER_SECONDS)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _respond(self, head: bytes) -> tuple[int, str, bytes, bool]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            return 400, "text/plain", b"bad request\n", True
        method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"GET or HEAD only\n", True
        path, _, query = target.partition("?")
        handler = self.routes.get(path)
        query_handler = self.query_routes.get(path)
        if handler is None and query_handler is None:
            return 404, "text/plain", b"not found\n", method == "GET"
        try:
            if query_handler is not None:
                status, ctype, body = await query_handler(
                    dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
                )
            else:
                assert handler is not None
                status, ctype, body = await handler()
        except Exception:
            log.exception("HTTP handler for %s failed", target)
            return 500, "text/plain", b"internal error\n", method == "GET"
        return status, ctype, body, method == "GET"


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass
