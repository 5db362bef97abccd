"""Logging of the server processes: one line per event on stderr, text or JSON.

One event is one line in both formats: a traceback (only ever logged for our
own bugs; a client's mistake is a warning with its reason and no traceback)
stays on the event's line, its line breaks escaped as "\\n" in text and
inside the "exc" string in JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from broky.server.config import ServerConfig


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
        return json.dumps(data)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\\n")


def setup_logging(config: ServerConfig, role: str) -> None:
    """Send the `broky` loggers to stderr in the configured format and level."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(_JsonFormatter(role))
    else:
        fmt = f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s"
        handler.setFormatter(_TextFormatter(fmt))
    logger = logging.getLogger("broky")
    logger.handlers[:] = [handler]
    logger.setLevel(config.log_level.upper())
    logger.propagate = False
