"""etcd and cluster nodes for the benchmarks (and the tests, through tests/support/cluster.py).

`EtcdServer` runs one etcd member (Debian's etcd-server, which `./run test`
installs) on free loopback ports with its own data directory, waits until its
/health answers, and can be paused (SIGSTOP), resumed, killed and restarted
on the same directory and ports, or wiped (`EtcdServer.wipe`: killed, its
data directory removed, a fresh member started on the same ports: every key,
lease and revision of the cluster is gone while its nodes run on).
`start_node` starts one `broky serve --cluster` node
(bench.harness.servers.start_broky), `ClusterRun` an etcd and named nodes
(killed, drained, started again). `cluster_view` reads the "cluster"
object of a node's /stats; `settled` says when the nodes agree on one map,
and `agreed` also that it is the map etcd holds. Everything is stopped by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from bench.harness.servers import Server, free_port, start_broky
from broky.protocol.routing import VBucketMap

T = TypeVar("T")
ETCD = shutil.which("etcd") or "etcd"  # Debian's etcd-server; `./run test` installs it


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Call `check` until it returns something other than None/False; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            got = check()
        except (OSError, ValueError, AssertionError) as exc:
            last = exc
        else:
            if got is not None and got is not False:
                return got
            last = got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what} (last: {last!r})")
        time.sleep(interval)


def http_get(port: int, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class EtcdServer:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="broky-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(os.path.join(self.dir, "etcd.log"), "ab")  # noqa: SIM115
        self.paused = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "/broky") -> str:
        return f"etcd://{self.endpoint}{prefix}"

    def start(self, timeout: float = 15.0) -> EtcdServer:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [
                ETCD, "--name", "test", "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--logger", "zap", "--log-outputs", "stderr",
            ],
            stdout=self.log, stderr=self.log, cwd=self.dir, start_new_session=True,
        )  # fmt: skip
        wait_for(self._healthy, timeout, f"etcd answering on {client}")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with status {self.proc.returncode}")
        status, body = http_get(self.client_port, "/health", timeout=1.0)
        return status == 200 and b"true" in body

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    def wipe(self, down: float = 0.0, timeout: float = 15.0) -> tuple[float, float]:
        """etcd loses its data under a running cluster: SIGKILL it, remove its data
        directory, wait `down` seconds, then start a fresh, empty member on the same
        ports (a new etcd cluster: no member keys, no map, no leases, revisions from 1).
        Returns the wall-clock times (time.time()) of the kill and of the fresh etcd's
        first healthy answer.

        Raises:
            AssertionError: the fresh etcd did not answer within `timeout` seconds.
        """
        self.kill()
        wiped_at = time.time()
        shutil.rmtree(os.path.join(self.dir, "data"), ignore_errors=True)
        if down > 0:
            time.sleep(down)
        self.start(timeout)
        return wiped_at, time.time()

    def stop(self) -> None:
        self.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_node(
    cluster_url: str, node_id: str, workers: int = 2, lease_ttl: int | None = None, *extra: str
) -> Server:
    """One `broky serve --cluster` node on free loopback ports (ready: registered, map applied)."""
    args = ["--cluster", cluster_url, "--node-id", node_id, "--log-level", "info", *extra]
    if lease_ttl is not None:
        args += ["--lease-ttl", str(lease_ttl)]
    return start_broky(workers, args, timeout=60.0)


def cluster_view(node: Server) -> dict[str, Any]:
    """The "cluster" object of the node's /stats."""
    status, body = http_get(node.metrics_port, "/stats")
    if status != 200:
        raise OSError(f"/stats answered {status}")
    view: dict[str, Any] = json.loads(body)["cluster"]
    return view


def settled(nodes: dict[str, Server]) -> dict[str, dict[str, Any]] | None:
    """Every node runs one committed map of exactly these nodes, all serving: their views."""
    return settled_views({node_id: cluster_view(node) for node_id, node in nodes.items()})


