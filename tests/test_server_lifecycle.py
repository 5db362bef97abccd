"""Supervision and shutdown of a real `broky serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broky.protocol import Error, Goodbye, Hello, Message, Welcome
from tests.serverproc import ServerProcess
from tests.test_server_pubsub import http_get
from tests.wire import Wire, kp_for_worker

KP = [kp_for_worker(0, 2), kp_for_worker(1, 2)]


def worker_pid(server: ServerProcess, index: int) -> int:
    from tests.test_server_pubsub import debug_stats

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


def test_killed_worker_is_back_within_a_second(server: ServerProcess) -> None:
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
    while True:
        pids = server.worker_pids()
        if len(pids) == 2 and victim not in pids and http_get(server, "/readyz")[0] == 200:
            break
        assert time.monotonic() - killed < 1.0, f"worker not back within 1 s: {pids}"
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
    # fails, and the connection must wait for the restarted worker instead of
    # being refused. (A socket handed over in the instant of the kill dies with
    # the worker: the client sees the connection close, and reconnects.)
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_goodbye_and_exit_0_within_5_s(start_server: Any, sig: int) -> None:
    server = start_server()
    workers = server.worker_pids()
    clients = [Wire.hello(server.address, worker=w) for w in (0, 1, 0)]
    clients[0].subscribe(1, b"k")
    clients[0].flush()
    paused_reader = clients[2]
    started = time.monotonic()
    server.signal(sig)
    assert server.wait(5.0) == 0
    assert time.monotonic() - started < 5.0
    for c in clients:
        frames = c.expect_closed()
        assert len(frames) == 1 and isinstance(frames[0], Goodbye), frames
        c.close()
    del paused_reader
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert "Traceback" not in server.log()


def test_shutdown_does_not_wait_for_a_client_that_never_reads(start_server: Any) -> None:
    server = start_server("--max-pending-bytes", "256K")
    stuck = Wire.hello(server.address, worker=0, rcvbuf=4096)
    stuck.subscribe(1, b"k")
    stuck.flush()
    with Wire.hello(server.address, worker=0) as pub:
        from broky.protocol import encode_message

        batch = encode_message(KP[0], b"k", b"x" * 1000) * 1000
        pub.sock.sendall(batch)
        pub.flush()
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    assert server.wait(5.0) == 0
    assert time.monotonic() - started < 5.0
    stuck.close()


def test_repeated_boot_failure_stops_the_master(tmp_path: Path) -> None:
    # sitecustomize runs first in every interpreter: make only the workers fail.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'broky.server.worker' in sys.orig_argv:\n"
        "    sys.stderr.write('injected boot failure\\n')\n"
        "    os._exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "broky", "serve", "--port", "0", "--metrics-port", "0", "--workers", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=30, start_new_session=True)
    assert proc.returncode == 1
    assert b"broky ready" not in proc.stdout
    assert b"failed to boot 3 times in a row; giving up" in proc.stderr


def test_port_in_use_is_a_clear_error(server: ServerProcess) -> None:
    cmd = [sys.executable, "-m", "broky", "serve", "--port", str(server.port), "--metrics-port", "0"]
    proc = subprocess.run(cmd, capture_output=True, timeout=30, start_new_session=True)
    assert proc.returncode == 1
    assert b"cannot listen on 127.0.0.1" in proc.stderr and b"Traceback" not in proc.stderr


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
