"""bench.cluster_cpu, short: one node and a three-node cluster (real etcd and nodes) under the
same small SDK load, every message delivered, CPU counted on every server process, the report
written. The real run is `python -m bench.cluster_cpu` (results in bench/results/cluster_cpu.md)."""

from __future__ import annotations

import argparse

import pytest

from bench import cluster_cpu
from bench.harness.machine import machine_info


@pytest.mark.timeout(150)
def test_cluster_cpu_measures_one_node_and_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_cpu, "IDLE_SECONDS", 1.0)
    results = {}
    for name in ("1 node x 3 workers", "3 nodes x 1 worker"):
        nodes, workers, clustered = cluster_cpu.SETUPS[name]
        got = cluster_cpu.one_run(nodes, workers, clustered, rate=2000, seconds=1.0, partitions=32)
        assert got["published"] > 1000 and got["delivered"] == got["published"], got
        assert got["server_cpu_s"] > 0 and got["server_cpu_us_per_delivery"] > 0, got
        assert 0 <= got["masters_cpu_s"] <= got["server_cpu_s"], got
        assert got["data_path_cpu_us_per_delivery"] <= got["server_cpu_us_per_delivery"], got
        results[name] = [got]
    assert results["1 node x 3 workers"][0]["etcd_cpu_s"] == 0  # no etcd for a single node
    for name in cluster_cpu.SETUPS:
        results.setdefault(name, results["3 nodes x 1 worker"])  # the report lists every setup
    args = argparse.Namespace(runs=1, rate=2000, seconds=1.0, partitions=32)
    text = cluster_cpu.report(results, args, machine_info())
    assert "| 1 node x 3 workers | 1 |" in text and "| 3 nodes x 1 worker |" in text
    assert "1.00x" in text  # the ratios are against the single node
