"""Server logs: one line per event in both formats, --log-level honoured.

The unit tests configure this process's logging with `setup_logging`; the
integration tests read the stderr of a real `broky serve`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop

from broky.errors import ErrorCode
from broky.protocol import Error
from broky.server.config import ServerConfig
from broky.server.logs import Throttle, setup_logging
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

Setup = Callable[[ServerConfig, str], None]


@pytest.fixture
def configure() -> Iterator[Setup]:
    """setup_logging for this test only: every global it changes is restored."""
    root, broky = logging.getLogger(), logging.getLogger("broky")
    saved = (root.level, broky.handlers[:], broky.level, broky.propagate, sys.excepthook, sys.unraisablehook)
    added: list[logging.Handler] = []

    def setup(config: ServerConfig, role: str) -> None:
        setup_logging(config, role)
        added.extend(root.handlers)

    yield setup
    for handler in added:
        root.removeHandler(handler)
    logging.captureWarnings(False)
    root.level, broky.handlers[:], broky.level, broky.propagate, sys.excepthook, sys.unraisablehook = saved


def _events(log: logging.Logger) -> None:
    log.debug("not shown at info")
    log.warning("connection %d from %s: %s; closing", 7, "127.0.0.1:5", "MALFORMED_FRAME")
    try:
        raise ZeroDivisionError("our own bug")
    except ZeroDivisionError:
        log.exception("handler failed\nwith a second line")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_line_per_event(configure: Setup, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    configure(ServerConfig(log_format=fmt, log_level="info"), "worker-3")
    _events(logging.getLogger("broky.test"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines  # the debug line is filtered, the traceback stays on its line
    if fmt == "json":
        warning, error = (json.loads(ln) for ln in lines)
        assert warning["level"] == "warning" and warning["process"] == "worker-3" and "exc" not in warning
        assert warning["msg"] == "connection 7 from 127.0.0.1:5: MALFORMED_FRAME; closing"
        assert error["level"] == "error" and "ZeroDivisionError: our own bug" in error["exc"]
    else:
        assert " WARNING worker-3 broky.test: connection 7 from 127.0.0.1:5: MALFORMED_FRAME" in lines[0]
        assert " ERROR worker-3 " in lines[1] and "\\nTraceback" in lines[1] and "our own bug" in lines[1]


def test_debug_level_shows_debug(configure: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    configure(ServerConfig(log_level="debug"), "master")
    _events(logging.getLogger("broky.test"))
    assert len(capsys.readouterr().err.splitlines()) == 3


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_exception_in_an_event_loop_callback_is_one_line(
    configure: Setup, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    configure(ServerConfig(log_format=fmt), "worker-0")

    async def main() -> None:
        asyncio.get_running_loop().call_soon(lambda: 1 / 0)
        await asyncio.sleep(0.01)

    uvloop.run(main())  # the server's loop: uvloop reports through the `asyncio` logger
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    if fmt == "json":
        record = json.loads(lines[0])
        assert record["logger"] == "asyncio" and record["level"] == "error"
        assert record["msg"].startswith("Exception in callback") and "ZeroDivisionError" in record["exc"]
    else:
        assert " ERROR worker-0 asyncio: Exception in callback" in lines[0]
        assert "\\nTraceback" in lines[0] and "ZeroDivisionError" in lines[0]


def test_an_uncaught_exception_is_one_line(configure: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    configure(ServerConfig(log_format="json"), "master")
    try:
        raise RuntimeError("escaped")
    except RuntimeError as exc:
        sys.excepthook(RuntimeError, exc, exc.__traceback__)
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["level"] == "critical" and record["msg"] == "uncaught exception: RuntimeError: escaped"
    assert "Traceback" in record["exc"]


def test_throttle_allows_one_event_per_key_and_interval() -> None:
    t = Throttle(10.0, max_keys=4)
    assert t.allow("a", now=0.0) == 0
    assert t.allow("a", now=1.0) is None
    assert t.allow("a", now=9.9) is None
    assert t.allow("b", now=2.0) == 0  # another key has its own allowance
    assert t.allow("a", now=10.0) == 2  # allowed again, with the count of those suppressed
    assert t.allow("a", now=11.0) is None
    assert t.allow("a", now=25.0) == 1
    for i in range(100):  # memory stays bounded; a forgotten key is allowed again
        assert t.allow(("k", i), now=30.0) == 0
        assert len(t._last) <= 4


# ---------------------------------------------------------------- a real server

# Run first in every interpreter of the server: schedule a callback that raises
# as soon as the event loop (uvloop.run, in the master and in each worker) starts.
BUGGY_CALLBACK = """\
import sys
if "-m" in sys.orig_argv and sys.orig_argv[sys.orig_argv.index("-m") + 1].startswith("broky"):
    import asyncio
    import uvloop

    _run = uvloop.run

    def run(main, **kwargs):
        async def with_a_bug():
            asyncio.get_running_loop().call_soon(lambda: 1 / 0)
            return await main

        return _run(with_a_bug(), **kwargs)

    uvloop.run = run
