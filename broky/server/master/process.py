"""The master process: accept, read the Hello, check it, hand the socket over.

Theory of operation
-------------------
The master binds the client port and the metrics port, starts the workers
(broky.server.master.supervisor) and prints the ready line once every worker has
said READY. A port it cannot bind is one CRITICAL line naming the address,
the cause and the option that chooses another (`_cannot_listen`), and exit 1.
For each accepted socket it reads exactly one frame: the size prefix, then
that many bytes (never more, so anything the client pipelined behind its
Hello stays in the kernel for the worker to read), within --hello-timeout
seconds. It checks that the frame is a Hello of a protocol
version it serves, with the right auth token (or, with --users, a user's
USER:PASSWORD: broky.server.security.users) when one is configured, and picks the
worker: Hello.worker, or the least-loaded one for -1. A Hello that asks for
TLS (Hello.tls, with --tls-cert) carries no secret: the master checks no token,
hands the socket over with the TLS flag, and the worker runs the TLS handshake
and checks the real Hello inside it (broky.server.security.tls); with a certificate,
a Hello that does not ask for TLS is refused (TLS_REQUIRED) unless
--tls-allow-plain. SIGHUP reloads the certificates (`reload`: here, for the
https port, and in every worker, RELOAD) and the users file (here, and in
every worker, USERS). The socket and the Hello
bytes then travel to that worker over its control channel as a CONN with a
hand-off id (broky.server.handoff), and the master keeps its own copy of the
socket until the worker answers: ADOPTED (the master closes its copy; the
worker has sent the Welcome) or REFUSED with a cause (the worker got no fd
because it is out of file descriptors, or adopting failed). Least-loaded means
the fewest connections open (as the worker last reported, in LOAD or ADOPTED)
plus the hand-offs sent to it and not answered yet (WorkerProcess.pending),
so the accounting is exact whatever happens to a hand-off; among the ready
workers, one that failed a hand-off in the last NOT_READY_AFTER_REFUSAL
seconds is picked only if no other is ready.

A hand-off that a worker does not take is refused to the client with a fatal
SERVER_BUSY that says why ("worker 0 cannot take connections: out of file
descriptors"): a REFUSED answer, no answer within HAND_OVER_TIMEOUT seconds of
the CONN ("no_answer": the CONN stays in the channel, so that socket is never
offered to another worker; a worker that wakes up later finds it closed), or a
control channel still full after HAND_OVER_TIMEOUT seconds ("channel_full": a
busy or stopped worker is back-pressure, not death). A Hello for any worker
(-1) whose hand-off was refused or never sent is first offered to another
ready worker: the client did not choose the worker, and a worker out of
descriptors would otherwise attract every such connection (it has the fewest
open). Each such failure is counted by (worker, cause) (/metrics
broky_handoffs_refused_total, /stats), logged at most once per
HANDOFF_LOG_INTERVAL per (worker, cause) with the number not logged, and makes
/readyz report that worker not ready for NOT_READY_AFTER_REFUSAL seconds.

Only a broken channel (EPIPE, ECONNRESET, ENOTCONN, or one the supervisor
closed) marks the WorkerProcess gone; hand-offs it had not answered when it
died are cancelled by the supervisor and tried again (on its successor, or
another worker for -1), since the master still holds their sockets. Its
successor is a new WorkerProcess, so nothing has to be cleared. A client that
resets during the handshake costs one info line. When the master runs out of
file descriptors it stops accepting for ACCEPT_PAUSE seconds (one log line
per episode). At SIGTERM/SIGINT, connections still in the handshake get a
Goodbye too.

Connection limits. A worker serves at most --max-connections connections
(its placement load as above, so hand-offs in flight count): a Hello for any
worker goes to the least-loaded one with room, and one naming a full worker,
or for any worker when none has room, gets SERVER_BUSY saying so. A client
address holds at most --max-connections-per-address connections over all
workers: the supervisor counts them (`by_address`: from the hand-off's CONN
until the worker refuses it, says CLOSED, or dies), and the check and the
count happen together, with no await between them, right before the CONN is
sent; one more gets TOO_MANY_CONNECTIONS. Each refusal is counted by limit
(/metrics broky_connections_refused_total) and logged at most once per
LIMIT_LOG_INTERVAL per limit with the number not logged.

A client address may also open at most --handshake-burst connections at
once, then --handshake-rate a second (broky.server.master.rates): one more gets
TOO_MANY_CONNECTIONS before its Hello is read, counted and logged the same
way (limit handshake_rate).

A refused handshake gets one fatal Error frame, one log line (throttled as
above when a worker refused it or a limit was reached), and a lingering
close: the master half-closes and discards input for up to a second so that
the client reads the Error instead of a connection reset.

The master also answers HTTP on the metrics port: /healthz (200 while the
master runs) and /readyz (200 when every worker is ready, was heard from on
its control channel within HEARTBEAT_TIMEOUT and took every hand-off of the
last NOT_READY_AFTER_REFUSAL seconds, else 503 naming the workers and why);
broky.server.http.monitor adds /metrics, /stats, /connections and /topics, whose
worker counters the master asks for over the control channels
(`worker_stats`); the last three need the auth token of a server that has one
(broky.server.http.server checks it, the master hands it the token);
broky.server.http.console serves the live console, a page that reads them, at /;
broky.server.http.gateway adds /v1/pub/ and /v1/sub/ (publish and subscribe over
HTTP): from the first such request on, the master is also a client of its
own workers (an SDK client, and a publish connection per worker), which it
closes first when it stops, so the streams end cleanly. SIGTERM or
SIGINT: stop accepting, ask every worker to say Goodbye and close, exit 0
within 5 s. In cluster mode the first one drains the node first (`_drain`:
its vbuckets go to the other members, at most --drain-timeout), and a node
that retains messages of the vbuckets it handed over then serves on for
--drain-linger seconds (accepting, its workers answering bounded reads of
them) before it stops; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import json
import logging
import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

import uvloop

from broky import __version__
from broky.errors import BrokyError, ErrorCode, RemoteProtocolError
from broky.protocol import (
    ANY_WORKER,
    SERVED_VERSIONS,
    Goodbye,
    Hello,
    NodeInfo,
    VBucketMap,
    decode_frame,
    encode_frame,
)
from broky.protocol.frames import error_frame
from broky.protocol.framing import MIN_FRAME_SIZE
from broky.server import handoff
from broky.server.accounts import ACCOUNT_TTL, Account
from broky.server.config import MAX_HELLO_BYTES, ServerConfig, env_name
from broky.server.http import console, gateway, monitor
from broky.server.http.server import HttpServer, Request, Response
from broky.server.logs import Throttle
from broky.server.master.rates import AddressRate
from broky.server.master.supervisor import Supervisor, WorkerProcess
from broky.server.security import exposure
from broky.server.security.users import Users, admits
from broky.server.shard import fastpath

if TYPE_CHECKING:
    from broky.cluster.node import ClusterNode
    from broky.server.security.tls import Certificates

log = logging.getLogger("broky.master")

_u32 = struct.Struct("<I").unpack_from
LINGER_SECONDS = 1.0
STATS_TIMEOUT = 2.0  # one deadline for all the workers' answers to one stats request
HEARTBEAT_TIMEOUT = 2.0  # a worker silent this long is not ready (it sends LOAD every 0.5 s)
WAIT_FOR_WORKER = 2.0  # a Hello naming a restarting worker waits this long for it
HAND_OVER_ATTEMPTS = 3  # hand-offs tried per connection when a worker is dead (or refuses a -1)
HAND_OVER_TIMEOUT = 2.0  # a hand-off waits this long for a full channel to drain, then for the answer
NOT_READY_AFTER_REFUSAL = 3.0  # /readyz: a worker that failed a hand-off this recently is not ready
HANDOFF_LOG_INTERVAL = 10.0  # seconds between two log lines about one (worker, cause) of failed hand-offs
LIMIT_LOG_INTERVAL = 10.0  # seconds between two log lines about connections refused for one limit
MAX_CONNECTIONS = "max_connections"  # the connection limits, as counted and labelled
MAX_CONNECTIONS_PER_ADDRESS = "max_connections_per_address"
HANDSHAKE_RATE = "handshake_rate"
NO_ANSWER = "no_answer"  # hand-off failure causes of the master's own (the worker's are in REFUSED)
CHANNEL_FULL = "channel_full"
_CAUSES = {
    handoff.NO_FD: "out of file descriptors",
    "EMFILE": "out of file descriptors",
    "ENFILE": "the system is out of file descriptors",
    NO_ANSWER: f"no answer to a hand-off within {HAND_OVER_TIMEOUT:g} s",
    CHANNEL_FULL: f"its control channel stayed full for {HAND_OVER_TIMEOUT:g} s",
}
ACCEPT_PAUSE = 0.1  # accepting stops this long when the master is out of file descriptors
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_CHANNEL_BROKEN = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


class _WorkerGone(BrokyError):
    """The hand-off channel of a worker that looked ready is broken."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _HandOffRefused(BrokyError):
    """A worker did not take a connection; `retry`: the socket is in no worker's hands."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class Refused(BrokyError):
    """The handshake is refused with `code`; `logged`: the cause was logged already (throttled)."""

    def __init__(self, code: ErrorCode, message: str, logged: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.logged = logged


class Master:
    def __init__(self, config: ServerConfig) -> None:
        self.users: Users | None = None  # --users (broky.server.security.users)
        self.users_error: str | None = None  # a users file that does not read: `run` says so
        if config.users:
            try:
                self.users = Users.load(config.users)
            except ValueError as exc:
                self.users_error = str(exc)
            if not config.auth_token:  # the server's own key (its HTTP gateway's), known to no one else
                secret = base64.urlsafe_b64encode(os.urandom(24)).decode()  # (no `secrets`: it loads hmac)
                config = dataclasses.replace(config, auth_token=secret)
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.listener: socket.socket | None = None
        self.http = HttpServer(
            config.auth_token,
            config.http_max_body,
            config.http_max_connections,
            config.http_body_memory,
            config.http_allow_origin,
        )
        self.http.users = lambda: self.users
        self.supervisor: Supervisor | None = None
        self.handshakes: set[asyncio.Task[None]] = set()
        self._stats_waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_request = 0
        self.handed_total = 0  # hand-offs ADOPTED
        self._next_handoff = 0
        self.stopping = False
        self._accept_paused_since = 0.0  # monotonic time accepting first stopped for lack of fds
        self.refused_total: dict[str, int] = {}
        self.vmap: VBucketMap = VBucketMap(0, (), ())  # set in `run`, once the port is bound
        self.handoffs_refused: dict[tuple[int, str], int] = {}  # (worker, cause) -> hand-offs not taken
        self._handoff_log = Throttle(HANDOFF_LOG_INTERVAL)
        # Handshakes refused for a connection limit, by limit.
        self.limits_refused: dict[str, int] = {
            MAX_CONNECTIONS: 0,
            MAX_CONNECTIONS_PER_ADDRESS: 0,
            HANDSHAKE_RATE: 0,
        }
        self.handshake_rate = AddressRate(config.handshake_rate, config.handshake_burst)
        self._limit_log = Throttle(LIMIT_LOG_INTERVAL)
        self.started = time.time()
        self.started_monotonic = time.monotonic()
        self.node_grace = False  # a restart of this server was seen, and its grace given (`_note_restart`)
        self.cluster: ClusterNode | None = None  # cluster mode (--cluster) only
        self.cluster_task: asyncio.Task[None] | None = None
        self.gateway: gateway.Gateway | None = None  # the /v1/ routes (set in `run`)
        self.certificates: Certificates | None = (
            None  # --tls-cert: the https port's (broky.server.security.tls)
        )
        # Beyond loopback without a credential (--allow-unauthenticated): logged at start,
        # /metrics broky_unauthenticated_public, /stats (broky.server.security.exposure).
        self.unauthenticated_public = exposure.unauthenticated_public(config)

    # ------------------------------------------------------------ life

    async def run(self) -> int:
        cfg = self.config
        if self.users_error is not None:
            log.critical("%s", self.users_error)
            return 1
        if cfg.tls_cert:
            from broky.server.security.tls import Certificates

            try:
                self.certificates = Certificates(cfg, https=True)
            except Exception as exc:  # OSError, ssl.SSLError: the message names the file or the mismatch
                log.critical(
                    "cannot load the TLS certificate %s with key %s: %s", cfg.tls_cert, cfg.tls_key, exc
                )
                return 1
        try:
            self.listener = _listen(cfg.host, cfg.port)
        except OSError as exc:
            log.critical("%s", _cannot_listen(cfg.host, cfg.port, "clients", "port", exc))
            return 1
        try:
            https = self.certificates.https if self.certificates is not None else None
            metrics_port = await self.http.start(cfg.host, cfg.metrics_port, https)
        except OSError as exc:
            self.listener.close()
            log.critical(
                "%s", _cannot_listen(cfg.host, cfg.metrics_port, "metrics (HTTP)", "metrics_port", exc)
            )
            return 1
        port = self.listener.getsockname()[1]
        self.http.client_port = port  # named to a Broky client that reached the HTTP port
        self.config = cfg = dataclasses.replace(cfg, port=port, metrics_port=metrics_port)
        self.http.route("/healthz", self.healthz)
        self.http.route("/readyz", self.readyz)
        monitor.install(self)
        console.install(self.http)
        self.gateway = gateway.install(self)
        self.supervisor = sup = Supervisor(cfg, self._on_worker_message)
        sup.on_hangup = self.reload
        sup.users = self.users.data if self.users is not None else None
        sup.install_signals()
        if cfg.cluster:  # the workers start with the cluster's map (`apply_map` later)
            joined = await self._join()
            if joined is not None:
                await self.shutdown()
                return joined
        else:  # the node's map for good
            self.vmap = VBucketMap.single_node(
                NodeInfo(cfg.node_id, cfg.advertised_host(), port, cfg.workers)
            )
        sup.map_json = self.vmap.to_json()
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
            await self.shutdown()  # the supervisor logged why
            return 1
        self.loop.add_reader(self.listener.fileno(), self._accept)
        print(
            f"broky ready: listening on {cfg.host}:{port}, metrics on {cfg.host}:{metrics_port}, "
            f"workers {cfg.workers}, pid {os.getpid()}",
            flush=True,
        )
        log.info(
            "broky %s serving on %s:%d with %d workers (fan-out: %s)",
            __version__, cfg.host, port, cfg.workers, fastpath.description,
        )  # fmt: skip
        if (warning := fastpath.warning()) is not None:
            log.warning("%s", warning)
        if self.unauthenticated_public:
            log.warning("%s", exposure.warning(cfg, metrics_port))
        code = await sup.run(drain=self._drain if self.cluster is not None else None)
        await self.shutdown()  # on a failure (code 1) the supervisor logged why
        return code

    async def _join(self) -> int | None:
        """Cluster mode: register in etcd and wait for the cluster's map (applied by
        the ClusterNode through `apply_map`). None once joined, else the exit status:
        0 for SIGTERM/SIGINT meanwhile, 1 when the node cannot join (logged)."""
        from broky.cluster.layout import MemberRecord
        from broky.cluster.node import ClusterNode  # imports the etcd client: cluster mode only

        assert self.supervisor is not None
        cfg = self.config
        record = MemberRecord(
            cfg.node_id, cfg.advertised_host(), cfg.port, cfg.workers, cfg.metrics_port, __version__
        )
        self.cluster = node = ClusterNode(cfg, self, record)
        self.cluster_task = task = self.loop.create_task(node.run())
        task.add_done_callback(self._cluster_ended)
        log.info("joining the cluster at %s as node %r", node.url, cfg.node_id)
        joined = self.loop.create_task(node.joined.wait())
        while True:
            event = self.loop.create_task(self.supervisor.events.get())
            done, _ = await asyncio.wait({joined, event, task}, return_when=asyncio.FIRST_COMPLETED)
            if event in done and event.result() in ("SIGTERM", "SIGINT"):
                joined.cancel()
                log.info("%s received while joining: shutting down", event.result())
                return 0
            event.cancel()
            if task.done():
                joined.cancel()
                return 1  # logged by _cluster_ended
            if joined in done:
                log.info("joined the cluster: map version %d", self.vmap.version)
                return None

    def _cluster_ended(self, task: asyncio.Task[None]) -> None:
        """The ClusterNode stopped by itself: it cannot go on, nor can the node."""
        from broky.cluster.node import NodeIdInUse  # loaded already: the task is a ClusterNode's

        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, NodeIdInUse):
            log.critical("%s", exc)
        else:
            log.critical("the cluster agent failed: %r", exc, exc_info=exc)
        if self.supervisor is not None and self.supervisor.failure is None:
            self.supervisor.failure = f"the cluster agent stopped: {exc}"
            self.supervisor.events.put_nowait("failure")

    async def _drain(self) -> None:
        """SIGTERM in cluster mode: hand the vbuckets over first (bounded by --drain-timeout),
        then linger (--drain-linger) while the workers retain messages of vbuckets they
        handed over: their new owners hold them only from the handover on, and a reader
        behind it reads the rest here (broky.server.shard.moves, former vbuckets)."""
        assert self.cluster is not None
        await self.cluster.drain(self.config.drain_timeout)
        linger = self.config.drain_linger
        if linger <= 0:
            return
        kept = sum(a.get("former_messages", 0) for a in await self.worker_stats() if a is not None)
        if kept:
            log.info(
                "lingering %g s so readers can fetch what this node retained of the vbuckets it "
                "handed over (%d messages)", linger, kept,
            )  # fmt: skip
            await asyncio.sleep(linger)

    async def shutdown(self) -> None:
        started = time.monotonic()
        if self.listener is not None:
            try:
                self.loop.remove_reader(self.listener.fileno())
            except (ValueError, OSError):
                pass
            self.listener.close()
        self.stopping = True  # handshakes cancelled from now on say Goodbye (_handshake)
        if self.gateway is not None:  # its streams end cleanly, its client says goodbye
            await self.gateway.close()
        handshakes = list(self.handshakes)
        if handshakes:
            log.info("goodbye to %d connections in the handshake", len(handshakes))
        for task in handshakes:
            task.cancel()
        if self.supervisor is not None:
            await self.supervisor.stop(self.config.shutdown_timeout + 0.5)
        if handshakes:  # their lingering closes ran meanwhile; each is bounded by LINGER_SECONDS
            await asyncio.wait(handshakes, timeout=2 * LINGER_SECONDS)
        if self.cluster_task is not None:
            self.cluster_task.cancel()
            await asyncio.wait({self.cluster_task})
        if self.cluster is not None:  # its keys go with its lease: the others see it leave at once
            await self.cluster.leave()
        await self.http.close()
        log.info("stopped in %.2f s", time.monotonic() - started)

    # ------------------------------------------------------------ accepting

    def _accept(self) -> None:
        listener = self.listener
        assert listener is not None
        for _ in range(256):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:  # e.g. ECONNABORTED: that client's problem
                    log.info("accept failed: %s", exc)
                    continue
                # The listener stays readable: stop watching it for a while instead of spinning.
                if not self._accept_paused_since:
                    self._accept_paused_since = time.monotonic()
                    log.error("accept failed: %s; accepting again every %g s", exc, ACCEPT_PAUSE)
                self.loop.remove_reader(listener.fileno())
                self.loop.call_later(ACCEPT_PAUSE, self._resume_accepting, listener)
                return
            if self._accept_paused_since:
                log.warning("accepting again after %.1f s", time.monotonic() - self._accept_paused_since)
                self._accept_paused_since = 0.0
            sock.setblocking(False)
            task = self.loop.create_task(self._handshake(sock, addr[0], f"{addr[0]}:{addr[1]}"))
            self.handshakes.add(task)
            task.add_done_callback(self.handshakes.discard)

    def _resume_accepting(self, listener: socket.socket) -> None:
        if self.stopping or listener.fileno() < 0:
            return
        self.loop.add_reader(listener.fileno(), self._accept)

    async def _handshake(self, sock: socket.socket, address: str, peer: str) -> None:
        try:
            if not self.handshake_rate.allow(address, time.monotonic()):
                cfg = self.config
                raise self._limit_refused(
                    HANDSHAKE_RATE,
                    ErrorCode.TOO_MANY_CONNECTIONS,
                    f"{address} opens connections faster than --handshake-rate {cfg.handshake_rate:g} a "
                    f"second (after a burst of --handshake-burst {cfg.handshake_burst}); try again later",
                )
            try:
                hello_bytes, hello = await asyncio.wait_for(self._read_hello(sock), self.config.hello_timeout)
            except TimeoutError:
                raise Refused(
                    ErrorCode.HELLO_TIMEOUT, f"no Hello within {self.config.hello_timeout:g} s"
                ) from None
            except RemoteProtocolError as exc:
                raise Refused(exc.code, str(exc)) from None
            await self._place(sock, hello_bytes, hello, address)
        except Refused as exc:
            await self._refuse(sock, peer, exc.code, str(exc), exc.logged)  # (a cancel in there: no Goodbye)
        except EOFError:
            pass  # closed before sending anything
        except OSError as exc:  # e.g. a reset during the Hello
            log.info("connection from %s lost during the handshake: %s", peer, exc)
        except asyncio.CancelledError:
            if self.stopping and sock.fileno() >= 0:
                await self._linger_close(sock, encode_frame(Goodbye("server shutting down")))
            raise
        finally:
            sock.close()

    async def _place(self, sock: socket.socket, hello_bytes: bytes, hello: Hello, address: str) -> None:
        """Hand the socket (from client IP `address`) to a worker that adopts it.

        Raises:
            Refused: no worker took it (SERVER_BUSY), or a connection limit is reached
                (SERVER_BUSY, TOO_MANY_CONNECTIONS).
        """
        refused_by: set[int] = set()  # workers that did not take this connection
        refusal: _HandOffRefused | None = None
        self._note_restart(hello)  # before the hand-off: its publishes may have to wait
        for _ in range(HAND_OVER_ATTEMPTS):
            wp = await self._pick_worker(hello, refused_by)
            account = self._dead_account(hello, wp)
            try:
                packed = account.pack(secret=hello.tls) if account else b""  # (TLS: its worker checks it)
                await self._hand_over(sock, hello_bytes, wp, address, packed, hello.tls)
                if account is not None and not hello.tls:  # a TLS client's claim: its worker checks it
                    assert self.supervisor is not None
                    self.supervisor.dead.discard(account.conn_id)  # answered by its new worker
                return
            except _WorkerGone as exc:
                # It died and the supervisor has not reaped it yet: wait for its
                # successor (or, for "any worker", take another one).
                log.info("worker %d is gone (%s); waiting for a ready worker", wp.index, exc.reason)
            except _HandOffRefused as exc:
                refused_by.add(wp.index)
                refusal = exc
                if not (exc.retry and hello.worker == ANY_WORKER and self._ready_besides(refused_by)):
                    break
        if refusal is not None:  # logged (throttled) where it happened
            raise Refused(ErrorCode.SERVER_BUSY, str(refusal), logged=True)
        raise Refused(ErrorCode.SERVER_BUSY, f"worker {wp.index} keeps refusing connections")

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
        if hello.protocol_version not in SERVED_VERSIONS:
            raise Refused(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {hello.protocol_version} unsupported (this server: "
                f"{', '.join(map(str, sorted(SERVED_VERSIONS)))})",
            )
        if (
            hello.tls
        ):  # the worker runs the TLS handshake and checks the Hello inside (broky.server.security.tls)
            if not self.config.tls_cert:
                raise Refused(
                    ErrorCode.TLS_UNAVAILABLE,
                    "this server does not offer TLS (no --tls-cert): connect with broky://HOST:PORT",
                )
            if hello.auth_token or (hello.previous is not None and hello.previous.resume_token):
                raise Refused(
                    ErrorCode.TLS_REQUIRED,
                    "a Hello asking for TLS travels in plain text: it must carry no auth_token and no "
                    "previous.resume_token (they go in the Hello inside TLS)",
                )
            return frame, hello
        if self.config.tls_cert and not self.config.tls_allow_plain:
            raise Refused(
                ErrorCode.TLS_REQUIRED,
                "this server requires TLS: connect with broky+tls://HOST:PORT "
                "(Hello.tls; schema/README.md 2.1)",
            )
        if not await admits(self.config.auth_token, self.users, hello.auth_token):
            raise Refused(ErrorCode.AUTH_FAILED, "wrong or missing auth token (or user:password)")
        return frame, hello

    async def _pick_worker(self, hello: Hello, refused_by: set[int]) -> WorkerProcess:
        """Hello.worker, or for -1 the least-loaded ready worker not in `refused_by`,
        with room for one more connection (--max-connections)."""
        assert self.supervisor is not None
        n = self.config.workers
        limit = self.config.max_connections
        wanted = hello.worker
        if wanted != ANY_WORKER and not 0 <= wanted < n:
            raise Refused(ErrorCode.NO_SUCH_WORKER, f"worker {wanted} does not exist (workers: {n})")
        deadline = time.monotonic() + WAIT_FOR_WORKER
        while True:
            ready = [wp for wp in self.supervisor.live() if wp.ready and not wp.gone]
            if wanted != ANY_WORKER:
                ready = [wp for wp in ready if wp.index == wanted]
            else:
                ready = [wp for wp in ready if wp.index not in refused_by]
            if ready:
                now = time.monotonic()
                room = [wp for wp in ready if not limit or wp.placement_load < limit]
                if room:
                    return min(room, key=lambda wp: (_refusing(wp, now), wp.placement_load, wp.index))
                if wanted != ANY_WORKER:
                    why = f"worker {wanted} serves {ready[0].placement_load} connections"
                else:
                    why = f"every worker serves {limit} connections or more"
                raise self._limit_refused(
                    MAX_CONNECTIONS,
                    ErrorCode.SERVER_BUSY,
                    f"{why}: the most one worker may (--max-connections {limit})",
                )
            if time.monotonic() > deadline:
                raise Refused(ErrorCode.SERVER_BUSY, "no worker is ready")
            await asyncio.sleep(0.05)

    def _note_restart(self, hello: Hello) -> None:
        """A client names a connection of another server process: this server (or
        node) restarted under it. Its workers start empty: a publisher reconnecting
        first would have its publishes dropped as no_subscribers before the
        subscribers of the previous process are back, and nobody would be told. So
        every worker holds publishes for --restart-grace seconds from now (once per
        process, within ACCOUNT_TTL of its start: a later reconnect of that kind is
        a client that was away longer than any account lasts). A subscriber back
        later than that is told it may have lost messages (LossNotice UNACCOUNTED)."""
        prev = hello.previous
        grace = self.config.restart_grace
        if prev is None or self.node_grace or grace <= 0 or self.supervisor is None:
            return
        if self.supervisor.issued(prev.connection_id >> 32):
            return
        if time.monotonic() - self.started_monotonic > ACCOUNT_TTL:
            return
        self.node_grace = True
        log.warning(
            "a client resumes a connection of an earlier server process: this server restarted; "
            "publishes wait %g s for that process's subscribers to subscribe again", grace,
        )  # fmt: skip
        payload = handoff.pack_u32(int(grace * 1000))
        for wp in self.supervisor.live():
            try:
                handoff.send(wp.chan, handoff.GRACE, payload)
            except OSError as exc:  # dead: its successor starts without it
                log.info("worker %d did not take the restart grace: %s", wp.index, exc)

    def _dead_account(self, hello: Hello, wp: WorkerProcess) -> Account | None:
        """The account of the connection a resuming client names, when that connection
        was served by an earlier (dead) incarnation of wp's worker. (A connection of the
        live incarnation is wp's own business: its worker keeps the account.)"""
        prev = hello.previous
        if prev is None or prev.connection_id >> 32 == wp.epoch:
            return None
        assert self.supervisor is not None
        if hello.tls:  # its secret is inside TLS: the worker checks it against the account's
            return self.supervisor.dead.lookup(prev.connection_id, wp.index)
        return self.supervisor.dead.find(prev.connection_id, wp.index, prev.resume_token)

    def _ready_besides(self, refused_by: set[int]) -> bool:
        assert self.supervisor is not None
        return any(wp.ready and not wp.gone and wp.index not in refused_by for wp in self.supervisor.live())

    async def _hand_over(
        self,
        sock: socket.socket,
        hello_bytes: bytes,
        wp: WorkerProcess,
        address: str,
        account: bytes = b"",
        tls: bool = False,
    ) -> None:
        """Send the socket (with the account of the connection it resumes, if any) to wp,
        waiting (bounded) while its channel is full, and wait (bounded) for its answer.
        On return the worker has adopted it. The connection counts for its client
        `address` from the moment the CONN is sent.

        Raises:
            Refused: `address` holds --max-connections-per-address connections already.
            _WorkerGone: the channel is broken, or the worker died before answering.
            _HandOffRefused: the worker refused it or did not answer in time, the
                channel stayed full, or sending failed (counted and logged here).
        """
        assert self.supervisor is not None
        deadline = time.monotonic() + HAND_OVER_TIMEOUT
        self._next_handoff = handoff_id = (self._next_handoff + 1) & 0xFFFFFFFF
        while True:
            if wp.gone:
                raise _WorkerGone("its control channel is closed")
            self._check_address(address)  # and counted right after the send: no await between
            try:
                handoff.send_socket(wp.chan, sock, handoff_id, hello_bytes, account, tls)
                self.supervisor.count_connection(wp, handoff_id, address)
                break
            except (BlockingIOError, InterruptedError):
                if not wp.backlogged:  # one line per episode
                    wp.backlogged = True
                    log.warning(
                        "worker %d is not taking connections: its control channel is full; waiting",
                        wp.index,
                    )
                left = deadline - time.monotonic()
                if left <= 0 or not await self.supervisor.wait_writable(wp, left):
                    raise self._handoff_refused(wp, CHANNEL_FULL, retry=True) from None
            except OSError as exc:
                if exc.errno in _CHANNEL_BROKEN:
                    wp.gone = True  # skipped until the supervisor restarts it
                    raise _WorkerGone(str(exc)) from None
                cause = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                raise self._handoff_refused(wp, cause, retry=True, detail=str(exc)) from None
        if wp.backlogged:
            wp.backlogged = False
            log.info("worker %d takes connections again", wp.index)
        answer: asyncio.Future[str | None] = self.loop.create_future()
        wp.pending[handoff_id] = answer  # counted as load until answered (or forgotten)
        try:
            await asyncio.wait({answer}, timeout=HAND_OVER_TIMEOUT)
        finally:
            wp.pending.pop(handoff_id, None)
        if answer.cancelled():  # by the supervisor: the worker died; its CONN died with it
            raise _WorkerGone("it died before answering the hand-off")
        if not answer.done():  # the CONN may still be in the channel: never offered elsewhere
            raise self._handoff_refused(wp, NO_ANSWER, retry=False)
        refused = answer.result()
        if refused is not None:
            raise self._handoff_refused(wp, refused, retry=True)
        self.handed_total += 1

    def _check_address(self, address: str) -> None:
        """Refuse a connection from an address that holds as many as it may."""
        assert self.supervisor is not None
        limit = self.config.max_connections_per_address
        count = self.supervisor.by_address.get(address, 0)
        if limit and count >= limit:
            raise self._limit_refused(
                MAX_CONNECTIONS_PER_ADDRESS,
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"{address} holds {count} connections: the most one client address may "
                f"(--max-connections-per-address {limit})",
            )

    def _limit_refused(self, limit: str, code: ErrorCode, message: str) -> Refused:
        """Count a handshake refused for a connection limit and log it (throttled)."""
        self.limits_refused[limit] = total = self.limits_refused[limit] + 1
        suppressed = self._limit_log.allow(limit)
        if suppressed is not None:
            log.warning(
                "connection refused: %s: %s; refused for --%s: %d so far, %d not logged since the last line",
                code.name, message, limit.replace("_", "-"), total, suppressed,
            )  # fmt: skip
        return Refused(code, message, logged=True)

    def _handoff_refused(
        self, wp: WorkerProcess, cause: str, retry: bool, detail: str = ""
    ) -> _HandOffRefused:
        """Count a hand-off wp did not take, log it (throttled), note it for /readyz."""
        key = (wp.index, cause)
        self.handoffs_refused[key] = total = self.handoffs_refused.get(key, 0) + 1
        wp.refused_at = time.monotonic()
        wp.refused_cause = cause
        message = f"worker {wp.index} cannot take connections: {detail or _describe(cause)}"
        suppressed = self._handoff_log.allow(key)
        if suppressed is not None:
            log.error(
                "%s (%s); hand-offs refused for this cause: %d so far, %d not logged since the last line",
                message, cause, total, suppressed,
            )  # fmt: skip
        return _HandOffRefused(message, retry)

    async def _refuse(
        self, sock: socket.socket, peer: str, code: ErrorCode, message: str, logged: bool = False
    ) -> None:
        if not logged:
            log.warning("connection from %s refused: %s: %s", peer, code.name, message)
        self.refused_total[code.name] = self.refused_total.get(code.name, 0) + 1
        await self._linger_close(sock, error_frame(code, message, fatal=True))

    async def _linger_close(self, sock: socket.socket, frame: bytes) -> None:
        """Send a last frame, half-close, and discard input until EOF (each step bounded)."""
        try:
            await asyncio.wait_for(self.loop.sock_sendall(sock, frame), LINGER_SECONDS)
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
        elif kind == handoff.HANDED:  # sequences for the vbuckets' new owners, through etcd
            if self.cluster is not None:
                self.cluster.handed(wp.index, payload)
        else:
            log.error("unexpected message %r from worker %d", kind, wp.index)

    async def worker_stats(self, what: bytes = b"") -> list[dict[str, Any] | None]:
        """A stats snapshot (or the view `what`: broky.server.worker.views) of every worker (None: no answer).

        Every ready worker is asked at once and the answers share one deadline
        (STATS_TIMEOUT), so hung workers cost STATS_TIMEOUT once, not each;
        an answer that comes later is ignored.
        """
        assert self.supervisor is not None
        asked: list[tuple[int, asyncio.Future[dict[str, Any]]] | None] = []
        try:
            for wp in self.supervisor.workers:
                if wp is None or not wp.ready:
                    asked.append(None)
                    continue
                self._next_request = request_id = (self._next_request + 1) & 0xFFFFFFFF
                fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
                try:
                    handoff.send(wp.chan, handoff.STATS, handoff.pack_id(request_id) + what)
                except OSError:
                    asked.append(None)
                    continue
                self._stats_waiters[request_id] = fut
                asked.append((request_id, fut))
            futures = [a[1] for a in asked if a is not None]
            if futures:
                await asyncio.wait(futures, timeout=STATS_TIMEOUT)
            return [a[1].result() if a is not None and a[1].done() else None for a in asked]
        finally:
            for a in asked:
                if a is not None:
                    self._stats_waiters.pop(a[0], None)
                    a[1].cancel()

    def reload(self) -> None:
        """SIGHUP: read the users file again (--users) and load the TLS certificates
        again, here and in every worker (broky.server.security.users, broky.server.security.tls)."""
        self.reload_users()
        if self.certificates is None or self.supervisor is None:
            log.info("SIGHUP received: nothing to reload (no --tls-cert)")
            return
        if not self.certificates.reload():
            return  # logged; the workers would fail alike: they keep theirs too
        for wp in self.supervisor.live():
            try:
                handoff.send(wp.chan, handoff.RELOAD)
            except OSError as exc:  # dead: its successor loads the files at boot
                log.info("worker %d did not take the reload: %s", wp.index, exc)
        log.info("SIGHUP received: TLS certificates reloaded from %s", self.config.tls_cert)

    def reload_users(self) -> None:
        """SIGHUP with --users: the file again, here (handshakes, the HTTP port) and in
        every worker (USERS: new rules at once; subscriptions they refuse end)."""
        path = self.config.users
        if not path or self.supervisor is None:
            return
        try:
            users = Users.load(path)
        except ValueError as exc:
            log.error("users not reloaded (the previous ones stay in force): %s", exc)
            return
        self.users = users
        self.supervisor.users = users.data
        if self.gateway is not None:
            self.gateway.apply_users()  # its streams (HTTP subscriptions) of users
        payload = json.dumps(users.data).encode()
        for wp in self.supervisor.live():
            try:
                handoff.send(wp.chan, handoff.USERS, payload)
            except OSError as exc:  # dead: its successor gets them in CONFIG
                log.info("worker %d did not take the users: %s", wp.index, exc)
        log.info("SIGHUP received: %d users reloaded from %s", len(users.by_name), path)

    def apply_map(self, vmap: VBucketMap) -> bool:
        """Make `vmap` this node's map if it is newer: every worker applies it and
        pushes it to its clients (a worker that boots later starts with it).
        Returns False for a map not newer than the current one."""
        assert self.supervisor is not None
        if vmap.version <= self.vmap.version:
            return False
        self.vmap = vmap
        data = vmap.to_json()
        self.supervisor.map_json = data
        payload = json.dumps(data).encode()
        for wp in self.supervisor.live():
            try:
                handoff.send(wp.chan, handoff.MAP, payload)
            except OSError as exc:  # dead: its successor boots with the map
                log.info("worker %d did not take map version %d: %s", wp.index, vmap.version, exc)
        return True

    def sequences(self, record: bytes) -> None:
        """A handover record from etcd (broky.server.shard.moves `Handed`): to every worker,
        for the new owners of its vbuckets to continue their sequences."""
        assert self.supervisor is not None
        for wp in self.supervisor.live():
            try:
                handoff.send(wp.chan, handoff.SEQUENCES, record)
            except OSError as exc:  # dead: its successor starts every vbucket under a new epoch
                log.info("worker %d did not take a handover record: %s", wp.index, exc)

    async def runs_map(self, version: int) -> bool:
        """True when every worker that answers runs map `version` (or newer): the
        sequences it handed over with that map have reached the cluster agent (HANDED
        comes before the answer on the same channel)."""
        answers = await self.worker_stats(b"ready:%d" % version)
        return all(a is None or a["version"] >= version for a in answers)

    async def map_ready(self, version: int) -> bool:
        """True when every worker runs map `version` (or newer) and every one of its
        connections with subscriptions has said MapApplied for it."""
        answers = await self.worker_stats(b"ready:%d" % version)
        return all(a is not None and a["ready"] and a["version"] >= version for a in answers)

    async def healthz(self, request: Request) -> Response:
        return 200, "text/plain", b"ok\n"

    async def readyz(self, request: Request) -> Response:
        """200 when every worker is ready, answering and taking connections; a hung worker
        (e.g. stopped) is not, nor one that refused a hand-off in the last few seconds."""
        assert self.supervisor is not None
        now = time.monotonic()
        waiting: list[int] = []
        silent: list[int] = []
        refusing: list[str] = []
        for i, wp in enumerate(self.supervisor.workers):
            if wp is None or not wp.ready or wp.gone:
                waiting.append(i)
            elif now - wp.heard > HEARTBEAT_TIMEOUT:
                silent.append(i)
            elif _refusing(wp, now):
                refusing.append(f"worker {i} ({wp.refused_cause}: {_describe(wp.refused_cause)})")
        cluster = self.cluster.not_ready() if self.cluster is not None else None
        if not waiting and not silent and not refusing and cluster is None:
            return 200, "text/plain", b"ok\n"
        why = [cluster] if cluster is not None else []
        if waiting:
            why.append(f"workers not ready: {waiting}")
        if silent:
            why.append(f"workers silent for over {HEARTBEAT_TIMEOUT:g} s: {silent}")
        if refusing:
            last = f"{NOT_READY_AFTER_REFUSAL:g} s"
            why.append(f"workers refusing connections in the last {last}: {', '.join(refusing)}")
        return 503, "text/plain", ("; ".join(why) + "\n").encode()


def _refusing(wp: WorkerProcess, now: float) -> bool:
    """wp failed a hand-off in the last NOT_READY_AFTER_REFUSAL seconds."""
    return bool(wp.refused_cause) and now - wp.refused_at < NOT_READY_AFTER_REFUSAL


def _describe(cause: str) -> str:
    """Words for a hand-off failure cause: ours, or an errno name."""
    if cause in _CAUSES:
        return _CAUSES[cause]
    code = getattr(errno, cause, None)
    return os.strerror(code).lower() if isinstance(code, int) else cause


def _cannot_listen(host: str, port: int, what: str, dest: str, exc: OSError) -> str:
    """The CRITICAL line of a port that cannot be bound: which address, for what, why,
    and the option (and variable) that chooses another."""
    why = os.strerror(exc.errno).lower() if exc.errno else str(exc)  # asyncio's strerror is a sentence
    if exc.errno == errno.EADDRINUSE:
        why += " (another broky serve, or another program, holds it)"
    option = "--" + dest.replace("_", "-")
    return (
        f"cannot listen on {host}:{port} for {what}: {why}; choose another port with {option} PORT "
        f"or ${env_name(dest)} (0 picks a free one)"
    )


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
