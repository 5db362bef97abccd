"""Quiet, honest loss reports: `LossLog`.

A subscriber that falls behind in a burst can be told of losses hundreds of
times a second (a LossNotice per drained backlog, a report per burst of local
drops). Each is counted at once (ClientStats, the subscription's `dropped`);
what is *logged* is at most one line per source every `interval` seconds:
the count since the previous line and the running total. The first loss of a
source is logged at once; later ones within the interval wait for a timer,
so a burst of any length costs one line now and one line later, and the last
count is never kept back longer than the interval. `close` writes what is
still unreported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

LOSS_LOG_INTERVAL = 5.0  # seconds between two lines about the same source


@dataclass
class _Source:
    label: str
    noun: tuple[str, str] = ("message lost", "messages lost")  # one, many
    total: int = 0
    unreported: int = 0
    last: float = float("-inf")  # when its last line was written
    timer: asyncio.TimerHandle | None = None


class LossLog:
    """Loss counts per source (a subscription, a connection and reason), logged sparingly."""

    def __init__(
        self,
        emit: Callable[[str], None],
        interval: float = LOSS_LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.emit = emit
        self.interval = interval
        self.clock = clock
        self.sources: dict[Hashable, _Source] = {}

    def add(
        self, key: Hashable, label: str, lost: int, noun: tuple[str, str] = ("message lost", "messages lost")
    ) -> None:
        """`lost` more messages of source `key` (described by `label`) were lost;
        `noun` names what is counted (one, many), if not lost messages."""
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = _Source(label, noun)
        source.total += lost
        source.unreported += lost
        now = self.clock()
        if now - source.last >= self.interval:
            self._write(source, now)
        elif source.timer is None:
            loop = asyncio.get_running_loop()
            source.timer = loop.call_later(source.last + self.interval - now, self._due, source)

    def _due(self, source: _Source) -> None:
        source.timer = None
        self._write(source, self.clock())

    def _write(self, source: _Source, now: float) -> None:
        if not source.unreported:
            return
        lost = f"{source.unreported:,} {source.noun[source.unreported != 1]}"
        if source.unreported == source.total:
            self.emit(f"{source.label}: {lost}")
        else:
            self.emit(f"{source.label}: {lost} since the last report, {source.total:,} in all")
        source.unreported = 0
        source.last = now

    def close(self) -> None:
        """Write what is still unreported; stop the timers."""
        now = self.clock()
        for source in self.sources.values():
            if source.timer is not None:
                source.timer.cancel()
                source.timer = None
            self._write(source, now)


__all__ = ["LOSS_LOG_INTERVAL", "LossLog"]
