"""`broky pub`, `broky sub` and `broky info` as real subprocesses against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.serverproc import ServerProcess

BROKY = [sys.executable, "-m", "broky"]


def broky_cli(
    *args: str, stdin: bytes | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKY_")}
    return subprocess.run(
        [*BROKY, *args], input=stdin, capture_output=True, timeout=timeout, env=env, check=False
    )


class SubProcess:
    """A `broky sub` running in the background; started once it is subscribed."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*BROKY, "sub", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert b"subscribed to" in line, line + self.proc.stderr.read()

    def finish(self, timeout: float = 30) -> tuple[int, bytes, bytes]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def subs() -> Iterator[list[SubProcess]]:
    started: list[SubProcess] = []
    yield started
    for s in started:
        s.kill()


def test_seq_piped_into_pub_arrives_in_order(server: ServerProcess, subs: list[SubProcess]) -> None:
    sub = SubProcess("k", "--count", "1000", "--server", server.url)
    subs.append(sub)
    seq = subprocess.run(["seq", "1", "1000"], capture_output=True, check=True).stdout
    pub = broky_cli("pub", "k", "--server", server.url, stdin=seq)
    assert pub.returncode == 0, pub.stderr
    code, out, err = sub.finish()
    assert code == 0, err
    assert out.split(b"\n")[:-1] == [str(i).encode() for i in range(1, 1001)]


def test_sub_json_and_partition(server: ServerProcess, subs: list[SubProcess]) -> None:
    sub = SubProcess("orders.*", "--partition", "t1", "--count", "1", "--json", "--server", server.url)
    subs.append(sub)
    for partition in ("t2", "t1"):
        pub = broky_cli("pub", "orders.created", "héllo", "--partition", partition, "--server", server.url)
        assert pub.returncode == 0, pub.stderr
    code, out, err = sub.finish()
    assert code == 0, err
    record = json.loads(out)
    assert record["key_partition"] == "t1"
    assert record["key"] == "orders.created"
    assert record["payload"] == "héllo"
    assert record["ts_producer"] > 0 and record["ts_broker"] >= record["ts_producer"]
    assert len(record["uid"]) == 27


def test_info_shows_the_map(server: ServerProcess) -> None:
    done = broky_cli("info", "--server", server.url, "--metrics", f"127.0.0.1:{server.metrics_port}")
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    assert "map       version 1, 1024 vbuckets, 1 node(s)" in text
    assert "workers 2" in text
    assert "worker 0: 512 vbuckets: 0-511" in text
    assert "worker 1: 512 vbuckets: 512-1023" in text
    assert "max_frame_bytes 1048576" in text
    assert "counters" in text


def test_info_into_a_closed_pipe_is_quiet(server: ServerProcess, tmp_path: Path) -> None:
    # `true` exits at once, long before info has connected: its output meets a closed pipe.
    script = 'set -o pipefail; "$@" 2>errors | true; echo "exit $?"; cat errors'
    info = [*BROKY, "info", "--server", server.url, "--metrics", f"127.0.0.1:{server.metrics_port}"]
    done = subprocess.run(
        ["bash", "-c", script, "-", *info], cwd=tmp_path, capture_output=True, timeout=30, check=False
    )
    assert done.stdout.decode().splitlines() == ["exit 141"]  # 128 + SIGPIPE, and no traceback


def test_info_without_metrics_degrades(server: ServerProcess, unused_port: int) -> None:
    done = broky_cli("info", "--server", server.url, "--metrics", f"127.0.0.1:{unused_port}")
    assert done.returncode == 0, done.stderr
    assert "counters  unavailable" in done.stdout.decode()


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", [[], ["pub"], ["sub"], ["info"]])
def test_help(command: list[str]) -> None:
    done = broky_cli(*command, "--help")
    assert done.returncode == 0
    assert b"usage: broky" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pub", "k", "x", "--server", "nats://h:1"], b"unsupported scheme"),
        (["sub", "a..b", "--server", "127.0.0.1:1"], b"empty token"),
        (["sub", "k", "--count", "0"], b"--count must be at least 1"),
        (["pub", "", "x"], b"KEY must not be empty"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args: list[str], message: bytes) -> None:
    done = broky_cli(*args)
    assert done.returncode == 1
    assert message in done.stderr
    assert done.stderr.count(b"\n") == 1, done.stderr
    assert done.stderr.startswith(b"broky ")


def test_no_server_is_a_clear_error(unused_port: int) -> None:
    for command in (["pub", "k", "x"], ["sub", "k"], ["info"]):
        done = broky_cli(*command, "--server", f"127.0.0.1:{unused_port}", "--connect-timeout", "0.3")
        assert done.returncode == 1
        assert b"cannot connect" in done.stderr and done.stderr.count(b"\n") == 1, done.stderr


def test_wrong_token_is_a_clear_error(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--auth-token", "tok")
    done = broky_cli("pub", "k", "x", "--server", server.url, "--auth-token", "bad")
    assert done.returncode == 1 and b"AUTH_FAILED" in done.stderr, done.stderr
    done = broky_cli("pub", "k", "x", "--server", server.url, "--auth-token", "tok")
    assert done.returncode == 0, done.stderr


def test_bad_arguments_exit_2() -> None:
    done = broky_cli("sub", "k", "--count", "many")
    assert done.returncode == 2
    assert b"invalid int value" in done.stderr
