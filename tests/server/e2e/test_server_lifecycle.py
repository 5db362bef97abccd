"""Supervision and shutdown of a real `broky serve`."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broky.errors import ErrorCode
from broky.protocol import (
    Error,
    Goodbye,
    Hello,
    LossNotice,
    LossReason,
    Message,
    Pause,
    Ping,
    Welcome,
    encode_frame,
    encode_message,
)
from broky.server.config import ServerConfig
from tests.support.http import http_get
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP = [kp_for_worker(0, 2), kp_for_worker(1, 2)]


def worker_pid(server: ServerProcess, index: int) -> int:
    from tests.support.http import debug_stats

    snap = debug_stats(server)["workers"][index]
    assert snap is not None
    return int(snap["pid"])


def round_trip(server: ServerProcess, worker: int, tag: bytes) -> None:
    with Wire.hello(server.address, worker=worker) as sub, Wire.hello(server.address, worker=worker) as pub:
        assert sub.welcome is not None and sub.welcome.worker == worker
        sub.subscribe(1, b"rt")
        sub.flush()
        pub.publish(KP[worker], b"rt", tag)
        pub.flush()
        assert [m.payload for m in sub.messages()] == [tag]


def test_a_killed_worker_is_restarted_and_the_other_never_notices(server: ServerProcess) -> None:
    victim, survivor = worker_pid(server, 1), worker_pid(server, 0)
    assert sorted(server.worker_pids()) == sorted([victim, survivor])
    keeper = Wire.hello(server.address, worker=0)
    keeper.subscribe(1, b"keep")
    keeper.flush()
    doomed = Wire.hello(server.address, worker=1)

    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    doomed.expect_closed()  # its connections die with it
    doomed.close()
    while True:  # back in about 0.2 s on an idle machine
        pids = server.worker_pids()
        if len(pids) == 2 and victim not in pids and http_get(server, "/readyz")[0] == 200:
            break
        assert time.monotonic() - killed < 10.0, f"worker not back within 10 s: {pids}"
        time.sleep(0.02)
    assert worker_pid(server, 0) == survivor
    assert worker_pid(server, 1) not in (victim, survivor)
    round_trip(server, 1, b"after restart")
    with Wire.hello(server.address, worker=0) as pub:  # the other shard never noticed
        pub.publish(KP[0], b"keep", b"k")
        pub.flush()
    assert [m.payload for m in keeper.messages()] == [b"k"]
    keeper.close()
    assert "worker 1" in server.log() and "died (killed by SIGKILL); restarting it" in server.log()


def test_hello_for_a_worker_that_just_died_waits_for_its_successor(server: ServerProcess) -> None:
    victim = worker_pid(server, 1)
    os.kill(victim, signal.SIGKILL)
    # Until the master reaps the dead worker it still looks ready: a hand-off then
    # fails (or is never answered), and the connection must wait for the restarted
    # worker instead of being refused. (A socket the worker adopted in the instant
    # of the kill dies with it: the client sees the connection close, and reconnects.)
    outcomes = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        w = Wire(server.address, timeout=5)
        w.send(Hello(worker=1, client_name="test"))
        try:
            frame = w.next()
        except EOFError:
            outcomes.append("closed")
            continue
        finally:
            w.close()
        outcomes.append(type(frame).__name__)
        if isinstance(frame, Welcome):
            break
        assert not isinstance(frame, Error), f"refused: {frame}"
    assert outcomes[-1] == "Welcome", outcomes
    assert worker_pid(server, 1) != victim


def shutdown_drops(server: ServerProcess, worker: int) -> int:
    """The `shutdown` drops a worker logged as it stopped."""
    found = re.findall(rf"worker {worker} stopped: (\d+) messages dropped at shutdown", server.log())
    assert len(found) == 1, server.log()
    return int(found[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_goodbye_and_exit_0_within_5_s(start_server: Any, sig: int) -> None:
    server = start_server()
    workers = server.worker_pids()
    clients = [Wire.hello(server.address, worker=w) for w in (0, 1, 0)]
    clients[0].subscribe(1, b"k")
    clients[0].flush()
    paused = clients[2]  # three deliveries kept for it when the signal comes: they are dropped
    paused.subscribe(1, b"kept")
    paused.send(Pause())
    assert paused.flush() == []
    with Wire.hello(server.address, worker=0) as pub:
        pub.send(*(encode_message(KP[0], b"kept", b"%d" % i) for i in range(3)))  # one read, one run
        assert pub.flush() == []
    paused.expect_silence()
    started = time.monotonic()
    server.signal(sig)
    assert server.wait(5.0) == 0
    assert time.monotonic() - started < 5.0
    for c in clients:
        frames = c.expect_closed()
        # Goodbye is not kept back; the paused client is told what it lost first.
        told = [LossNotice(3, LossReason.SHUTDOWN)] if c is paused else []
        assert frames == [*told, Goodbye("server shutting down", 0)], frames
        c.close()
    assert (shutdown_drops(server, 0), shutdown_drops(server, 1)) == (3, 0)
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert "Traceback" not in server.log()


def test_connections_still_in_the_handshake_get_a_goodbye(start_server: Any) -> None:
    server = start_server()
    silent = Wire(server.address)  # no Hello yet
    partial = Wire(server.address)
    partial.send(encode_frame(Hello())[:10])
    # The master accepts in order: once a later connection is welcomed, both are in the handshake.
    Wire.hello(server.address).close()
    server.signal(signal.SIGTERM)
    for w in (silent, partial):
        frames = w.expect_closed()
        assert len(frames) == 1 and isinstance(frames[0], Goodbye), frames
        w.close()
    assert server.wait(5.0) == 0
    assert "goodbye to 2 connections in the handshake" in server.log()


def test_publishes_after_the_goodbye_are_counted_as_shutdown(start_server: Any) -> None:
    server = start_server()
    # A subscriber that never reads keeps worker 0 flushing for the whole shutdown timeout,
    # so the publisher's late messages certainly reach it.
    stuck = stall(server)
    pub = Wire.hello(server.address, worker=0)
    server.signal(signal.SIGTERM)
    pub.expect(Goodbye)
    late = b"".join(
        [
            *(encode_message(KP[0], b"late", b"%d" % i) for i in range(100)),
            encode_frame(Ping(1)),  # not a message: not counted
            encode_message(KP[0], b"late", b"half")[:50],  # never completed: not counted
        ]
    )
    pub.sock.sendall(late[:1001])  # frames split across reads
    time.sleep(0.05)
    pub.sock.sendall(late[1001:])
    assert server.wait(5.0) == 0
    assert shutdown_drops(server, 0) == 100
    stuck.close()
    pub.close()


def stall(server: ServerProcess) -> Wire:
    """A subscriber of worker 0 that never reads, with megabytes queued in the worker
    (more than the kernel's socket buffers hold: 16 MB published; past the 4 MiB bound it lags,
    with its bound queued)."""
    stuck = Wire.hello(server.address, worker=0, rcvbuf=4096)
    stuck.subscribe(1, b"k")
    stuck.flush()
    with Wire.hello(server.address, worker=0) as pub:
        pub.sock.sendall(encode_message(KP[0], b"k", b"x" * 1000) * 16_000)
        assert pub.flush(timeout=30) == []
    return stuck


def test_shutdown_does_not_wait_for_a_client_that_never_reads(start_server: Any) -> None:
    server = start_server()
    stuck = stall(server)
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    # It waits its shutdown timeout for the client (4 s), then resets it: not for ever.
    timeout = ServerConfig().shutdown_timeout
    assert server.wait(5 * timeout) == 0
    assert time.monotonic() - started < 3 * timeout
    assert "worker 0: connections not flushed in time; reset" in server.log()
    stuck.close()


def test_repeated_boot_failure_stops_the_master(tmp_path: Path) -> None:
    # sitecustomize runs first in every interpreter: make only the workers fail.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'broky.server.worker.process' in sys.orig_argv:\n"
        "    sys.stderr.write('injected boot failure\\n')\n"
        "    os._exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "broky", "serve", "--port", "0", "--metrics-port", "0", "--workers", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=30, start_new_session=True)
    assert proc.returncode == 1
    assert b"broky ready" not in proc.stdout
    assert b"failed to boot 3 times in a row; giving up" in proc.stderr


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_port_in_use_names_the_port_and_the_option_that_chooses_another(
    server: ServerProcess, option: str
) -> None:
    held = server.port if option == "--port" else server.metrics_port
    ports = {"--port": "0", "--metrics-port": "0", option: str(held)}
    cmd = [sys.executable, "-m", "broky", "serve", *(a for pair in ports.items() for a in pair)]
    proc = subprocess.run(cmd, capture_output=True, timeout=30, start_new_session=True)
    assert proc.returncode == 1
    (line,) = proc.stderr.decode().splitlines()  # one line, no traceback
    what = "clients" if option == "--port" else "metrics (HTTP)"
    assert f" CRITICAL master broky.master: cannot listen on 127.0.0.1:{held} for {what}: " in line
    assert "address already in use" in line
    variable = "$BROKY_PORT" if option == "--port" else "$BROKY_METRICS_PORT"
    assert line.endswith(f"choose another port with {option} PORT or {variable} (0 picks a free one)")


def test_a_delivery_in_flight_at_shutdown_arrives_before_goodbye(start_server: Any) -> None:
    server = start_server()
    sub = Wire.hello(server.address, worker=0)
    sub.subscribe(1, b"k")
    sub.flush()
    with Wire.hello(server.address, worker=0) as pub:
        pub.publish(KP[0], b"k", b"last")
        pub.flush()
    server.signal(signal.SIGTERM)
    frames = sub.expect_closed()
    assert isinstance(frames[0], Message) and isinstance(frames[-1], Goodbye)
    assert server.wait(5.0) == 0
    sub.close()


def test_a_busy_worker_is_waited_for_then_refused_not_written_off(start_server: Any) -> None:
    from tests.support.http import debug_stats

    server = start_server("--hello-timeout", "10")
    victim = worker_pid(server, 0)
    # 60 KB Hellos: a few dozen hand-offs fill a stopped worker's control channel.
    hello = encode_frame(Hello(worker=0, client_name="x" * 60_000))
    waiting: list[Wire] = []
    outcomes = []
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        for _ in range(80):
            waiting.append(Wire(server.address, timeout=10))
            waiting[-1].send(hello)
        while "its control channel is full" not in server.log():
            assert time.monotonic() - stopped < 15, server.log()
            time.sleep(0.05)
        for w in waiting:
            frame = w.next()
            assert isinstance(frame, Error), frame
            outcomes.append((ErrorCode(frame.code).name, frame.message))
        answered = time.monotonic() - stopped
        os.kill(victim, signal.SIGCONT)
    finally:
        os.kill(victim, signal.SIGCONT)
        for w in waiting:
            w.close()
    # Each was refused after waiting 2 s, as busy, not because the worker was thought dead:
    # those in the channel for want of an answer, the others for want of room in it.
    assert answered < 15  # 2 s and the hand-offs; not the 10 s Hello timeout twice over
    assert {code for code, _ in outcomes} == {"SERVER_BUSY"}
    assert {message for _, message in outcomes} == {
        "worker 0 cannot take connections: no answer to a hand-off within 2 s",
        "worker 0 cannot take connections: its control channel stayed full for 2 s",
    }
    assert debug_stats(server)["master"]["handoffs_refused"][0].keys() == {"no_answer", "channel_full"}
    assert sum(debug_stats(server)["master"]["handoffs_refused"][0].values()) == 80
    # The worker is not written off: new connections to it work at once (it finds the
    # sockets of the refused hand-offs still in its channel closed, and says nothing).
    round_trip(server, 0, b"after SIGCONT")
    assert worker_pid(server, 0) == victim
    assert "is gone" not in server.log() and "Traceback" not in server.log()
    deadline = time.monotonic() + 5  # not ready for 3 s after the last refusal
    while http_get(server, "/readyz")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_least_loaded_means_fewest_open_connections(server: ServerProcess) -> None:
    from tests.support.http import debug_stats

    time.sleep(0.5)  # past the workers' first LOAD reports
    # Ten connections to worker 0 that open and close between two LOAD reports (10 ms).
    for _ in range(10):
        Wire.hello(server.address, worker=0).close()
    deadline = time.monotonic() + 5
    while debug_stats(server)["workers"][0]["connections"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(2.0)  # a LOAD report (every 0.25 s tick, at least every 0.5 s) says they are gone
    held = [Wire.hello(server.address) for _ in range(4)]
    assert [w.welcome.worker for w in held if w.welcome] == [0, 1, 0, 1]  # ties: the lower index
    # Open connections are load: three more on worker 1 (5 against 2), then "any" fills worker 0.
    held += [Wire.hello(server.address, worker=1) for _ in range(3)]
    more = [Wire.hello(server.address) for _ in range(4)]
    assert [w.welcome.worker for w in more if w.welcome] == [0, 0, 0, 0]
    for w in held + more:
        w.close()


def test_out_of_file_descriptors_pauses_accepting(start_server: Any) -> None:
    server = start_server("--hello-timeout", "1")
    fds = len(os.listdir(f"/proc/{server.pid}/fd"))
    _, hard = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (fds + 2, hard))  # room for about 2 more
    clients = [Wire(server.address, timeout=10) for _ in range(5)]  # silent: they hold their fds
    cpu_before = process_cpu_seconds(server.pid)
    time.sleep(0.8)  # less than the Hello timeout: nothing is freed meanwhile
    cpu = process_cpu_seconds(server.pid) - cpu_before
    failures = [line for line in server.log().splitlines() if "accept failed" in line]
    assert len(failures) == 1 and "Too many open files" in failures[0], failures
    assert cpu < 0.3, f"the master spun: {cpu:.2f} s of CPU in 0.8 s"
    # As Hello timeouts free descriptors the master accepts again: every client is answered.
    for w in clients:
        frames = w.expect_closed()
        assert [(type(f), getattr(f, "code", None)) for f in frames] == [(Error, ErrorCode.HELLO_TIMEOUT)]
        w.close()
    resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (hard, hard))
    round_trip(server, 0, b"after EMFILE")
    assert "accepting again after" in server.log()
    assert "Traceback" not in server.log()


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_supervisor_polls_fast_only_while_a_worker_boots_or_dies() -> None:
    # An idle master must stay idle (its 0.1 s poll cost 4 ms of CPU per second): it
    # sleeps REAP_SECONDS when every worker is up, BOOT_POLL_SECONDS while one boots or
    # has closed its channel and is not reaped yet (a dead worker is back within a second).
    import asyncio
    from types import SimpleNamespace

    from broky.server.master import supervisor

    async def poll_seconds() -> list[float]:
        sup = supervisor.Supervisor(ServerConfig(workers=2), lambda wp, kind, payload: None)
        up = [SimpleNamespace(ready=True, channel_closed=False) for _ in range(2)]
        sup.workers = up  # type: ignore[assignment]
        idle = sup._poll_seconds()
        up[1].ready = False  # booting
        booting = sup._poll_seconds()
        up[1].ready, up[0].channel_closed = True, True  # exiting
        dying = sup._poll_seconds()
        return [idle, booting, dying]

    idle, booting, dying = asyncio.run(poll_seconds())
    assert idle == supervisor.REAP_SECONDS >= 1.0
    assert booting == dying == supervisor.BOOT_POLL_SECONDS <= 0.1
