"""One worker's share of the server-wide memory budget, and what uses it, by kind.

Theory of operation
-------------------
`--memory-budget` bounds the memory the server keeps on behalf of its
clients. Shared-nothing, as everything else: each worker gets an equal share
(`--memory-budget // --workers`, `share`) and keeps its own use under it
alone; nothing crosses processes, and a worker never waits for another.

What uses a share, by kind:

  pending  the outbound bytes of the worker's connections: what their
           transports' write buffers have and what is queued in `out`
           (deliveries and replies; see broky.server.shard.connection). The shard
           (broky.server.shard.budget_enforcement) keeps the running total in `pending`,
           updated once per touched connection per read and made exact from
           the transports at every tick and before any cut.
  others   anything else a worker keeps for its clients and can give back,
           by name: `take` and `give`, and what each took is in `taken`.
           The replay buffer ("replay", broky.server.shard.replay) is one.

The pending bytes may use what the other kinds leave (`room`). When they go
over it, the shard cuts the connections with the most pending bytes until
they are under the low mark (LOW_MARK of `room`); see
broky.server.shard.budget_enforcement. The other kinds never take room that the
pending bytes use now: `take` fails instead, and the caller frees some of
its own (the replay buffer evicts its oldest messages). And when the pending
bytes go over their room, the replay buffer gives room back before any
connection is cut. Connections come first because their bytes are owed
(each was counted as delivered); what the others take is an extra.

It also keeps the bookkeeping of the heap trim that gives memory back after
a burst or a subscription flood (broky.server.shard.budget_enforcement, "Memory"): the
peak of the pending bytes and the subscription bytes freed since the last
trim, and when that was.
"""

from __future__ import annotations

LOW_MARK = 0.75  # cuts bring the pending bytes under this fraction of their room


class Budget:
    """A worker's share of --memory-budget: the pending bytes, the other kinds, the room."""

    __slots__ = ("share", "pending", "peak", "peaked", "taken", "room", "freed_sub_bytes", "trimmed_at")

    def __init__(self, share: int) -> None:
        self.share = share
        # Outbound bytes of every connection (broky.server.shard.budget keeps it): the sum of
        # their `charged` bytes.
        self.pending = 0
        # The highest `pending` seen since the heap was last trimmed, at most `room`: the
        # shard compares `pending` with it once per read (and cuts past `room`).
        self.peak = 0
        self.peaked = False  # `pending` passed `peak` during this read (the shard looks after it)
        self.taken: dict[str, int] = {}  # bytes taken by every other kind (`take`)
        self.room = share  # what the pending bytes may use: the share minus `taken`
        self.freed_sub_bytes = 0  # subscription bytes freed since the last heap trim
        self.trimmed_at = 0.0  # monotonic time of the last heap trim

    @property
    def low(self) -> int:
        """Where cuts stop: the pending bytes under this."""
        return int(self.room * LOW_MARK)

    def used(self) -> int:
        return self.pending + self.share - self.room

    def take(self, kind: str, nbytes: int) -> bool:
        """Take `nbytes` more for `kind` if the share has that much free (beyond the
        pending bytes and what every kind took); False, and nothing taken, if not."""
        if nbytes < 0:
            raise ValueError(f"cannot take {nbytes} bytes")
        if self.used() + nbytes > self.share:
            return False
        self.taken[kind] = self.taken.get(kind, 0) + nbytes
        self.room -= nbytes
        return True

    def give(self, kind: str, nbytes: int) -> None:
        """`kind` gives back `nbytes` of what it took."""
        taken = self.taken.get(kind, 0)
        if not 0 <= nbytes <= taken:
            raise ValueError(f"{kind} took {taken} bytes, cannot give back {nbytes}")
        self.taken[kind] = taken - nbytes
        self.room += nbytes

    def snapshot(self) -> dict[str, int]:
        """For /stats: the share, and what each kind uses of it."""
        return {"share": self.share, "pending": self.pending, **self.taken}
