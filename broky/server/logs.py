"""Logging of the server processes: one line per event on stderr, text or JSON.

One event is one line in both formats: a traceback (only ever logged for our
own bugs; a client's mistake is a warning with its reason and no traceback)
stays on the event's line, its line breaks escaped as "\\n" in text and
inside the "exc" string in JSON.

Every record of the process goes through the one handler on the root logger:
the `broky` loggers, the `asyncio` logger (where the event loop, uvloop's too,
reports an exception escaping a callback or a task), `py.warnings`, and the
uncaught exceptions that Python would otherwise print as a multi-line
traceback (`sys.excepthook`, `sys.unraisablehook`). So nothing a running
server writes to stderr escapes the chosen format.

`Throttle` keeps a repeated warning (a client making the same mistake again
and again) to one line per key per interval.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Hashable
from types import TracebackType
from typing import Any

from broky.server.config import ServerConfig

log = logging.getLogger("broky")


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self.role,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            data["exc"] = self.formatStack(record.stack_info)
        return json.dumps(data)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\\n")


def setup_logging(config: ServerConfig, role: str) -> None:
    """Send every logger of this process to stderr in the configured format and level."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(_JsonFormatter(role))
    else:
        fmt = f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s"
        handler.setFormatter(_TextFormatter(fmt))
    level = config.log_level.upper()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    broky = logging.getLogger("broky")
    broky.handlers.clear()
    broky.setLevel(level)
    broky.propagate = True
    logging.captureWarnings(True)
    sys.excepthook = _uncaught
    sys.unraisablehook = _unraisable


def _uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        log.info("interrupted")
        return
    log.critical("uncaught exception: %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb))


def _unraisable(unraisable: Any) -> None:
    what = unraisable.err_msg or "Exception ignored in"
    exc_info = None
    if unraisable.exc_type is not None and unraisable.exc_value is not None:
        exc_info = (unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
    log.error("%s: %r", what, unraisable.object, exc_info=exc_info)


class Throttle:
    """At most one event per key per `interval` seconds; counts the ones it suppressed.

    `allow(key)` returns None to stay silent, else how many events of this key
    were suppressed since the last one allowed. At most `max_keys` keys are
    remembered; beyond that the oldest are forgotten (a forgotten key is
    allowed again), so the memory is bounded whatever the traffic.
    """

    def __init__(self, interval: float, max_keys: int = 1024) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self._last: dict[Hashable, list[float]] = {}  # key -> [time allowed, events suppressed]

    def allow(self, key: Hashable, now: float | None = None) -> int | None:
        if now is None:
            now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            last[1] += 1
            return None
        suppressed = int(last[1]) if last is not None else 0
        if last is None and len(self._last) >= self.max_keys:
            self._forget(now)
        self._last[key] = [now, 0]
        return suppressed

    def _forget(self, now: float) -> None:
        fresh = {k: v for k, v in self._last.items() if now - v[0] < self.interval}
        if len(fresh) >= self.max_keys:  # all recent: drop the older half
            fresh = dict(sorted(fresh.items(), key=lambda kv: kv[1][0])[len(fresh) // 2 :])
        self._last = fresh
