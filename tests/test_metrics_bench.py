"""The verdict of bench/metrics_overhead.py: two-sided, and read against the noise.

No benchmark runs here: the summary and its report are fed made-up runs.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench import metrics_overhead
from bench.harness.loadgen import Load


@pytest.mark.parametrize(
    ("diff", "noise", "expected"),
    [
        (1.0, 1.0, "met"),
        (-1.0, 1.5, "met"),  # a small speed-up is within the target too
        (2.5, 1.0, "not demonstrated"),  # could be either side of 3 %
        (5.0, 1.0, "not met"),
        (-5.0, 1.0, "not met"),  # two-sided: a 5 % speed-up is not "under 3 %" either
        (0.0, 3.0, "not demonstrated"),  # noise alone reaches the target
        (1.0, 70.0, "not demonstrated"),
        (80.0, 70.0, "not met"),  # even the noise cannot explain this much
    ],
)
def test_verdict(diff: float, noise: float, expected: str) -> None:
    assert metrics_overhead.verdict(diff, noise, 3.0) == expected


def _runs(off: list[float], on: list[float]) -> list[dict[str, Any]]:
    runs = []
    for side, rates in (("off", off), ("on", on)):
        for i, rate in enumerate(rates):
            runs.append(
                {
                    "side": side,
                    "round": i,
                    "deliveries_per_s": rate,
                    "server_cpu_us_per_delivery": 1.0,
                    "errors": 0,
                    "not_delivered": 0,
                    **({"scrapes": 8, "scrape_median_ms": 2.0} if side == "on" else {}),
                }
            )
    return runs


def _summary(off: list[float], on: list[float]) -> dict[str, Any]:
    args = argparse.Namespace(
        rounds=len(off), duration=1.0, warmup=0.1, interval=1.0, workers=2,
        publishers=1, subscribers=1, payload=100, out=None,
    )  # fmt: skip
    res = metrics_overhead.summarize(args, Load(1, 1, 100), _runs(off, on))
    res["scrape_cpu_ms"], res["scrape_share_percent"] = 1.8, 0.2
    return res


def test_a_faster_side_within_a_noisy_run_is_not_demonstrated() -> None:
    # The old one-sided check called this "met": on was 8 % faster, runs varied by 70 %.
    res = _summary(off=[680e3, 980e3, 1370e3], on=[730e3, 1060e3, 1450e3])
    assert res["throughput_difference_percent"] == pytest.approx(-8.16, abs=0.01)
    assert res["noise_percent"] == pytest.approx(70.4, abs=0.1)
    assert res["verdict"] == "not demonstrated"
    report = metrics_overhead.markdown(res)
    assert "Verdict: **not demonstrated**" in report and "**0.20 %**" in report


def test_steady_runs_give_a_verdict() -> None:
    assert _summary(off=[1000e3, 1005e3, 1002e3], on=[998e3, 1001e3, 1003e3])["verdict"] == "met"
    assert _summary(off=[1000e3, 1005e3, 1002e3], on=[900e3, 905e3, 902e3])["verdict"] == "not met"


def test_one_run_per_side_cannot_show_anything() -> None:
    res = _summary(off=[1000e3], on=[700e3])  # a 30 % difference, but no noise estimate
    assert res["noise_percent"] is None and res["verdict"] == "not demonstrated"
    assert "(one run per side: no noise estimate)" in metrics_overhead.markdown(res)
