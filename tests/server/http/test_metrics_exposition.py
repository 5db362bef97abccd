"""The server's own rendering of Prometheus' text format, read back by prometheus_client's parser.

broky.server.http.metrics renders /metrics itself (see its header for why). Any
snapshot, whatever the counts and label values, must parse back to exactly
the families, types, labels and values it was rendered from.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from broky.protocol import LossReason
from broky.server import histogram
from broky.server.http.metrics import COUNTERS, GAUGES, Exporter, Family
from broky.server.shard.stats import DROPPED_AS, DropReason
from tests.support.paths import ROOT

counts = st.integers(min_value=0, max_value=2**53)
snapshots = st.fixed_dictionaries(
    {field: counts for _, field, _ in COUNTERS + GAUGES},
    optional={
        "dropped": st.dictionaries(st.sampled_from(list(DropReason)), counts),
        "errors": st.dictionaries(st.sampled_from(["BAD_FRAME", "NOT_MY_VBUCKET"]), counts),
        "latency_us": st.lists(st.integers(0, 10**9), max_size=histogram.BUCKETS),
        "latency_ns_sum": counts,
    },
)
label_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


def parse(text: bytes) -> dict[str, Any]:
    """family name -> (type, {(sample name, sorted labels): value})."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text.decode()):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = (family.type, samples)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), snapshots), min_size=1, max_size=4), label_text, label_text)
def test_every_snapshot_parses_back_to_its_values(
    workers: list[dict[str, Any] | None], node_id: str, leader: str
) -> None:
    master = {
        "worker_restarts": [1] * len(workers),
        "connections_handed": 7,
        "handshakes_refused": {"AUTH": 2},
    }
    cluster = {
        "map_version": 3, "map_moving": False, "members": [1, 2], "is_leader": True,
        "etcd_connected": True, "state": "serving", "node_id": node_id, "leader": leader,
    }  # fmt: skip
    families = parse(Exporter().render(workers, master, cluster))
    assert families["broky_worker_up"][1] == {
        ("broky_worker_up", (("worker", str(i)),)): float(s is not None) for i, s in enumerate(workers)
    }
    for name, field, _ in COUNTERS:
        kind, samples = families[name.removesuffix("_total")]
        assert kind == "counter"
        expected = {(name, (("worker", str(i)),)): float(s[field]) for i, s in enumerate(workers) if s}
        assert samples == expected
    for name, field, _ in GAUGES:
        expected = {(name, (("worker", str(i)),)): float(s[field]) for i, s in enumerate(workers) if s}
        assert families[name] == ("gauge", expected)
    kind, dropped = families["broky_messages_dropped"]
    for i, s in enumerate(workers):
        for reason in DropReason:
            if s is not None:
                key = ("broky_messages_dropped_total", (("reason", reason), ("worker", str(i))))
                assert dropped[key] == float(s.get("dropped", {}).get(reason, 0))
    kind, latency = families["broky_broker_latency_seconds"]
    assert kind == "histogram"
    for i, s in enumerate(workers):
        if s is None:
            continue
        total = sum(s.get("latency_us", []))
        assert latency["broky_broker_latency_seconds_count", (("worker", str(i)),)] == total
        inf = latency["broky_broker_latency_seconds_bucket", (("le", "+Inf"), ("worker", str(i)))]
        assert inf == total
        got = latency["broky_broker_latency_seconds_sum", (("worker", str(i)),)]
        assert math.isclose(got, s.get("latency_ns_sum", 0) / 1e9)
    info = families["broky_cluster_node_info"][1]
    assert info == {("broky_cluster_node_info", (("leader", leader), ("node_id", node_id))): 1.0}


def test_help_and_label_values_are_escaped() -> None:
    family = Family("x_total", "counter", 'a \\ back\nslash "quoted"', ["who"])
    family.add_metric(['say "hi"\\\n'], 3)
    family.add_metric(["plain"], float("inf"))
    text = family.render()
    assert text.splitlines()[0] == '# HELP x_total a \\\\ back\\nslash "quoted"'
    (parsed,) = text_string_to_metric_families(text)
    assert parsed.documentation == 'a \\ back\nslash "quoted"'
    assert [(s.labels, s.value) for s in parsed.samples] == [
        ({"who": 'say "hi"\\\n'}, 3.0),
        ({"who": "plain"}, math.inf),
    ]


def test_a_family_without_labels_has_no_braces() -> None:
    family = Family("broky_workers_ready", "gauge", "Workers ready to serve.")
    family.add_metric([], 2.0)
    assert family.render().splitlines()[-1] == "broky_workers_ready 2.0"


def test_the_drop_reasons_are_the_labels_of_the_dropped_counter_and_the_docs_name_each() -> None:
    _, samples = parse(Exporter().render([{}, {"dropped": {}}], {}))["broky_messages_dropped"]
    for worker in ("0", "1"):
        labels = {dict(pairs)["reason"] for _, pairs in samples if dict(pairs)["worker"] == worker}
        assert labels == {str(r) for r in DropReason}
    page = (ROOT / "docs" / "operations" / "monitoring.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith("| `broky_messages_dropped_total{")]
    named = set(re.findall(r"`(\w+)`", row.split("|")[3]))
    assert named == {str(r) for r in DropReason}


def test_a_loss_that_is_a_drop_counts_under_the_drop_reason_of_its_name() -> None:
    drops = {str(r) for r in DropReason}
    for reason in LossReason.NAMES:
        name = LossReason.name(reason)
        if name in drops:
            assert DROPPED_AS[reason] == name
        else:
            assert reason not in DROPPED_AS, name
    assert set(DROPPED_AS.values()) == {DropReason(n) for n in drops & set(LossReason.NAMES.values())}
