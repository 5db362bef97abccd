"""`broky serve` settings (flags, BROKY_* variables, defaults) and the Dockerfile."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from broky.server import config
from broky.server.config import DEFAULT_METRICS_PORT, DEFAULT_PORT, ServerConfig
from tests.support.paths import ROOT
from tests.support.wire import Wire


def parse(
    argv: list[str], env: dict[str, str] | None = None, warnings: list[str] | None = None
) -> ServerConfig:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    sink = [] if warnings is None else warnings
    return config.from_args(parser.parse_args(argv), env or {}, warn=sink.append)


def test_defaults_need_no_flags() -> None:
    cfg = parse([])
    assert (cfg.host, cfg.port, cfg.metrics_port) == ("127.0.0.1", 4777, 9477)
    assert cfg.workers >= 1 and cfg.auth_token is None
    assert cfg.max_frame_bytes == 1 << 20 and cfg.max_pending_bytes == 4 << 20
    assert cfg.replay_bytes == 192 << 20
    assert (cfg.hello_timeout, cfg.frame_timeout, cfg.slow_consumer_deadline) == (5.0, 10.0, 10.0)


def test_the_pending_bound_defaults_higher_without_a_replay_buffer_to_lag_on() -> None:
    # With replay a reader past its bound lags (no loss); without, the bound is all a burst has.
    assert parse(["--replay-bytes", "0"]).max_pending_bytes == 64 << 20
    assert parse([], {"BROKY_REPLAY_BYTES": "0"}).max_pending_bytes == 64 << 20
    assert parse(["--replay-bytes", "0", "--max-pending-bytes", "2M"]).max_pending_bytes == 2 << 20
    assert parse(["--replay-bytes", "0"], {"BROKY_MAX_PENDING_BYTES": "8M"}).max_pending_bytes == 8 << 20
    assert parse(["--replay-bytes", "32M"]).max_pending_bytes == 4 << 20


def test_connection_limits_and_the_reply_bound() -> None:
    cfg = parse([])
    assert (cfg.max_subscriptions, cfg.max_subscription_bytes) == (10_000, 2 << 20)
    assert cfg.max_reply_bytes == 1 << 20
    cfg = parse(
        ["--max-subscriptions", "5", "--max-subscription-bytes", "64K"], {"BROKY_MAX_REPLY_BYTES": "8K"}
    )
    assert (cfg.max_subscriptions, cfg.max_subscription_bytes, cfg.max_reply_bytes) == (5, 64 << 10, 8 << 10)
    # The default reply bound follows a smaller pending bound; an explicit one may not exceed it.
    assert parse(["--max-pending-bytes", "64K"]).max_reply_bytes == 64 << 10
    with pytest.raises(ValueError, match="--max-reply-bytes cannot exceed --max-pending-bytes"):
        parse(["--max-pending-bytes", "64K", "--max-reply-bytes", "128K"])
    with pytest.raises(SystemExit):
        parse(["--max-subscriptions", "0"])


def test_the_handshake_rate() -> None:
    cfg = parse([])
    assert (cfg.handshake_rate, cfg.handshake_burst) == (500.0, 1_000)
    cfg = parse(["--handshake-rate", "0.5", "--handshake-burst", "7"])
    assert (cfg.handshake_rate, cfg.handshake_burst) == (0.5, 7)
    assert parse(["--handshake-rate", "0"]).handshake_rate == 0.0
    for bad in ("-1", "nan", "inf", "fast"):
        with pytest.raises(SystemExit):
            parse(["--handshake-rate", bad])


def test_the_http_body_bounds() -> None:
    cfg = parse([])
    assert (cfg.http_max_body, cfg.http_body_memory) == (16 << 20, 64 << 20)
    # The default body memory follows a larger body bound; an explicit one may not be smaller.
    assert parse(["--http-max-body", "100M"]).http_body_memory == 100 << 20
    with pytest.raises(ValueError, match="--http-body-memory cannot be less than --http-max-body"):
        parse(["--http-max-body", "2M", "--http-body-memory", "1M"])


def test_memory_budget_and_connection_limits() -> None:
    cfg = parse([])
    assert cfg.memory_budget == 1 << 30
    assert (cfg.max_connections, cfg.max_connections_per_address) == (10_000, 1_000)
    env = {"BROKY_MEMORY_BUDGET": "256M", "BROKY_MAX_CONNECTIONS_PER_ADDRESS": "0"}
    cfg = parse(["--max-connections", "0", "--workers", "2"], env)
    assert (cfg.memory_budget, cfg.max_connections, cfg.max_connections_per_address) == (256 << 20, 0, 0)
    # A share smaller than one connection's bound works, but is worth a word.
    warnings: list[str] = []
    parse(["--memory-budget", "6M", "--workers", "2"], warnings=warnings)
    assert len(warnings) == 1 and "--max-pending-bytes" in warnings[0], warnings
    warnings.clear()
    parse(["--memory-budget", "64M", "--workers", "1"], warnings=warnings)
    assert warnings == []
    with pytest.raises(ValueError, match="--memory-budget must give each of the 4 workers"):
        parse(["--memory-budget", "3", "--workers", "4", "--max-pending-bytes", "1"])
    for bad in (
        ["--max-connections", "-1"],
        ["--max-connections-per-address", "x"],
        ["--memory-budget", "0"],
    ):
        with pytest.raises(SystemExit):
            parse(bad)


def test_cluster_settings() -> None:
    cfg = parse([])
    assert cfg.cluster is None  # a single node
    assert (cfg.lease_ttl, cfg.move_timeout, cfg.drain_timeout, cfg.drain_linger) == (5, 10.0, 20.0, 5.0)
    env = {
        "BROKY_CLUSTER": "etcd://e1:2379,e2/prod",
        "BROKY_NODE_ID": "n1",
        "BROKY_LEASE_TTL": "3",
        "BROKY_DRAIN_LINGER": "0",
    }
    cfg = parse(["--move-timeout", "2.5", "--drain-timeout", "9"], env)
    assert (cfg.cluster, cfg.node_id, cfg.lease_ttl) == ("etcd://e1:2379,e2/prod", "n1", 3)
    assert (cfg.move_timeout, cfg.drain_timeout, cfg.drain_linger) == (2.5, 9.0, 0.0)
    assert parse(["--drain-linger", "1.5"], env).drain_linger == 1.5
    assert parse(["--cluster", "etcd://x:1"], env).cluster == "etcd://x:1"  # the flag wins
    with pytest.raises(ValueError, match="BROKY_CLUSTER"):
        parse([], {"BROKY_CLUSTER": "http://e1:2379"})
    with pytest.raises(SystemExit):
        parse(["--lease-ttl", "0"])
    with pytest.raises(SystemExit):
        parse(["--drain-linger", "-1"])


def test_environment_then_flags() -> None:
    env = {
        "BROKY_PORT": "5000",
        "BROKY_MAX_PENDING_BYTES": "16M",
        "BROKY_AUTH_TOKEN": "t",
        "BROKY_WORKERS": "3",
    }
    cfg = parse([], env)
    assert (cfg.port, cfg.max_pending_bytes, cfg.auth_token, cfg.workers) == (5000, 16 << 20, "t", 3)
    cfg = parse(["--port", "6000", "--max-pending-bytes", "512K"], env)
    assert (cfg.port, cfg.max_pending_bytes, cfg.workers) == (6000, 512 << 10, 3)


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--workers", "0"],
        ["--max-pending-bytes", "lots"],
        ["--slow-consumer-deadline", "0"],
    ],
)
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)


def test_bad_environment_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="BROKY_PORT='http'"):
        parse([], {"BROKY_PORT": "http"})
    assert parse(["--port", "5000"], {"BROKY_PORT": "http"}).port == 5000  # the flag wins, unread


def test_a_bad_variable_breaks_only_serve() -> None:
    env = {**os.environ, "BROKY_PORT": "http", "BROKY_MAX_PENDING_BYTES": "lots"}
    for argv in (["pub", "--help"], ["sub", "--help"], ["serve", "--help"], ["--help"]):
        proc = subprocess.run(
            [sys.executable, "-m", "broky", *argv], env=env, capture_output=True, timeout=30
        )
        assert proc.returncode == 0, (argv, proc.stderr)
        assert b"BROKY_PORT" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "broky", "serve", "--workers", "1"], env=env, capture_output=True, timeout=30
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(b"broky serve: error: BROKY_PORT='http' (sets --port): "), proc.stderr
    assert b"Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["BROKY_PORT", "BROKY_METRICS_PORT"])
def test_a_kubernetes_service_link_is_ignored_with_a_warning(name: str) -> None:
    # Kubernetes sets BROKY_PORT=tcp://<cluster ip>:<service port> for a Service named
    # "broky" (BROKY_METRICS_PORT for "broky-metrics"): not this process's port.
    warnings: list[str] = []
    cfg = parse([], {name: "tcp://10.96.0.12:80", "BROKY_WORKERS": "3"}, warnings)
    assert (cfg.port, cfg.metrics_port, cfg.workers) == (DEFAULT_PORT, DEFAULT_METRICS_PORT, 3)
    assert len(warnings) == 1 and f"ignoring {name}='tcp://10.96.0.12:80'" in warnings[0]
    cfg = parse(["--port", "5000", "--metrics-port", "5001"], {name: "tcp://10.96.0.12:80"}, warnings)
    assert (cfg.port, cfg.metrics_port) == (5000, 5001) and len(warnings) == 1  # flags: not even read


def serve_refuses(*argv: str, env: dict[str, str] | None = None) -> str:
    """The one line `broky serve ARGV` (a real process) exits 2 with, before it serves."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BROKY_")}
    cmd = [sys.executable, "-m", "broky", "serve", "--port", "0", "--metrics-port", "0", *argv]
    proc = subprocess.run(cmd, capture_output=True, timeout=30, env={**clean, **(env or {})})
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.decode()
    assert line.count("\n") == 1 and line.startswith("broky serve: error: "), line
    return line.removeprefix("broky serve: error: ").rstrip("\n")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--log-format", "xml"], {}, "argument --log-format: expected text or json, got 'xml'"),
        (
            ["--log-level", "loud"],
            {},
            "argument --log-level: expected debug, info, warning or error, got 'loud'",
        ),
        (["--workers", "abc"], {}, "argument --workers: expected a whole number >= 1, got 'abc'"),
        (
            ["--port", "http"],
            {},
            "argument --port: expected a TCP port (0-65535; 0: any free port), got 'http'",
        ),
        (
            ["--hello-timeout", "soon"],
            {},
            "argument --hello-timeout: expected a number of seconds > 0, got 'soon'",
        ),
        (["--hello-timeout", "nan"], {}, "argument --hello-timeout: must be > 0 seconds, got nan"),
        (["--no-such-option"], {}, "unrecognized arguments: --no-such-option"),
        (
            [],
            {"BROKY_WORKERS": "zz"},
            "BROKY_WORKERS='zz' (sets --workers): expected a whole number >= 1, got 'zz'",
        ),
        (
            [],
            {"BROKY_LOG_LEVEL": "loud"},
            "BROKY_LOG_LEVEL='loud' (sets --log-level): expected debug, info, warning or error, got 'loud'",
        ),
    ],
)
def test_a_bad_setting_is_named_with_what_it_takes(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    assert serve_refuses(*argv, env=env) == expected


def test_log_level_and_format_take_any_case() -> None:
    cfg = parse(["--log-level", "DEBUG"], {"BROKY_LOG_FORMAT": "JSON"})
    assert (cfg.log_level, cfg.log_format) == ("debug", "json")


def test_advertised_host() -> None:
    assert ServerConfig(host="10.1.2.3").advertised_host() == "10.1.2.3"
    assert ServerConfig(host="0.0.0.0", advertise_host="broky.example").advertised_host() == "broky.example"
    assert ServerConfig(host="0.0.0.0").advertised_host() not in ("0.0.0.0", "")


def test_serve_help_lists_every_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "broky", "serve", "--help"], capture_output=True, timeout=30)
    assert proc.returncode == 0
    flags = (
        "host port workers metrics-port auth-token max-frame-bytes max-pending-bytes max-reply-bytes "
        "max-subscriptions max-subscription-bytes memory-budget max-connections max-connections-per-address "
        "log-level log-format cluster lease-ttl move-timeout drain-timeout drain-linger"
    )
    for flag in flags.split():
        assert f"--{flag} ".encode() in proc.stdout


