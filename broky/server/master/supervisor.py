"""A boring supervisor of the worker processes, in the style of gunicorn's arbiter.

Each worker is a fresh interpreter (`python -m broky.server.worker.process INDEX FD`)
holding the worker end of its control channel; nothing is forked from the
running event loop. The supervisor loop wakes when a signal handler enqueues
something (handlers only enqueue), when a worker's channel closes (a dying
worker's does), every BOOT_POLL_SECONDS while a worker boots or its channel
is closed and it is not reaped yet, and every REAP_SECONDS otherwise (an idle
master stays idle); it reaps dead workers
without blocking and restarts each at once with the same index, hence the
same vbuckets: a dead worker is back within a second. A worker that exits
before it is READY, or is not READY within BOOT_TIMEOUT, failed to boot;
MAX_BOOT_FAILURES in a row for one index stop the whole server with a clear
message and exit status 1.

Every worker process gets a random epoch (the high half of its connection ids)
and a shared table for its connection accounts (broky.server.accounts). When a
worker is reaped, its accounts are read into `dead` for resuming clients, and
its successor is told which of the dead worker's connections had
subscriptions, so that it holds publishes until they are back (the restart
grace, broky.server.shard.grace `Grace.start`).

The supervisor also counts every worker's connections by client address
(`by_address`, for --max-connections-per-address): a hand-off counts from
the moment its CONN is sent (`count_connection`) until the worker refuses
it (REFUSED) or says its connection is gone (CLOSED); a dead worker's are
all dropped when it is reaped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from broky.server import accounts, handoff
from broky.server.config import ServerConfig

log = logging.getLogger("broky.master")

# The supervisor's loop wakes at least this often when every worker is up (a dying worker's
# closed channel wakes it at once): an idle master stays idle (polling at 0.1 s cost 4 ms of
# CPU per second, counted in every benchmark row).
REAP_SECONDS = 1.0
BOOT_POLL_SECONDS = 0.1  # ... and this often while a worker boots or is dying
BOOT_TIMEOUT = 15.0
MAX_BOOT_FAILURES = 3


class WorkerProcess:
    """The master's view of one worker."""

    def __init__(
        self, index: int, proc: subprocess.Popen[bytes], chan: socket.socket, epoch: int, table: mmap.mmap
    ) -> None:
        self.index = index
        self.proc = proc
        self.chan = chan
        self.epoch = epoch  # the high 32 bits of its connection ids
        self.table = table  # its accounts (read when it is gone)
        self.started = time.monotonic()
        self.ready = False
        self.load = 0  # connections open, as the worker last reported (LOAD or ADOPTED)
        # Hand-offs sent to it (CONN) and not answered yet, by hand-off id: each future
        # gets None (ADOPTED) or the cause (REFUSED), and is cancelled if the worker dies.
        self.pending: dict[int, asyncio.Future[str | None]] = {}
        self.refused_at = 0.0  # monotonic time of its last failed hand-off (/readyz)
        self.refused_cause = ""  # and its cause ("" until one fails)
        self.gone = False  # its channel broke or was closed: hand nothing more to this process
        self.channel_closed = False  # the worker closed its end (it is exiting): reap it soon
        self.backlogged = False  # a hand-off found its channel full (logged once per episode)
        self.writable: asyncio.Future[None] | None = None  # set when a full channel drains
        self.heard = self.started  # last message from the worker (LOAD comes at least every 0.5 s)
        # Client address of every hand-off sent to it that is not refused or closed yet.
        self.peers: dict[int, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def placement_load(self) -> int:
        """What least-loaded placement compares: open connections + hand-offs in flight."""
        return self.load + len(self.pending)


class Supervisor:
    """Starts, reaps and restarts the workers; `run` returns the exit status."""

    def __init__(
        self,
        config: ServerConfig,
        on_message: Callable[[WorkerProcess, bytes, bytes], None],
    ) -> None:
        self.config = config
        self.on_message = on_message
        self.loop = asyncio.get_running_loop()
        self.workers: list[WorkerProcess | None] = [None] * config.workers
        self.boot_failures = [0] * config.workers
        self.events: asyncio.Queue[str] = asyncio.Queue()
        self.on_hangup: Callable[[], None] | None = None  # SIGHUP (the master's reload)
        self.users: dict[str, Any] | None = None  # the users file as read (--users): for CONFIG
        self.stopping = False
        self.failure: str | None = None
        self.restarts = 0
        self.restarts_of = [0] * config.workers  # by worker index, for broky_worker_restarts_total
        self.dead = accounts.DeadAccounts()  # accounts of the connections of dead workers
        self.map_json: dict[str, object] | None = None  # the cluster's map, for workers that boot
        self._epochs: set[int] = set()  # every epoch given out (ids must never repeat)
        self._ready_changed = asyncio.Event()
        # Connections (open, or handed over and not answered yet) by client address.
        self.by_address: dict[str, int] = {}

    # ------------------------------------------------------------ processes

    def _new_epoch(self) -> int:
        while True:
            epoch = int.from_bytes(os.urandom(4), "big")  # as secrets.randbits, without loading random
            if epoch and epoch not in self._epochs:
                self._epochs.add(epoch)
                return epoch

    def spawn(self, index: int, expected: Sequence[int] = ()) -> WorkerProcess:
        """Start worker `index`; `expected`: its dead predecessor's subscribing connections."""
        master_end, worker_end = handoff.channel_pair()
        book_fd, table = accounts.new_table()
        try:
            args = [str(index), str(worker_end.fileno()), str(book_fd)]
            proc = subprocess.Popen(
                [sys.executable, "-m", "broky.server.worker.process", *args],
                pass_fds=[worker_end.fileno(), book_fd],
            )
        finally:
            worker_end.close()
            os.close(book_fd)
        epoch = self._new_epoch()
        batches = [
            expected[i : i + handoff.EXPECT_BATCH] for i in range(0, len(expected), handoff.EXPECT_BATCH)
        ]
        boot = {
            "config": self.config.to_worker_json(),
            "epoch": epoch,
            "map": self.map_json,
            "grace": self.config.restart_grace if expected else 0.0,
            "expect": len(batches),
            "users": self.users,
        }
        handoff.send(master_end, handoff.CONFIG, json.dumps(boot).encode())
        for batch in batches:
            handoff.send(master_end, handoff.EXPECT, handoff.pack_ids(list(batch)))
        master_end.setblocking(False)
        wp = WorkerProcess(index, proc, master_end, epoch, table)
        self.workers[index] = wp
        self.loop.add_reader(master_end.fileno(), self._on_channel, wp)
        log.debug("worker %d started, pid %d", index, proc.pid)
        return wp

    def start_all(self) -> None:
        for index in range(self.config.workers):
            self.spawn(index)

    def _on_channel(self, wp: WorkerProcess) -> None:
        while True:
            try:
                kind, payload, fd, _ = handoff.recv(wp.chan)
            except BlockingIOError:
                return
            except OSError:
                kind, payload, fd = b"", b"", None
            if fd is not None:
                socket.close(fd)
            wp.heard = time.monotonic()
            if kind == b"":
                self.loop.remove_reader(wp.chan.fileno())
                wp.channel_closed = True
                self.events.put_nowait("channel")  # reap soon
                return
            if kind == handoff.READY:
                wp.ready = True
                self.boot_failures[wp.index] = 0
                self._ready_changed.set()
            elif kind == handoff.LOAD:
                wp.load = handoff.split_load(payload)
            elif kind == handoff.ADOPTED:
                handoff_id, wp.load = handoff.split_adopted(payload)
                _answer(wp, handoff_id, None)
            elif kind == handoff.REFUSED:
                handoff_id, cause = handoff.split_refused(payload)
                self._uncount(wp, handoff_id)
                _answer(wp, handoff_id, cause)
            elif kind == handoff.CLOSED:
                handoff_id, wp.load = handoff.split_closed(payload)
                self._uncount(wp, handoff_id)
            else:
                self.on_message(wp, kind, payload)

    def count_connection(self, wp: WorkerProcess, handoff_id: int, address: str) -> None:
        """A connection from `address` was handed to wp (CONN sent): it counts until refused or closed."""
        wp.peers[handoff_id] = address
        self.by_address[address] = self.by_address.get(address, 0) + 1

    def _uncount(self, wp: WorkerProcess, handoff_id: int) -> None:
        address = wp.peers.pop(handoff_id, None)
        if address is not None:
            left = self.by_address[address] - 1
            if left:
                self.by_address[address] = left
            else:
                del self.by_address[address]

    async def wait_writable(self, wp: WorkerProcess, timeout: float) -> bool:
        """Wait until wp's channel is writable (or closed); False after `timeout` s.

        One writer callback per channel, however many hand-offs wait on it.
        """
        if wp.gone:
            return True
        if wp.writable is None:
            wp.writable = self.loop.create_future()
            self.loop.add_writer(wp.chan.fileno(), self._on_writable, wp)
        done, _ = await asyncio.wait({wp.writable}, timeout=timeout)
        return bool(done)

    def _on_writable(self, wp: WorkerProcess) -> None:
        fut, wp.writable = wp.writable, None
        try:
            self.loop.remove_writer(wp.chan.fileno())
        except (ValueError, OSError):
            pass
        if fut is not None and not fut.done():
            fut.set_result(None)

    def issued(self, epoch: int) -> bool:
        """Whether `epoch` (the high 32 bits of a connection id) is one this process gave out."""
        return epoch in self._epochs

    def live(self) -> list[WorkerProcess]:
        return [wp for wp in self.workers if wp is not None]

    def all_ready(self) -> bool:
        return all(wp is not None and wp.ready for wp in self.workers)

    async def wait_ready(self) -> bool:
        """Wait until every worker is READY; False if the supervisor gave up."""
        while not self.all_ready():
            if self.failure is not None:
                return False
            self._ready_changed.clear()
            try:
                await asyncio.wait_for(self._ready_changed.wait(), BOOT_POLL_SECONDS)
            except TimeoutError:
                self.reap()
        return self.failure is None

    def _poll_seconds(self) -> float:
        """How long the supervisor's loop may sleep: short while a worker boots or is dying."""
        if any(not wp.ready or wp.channel_closed for wp in self.live()):
            return BOOT_POLL_SECONDS
        return REAP_SECONDS

    def reap(self) -> None:
        """Collect dead workers without blocking; restart them unless stopping."""
        now = time.monotonic()
        for index, wp in enumerate(self.workers):
            if wp is None:
                continue
            code = wp.proc.poll()
            if code is None:
                if not wp.ready and now - wp.started > BOOT_TIMEOUT and not self.stopping:
                    log.error(
                        "worker %d (pid %d) not ready after %.0f s; killing it", index, wp.pid, BOOT_TIMEOUT
                    )
                    wp.proc.kill()
                continue
            was_ready = wp.ready
            expected = self._forget(wp)
            if self.stopping:
                continue
            if was_ready:
                log.error("worker %d (pid %d) died (%s); restarting it", index, wp.pid, _describe(code))
            else:
                self.boot_failures[index] += 1
                log.error(
                    "worker %d (pid %d) failed to boot (%s), %d time(s) in a row",
                    index, wp.pid, _describe(code), self.boot_failures[index],
                )  # fmt: skip
                if self.boot_failures[index] >= MAX_BOOT_FAILURES:
                    self.failure = (
                        f"worker {index} failed to boot {MAX_BOOT_FAILURES} times in a row; giving up"
                    )
                    log.critical("%s", self.failure)
                    self.events.put_nowait("failure")
                    return
            self.restarts += 1
            self.restarts_of[index] += 1
            self.spawn(index, expected)

    def _forget(self, wp: WorkerProcess) -> list[int]:
        """Drop a reaped worker; keep its accounts. Returns the ids of its connections
        that were open with subscriptions (its successor waits for them)."""
        self._on_channel(wp)  # what it said before it died (ADOPTED among others) still counts
        try:
            self.loop.remove_reader(wp.chan.fileno())
        except (ValueError, OSError):
            pass
        wp.gone = True
        if wp.writable is not None:
            self._on_writable(wp)  # wake the waiting hand-offs: they see `gone`
        for fut in wp.pending.values():
            fut.cancel()  # hand-offs it never answered: the handshakes waiting for them see `gone`
        wp.pending.clear()
        for handoff_id in list(wp.peers):  # its connections died with it
            self._uncount(wp, handoff_id)
        wp.chan.close()
        wp.ready = False
        self.workers[wp.index] = None
        if self.stopping:
            wp.table.close()
            return []
        found = accounts.read_accounts(wp.table)
        wp.table.close()
        self.dead.add(wp.index, found)
        expected = [a.conn_id for a in found if a.open and a.subscriptions]
        if found:
            log.info(
                "worker %d left the accounts of %d connections (%d subscribing were open)",
                wp.index, len(found), len(expected),
            )  # fmt: skip
        return expected

    # ------------------------------------------------------------ the loop

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.loop.add_signal_handler(sig, self.events.put_nowait, sig.name)

    async def run(self, drain: Callable[[], Coroutine[Any, Any, None]] | None = None) -> int:
        """Supervise until SIGTERM/SIGINT (exit 0) or a boot failure (exit 1).

        With `drain` (cluster mode), the first SIGTERM/SIGINT starts it and the
        workers are supervised on until it returns; a second signal stops at once.
        """
        draining: asyncio.Task[None] | None = None
        while self.failure is None:
            try:
                event = await asyncio.wait_for(self.events.get(), self._poll_seconds())
            except TimeoutError:
                event = "tick"
            if event in ("SIGTERM", "SIGINT"):
                if drain is not None and draining is None:
                    log.info("%s received: draining first (send it again to stop at once)", event)
                    draining = self.loop.create_task(drain())
                    draining.add_done_callback(lambda _: self.events.put_nowait("drained"))
                    continue
                if draining is not None and not draining.done():
                    draining.cancel()
                    log.info("%s received again: shutting down without waiting for the drain", event)
                else:
                    log.info("%s received: shutting down", event)
                return 0
            if event == "SIGHUP":
                if self.on_hangup is not None:
                    self.on_hangup()
                continue
            if event == "drained":
                log.info("drained: shutting down")
                return 0
            self.reap()
        if draining is not None:
            draining.cancel()
        return 1

    async def stop(self, timeout: float) -> None:
        """SIGTERM every worker, wait up to `timeout` s, then SIGKILL the rest."""
        self.stopping = True
        for wp in self.live():
            _signal(wp.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.live() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            self.reap()
        for wp in self.live():
            log.warning("worker %d (pid %d) did not stop in time; killing it", wp.index, wp.pid)
            _signal(wp.proc, signal.SIGKILL)
            wp.proc.wait()
            self._forget(wp)


def _answer(wp: WorkerProcess, handoff_id: int, cause: str | None) -> None:
    fut = wp.pending.pop(handoff_id, None)
    if fut is not None and not fut.done():  # else the master stopped waiting (HAND_OVER_TIMEOUT)
        fut.set_result(cause)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:  # never signal a pid that was already reaped
        proc.send_signal(sig)


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
