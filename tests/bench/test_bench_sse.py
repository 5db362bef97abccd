"""bench.sse, tiny: `python -m bench.sse --quick` end to end (a real broky serve, event-stream
readers and SDK subscribers in processes of their own, an SDK publisher).

No timing assertion: the figures depend on the machine; only that every case ran, every
reader got every message, the sampled events parsed, and the report has its fields. The real
run is `python -m bench.sse` (results in bench/results/sse.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchrun import run_bench


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_sse_quick_runs_every_case(tmp_path: Path) -> None:
    run_bench("bench.sse", "--quick", "--out", str(tmp_path), timeout=100)

    doc = json.loads((tmp_path / "sse.json").read_text())
    for field in ("cpu_model", "cores", "python", "broky"):
        assert doc["machine"][field], field
    assert set(doc["runs"]) == {"sse 20", "sdk 20", "sse 1", "sdk 1"}
    for name, runs in doc["runs"].items():
        assert len(runs) == 1 and "error" not in runs[0], (name, runs)
        run = runs[0]
        assert run["published"] > 0 and run["missing"] == 0, (name, run)  # every reader got every one
        assert run["delivered_total"] == run["published"] * run["readers"], (name, run)
        assert run["deliveries_per_s"] > 0 and run["cpu_us_per_delivery"] > 0, (name, run)
        assert 0 < run["master_share"] <= 1 and run["master_rss_open"] > 0, (name, run)
        assert run["special_events"] == 0 and run["streams_closed"] == 0, (name, run)
        if run["kind"] == "sse":
            assert run["server"]["http"]["streams"] == run["readers"], run["server"]
            assert run["sample_checked"] >= run["published"] and run["sample_bad"] == [], run
    text = (tmp_path / "sse.md").read_text()
    assert "| sse 20 |" in text and "| sdk 1 |" in text and "Failed rounds: none" in text, text
