"""A three-node Broky cluster on this machine, with one command.

    .venv/bin/python examples/cluster/run.py                # etcd + 3 nodes, Ctrl-C stops them
    .venv/bin/python examples/cluster/run.py --nodes 4 --workers 1

It starts one etcd (Debian's ``etcd-server``; ``./run test`` installs it) on
its own data directory, then ``--nodes`` ``broky serve --cluster`` nodes
named ``node1``, ``node2``, ... on 127.0.0.1. Once every node is ready and
the map is settled (one version on every node, nothing moving, the 1,024
vbuckets balanced over every worker of every node), it prints the seeds to
give clients and the commands to try, then waits. Ctrl-C or SIGTERM stops the
nodes one after another with SIGTERM (each drains: it hands its vbuckets to
the nodes still running before it says Goodbye), then etcd, and removes the
data directory; a second Ctrl-C or SIGTERM kills the nodes left at once.

Ports are free ones by default (the printed lines say which), so it runs
beside a ``./run serve`` on 4777/9477. ``--port``, ``--metrics-port`` and
``--etcd-port`` choose them instead: the nodes' on consecutive ports from
the one given. A process that does not start (a port taken, say) is an
error that quotes the last line of its log and keeps the logs (the data
directory is kept whenever run.py fails). Every process is started in a new
session and stopped by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

READY = re.compile(rb"listening on (\S+):(\d+), metrics on (\S+):(\d+)")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"run.py: {what} not within {timeout:g} s")


class Processes:
    """What this script started, stopped in reverse order by pid."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes: dict[str, tuple[subprocess.Popen[bytes], int, int]] = {}  # id -> (proc, port, metrics)
        self.logs: list[IO[bytes]] = []
        self.hurry = False  # a second signal: kill what is left, no drain

    def failed(self, name: str, what: str) -> SystemExit:
        """`name` did not start: the last line of its log, and where the (kept) log is."""
        path = self.workdir / f"{name}.log"
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "(its log is empty)"
        return SystemExit(f"run.py: {name} {what}: {last}\nrun.py: see {path}")

    def log(self, name: str) -> IO[bytes]:
        f = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.logs.append(f)
        return f

    def start_etcd(self, client_port: int, peer_port: int) -> str:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise SystemExit("run.py: etcd not found (apt-get install etcd-server; ./run test installs it)")
        client, peer = f"http://{HOST}:{client_port}", f"http://{HOST}:{peer_port}"
        self.etcd = subprocess.Popen(
            [
                etcd, "--name", "example", "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"example={peer}", "--logger", "zap", "--log-outputs", "stderr",
            ],
            stdout=subprocess.DEVNULL, stderr=self.log("etcd"), start_new_session=True,
        )  # fmt: skip

        def healthy() -> bool:
            assert self.etcd is not None
            if self.etcd.poll() is not None:
                code = self.etcd.returncode
                raise self.failed("etcd", f"exited ({code}), ports {client_port} and {peer_port}")
            status, body = http_get(client_port, "/health")
            return status == 200 and b"true" in body

        wait_until(healthy, 20, f"etcd answering on {client}")
        return f"etcd://{HOST}:{client_port}/broky"

    def start_node(self, node_id: str, cluster: str, port: int, metrics_port: int, workers: int) -> None:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "broky", "serve", "--cluster", cluster, "--node-id", node_id,
                "--host", HOST, "--port", str(port), "--metrics-port", str(metrics_port),
                "--workers", str(workers),
            ],
            stdout=subprocess.PIPE, stderr=self.log(node_id), start_new_session=True,
        )  # fmt: skip
        self.nodes[node_id] = (proc, port, metrics_port)  # stopped by `stop` from now on
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready line, or EOF if it failed
        match = READY.search(line)
        if match is None:
            proc.wait(10)
            raise self.failed(node_id, "did not start")
        proc.stdout.close()
        self.nodes[node_id] = (proc, int(match.group(2)), int(match.group(4)))

    def settled(self) -> tuple[dict[str, Any], list[int]] | None:
        """The first node's cluster view and each node's vbuckets once every node serves one
        map of all nodes, nothing moving, every worker owning its share (1024 / workers,
        rounded either way: until the leader has moved vbuckets to a node that joined,
        the map holds them elsewhere); else None."""
        views = []
        for _, _, metrics in self.nodes.values():
            status, body = http_get(metrics, "/stats")
            if status != 200:
                return None
            views.append(json.loads(body)["cluster"])
        if len({v["map_version"] for v in views}) != 1 or any(v["map_moving"] for v in views):
            return None
        if any({m["node_id"] for m in v["members"]} != set(self.nodes) for v in views):
            return None
        shares = [n for v in views for n in v["vbuckets"]]
        low, high = 1024 // len(shares), -(-1024 // len(shares))
        if sum(shares) != 1024 or not all(low <= n <= high for n in shares):
            return None
        return views[0], [sum(v["vbuckets"]) for v in views]

    def kill_rest(self, signum: int, frame: Any) -> None:
        """A second Ctrl-C or SIGTERM while stopping: no more draining."""
        if not self.hurry:
            print("run.py: a second signal: killing the nodes left, without draining", flush=True)
        self.hurry = True
        for proc, _, _ in self.nodes.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for node_id in reversed(list(self.nodes)):  # one at a time: each drains into those left
            proc = self.nodes[node_id][0]
            if proc.poll() is None and not self.hurry:
                print(f"stopping {node_id} (pid {proc.pid}): drain, then Goodbye", flush=True)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(40)
                except subprocess.TimeoutExpired:
                    proc.kill()
            try:  # its workers share its process group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
            del self.nodes[node_id]
        if self.etcd is not None:
            self.etcd.terminate()
            try:
                self.etcd.wait(10)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait(5)
            self.etcd = None
        for f in self.logs:
            f.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="how many nodes (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="workers per node (default 2)")
    parser.add_argument("--port", type=int, help="first node's client port (default: free ports)")
    parser.add_argument("--metrics-port", type=int, help="first node's HTTP port (default: free ports)")
    parser.add_argument(
        "--etcd-port", type=int, help="etcd's client port, its peer port the next (default: free ports)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the data directory and logs at exit")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.workers < 1:
        parser.error("--nodes and --workers must be at least 1")

    def ports(first: int | None, count: int, pick: Callable[[], int]) -> list[int]:
        return [pick() for _ in range(count)] if not first else list(range(first, first + count))

    etcd_client, etcd_peer = ports(args.etcd_port, 2, free_port)
    # 0: each node binds a free port itself (no race) and says which in its ready line
    client_ports = ports(args.port, args.nodes, lambda: 0)
    metrics_ports = ports(args.metrics_port, args.nodes, lambda: 0)

    workdir = Path(tempfile.mkdtemp(prefix="broky-cluster-example-"))
    procs = Processes(workdir)

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    keep, status = args.keep, 0
    try:
        cluster = procs.start_etcd(etcd_client, etcd_peer)
        assert procs.etcd is not None
        print(f"etcd: {cluster}, pid {procs.etcd.pid} (data and logs in {workdir})", flush=True)
        for i in range(args.nodes):
            node_id = f"node{i + 1}"
            procs.start_node(node_id, cluster, client_ports[i], metrics_ports[i], args.workers)
            proc, port, metrics = procs.nodes[node_id]
            print(f"{node_id}: clients {HOST}:{port}, HTTP {HOST}:{metrics}, pid {proc.pid}", flush=True)
        wait_until(procs.settled, 60, "the nodes agreeing on one map")
        view, shares = procs.settled() or ({}, [])
        seeds = ",".join(f"{HOST}:{port}" for _, port, _ in procs.nodes.values())
        per_node = ", ".join(f"{n} {k}" for n, k in zip(procs.nodes, shares, strict=True))
        print(
            f"cluster ready: {len(procs.nodes)} nodes, map version {view.get('map_version')}, "
            f"leader {view.get('leader')}, seeds {seeds}\n"
            f"  vbuckets per node: {per_node}\n"
            f"  broky cluster status --cluster {cluster}\n"
            f"  broky sub --server {seeds} 'demo.>'\n"
            f"  broky pub --server {seeds} --partition tenant-1 demo.hello 'hi'\n"
            "Ctrl-C stops the nodes (each drains into the others), then etcd; a second Ctrl-C kills them.",
            flush=True,
        )
        exited: set[str] = set()
        while True:
            for node_id, (proc, _, _) in procs.nodes.items():
                if proc.poll() is not None and node_id not in exited:
                    exited.add(node_id)
                    keep = True  # the log says why: kept
                    print(f"{node_id} exited ({proc.returncode}); see {workdir}/{node_id}.log", flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:  # something did not start: its message points into the directory
        keep, status = True, 1
        print(exc.code, file=sys.stderr, flush=True)
        if args.port or args.metrics_port or args.etcd_port:
            print(
                "run.py: without --port, --metrics-port and --etcd-port it picks free ports", file=sys.stderr
            )
    finally:
        signal.signal(signal.SIGTERM, procs.kill_rest)
        signal.signal(signal.SIGINT, procs.kill_rest)
        procs.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"stopped; data and logs kept in {workdir}" if keep else "stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
