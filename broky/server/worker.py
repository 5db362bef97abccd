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
(CONFIG, EXPECT, CONN with the socket's fd, STATS request/answer, READY, LOAD).
There is no lock, and one piece of shared memory, written by the worker only:
the accounts of its connections (broky.server.accounts), which the master
reads once this process is gone, so that clients reconnecting after a crash
learn exactly what was processed and what was lost.

Life. `python -m broky.server.worker INDEX FD BOOK_FD` is started by the
supervisor with the worker end of the channel as FD and its accounts table
as BOOK_FD. It reads CONFIG and the EXPECT messages (blocking), starts uvloop,
adopts each handed socket with `loop.connect_accepted_socket`, and sends
READY; every tick it reports its LOAD. A worker that replaces a dead one
starts in the restart grace (broky.server.fanout `Shard.start_grace`). SIGTERM, or EOF on the channel
(the master is gone), starts the shutdown: Goodbye to every connection (behind
the deliveries already queued to it), wait until every final byte has left the
process for at most shutdown_timeout seconds, reset the rest, log what the
shutdown dropped, exit 0. A socket handed over after that gets a Goodbye and
is closed. SIGINT is ignored: a Ctrl-C reaches the whole process group, and
the master decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

import uvloop

from broky.protocol import Goodbye, encode_frame
from broky.server import handoff, monitor
from broky.server.accounts import Account, AccountBook
from broky.server.config import ServerConfig
from broky.server.connection import Connection
from broky.server.fanout import Shard
from broky.server.logs import setup_logging

log = logging.getLogger("broky.worker")

TICK_SECONDS = 0.25
HEARTBEAT_SECONDS = 0.5  # LOAD is sent at least this often: the master's /readyz wants signs of life


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
    ) -> None:
        self.config = config
        self.index = index
        self.chan = chan
        self.loop = asyncio.get_running_loop()
        self.shard = Shard(config, index, self.loop, book, epoch)
        self.expected = expected or set()
        self.grace = grace
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.adopted = 0  # connections received from the master (CONN), for LOAD
        self._reported_load = (-1, -1)
        self._reported_at = 0.0
        self._stopping = False

    async def run(self) -> None:
        loop = self.loop
        self.chan.setblocking(False)
        loop.add_reader(self.chan.fileno(), self._on_channel)
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ticker = loop.create_task(self._ticker())
        handoff.send(self.chan, handoff.READY)
        log.info("worker %d ready, pid %d", self.index, os.getpid())
        self.shard.start_grace(self.expected, self.grace)
        try:
            await self.done
        finally:
            ticker.cancel()
            loop.remove_reader(self.chan.fileno())

    def _on_channel(self) -> None:
        while True:
            try:
                kind, payload, fd = handoff.recv(self.chan)
            except BlockingIOError:
                return
            except OSError as exc:
                log.error("control channel failed: %s", exc)
                kind, payload, fd = b"", b"", None
            if kind == handoff.CONN and fd is not None:
                self._adopt(fd, payload)
            elif kind == handoff.STATS:
                request_id, what = handoff.split_id(payload)
                with contextlib.suppress(OSError):
                    handoff.send_json(self.chan, handoff.STATS, request_id, monitor.answer(self.shard, what))
            elif kind == b"":
                log.warning("master is gone; worker %d shutting down", self.index)
                self.loop.remove_reader(self.chan.fileno())
                self.stop()
                return
            else:
                if fd is not None:
                    socket.close(fd)
                log.error("unexpected control message %r", kind)

    def _adopt(self, fd: int, payload: bytes) -> None:
        account, hello = handoff.split_conn(payload)
        self.adopted += 1
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        if self._stopping:  # handed over just before the SIGTERM: a Goodbye, not a bare close
            with contextlib.suppress(OSError):
                sock.send(encode_frame(Goodbye("server shutting down")))
            sock.close()
            return
        conn = self.shard.new_connection(hello, Account.unpack(account) if account else None)
        self.loop.create_task(self._connect(sock, conn))

    async def _connect(self, sock: socket.socket, conn: Connection) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: conn, sock=sock)
        except OSError as exc:
            log.info("could not adopt a connection: %s", exc)
            sock.close()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.shard.tick()
            self.shard.book.expire()
            # Open connections and connections ever received: a connection that opened and
            # closed between two ticks changes the second, so the master learns it is gone.
            load = (len(self.shard.conns), self.adopted)
            now = self.loop.time()
            if load != self._reported_load or now - self._reported_at >= HEARTBEAT_SECONDS:
                try:
                    handoff.send(self.chan, handoff.LOAD, handoff.pack_load(*load))
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
        await asyncio.sleep(0)  # let aborted transports run their callbacks
        log.info(
            "worker %d stopped: %d messages dropped at shutdown, %d unsent bytes discarded",
            self.index, shard.stats.dropped["shutdown"], shard.stats.bytes_discarded,
        )  # fmt: skip
        self.done.set_result(None)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print(
            "usage: python -m broky.server.worker INDEX FD BOOK_FD (started by broky serve)", file=sys.stderr
        )
        return 2
    index, fd, book_fd = int(args[0]), int(args[1]), int(args[2])
    chan = socket.socket(fileno=fd)
    kind, payload, _ = handoff.recv(chan)
    if kind != handoff.CONFIG:
        print(f"worker {index}: expected CONFIG on the control channel, got {kind!r}", file=sys.stderr)
        return 2
    boot = json.loads(payload)
    config = ServerConfig.from_json(boot["config"])
    expected: set[int] = set()
    for _ in range(boot["expect"]):
        kind, payload, _ = handoff.recv(chan)
        if kind != handoff.EXPECT:
            print(f"worker {index}: expected EXPECT on the control channel, got {kind!r}", file=sys.stderr)
            return 2
        expected.update(handoff.split_ids(payload))
    setup_logging(config, f"worker-{index}")
    book = AccountBook.from_fd(book_fd)

    async def run() -> None:
        await Worker(config, index, chan, book, boot["epoch"], expected, boot["grace"]).run()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