"""


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line parsed as one JSON object (fails on any other line)."""
    return [json.loads(line) for line in text.splitlines()]


def test_every_stderr_line_of_a_json_server_is_json(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text(BUGGY_CALLBACK)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    server = start_server("--log-format", "json", env={"PYTHONPATH": path})
    deadline = time.monotonic() + 5
    while sum("ZeroDivisionError" in r.get("exc", "") for r in _json_lines(server.log())) < 3:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    # The port is taken: one JSON line, nothing else.
    cmd = [sys.executable, "-m", "broky", "serve", "--port", str(server.port), "--metrics-port", "0"]
    busy = subprocess.run([*cmd, "--log-format", "json"], capture_output=True, timeout=30)
    assert busy.returncode == 1
    (refused,) = _json_lines(busy.stderr.decode())
    assert refused["level"] == "critical" and refused["msg"].startswith("cannot listen on 127.0.0.1")
    busy = subprocess.run(cmd, capture_output=True, timeout=30)  # text: one plain line
    assert busy.returncode == 1 and len(busy.stderr.splitlines()) == 1
    assert b" CRITICAL master broky.master: cannot listen on 127.0.0.1" in busy.stderr
    server.signal(signal.SIGTERM)
    assert server.wait(10) == 0
    records = _json_lines(server.log())
    bugs = [r for r in records if "ZeroDivisionError" in r.get("exc", "")]
    assert sorted(r["process"] for r in bugs) == ["master", "worker-0", "worker-1"]  # one line each
    assert all(r["logger"] == "asyncio" and r["level"] == "error" for r in bugs)
    assert any(r["msg"].startswith("stopped in") for r in records)


def test_non_fatal_client_errors_are_warned_once_per_connection_and_code(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server("--log-format", "json")
    with Wire.hello(server.address, worker=0, name="clumsy") as clumsy:
        for sid in range(1, 6):
            clumsy.subscribe(sid, b"orders..eu")  # BAD_PATTERN, 5 times
        clumsy.subscribe(10, b"ok")
        for _ in range(3):
            clumsy.subscribe(10, b"ok")  # DUPLICATE_SID, 3 times
        for _ in range(4):
            clumsy.publish(kp_for_worker(1, 2), b"ok", b"x")  # NOT_MY_VBUCKET, 4 times
        frames = clumsy.flush()
        codes = [ErrorCode(f.code) for f in frames if isinstance(f, Error) and not f.fatal]
        assert len(codes) == len(frames) == 12
        with Wire.hello(server.address, worker=0, name="other") as other:
            other.subscribe(1, b"a.>.b")  # another connection: its own warning
            (error,) = other.flush()
            assert isinstance(error, Error) and error.code == ErrorCode.BAD_PATTERN
        clumsy.subscribe(20, b"fine")
        assert clumsy.flush() == []  # non-fatal: the connection still works
    time.sleep(0.1)
    warnings = [r for r in _json_lines(server.log()) if r["level"] == "warning"]
    by_code = {code: [w for w in warnings if f": {code.name}: " in w["msg"]] for code in set(codes)}
    assert {code: len(ws) for code, ws in by_code.items()} == {
        ErrorCode.BAD_PATTERN: 2,  # clumsy's and other's
        ErrorCode.DUPLICATE_SID: 1,
        ErrorCode.NOT_MY_VBUCKET: 1,
    }, warnings
    assert len(warnings) == 4 and all("exc" not in w and w["process"] == "worker-0" for w in warnings)
    assert any("orders..eu" in w["msg"] for w in by_code[ErrorCode.BAD_PATTERN])
