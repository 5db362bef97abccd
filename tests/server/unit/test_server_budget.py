"""A worker's share of the memory budget (broky.server.shard.budget): what each kind may take."""

from __future__ import annotations

import asyncio

import pytest

from broky.server.config import ServerConfig
from broky.server.shard.budget import LOW_MARK, Budget
from broky.server.shard.core import SHARD_ATTRIBUTES, Shard


def test_other_kinds_take_only_what_is_free_and_leave_the_pending_bytes_less_room() -> None:
    budget = Budget(1000)
    assert (budget.room, budget.low) == (1000, int(1000 * LOW_MARK))
    budget.pending = 600
    assert budget.take("replay", 300)
    assert (budget.room, budget.used()) == (700, 900)
    assert not budget.take("replay", 101)  # the pending bytes keep what they use now
    assert budget.taken == {"replay": 300}
    assert budget.take("replay", 100)
    budget.give("replay", 250)
    assert (budget.room, budget.used(), budget.taken) == (850, 750, {"replay": 150})
    assert budget.snapshot() == {"share": 1000, "pending": 600, "replay": 150}
    with pytest.raises(ValueError):
        budget.give("replay", 151)
    with pytest.raises(ValueError):
        budget.take("replay", -1)


def test_the_shard_keeps_few_attributes() -> None:
    # Past SHARD_ATTRIBUTES, every `self.x` of the read handler gets slower (see fanout).
    loop = asyncio.new_event_loop()
    try:
        shard = Shard(ServerConfig(workers=1), 0, loop)
        shard.on_closed = print  # as a worker sets it
        assert len(vars(shard)) <= SHARD_ATTRIBUTES, sorted(vars(shard))
    finally:
        loop.close()
