"""`broky pub`, `broky sub` and `broky info` as real subprocesses against a real server."""

from __future__ import annotations

import base64
import json
import os
import pty
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import broky
from broky.client.commands import DEFAULT_METRICS_PORT
from broky.client.info import Metrics, summary
from broky.protocol.routing import vbucket_of
from tests.support.cli import BROKY, SubProcess, broky_cli
from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess


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


def test_pub_says_what_it_published_unless_quiet(server: ServerProcess) -> None:
    one = broky_cli("pub", "orders.created", "x", "--server", server.url)
    assert one.returncode == 0, one.stderr
    vb = vbucket_of(b"orders.created")
    assert (
        one.stdout
        == f"published 1 message to orders.created (partition orders.created, vbucket {vb})\n".encode()
    )
    many = broky_cli("pub", "orders.created", "--partition", "t1", "--server", server.url, stdin=b"a\nb\nc\n")
    assert many.returncode == 0, many.stderr
    assert (
        many.stdout
        == f"published 3 messages to orders.created (partition t1, vbucket {vbucket_of(b't1')})\n".encode()
    )
    for quiet in ("-q", "--quiet"):
        done = broky_cli("pub", "orders.created", "x", quiet, "--server", server.url)
        assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")


def test_pub_without_payload_refuses_a_terminal_at_once_unless_stdin_is_asked(server: ServerProcess) -> None:
    # stdin a terminal (a pty), no PAYLOAD: exit 2 at once, not a silent wait for lines
    main, tty = pty.openpty()
    try:
        started = time.monotonic()
        done = subprocess.run(
            [*BROKY, "pub", "t.k", "--server", server.url],
            stdin=tty, capture_output=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr == b"broky pub: give a PAYLOAD, or pipe the lines to publish on stdin " + (
            b"(--stdin reads them from the terminal)\n"
        )
        assert done.stdout == b""
        assert time.monotonic() - started < 20  # (start-up only: nothing waited for input)
        # --stdin: the terminal's lines are published, up to an end of file (Ctrl-D)
        os.write(main, b"one\ntwo\n\x04")
        done = subprocess.run(
            [*BROKY, "pub", "t.k", "--stdin", "--server", server.url],
            stdin=tty, capture_output=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(b"published 2 messages to t.k "), done.stdout
    finally:
        os.close(main)
        os.close(tty)


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


def test_info_summarizes_the_server_for_a_person(server: ServerProcess, subs: list[SubProcess]) -> None:
    subs.append(SubProcess("orders.>", "--server", server.url))
    subs.append(SubProcess("jobs.>", "--group", "crunchers", "--server", server.url))
    for key, body in (
        (b"orders.created", b"1\n2\n3\n"),
        (b"nobody.listens", b"1\n2\n"),
        (b"jobs.a", b"1\n"),
    ):
        pub = broky_cli("pub", key, "--server", server.url, stdin=body)
        assert pub.returncode == 0, pub.stderr
    metrics = f"127.0.0.1:{server.metrics_port}"
    done = broky_cli("info", "--server", server.url, "--metrics", metrics, "--interval", "0.2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert lines[:7] == [
        f"server    {server.url}",
        f"version   {broky.__version__}",
        "map       version 1, 1024 vbuckets, 1 node(s)",
        f"node      {lines[3].split()[1]} at 127.0.0.1:{server.port}, workers 2",
        "  worker 0: 512 vbuckets: 0-511",
        "  worker 1: 512 vbuckets: 512-1023",
        "limits    max_frame_bytes 1048576, max_pending_bytes 4194304",
    ]
    assert re.fullmatch(
        rf"live      from {metrics}: 2 of 2 workers up, rates over the last 0\.\d s", lines[7]
    )
    assert lines[8].split() == [
        "worker", "up", "vbuckets", "conns", "subs", "groups", "in/s", "out/s", "dropped/s", "memory"
    ]  # fmt: skip
    for w, line in enumerate(lines[9:11]):
        # each `broky sub` holds a connection and a subscription on each worker (every vbucket)
        cells = line.split()
        assert cells[:6] == [str(w), "yes", "512", "2", "2", "1"], line
        assert cells[-1] == "MiB" and 10 < float(cells[-2]) < 1000, line
    # the counters since start, and every loss by its reason; nothing moves during the interval
    clients = re.fullmatch(r"clients   4 connections \((\d+) since start\).*", lines[13])
    assert clients is not None, lines
    since = int(clients.group(1))
    assert since > 4  # the two `broky sub`, the three `broky pub` (and this `info`) on one worker or both
    assert lines[11:] == [
        "messages  published 6 (0/s), delivered 4 (0/s), replayed 0",
        "dropped   2 (0/s): no_subscribers 2",
        f"clients   4 connections ({since} since start); over the workers 4 subscriptions, 4 topics",
        "groups    over the workers 2 groups, 2 members, 0 messages in flight; acked 0, redelivered 0, "
        "dead-lettered 0",
        "latency   no deliveries in the interval",
    ], lines


def test_info_rates_are_over_the_interval() -> None:
    def page(published: int, delivered: int, slow: int, latency: float) -> str:
        return (
            f'broky_worker_up{{worker="0"}} 1.0\n'
            f'broky_messages_published_total{{worker="0"}} {published}.0\n'
            f'broky_messages_delivered_total{{worker="0"}} {delivered}.0\n'
            f'broky_messages_dropped_total{{reason="slow_consumer",worker="0"}} {slow}.0\n'
            f'broky_broker_latency_seconds_sum{{worker="0"}} {latency}\n'
            f'broky_broker_latency_seconds_count{{worker="0"}} {delivered}.0\n'
            f'broky_broker_latency_seconds_bucket{{le="0.001",worker="0"}} {delivered}.0\n'
        )

    before = Metrics(page(1000, 2000, 0, 1.0), at=10.0)
    after = Metrics(page(1500, 3000, 5, 1.5), at=12.0)  # 2 s later
    lines = summary(before, after, "h:9477")
    assert lines[0] == "live      from h:9477: 1 of 1 workers up, rates over the last 2.0 s"
    assert lines[2].split()[6:9] == ["250", "500", "2.5"]  # in/s, out/s, dropped/s of worker 0
    assert lines[3] == "messages  published 1,500 (250/s), delivered 3,000 (500/s), replayed 0"
    assert lines[4] == "dropped   5 (2.5/s): slow_consumer 5"
    assert lines[-1] == "latency   broker mean 0.5 ms over 1,000 deliveries"


def test_info_json_prints_everything(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--auth-token", "tok")
    pub = broky_cli("pub", "k", "x", "--server", server.url, "--auth-token", "tok")
    assert pub.returncode == 0, pub.stderr
    metrics = f"127.0.0.1:{server.metrics_port}"
    done = broky_cli("info", "--server", server.url, "--auth-token", "tok", "--metrics", metrics, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["server"] == server.url and out["version"] == broky.__version__
    assert out["limits"] == {"max_frame_bytes": 1048576, "max_pending_bytes": 4194304}
    assert out["map"]["version"] == 1 and not out["map"]["moving"]
    (node,) = out["map"]["nodes"]
    assert node["node_id"] == out["node_id"] and node["port"] == server.port
    assert node["workers"] == [
        {"worker": 0, "vbuckets": [[0, 511]]},
        {"worker": 1, "vbuckets": [[512, 1023]]},
    ]
    # /stats whole (it needs the token): every counter, not a summary
    assert out["metrics_address"] == metrics and "error" not in out
    assert out["stats"]["totals"]["messages_published"] == 1
    assert out["stats"]["totals"]["dropped"]["no_subscribers"] == 1
    assert len(out["stats"]["workers"]) == 2 and "acks" in out["stats"]["workers"][0]


def test_info_json_says_which_counters_it_could_not_read(server: ServerProcess, unused_port: int) -> None:
    done = broky_cli("info", "--server", server.url, "--metrics", f"127.0.0.1:{unused_port}", "--json")
    assert done.returncode == 1
    out = json.loads(done.stdout)  # what could be read: still one JSON object
    assert out["map"]["version"] == 1 and out["stats"] is None
    assert out["error"].startswith(f"no counters from 127.0.0.1:{unused_port}: ")
    assert done.stderr.decode() == f"broky info: error: {out['error']}\n"


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


LOADS = """
import sys
from broky import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["pub", "--help"], ["sub", "--help"], ["info", "--help"], ["pub", "a.*", "x"]]
)
def test_help_and_argument_errors_load_neither_asyncio_nor_the_sdk(args: list[str]) -> None:
    # the start-up of `broky pub --help` or of a refused argument: argparse, not the SDK
    done = subprocess.run(
        [sys.executable, "-c", LOADS, *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    loaded = set(done.stdout.split("\n")[-2].split())
    assert "broky.cli" in loaded and "broky.client.cli" in loaded, done.stdout
    assert not loaded & {"asyncio", "ssl", "uvloop", "broky.client.client", "broky.client.sync"}, sorted(
        loaded & {"asyncio", "ssl", "uvloop", "broky.client.client", "broky.client.sync"}
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pub", "k", "x", "--server", "nats://h:1"], b"argument --server: unsupported scheme"),
        (["sub", "a..b", "--server", "127.0.0.1:1"], b"argument PATTERN: empty token in pattern 'a..b'"),
        (["sub", "a.>.b"], b"argument PATTERN: '>' must be the last token in 'a.>.b'"),
        (["sub", "a.b*"], b"argument PATTERN: wildcards must be whole tokens in 'a.b*'"),
        (["sub", "k", "--count", "0"], b"argument --count: must be at least 1, not 0"),
        (["sub", "k", "--count", "many"], b"argument --count: 'many' is not a whole number"),
        (["pub", "", "x"], b"argument KEY: must not be empty"),
        (["pub", "a.*", "x"], b"argument KEY: 'a.*' has a wildcard token"),
        (["pub", "a.>", "x"], b"argument KEY: 'a.>' has a wildcard token"),
        (["pub", "a..b", "x"], b"argument KEY: 'a..b' has an empty token"),
        (["pub", "k.", "x"], b"argument KEY: 'k.' has an empty token"),
        (["pub", "k", "x", "--partition", ""], b"argument --partition: must not be empty"),
        (["pub", "k", "x", "--connect-timeout", "-1"], b"argument --connect-timeout: must be a positive"),
        (["info", "--connect-timeout", "nan"], b"argument --connect-timeout: must be a positive"),
        (["sub", "k", "--no-such-option"], b"broky sub: error: unrecognized arguments: --no-such-option"),
        (["pub", "k", "x", "y"], b"broky pub: error: unrecognized arguments: y"),
        (["cluster", "status", "--no-such-option"], b"broky cluster status: error: unrecognized arguments"),
        (["--no-such-option", "pub", "k", "x"], b"broky: error: unrecognized arguments: --no-such-option"),
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
    assert re.match(rb"broky( [a-z]+)*: error: ", done.stderr), done.stderr
    assert b" b'" not in done.stderr and b"_" not in done.stderr, done.stderr  # no reprs, no names
    assert done.stdout == b""


def test_no_server_is_a_clear_error_at_once(unused_port: int) -> None:
    # a refused connection is an answer: nothing listens there. The 5 s timeout is not waited.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other = s.getsockname()[1]
    for command, seeds in (
        (["pub", "k", "x"], [unused_port]),
        (["sub", "k"], [unused_port, other]),
        (["info"], [unused_port]),
    ):
        tried = ", ".join(f"127.0.0.1:{port}" for port in seeds)
        shown = ", ".join(f"broky://127.0.0.1:{port}" for port in seeds)  # the scheme used
        began = time.monotonic()
        done = broky_cli(*command, "--server", tried.replace(" ", ""))
        took = time.monotonic() - began
        assert done.returncode == 1
        expected = (
            f"broky {command[0]}: error: connection refused at {shown}: no server listens there "
            "(is `broky serve` running? `./run serve` starts one)\n"
        )
        assert done.stderr == expected.encode(), done.stderr
        assert took < 4, took  # an interpreter's start and a refusal, not the 5 s timeout


def test_an_address_that_does_not_answer_gets_the_whole_timeout() -> None:
    # a listening socket nobody accepts from: the TCP connection is made, no Welcome comes
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        began = time.monotonic()
        done = broky_cli("pub", "k", "x", "--server", address, "--connect-timeout", "1")
        took = time.monotonic() - began
    assert done.returncode == 1
    assert f"cannot connect to broky://{address} within 1 s".encode() in done.stderr, done.stderr
    assert b"broky serve" not in done.stderr and done.stderr.count(b"\n") == 1, done.stderr
    assert took >= 1, took


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
