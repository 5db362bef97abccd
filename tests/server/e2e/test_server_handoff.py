"""Hand-offs a worker cannot take, on a real `broky serve`.

Worker 0's RLIMIT_NOFILE is lowered at run time (`prlimit`), so that the
kernel drops the client socket's fd from the CONN datagrams it receives
(MSG_CTRUNC). Every such connection must be refused with SERVER_BUSY, never
dropped without a word; the refusals are counted, logged a bounded number of
times, make /readyz say which worker and why, and leave the master's load
accounting exact.
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import time

import pytest

from broky.errors import ErrorCode
from broky.protocol import Error, Hello, Welcome, encode_frame
from broky.server import handoff
from tests.support.http import debug_stats, http_get, scrape, value
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire

LIMIT = 64  # file descriptors left to worker 0 (it needs about 20 of them itself)
REFUSALS = 20  # connections refused before the test stops opening more


def connect(server: ServerProcess, worker: int) -> tuple[Wire, Welcome | Error]:
    """A raw connection with Hello{worker}, and the server's first answer (EOF fails)."""
    w = Wire(server.address, timeout=5)
    w.send(Hello(worker=worker, client_name="fd-test"))
    try:
        frame = w.next()
    except EOFError:
        w.close()
        raise AssertionError("bare EOF instead of a Welcome or an Error") from None
    assert isinstance(frame, Welcome | Error), frame
    return w, frame


def wait_for(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_worker_out_of_file_descriptors_refuses_with_server_busy(server: ServerProcess) -> None:
    pid = debug_stats(server)["workers"][0]["pid"]
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (LIMIT, hard))
    held: list[Wire] = []
    refused: list[Error] = []
    try:
        # Clients for any worker alternate between the two until worker 0 refuses one:
        # that client is handed to worker 1 instead, and never hears of it.
        while not debug_stats(server)["master"]["handoffs_refused"][0]:
            assert len(held) < 2 * LIMIT, "worker 0 never ran out of file descriptors"
            held.append(Wire.hello(server.address, worker=-1))
        on_0 = sum(1 for w in held if w.welcome is not None and w.welcome.worker == 0)
        assert 10 < on_0 < LIMIT and len(held) - on_0 in (on_0, on_0 + 1), (on_0, len(held))
        # Clients that name worker 0 are refused, each with an Error, never a bare EOF.
        while len(refused) < REFUSALS:
            assert len(held) < 3 * LIMIT
            w, frame = connect(server, 0)
            if isinstance(frame, Welcome):  # a descriptor freed meanwhile
                held.append(w)
                continue
            refused.append(frame)
            assert w.expect_closed() == []  # the Error is the last frame, then the close
            w.close()
        for e in refused:
            assert (e.code, e.fatal) == (ErrorCode.SERVER_BUSY, True)
            assert e.message == "worker 0 cannot take connections: out of file descriptors", e.message
        # Meanwhile a client for any worker goes straight to the one that takes connections.
        with Wire.hello(server.address, worker=-1) as any_worker:
            assert any_worker.welcome is not None and any_worker.welcome.worker == 1

        _, samples = scrape(server)
        no_fd = value(samples, "broky_handoffs_refused_total", worker="0", cause="no_fd")
        assert no_fd == REFUSALS + 1  # and the one handed to worker 1 instead
        assert value(samples, "broky_handshakes_refused_total", code="server_busy") == REFUSALS
        assert debug_stats(server)["master"]["handoffs_refused"] == [{"no_fd": REFUSALS + 1}, {}]
        status, body = http_get(server, "/readyz")
        assert status == 503 and b"worker 0 (no_fd: out of file descriptors)" in body, body
    finally:
        for w in held:
            w.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))

    log = server.log().splitlines()
    worker_lines = [line for line in log if "worker 0 refused a connection (no_fd)" in line]
    master_lines = [line for line in log if "worker 0 cannot take connections" in line]
    # One line each per 10 s interval (the test takes a few seconds), never one per connection.
    assert 1 <= len(worker_lines) <= 2 and 1 <= len(master_lines) <= 2, (worker_lines, master_lines)
    assert "MSG_CTRUNC" in worker_lines[0]
    assert "unexpected control message" not in server.log()
    assert "Traceback" not in server.log()

    # Ready again by itself, a few seconds after the last refusal.
    wait_for("/readyz not 200 again", lambda: http_get(server, "/readyz")[0] == 200, 6)
    # Everything closed: the master's view of the load is exact again, so connections
    # for any worker split evenly (the lost hand-offs of the bug skewed this for good).
    wait_for(
        "connections not closed",
        lambda: [w["connections"] for w in debug_stats(server)["workers"]] == [0, 0],
        5,
    )
    time.sleep(2.0)  # a LOAD report (every 0.25 s tick, at least every 0.5 s) says they are gone
    held = [Wire.hello(server.address, worker=-1) for _ in range(200)]
    try:
        on = [sum(1 for w in held if w.welcome is not None and w.welcome.worker == i) for i in (0, 1)]
        assert sum(on) == 200 and abs(on[0] - on[1]) <= 2, on
    finally:
        for w in held:
            w.close()


@pytest.mark.timeout(30)
def test_a_hand_off_pending_when_its_worker_dies_goes_to_its_successor(server: ServerProcess) -> None:
    victim = debug_stats(server)["workers"][1]["pid"]
    os.kill(victim, signal.SIGSTOP)  # the CONN waits in its channel, unanswered
    try:
        w = Wire(server.address, timeout=5)
        w.send(Hello(worker=1, client_name="pending"))
        # The master reads the Hello and sends the CONN, which waits unanswered; the kill must
        # come within the 2 s the master waits for an answer. Nothing shows the CONN sent
        # sooner (/stats waits those 2 s for the stopped worker): the middle of the window,
        # and the log checked below says the worker died with the hand-off pending.
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
    finally:
        os.kill(victim, signal.SIGCONT)
    with w:  # the master still held the socket: the restarted worker 1 welcomes it
        welcome = w.expect(Welcome)
        assert welcome.worker == 1
        assert w.flush() == []
    stats = debug_stats(server)
    assert stats["workers"][1]["pid"] != victim
    assert stats["master"]["handoffs_pending"] == [0, 0] and stats["master"]["handoffs_refused"] == [{}, {}]
    assert "worker 1 is gone (it died before answering the hand-off)" in server.log()


def test_conn_payload_layout_takes_new_fields() -> None:
    hello = encode_frame(Hello(worker=0, client_name="x"))
    payload = handoff.pack_conn(7, hello)
    assert handoff.split_conn(payload) == handoff.Conn(7, hello)
    # Field 1 is the account of the connection a client resumes.
    assert handoff.split_conn(handoff.pack_conn(7, hello, b"acct")) == handoff.Conn(7, hello, b"acct")
    # A writer that appends a field is still read by this reader.
    newer = struct.pack("<IHIII", 7, 3, len(hello), 2, 3) + hello + b"ac" + b"xyz"
    assert handoff.split_conn(newer) == handoff.Conn(7, hello, b"ac")
    assert handoff.split_refused(handoff.pack_refused(9, "EMFILE")) == (9, "EMFILE")
    assert handoff.split_adopted(handoff.pack_adopted(9, 42)) == (9, 42)
