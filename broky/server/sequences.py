"""The sequence of every vbucket a worker owns: its epoch and its next offset.

Theory of operation
-------------------
A message's position is (vbucket, epoch, offset): the worker that owns the
vbucket stamps it when it accepts the message (broky.server.fanout), in place
like ts_broker. Per vbucket the offsets count the accepted messages from 1,
+1 each, no gaps, while the epoch stays the same. The epoch changes whenever
the sequence may have restarted: a worker's new incarnation starts every
vbucket it serves with a new epoch (a random 64-bit number, drawn once per
incarnation), and so does a vbucket taken over after a failure. A planned move
in a cluster continues the sequence on the new owner: same epoch, the next
offset (`resume`).

The state lives in one bytearray of 1024 x 16 bytes (epoch, next offset; u64
little-endian each), so that the compiled twin of the read path can take
offsets from it without a Python call per message (broky.server._feedscan);
`view` is the same memory as 2048 u64 for Python.
"""

from __future__ import annotations

import os

from broky.protocol import VBUCKETS

ENTRY_BYTES = 16  # epoch, next offset


def new_epoch() -> int:
    """A random nonzero 64-bit epoch."""
    while True:
        epoch = int.from_bytes(os.urandom(8), "little")
        if epoch:
            return epoch


class Sequences:
    """Per vbucket: the epoch and next offset of its sequence on this worker."""

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = new_epoch() if epoch is None else epoch  # this incarnation's fresh epoch
        self.state = bytearray(VBUCKETS * ENTRY_BYTES)
        self.view = memoryview(self.state).cast("Q")
        view = self.view
        for vb in range(VBUCKETS):
            view[2 * vb] = self.epoch
            view[2 * vb + 1] = 1
        # The last ts_broker stamped: the read path never stamps an earlier one, so
        # ts_broker never decreases on a worker (a start from a time is a binary search).
        self.last_ts = 0

    def epoch_of(self, vb: int) -> int:
        return int(self.view[2 * vb])

    def next_of(self, vb: int) -> int:
        """The offset the next accepted message of vb gets."""
        return int(self.view[2 * vb + 1])

    def take(self, vb: int) -> int:
        """The offset of an accepted message of vb (the next, counted)."""
        view = self.view
        at = 2 * vb + 1
        offset = view[at]
        view[at] = offset + 1
        return int(offset)

    def restart(self, vb: int) -> None:
        """vb's sequence starts again here, under a new epoch (it was taken over
        without its history, e.g. after a failover)."""
        self.view[2 * vb] = new_epoch()
        self.view[2 * vb + 1] = 1

    def resume(self, vb: int, epoch: int, next_offset: int) -> None:
        """vb's sequence continues here (a planned move handed it over)."""
        self.view[2 * vb] = epoch
        self.view[2 * vb + 1] = next_offset


__all__ = ["ENTRY_BYTES", "Sequences", "new_epoch"]
