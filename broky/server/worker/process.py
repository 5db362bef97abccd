"""One worker process: a shared-nothing shard with its own uvloop.

Theory of operation
-------------------
Ownership. A worker owns, and never shares:
  * a fixed set of vbuckets (those with `vb * workers // 1024 == index`, the
    single-node VBucketMap); the same index always gets the same vbuckets, so
    a restarted worker serves the same shard;
  * every client connection the master handed to it, until it closes;
  * the subscription table (a `broky.matching.Matcher`) of those connections;
  * its counters (`WorkerStats`).
Nothing on the data path crosses processes. The only link to the master is the
control channel (broky.server.handoff): every message on it is explicit
(CONFIG, EXPECT, CONN with the socket's fd, ADOPTED/REFUSED, CLOSED, STATS
request/answer, READY, LOAD, GRACE, RELOAD, USERS; in a cluster also MAP, and SEQUENCES and
HANDED: the sequences of vbuckets that move, broky.server.shard.moves). There is
no lock, and one piece of shared memory, written by the worker only: the
accounts of its connections (broky.server.accounts), which the master reads
once this process is gone, so that clients reconnecting after a crash learn
exactly what was processed and what was lost.

Life. `python -m broky.server.worker.process INDEX FD BOOK_FD` is started by the
supervisor with the worker end of the channel as FD and its accounts table as
BOOK_FD. It reads CONFIG and the EXPECT messages (blocking), starts uvloop and
sends READY; every tick it reports its LOAD. Before READY it freezes what
start-up made (`gc.freeze`): the cyclic collector's full collections then
look at what came after only (BROKY_GC_FREEZE=0 leaves it, to compare). A
worker that replaces a dead one starts in the restart grace
(broky.server.shard.grace `Grace.start`).

Hand-offs. Every CONN is answered. The worker adopts the socket with
`loop.connect_accepted_socket` and answers ADOPTED (with its number of open
connections) from the connection's `connection_made`, before the Welcome is
written: no byte of the client's stream moves before the master knows, so a
worker that dies before answering leaves the socket untouched and the master
can hand it to another worker. A CONN that arrived without its fd (the
kernel drops the fd, with MSG_CTRUNC, when this process is out of file
descriptors) or whose adoption failed (any exception before connection_made)
is answered REFUSED with the cause ("no_fd", or the errno name such as
EMFILE); the master still holds the socket and tells the client SERVER_BUSY.
Refusals are logged through a Throttle: one line per cause per
ADOPT_LOG_INTERVAL with the running count, never one per connection. A CONN
with the TLS flag (the client asked for TLS) is answered ADOPTED at once,
then gets the go-ahead, the TLS handshake and its Hello inside TLS
(`_connect_tls`, broky.server.security.tls) before it becomes a connection like any
other; a failure there closes it and says CLOSED. The claim of a dead
worker's account that such a client makes is checked here (the master
cannot see its resume token). When an
adopted connection is gone, the worker says CLOSED with its hand-off id (the
master counts connections per client address); one that finds the channel
full is sent again at the next tick.

Stopping. SIGTERM, or EOF on the channel (the master is gone), starts the
shutdown: Goodbye to every connection (behind the deliveries already queued
to it), wait until every final byte has left the process for at most
shutdown_timeout seconds, reset the rest, then up to GOODBYE_LINGER seconds
more for the clients to close (the SDK closes once it read its Goodbye: a
process that exits with unread input resets that connection, and a reset can
destroy the Goodbye still on its way to the client, which must then settle
the connection without an account), log what the shutdown dropped, exit 0.
A socket handed over after that is answered ADOPTED, gets a Goodbye and is
closed. SIGINT is ignored: a Ctrl-C reaches the whole process group, and the
master decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import uvloop

from broky.protocol import Goodbye, VBucketMap, encode_frame
from broky.server import handoff
from broky.server.accounts import Account, AccountBook, same_secret
from broky.server.config import ServerConfig
from broky.server.logs import Throttle, setup_logging
from broky.server.security.tls import START_TLS
from broky.server.security.users import Users, WorkerUsers
from broky.server.shard.connection import Connection
from broky.server.shard.core import Shard
from broky.server.shard.stats import DropReason
from broky.server.worker import views

if TYPE_CHECKING:
    from broky.server.security.tls import Handshakes

log = logging.getLogger("broky.worker")

TICK_SECONDS = 0.25
GOODBYE_LINGER = 0.5  # seconds the shutdown waits for clients to close after their Goodbye
HEARTBEAT_SECONDS = 0.5  # LOAD is sent at least this often: the master's /readyz wants signs of life
ADOPT_LOG_INTERVAL = 10.0  # seconds between two log lines about hand-offs refused for one cause
FREEZE_GC = os.environ.get("BROKY_GC_FREEZE", "1") != "0"  # 0: for bench/tail_sources.py's "before"


class Worker:
    def __init__(
        self,
        config: ServerConfig,
        index: int,
        chan: socket.socket,
        book: AccountBook,
        epoch: int,
        expected: set[int] | None = None,
        grace: float = 0.0,
        vmap: VBucketMap | None = None,
        users: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.chan = chan
        self.loop = asyncio.get_running_loop()
        self.shard = Shard(config, index, self.loop, book, epoch, vmap)
        self.expected = expected or set()
        self.grace = grace
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.refused: dict[str, int] = {}  # hand-offs answered REFUSED, by cause
        self._refusal_log = Throttle(ADOPT_LOG_INTERVAL)
        self._reported_load = -1  # open connections, as last reported in LOAD, ADOPTED or CLOSED
        self._reported_at = 0.0
        self._stopping = False
        self._unsent_closed: list[int] = []  # hand-off ids of closed connections not told yet
        self.shard.on_closed = self._closed
        if users is not None:
            self.shard.users = WorkerUsers(Users(users))
        self.shard.moves.report = self._handed
        self.tls: Handshakes | None = None  # --tls-cert: this worker runs its clients' TLS handshakes
        if config.tls_cert:
            from broky.server.security.tls import Handshakes

            self.tls = Handshakes(config, index, self.shard.stats)
            self.tls.users = lambda: None if self.shard.users is None else self.shard.users.users

    async def run(self) -> None:
        loop = self.loop
        self.chan.setblocking(False)
        loop.add_reader(self.chan.fileno(), self._on_channel)
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the master reloads, and tells (RELOAD)
        ticker = loop.create_task(self._ticker())
        if FREEZE_GC:
            # What start-up made (modules, the config, the shard's tables) lives as long as the
            # process: out of the collector's sight, so that its full collections, which stop
            # the loop, look at what came after only (bench/README.md, "Tail sources").
            gc.freeze()
        handoff.send(self.chan, handoff.READY)
        log.info("worker %d ready, pid %d", self.index, os.getpid())
        self.shard.grace.start(self.expected, self.grace)
        try:
            await self.done
        finally:
            ticker.cancel()
            loop.remove_reader(self.chan.fileno())

    def _on_channel(self) -> None:
        while True:
            try:
                kind, payload, fd, truncated = handoff.recv(self.chan)
            except BlockingIOError:
                return
            except OSError as exc:
                log.error("control channel failed: %s", exc)
                kind, payload, fd, truncated = b"", b"", None, False
            if kind == handoff.CONN:
                self._on_conn(handoff.split_conn(payload), fd, truncated)
            elif kind == handoff.MAP:
                try:
                    vmap = VBucketMap.from_json(json.loads(payload))
                except ValueError as exc:
                    log.error("the master sent a map that does not read: %s", exc)
                else:
                    self.shard.apply_map(vmap)
            elif kind == handoff.SEQUENCES:
                self.shard.moves.take_handed(payload)
            elif kind == handoff.RELOAD:
                if self.tls is not None and self.tls.certificates.reload():
                    log.info("worker %d reloaded its TLS certificates", self.index)
            elif kind == handoff.USERS:
                self.shard.apply_users(Users(json.loads(payload)))
                log.info("worker %d applied the reloaded users", self.index)
            elif kind == handoff.GRACE:
                self.shard.grace.start_node(handoff.split_u32(payload) / 1000)
            elif kind == handoff.STATS:
                request_id, what = handoff.split_id(payload)
                with contextlib.suppress(OSError):
                    handoff.send_json(self.chan, handoff.STATS, request_id, views.answer(self.shard, what))
            elif kind == b"":
                log.warning("master is gone; worker %d shutting down", self.index)
                self.loop.remove_reader(self.chan.fileno())
                self.stop()
                return
            else:
                if fd is not None:
                    socket.close(fd)
                log.error("unexpected control message %r", kind)

    def _on_conn(self, handed: handoff.Conn, fd: int | None, truncated: bool) -> None:
        if fd is None:
            why = "out of file descriptors (MSG_CTRUNC)" if truncated else "sent without one"
            self._refuse(handed.handoff_id, handoff.NO_FD, f"the socket arrived without its fd: {why}")
            return
        self.loop.create_task(self._connect(fd, handed))

    async def _connect(self, fd: int, handed: handoff.Conn) -> None:
        sock: socket.socket | None = None
        adopted = False

        def answer_adopted() -> None:  # from connection_made: before the Welcome is written
            nonlocal adopted
            adopted = True
            self._answer_adopted(handed.handoff_id, len(self.shard.conns) + 1)  # this one included

        try:
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            if self._stopping:  # handed over just before the SIGTERM: a Goodbye, not a bare close
                self._answer_adopted(handed.handoff_id, len(self.shard.conns))
                adopted = True
                with contextlib.suppress(OSError):
                    sock.send(encode_frame(Goodbye("server shutting down")))
                sock.close()
                return
            account = Account.unpack(handed.account) if handed.account else None
            if handed.tls:
                self._answer_adopted(handed.handoff_id, len(self.shard.conns) + 1)
                adopted = True  # before a byte moves: the TLS handshake is this worker's
                with contextlib.suppress(OSError):  # (a peer gone fails the handshake, counted)
                    sock.send(START_TLS)  # go ahead (broky.server.security.tls)
                await self._connect_tls(sock, handed.handoff_id, account)
                return
            conn = self.shard.arrivals.new_connection(handed.hello, account)
            conn.handoff_id = handed.handoff_id
            conn.on_adopted = answer_adopted
            await self.loop.connect_accepted_socket(lambda: conn, sock=sock)
        except Exception as exc:  # the client is told SERVER_BUSY by the master, whatever failed
            if adopted:  # too late to refuse: the transport closes it (the client sees EOF)
                log.error("connection failed right after its adoption: %r", exc)
                return
            if sock is not None:
                sock.close()
            else:
                os.close(fd)
            code = exc.errno if isinstance(exc, OSError) else None
            cause = errno.errorcode.get(code or 0, type(exc).__name__)
            self._refuse(handed.handoff_id, cause, f"could not adopt the socket: {exc}")

    async def _connect_tls(self, sock: socket.socket, handoff_id: int, account: Account | None) -> None:
        """A client that asked for TLS: the handshake and its Hello inside TLS, checked
        (broky.server.security.tls), then the connection, as a plain one. A failure closes the
        socket and says CLOSED (the master counts the connection until then)."""
        assert self.tls is not None
        try:
            peer = "{}:{}".format(*sock.getpeername()[:2])
        except OSError:
            peer = "?"
        got = await self.tls.handshake(self.loop, sock, peer)  # (never raises: its failures end in None)
        if got is None:  # counted and logged
            self._closed_handoff(handoff_id)
            return
        transport, hello, frame, rest = got
        prev = hello.previous
        if account is not None and (
            prev is None
            or prev.connection_id != account.conn_id
            or not same_secret(prev.resume_token, account.token)
        ):
            self.shard.stats.resumes["refused"] += 1  # a claim without the secret: answered as unknown
            account = None
        try:
            conn = self.shard.arrivals.new_connection(frame, account)
        except Exception as exc:  # a bug: that connection goes, the worker stays
            log.error("TLS connection from %s failed: %r", peer, exc)
            transport.abort()
            self._closed_handoff(handoff_id)
            return
        conn.handoff_id = handoff_id  # from here on the shard says CLOSED when it is gone
        transport.set_protocol(conn)
        transport.resume_reading()  # (paused once the Hello was read); a held connection pauses it again
        conn.connection_made(transport)
        if rest:
            conn.data_received(rest)

    def _answer_adopted(self, handoff_id: int, open_connections: int) -> None:
        with contextlib.suppress(OSError):
            handoff.send(self.chan, handoff.ADOPTED, handoff.pack_adopted(handoff_id, open_connections))
            self._reported_load = open_connections

    def _closed(self, conn: Connection) -> None:
        """An adopted connection is gone: tell the master (CLOSED), now or at the next tick."""
        self._closed_handoff(conn.handoff_id)

    def _closed_handoff(self, handoff_id: int) -> None:
        self._unsent_closed.append(handoff_id)
        if len(self._unsent_closed) == 1:
            self._send_closed()

    def _handed(self, record: bytes) -> None:
        """The shard handed sequences over (broky.server.shard.moves): to the master (HANDED)."""
        try:
            handoff.send(self.chan, handoff.HANDED, record)
        except OSError as exc:  # the new owners start those vbuckets under a new epoch
            log.error("worker %d could not report the sequences it handed over: %s", self.index, exc)

    def _send_closed(self) -> None:
        unsent = self._unsent_closed
        load = len(self.shard.conns)
        while unsent:
            try:
                handoff.send(self.chan, handoff.CLOSED, handoff.pack_closed(unsent[0], load))
            except BlockingIOError:
                return  # the channel is full: the next tick tries again
            except OSError:
                unsent.clear()  # the master is gone
                return
            unsent.pop(0)
            self._reported_load = load

    def _refuse(self, handoff_id: int, cause: str, why: str) -> None:
        """Answer REFUSED (the master tells the client SERVER_BUSY) and log it, throttled."""
        self.refused[cause] = total = self.refused.get(cause, 0) + 1
        with contextlib.suppress(OSError):
            handoff.send(self.chan, handoff.REFUSED, handoff.pack_refused(handoff_id, cause))
        suppressed = self._refusal_log.allow(cause)
        if suppressed is not None:
            log.error(
                "worker %d refused a connection (%s): %s; refused for this cause: %d so far, "
                "%d not logged since the last line",
                self.index, cause, why, total, suppressed,
            )  # fmt: skip

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.shard.tick()
            self.shard.book.expire()
            if self._unsent_closed:
                self._send_closed()
            # Compared with the last number reported in LOAD or ADOPTED: a connection adopted
            # (ADOPTED said n + 1) and closed before this tick is reported gone (n).
            load = len(self.shard.conns)
            now = self.loop.time()
            if load != self._reported_load or now - self._reported_at >= HEARTBEAT_SECONDS:
                try:
                    handoff.send(self.chan, handoff.LOAD, handoff.pack_load(load))
                    self._reported_load = load
                    self._reported_at = now
                except OSError:
                    pass

    def stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self.loop.create_task(self._shutdown())

    async def _shutdown(self) -> None:
        """Goodbye to everyone, wait until every final byte left the process, stop."""
        shard = self.shard
        log.info("worker %d stopping: goodbye to %d connections", self.index, len(shard.conns))
        shard.shutdown()
        deadline = self.loop.time() + self.config.shutdown_timeout
        while not shard.flushed():
            if self.loop.time() > deadline:
                log.warning("worker %d: connections not flushed in time; reset", self.index)
                shard.abort_all()
                break
            await asyncio.sleep(0.02)
        linger = min(deadline, self.loop.time() + GOODBYE_LINGER)
        while shard.conns and self.loop.time() < linger:  # see "Stopping" in the header
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)  # let aborted transports run their callbacks
        log.info(
            "worker %d stopped: %d messages dropped at shutdown, %d unsent bytes discarded",
            self.index, shard.stats.dropped[DropReason.SHUTDOWN], shard.stats.bytes_discarded,
        )  # fmt: skip
        self.done.set_result(None)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print(
            "usage: python -m broky.server.worker.process INDEX FD BOOK_FD (started by broky serve)",
            file=sys.stderr,
        )
        return 2
    index, fd, book_fd = int(args[0]), int(args[1]), int(args[2])
    chan = socket.socket(fileno=fd)
    kind, payload, _, _ = handoff.recv(chan)
    if kind != handoff.CONFIG:
        print(f"worker {index}: expected CONFIG on the control channel, got {kind!r}", file=sys.stderr)
        return 2
    boot = json.loads(payload)
    config = ServerConfig.from_json(boot["config"])
    expected: set[int] = set()
    for _ in range(boot["expect"]):
        kind, payload, _, _ = handoff.recv(chan)
        if kind != handoff.EXPECT:
            print(f"worker {index}: expected EXPECT on the control channel, got {kind!r}", file=sys.stderr)
            return 2
        expected.update(handoff.split_ids(payload))
    setup_logging(config, f"worker-{index}")
    book = AccountBook.from_fd(book_fd)

    vmap = None if boot.get("map") is None else VBucketMap.from_json(boot["map"])
    probe = os.environ.get("BROKY_LOOP_PROBE")  # a debug probe (broky.server.worker.loopprobe); off: nothing
    if probe:
        from broky.server.worker import loopprobe

        loopprobe.install(index, probe, Worker)

    async def run() -> None:
        await Worker(
            config, index, chan, book, boot["epoch"], expected, boot["grace"], vmap, boot.get("users")
        ).run()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
