"""The per-address token buckets of broky.server.master.rates (in-process: pure arithmetic)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broky.server.master.rates import AddressRate


def test_a_burst_at_once_then_the_rate() -> None:
    rate = AddressRate(rate=10, burst=3)
    assert [rate.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rate.allow("b", 0.0)  # another address has its own bucket
    assert not rate.allow("a", 0.05)  # half a token
    assert rate.allow("a", 0.1)
    assert not rate.allow("a", 0.1)
    assert [rate.allow("a", 10.0) for _ in range(4)] == [True, True, True, False]  # refilled to the burst


def test_rate_zero_never_refuses() -> None:
    rate = AddressRate(rate=0, burst=1)
    assert all(rate.allow("a", 0.0) for _ in range(1000))
    assert rate.buckets == {}


def test_the_table_is_bounded_and_dropping_a_bucket_never_refuses_more() -> None:
    rate = AddressRate(rate=1, burst=2, max_addresses=100)
    for i in range(1000):
        assert rate.allow(f"10.0.{i // 256}.{i % 256}", i * 0.001)
        assert len(rate.buckets) <= 100
    # An address kept (the most recent) keeps its debt; a dropped one starts full.
    assert rate.allow("10.0.3.231", 1.0) and not rate.allow("10.0.3.231", 1.0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 0.5)), max_size=200))
def test_never_more_than_the_burst_plus_the_rate_times_the_time(steps: list[tuple[str, float]]) -> None:
    rate = AddressRate(rate=5, burst=4)
    now = 0.0
    allowed: dict[str, int] = {}
    for address, gap in steps:
        now += gap
        if rate.allow(address, now):
            allowed[address] = allowed.get(address, 0) + 1
    for n in allowed.values():
        assert n <= 4 + 5 * now + 1e-9
