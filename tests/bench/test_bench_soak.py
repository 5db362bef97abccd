"""The soak suite's short version (`python -m bench.soak --quick`): every section tiny.

bench/soak.py runs each section on a real `broky serve --workers 2`: a few hundred
connections held, a stalled subscriber under 20,000 messages, 20,000 random and mutated
frames (and HTTP requests) with a probe, and one worker SIGKILLed under load. This test
asserts the invariants the full run reports, not its timings: every held connection
answers, the readers beside the stalled one lose nothing, no worker crashes and no probe
hangs under the fuzz, and lost - told = 0 for every worker. Both in plain TCP and over TLS
(`--tls`: the server accepts TLS only, so a client that did not make the upgrade would be
refused and the invariants would fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_quick_soak_keeps_its_invariants(tmp_path: Path, tls: bool) -> None:
    name = "reliability_tls" if tls else "reliability"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--quick", *(["--tls"] if tls else []), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    assert (tmp_path / f"{name}.md").exists(), proc.stderr[-3000:]
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert doc["tls"] is tls
    sections = doc["sections"]
    assert set(sections) == {"connections", "stalled", "fuzz", "kills"}

    held = sections["connections"]
    assert held["welcomed"] == held["answered_ping_after_hold"] == held["connections"] > 0

    stalled = sections["stalled"]
    assert len(stalled["readers"]) == 2
    for reader in stalled["readers"]:
        assert reader["received"] == stalled["published"] > 0
        assert reader["lost"] == reader["told"] == reader["duplicates"] == 0
    for s in stalled["stalled"]:
        told = s["told"]["before_close"] + s["told"]["on_reconnect"]
        assert s["received"] + told == s["published_to_its_worker"] or s["closed"]

    fuzz = sections["fuzz"]
    assert fuzz["frames_sent"] >= fuzz["frames_target"]
    assert fuzz["worker_crashes"] == 0 and fuzz["worker_pids_unchanged"]
    assert fuzz["connections_open_at_end"] == 0  # none left behind by its client
    assert fuzz["hangs"] == 0 and fuzz["probe_failures"] == [] and fuzz["probe_round_trips"] > 0
    assert fuzz["http_requests"] > 0
    assert fuzz["connections_ended_with_error"] > 0  # the mutated frames reached the workers

    kills = sections["kills"]
    assert len(kills["kills"]) >= 1 and kills["published"] > 0
    assert kills["lost_by_worker"] == kills["told_by_worker"]
    assert kills["lost_minus_told"] == 0 and kills["duplicates"] == 0

    assert proc.returncode == 0, proc.stderr[-3000:]
