"""A three-node Broky cluster on this machine, with one command.

    .venv/bin/python examples/cluster/run.py                # etcd + 3 nodes, Ctrl-C stops them
    .venv/bin/python examples/cluster/run.py --nodes 4 --workers 1

It starts one etcd (Debian's ``etcd-server``; ``./run test`` installs it) on
its own data directory, then ``--nodes`` ``broky serve --cluster`` nodes
named ``node1``, ``node2``, ... on consecutive ports from ``--port`` (clients)
and ``--metrics-port`` (HTTP), all on 127.0.0.1. Once every node is ready and
the nodes agree on one map, it prints the seeds to give clients and the
commands to try, then waits. Ctrl-C (or SIGTERM) stops the nodes one after
another with SIGTERM (each drains: it hands its vbuckets to the nodes still
running before it says Goodbye), then etcd, and removes the data directory.

Ports already taken are an error; ``--port 0`` picks free ports for
everything (the printed seeds say which). Every process is started in a new
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

    def log(self, name: str) -> IO[bytes]:
        f = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.logs.append(f)
        return f

    def start_etcd(self, client_port: int, peer_port: int) -> str:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise SystemExit("run.py: etcd not found (apt-get install etcd-server, or ./run test)")
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
                raise SystemExit(f"run.py: etcd exited ({self.etcd.returncode}); see {self.workdir}/etcd.log")
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
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready line, or EOF if it failed
        match = READY.search(line)
        if match is None:
            proc.wait(10)
            raise SystemExit(f"run.py: {node_id} did not start; see {self.workdir}/{node_id}.log")
        proc.stdout.close()
        self.nodes[node_id] = (proc, int(match.group(2)), int(match.group(4)))

    def settled(self) -> dict[str, Any] | None:
        """Every node serves one map of all nodes, nothing moving: the /stats of the first, else None."""
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
        return views[0] if sum(sum(v["vbuckets"]) for v in views) == 1024 else None

    def stop(self) -> None:
        for node_id in reversed(list(self.nodes)):  # one at a time: each drains into those left
            proc = self.nodes.pop(node_id)[0]
            if proc.poll() is None:
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
    parser.add_argument("--port", type=int, default=4777, help="first node's client port; 0 = free ports")
    parser.add_argument("--metrics-port", type=int, default=9477, help="first node's HTTP port")
    parser.add_argument("--etcd-port", type=int, default=2379, help="etcd's client port (peer: the next one)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory and logs at exit")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.workers < 1:
        parser.error("--nodes and --workers must be at least 1")

    def ports(first: int, count: int) -> list[int]:
        return [free_port() for _ in range(count)] if args.port == 0 else list(range(first, first + count))

    etcd_client, etcd_peer = ports(args.etcd_port, 2)
    client_ports, metrics_ports = ports(args.port, args.nodes), ports(args.metrics_port, args.nodes)

    workdir = Path(tempfile.mkdtemp(prefix="broky-cluster-example-"))
    procs = Processes(workdir)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
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
        view = procs.settled() or {}
        seeds = ",".join(f"{HOST}:{port}" for _, port, _ in procs.nodes.values())
        print(
            f"cluster ready: {len(procs.nodes)} nodes, map version {view.get('map_version')}, "
            f"leader {view.get('leader')}, seeds {seeds}\n"
            f"  broky cluster status --cluster {cluster}\n"
            f"  broky sub --server {seeds} 'demo.>'\n"
            f"  broky pub --server {seeds} --partition tenant-1 demo.hello 'hi'\n"
            "Ctrl-C stops the nodes (each drains into the others), then etcd.",
            flush=True,
        )
        while True:
            for node_id, (proc, _, _) in procs.nodes.items():
                if proc.poll() is not None:
                    print(f"{node_id} exited ({proc.returncode}); see {workdir}/{node_id}.log", flush=True)
                    procs.nodes.pop(node_id)
                    break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        procs.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
