"""The issue's scenario, short: SDK publisher and subscriber, a worker SIGKILLed.

A publisher at 5,000 msgs/s over 256 key_partitions (a sequence number per
partition in every payload), a subscriber on `w.>`, one worker killed under
load (bench/worker_kill.py runs the same with ten kills). Either nothing is
lost, or the subscriber was told exactly how many it lost, worker by worker
(a total would let over-telling on one worker hide a silent loss on the
other); never a duplicate, never out of order, not even one the SDK's
duplicate filter caught; the publisher's flush succeeds because the dead
worker's account told it which publishes to send again.
"""

from __future__ import annotations

import pytest

from bench import worker_kill


def assert_told_exactly(result: worker_kill.Result) -> None:
    """Lost equals told on every worker, and what arrived is whole, in order and counted twice over."""
    summary = f"{result}"
    assert result.lost_by_worker == result.told_by_worker, summary  # nothing lost silently, anywhere
    assert result.lost == result.told, summary
    # What the subscriber's callback got: the publisher's count less what it was told it lost (no
    # derivation from the sequences), and the SDK's own count of what it handed over.
    assert result.received == result.published - result.told, summary
    assert result.received == result.subscriber_sdk_delivered, summary
    assert result.duplicates == 0 and result.out_of_order == 0, summary
    assert result.stray == 0 and result.corrupt == 0, summary
    # The dead worker's account settled every in-doubt publish: nothing was sent twice, so the
    # SDK's duplicate filter had nothing to drop (a copy it dropped would be a double delivery).
    assert result.subscriber_duplicates_dropped == 0, summary
    assert result.subscriber_unaccounted == 0, summary  # every connection had its account
    assert result.publisher_flush_error is None, summary
    assert result.publisher_unconfirmed_lost == 0, summary  # every in-doubt publish was settled


@pytest.mark.timeout(120)
def test_a_worker_killed_under_load_loses_nothing_silently() -> None:
    result = worker_kill.run(kills=1, interval=2.0, rate=5000, partitions=256)
    summary = f"{result}"
    assert result.published > 10000, summary
    assert_told_exactly(result)
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
    killed = result.kills[0]["worker"]
    assert result.lost_by_worker[killed] > 0, summary  # the scenario did lose deliveries...
    assert_told_exactly(result)  # ...and every one was told, by the worker that lost it
    assert result.told_by_reason.get("worker_restart", 0) > 0, summary
