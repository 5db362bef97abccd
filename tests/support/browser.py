"""A real headless Chromium for the tests, driven over the Chrome DevTools Protocol.

Standard library only: `Chromium` starts Debian's `chromium` with
--remote-debugging-port=0 in a profile directory of its own, reads the port
it chose from the DevToolsActivePort file it writes there, and speaks CDP
over a WebSocket (RFC 6455, the small client subset: masked text frames out,
fragmented frames in, pings answered). One page (a target attached in
"flatten" mode) is enough for the console's tests:

    with Chromium(tmp_path) as browser:
        page = browser.new_page()
        page.navigate(url)
        page.wait_for("document.querySelectorAll('#workers tbody tr').length == 2")
        page.screenshot(tmp_path / "console.png")

Everything the page reports (console calls, uncaught exceptions, log entries
such as failed loads, the URL of every request, the status of every response
and the headers each request was sent with, cookies included) is kept on the
page, for the tests to assert on. The browser and its children are one process group,
ended by its id.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.requires import program

TIMEOUT = 30.0


class WebSocket:
    """A blocking WebSocket client: enough of RFC 6455 for the DevTools protocol."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
                f"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"no WebSocket upgrade: {head[:200]!r}")

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the browser closed the DevTools connection")
        return chunk

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self.buf += self._recv()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def send(self, text: str) -> None:
        self._frame(0x1, text.encode())

    def receive(self, timeout: float) -> str:
        """The next text message (fragments joined; pings answered). Only the wait for its
        first byte is bounded by `timeout` (TimeoutError): a message once begun is read whole."""
        if not self.buf:
            self.sock.settimeout(timeout)
            self.buf = self._recv()
        self.sock.settimeout(TIMEOUT)
        message = b""
        while True:
            b0, b1 = self._take(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._take(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._take(8))
            payload = self._take(n)  # a server's frames are not masked
            opcode = b0 & 0x0F
            if opcode == 0x9:
                self._frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise ConnectionError("the browser closed the DevTools connection")
            if opcode in (0x0, 0x1, 0x2):
                message += payload
                if b0 & 0x80:
                    return message.decode()

    def close(self) -> None:
        self.sock.close()


class Page:
    """One tab, attached with its own CDP session."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session
        self.console_errors: list[str] = []  # console.error/assert and uncaught exceptions
        self.log_errors: list[dict[str, Any]] = []  # Log.entryAdded, level error (e.g. a failed load)
        self.requests: list[str] = []  # the URL of every request the page made
        self.responses: list[tuple[str, int]] = []  # (URL, status) of every response, opaque ones too
        self.sent_headers: list[dict[str, str]] = []  # the headers each request went out with (Cookie too)
        self.loaded = False

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.call(method, params, self.session)

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.console_errors.append(
                " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console_errors.append(str(details.get("exception", {}).get("description", details["text"])))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.log_errors.append(params["entry"])
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Network.responseReceived":
            self.responses.append((params["response"]["url"], params["response"]["status"]))
        elif method == "Network.requestWillBeSentExtraInfo":
            self.sent_headers.append({k.lower(): v for k, v in params["headers"].items()})
        elif method == "Page.loadEventFired":
            self.loaded = True

    def navigate(self, url: str) -> None:
        self.loaded = False
        self.call("Page.navigate", {"url": url})
        self.browser.pump_until(lambda: self.loaded, TIMEOUT, f"the load of {url}")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        answer = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in answer:
            raise AssertionError(f"{expression!r} raised: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = TIMEOUT) -> Any:
        """Poll until the expression is truthy; return its value. An expression that raises
        counts as false until the deadline (the page may be between two documents)."""
        deadline = time.monotonic() + timeout
        while True:
            error = ""
            try:
                value = self.evaluate(expression)
            except AssertionError as exc:
                value, error = None, f"\n--- the last error: {exc}"
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(
                    f"never true within {timeout} s: {expression}{error}\n--- the page:\n{text}"
                )
            self.browser.pump_until(lambda: False, 0.2, "")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))
        return path


class Chromium:
    """A headless Chromium in its own profile directory under `tmp`."""

    def __init__(self, tmp: Path, width: int = 1400, height: int = 1100) -> None:
        self.tmp = tmp
        self.profile = tmp / "chromium-profile"
        self.size = (width, height)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ws: WebSocket | None = None
        self.next_id = 0
        self.pages: dict[str, Page] = {}
        self.log = tmp / "chromium.log"

    def __enter__(self) -> Chromium:
        exe = program("chromium")
        self.profile.mkdir(parents=True, exist_ok=True)
        args = [
            exe, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-background-networking", "--disable-sync",
            "--disable-dev-shm-usage",  # containers often have a small /dev/shm
            "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
            f"--window-size={self.size[0]},{self.size[1]}", "about:blank",
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
        with self.log.open("wb") as log:
            # TMPDIR: its singleton socket directories go under `tmp` too, not into /tmp for good
            self.proc = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "TMPDIR": str(self.tmp)},
            )
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + TIMEOUT
        while not (active.exists() and len(active.read_text().splitlines()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"chromium did not start; see {self.log}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        port, path = active.read_text().splitlines()[:2]
        self.ws = WebSocket(f"ws://127.0.0.1:{port}{path}")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.ws is not None:
            self.ws.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        """Send one command; return its result (events that arrive meanwhile go to their pages)."""
        assert self.ws is not None
        self.next_id += 1
        ident = self.next_id
        command: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            command["sessionId"] = session
        self.ws.send(json.dumps(command))
        answer: dict[str, Any] = {}
        self.pump_until(lambda: bool(answer), TIMEOUT, method, (ident, answer))
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer["result"]
        return result

    def pump_until(
        self,
        done: Any,
        timeout: float,
        what: str,
        waiting: tuple[int, dict[str, Any]] | None = None,
    ) -> None:
        """Read messages until done() (a zero-argument callable) or timeout (an error if `what` names it)."""
        assert self.ws is not None
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                if what:
                    raise TimeoutError(f"chromium: no {what} within {timeout} s")
                return
            try:
                message = json.loads(self.ws.receive(left))
            except TimeoutError:
                continue
            if waiting is not None and message.get("id") == waiting[0]:
                waiting[1].update(message)
            elif "method" in message:
                page = self.pages.get(message.get("sessionId", ""))
                if page is not None:
                    page.on_event(message["method"], message["params"])

    def new_page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = self.pages[session] = Page(self, session)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.call(f"{domain}.enable")
        return page


class Site:
    """A page of another origin, for cross-origin tests: a tiny HTTP server on a free loopback
    port that answers every GET with one empty HTML page (in a daemon thread; `stop` ends it)."""

    PAGE = b"<!doctype html><meta charset=utf-8><title>another origin</title><body>another origin</body>"

    def __init__(self) -> None:
        import http.server
        import threading

        page = self.PAGE

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, format: str, *args: Any) -> None:  # (quiet)
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="site", daemon=True)
        self.thread.start()

    def url(self, host: str = "127.0.0.1") -> str:
        """Its page, named by `host` (127.0.0.1 and localhost are two origins, and two sites)."""
        return f"http://{host}:{self.port}/"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
