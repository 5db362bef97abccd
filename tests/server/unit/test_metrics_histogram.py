"""The broker latency histogram: bucket layout, Prometheus buckets, quantiles."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from broky.server import histogram
from broky.server.shard.stats import WorkerStats


@given(st.integers(min_value=0, max_value=1 << 50))
def test_bucket_of_agrees_with_the_inline_update_of_the_worker(ns: int) -> None:
    # broky.server.shard.core updates its histogram inline with this expression.
    inline = min(ns >> 10, 1 << 30).bit_length()
    assert histogram.bucket_of(ns) == inline
    assert inline < len(WorkerStats().latency_us) == histogram.BUCKETS


@given(st.integers(min_value=0, max_value=(1 << 40) - 1))
def test_a_duration_lies_within_its_bucket(ns: int) -> None:
    i = histogram.bucket_of(ns)
    assert ns / 1e9 < histogram.upper_bound_seconds(i)
    if i > 0:
        assert ns / 1e9 >= histogram.upper_bound_seconds(i - 1)


def test_known_durations() -> None:
    assert histogram.bucket_of(0) == 0
    assert histogram.bucket_of(1023) == 0
    assert histogram.bucket_of(1024) == 1
    assert histogram.bucket_of(50_000) == 6  # 50 us < 65.5 us
    assert histogram.bucket_of(-5) == 0
    assert histogram.bucket_of(1 << 60) == histogram.LAST


@given(st.lists(st.integers(min_value=0, max_value=1 << 36), max_size=200))
@example([1_073_741_820])  # just under 2**30 ns: its bound must not print as less than it is
def test_prometheus_buckets_are_cumulative_and_end_with_the_count(durations: list[int]) -> None:
    h = histogram.LatencyHistogram()
    for ns in durations:
        h.observe(ns)
    buckets = histogram.prometheus_buckets(h.counts)
    assert buckets[-1] == ("+Inf", float(len(durations)))
    bounds = [float(le) for le, _ in buckets]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    assert 5e-6 < bounds[0] < 1e-5 and bounds[-2] > 10
    counts = [c for _, c in buckets]
    assert counts == sorted(counts)
    for le, c in buckets:  # the cumulative count is exactly the durations under the bound
        assert c == sum(1 for ns in durations if ns / 1e9 < float(le))
    assert h.sum_ns == sum(durations)


def test_quantile_and_merge() -> None:
    h = histogram.LatencyHistogram()
    assert histogram.quantile(h.counts, 0.99) is None
    for _ in range(99):
        h.observe(20_000)  # 20 us: bucket 5, under 32.8 us
    h.observe(5_000_000)  # 5 ms: bucket 13, under 8.4 ms
    assert histogram.quantile(h.counts, 0.5) == histogram.upper_bound_seconds(5)
    assert histogram.quantile(h.counts, 0.99) == histogram.upper_bound_seconds(5)
    assert histogram.quantile(h.counts, 0.999) == histogram.upper_bound_seconds(13)
    merged = histogram.merge([h.counts, h.counts[:10]])
    assert sum(merged) == 199 and merged[13] == 1


def test_producer_ages_are_comparable_from_one_second_ahead_to_a_minute_behind() -> None:
    # broky.server.shard.core's inline update of the producer histogram follows this reference
    # (tests/server/http/test_metrics.py checks it against a real server).
    assert histogram.producer_bucket(20_000_000) == histogram.bucket_of(20_000_000)
    assert histogram.producer_bucket(histogram.PRODUCER_BEHIND_NS) == histogram.bucket_of(60 * 10**9)
    assert histogram.producer_bucket(histogram.PRODUCER_BEHIND_NS + 1) is None
    assert histogram.producer_bucket(-histogram.PRODUCER_AHEAD_NS) == 0  # a clock ahead counts as 0
    assert histogram.producer_bucket(-histogram.PRODUCER_AHEAD_NS - 1) is None
    assert len(WorkerStats().producer_us) == histogram.BUCKETS
