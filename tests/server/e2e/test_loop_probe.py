"""The workers' debug probe (broky.server.worker.loopprobe, BROKY_LOOP_PROBE) against a real
server: each worker writes what held its loop when it stops, and start-up's objects are
out of the collector's sight (gc.freeze, broky.server.worker.process)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from broky.protocol import Read
from tests.support.wire import Wire, kp_for_worker


def test_each_worker_reports_its_jobs_and_its_frozen_start_up(start_server: Any, tmp_path: Path) -> None:
    prefix = tmp_path / "probe"
    server = start_server(workers=1, env={"BROKY_LOOP_PROBE": str(prefix)})
    kp = kp_for_worker(0, 1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as sub:
        sub.subscribe(1, b"p.>")
        sub.flush()
        for i in range(20):
            pub.publish(kp, b"p.k", b"%d" % i)
        pub.flush()
        assert len(sub.messages()) == 20
        sub.send(Read(1, b">", kp))
        sub.flush()
        time.sleep(0.3)  # a tick
    server.stop()
    report = json.loads(Path(f"{prefix}-worker-0.json").read_text())
    jobs = report["jobs"]
    assert jobs["read"]["count"] >= 5 and jobs["tick"]["count"] >= 1 and jobs["bounded_read"]["count"] == 1
    for job in jobs.values():
        assert 0 < job["p50_us"] <= job["p99_us"] <= job["max_us"] and job["cpu_max_us"] > 0
    assert report["gc_frozen"] > 1000 and report["gc_objects"] < report["gc_frozen"]
    assert report["gc_full_us"] > 0
