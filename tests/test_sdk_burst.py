"""The issue's burst, as a new user runs it: 300,000 messages of 100 B over 256 key_partitions
from an SDK publisher process to an SDK subscriber process reading with `async for`, default
settings everywhere (a real `broky serve`): every message arrives. bench.sdk_burst runs the
same against nats.py and reports the figures; here only the loss is asserted."""

from __future__ import annotations

import pytest

from bench import sdk_burst


@pytest.mark.timeout(180)
def test_a_300k_burst_arrives_whole_with_the_defaults() -> None:
    got = sdk_burst.one_run("broky", 300_000, workers=2)
    print(f"\nburst: {got}")
    assert got["published"] == 300_000
    assert got["received"] == 300_000 and got["lost"] == 0, got
    assert got["told_lost"] == 0 and got["dropped_local"] == 0, got
