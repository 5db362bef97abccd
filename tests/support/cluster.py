"""Real etcd and real `broky serve --cluster` nodes for the tests.

`EtcdServer` (bench.harness.cluster, shared with the benchmarks) runs one
etcd member on free loopback ports with its own data directory. `Cluster`
starts nodes against it (tests.support.serverproc.ServerProcess with --cluster,
--node-id and short timeouts), reads their /stats and /readyz, runs `broky cluster status --json`, and reads
the whole history of the map key from etcd (`map_history`: etcd keeps every
revision until it is compacted, and these tests never compact). Everything is
stopped by pid: nodes with SIGKILL on their process group (a SIGTERM would
drain), then etcd. The `cluster` fixture (a Cluster on an etcd of its own) is
every test module's, through tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.harness.cluster import EtcdServer, http_get, settled_views, wait_for
from bench.harness.servers import free_port
from broky.protocol.routing import NO_OWNER, VBucketMap, vbucket_of
from tests.support import requires
from tests.support.serverproc import ServerProcess

__all__ = ["EtcdServer", "free_port", "http_get", "wait_for"]  # tests import them from here


def run_etcd(call: Callable[[Any], Any], endpoint: str, timeout: float = 3.0) -> Any:
    """Run `await call(etcd)` with a broky.cluster.etcd.Etcd on `endpoint` (host:port)."""
    from broky.cluster.etcd import Etcd

    host, port = endpoint.rsplit(":", 1)

    async def main() -> Any:
        etcd = Etcd((host, int(port)), timeout)
        try:
            return await call(etcd)
        finally:
            await etcd.close()

    return asyncio.run(main())


def map_history(endpoint: str, prefix: str = "/broky", timeout: float = 10.0) -> list[VBucketMap]:
    """Every map ever written under `prefix`, in the order of etcd's revisions."""
    key = f"{prefix}/map"

    async def read(etcd: Any) -> list[VBucketMap]:
        current = await etcd.get(key)
        if current is None:
            return []
        maps: list[VBucketMap] = []

        async def collect() -> None:
            async for event in etcd.watch(key, 1):
                if event.kv.key != key or event.kind != "put":
                    continue
                maps.append(VBucketMap.from_json(json.loads(event.kv.value)))
                if event.kv.mod_revision >= current.mod_revision:
                    return

        await asyncio.wait_for(collect(), timeout)
        return maps

    result: list[VBucketMap] = run_etcd(read, endpoint)
    return result


def agreed_history(
    endpoint: str, settled: Callable[[], dict[str, dict[str, Any]] | None], prefix: str = "/broky"
) -> list[VBucketMap] | None:
    """The map history if etcd holds a map and every node settled on it (`settled`: their
    /stats "cluster" objects once settled), else None. After etcd lost its data the nodes
    look settled on the map they ran well before the leader writes one: this waits for it."""
    history = map_history(endpoint, prefix)
    views = settled()
    if not history or views is None:
        return None
    return history if {v["map_version"] for v in views.values()} == {history[-1].version} else None


def moving(vmap: VBucketMap) -> dict[str, int]:
    """Vbuckets prepared to move, by the node they move to."""
    out: dict[str, int] = {}
    for i in vmap.incoming or ():
        if i != NO_OWNER:
            node = vmap.nodes[i[0]].node_id
            out[node] = out.get(node, 0) + 1
    return out


def owners_by_id(vmap: VBucketMap) -> list[tuple[str, int]]:
    return [(vmap.nodes[n].node_id, w) for n, w in vmap.owners]


def moved_between(a: VBucketMap, b: VBucketMap) -> int:
    return sum(1 for x, y in zip(owners_by_id(a), owners_by_id(b)) if x != y)


def kp_owned_by(vmap: VBucketMap, node_id: str, worker: int, prefix: str = "kp") -> bytes:
    """A key_partition whose vbucket `vmap` gives to (node_id, worker)."""
    index = vmap.node_index(node_id)
    for i in range(100_000):
        kp = f"{prefix}-{i}".encode()
        if vmap.owners[vbucket_of(kp)] == (index, worker):
            return kp
    raise AssertionError(f"no key_partition owned by {node_id}/{worker}")


