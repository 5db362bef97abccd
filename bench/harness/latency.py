"""Open-loop latency through the compiled probe: a fixed publish rate, latency from the
intended send time, and the floor (no broker) measured the same way.

Theory of operation
-------------------
The timed part runs in bench/probe/probe.c, one small C process: a sender thread
that owns the schedule (message i due at ``start + i / rate``; it writes every
message due by now in one write, each carrying its own *due* time, CLOCK_MONOTONIC
ns, in the first 8 bytes of its payload) and a receiver thread that parses the
deliveries of every subscriber connection and records ``receive time - due`` in an
HdrHistogram-layout histogram (1 ns .. 60 s, 3 significant digits). A server or a
sender that stalls therefore cannot hide its stall: the messages that should have
gone out meanwhile keep their due times ("coordinated omission" avoided). Samples
due before the warm-up ends are not recorded.

This module sets up the connections with the harness's drivers (loadgen.py: the
one owner of each protocol's handshake, subscription and frame layout) and hands
them to the probe as inherited file descriptors with the pre-encoded publish and
the offset of its payload; `run_floor` lets the probe talk to an echo thread of its
own over loopback (the physical limit of the machine, same sender and receiver).

Server CPU is read from /proc (every thread of every server process, from the
scheduler) around the whole probe run, warm-up and drain included: as a share of
one core over that time, and per delivered message.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from hdrh.histogram import HdrHistogram

from bench import probe
from bench.harness import procstat
from bench.harness.loadgen import Driver, LoadError, make_keys

PERCENTILES = (50.0, 90.0, 99.0, 99.9, 99.99)
DRAIN_S = 2.0  # how long the probe waits for stragglers once nothing more arrives
DRAIN_MAX_S = 10.0  # and at most, after its last send, for a server working off a backlog


def new_histogram() -> HdrHistogram:
    return HdrHistogram(probe.LOWEST_NS, probe.HIGHEST_NS, probe.DIGITS)


def run_latency(
    driver: Driver,
    address: tuple[str, int],
    server_pids: Callable[[], list[int]],
    payload: int,
    rate: float,
    warmup: float,
    duration: float,
    fanout: int = 1,
    options: tuple[str, ...] = (),
    keep_histogram: bool = False,
) -> dict[str, Any]:
    """One open-loop run, 1 -> `fanout`, at `rate` msgs/s; percentiles in microseconds.

    `driver.prepare(address)` must have been called. `options`: more of the probe's
    arguments (pinning: --cpu-send, --cpu-recv; --spin-us; see probe.c).
    `keep_histogram`: the HdrHistogram itself under "histogram" (to merge runs), else
    only figures that JSON can hold.
    """
    if payload < 8:
        raise ValueError("the payload carries an 8-byte timestamp")
    if driver.name not in ("broky", "nats", "redis"):
        raise ValueError(f"the probe does not speak {driver.name}")
    keys = make_keys(1)
    body = bytes(payload)
    socks: list[socket.socket] = []
    try:
        for _ in range(fanout):
            subs = driver.subscribe(address, keys, False)
            if len(subs) != 1:
                raise LoadError("one subscriber must need one connection")
            socks += subs
        rec = driver.record(keys[0], body, False)
        (pub, _), *more = driver.publishers(address, [keys[0]])
        socks.append(pub)
        if more:
            raise LoadError("one key must need one publishing connection")
        driver.handshake_publisher(pub)
        frame, offset = driver.publish(keys[0], body)
        for sock in socks:
            sock.setblocking(True)
        args = [
            "--mode", driver.name, "--pub-fd", str(pub.fileno()),
            "--sub-fds", ",".join(str(s.fileno()) for s in socks[:-1]),
            "--template", frame.hex(), "--due-offset", str(offset),
            "--record-len", str(rec.length), "--record-due-offset", str(rec.payload_offset),
        ]  # fmt: skip
        fds = tuple(s.fileno() for s in socks)
        return _run(args, fds, server_pids, rate, warmup, duration, options, keep_histogram)
    finally:
        for sock in socks:
            sock.close()


def run_floor(
    payload: int,
    rate: float,
    warmup: float,
    duration: float,
    fanout: int = 1,
    options: tuple[str, ...] = (),
    keep_histogram: bool = False,
) -> dict[str, Any]:
    """The same run with no broker: the probe's own echo thread over loopback TCP."""
    if payload < 8:
        raise ValueError("the payload carries an 8-byte timestamp")
    args = ["--mode", "echo", "--fanout", str(fanout), "--size", str(payload)]
    return _run(args, (), lambda: [], rate, warmup, duration, options, keep_histogram)


