"""Server CPU per delivered message, 1 publisher -> N subscribers (a check, not a test).

    .venv/bin/python scripts/server_cpu.py [--subscribers 1] [--payload 100] [--messages 1000000]

Runs the same load against a real `broky serve --workers 1` and, in the same
run, a redis-server: N raw subscriber sockets that only count bytes, one
publisher writing pre-encoded messages as fast as TCP takes them. Reads each
server's CPU time (/proc/<pid>/stat utime+stime, master and worker for Broky)
around the run and prints server CPU microseconds per delivered message,
deliveries per second and the Broky/Redis ratio. On a shared machine the
absolute figures drift from run to run (other processes take the CPUs, the
clock scales); both servers run in the same run on the same machine, so the
ratio is the steadier figure: quote it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import peers, servers
from bench.harness.procstat import total_cpu_seconds as cpu_seconds
from broky.protocol import encode_message
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire

Result = tuple[float, float, int]  # seconds, server CPU seconds, bytes received by all subscribers


def run_load(pids: list[int], subs: list[socket.socket], pub: socket.socket, batch: bytes, batches: int,
             per_sub: int) -> Result:  # fmt: skip
    """Publish `batches` x batch while every subscriber counts bytes until per_sub."""
    counts = [0] * len(subs)

    def drain(i: int) -> None:
        sock = subs[i]
        sock.settimeout(60)
        while counts[i] < per_sub:
            data = sock.recv(1 << 20)
            if not data:
                return
            counts[i] += len(data)

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(subs))]
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    for t in threads:
        t.start()
    for _ in range(batches):
        pub.sendall(batch)
    for t in threads:
        t.join(120)
    return time.perf_counter() - t0, cpu_seconds(pids) - cpu0, sum(counts)


def broky_run(args: argparse.Namespace, n: int) -> Result:
    server = ServerProcess(workers=1).start()
    try:
        frame = encode_message(b"p", b"bench.key", b"x" * args.payload)
        subs = [Wire.hello(server.address, worker=0) for _ in range(args.subscribers)]
        for w in subs:
            w.subscribe(1, b"bench.*")
            w.flush()
        pub = Wire.hello(server.address, worker=0)
        pids = [server.pid, *server.worker_pids()]
        socks = [w.sock for w in subs]
        elapsed, cpu, got = run_load(
            pids, socks, pub.sock, frame * args.batch, n // args.batch, n * len(frame)
        )
        for w in [*subs, pub]:
            w.close()
        return elapsed, cpu, got // len(frame)
    finally:
        server.stop()


def resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _discard(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 20):
            pass
    except OSError:
        pass


def redis_run(args: argparse.Namespace, n: int) -> Result:
    # the benchmarks' Redis peer: persists nothing, runs in a directory of its own
    server = servers.start_redis(binary=peers.system_binary("redis-server"))
    port = server.port
    try:
        payload = b"x" * args.payload
        subs = []
        for _ in range(args.subscribers):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(resp(b"SUBSCRIBE", b"bench.key"))
            s.recv(1024)
            subs.append(s)
        delivery = len(resp(b"message", b"bench.key", payload))
        pub = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=_discard, args=(pub,), daemon=True).start()  # the ":N" replies
        batch = resp(b"PUBLISH", b"bench.key", payload) * args.batch
        elapsed, cpu, got = run_load(server.pids(), subs, pub, batch, n // args.batch, n * delivery)
        for s in [*subs, pub]:
            s.close()
        return elapsed, cpu, got // delivery
    finally:
        server.stop()


def report(name: str, n: int, subs: int, result: Result) -> float:
    elapsed, cpu, delivered = result
    if delivered != n * subs:
        print(f"warning: {name} delivered {delivered} of {n * subs}", file=sys.stderr)
    per = cpu / max(delivered, 1) * 1e6
    print(
        f"{name:6} 1 -> {subs}: {delivered} deliveries in {elapsed:.2f} s = "
        f"{delivered / elapsed / 1e3:.0f}k/s; server CPU {cpu:.2f} s = {per:.2f} us per delivery"
    )
    return per


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--subscribers", type=int, default=1)
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=500, help="messages per publisher write")
    parser.add_argument("--no-redis", action="store_true", help="skip the redis-server run")
    args = parser.parse_args()
    n = args.messages - args.messages % args.batch
    print(f"{n} messages, {args.payload} B payload")
    broky = report("broky", n, args.subscribers, broky_run(args, n))
    if not args.no_redis:
        redis = report("redis", n, args.subscribers, redis_run(args, n))
        print(f"broky / redis server CPU per delivery: {broky / redis:.2f}")


if __name__ == "__main__":
    main()