class Cluster:
    """Nodes of one cluster (one prefix of one etcd), with short timeouts for the tests."""

    def __init__(
        self,
        etcd: EtcdServer,
        prefix: str = "/broky",
        lease_ttl: int = 2,
        move_timeout: float = 4.0,
        drain_timeout: float = 20.0,
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.url = etcd.url(prefix)
        self.lease_ttl = lease_ttl
        self.move_timeout = move_timeout
        self.drain_timeout = drain_timeout
        self.nodes: dict[str, ServerProcess] = {}

    def start(self, node_id: str, *args: str, workers: int = 2) -> ServerProcess:
        server = ServerProcess(
            "--cluster", self.url, "--node-id", node_id,
            "--lease-ttl", str(self.lease_ttl), "--move-timeout", str(self.move_timeout),
            "--drain-timeout", str(self.drain_timeout), *args,
            workers=workers,
        )  # fmt: skip
        self.nodes[node_id] = server
        return server.start(timeout=30.0)

    def kill(self, node_id: str) -> None:
        """SIGKILL a node's master and workers (its process group)."""
        server = self.nodes.pop(node_id)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        server.stop()

    def leave(self, node_id: str, timeout: float = 60.0) -> int:
        """SIGTERM: the node drains (hands its vbuckets over), says Goodbye and exits; its status."""
        server = self.nodes.pop(node_id)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout)
        server.stop()
        return code

    def stop(self) -> None:
        for node_id in list(self.nodes):
            server = self.nodes[node_id]
            if server.proc is not None and server.proc.poll() is None:
                self.kill(node_id)
            else:
                self.nodes.pop(node_id).stop()

    def stats(self, node_id: str) -> dict[str, Any]:
        status, body = http_get(self.nodes[node_id].metrics_port, "/stats")
        assert status == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def readyz(self, node_id: str) -> tuple[int, str]:
        status, body = http_get(self.nodes[node_id].metrics_port, "/readyz")
        return status, body.decode()

    def status(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "broky", "cluster", "status", "--cluster", self.url, *args],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    def status_json(self) -> dict[str, Any]:
        done = self.status("--json")
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def settled(self, *node_ids: str) -> dict[str, dict[str, Any]] | None:
        """The nodes' /stats "cluster" objects once they settled (bench.harness.cluster.settled_views):
        every node's, or those of `node_ids` (the others stopped)."""
        return settled_views({node_id: self.stats(node_id)["cluster"] for node_id in node_ids or self.nodes})

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Every node's /readyz answers 200 (each waited for up to `timeout` seconds)."""
        for node_id in self.nodes:
            wait_for(lambda node_id=node_id: self.readyz(node_id)[0] == 200, timeout, f"{node_id} ready")  # type: ignore[misc]

    def wait_settled(self, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        return wait_for(self.settled, timeout, f"nodes {sorted(self.nodes)} settled on one map")

    def history(self) -> list[VBucketMap]:
        return map_history(self.etcd.endpoint, self.prefix)

    def wait_agreed(self, timeout: float = 60.0) -> list[VBucketMap]:
        """Wait until etcd holds a map and every node settled on it: the map history."""
        return wait_for(
            lambda: agreed_history(self.etcd.endpoint, self.settled, self.prefix),
            timeout,
            f"nodes {sorted(self.nodes)} settled on the map in etcd",
        )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A Cluster (no node started yet) on an etcd of its own: leases of 2 s, moves committed
    within 4 s. tests/conftest.py makes it every module's `cluster` (a module may define
    its own)."""
    requires.program("etcd")
    etcd = EtcdServer().start()
    c = Cluster(etcd, lease_ttl=2, move_timeout=4.0)
    try:
        yield c
    finally:
        c.stop()
        etcd.stop()


def assert_versions_grow(history: list[VBucketMap]) -> None:
    """Map versions strictly increase, one write per version: no version carries two maps."""
    versions = [m.version for m in history]
    assert versions == sorted(set(versions)), versions
    assert versions == list(range(versions[0], versions[0] + len(versions))), versions


def assert_every_move_prepared(history: list[VBucketMap]) -> None:
    """No map moves anything in one step: every vbucket whose owner changes from one map
    to the next was named, with that new owner, by the earlier map's `incoming` (a prepare)."""
    for before, after in itertools.pairwise(history):
        old, new = owners_by_id(before), owners_by_id(after)
        changed = [vb for vb in range(len(new)) if old[vb] != new[vb]]
        if not changed:
            continue
        assert before.incoming is not None, (
            f"map version {after.version} moves {len(changed)} vbuckets that version {before.version} "
            "did not prepare"
        )
        incoming = [None if i == NO_OWNER else (before.nodes[i[0]].node_id, i[1]) for i in before.incoming]
        unprepared = [vb for vb in changed if incoming[vb] != new[vb]]
        assert not unprepared, (
            f"map version {after.version} moves {len(unprepared)} vbuckets (e.g. {unprepared[:5]}) to "
            f"owners that version {before.version} did not prepare"
        )


def applied_versions(log: str) -> list[int]:
    """The map versions a node applied, in order, from its log (ClusterNode._apply)."""
    return [int(m) for m in re.findall(r"applied map version (\d+): \d+ vbuckets owned here", log)]