def _run(
    args: list[str],
    fds: tuple[int, ...],
    server_pids: Callable[[], list[int]],
    rate: float,
    warmup: float,
    duration: float,
    options: tuple[str, ...],
    keep_histogram: bool,
) -> dict[str, Any]:
    count = max(1, int(rate * (warmup + duration)))
    args += ["--rate", repr(float(rate)), "--count", str(count), "--warmup", repr(float(warmup))]
    args += ["--drain", str(DRAIN_S), "--drain-max", str(DRAIN_MAX_S), *options]
    probe.binary()  # built (once) before the server's CPU is read
    pids = server_pids()
    cpu0, t0 = procstat.total_exact_cpu_seconds(pids), time.monotonic()
    try:
        out = probe.run(args, fds, timeout=warmup + duration + DRAIN_MAX_S + 60)
    except probe.ProbeError as exc:
        raise LoadError(str(exc)) from exc
    cpu1, t1 = procstat.total_exact_cpu_seconds(pids), time.monotonic()
    hist: HdrHistogram = out.pop("histogram")
    if hist.get_total_count() == 0:
        raise LoadError(f"{out['mode']}: no latency sample was recorded ({out.get('first_error')})")
    server_cpu = out["echo_cpu_s"] if out["mode"] == "echo" else cpu1 - cpu0
    received = out["received"]
    result: dict[str, Any] = {
        "rate_per_s": rate,
        "fanout": out["fanout"],
        "samples": hist.get_total_count(),
        "percentiles_us": {f"p{p:g}": hist.get_value_at_percentile(p) / 1000 for p in PERCENTILES},
        "max_us": hist.get_max_value() / 1000,
        "mean_us": hist.get_mean_value() / 1000,
        "distribution": distribution(hist),
        "server_cpu_s": server_cpu,
        "server_cpu_pct": 100 * server_cpu / (t1 - t0),
        "server_cpu_us_per_delivery": server_cpu * 1e6 / received if received else None,
        "published": out["sent"],
        "expected": out["expected"],
        "delivered_total": received,
        "not_delivered": out["lost"],
        "rate_achieved": out["rate_achieved"],
        "kept_up": kept_up(out),
        "errors": out["errors"],
        "notes": [out["first_error"]] if out["first_error"] else [],
        "probe": {
            k: out[k] for k in ("sender_cpu_s", "receiver_cpu_s", "send_lag_max_ns", "writes", "foreign")
        },
    }
    if keep_histogram:
        result["histogram"] = hist
    return result


def kept_up(out: dict[str, Any]) -> bool:
    """Every expected delivery arrived, without errors, and the sender held its rate
    (within 2%: a sender slowed by a server that stopped reading did not hold it)."""
    return bool(out["lost"] == 0 and out["errors"] == 0 and out["rate_achieved"] >= 0.98 * out["rate"])


def distribution(hist: HdrHistogram) -> list[tuple[float, float]]:
    """(percentile, latency µs) pairs for the percentile plot, up to the max; only the
    percentiles that at least one sample lies beyond (the rest would all be the max)."""
    points = []
    total = hist.get_total_count()
    for p in (0, 10, 25, 50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99, 99.995, 99.999):
        if (100 - p) * total < 100:
            break
        points.append((float(p), hist.get_value_at_percentile(p) / 1000))
    points.append((100.0, hist.get_max_value() / 1000))
    return points
