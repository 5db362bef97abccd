"""The issue's burst, as a new user runs it: 300,000 messages of 100 B over 256 key_partitions
from an SDK publisher process to an SDK subscriber process reading with `async for`, default
settings everywhere (a real `broky serve`): every message arrives, once, whole and in order
within its key_partition. bench.sdk_burst runs the same against nats.py and reports the
figures; here it runs in its check mode (a key_partition index and a sequence number in each
payload, every message checked by the subscriber) and only the delivery is asserted. A
shorter burst does the same with the replay buffer off (`--replay-bytes 0`, the benchmark's
`broky_noreplay`)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import sdk_burst


def _burst(system: str, n: int, parts: int) -> dict[str, Any]:
    got = sdk_burst.one_run(system, n, workers=2, parts=parts, check=True)
    per_partition = got.pop("per_partition")
    print(f"\nburst: {got}")
    assert got["published"] == n and got["error"] is None, got
    assert got["received"] == n and got["lost"] == 0, got
    assert got["told_lost"] == 0 and got["dropped_local"] == 0, got
    # Each message whole (key, key_partition, payload), each key_partition's in order and
    # complete: every sequence number once, none skipped, none twice, none late.
    assert got["corrupt"] == 0 and got["gaps"] == 0, got
    assert got["duplicates"] == 0 and got["out_of_order"] == 0, got
    assert got["duplicates_dropped"] == 0, got  # not even a copy the SDK's filter caught
    assert per_partition == [n // parts + (p < n % parts) for p in range(parts)]
    return got


@pytest.mark.timeout(180)
def test_a_300k_burst_arrives_whole_with_the_defaults() -> None:
    n = 300_000
    got = _burst("broky", n, 256)
    # The default replay buffer (192 MiB per worker) kept every one of them: 300,000 frames of
    # 256 B are about 38 MB per worker.
    assert got["replay"]["after"]["replay_messages"] == n, got["replay"]
    assert got["replay"]["after"]["replay_evicted_messages"] == 0, got["replay"]


@pytest.mark.timeout(120)
def test_a_burst_arrives_whole_with_the_replay_buffer_off() -> None:
    got = _burst("broky_noreplay", 50_000, 256)
    assert got["replay"]["after"] == {
        "replay_bytes": 0, "replay_segments": 0, "replay_messages": 0, "replay_evicted_messages": 0,
        "lag_entered": 0, "lag_served": 0, "lag_evicted": 0,
    }  # fmt: skip
