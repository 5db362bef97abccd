"""Open-loop latency: a fixed publish rate, latency from the intended send time.

Theory of operation
-------------------
The publisher process owns a schedule: message i is due at
``start + i / rate``. It sleeps until the next message is due, then writes
every message that is due by now (one write), each carrying its own *due*
time (CLOCK_MONOTONIC ns, shared by every process of the machine) in the
first 8 bytes of its payload, patched into a pre-encoded frame. A server (or
a generator) that stalls therefore cannot hide its stall: the messages that
should have gone out meanwhile are sent late but keep their due times
("coordinated omission" avoided). The subscriber process reads the due time
of every delivery at the payload offset it knows from the run's record shape
and records ``now - due`` in an HdrHistogram (1 ns .. 60 s, 3 significant
digits). Samples due before the warm-up ends are not recorded.

The generator's own delay (sleep granularity, the subscriber's wake-up) is
inside every figure and is the same for every system.
"""

from __future__ import annotations

import base64
import multiprocessing
import struct
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from hdrh.histogram import HdrHistogram

from bench.harness import procstat
from bench.harness.loadgen import (
    RUN,
    SETUP,
    STOP,
    Counters,
    Driver,
    Load,
    LoadError,
    Record,
    Shared,
    kill_generator,
    start_generator,
    subscriber_main,
)

LOWEST_NS, HIGHEST_NS, DIGITS = 1, 60_000_000_000, 3
PERCENTILES = (50.0, 90.0, 99.0, 99.9, 99.99)
_ts = struct.Struct("<q")


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_NS, HIGHEST_NS, DIGITS)


def _observer(
    start: Any, warmup_ns: int
) -> Callable[[Record], tuple[Callable[[bytearray, int], None], Callable[[], dict[str, Any]]]]:
    def make(rec: Record) -> tuple[Callable[[bytearray, int], None], Callable[[], dict[str, Any]]]:
        hist = new_histogram()
        offset = rec.payload_offset
        unpack = _ts.unpack_from
        clock = time.monotonic_ns
        top = HIGHEST_NS

        def on_record(buf: bytearray, pos: int) -> None:
            due = unpack(buf, pos + offset)[0]
            if due >= start.value + warmup_ns:
                hist.record_value(min(max(clock() - due, 1), top))

        def finish() -> dict[str, Any]:
            return {"histogram": base64.b64encode(hist.encode()).decode()}

        return on_record, finish

    return make


def publisher_main(
    driver: Driver,
    address: tuple[str, int],
    load: Load,
    shared: Shared,
    conn: Connection,
    rate: float,
    count: int,
    start: Any,
) -> None:
    """Body of the open-loop publisher process."""
    try:
        key = load.key_list()[0]
        payload = b"\0" * load.payload
        counters = Counters()
        (sock, _), *more = driver.publishers(address, [key])
        if more:
            raise LoadError("one key must need one publishing connection")
        driver.handshake_publisher(sock)
        sock.settimeout(None)
        frame, offset = driver.publish(key, payload)
        template = bytearray(frame)
        size = len(frame)
        out = bytearray(size * 64)
        conn.send({"ready": True})
        while shared.phase.value == SETUP:
            time.sleep(0.001)
        start_ns = start.value
        interval = 1e9 / rate
        clock = time.monotonic_ns
        pack = _ts.pack_into
        sent = 0
        while sent < count and shared.phase.value == RUN:
            now = clock()
            due = start_ns + int(sent * interval)
            if due > now:
                time.sleep((due - now) / 1e9)
                continue
            n = 0
            while sent < count and due <= now and n < 64:
                out[n * size : (n + 1) * size] = template
                pack(out, n * size + offset, due)
                n += 1
                sent += 1
                due = start_ns + int(sent * interval)
            sock.sendall(memoryview(out)[: n * size])
            shared.sent[0] = sent
        driver.sync(sock, counters)
        sock.close()
        shared.published.value = 1
        conn.send({"sent": sent, "errors": counters.errors, "notes": counters.notes})
    except Exception:
        conn.send({"error": traceback.format_exc()})


def run_latency(
    driver: Driver,
    address: tuple[str, int],
    server_pids: Callable[[], list[int]],
    payload: int,
    rate: float,
    warmup: float,
    duration: float,
) -> dict[str, Any]:
    """One open-loop 1 -> 1 run at `rate` msgs/s; percentiles in microseconds."""
    if payload < 8:
        raise ValueError("the payload carries an 8-byte timestamp")
    load = Load(publishers=1, subscribers=1, payload=payload)
    shared = Shared.create(load)
    start = multiprocessing.get_context("fork").RawValue("q", 0)  # due time of message 0, set below
    count = int(rate * (warmup + duration))

    def pub(driver: Driver, address: tuple[str, int], load: Load, shared: Shared, conn: Connection) -> None:
        publisher_main(driver, address, load, shared, conn, rate, count, start)

    def sub(driver: Driver, address: tuple[str, int], load: Load, shared: Shared, conn: Connection) -> None:
        subscriber_main(driver, address, load, shared, conn, _observer(start, int(warmup * 1e9)))

    gen = start_generator(sub, pub, (driver, address, load, shared))
    try:
        pids = server_pids()
        cpu0 = procstat.total_cpu_seconds(pids)
        start.value = time.monotonic_ns() + 10_000_000
        shared.phase.value = RUN
        pub_reply = gen.expect(1, warmup + duration + 15)
        cpu1 = procstat.total_cpu_seconds(pids)
        shared.phase.value = STOP
        sub_reply = gen.expect(0, 15)
    except BaseException:
        kill_generator(gen)
        raise
    gen.stop()
    hist = HdrHistogram.decode(base64.b64decode(sub_reply["histogram"]))
    if hist.get_total_count() == 0:
        raise LoadError(f"{driver.name}: no latency sample was recorded")
    return {
        "rate_per_s": rate,
        "payload": payload,
        "samples": hist.get_total_count(),
        "percentiles_us": {f"p{p:g}": hist.get_value_at_percentile(p) / 1000 for p in PERCENTILES},
        "max_us": hist.get_max_value() / 1000,
        "mean_us": hist.get_mean_value() / 1000,
        "distribution": distribution(hist),
        "server_cpu_s": cpu1 - cpu0,
        "published": pub_reply["sent"],
        "delivered_total": sub_reply["delivered"],
        "not_delivered": max(0, pub_reply["sent"] - sub_reply["delivered"]),
        "errors": pub_reply["errors"] + sub_reply["errors"],
        "notes": pub_reply["notes"] + sub_reply["notes"],
    }


def distribution(hist: HdrHistogram) -> list[tuple[float, float]]:
    """(percentile, latency µs) pairs for the percentile plot, up to the max."""
    points = []
    for p in (0, 10, 25, 50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99, 99.995, 99.999):
        points.append((float(p), hist.get_value_at_percentile(p) / 1000))
    points.append((100.0, hist.get_max_value() / 1000))
    return points
