"""The master process: accept, read the Hello, check it, hand the socket over.

Theory of operation
-------------------
The master binds the client port and the metrics port, starts the workers
(broky.server.supervisor) and prints the ready line once every worker has
said READY. For each accepted socket it reads exactly one frame: the size
prefix, then that many bytes (never more, so anything the client pipelined
behind its Hello stays in the kernel for the worker to read), within
--hello-timeout seconds. It checks that the frame is a Hello of protocol
version 1, with the right auth token when one is configured, and picks the
worker: Hello.worker, or the least-loaded one for -1. The socket and the Hello
bytes then travel to that worker over its control channel
(broky.server.handoff) and the master closes its copy.

A refused handshake gets one fatal Error frame, one log line, and a lingering
close: the master half-closes and discards input for up to a second so that
the client reads the Error instead of a connection reset.

The master also answers HTTP on the metrics port: /healthz (200 while the
master runs), /readyz (200 when every worker is ready, else 503) and
/debug/stats (JSON: every worker's counters, asked over the control
channels); broky.server.monitor adds /metrics, /stats, /connections and
/topics. SIGTERM or SIGINT: stop accepting, ask every worker to say Goodbye
and close, exit 0 within 5 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import socket
import struct
import sys
import time
from typing import Any

import uvloop

from broky import __version__
from broky.errors import ErrorCode, RemoteProtocolError
from broky.protocol import ANY_WORKER, PROTOCOL_VERSION, Hello, decode_frame
from broky.protocol.frames import error_frame
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.server import handoff, monitor
from broky.server.config import MAX_HELLO_BYTES, ServerConfig
from broky.server.httpd import HttpServer, Response
from broky.server.supervisor import Supervisor, WorkerProcess

log = logging.getLogger("broky.master")

_u32 = struct.Struct("<I").unpack_from
LINGER_SECONDS = 1.0
STATS_TIMEOUT = 2.0
WAIT_FOR_WORKER = 2.0  # a Hello naming a restarting worker waits this long for it
HAND_OVER_ATTEMPTS = 3  # hand-offs tried per connection when a worker turns out to be dead


class _WorkerGone(Exception):
    """The hand-off channel of a worker that looked ready is broken."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Master:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.listener: socket.socket | None = None
        self.http = HttpServer()
        self.supervisor: Supervisor | None = None
        self.handshakes: set[asyncio.Task[None]] = set()
        self._stats_waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_request = 0
        self.handed_total = 0
        self.gone_pids: set[int] = set()  # workers whose hand-off channel broke (dead, not reaped yet)
        self.refused_total: dict[str, int] = {}
        self.started = time.time()

    # ------------------------------------------------------------ life

    async def run(self) -> int:
        cfg = self.config
        try:
            self.listener = _listen(cfg.host, cfg.port)
            metrics_port = await self.http.start(cfg.host, cfg.metrics_port)
        except OSError as exc:
            log.critical("cannot listen on %s: %s", cfg.host, exc)
            print(f"broky serve: cannot listen on {cfg.host}: {exc}", file=sys.stderr)
            return 1
        port = self.listener.getsockname()[1]
        self.config = cfg = dataclasses.replace(cfg, port=port, metrics_port=metrics_port)
        self.http.routes["/healthz"] = self.healthz
        self.http.routes["/readyz"] = self.readyz
        self.http.routes["/debug/stats"] = self.debug_stats
        monitor.install(self)
        self.supervisor = sup = Supervisor(cfg, self._on_worker_message)
        sup.install_signals()
        sup.start_all()
        boot = self.loop.create_task(sup.wait_ready())
        first_event = self.loop.create_task(sup.events.get())
        done, _ = await asyncio.wait({boot, first_event}, return_when=asyncio.FIRST_COMPLETED)
        if first_event in done and first_event.result() in ("SIGTERM", "SIGINT"):
            boot.cancel()
            await self.shutdown()
            return 0
        first_event.cancel()
        if not await boot:
            await self.shutdown()
            print(f"broky serve: {sup.failure}", file=sys.stderr)
            return 1
        self.loop.add_reader(self.listener.fileno(), self._accept)
        print(
            f"broky ready: listening on {cfg.host}:{port}, metrics on {cfg.host}:{metrics_port}, "
            f"workers {cfg.workers}, pid {os.getpid()}",
            flush=True,
        )
        log.info("broky %s serving on %s:%d with %d workers", __version__, cfg.host, port, cfg.workers)
        code = await sup.run()
        await self.shutdown()
        if code:
            print(f"broky serve: {sup.failure}", file=sys.stderr)
        return code

    async def shutdown(self) -> None:
        started = time.monotonic()
        if self.listener is not None:
            try:
                self.loop.remove_reader(self.listener.fileno())
            except (ValueError, OSError):
                pass
            self.listener.close()
        for task in list(self.handshakes):
            task.cancel()
        if self.supervisor is not None:
            await self.supervisor.stop(self.config.shutdown_timeout + 0.5)
        await self.http.close()
        log.info("stopped in %.2f s", time.monotonic() - started)

    # ------------------------------------------------------------ accepting

    def _accept(self) -> None:
        assert self.listener is not None
        for _ in range(256):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: log and keep serving
                log.error("accept failed: %s", exc)
                return
            sock.setblocking(False)
            task = self.loop.create_task(self._handshake(sock, f"{addr[0]}:{addr[1]}"))
            self.handshakes.add(task)
            task.add_done_callback(self.handshakes.discard)

    async def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            try:
                hello_bytes, hello = await asyncio.wait_for(self._read_hello(sock), self.config.hello_timeout)
            except TimeoutError:
                raise Refused(
                    ErrorCode.HELLO_TIMEOUT, f"no Hello within {self.config.hello_timeout:g} s"
                ) from None
            except RemoteProtocolError as exc:
                raise Refused(exc.code, str(exc)) from None
            for _ in range(HAND_OVER_ATTEMPTS):
                index = await self._pick_worker(hello)
                try:
                    self._hand_over(sock, hello_bytes, index)
                    break
                except _WorkerGone as exc:
                    # It died and the supervisor has not reaped it yet: wait for its
                    # successor (or, for "any worker", take another one).
                    log.info("worker %d is gone (%s); waiting for a ready worker", index, exc.reason)
            else:
                raise Refused(ErrorCode.SERVER_BUSY, f"worker {index} keeps refusing connections")
        except Refused as exc:
            await self._refuse(sock, peer, exc.code, str(exc))
        except EOFError:
            sock.close()  # closed before sending anything
        except asyncio.CancelledError:
            sock.close()
            raise

    async def _recv_exact(self, sock: socket.socket, n: int, got: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = await self.loop.sock_recv(sock, n - len(buf))
            if not chunk:
                if got + len(buf) == 0:
                    raise EOFError
                raise Refused(
                    ErrorCode.TRUNCATED_FRAME, f"end of stream inside the Hello ({got + len(buf)} bytes)"
                )
            buf += chunk
        return bytes(buf)

    async def _read_hello(self, sock: socket.socket) -> tuple[bytes, Hello]:
        prefix = await self._recv_exact(sock, 4, 0)
        size = _u32(prefix)[0]
        limit = min(self.config.max_frame_bytes, MAX_HELLO_BYTES)
        if size > limit:
            raise Refused(
                ErrorCode.FRAME_TOO_LARGE,
                f"first frame of {size} bytes exceeds the Hello limit of {limit} bytes",
            )
        if size < MIN_FRAME_SIZE:
            raise Refused(ErrorCode.MALFORMED_FRAME, f"size prefix {size} is smaller than any frame")
        frame = prefix + await self._recv_exact(sock, size, 4)
        hello = decode_frame(frame)
        if not isinstance(hello, Hello):
            raise Refused(
                ErrorCode.EXPECTED_HELLO, f"the first frame must be a Hello, not {type(hello).__name__}"
            )
        if hello.protocol_version != PROTOCOL_VERSION:
            raise Refused(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {hello.protocol_version} unsupported (this server: {PROTOCOL_VERSION})",
            )
        token = self.config.auth_token
        if token and not hmac.compare_digest((hello.auth_token or "").encode(), token.encode()):
            raise Refused(ErrorCode.AUTH_FAILED, "wrong or missing auth token")
        return frame, hello

    async def _pick_worker(self, hello: Hello) -> int:
        assert self.supervisor is not None
        n = self.config.workers
        wanted = hello.worker
        if wanted != ANY_WORKER and not 0 <= wanted < n:
            raise Refused(ErrorCode.NO_SUCH_WORKER, f"worker {wanted} does not exist (workers: {n})")
        deadline = time.monotonic() + WAIT_FOR_WORKER
        while True:
            ready = [wp for wp in self.supervisor.live() if wp.ready and wp.pid not in self.gone_pids]
            if wanted != ANY_WORKER:
                ready = [wp for wp in ready if wp.index == wanted]
            if ready:
                return min(ready, key=lambda wp: (wp.load + wp.handed, wp.index)).index
            if time.monotonic() > deadline:
                raise Refused(ErrorCode.SERVER_BUSY, "no worker is ready")
            await asyncio.sleep(0.05)

    def _hand_over(self, sock: socket.socket, hello_bytes: bytes, index: int) -> None:
        assert self.supervisor is not None
        wp = self.supervisor.workers[index]
        if wp is None:
            raise Refused(ErrorCode.SERVER_BUSY, f"worker {index} is restarting")
        try:
            handoff.send_socket(wp.chan, sock, hello_bytes)
        except OSError as exc:
            self.gone_pids.add(wp.pid)  # skipped until the supervisor restarts it
            raise _WorkerGone(str(exc)) from None
        wp.handed += 1
        self.handed_total += 1
        sock.close()

    async def _refuse(self, sock: socket.socket, peer: str, code: ErrorCode, message: str) -> None:
        log.warning("connection from %s refused: %s: %s", peer, code.name, message)
        self.refused_total[code.name] = self.refused_total.get(code.name, 0) + 1
        try:
            await asyncio.wait_for(
                self.loop.sock_sendall(sock, error_frame(code, message, fatal=True)), LINGER_SECONDS
            )
            sock.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(self._discard_until_eof(sock), LINGER_SECONDS)
        except (OSError, TimeoutError):
            pass
        finally:
            sock.close()

    async def _discard_until_eof(self, sock: socket.socket) -> None:
        while await self.loop.sock_recv(sock, 65536):
            pass

    # ------------------------------------------------------------ control channel and HTTP

    def _on_worker_message(self, wp: WorkerProcess, kind: bytes, payload: bytes) -> None:
        if kind == handoff.STATS:
            request_id, body = handoff.split_id(payload)
            waiter = self._stats_waiters.pop(request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(json.loads(body))
        else:
            log.error("unexpected message %r from worker %d", kind, wp.index)

    async def worker_stats(self, what: bytes = b"") -> list[dict[str, Any] | None]:
        """A stats snapshot (or the view `what`, see monitor.answer) of every worker (None: no answer)."""
        assert self.supervisor is not None
        waiters: list[asyncio.Future[dict[str, Any]] | None] = []
        for wp in self.supervisor.workers:
            if wp is None or not wp.ready:
                waiters.append(None)
                continue
            self._next_request = (self._next_request + 1) & 0xFFFFFFFF
            fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
            self._stats_waiters[self._next_request] = fut
            try:
                handoff.send(wp.chan, handoff.STATS, handoff.pack_id(self._next_request) + what)
            except OSError:
                self._stats_waiters.pop(self._next_request, None)
                waiters.append(None)
                continue
            waiters.append(fut)
        out: list[dict[str, Any] | None] = []
        for w in waiters:
            try:
                out.append(await asyncio.wait_for(w, STATS_TIMEOUT) if w is not None else None)
            except TimeoutError:
                out.append(None)
        return out

    async def healthz(self) -> Response:
        return 200, "text/plain", b"ok\n"

    async def readyz(self) -> Response:
        assert self.supervisor is not None
        if self.supervisor.all_ready():
            return 200, "text/plain", b"ok\n"
        waiting = [i for i, wp in enumerate(self.supervisor.workers) if wp is None or not wp.ready]
        return 503, "text/plain", f"workers not ready: {waiting}\n".encode()

    async def debug_stats(self) -> Response:
        assert self.supervisor is not None
        stats = await self.worker_stats()
        for index, wp in enumerate(self.supervisor.workers):
            snap = stats[index]
            if snap is not None and wp is not None:
                snap["pid"] = wp.pid
        body = {
            "version": __version__,
            "master": {
                "pid": os.getpid(),
                "uptime_seconds": time.time() - self.started,
                "connections_handed": self.handed_total,
                "handshakes_refused": self.refused_total,
                "worker_restarts": self.supervisor.restarts,
            },
            "workers": stats,
        }
        return 200, "application/json", json.dumps(body, indent=1).encode()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def serve(config: ServerConfig) -> int:
    """Run a server until SIGTERM/SIGINT; return the exit status."""

    async def main() -> int:
        return await Master(config).run()

    return uvloop.run(main())
