"""Which implementation of the fan-out fast path this process runs.

`Shard.feed` (broky.server.shard.core) is written in Python and stays the
reference. Its inner loop over canonical Messages with a cached route has a
compiled twin, `broky.server.shard._feedscan` (a small C extension built by
`pip install` when a C compiler is there; see its header). The twin is used
when it was built and matches this code; otherwise the worker runs the pure
Python loop, which handles every frame the same way at several times the CPU
per message, and the server says so in a warning when it starts.
BROKY_PURE_PYTHON=1 chooses the pure-Python loop on purpose (to compare the two).

The twin takes every position of the canonical layout from its owner,
broky.protocol.layout, handed to its configure() here at import; a twin that
refuses that layout (a change it cannot hold) leaves the pure-Python loop in
charge, and says why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from broky.protocol import layout
from broky.protocol.framing import MIN_FRAME_SIZE

ENV_PURE = "BROKY_PURE_PYTHON"
VERSION = 8  # the _feedscan.c interface this code calls (its FEEDSCAN_VERSION)

# scan(data, pos, buf, t0, routes, max_frame, runs, seqs, log, index, seg)
#   -> (pos, buf, published, unmatched)
Scan = Callable[
    [bytes, int, Any, int, dict[Any, Any], int, list[Any], bytearray, Any, Any, int],
    tuple[int, Any, int, int],
]
# settle(log, index): the replay buffer's log into its index (broky.server.shard.replay)
Settle = Callable[[bytearray, list[bytearray]], None]
# gather(entries, segments, room, first) -> (frames joined, how many): a lagging reader's batch
# from the replay buffer (broky.server.shard.replay, ReplayBuffer.gather)
Gather = Callable[[bytes, dict[int, Any], int, bool], tuple[bytes, int]]
# note(buf, start, end, owed, epochs): a lagging connection's refused offsets noted as ranges
# per vbucket (broky.server.shard.lag, Lag.missed)
Note = Callable[[bytearray, int, int, dict[int, list[list[int]]], dict[int, int]], None]


def pure_requested() -> bool:
    return os.environ.get(ENV_PURE, "") not in ("", "0")


def _load() -> tuple[Scan | None, Settle | None, Gather | None, Note | None, str]:
    if pure_requested():
        return None, None, None, None, f"pure Python ({ENV_PURE} is set)"
    try:
        from broky.server.shard import _feedscan
    except ImportError as exc:
        return (
            None,
            None,
            None,
            None,
            f"pure Python: the compiled fast path is not built ({exc}); reinstall with a C compiler",
        )
    if getattr(_feedscan, "VERSION", None) != VERSION:
        return (
            None,
            None,
            None,
            None,
            "pure Python: the compiled fast path is out of date; reinstall (pip install -e .)",
        )
    try:
        _feedscan.configure(layout, MIN_FRAME_SIZE)
    except ValueError as exc:
        return None, None, None, None, f"pure Python: {exc}"
    return _feedscan.scan, _feedscan.settle, _feedscan.gather, _feedscan.note, "compiled"


compiled_scan, compiled_settle, compiled_gather, compiled_note, description = _load()


def warning() -> str | None:
    """What the server should warn about at start, if anything."""
    if compiled_scan is None and not pure_requested():
        return (
            f"fan-out runs in {description}: several times the CPU per message. "
            "The install could not build broky.server.shard._feedscan (needs gcc and the Python headers)."
        )
    return None