def test_environment_reaches_a_real_server_and_json_logs(start_server: Any) -> None:
    server = start_server(workers=1, env={"BROKY_MAX_PENDING_BYTES": "1M", "BROKY_LOG_FORMAT": "json"})
    assert b"workers 1," in server.ready_line
    with Wire.hello(server.address) as w:
        assert w.welcome is not None and w.welcome.max_pending_bytes == 1 << 20
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert any(line["msg"].startswith("worker 0 ready") for line in lines)
    assert {"ts", "level", "process", "logger", "msg"} <= set(lines[0])


def test_dockerfile_matches_the_cli() -> None:
    """What the Dockerfile says; tests/repo/test_image.py builds and runs it."""
    text = (ROOT / "Dockerfile").read_text()
    # The python image by default; scripts/build-image passes a Debian base of its own.
    assert re.search(r"^ARG BASE=docker\.io/library/python:3\.11-slim$", text, re.M)
    assert re.findall(r"^FROM (.+)$", text, re.M) == ["${BASE} AS build", "${BASE}"]
    # The wheel is built where there is a compiler (and Python.h: Debian's python3-dev),
    # holds the compiled fast path, and goes with the cluster extra into /opt/broky.
    assert re.search(r"pkgs=\"gcc libc6-dev\"", text)
    assert re.search(r"pkgs=\"\$pkgs python3-dev python3-venv\"", text)
    assert re.search(r"^COPY pyproject\.toml ", text, re.M)
    assert re.search(r"\['optional-dependencies'\]\['cluster'\]", text)  # the image can join a cluster
    assert re.search(r"^RUN /opt/broky/bin/pip wheel .*\n.*endswith\('\.so'\)", text, re.M)
    assert re.search(r"^COPY --from=build /opt/broky /opt/broky$", text, re.M)
    user = re.search(r"^USER (\S+)", text, re.M)
    assert user and user.group(1) not in ("root", "0")
    assert re.search(r"^RUN useradd .*\b" + user.group(1) + r"$", text, re.M)
    expose = re.search(r"^EXPOSE (.+)$", text, re.M)
    assert expose and expose.group(1).split() == [str(DEFAULT_PORT), str(DEFAULT_METRICS_PORT)]
    entry = re.search(r"^ENTRYPOINT (.+)$", text, re.M)
    assert entry and json.loads(entry.group(1)) == ["broky", "serve", "--host", "0.0.0.0"]
    health = re.search(r"^HEALTHCHECK (.+?)CMD (\[[^\n]+\])$", text, re.M | re.S)
    assert health
    probe = json.loads(health.group(2))
    assert probe[:2] == ["python", "-c"] and "/healthz" in probe[2] and str(DEFAULT_METRICS_PORT) in probe[2]
    compile(probe[2], "healthcheck", "exec")
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in ignore and "!broky/" in ignore and "!pyproject.toml" in ignore and "!setup.py" in ignore


def test_healthcheck_command_against_a_real_server(start_server: Any) -> None:
    server = start_server(workers=1)
    text = (ROOT / "Dockerfile").read_text()
    health = re.search(r"^HEALTHCHECK .+?CMD (\[[^\n]+\])$", text, re.M | re.S)
    assert health
    probe = json.loads(health.group(1))
    env = {"BROKY_METRICS_PORT": str(server.metrics_port)}
    ok = subprocess.run([sys.executable, *probe[1:]], env=env, timeout=30, capture_output=True)
    assert ok.returncode == 0
    server.stop()
    down = subprocess.run([sys.executable, *probe[1:]], env=env, timeout=30, capture_output=True)
    assert down.returncode != 0
