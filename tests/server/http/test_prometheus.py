"""A real Prometheus scrapes a real `broky serve` and reads back what was published.

Starts Debian's `prometheus` (installed by ./run) on a free loopback port with
a temporary config scraping the broker's metrics port every second and a
temporary storage directory, and stops it by its pid.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import requires
from tests.support.paths import ROOT
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

pytestmark = pytest.mark.prometheus
DASHBOARD = ROOT / "grafana" / "broky-dashboard.json"

CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: broky
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, target_port: int) -> None:
        binary = requires.program("prometheus")
        self.dir = Path(tempfile.mkdtemp(prefix="broky-prometheus-"))
        (self.dir / "prometheus.yml").write_text(CONFIG.format(port=target_port))
        self.port = _free_port()
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.logs()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready in {timeout} s:\n{self.logs()}"
            time.sleep(0.1)

    def query(self, expr: str) -> float | None:
        """The value of a scalar-like instant query (None: no series yet)."""
        result = self.api("query", query=expr)["result"]
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def wait_for(self, expr: str, expected: float, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        got: float | None = None
        while time.monotonic() < deadline:
            got = self.query(expr)
            if got == expected:
                return
            time.sleep(0.2)
        raise AssertionError(f"{expr} = {got}, expected {expected}\n{self.logs()}")

    def logs(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def prometheus(server: ServerProcess) -> Iterator[Prometheus]:
    prom = Prometheus(server.metrics_port)
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()


def test_prometheus_reads_back_the_published_count(server: ServerProcess, prometheus: Prometheus) -> None:
    n, unheard = 1000, 37
    kps = [kp_for_worker(w, 2) for w in (0, 1)]
    wires = [Wire.hello(server.address, worker=w, name=f"prom-{w}") for w in (0, 1)]
    try:
        for w in wires:
            w.subscribe(1, b"clicks.>")  # all-partition: one per worker
            w.flush()
        for i in range(n):
            k = i % 2
            wires[k].publish(kps[k], b"clicks.page", b"%d" % i)
        for _ in range(unheard):
            wires[0].publish(kps[0], b"nobody.listens", b"x")
        received = sum(len(w.messages()) for w in wires)
        assert received == n
        prometheus.wait_for('count(up{job="broky"} == 1)', 1)
        prometheus.wait_for("sum(broky_messages_published_total)", n + unheard)
        prometheus.wait_for("sum(broky_messages_delivered_total)", n)
        prometheus.wait_for('sum(broky_messages_dropped_total{reason="no_subscribers"})', unheard)
        assert prometheus.query('broky_messages_published_total{worker="1"}') == n // 2
        assert prometheus.query("sum(broky_connections)") == 2
        assert prometheus.query("sum(broky_subscriptions)") == 2
        p99 = prometheus.query("histogram_quantile(0.99, sum by (le) (broky_broker_latency_seconds_bucket))")
        assert p99 is not None and 0 < p99 < 10
        # The process metrics of the master and each worker, and Prometheus' own scrapes.
        prometheus.wait_for("count(process_cpu_seconds_total)", 3)
        assert prometheus.query('count(process_resident_memory_bytes{process=~"master|worker-[01]"})') == 3
        prometheus.wait_for('count(broky_http_requests_total{method="get",code="200"} > 0)', 1)
        check_dashboard(prometheus)
        check_promtool(server)
    finally:
        for w in wires:
            w.close()


def check_dashboard(prometheus: Prometheus) -> None:
    """Every query of the Grafana dashboard is valid PromQL over series that exist."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    # Every panel has series on a healthy server that refused nothing (the counters by error
    # code are at 0 from the start), once rate() over a 10 s window has two scrapes (1 s
    # apart) after the traffic.
    deadline = time.monotonic() + 30
    while True:
        empty = []
        for expr in exprs:
            concrete = expr.replace("$__rate_interval", "10s").replace("$instance", ".*")
            result = prometheus.api("query", query=concrete)["result"]  # raises unless valid
            if not result:
                empty.append(expr)
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not empty, empty


def check_promtool(server: ServerProcess) -> None:
    """promtool's lint finds nothing to say about a scrape."""
    url = f"http://{server.host}:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read()
    done = subprocess.run(
        [requires.program("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b""), done
