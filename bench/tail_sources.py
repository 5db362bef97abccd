"""Broky's own tail sources, timed inside the workers under a steady SDK load.

    python -m bench.tail_sources [--rate 20000] [--seconds 20] [--workers 2]
                                 [--reads 0] [--read-every 0.5] [--serve-args "..."]
                                 [--env NAME=VALUE ...] [--json FILE]

Starts `broky serve` with BROKY_LOOP_PROBE set (broky.server.worker.loopprobe: each
worker times its own jobs: reads, the garbage collector by generation, the
tick and what it does, control messages, bounded reads), then for
`--seconds`:
  - one SDK publisher process publishes `--rate` messages/s of 100 B over
    256 key_partitions, paced every millisecond (open loop);
  - one SDK subscriber process takes them all (`cpu.>`);
  - one raw connection per worker sends a Ping every 5 ms and times its Pong
    (how long the worker's loop made it wait, plus the network and this
    process: an end-to-end check of what the workers report);
  - with `--reads N`: one raw connection to worker 0 sends, every
    `--read-every` s, N Read frames (each the retained messages of one
    key_partition, from the oldest: as bench/soak.py's fuzz does) and a Ping
    in one write, and times that Pong (the Ping waits behind the N Reads).
Then it stops the server and prints, per worker and job: count, p50, p99,
max and the share of the run's time the job held the loop; the master's and
the workers' context switches over the load (wake-ups: the publish path should
cause none in the master); and the Pong times. Figures: bench/README.md, "Tail
sources".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import options, procstat, roles, servers, tlsclient
from broky.protocol import FrameReader, Hello, Ping, Pong, Read, decode_frame, encode_frame
from broky.protocol.message import BODY_MESSAGE, body_type

PARTS = 256
SIZE = 100


def _partitions() -> list[bytes]:
    return [b"tenant-%d" % i for i in range(PARTS)]


# ------------------------------------------------------------ client processes


async def _publisher(address: str, rate: int, seconds: float) -> dict[str, Any]:
    import broky

    names = _partitions()
    payload = b"x" * SIZE
    sent = 0
    async with broky.connect(address) as client:
        start = time.monotonic()
        end = start + seconds
        while (now := time.monotonic()) < end:
            due = int((now - start) * rate)
            while sent < due:
                await client.publish(b"cpu.k", payload, partition=names[sent % PARTS])
                sent += 1
            await asyncio.sleep(0.001)
        await client.flush()
    return {"published": sent}


async def _subscriber(address: str, seconds: float) -> dict[str, Any]:
    import broky

    got = 0
    async with broky.connect(address) as client:
        sub = await client.subscribe("cpu.>")
        roles.ready()
        it = sub.__aiter__()
        deadline = time.monotonic() + seconds + 30
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(it.__anext__(), 3.0 if got else 30.0)
            except (TimeoutError, StopAsyncIteration):
                break
            got += 1
    return {"received": got}


def _role(args: argparse.Namespace) -> int:
    if args.role == "pub":
        return roles.done(asyncio.run(_publisher(args.address, args.rate, args.seconds)))
    return roles.done(asyncio.run(_subscriber(args.address, args.seconds)))


# ------------------------------------------------------------ raw connections


class Raw:
    """A raw connection to one worker: frames out, frames in."""

    def __init__(self, address: tuple[str, int], worker: int) -> None:
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = FrameReader()
        self.sock.sendall(encode_frame(Hello(worker=worker, client_name="tail-sources")))
        self.welcome = self.next()

    def next_raw(self) -> bytes:
        """The next whole frame's bytes, reading as needed."""
        return tlsclient.next_frame(self.sock, self.reader)

    def next(self) -> Any:
        return decode_frame(self.next_raw())

    def until_pong(self, ping: int) -> dict[str, int]:
        """Frames until the Pong to `ping`, by type (Messages counted, not decoded)."""
        seen: dict[str, int] = {}
        while True:
            raw = self.next_raw()
            if body_type(raw, 0, len(raw)) == BODY_MESSAGE:
                seen["Message"] = seen.get("Message", 0) + 1
                continue
            frame = decode_frame(raw)
            if isinstance(frame, Pong) and frame.id == ping:
                return seen
            name = type(frame).__name__
            seen[name] = seen.get(name, 0) + 1


def _pinger(address: tuple[str, int], worker: int, stop: threading.Event, out: list[int]) -> None:
    raw = Raw(address, worker)
    n = 0
    while not stop.is_set():
        n += 1
        t = time.perf_counter_ns()
        raw.sock.sendall(encode_frame(Ping(n)))
        raw.until_pong(n)
        out.append(time.perf_counter_ns() - t)
        time.sleep(0.005)
    raw.sock.close()


def _reader(
    address: tuple[str, int], reads: int, every: float, stop: threading.Event, out: list[dict[str, Any]]
) -> None:
    raw = Raw(address, 0)
    vmap = raw.welcome.map
    mine = [kp for kp in _partitions() if vmap.owner(kp)[1] == 0]
    rid = n = 0
    while not stop.wait(every):
        frames = []
        for _ in range(reads):
            rid += 1  # one key_partition's retained messages, from the oldest
            frames.append(encode_frame(Read(rid, b">", mine[rid % len(mine)], start_time=1)))
        n += 1
        t = time.perf_counter_ns()
        raw.sock.sendall(b"".join(frames) + encode_frame(Ping(n)))
        seen = raw.until_pong(n)
        out.append({"pong_ns": time.perf_counter_ns() - t, "seen": seen})
    raw.sock.close()


