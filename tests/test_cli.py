"""`broky pub`, `broky sub` and `broky info` as real subprocesses against a real server."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broky.client.cli import DEFAULT_METRICS_PORT
from broky.protocol.routing import vbucket_of
from tests.serverproc import ServerProcess

BROKY = [sys.executable, "-m", "broky"]


def broky_cli(
    *args: str | bytes, stdin: bytes | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKY_")}
    return subprocess.run(
        [*BROKY, *args], input=stdin, capture_output=True, timeout=timeout, env=env, check=False
    )


class SubProcess:
    """A `broky sub` running in the background; started once it is subscribed."""

    def __init__(self, *args: str | bytes) -> None:
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
    # nanoseconds as strings: above 2**53, a JSON number would be rounded by float64 readers
    ts_producer, ts_broker = int(record["ts_producer"]), int(record["ts_broker"])
    assert isinstance(record["ts_producer"], str) and ts_producer > 2**53
    assert ts_broker >= ts_producer
    assert len(record["uid"]) == 27
    # the position: the vbucket of t1, an epoch (a string: 64 bits), its offset there
    assert record["vbucket"] == vbucket_of(b"t1")
    assert isinstance(record["epoch"], str) and int(record["epoch"]) > 0
    assert record["offset"] >= 1


def test_sub_since_time_and_last_start_with_retained_messages(
    server: ServerProcess, subs: list[SubProcess]
) -> None:
    pub = broky_cli("pub", "hist.k", "--server", server.url, stdin=b"1\n2\n3\n4\n")
    assert pub.returncode == 0, pub.stderr
    last = SubProcess("hist.k", "--last", "2", "--count", "2", "--server", server.url)
    ago = SubProcess("hist.k", "--since-time", "1h", "--count", "4", "--json", "--server", server.url)
    subs.extend([last, ago])
    code, out, err = last.finish()
    assert code == 0, err
    assert out == b"3\n4\n"
    code, out, err = ago.finish()
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["payload"] for r in records] == ["1", "2", "3", "4"]
    offsets = [r["offset"] for r in records]
    assert offsets == list(range(offsets[0], offsets[0] + 4))


def test_server_takes_a_list_of_seeds(
    server: ServerProcess, subs: list[SubProcess], unused_port: int
) -> None:
    # the first seed answers nothing: both commands try the next one
    seeds = f"127.0.0.1:{unused_port},{server.host}:{server.port}"
    sub = SubProcess("seeds.k", "--count", "2", "--server", seeds)
    subs.append(sub)
    pub = broky_cli("pub", "seeds.k", "--server", f"broky://{seeds}", stdin=b"a\nb\n")
    assert pub.returncode == 0, pub.stderr
    code, out, err = sub.finish()
    assert code == 0, err
    assert out == b"a\nb\n"
    done = broky_cli("pub", "k", "x", "--server", f"{server.host}:{server.port},")
    assert done.returncode == 2 and b"empty entry in the server list" in done.stderr, done.stderr


def test_info_shows_the_map(server: ServerProcess) -> None:
    pub = broky_cli("pub", "k", "--server", server.url, stdin=b"1\n2\n3\n")
    assert pub.returncode == 0, pub.stderr
    done = broky_cli("info", "--server", server.url, "--metrics", f"127.0.0.1:{server.metrics_port}")
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    assert "map       version 1, 1024 vbuckets, 1 node(s)" in text
    assert "workers 2" in text
    assert "worker 0: 512 vbuckets: 0-511" in text
    assert "worker 1: 512 vbuckets: 512-1023" in text
    assert "max_frame_bytes 1048576" in text
    assert f"counters  from 127.0.0.1:{server.metrics_port}" in text
    # live values, not a placeholder: the three messages just published
    assert re.search(r"^  \S*messages_published\S* 3$", text, re.MULTILINE), text


def test_info_reads_the_stats_of_a_server_with_a_token(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--auth-token", "tok")
    pub = broky_cli("pub", "k", "x", "--server", server.url, "--auth-token", "tok")
    assert pub.returncode == 0, pub.stderr
    metrics = f"127.0.0.1:{server.metrics_port}"
    done = broky_cli("info", "--server", server.url, "--auth-token", "tok", "--metrics", metrics)
    assert done.returncode == 0, done.stderr
    # /stats (it needs the token) rather than the /metrics fallback: its flattened names
    assert re.search(r"^  totals\.messages_published 1$", done.stdout.decode(), re.MULTILINE), done.stdout


def test_info_into_a_closed_pipe_is_quiet(server: ServerProcess, tmp_path: Path) -> None:
    # `true` exits at once, long before info has connected: its output meets a closed pipe.
    script = 'set -o pipefail; "$@" 2>errors | true; echo "exit $?"; cat errors'
    info = [*BROKY, "info", "--server", server.url, "--metrics", f"127.0.0.1:{server.metrics_port}"]
    done = subprocess.run(
        ["bash", "-c", script, "-", *info], cwd=tmp_path, capture_output=True, timeout=30, check=False
    )
    assert done.stdout.decode().splitlines() == ["exit 141"]  # 128 + SIGPIPE, and no traceback


def test_info_fails_when_the_metrics_it_was_given_are_unreachable(
    server: ServerProcess, unused_port: int
) -> None:
    done = broky_cli("info", "--server", server.url, "--metrics", f"127.0.0.1:{unused_port}")
    assert done.returncode == 1
    assert b"map       version 1" in done.stdout  # what could be read is printed
    assert done.stderr.startswith(f"broky info: error: no counters from 127.0.0.1:{unused_port}".encode())
    assert done.stderr.count(b"\n") == 1, done.stderr


def test_info_without_metrics_degrades_and_says_how_to_find_them(server: ServerProcess) -> None:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", DEFAULT_METRICS_PORT)) == 0:
            pytest.skip(f"something listens on the default metrics port {DEFAULT_METRICS_PORT}")
    done = broky_cli("info", "--server", server.url)  # this server's metrics are on another port
    assert done.returncode == 0, done.stderr
    line = done.stdout.decode().splitlines()[-1]
    assert line.startswith(f"counters  unavailable from 127.0.0.1:{DEFAULT_METRICS_PORT} (the default")
    assert "--metrics HOST:PORT" in line and "$BROKY_METRICS" in line


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "command", [[], ["pub"], ["sub"], ["info"], ["serve"], ["cluster"], ["cluster", "status"]]
)
def test_help(command: list[str]) -> None:
    done = broky_cli(*command, "--help")
    assert done.returncode == 0
    assert b"usage: broky" in done.stdout


def test_the_command_table_names_every_command_its_module_adds() -> None:
    import argparse

    from broky import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(cli.COMMANDS)
    for command, module in cli.COMMANDS.items():
        alone = next(
            a for a in cli.build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)
        )
        assert command in alone.choices, module


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pub", "k", "x", "--server", "nats://h:1"], b"argument --server: unsupported scheme"),
        (["sub", "a..b", "--server", "127.0.0.1:1"], b"argument PATTERN: empty token"),
        (["sub", "k", "--count", "0"], b"argument --count: must be at least 1, not 0"),
        (["sub", "k", "--count", "many"], b"argument --count: 'many' is not a whole number"),
        (["pub", "", "x"], b"argument KEY: must not be empty"),
        (["pub", "a.*", "x"], b"argument KEY: 'a.*' has a wildcard token"),
        (["pub", "a.>", "x"], b"argument KEY: 'a.>' has a wildcard token"),
        (["pub", "a..b", "x"], b"argument KEY: 'a..b' has an empty token"),
        (["pub", "k.", "x"], b"argument KEY: 'k.' has an empty token"),
        (["pub", "k", "x", "--connect-timeout", "-1"], b"argument --connect-timeout: must be a positive"),
        (["info", "--connect-timeout", "nan"], b"argument --connect-timeout: must be a positive"),
        (["sub", "k", "--no-such-option"], b"unrecognized arguments: --no-such-option"),
        (["sub", "k", "--since-time", "yesterday"], b"argument --since-time: 'yesterday' is not a duration"),
        (["sub", "k", "--last", "-1"], b"argument --last: must be at least 1"),
        (["sub", "k", "--ack"], b"--key-shared and --ack need --group NAME"),
        (["sub", "k", "--key-shared"], b"--key-shared and --ack need --group NAME"),
        (["sub", "k", "--group", "g", "--last", "5"], b"a group member starts live"),
        (["sub", "k", "--group", ""], b"argument --group: must not be empty"),
        (["pub"], b"the following arguments are required: KEY"),
        (["nosuchcommand"], b"argument COMMAND: invalid choice"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: bytes) -> None:
    done = broky_cli(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr
    assert done.stderr.count(b"\n") == 1, done.stderr
    assert re.match(rb"broky( [a-z]+)?: error: ", done.stderr), done.stderr
    assert done.stdout == b""


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


def test_an_unresolvable_host_is_one_clear_line() -> None:
    for _ in range(3):  # the stray "Future exception was never retrieved" came and went
        done = broky_cli("pub", "--server", "nosuchhost.invalid:4777", "k", "x")
        assert done.returncode == 1
        expected = b"broky pub: error: cannot resolve host 'nosuchhost.invalid'"
        assert done.stderr.startswith(expected), done.stderr
        assert done.stderr.count(b"\n") == 1, done.stderr


def test_bytes_that_are_not_utf8_pass_through(server: ServerProcess, subs: list[SubProcess]) -> None:
    key, partition = b"raw.\xff", b"p\xfe"
    sub = SubProcess(b"raw.\xff", "--partition", partition, "--count", "1", "--json", "--server", server.url)
    subs.append(sub)
    for p in (b"other", partition):
        pub = broky_cli("pub", key, b"\xfd", "--partition", p, "--server", server.url)
        assert pub.returncode == 0, pub.stderr
    code, out, err = sub.finish()
    assert code == 0, err
    record = json.loads(out)
    b64 = {k: base64.b64decode(record[k]["base64"]) for k in ("key_partition", "key", "payload")}
    assert b64 == {"key_partition": partition, "key": key, "payload": b"\xfd"}
