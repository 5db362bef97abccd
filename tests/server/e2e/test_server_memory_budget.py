"""The server-wide memory budget and the connection limits, against a real `broky serve`.

Stalled subscribers are raw connections with a small receive buffer that
never read. What is checked: the worker's memory stays within its share of
--memory-budget under a burst (RSS), the connections with the most pending
bytes are cut first, a cut subscriber that reconnects naming its connection
is told exactly what it lost (SLOW_CONSUMER), a healthy subscriber on the
same worker loses nothing, and the heap is given back after the burst. Then
--max-connections (per worker) and --max-connections-per-address: refused
with the right code, counted, and freed again when connections close or
their worker dies.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broky.errors import ErrorCode
from broky.protocol import (
    Error,
    Hello,
    LossNotice,
    LossReason,
    Message,
    PreviousConnection,
    Welcome,
    encode_message,
)
from tests.support.http import debug_stats, scrape, value
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP = kp_for_worker(0, 1)
_seq = struct.Struct("<I")


def rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def message(key: bytes, seq: int) -> bytes:
    return encode_message(KP, key, _seq.pack(seq) + b"p" * 996)  # about 1 KiB on the wire


class Reader(threading.Thread):
    """A healthy subscriber: reads everything as it comes, keeps the sequence numbers
    of its deliveries and every other frame."""

    def __init__(self, wire: Wire) -> None:
        super().__init__(daemon=True)
        self.wire = wire
        self.seqs: list[int] = []
        self.others: list[Any] = []
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            try:
                frame = self.wire.next(timeout=0.2)
            except TimeoutError:
                continue
            except EOFError:
                return
            if isinstance(frame, Message):
                self.seqs.append(_seq.unpack_from(frame.payload)[0])
            else:
                self.others.append(frame)

    def wait_for(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seqs) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        self.stop = True
        self.join(5)


def drain(w: Wire, quiet: float = 1.0) -> tuple[int, int, bool]:
    """Read a stalled connection until it ends or stays silent for `quiet` seconds:
    (deliveries, sum of LossNotice counts, whether the server closed it)."""
    got = told = 0
    while True:
        try:
            frame = w.next(timeout=quiet)
        except TimeoutError:
            return got, told, False
        except EOFError:
            return got, told, True
        if isinstance(frame, Message):
            got += 1
        elif isinstance(frame, LossNotice):
            told += frame.dropped


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_stalled_subscribers_stay_within_the_budget_and_memory_is_given_back(start_server: Any) -> None:
    # 20 stalled subscribers may each hold 16 MiB (320 MiB together); the worker's budget is 32 MiB.
    budget = 32 << 20
    server: ServerProcess = start_server(
        "--memory-budget", "32M", "--max-pending-bytes", "16M", "--slow-consumer-deadline", "60", workers=1
    )
    worker = debug_stats(server)["workers"][0]["pid"]
    stalled = [Wire.hello(server.address, worker=0, rcvbuf=4096) for _ in range(20)]
    healthy = Wire.hello(server.address, worker=0)
    try:
        for w in stalled:
            w.subscribe(1, b">")
            w.flush()
        healthy.subscribe(1, b"a.*")
        healthy.flush()
        reader = Reader(healthy)
        reader.start()
        time.sleep(0.5)
        baseline = peak = rss(worker)
        # 60 MB of 1 KiB messages; keys alternate (a.x reaches the healthy one too), so each
        # stalled connection holds its own copy of what it was sent, as with many keys.
        n = 60_000
        with Wire.hello(server.address, worker=0) as pub:
            for start in range(0, n, 500):
                pub.sock.sendall(
                    b"".join(message(b"a.x" if i % 2 else b"b.x", i) for i in range(start, start + 500))
                )
                if start % 5000 == 0:
                    peak = max(peak, rss(worker))
            pub.flush(timeout=60)
        peak = max(peak, rss(worker))
        reader.wait_for(n // 2)

        stats = debug_stats(server)["workers"][0]
        assert stats["budget_cuts"] >= 1
        assert stats["pending_bytes"] <= budget
        # Within the budget: its share, one read's deliveries to every target, and the
        # allocator's slack, freed heap not yet reused (measured: 86-90 MiB over the
        # baseline here, the share and 54-58 MiB; the stalled may hold 320 MiB without it).
        assert peak - baseline < budget + (96 << 20), (baseline, peak)
        # The healthy subscriber on the same worker lost nothing, in order, untold of nothing.
        assert reader.seqs == list(range(1, n, 2))
        assert reader.others == []
    finally:
        for w in stalled:
            w.close()
    # The burst is over: the heap goes back to the OS (the trim runs at most every 5 s), all
    # but the messages the replay buffer retains, which it took from the same share; it gave
    # room back to the pending bytes before any connection was cut (counted as evicted).
    wait_until(lambda: debug_stats(server)["workers"][0]["memory_trims"] >= 1, 15, "no heap trim")
    stats = debug_stats(server)["workers"][0]
    assert stats["replay_shrinks"] >= 1
    assert stats["replay_evicted_messages"] > 0
    assert stats["replay_bytes"] == stats["budget"]["replay"]
    assert stats["replay_bytes"] + stats["pending_bytes"] <= budget

    def given_back() -> bool:
        retained: int = debug_stats(server)["workers"][0]["replay_bytes"]
        return rss(worker) < baseline + retained + (16 << 20)

    wait_until(given_back, 15, f"RSS {rss(worker)} vs {baseline} before")
    healthy.close()


@pytest.mark.timeout(180)
def test_the_worst_offenders_are_cut_first_and_told_exactly_on_reconnect(start_server: Any) -> None:
    server: ServerProcess = start_server(
        "--memory-budget", "13M", "--max-pending-bytes", "2M", "--slow-consumer-deadline", "60",
        "--replay-bytes", "0",  # connections that hold copies to the end (with a buffer they would lag)
        workers=1,
    )  # fmt: skip
    opened: list[Wire] = []

    def hello(**kwargs: Any) -> Wire:
        w = Wire.hello(server.address, worker=0, **kwargs)
        opened.append(w)
        return w

    try:
        full = [hello(rcvbuf=4096) for _ in range(6)]  # every message of phase 1: at their bound
        light = [hello(rcvbuf=4096) for _ in range(6)]  # one in 64: at most 128 KB pending each
        trigger = hello(rcvbuf=4096)
        healthy = hello()
        for w in full:
            w.subscribe(1, b"s.>")
        for w in light:
            w.subscribe(1, b"s.b")
        trigger.subscribe(1, b"t.>")
        healthy.subscribe(1, b"s.>")
        for w in opened:
            w.flush()
        reader = Reader(healthy)
        reader.start()

        # Phase 1: 8 MB to `full` (each holds 2 MiB pending, 12 MiB together), 128 KB to
        # `light`: under the 13 MiB, however much the kernel's socket buffers hold.
        n = 8000
        pub = hello()
        frames = [message(b"s.b" if i % 64 == 63 else b"s.a", i) for i in range(n)]
        pub.sock.sendall(b"".join(frames))
        pub.flush(timeout=60)
        reader.wait_for(n)
        assert reader.seqs == list(range(n)) and reader.others == []
        assert debug_stats(server)["workers"][0]["budget_cuts"] == 0

        # Phase 2: only the trigger gets these; its pending bytes grow until the budget is
        # reached (it cannot hold more than 2 MiB itself), then the worst offenders go.
        batch = b"".join(message(b"t.x", i) for i in range(64))
        for _ in range(400):
            pub.sock.sendall(batch)
            pub.flush()
            if debug_stats(server)["workers"][0]["budget_cuts"]:
                break
        stats = debug_stats(server)["workers"][0]
        assert stats["budget_cuts"] >= 1
        assert stats["pending_bytes"] <= 13 << 20

        # Only connections at their 2 MiB bound were cut; the light ones and the trigger stay.
        ended = {i: drain(w) for i, w in enumerate(full)}
        cut = [i for i, (_, _, closed) in ended.items() if closed]
        assert cut and len(cut) == stats["budget_cuts"], (ended, stats["budget_cuts"])
        assert not any(drain(w)[2] for w in [*light, trigger])

        # A cut subscriber reconnects naming its connection: told exactly what it lost.
        for i in cut:
            got, told, _ = ended[i]
            old = full[i].welcome
            assert old is not None
            again = hello(
                previous=PreviousConnection(old.connection_id, got, told, old.resume_token), name="back"
            )
            assert again.welcome is not None and again.welcome.resumed is not None
            assert again.welcome.resumed.connection_id == old.connection_id
            notices = again.flush()
            assert notices and all(
                isinstance(f, LossNotice) and f.reason == LossReason.SLOW_CONSUMER for f in notices
            ), notices
            assert got + told + sum(f.dropped for f in notices if isinstance(f, LossNotice)) == n
        stats = debug_stats(server)["workers"][0]
        assert stats["resumes"]["connection_lost"] == len(cut)
        assert stats["dropped"]["connection_lost"] == 0
        assert stats["budget_cut_bytes"] >= len(cut) * (1 << 20)
        assert "over its memory budget" in server.log()
    finally:
        for w in opened:
            w.close()


def refused(server: ServerProcess, worker: int) -> Error:
    """A Hello the server refuses: the fatal Error it answers."""
    with Wire(server.address) as w:
        w.send(Hello(worker=worker))
        frames = w.expect_closed()
    assert len(frames) == 1 and isinstance(frames[0], Error) and frames[0].fatal, frames
    return frames[0]


def welcomed(server: ServerProcess, worker: int, timeout: float = 10.0) -> Wire:
    """A Hello the server accepts (once a limit has freed up: tried until `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        w = Wire(server.address)
        w.send(Hello(worker=worker))
        frame = w.next()
        if isinstance(frame, Welcome):
            w.welcome = frame
            return w
        w.close()
        assert time.monotonic() < deadline, f"still refused: {frame!r}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_connection_limits_per_worker_and_per_address(start_server: Any) -> None:
    server: ServerProcess = start_server(
        "--max-connections", "3", "--max-connections-per-address", "4", "--restart-grace", "0"
    )
    held = [Wire.hello(server.address, worker=0) for _ in range(3)]
    try:
        # Worker 0 is full: a Hello naming it is refused, one for any worker goes to worker 1.
        busy = refused(server, 0)
        assert busy.code == ErrorCode.SERVER_BUSY and "--max-connections 3" in (busy.message or "")
        held.append(Wire.hello(server.address))
        assert held[-1].welcome is not None and held[-1].welcome.worker == 1
        # 127.0.0.1 holds 4: the most one address may, whichever worker it asks for.
        for worker in (-1, 1, 1):
            too_many = refused(server, worker)
            assert too_many.code == ErrorCode.TOO_MANY_CONNECTIONS
            assert "--max-connections-per-address 4" in (too_many.message or "")
        master = debug_stats(server)["master"]
        assert master["connections_refused"] == {
            "max_connections": 1,
            "max_connections_per_address": 3,
            "handshake_rate": 0,
        }
        assert master["handshakes_refused"] == {"SERVER_BUSY": 1, "TOO_MANY_CONNECTIONS": 3}
        _, samples = scrape(server)
        refusals = "broky_connections_refused_total"
        assert value(samples, refusals, reason="max_connections_per_address") == 3
        assert value(samples, refusals, reason="max_connections") == 1
        log = server.log()
        assert log.count("connection refused: TOO_MANY_CONNECTIONS") == 1  # one line per 10 s
        assert log.count("connection refused: SERVER_BUSY") == 1

        # A connection that closes frees its place at once (the worker says CLOSED).
        held.pop(0).close()
        held.append(welcomed(server, 0, timeout=5))
        assert refused(server, 1).code == ErrorCode.TOO_MANY_CONNECTIONS

        # A worker that dies takes its connections with it: its count is dropped.
        pids = debug_stats(server)["master"]["worker_pids"]
        os.kill(pids[1], signal.SIGKILL)
        held.append(welcomed(server, 1, timeout=20))
        assert debug_stats(server)["master"]["worker_pids"][1] != pids[1]
        assert refused(server, -1).code == ErrorCode.TOO_MANY_CONNECTIONS
    finally:
        for w in held:
            w.close()


@pytest.mark.timeout(60)
def test_an_address_opens_a_burst_then_handshake_rate_connections_a_second(start_server: Any) -> None:
    server: ServerProcess = start_server("--handshake-rate", "4", "--handshake-burst", "3")
    time.sleep(1)  # the start-up's own /readyz and Hello probes refill meanwhile
    for _ in range(3):
        Wire.hello(server.address).close()
    too_fast = refused(server, -1)
    assert too_fast.code == ErrorCode.TOO_MANY_CONNECTIONS
    assert "faster than --handshake-rate 4 a second (after a burst of --handshake-burst 3)" in (
        too_fast.message or ""
    )
    welcomed(server, -1, timeout=5).close()  # a token a quarter of a second later
    master = debug_stats(server)["master"]
    assert master["connections_refused"]["handshake_rate"] >= 1
    _, samples = scrape(server)
    assert value(samples, "broky_connections_refused_total", reason="handshake_rate") >= 1
    assert server.log().count("connection refused: TOO_MANY_CONNECTIONS") == 1  # one line per 10 s
