"""Server logs: one line per event in both formats, --log-level honoured."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from broky.server.config import ServerConfig
from broky.server.logs import setup_logging


@pytest.fixture
def broky_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("broky")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logging.getLogger("broky.test")
    logger.handlers[:], logger.level, logger.propagate = saved


def _events(log: logging.Logger) -> None:
    log.debug("not shown at info")
    log.warning("connection %d from %s: %s; closing", 7, "127.0.0.1:5", "MALFORMED_FRAME")
    try:
        raise ZeroDivisionError("our own bug")
    except ZeroDivisionError:
        log.exception("handler failed\nwith a second line")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_line_per_event(
    broky_logger: logging.Logger, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    setup_logging(ServerConfig(log_format=fmt, log_level="info"), "worker-3")
    _events(broky_logger)
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


def test_debug_level_shows_debug(broky_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(ServerConfig(log_level="debug"), "master")
    _events(broky_logger)
    assert len(capsys.readouterr().err.splitlines()) == 3