def settled_views(views: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """`views` (node id -> /stats "cluster") if every node runs one committed map, balanced
    over the workers, and sees exactly these nodes as serving members; else None.
    (Balanced: a leader settling after a join runs an older map for a moment, which would
    otherwise pass for the final one.)"""
    if len({v["map_version"] for v in views.values()}) != 1:
        return None
    for v in views.values():
        if v["map_moving"] or not v["etcd_connected"]:
            return None
        if {m["node_id"]: m["state"] for m in v["members"]} != dict.fromkeys(views, "serving"):
            return None
    counts = [n for v in views.values() for n in v["vbuckets"]]
    if sum(counts) != 1024 or max(counts) - min(counts) > 1:
        return None
    return views


def current_map(etcd: EtcdServer, prefix: str = "/broky") -> VBucketMap:
    """The map etcd holds under `prefix` (the cluster's agreed map)."""
    from broky.cluster.etcd import Etcd  # the cluster extra

    async def read() -> VBucketMap:
        client = Etcd(("127.0.0.1", etcd.client_port), 3.0)
        try:
            kv = await client.get(f"{prefix}/map")
        finally:
            await client.close()
        if kv is None:
            raise AssertionError(f"no map under {prefix}")
        return VBucketMap.from_json(json.loads(kv.value))

    return asyncio.run(read())


def agreed(etcd: EtcdServer, nodes: dict[str, Server], prefix: str = "/broky") -> VBucketMap | None:
    """The map etcd holds once every node settled on it (`settled`), else None. After
    `EtcdServer.wipe` the nodes look settled on the map they ran before etcd holds any:
    wait_for(lambda: agreed(etcd, nodes), ...) waits until the map is back in etcd too.

    Raises:
        AssertionError: etcd holds no map (wait_for retries it).
    """
    views = settled(nodes)
    if views is None:
        return None
    vmap = current_map(etcd, prefix)
    return vmap if {v["map_version"] for v in views.values()} == {vmap.version} else None


class ClusterRun:
    """etcd and named nodes (`workers` each, `lease_ttl`, `node_args`); every process stopped
    by pid at `stop`. With `keep_ports`, each node has ports of its own that it keeps when
    it is started again (a node restarted under its old id, at its old address); else a
    node started again gets new ones."""

    def __init__(
        self, workers: int = 2, lease_ttl: int | None = None, *node_args: str, keep_ports: bool = False
    ) -> None:
        self.etcd = EtcdServer().start()
        self.url = self.etcd.url()
        self.workers = workers
        self.lease_ttl = lease_ttl
        self.node_args = node_args
        self.nodes: dict[str, Server] = {}
        self.ports: dict[str, tuple[int, int]] | None = {} if keep_ports else None

    def start(self, node_id: str) -> Server:
        args = self.node_args
        if self.ports is not None:
            port, metrics = self.ports.setdefault(node_id, (free_port(), free_port()))
            args += ("--port", str(port), "--metrics-port", str(metrics))
        node = start_node(self.url, node_id, self.workers, self.lease_ttl, *args)
        self.nodes[node_id] = node
        return node

    def pids(self, node_id: str) -> list[int]:
        """The node's master and workers."""
        return self.nodes[node_id].pids()

    def seeds(self, *node_ids: str) -> str:
        return ",".join(f"{self.nodes[n].host}:{self.nodes[n].port}" for n in node_ids or self.nodes)

    def kill(self, node_id: str) -> float:
        """SIGKILL the node's master and workers (its process group); the time of the kill."""
        node = self.nodes.pop(node_id)
        killed_at = time.time()
        os.killpg(node.pid, signal.SIGKILL)
        assert node.proc is not None
        node.proc.wait(10)
        node.stop()
        return killed_at

    def leave(self, node_id: str, timeout: float = 60.0) -> int:
        """SIGTERM: the node drains (hands its vbuckets over), says Goodbye and exits."""
        node = self.nodes.pop(node_id)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        code = node.proc.wait(timeout)
        node.stop()
        return code

    def wait_settled(self, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
        return wait_for(
            lambda: settled(self.nodes), timeout, f"nodes {sorted(self.nodes)} settled on one map"
        )

    def leader(self) -> str:
        views = self.wait_settled()
        leaders = {v["leader"] for v in views.values()}
        assert len(leaders) == 1, views
        return str(leaders.pop())

    def map(self) -> VBucketMap:
        return current_map(self.etcd)

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{node.log()}" for n, node in self.nodes.items())

    def stop(self) -> None:
        for node_id in list(self.nodes):
            node = self.nodes.pop(node_id)
            if node.proc is not None and node.proc.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)  # a SIGTERM would drain into nodes stopping too
            node.stop()
        self.etcd.stop()