def _quantiles(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {}
    s = sorted(ns)
    n = len(s)
    return {
        "count": n,
        "p50_us": s[n // 2] / 1e3,
        "p99_us": s[min(n - 1, n * 99 // 100)] / 1e3,
        "max_us": s[-1] / 1e3,
    }


# ------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = os.path.join(tempfile.mkdtemp(prefix="tails-"), "probe")
    env = dict(item.split("=", 1) for item in args.env) | {"BROKY_LOOP_PROBE": prefix}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        server = servers.start_broky(args.workers, shlex.split(args.serve_args))
    finally:
        for name, was in saved.items():
            if was is None:
                del os.environ[name]
            else:
                os.environ[name] = was
    result: dict[str, Any] = {
        "rate": args.rate,
        "seconds": args.seconds,
        "serve_args": args.serve_args,
        "env": args.env,
    }
    procs: list[roles.Role] = []
    try:
        me = (
            "bench.tail_sources",
            "--address",
            f"{servers.HOST}:{server.port}",
            "--seconds",
            str(args.seconds),
        )
        sub = roles.start(procs, *me, "--role", "sub", what="the subscriber")
        pids = {"master": server.pid} | {
            f"worker-{i}": p for i, p in enumerate(procstat.children(server.pid))
        }
        before = {name: procstat.context_switches(p) for name, p in pids.items()}
        stop = threading.Event()
        pongs: list[list[int]] = [[] for _ in range(args.workers)]
        read_pongs: list[dict[str, Any]] = []
        threads = [
            threading.Thread(target=_pinger, args=((servers.HOST, server.port), w, stop, pongs[w]))
            for w in range(args.workers)
        ]
        if args.reads:
            threads.append(
                threading.Thread(
                    target=_reader,
                    args=((servers.HOST, server.port), args.reads, args.read_every, stop, read_pongs),
                )
            )
        for t in threads:
            t.start()
        pub = roles.start(
            procs, *me, "--role", "pub", "--rate", str(args.rate), ready=None, what="the publisher"
        )
        result["publisher"] = pub.finish(None, timeout=args.seconds + 120)
        stop.set()
        for t in threads:
            t.join()
        after = {name: procstat.context_switches(p) for name, p in pids.items()}
        result["subscriber"] = sub.finish(None)
        result["context_switches_per_s"] = {
            name: (after[name] - before[name]) / args.seconds for name in pids
        }
        result["pong"] = [_quantiles(p) for p in pongs]
        if args.reads:
            result["reads"] = {
                "pong": _quantiles([r["pong_ns"] for r in read_pongs]),
                "seen": read_pongs[-1]["seen"] if read_pongs else {},
            }
    finally:
        roles.kill_all(procs)
        server.stop()
    workers = []
    for w in range(args.workers):
        path = Path(f"{prefix}-worker-{w}.json")
        workers.append(json.loads(path.read_text()) if path.exists() else None)
    result["workers"] = workers
    return result


def show(result: dict[str, Any]) -> None:
    seconds = result["seconds"]
    print(
        f"rate {result['rate']} msgs/s for {seconds} s; serve {result['serve_args'] or '(defaults)'}"
        + (f"; env {' '.join(result['env'])}" if result["env"] else "")
    )
    print(f"published {result['publisher']['published']}, received {result['subscriber']['received']}")
    print(
        "context switches/s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["context_switches_per_s"].items())
    )
    for w, q in enumerate(result["pong"]):
        print(f"pong worker {w}: " + ", ".join(f"{k} {v:g}" for k, v in q.items()))
    if "reads" in result:
        print(f"pong behind reads: {result['reads']}")
    for w, rep in enumerate(result["workers"]):
        if rep is None:
            print(f"worker {w}: no report")
            continue
        print(
            f"worker {w}: gc collected {rep['gc_collected']} (by generation), tracked objects "
            f"{rep['gc_objects']}, frozen {rep['gc_frozen']}, a full collection at the end "
            f"{rep['gc_full_us']:.0f} us; older generations ran at "
            + ", ".join(f"{t:g} s (gen {g}, {us:.0f} us)" for t, g, us in rep["gc_older"])
        )
        print(
            f"  {'job':16} {'count':>8} {'p50 us':>9} {'p99 us':>9} {'max us':>9} {'share':>7}"
            f" {'cpu p99':>9} {'cpu max':>9}"
        )
        for name, j in rep["jobs"].items():
            share = j["total_us"] / (seconds * 1e6)
            print(
                f"  {name:16} {j['count']:8d} {j['p50_us']:9.1f} {j['p99_us']:9.1f} {j['max_us']:9.1f}"
                f" {share:7.2%} {j['cpu_p99_us']:9.1f} {j['cpu_max_us']:9.1f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.tail_sources", __doc__, workers=2, role=("pub", "sub"))
    parser.add_argument("--rate", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reads", type=int, default=0)
    parser.add_argument("--read-every", type=float, default=0.5)
    parser.add_argument("--serve-args", default="")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server")
    parser.add_argument("--json", help="also write the result here")
    options.role_options(parser, "address")
    args = parser.parse_args(argv)
    if args.role:
        return _role(args)
    result = run(args)
    show(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
