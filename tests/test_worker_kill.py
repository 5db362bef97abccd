"""The issue's scenario, short: SDK publisher and subscriber, a worker SIGKILLed.

A publisher at 5,000 msgs/s over 256 key_partitions (a sequence number per
partition in every payload), a subscriber on `w.>`, one worker killed under
load (bench/worker_kill.py runs the same with ten kills). Either nothing is
lost, or the subscriber was told exactly how many it lost; never a
duplicate, never out of order; the publisher's flush succeeds because the
dead worker's account told it which publishes to send again.
"""

from __future__ import annotations

import pytest

from bench import worker_kill


@pytest.mark.timeout(120)
def test_a_worker_killed_under_load_loses_nothing_silently() -> None:
    result = worker_kill.run(kills=1, interval=2.0, rate=5000, partitions=256)
    summary = f"{result}"
    assert result.published > 10000, summary
    assert result.lost == result.told, summary  # nothing lost silently
    assert result.received == result.published - result.lost, summary
    assert result.duplicates == 0 and result.out_of_order == 0, summary
    assert result.publisher_flush_error is None, summary
    assert result.publisher_unconfirmed_lost == 0, summary  # every in-doubt publish was settled
    assert result.kills[0]["recovery_s"] is not None and result.kills[0]["recovery_s"] < 10, summary
    print(
        f"\nworker kill: {result.published} published, {result.lost} lost, {result.told} told, "
        f"{result.publisher_resent_after_loss} resent, recovery {result.kills[0]['recovery_s']} s"
    )


@pytest.mark.timeout(120)
def test_a_subscriber_behind_when_the_worker_dies_is_told_exactly_what_it_lost() -> None:
    """The subscriber process is stopped for a second before the kill: the worker holds a
    backlog for it (and drops past its pending bound) when it dies. On the reconnect the
    dead worker's account tells it exactly: deliveries lost (WORKER_RESTART) and drops it
    had not been told of yet (SLOW_CONSUMER)."""
    result = worker_kill.run(
        kills=1, interval=2.0, rate=5000, partitions=256, payload_bytes=4096, stall_subscriber=1.5
    )
    summary = f"{result}"
    assert result.lost > 0, summary  # the scenario did lose deliveries...
    assert result.lost == result.told, summary  # ...and every one was told
    assert result.told_by_reason.get("worker_restart", 0) > 0, summary
    assert result.duplicates == 0 and result.out_of_order == 0, summary
    assert result.publisher_flush_error is None and result.publisher_unconfirmed_lost == 0, summary
