"""The sequence of every vbucket a worker owns: its epoch and its next offset.

Theory of operation
-------------------
A message's position is (vbucket, epoch, offset): the worker that owns the
vbucket stamps it when it accepts the message (broky.server.shard.core), in place
like ts_broker. Per vbucket the offsets count the accepted messages from 1,
+1 each, no gaps, while the epoch stays the same. The epoch changes whenever
the sequence may have restarted: a worker's new incarnation starts every
vbucket it serves with a new epoch (a random 64-bit number, drawn once per
incarnation), and so does a vbucket taken over after a failure. A planned move
in a cluster continues the sequence on the new owner: same epoch, the next
offset (`resume`).

The state lives in one bytearray of 1024 x 32 bytes (epoch, next offset, the
ts_broker of the last message stamped here when the worker has no replay
buffer (with one, the buffer knows it), and of offset 1 of the sequence;
u64 little-endian each), so that the compiled twin of the read path can take
offsets from it and note the stamps without a Python call per message
(broky.server.shard._feedscan); `view` is the same memory as 4096 u64 for Python.

What a start from a time needs to count exactly (broky.server.shard.positions), per
vbucket: the last stamp (a vbucket that took nothing at or after a time has
lost nothing after it), the first stamp and the first offset of its current
sequence here (`begun_offset`: 1, or the offset a planned move handed over):
when the first stamp is at or after the time, so is every offset from the
first one on.

A vbucket this worker handed over in a planned move (broky.server.shard.moves)
keeps its entry (the epoch and the next offset it was handed over with: the
replay buffer counts its retained offsets back from there) and is *former*
(`former`) until it comes back: its retained messages are still read by
bounded reads that name it (broky.server.shard.positions), and nothing is
stamped in it here.
"""

from __future__ import annotations

import os

from broky.protocol import VBUCKETS

ENTRY_BYTES = 32  # epoch, next offset, last ts_broker, first ts_broker
ENTRY_WORDS = ENTRY_BYTES // 8


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
            view[ENTRY_WORDS * vb] = self.epoch
            view[ENTRY_WORDS * vb + 1] = 1
        # The last ts_broker stamped: the read path never stamps an earlier one, so
        # ts_broker never decreases on a worker (a start from a time is a binary search).
        self.last_ts = 0
        # Per vbucket, the first offset of its current sequence here (1, or the next offset a
        # planned move handed over).
        self.begun_offset = [1] * VBUCKETS
        # vbucket -> (epoch, next offset) it was handed over with: a former vbucket (see the header)
        self.former: dict[int, tuple[int, int]] = {}
        # vbucket -> (epoch, next offset) of its sequence before the last restart under another
        # epoch here: how many a lagging reader was owed of it (broky.server.shard.lag)
        self.ended: dict[int, tuple[int, int]] = {}

    def epoch_of(self, vb: int) -> int:
        return int(self.view[ENTRY_WORDS * vb])

    def next_of(self, vb: int) -> int:
        """The offset the next accepted message of vb gets."""
        return int(self.view[ENTRY_WORDS * vb + 1])

    def last_ts_of(self, vb: int) -> int:
        """The ts_broker of the last message of vb's sequence stamped here (0: none), kept
        by the read path only when the worker has no replay buffer."""
        return int(self.view[ENTRY_WORDS * vb + 2])

    def first_ts_of(self, vb: int) -> int:
        """The ts_broker of offset 1 of vb's sequence (0: not stamped here)."""
        return int(self.view[ENTRY_WORDS * vb + 3])

    def take(self, vb: int, ts: int = 0) -> int:
        """The offset of an accepted message of vb (the next, counted), stamped `ts`
        (0: its stamp is not noted)."""
        view = self.view
        at = ENTRY_WORDS * vb + 1
        offset = view[at]
        view[at] = offset + 1
        if ts:
            view[at + 1] = ts
            if offset == 1:
                view[at + 2] = ts
        return int(offset)

    def begin(self, vb: int, epoch: int, next_offset: int) -> None:
        before = self.epoch_of(vb)
        if before != epoch:
            self.ended[vb] = (before, self.next_of(vb))
        self.view[ENTRY_WORDS * vb] = epoch
        self.view[ENTRY_WORDS * vb + 1] = next_offset
        self.view[ENTRY_WORDS * vb + 2] = self.view[ENTRY_WORDS * vb + 3] = 0
        self.begun_offset[vb] = next_offset

    def restart(self, vb: int) -> None:
        """vb's sequence starts again here, under a new epoch (it was taken over
        without its history, e.g. after a failover)."""
        self.begin(vb, new_epoch(), 1)

    def resume(self, vb: int, epoch: int, next_offset: int) -> None:
        """vb's sequence continues here (a planned move handed it over)."""
        self.begin(vb, epoch, next_offset)


__all__ = ["ENTRY_BYTES", "ENTRY_WORDS", "Sequences", "new_epoch"]
