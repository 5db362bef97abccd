"""Soak suite: the server held under many connections, a stalled reader, hostile input and kills.

    python -m bench.soak [--only SECTION ...] [--quick] [--tls] [--out DIR]

Four sections (issue 27, item 5), each on a fresh `broky serve --workers 2`;
`--only` runs some of them and keeps the others' last figures in the results;
`--quick` runs every section with tiny sizes (tests/bench/test_bench_soak.py, in CI):

- `connections`: `--connections` (10,000) raw connections, each with a Hello
  and its Welcome, held `--hold` seconds (60); beside them an open-loop pub/sub
  pair (bench.harness.latency, 5,000 msgs/s of 100 B) whose percentiles are
  set against the same pair's on the same server before the connections
  opened. At the end every held connection must answer a Ping. The server
  runs with `--max-connections-per-address 0 --handshake-rate 0` (every
  connection comes from 127.0.0.1); this process raises its own open-file
  limit to the hard limit (resource.setrlimit) and says what both were.
- `stalled`: one raw subscriber per worker on `>` that never reads, under
  `--messages` (1,000,000) messages of 100 B from an SDK publisher at
  `--stalled-rate` msgs/s, with two SDK subscribers on `w.>` reading: the
  server's RSS (sampled every 50 ms) against the configured bounds
  (`--max-pending-bytes`, `--memory-budget`), what each reader lost, and what
  the stalled ones were told (read at last; closed ones reconnect naming their
  connection and add up the notices they are given).
- `fuzz`: `--frames` (10,000,000) random and mutated Broky frames over many
  short connections (`--fuzz-threads` at a time), and random and mutated HTTP
  requests on the HTTP port, for at most `--fuzz-seconds` (the frames sent by
  then are reported). A probe connection per worker keeps a Ping in flight
  and an HTTP probe keeps asking /healthz: their longest round trips, and a
  hang is one over HANG_SECONDS. Worker crashes are the supervisor's restart
  count. RSS: at the start, after the first tenth, the peak, the end.
- `kills`: bench.worker_kill's SDK publisher (5,000 msgs/s over 256
  key_partitions) and subscriber while a worker is SIGKILLed every
  `--kill-interval` seconds (5) for `--kill-seconds` (60): the recovery
  times' distribution, and lost - told per worker (must be 0).

Frames for the fuzz are made once, cheaply: a pool of connection streams
(a Hello, then a few hundred frames, each mutated with probability
MUTATION_RATE by one of tests/protocol/test_protocol_fuzz.py's mutations, written here
with `random`), cycled; each connection sends one stream in one write, shuts
its sending side and reads until the server closes. A worker stops reading a
connection at its first fatal error, so the frames after it are sent but
never read: both counts are reported (the frames the workers read are
`messages_published` + subscriptions + pings, not broken down, so the report
gives the bytes the workers received).

TLS (`--tls`): `Transport` is the one place that knows how a client reaches
the server. With TLS, every server gets a certificate of the benchmark's own
CA (bench.harness.servers.tls_files), the SDK children connect to
broky+tls:// trusting that CA, and raw connections make the upgrade of
schema/README.md 2.1 (bench.harness.tlsclient) before their Hello; the HTTP
port is https. The latency pair of `connections` is the exception: the
compiled probe speaks no TLS, so that server also serves plain TCP
(`--tls-allow-plain`) and the pair measures, in plain TCP, what the 10,000
TLS connections held beside it do to other traffic. The fuzz sends its
streams inside TLS, except one connection in 16 (PLAIN_TO_TLS) that sends
its stream in plain text to the TLS-only server, and likewise to the https
port.

Results: bench/results/reliability.md and .json (plain TCP), and
reliability_tls.md and .json (`--tls`), with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import selectors
import socket
import ssl
import statistics
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import memory_budget, worker_kill  # noqa: E402
from bench.harness import latency, loadgen, options, procstat, roles, servers, tlsclient  # noqa: E402
from bench.harness.machine import broky_revision, describe, machine_info  # noqa: E402
from bench.harness.report import table, write_results  # noqa: E402
from broky.protocol import (  # noqa: E402
    NEED_DATA,
    Ack,
    Error,
    FrameReader,
    Goodbye,
    Hello,
    LossNotice,
    LossReason,
    Pause,
    Ping,
    Pong,
    Position,
    PreviousConnection,
    Read,
    Resume,
    Subscribe,
    Unsubscribe,
    Welcome,
    decode_frame,
    encode_frame,
    encode_message,
    vbucket_of,
)

NAME = "reliability"
SECTIONS = ("connections", "stalled", "fuzz", "kills")
WORKERS = 2
HANG_SECONDS = 5.0  # a probe round trip longer than this is a hang
MUTATION_RATE = 0.001  # of the frames in a fuzz stream
PLAIN_TO_TLS = 1 / 16  # with TLS: the share of fuzz connections that send in plain text anyway
STREAM_FRAMES = 2000  # frames per fuzz connection
POOL_STREAMS = 256


@dataclass(frozen=True)
class Transport:
    """How every client of the suite reaches the server: plain TCP, or TLS (see the header)."""

    tls: bool = False

    def server_args(self) -> list[str]:
        if not self.tls:
            return []
        _, cert, key = servers.tls_files()
        return ["--tls-cert", cert, "--tls-key", key]

    def url(self, server: servers.Server) -> str:
        return f"{'broky+tls://' if self.tls else ''}{server.host}:{server.port}"

    def client_args(self) -> list[str]:
        """What an SDK child process (bench.worker_kill's roles) needs besides the URL."""
        return ["--tls-ca", servers.tls_files()[0]] if self.tls else []

    def context(self) -> ssl.SSLContext | None:
        return tlsclient.context(servers.tls_files()[0]) if self.tls else None

    def pair_args(self) -> list[str]:
        """The latency pair speaks plain TCP (the compiled probe has no TLS): a TLS server
        of the `connections` section serves plain connections too, for the pair alone."""
        return ["--tls-allow-plain"] if self.tls else []

    def connect(self, address: tuple[str, int], worker: int, timeout: float = 10.0) -> socket.socket:
        """A connection placed on `worker`, ready for the caller's Hello (inside TLS, with TLS)."""
        sock = socket.create_connection(address, timeout=timeout)
        ctx = self.context()
        if ctx is None:
            return sock
        try:
            return tlsclient.upgrade(sock, ctx, worker)
        except BaseException:
            sock.close()
            raise

    def http_connect(self, address: tuple[str, int], timeout: float = 10.0) -> socket.socket:
        """A connection to the HTTP port (https, with TLS)."""
        sock = socket.create_connection(address, timeout=timeout)
        ctx = self.context()
        if ctx is None:
            return sock
        try:
            return ctx.wrap_socket(sock, server_hostname=address[0])
        except BaseException:
            sock.close()
            raise


def half_close(sock: socket.socket) -> None:
    """Shut our sending side and keep reading; on TLS the SSL object stays (SSLSocket.shutdown
    would drop it and leave the reads with raw TLS records)."""
    socket.socket.shutdown(sock, socket.SHUT_WR)


def start_server(transport: Transport, extra: list[str]) -> servers.Server:
    return servers.start_broky(WORKERS, [*transport.server_args(), *extra])


def read_frame(sock: socket.socket, reader: FrameReader) -> Any:
    return decode_frame(tlsclient.next_frame(sock, reader))


# ---------------------------------------------------------------- connections


def raise_fd_limit() -> dict[str, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return {"soft_before": soft, "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "hard": hard}


def _for_every(socks: list[socket.socket], want: type, timeout: float) -> tuple[int, int]:
    """Read every socket until a frame of type `want`: (how many got it, how many ended first)."""
    sel = selectors.DefaultSelector()
    readers: dict[int, FrameReader] = {}
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        readers[s.fileno()] = FrameReader(max_frame_bytes=1 << 24)
    got = ended = 0
    deadline = time.monotonic() + timeout
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(0.5):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            reader = readers[sock.fileno()]
            try:
                data = tlsclient.recv_ready(sock, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                ended += 1
                sel.unregister(sock)
                continue
            reader.feed(data)
            while (raw := reader.next_frame()) is not NEED_DATA:
                assert isinstance(raw, bytes)
                if isinstance(decode_frame(raw), want):
                    got += 1
                    sel.unregister(sock)
                    break
    sel.close()
    return got, ended


def connections_section(args: argparse.Namespace, transport: Transport) -> dict[str, Any]:
    limits = raise_fd_limit()
    if args.connections + 200 > limits["soft"]:
        raise SystemExit(f"--connections {args.connections}: the open-file limit is {limits['soft']}")
    server = start_server(transport, ["--max-connections-per-address", "0", "--handshake-rate", "0",
                                      *transport.pair_args()])  # fmt: skip
    held: list[socket.socket] = []
    out: dict[str, Any] = {"connections": args.connections, "hold_s": args.hold, "fd_limits": limits}
    out["pair_plain_beside_tls"] = transport.tls
    try:
        driver = loadgen.BrokyDriver()
        driver.prepare(server.address)
        rate = args.latency_rate
        out["rss_idle"] = server.rss_bytes()
        out["baseline"] = latency.run_latency(driver, server.address, server.pids, 100, rate, 1.0,
                                              args.latency_seconds)  # fmt: skip
        started = time.monotonic()
        welcomed = ended = 0
        for wave in range(0, args.connections, 500):
            batch = []
            for i in range(wave, min(wave + 500, args.connections)):
                sock = transport.connect(server.address, i % WORKERS)
                sock.sendall(encode_frame(Hello(worker=i % WORKERS, client_name="soak")))
                batch.append(sock)
            got, gone = _for_every(batch, Welcome, 60.0)
            welcomed, ended = welcomed + got, ended + gone
            held.extend(batch)
        out["open_seconds"] = round(time.monotonic() - started, 2)
        out["welcomed"], out["refused_or_closed"] = welcomed, ended
        out["rss_held"] = server.rss_bytes()
        out["per_worker"] = [w["connections"] for w in server.stats()["workers"]]
        hold_start = time.monotonic()
        cpu0 = procstat.total_cpu_seconds(server.pids())
        out["with_connections"] = latency.run_latency(
            driver, server.address, server.pids, 100, rate, 1.0, min(args.latency_seconds, args.hold)
        )
        time.sleep(max(0.0, args.hold - (time.monotonic() - hold_start)))
        out["server_cpu_s_per_s_held"] = round(
            (procstat.total_cpu_seconds(server.pids()) - cpu0) / (time.monotonic() - hold_start), 3
        )
        for sock in held:
            sock.setblocking(True)
            sock.settimeout(10)
            sock.sendall(encode_frame(Ping(1)))
        out["answered_ping_after_hold"], _ = _for_every(held, Pong, 60.0)
        out["rss_peak_held"] = server.rss_bytes()
        for sock in held:
            sock.close()
        held.clear()
        time.sleep(2.0)
        out["after"] = latency.run_latency(driver, server.address, server.pids, 100, rate, 1.0,
                                           args.latency_seconds)  # fmt: skip
        out["server_log_tail"] = server.log()[-1500:]
    finally:
        for sock in held:
            sock.close()
        server.stop()
    for run in ("baseline", "with_connections", "after"):
        out[run].pop("distribution", None)
    return out


def connections_ok(r: dict[str, Any]) -> bool:
    return bool(r["welcomed"] == r["answered_ping_after_hold"] == r["connections"])


# ---------------------------------------------------------------- stalled


def stalled_section(args: argparse.Namespace, transport: Transport) -> dict[str, Any]:
    bounds = ["--max-pending-bytes", args.max_pending_bytes, "--memory-budget", args.memory_budget]
    server = start_server(transport, bounds)
    url = transport.url(server)
    procs: list[roles.Role] = []
    stalled: list[memory_budget.Stalled] = []
    sampler = procstat.RssSampler(server.pids)
    partitions = 256
    out: dict[str, Any] = {"messages": args.messages, "rate": args.stalled_rate}
    try:
        for w in range(WORKERS):
            s = memory_budget.Stalled(server.address, w, tls=transport.context())
            s.subscribe()
            stalled.append(s)
        subs = [worker_kill.start_subscriber(procs, url, transport.client_args()) for _ in range(2)]
        snap = server.stats()["workers"]
        out["bounds"] = {
            "max_pending_bytes": args.max_pending_bytes,
            "memory_budget_bytes": sum(w["memory_budget"] for w in snap),
            "replay_bytes": sum(w["replay_limit"] for w in snap),
        }
        out["rss_before"] = server.rss_bytes()
        sampler.start()
        duration = args.messages / args.stalled_rate
        pub = worker_kill.start_publisher(procs, url, args.stalled_rate, partitions, duration, 100,
                                          transport.client_args())  # fmt: skip
        published = pub.finish(None, timeout=duration + 120)
        time.sleep(2.0)
        subscribed = [sub.finish(timeout=120) for sub in subs]
        sampler.stop()
        out["rss_peak"] = max(sampler.peak, server.rss_bytes())
        out["rss_after"] = server.rss_bytes()
        snap = server.stats()["workers"]
        out["slow_consumer_disconnects"] = sum(w["slow_consumer_disconnects"] for w in snap)
        out["budget_cuts"] = sum(w["budget_cuts"] for w in snap)
        memory_budget.drain_all(stalled)
        out["stalled"] = _told(server.address, stalled, published, partitions, transport)
        out["server_log_tail"] = server.log()[-1500:]
    finally:
        sampler.stop()
        for s in stalled:
            s.sock.close()
        roles.kill_all(procs)
        server.stop()
    out["published"] = published["sent"] - published["refused"]
    out["publisher_flush_error"] = published["flush_error"]
    out["readers"] = []
    for reader in subscribed:
        seqs = worker_kill.sequences(published, reader["received"], partitions)
        out["readers"].append({
            "received": len(reader["received"]),
            "lost": sum(seqs.lost),
            "told": sum(n for _, n, _, _ in reader["losses"]),
            "duplicates": seqs.duplicates,
            "out_of_order": seqs.out_of_order,
        })  # fmt: skip
    return out


def _told(
    address: tuple[str, int],
    stalled: list[memory_budget.Stalled],
    published: dict[str, Any],
    partitions: int,
    transport: Transport,
) -> list[dict[str, Any]]:
    """What each stalled connection received and was told (a closed one: also on reconnecting)."""
    per_worker = [0] * WORKERS
    for i, count in enumerate(published["per_partition"]):
        per_worker[vbucket_of(worker_kill.partition(i)) * WORKERS // 1024] += count
    out = []
    for s in stalled:
        told = {"before_close": s.told, "on_reconnect": 0}
        reasons: dict[str, int] = {}
        if s.closed:
            prev = PreviousConnection(s.welcome.connection_id, s.received, s.told, s.welcome.resume_token)
            back = memory_budget.Stalled(address, s.worker, previous=prev, tls=transport.context())
            for frame in back.frames_after_welcome():
                if isinstance(frame, LossNotice):
                    told["on_reconnect"] += frame.dropped
                    name = LossReason.name(frame.reason)
                    reasons[name] = reasons.get(name, 0) + frame.dropped
            back.sock.close()
        error = None
        if s.error is not None:
            error = f"{s.error.code}: {s.error.message}" if hasattr(s.error, "message") else str(s.error)
        out.append({
            "worker": s.worker,
            "published_to_its_worker": per_worker[s.worker],
            "received": s.received,
            "told": told,
            "told_on_reconnect_by_reason": reasons,
            "closed": s.closed,
            "error": error,
        })  # fmt: skip
    return out


def stalled_ok(r: dict[str, Any]) -> bool:
    """The readers lost nothing; a stalled one still open received + was told = what its worker had."""
    return all(x["lost"] == 0 and x["told"] == 0 and x["duplicates"] == 0 for x in r["readers"]) and all(
        s["received"] + s["told"]["before_close"] == s["published_to_its_worker"]
        for s in r["stalled"]
        if not s["closed"]
    )


# ---------------------------------------------------------------- fuzz


def mutate(data: bytearray, rnd: random.Random) -> bytearray:
    """One of tests/protocol/test_protocol_fuzz.py's mutations, drawn with `random` (fast)."""
    if not data:
        return data
    kind, at = rnd.randrange(6), rnd.randrange(len(data))
    if kind == 0:
        data[at] ^= 1 << rnd.randrange(8)
    elif kind == 1:
        del data[at:]
    elif kind == 2:
        data[at:at] = rnd.randbytes(rnd.randint(1, 8))
    elif kind == 3:
        del data[at : at + rnd.randint(1, 8)]
    elif kind == 4 and (at & ~3) + 4 <= len(data):
        word = rnd.choice([0, 1, 4, 8, 16, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, rnd.getrandbits(32)])
        struct.pack_into("<I", data, at & ~3, word)
    elif kind == 5 and (at & ~1) + 2 <= len(data):
        struct.pack_into("<H", data, at & ~1, rnd.getrandbits(16))
    return data


def owned_partitions(worker: int) -> list[bytes]:
    """Key_partitions whose vbuckets `worker` owns (of WORKERS, on one node)."""
    return [kp for kp in (b"p%d" % i for i in range(256)) if vbucket_of(kp) * WORKERS // 1024 == worker]


def valid_frame(rnd: random.Random, kps: list[bytes]) -> tuple[bytes, bool]:
    """A well-formed client frame of any kind a client may send after its Hello (a Message: to a
    key_partition of its worker, `kps`, nine times in ten)."""
    kp = rnd.choice(kps) if rnd.random() < 0.9 else b"q%d" % rnd.randrange(64)
    pattern = rnd.choice([b"f.>", b"f.*", b"f.k", b"f.*.x", b">", b"g.>"])
    pick = rnd.random()
    if pick < 0.7:
        key = rnd.choice([b"f.k", b"f.q.x", b"g.h", b"f." + rnd.randbytes(3).hex().encode()])
        return encode_message(kp, key, rnd.randbytes(rnd.randrange(200))), True
    return _control(rnd, kp, pattern, pick), False


def _control(rnd: random.Random, kp: bytes, pattern: bytes, pick: float) -> bytes:
    if pick < 0.8:
        return encode_frame(Subscribe(rnd.randrange(1, 50), pattern, kp if rnd.random() < 0.3 else None))
    if pick < 0.87:
        return encode_frame(Unsubscribe(rnd.randrange(1, 50)))
    if pick < 0.93:
        return encode_frame(Ping(rnd.randrange(1 << 31)))
    if pick < 0.94:
        return encode_frame(Read(rnd.randrange(1, 50), pattern, kp, start_time=1))
    if pick < 0.98:
        return encode_frame(
            Ack(rnd.randrange(1, 50), rnd.randrange(4), (Position(rnd.randrange(1024), 1, 1),))
        )
    if pick < 0.9996:
        return encode_frame(Pause() if rnd.random() < 0.5 else Resume())
    if pick < 0.9998:
        return encode_frame(Hello(worker=0))  # a second Hello
    return encode_frame(Goodbye("soak"))


Stream = tuple[bytes, int, int, int]  # a fuzz connection's bytes, frames, Messages, worker


def fuzz_stream(rnd: random.Random, frames: int) -> Stream:
    """One connection's bytes: a Hello, then `frames` frames (some mutated; or random bytes);
    with the count of frames, of Messages among them, and the worker its Hello names."""
    worker = rnd.randrange(WORKERS)
    kps = owned_partitions(worker)
    hello = bytearray(encode_frame(Hello(worker=worker, client_name="fuzz")))
    if rnd.random() < 0.03:
        hello = mutate(hello, rnd)
    parts = [bytes(hello)]
    kind = rnd.random()
    messages = 0
    for _ in range(frames):
        if kind < 0.05:
            parts.append(rnd.randbytes(rnd.randrange(1, 200)))  # random bytes
            continue
        raw, is_message = valid_frame(rnd, kps)
        messages += is_message
        if rnd.random() < MUTATION_RATE:
            raw = bytes(mutate(bytearray(raw), rnd))
        parts.append(raw)
    return b"".join(parts), frames + 1, messages, worker


HTTP_REQUESTS = [
    b"GET /healthz HTTP/1.1\r\nHost: soak\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: soak\r\n\r\n",
    b"GET /stats HTTP/1.1\r\nHost: soak\r\n\r\n",
    b"GET /readyz HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n",
    b"GET /connections?limit=5 HTTP/1.1\r\nHost: soak\r\n\r\n",
    b"GET /topics HTTP/1.1\r\nHost: soak\r\n\r\n",
    b"POST /v1/pub/f.k?partition=p1 HTTP/1.1\r\nHost: soak\r\nContent-Length: 11\r\n\r\nhello\nworld",
    b"POST /v1/pub/f.k HTTP/1.1\r\nHost: soak\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET /v1/sub/f.%3E?format=ndjson&last=3 HTTP/1.1\r\nHost: soak\r\n\r\n",
    b"GET /v1/sub/f.*?format=sse HTTP/1.1\r\nHost: soak\r\nAccept: text/event-stream\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: soak\r\n\r\n",
]


def http_request(rnd: random.Random) -> bytes:
    pick = rnd.random()
    if pick < 0.1:
        return rnd.randbytes(rnd.randrange(1, 300))
    raw = bytearray(rnd.choice(HTTP_REQUESTS))
    if pick < 0.8:
        for _ in range(rnd.randint(1, 3)):
            raw = mutate(raw, rnd)
    return bytes(raw)


class Fuzz:
    """Threads that send the pool's streams, connection after connection, until a count or a time."""

    def __init__(self, address: tuple[str, int], http: tuple[str, int], pool: list[Stream],
                 http_pool: list[bytes], frames: int, seconds: float, threads: int,
                 transport: Transport) -> None:  # fmt: skip
        self.address, self.http, self.transport = address, http, transport
        self.pool, self.http_pool = pool, http_pool
        self.frames, self.seconds, self.threads = frames, seconds, threads
        self.lock = threading.Lock()
        self.sent_frames = self.sent_bytes = self.sent_messages = self.connections = 0
        self.answered_error = self.closed_silently = self.kept_open = self.refused = 0
        self.http_requests = 0
        self.plain_to_tls = 0  # with TLS: connections that sent their stream in plain text
        self.kept_open_samples: list[str] = []  # what the first few connections kept open had read
        self.http_status: dict[str, int] = {}
        self.http_5xx: dict[str, int] = {}  # the bodies of 5xx answers (what the server said)
        self.stop = threading.Event()

    def _claim(self, n: int) -> bool:
        with self.lock:
            if self.sent_frames >= self.frames or self.stop.is_set():
                return False
            self.sent_frames += n
            return True

    def _one(self, data: bytes, worker: int, plain: bool) -> str:
        """Send `data` on a new connection, close our side, read until the server closes
        (with TLS: inside TLS, unless `plain`: in plain text to a server that wants TLS)."""
        try:
            if plain:
                sock = socket.create_connection(self.address, timeout=10)
            else:
                sock = self.transport.connect(self.address, worker)
        except (OSError, EOFError, tlsclient.UpgradeRefused):
            return "refused"
        last = None
        got = 0
        try:
            sock.sendall(data)
            half_close(sock)
            sock.settimeout(HANG_SECONDS)
            reader = FrameReader(max_frame_bytes=1 << 24)
            with contextlib.suppress(ssl.SSLEOFError):  # a TLS server may close without close_notify
                while chunk := sock.recv(1 << 16):
                    got += len(chunk)
                    reader.feed(chunk)
                    for raw in reader.frames():
                        last = raw
            final = decode_frame(last) if last is not None else None
            return "error" if isinstance(final, Error) and final.fatal else "closed"
        except TimeoutError:
            with self.lock:
                if len(self.kept_open_samples) < 10:
                    frame = type(decode_frame(last)).__name__ if last is not None else "nothing"
                    self.kept_open_samples.append(
                        f"{'plain' if plain else 'tls' if self.transport.tls else 'tcp'} stream of worker "
                        f"{worker}: {got:,} bytes read, the last a {frame}"
                    )
            return "kept_open"
        except OSError:
            return "closed"
        finally:
            sock.close()

    def _frames_thread(self, seed: int) -> None:
        rnd = random.Random(seed)
        while True:
            data, n, messages, worker = self.pool[rnd.randrange(len(self.pool))]
            if not self._claim(n):
                return
            plain = self.transport.tls and rnd.random() < PLAIN_TO_TLS
            outcome = self._one(data, worker, plain)
            with self.lock:
                self.connections += 1
                self.plain_to_tls += plain
                self.sent_messages += messages
                self.sent_bytes += len(data)
                if outcome == "error":
                    self.answered_error += 1
                elif outcome == "kept_open":
                    self.kept_open += 1
                elif outcome == "refused":
                    self.refused += 1
                else:
                    self.closed_silently += 1

    def _http_thread(self, seed: int) -> None:
        rnd = random.Random(seed)
        while not self.stop.is_set():
            data = self.http_pool[rnd.randrange(len(self.http_pool))]
            plain = self.transport.tls and rnd.random() < PLAIN_TO_TLS
            try:
                if plain:
                    sock = socket.create_connection(self.http, timeout=10)
                else:
                    sock = self.transport.http_connect(self.http)
            except OSError:
                status = "refused"
            else:
                # Over TLS the request is not followed by a half-close: a TLS server ends the
                # session at an EOF (asyncio's does), dropping the answer. So an incomplete request
                # waits for its rest (the server's --http-timeout): "no answer in 0.5 s", the
                # probe's GET /healthz telling whether the port still answers.
                over_tls = self.transport.tls and not plain
                wait = 0.5 if over_tls else 2.0
                try:
                    sock.sendall(data)
                    if not over_tls:
                        half_close(sock)
                    sock.settimeout(wait)
                    head = sock.recv(1024)
                    status = head[9:12].decode("latin-1") if head.startswith(b"HTTP/1.") else "none"
                    if status.startswith("5"):
                        body = head.partition(b"\r\n\r\n")[2][:160].decode("latin-1")
                        with self.lock:
                            self.http_5xx[body] = self.http_5xx.get(body, 0) + 1
                    with contextlib.suppress(TimeoutError):
                        while not over_tls and sock.recv(1 << 16):
                            pass
                except TimeoutError:
                    status = f"no answer in {wait:g} s"
                except ssl.SSLEOFError:
                    status = "closed"  # (what a plain client sending to https gets)
                except OSError:
                    status = "reset"
                finally:
                    sock.close()
            with self.lock:
                self.http_requests += 1
                self.http_status[status] = self.http_status.get(status, 0) + 1

    def run(self) -> float:
        threads = [
            threading.Thread(target=self._frames_thread, args=(i,), daemon=True) for i in range(self.threads)
        ]
        threads += [
            threading.Thread(target=self._http_thread, args=(1000 + i,), daemon=True) for i in range(2)
        ]
        start = time.monotonic()
        for t in threads:
            t.start()
        deadline = start + self.seconds
        while any(t.is_alive() for t in threads[: self.threads]) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stop.set()
        for t in threads:
            t.join(30)
        return time.monotonic() - start


def tenths(samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The samples at the end of each tenth of the run (fewer when the run was shorter)."""
    if not samples:
        return []
    end = samples[-1][0]
    picked: list[tuple[float, int]] = []
    for k in range(1, 11):
        due = end * k / 10
        sample = next(x for x in samples if x[0] >= due - 1e-9)
        if not picked or picked[-1] != sample:
            picked.append(sample)
    return picked


class Probe(threading.Thread):
    """One connection per worker, a Ping always in flight; and GET /healthz. Longest round trips."""

    def __init__(self, server: servers.Server, transport: Transport) -> None:
        super().__init__(daemon=True)
        self.server, self.transport = server, transport
        self.stop = threading.Event()
        self.max_rtt = 0.0
        self.max_http_rtt = 0.0
        self.round_trips = 0
        self.hangs = 0
        self.failures: list[str] = []

    def run(self) -> None:
        socks = []
        for w in range(WORKERS):
            sock = self.transport.connect(self.server.address, w, timeout=HANG_SECONDS * 2)
            reader = FrameReader(max_frame_bytes=1 << 24)
            sock.sendall(encode_frame(Hello(worker=w, client_name="probe")))
            read_frame(sock, reader)
            socks.append((sock, reader))
        n = 0
        last_http = 0.0
        while not self.stop.is_set():
            for w, (sock, reader) in enumerate(socks):
                n += 1
                t0 = time.monotonic()
                try:
                    sock.sendall(encode_frame(Ping(n)))
                    while not isinstance(read_frame(sock, reader), Pong):
                        pass
                except (OSError, EOFError) as exc:
                    self.failures.append(f"worker {w}: {type(exc).__name__}")
                    self.hangs += isinstance(exc, TimeoutError)
                    sock.close()
                    sock = self.transport.connect(self.server.address, w, timeout=HANG_SECONDS * 2)
                    reader = FrameReader(max_frame_bytes=1 << 24)
                    sock.sendall(encode_frame(Hello(worker=w, client_name="probe")))
                    read_frame(sock, reader)
                    socks[w] = (sock, reader)
                    continue
                rtt = time.monotonic() - t0
                self.max_rtt = max(self.max_rtt, rtt)
                self.hangs += rtt > HANG_SECONDS
                self.round_trips += 1
            if time.monotonic() - last_http > 0.5:
                last_http = time.monotonic()
                try:
                    self.server.http_get("/healthz", timeout=HANG_SECONDS * 2)
                except OSError as exc:
                    self.failures.append(f"healthz: {exc}")
                rtt = time.monotonic() - last_http
                self.max_http_rtt = max(self.max_http_rtt, rtt)
                self.hangs += rtt > HANG_SECONDS
            time.sleep(0.01)
        for sock, _ in socks:
            sock.close()


def fuzz_section(args: argparse.Namespace, transport: Transport) -> dict[str, Any]:
    rnd = random.Random(27)
    t0 = time.monotonic()
    pool = [fuzz_stream(rnd, STREAM_FRAMES) for _ in range(args.fuzz_pool)]
    http_pool = [http_request(rnd) for _ in range(2000)]
    out: dict[str, Any] = {
        "pool_streams": len(pool),
        "pool_seconds": round(time.monotonic() - t0, 2),
        "frames_target": args.frames,
        "seconds_limit": args.fuzz_seconds,
        "mutation_rate": MUTATION_RATE,
    }
    server = start_server(transport, ["--max-connections-per-address", "0", "--handshake-rate", "0"])
    probe = Probe(server, transport)
    sampler = procstat.RssSampler(server.pids)
    try:
        before = server.stats()
        out["rss_start"] = server.rss_bytes()
        probe.start()
        sampler.start()
        fuzz = Fuzz(server.address, (server.host, server.metrics_port), pool, http_pool, args.frames,
                    args.fuzz_seconds, args.fuzz_threads, transport)  # fmt: skip
        cpu0 = procstat.total_cpu_seconds(server.pids())
        series = procstat.RssSampler(server.pids, 1.0)
        series.start()
        seconds = fuzz.run()
        series.stop()
        cpu = procstat.total_cpu_seconds(server.pids()) - cpu0
        time.sleep(1.0)
        probe.stop.set()
        probe.join(HANG_SECONDS * 4)
        sampler.stop()
        time.sleep(HANG_SECONDS + 1.0)  # every fuzz connection closed by now, by us or by the server
        after = server.stats()
        names = [c["name"] for c in json.loads(server.http_get("/connections?limit=100000"))["connections"]]
        gateway = sum(name.startswith("http-gateway") for name in names)  # the HTTP port's own, kept
        out["connections_open_at_end"], out["gateway_connections_at_end"] = len(names) - gateway, gateway
        out["rss_end"] = server.rss_bytes()
        out["rss_peak"] = max(sampler.peak, out["rss_end"])
        out["rss_series"] = tenths(series.samples)
        out.update({
            "seconds": round(seconds, 1),
            "frames_sent": fuzz.sent_frames,
            "frames_per_s": round(fuzz.sent_frames / seconds),
            "bytes_sent": fuzz.sent_bytes,
            "messages_sent": fuzz.sent_messages,
            "connections": fuzz.connections,
            "connections_ended_with_error": fuzz.answered_error,
            "connections_closed_otherwise": fuzz.closed_silently,
            "connections_kept_open": fuzz.kept_open,
            "connections_refused": fuzz.refused,
            "connections_plain_to_tls": fuzz.plain_to_tls,
            "kept_open_samples": fuzz.kept_open_samples,
            "http_requests": fuzz.http_requests,
            "http_status": fuzz.http_status,
            "http_5xx_bodies": dict(sorted(fuzz.http_5xx.items(), key=lambda kv: -kv[1])[:10]),
            "server_cpu_s": round(cpu, 1),
            "bytes_received_by_workers": _grew(before, after, "totals", "bytes_received"),
            "messages_published": _grew(before, after, "totals", "messages_published"),
            "worker_crashes": restarts(after) - restarts(before),
            "replay_bytes_end": sum(w["replay_bytes"] for w in after["workers"]),
            "replay_limit": sum(w["replay_limit"] for w in after["workers"]),
            "pending_bytes_end": after["totals"]["pending_bytes"],
            "worker_pids_unchanged": after["master"]["worker_pids"] == before["master"]["worker_pids"],
            "probe_round_trips": probe.round_trips,
            "probe_max_rtt_ms": round(probe.max_rtt * 1000, 1),
            "probe_max_http_rtt_ms": round(probe.max_http_rtt * 1000, 1),
            "hangs": probe.hangs + (0 if not probe.is_alive() else 1),
            "probe_failures": probe.failures[:10],
        })  # fmt: skip
        out["server_log_tail"] = server.log()[-1500:]
    finally:
        probe.stop.set()
        sampler.stop()
        server.stop()
    return out


def restarts(stats: dict[str, Any]) -> int:
    return sum(stats["master"]["worker_restarts"])


def _grew(before: dict[str, Any], after: dict[str, Any], part: str, name: str) -> int:
    return int(after[part][name] - before[part][name])


def fuzz_ok(r: dict[str, Any]) -> bool:
    return bool(r["worker_crashes"] == 0 and r["hangs"] == 0 and r["worker_pids_unchanged"]
                and not r["probe_failures"] and r.get("connections_open_at_end", 0) == 0)  # fmt: skip


# ---------------------------------------------------------------- kills


def kills_section(args: argparse.Namespace, transport: Transport) -> dict[str, Any]:
    kills = max(1, int(args.kill_seconds / args.kill_interval))
    result = worker_kill.run(kills, args.kill_interval, args.kill_rate, 256, tls=transport.tls)
    rec = sorted(result.recovery)
    out = asdict(result)
    out.pop("server_log_tail")
    out.update({
        "interval_s": args.kill_interval,
        "rate": args.kill_rate,
        "recovery_s": {
            "min": rec[0] if rec else None,
            "median": statistics.median(rec) if rec else None,
            "p90": rec[min(len(rec) - 1, int(len(rec) * 0.9))] if rec else None,
            "max": rec[-1] if rec else None,
            "all": rec,
        },
        "lost_minus_told": result.lost - result.told,
        "promise_kept": worker_kill.promise_kept(result),
    })  # fmt: skip
    return out


def kills_ok(r: dict[str, Any]) -> bool:
    return bool(
        r["lost_by_worker"] == r["told_by_worker"] and r["duplicates"] == 0 and r["out_of_order"] == 0
    )


RUNS = {
    "connections": connections_section,
    "stalled": stalled_section,
    "fuzz": fuzz_section,
    "kills": kills_section,
}
CHECKS = {"connections": connections_ok, "stalled": stalled_ok, "fuzz": fuzz_ok, "kills": kills_ok}


# ---------------------------------------------------------------- report


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def _pct(run: dict[str, Any]) -> str:
    p = run["percentiles_us"]
    return f"{p['p50']:,.0f} / {p['p99']:,.0f} / {p['p99.9']:,.0f} / {run['max_us']:,.0f}"


def render(doc: dict[str, Any]) -> str:
    sections = doc["sections"]
    lines = [
        "# Reliability: the soak suite" + (", over TLS" if doc.get("tls") else ""),
        "",
        f"Machine: {describe(doc['machine'])}.",
        "",
        "Every section on a fresh `broky serve --workers 2` (its commit and command under it), "
        + (
            "every client over TLS (an ECDSA P-256 certificate; see bench/soak.py's header). The same "
            "runs in plain TCP: [reliability.md](reliability.md)."
            if doc.get("tls")
            else "plain TCP. The same runs over TLS: [reliability_tls.md](reliability_tls.md)."
        ),
        "",
    ]
    if doc.get("conditions"):
        lines += [f"Conditions: {doc['conditions']}", ""]
    for name in SECTIONS:
        if name in sections:
            r = sections[name]
            verdict = "met" if CHECKS[name](r) else "NOT met"
            when = (
                f"Run at {r['ran_at']}"
                + (f" at {r['commit']} by `python -m bench.soak{r['command']}`" if r.get("command") else "")
                + f", load average {r['load_average']} at its start; the machine's CPUs "
                f"were {r['machine_busy']:.0%} busy meanwhile (this run and everyone else's)."
            )
            lines += [*RENDER[name](r), "", f"Verdict: {verdict}. {when}", ""]
    return "\n".join(lines)


FIGURES = ("Figure", "Value")
PLAIN_PAIR = "; in plain TCP beside the TLS ones, the compiled probe speaking no TLS"


def render_connections(r: dict[str, Any]) -> list[str]:
    lim = r["fd_limits"]
    b, w = r["baseline"], r["with_connections"]
    return [
        f"## {r['connections']:,} connections held {r['hold_s']:g} s",
        "",
        f"`--max-connections-per-address 0 --handshake-rate 0` (all from 127.0.0.1). Open files: this "
        f"process's soft limit {lim['soft_before']:,} raised to {lim['soft']:,} (hard {lim['hard']:,}); the "
        "server inherits it.",
        "",
        *table(
            FIGURES,
            [
                (
                    "opened and welcomed",
                    f"{r['welcomed']:,} in {r['open_seconds']:g} s "
                    f"(refused or closed: {r['refused_or_closed']})",
                ),
                ("per worker", " / ".join(f"{n:,}" for n in r["per_worker"])),
                ("answered a Ping after the hold", f"{r['answered_ping_after_hold']:,}"),
                (
                    "server RSS idle / holding them",
                    f"{_mb(r['rss_idle'])} / {_mb(r['rss_held'])} "
                    f"({(r['rss_held'] - r['rss_idle']) / max(1, r['welcomed']) / 1024:.1f} KiB "
                    "per connection)",
                ),
                (
                    "server CPU while holding them (with the latency pair)",
                    f"{r['server_cpu_s_per_s_held']:g} s/s",
                ),
            ],
        ),
        "",
        f"Latency of one pub/sub pair (bench.harness.latency: raw connections, one to each "
        f"side's worker{PLAIN_PAIR if r.get('pair_plain_beside_tls') else ''}), open loop, "
        f"{b['rate_per_s']:,.0f} msgs/s of 100 B, {b['samples']:,} samples a run:",
        "",
        *table(
            ("", "p50 / p99 / p99.9 / max (µs)", "server CPU over the run"),
            [
                (name, _pct(run), f"{run['server_cpu_s']:.2f} s")
                for name, run in (
                    ("without the connections", b),
                    ("with them held", w),
                    ("after they closed", r["after"]),
                )
            ],
        ),
        "",
        "The three runs follow each other on one server; on a shared machine the first and the last "
        "bracket what the others' load does to the figures.",
    ]


def render_stalled(r: dict[str, Any]) -> list[str]:
    b = r["bounds"]
    figures = [
        (
            "server RSS before / peak (every 50 ms) / after",
            f"{_mb(r['rss_before'])} / {_mb(r['rss_peak'])} / {_mb(r['rss_after'])}",
        ),
        (
            "peak above before, against the memory budget",
            f"{_mb(r['rss_peak'] - r['rss_before'])} / {_mb(b['memory_budget_bytes'])}",
        ),
        ("slow-consumer disconnects, budget cuts", f"{r['slow_consumer_disconnects']}, {r['budget_cuts']}"),
        ("publisher's final flush", r["publisher_flush_error"] or "succeeded"),
    ]
    for i, x in enumerate(r["readers"]):
        figures.append(
            (
                f"reader {i + 1}: received / lost / told / duplicates / out of order",
                f"{x['received']:,} / {x['lost']} / {x['told']} / {x['duplicates']} / {x['out_of_order']}",
            )
        )
    for s in r["stalled"]:
        t = s["told"]
        figures.append(
            (
                f"stalled on worker {s['worker']}: published to it / received / told (before its close, on "
                "reconnecting)",
                f"{s['published_to_its_worker']:,} / {s['received']:,} / {t['before_close']:,}, "
                f"{t['on_reconnect']:,} {s['told_on_reconnect_by_reason'] or ''}",
            )
        )
        accounted = s["received"] + t["before_close"] + t["on_reconnect"]
        figures.append(
            (
                "... closed by the server; the last Error it read; received + told",
                f"{s['closed']}; {s['error'] or '-'}; {accounted:,}",
            )
        )
    return [
        f"## A stalled subscriber under {r['published']:,} messages",
        "",
        f"One raw subscriber per worker on `>`, never reading; an SDK publisher at {r['rate']:,} msgs/s "
        f"(100 B, 256 key_partitions); two SDK subscribers on `w.>`. `--max-pending-bytes "
        f"{b['max_pending_bytes']} --memory-budget` {_mb(b['memory_budget_bytes'])} (replay buffers "
        f"{_mb(b['replay_bytes'])}, drawn from it).",
        "",
        *table(FIGURES, figures),
        "",
        STALLED_NOTE,
    ]  # fmt: skip


STALLED_NOTE = (
    "A stalled subscriber's worker drops what goes past its pending bound (SLOW_CONSUMER) and, "
    "--slow-consumer-deadline (10 s) later, closes it; what was still in its buffer is lost with the "
    "connection (CONNECTION_LOST). It is told both when it reconnects naming its connection. Its "
    "received + told is the prefix of its worker's messages up to its close; the rest were published "
    "after it was gone."
)


def render_fuzz(r: dict[str, Any]) -> list[str]:
    limited = r["frames_sent"] < r["frames_target"]
    return [
        f"## {r['frames_sent']:,} random and mutated frames, and HTTP requests",
        "",
        f"A pool of {r['pool_streams']} connection streams made in {r['pool_seconds']:g} s (a Hello, then "
        f"{STREAM_FRAMES} frames of every kind a client sends, {r['mutation_rate']:.1%} of them mutated; 5 % "
        "of the streams random bytes after the Hello, 3 % with a mutated Hello), cycled over new "
        "connections, one write each"
        + (
            f"; stopped at the {r['seconds_limit']:g} s limit, short of {r['frames_target']:,}"
            if limited
            else ""
        )
        + ". A worker stops reading at a connection's first fatal error: the frames after it are sent, "
        "not read.",
        "",
        *table(FIGURES, [
            ("frames sent, in", f"{r['frames_sent']:,} in {r['seconds']:g} s ({r['frames_per_s']:,}/s)"),
            ("bytes sent / read by the workers",
             f"{_mb(r['bytes_sent'])} / {_mb(r['bytes_received_by_workers'])}"),
            ("Message frames sent (unmutated) / published by the workers",
             f"{r['messages_sent']:,} / {r['messages_published']:,}"),
            (f"connections: ended with a fatal Error / closed otherwise / kept open past {HANG_SECONDS:g} s",
             f"{r['connections_ended_with_error']:,} / {r['connections_closed_otherwise']:,} / "
             f"{r['connections_kept_open']:,} (refused {r['connections_refused']})"),
            *(
                [("... of which sent in plain text to the TLS-only server",
                  f"{r['connections_plain_to_tls']:,}")]
                if r.get("connections_plain_to_tls")
                else []
            ),
            ("HTTP requests (random, mutated, valid), by answer",
             f"{r['http_requests']:,}: "
             + ", ".join(f"{k} {v:,}" for k, v in sorted(r["http_status"].items()))),
            ("worker crashes", r["worker_crashes"]),
            *(
                [(f"clients' connections still open on the server at the end (besides the HTTP gateway's "
                  f"own {r.get('gateway_connections_at_end', '?')})", r["connections_open_at_end"])]
                if "connections_open_at_end" in r
                else []
            ),
            (f"hangs (a probe round trip over {HANG_SECONDS:g} s)", r["hangs"]),
            ("probe: Ping round trips, longest", f"{r['probe_round_trips']:,}, {r['probe_max_rtt_ms']:g} ms"),
            ("probe: GET /healthz, longest", f"{r['probe_max_http_rtt_ms']:g} ms"),
            ("server RSS start / peak / end",
             f"{_mb(r['rss_start'])} / {_mb(r['rss_peak'])} / {_mb(r['rss_end'])}"),
            ("server RSS at the end of each tenth of the run", ", ".join(_mb(b) for _, b in r["rss_series"])),
            ("... of which the replay buffers at the end (their bound)",
             f"{_mb(r['replay_bytes_end'])} ({_mb(r['replay_limit'])})"),
            ("pending outbound bytes at the end", f"{r['pending_bytes_end']:,}"),
            ("server CPU", f"{r['server_cpu_s']:g} s"),
        ]),
    ]  # fmt: skip


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_kills(r: dict[str, Any]) -> list[str]:
    rec = r["recovery_s"]
    return [
        f"## A worker SIGKILLed every {r['interval_s']:g} s, {len(r['kills'])} times",
        "",
        f"bench.worker_kill's SDK publisher ({r['rate']:,} msgs/s, 256 key_partitions) and SDK subscriber on "
        "`w.>`; workers 0 and 1 in turn.",
        "",
        *table(FIGURES, [
            ("published / received", f"{r['published']:,} / {r['received']:,}"),
            ("lost / told / lost - told",
             f"{r['lost']} / {r['told']} {r['told_by_reason'] or ''} / {r['lost_minus_told']}"),
            ("lost, told per worker", f"{r['lost_by_worker']}, {r['told_by_worker']}"),
            ("duplicates / out of order", f"{r['duplicates']} / {r['out_of_order']}"),
            ("recovery min / median / p90 / max",
             f"{_s(rec['min'])} / {_s(rec['median'])} / {_s(rec['p90'])} / {_s(rec['max'])} s"),
            ("publisher's unconfirmed / resent / final flush",
             f"{r['publisher_unconfirmed_lost']} / {r['publisher_resent_after_loss']} / "
             f"{r['publisher_flush_error'] or 'succeeded'}"),
        ]),
    ]  # fmt: skip


RENDER = {
    "connections": render_connections,
    "stalled": render_stalled,
    "fuzz": render_fuzz,
    "kills": render_kills,
}


# ---------------------------------------------------------------- main

QUICK = {
    "connections": 300,
    "hold": 2.0,
    "latency_seconds": 1.0,
    "messages": 20_000,
    "stalled_rate": 10_000,
    "frames": 20_000,
    "fuzz_seconds": 10.0,
    "fuzz_pool": 16,
    "kill_seconds": 2.0,
    "kill_interval": 2.0,
}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser("bench.soak", __doc__, out=options.RESULTS, quick=True,
                            helps={"quick": "every section tiny (CI)"})  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    parser.add_argument("--tls", action="store_true", help="the same runs over TLS (see the header)")
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--hold", type=float, default=60.0, help="seconds the connections are held")
    parser.add_argument(
        "--latency-seconds", type=float, default=30.0, help="measured seconds of each latency run"
    )
    parser.add_argument("--latency-rate", type=float, default=5000.0)
    parser.add_argument(
        "--messages", type=int, default=1_000_000, help="messages past the stalled subscriber"
    )
    parser.add_argument("--stalled-rate", type=int, default=40_000, help="msgs/s of that publisher")
    parser.add_argument("--max-pending-bytes", default="16MiB")
    parser.add_argument("--memory-budget", default="256MiB")
    parser.add_argument("--frames", type=int, default=10_000_000)
    parser.add_argument("--fuzz-seconds", type=float, default=300.0, help="the fuzz stops here if not done")
    parser.add_argument("--fuzz-threads", type=int, default=8)
    parser.add_argument(
        "--fuzz-pool", type=int, default=POOL_STREAMS, help="connection streams pre-generated"
    )
    parser.add_argument("--kill-seconds", type=float, default=60.0)
    parser.add_argument("--kill-interval", type=float, default=5.0)
    parser.add_argument("--kill-rate", type=int, default=5000)
    parser.add_argument(
        "--conditions", default="", help="a sentence on the machine's other load, for the report"
    )
    parser.add_argument(
        "--render", action="store_true", help="write the report again from its JSON, running nothing"
    )
    args = parser.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    transport = Transport(tls=args.tls)
    name_out = f"{NAME}_tls" if args.tls else NAME
    path = args.out / f"{name_out}.json"
    doc: dict[str, Any] = {"sections": {}}
    if (args.only or args.render) and path.exists():
        doc = json.loads(path.read_text())
    if args.render:
        (args.out / f"{name_out}.md").write_text(render(doc))
        return 0
    info = machine_info()
    doc["machine"] = info
    doc["command"] = options.command("bench.soak", argv).removeprefix("python -m bench.soak")
    doc["tls"] = args.tls
    if args.conditions:
        doc["conditions"] = args.conditions
    ok = True
    for name in args.only or SECTIONS:
        print(f"soak: {name} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        ran_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        load = round(os.getloadavg()[0], 2)
        busy0, all0, _ = procstat.machine_cpu()
        result = RUNS[name](args, transport)
        busy1, all1, _ = procstat.machine_cpu()
        result.update(ran_at=ran_at, load_average=load, seconds_total=round(time.monotonic() - start, 1),
                      command=doc["command"], commit=broky_revision(),
                      machine_busy=round((busy1 - busy0) / max(all1 - all0, 1e-9), 2))  # fmt: skip
        doc["sections"][name] = result
        passed = CHECKS[name](result)
        ok = ok and passed
        print(
            f"soak: {name} {'ok' if passed else 'FAILED'} in {result['seconds_total']:g} s", file=sys.stderr
        )
    settings = {k: v for k, v in doc.items() if k not in ("machine", "args", "sections")}
    write_results(args.out, name_out, render(doc), info, args, **settings, sections=doc["sections"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
