"""bench.groups, tiny: `python -m bench.groups --quick` end to end (a real broky serve and
nats-server, one process per member), and its checks on members' reports made up here.

No timing assertion: the figures depend on the machine; only that every section ran, every
message was taken once, and the report has its fields. The real run is `python -m bench.groups`
(results in bench/results/groups.md).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from bench import groups
from tests.support import requires
from tests.support.benchrun import run_bench


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_groups_quick_runs_every_section(tmp_path: Path) -> None:
    requires.program("nats-server")
    n = 2000
    stdout, _ = run_bench(
        "bench.groups", "--quick", "--messages", str(n), "--rate", "4000", "--partitions", "64",
        "--cpu-rounds", "1", "--out", str(tmp_path), timeout=130,
    )  # fmt: skip

    doc = json.loads((tmp_path / "groups.json").read_text())
    for field in ("cpu_model", "cores", "python", "broky", "nats_server"):
        assert doc["machine"][field], field
    results = doc["results"]
    assert set(results) == {*groups.QUICK, *(sc.id for sc in groups.CPU_SETUPS)}
    for sid, runs in results.items():
        assert len(runs) == 1, sid
        run = runs[0]
        assert "error" not in run, (sid, run)
        members = groups.BY_ID[sid].members
        assert len(run["per_member"]) == members == len(run["members"]), sid
        # every message taken, once, by one member; no member reported an error
        assert run["published"] == n and run["taken"] == n and run["lost"] == 0, (sid, run)
        assert run["twice_by_one"] == 0 and run["by_two"] in (0, None), (sid, run)
        assert all(m["member_error"] is None for m in run["members"]), (sid, run["members"])
        for key in ("max_over_min", "cv", "server_cpu_us_per_delivery", "elapsed_s", "lag_ms_p99"):
            assert run[key] is not None, (sid, key)
    assert results["cpu_plain_idle"][0]["idle_group_taken"] == 0  # idle: the load never matches it
    assert results["slow3_broky_ack"][0]["slow_share_of_fast"] is not None
    assert results["slow3_broky_ack"][0]["server"]["acks"] == n  # every message acked once
    ks = results["ks3_zipf"][0]
    # Without acks a vbucket moves at most once, undrained, at the rebalance a second after the
    # last member joined (schema/README.md 5.3 rule 3), which the run may straddle on a loaded
    # machine: a key_partition may then have two members, one after the other, never more.
    assert ks["partitions_moved_back_and_forth"] == 0, ks
    assert ks["partitions_split"] == 0 or ks["server"]["group_vbuckets_moved"] > 0, ks
    assert ks["partitions_incomplete"] <= ks["partitions_split"], ks  # incomplete: only if moved
    assert ks["out_of_order"] == 0 and ks["offset_backwards"] == 0, ks
    assert sum(ks["partitions_per_member"]) <= 64 + ks["partitions_split"], ks  # a moved one: on two
    assert 0 < ks["hottest_partition_share"] < 1, ks
    targets = {t["target"] for t in doc["summary"]["targets"]}
    assert any("idle group" in t for t in targets), targets

    text = (tmp_path / "groups.md").read_text()
    print(text.split("## Targets")[0])  # the balance figures of the tiny run (pytest -s)
    headings = ("## Load-balanced groups, equally fast members", "## Load-balanced groups, one member three",
                "## Key-shared groups (Broky only)", "## Acks", "## Server CPU per delivered message",
                "## Targets")  # fmt: skip
    for heading in headings:
        assert heading in text, heading
    assert doc["machine"]["nats_server"] in text and f"{doc['machine']['cores']} cores" in text
    assert stdout.startswith("# Consumer groups")


def _member(n: int, taken: list[int], per_partition: list[int], **extra: Any) -> dict[str, Any]:
    seen = bytearray((n + 7) // 8)
    for k in taken:
        seen[k >> 3] |= 1 << (k & 7)
    return {"taken": len(taken), "twice": 0, "redelivered": 0, "out_of_order": 0, "offset_backwards": 0,
            "per_partition": per_partition, "lag_ms_p99": 1.0, "lag_ms_max": 2.0, "first_at": 1.0,
            "last_at": 2.0, "seen": base64.b64encode(bytes(seen)).decode(), "member_error": None,
            **extra}  # fmt: skip


def test_analyse_finds_messages_lost_and_taken_by_two_members() -> None:
    n = 12
    published = {"published": n, "started_at": 0.0, "seconds": 1.0}
    sc = groups.BY_ID["lb3_broky"]
    taken = [_member(n, [0, 1, 2, 3], [4]), _member(n, [3, 4, 5, 6, 7], [5]), _member(n, [8, 9], [2])]
    got = groups.analyse(sc, n, 1, published, taken, n)
    assert got["lost"] == 2 and got["by_two"] == 1  # 10 and 11 nobody's; 3 taken by two
    assert got["per_member"] == [4, 5, 2] and got["max_over_min"] == 2.5
    assert "seen" not in got["members"][0] and "per_partition" not in got["members"][0]


def test_analyse_key_shared_finds_split_and_incomplete_key_partitions() -> None:
    n, parts = 8, 4  # round robin: every key_partition has 2 messages
    published = {"published": n, "started_at": 0.0, "seconds": 1.0}
    sc = groups.BY_ID["ks3_uniform"]
    taken = [
        _member(n, [0, 4, 1], [2, 1, 0, 0]),  # key_partition 1: one message here...
        _member(n, [5, 2, 6], [0, 1, 2, 0]),  # ...and one here: split
        _member(n, [3], [0, 0, 0, 1]),  # key_partition 3: one of two (7 lost)
    ]
    got = groups.analyse(sc, n, parts, published, taken, n)
    assert got["partitions_split"] == 1 and got["partitions_incomplete"] == 2
    assert got["partitions_per_member"] == [2, 2, 1] and got["lost"] == 1
    assert got["hottest_partition_share"] == 0.25
    assert got["partitions_moved_back_and_forth"] == 0  # key_partition 1: one member, then another


def test_analyse_key_shared_finds_a_key_partition_moved_back_and_forth() -> None:
    n, parts = 12, 4  # round robin: key_partition p has messages p, p + 4, p + 8
    published = {"published": n, "started_at": 0.0, "seconds": 1.0}
    taken = [
        _member(n, [0, 8, 1, 5, 2, 6, 10], [2, 2, 3, 0]),  # key_partition 0: here, there, here
        _member(n, [4, 9, 3, 7, 11], [1, 1, 0, 3]),  # key_partition 1: moved once, to here
    ]
    got = groups.analyse(groups.BY_ID["ks3_uniform"], n, parts, published, taken, n)
    assert got["partitions_split"] == 2 and got["partitions_moved_back_and_forth"] == 1


def test_slow_members_capacity_is_headroom_times_the_rate() -> None:
    fast, slow = groups.service_times(10_000)
    assert slow == pytest.approx(groups.SLOWER * fast)
    assert 2 / fast + 1 / slow == pytest.approx(groups.HEADROOM * 10_000)


def test_zipf_draw_is_seeded_and_skewed() -> None:
    a = groups.expected_per_partition(10_000, 256, groups.ZIPF_S)
    assert a == groups.expected_per_partition(10_000, 256, groups.ZIPF_S)
    assert sum(a) == 10_000 and a[0] == max(a) and a[0] > 10 * a[100]
    assert groups.expected_per_partition(512, 256, 0.0) == [2] * 256
