"""The verdict of bench/metrics_overhead.py: two-sided, paired windows, the median's 95 % interval.

No benchmark runs here: the summary and its report are fed made-up windows.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench import metrics_overhead
from bench.harness.loadgen import Load


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (-1.0, 2.0, "met"),
        (-2.5, -0.5, "met"),  # a small speed-up is within the target too
        (1.5, 3.5, "not demonstrated"),  # could be either side of 3 %
        (-3.0, 1.0, "not demonstrated"),  # the bound itself is not "under 3 %"
        (3.0, 7.0, "not met"),
        (-7.0, -4.0, "not met"),  # two-sided: a 4 % speed-up is not "under 3 %" either
        (-20.0, 20.0, "not demonstrated"),
    ],
)
def test_verdict(low: float, high: float, expected: str) -> None:
    assert metrics_overhead.verdict(low, high, 3.0) == expected


def test_median_interval_is_the_sign_test_one() -> None:
    # n = 60 at 95 %: the 22nd smallest and the 22nd largest (P(Bin(60, 1/2) <= 21) < 0.025)
    values = [float(i) for i in range(60)]
    assert metrics_overhead.median_interval(values) == (21.0, 38.0)
    assert metrics_overhead.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # n < 6: none at 95 %
    assert metrics_overhead.median_interval([float(i) for i in range(6)]) == (0.0, 5.0)


def _windows(pairs: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Windows of (off, on) deliveries/s per pair, in the measurement's alternating order."""
    windows = []
    for i, (off, on) in enumerate(pairs):
        order = (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))
        for side, rate in order:
            windows.append(
                {
                    "pair": i,
                    "side": side,
                    "deliveries_per_s": rate,
                    "server_cpu_us_per_delivery": 1.0,
                    "scrapes": 3 if side == "on" else 0,
                }
            )
    return windows


def _summary(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    args = argparse.Namespace(
        pairs=len(pairs), window=3.0, warmup=1.0, interval=1.0, workers=2,
        publishers=1, subscribers=1, payload=100, out=None,
    )  # fmt: skip
    run = {"published": 10, "delivered": 10, "not_delivered": 0, "errors": 0, "scrapes": 3 * len(pairs),
           "scrape_failures": 0, "scrape_median_ms": 30.0}  # fmt: skip
    res = metrics_overhead.summarize(args, Load(1, 1, 100), _windows(pairs), run)
    res["scrape_cpu_ms"], res["scrape_share_percent"] = 1.8, 0.2
    return res


def test_paired_differences_are_per_pair_and_signed() -> None:
    diffs = metrics_overhead.paired_differences(_windows([(100.0, 99.0), (200.0, 202.0)]))
    assert diffs == pytest.approx([1.0, -1.0])


def test_steady_pairs_give_a_verdict() -> None:
    # the level drifts a lot from pair to pair, the paired differences do not
    steady = [(1000e3, 995e3), (1400e3, 1398e3), (700e3, 701e3), (1200e3, 1195e3)] * 2
    res = _summary(steady)
    assert res["verdict"] == "met"
    assert res["median_difference_percent"] == pytest.approx(0.28, abs=0.1)
    report = metrics_overhead.markdown(res)
    assert "Verdict: **met**" in report and "**0.20 %**" in report
    assert "| 3 | 1,200,000 | 1,195,000 |" in report
    slower = [(1000e3, 900e3), (1400e3, 1265e3), (700e3, 630e3), (1200e3, 1085e3)] * 2
    assert _summary(slower)["verdict"] == "not met"


def test_an_outlier_pair_does_not_decide() -> None:
    # windows hit by 25 % stalls move the mean by 2.5 %, not the median's interval
    steady = [(1000e3, 1000e3 + d) for d in range(-4000, 5000, 500)]  # 18 pairs within +-0.5 %
    res = _summary([*steady, (1000e3, 750e3), (1000e3, 750e3)])
    assert res["mean_difference_percent"] > 2.4
    assert res["verdict"] == "met"


def test_noisy_pairs_are_not_demonstrated() -> None:
    # the old report called a faster side within 70 % noise "met"
    res = _summary([(680e3, 730e3), (980e3, 900e3), (1370e3, 1450e3)] * 3)
    assert res["verdict"] == "not demonstrated"
    assert "Verdict: **not demonstrated**" in metrics_overhead.markdown(res)


def test_too_few_pairs_cannot_show_anything() -> None:
    res = _summary([(1000e3, 999e3)] * 5)
    assert res["median_interval_95_percent"] is None and res["verdict"] == "not demonstrated"
    assert "too few pairs for a 95 % interval" in metrics_overhead.markdown(res)
