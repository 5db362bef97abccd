"""A slow HTTP stream lags instead of being cut (broky.server.http.gateway, "A slow reader lags"),
against a real `broky serve`: an event-stream client that stops reading through a burst and then
reads slowly gets every event, in order per key_partition, none twice, from the replay buffer
and then live; with a replay buffer smaller than the burst it is told `event: loss` with the
exact count of what was evicted before it got there, then goes on live; `curl --limit-rate`
through a burst gets every ndjson line. With --replay-bytes 0
the stream is cut as before (tests/server/http/test_http_gateway.py).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import broky
from tests.support.http import debug_stats
from tests.support.requires import program
from tests.support.serverproc import ServerProcess

PARTITIONS = [f"p{i}" for i in range(8)]
PAD = "x" * 300  # a message's payload: its number, then this (an SSE event of about 600 bytes)


class SlowReader:
    """An event stream read on a socket with a small receive buffer, as slowly as the test says."""

    def __init__(self, server: ServerProcess, path: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.settimeout(30)
        sock.connect((server.host, server.metrics_port))
        self.conn = http.client.HTTPConnection(server.host, server.metrics_port)
        self.conn.sock = sock
        self.conn.request("GET", path, headers={"Accept": "text/event-stream"})
        self.resp = self.conn.getresponse()  # its head comes once the stream is subscribed
        assert self.resp.status == 200, self.resp.read()
        self.messages: dict[str, list[int]] = {}  # key_partition -> the numbers of its payloads
        self.ids: set[str] = set()
        self.losses: list[dict[str, Any]] = []
        self.cuts: list[str] = []

    @property
    def received(self) -> int:
        return sum(map(len, self.messages.values()))

    def event(self) -> dict[str, str]:
        fields: dict[str, str] = {}
        while True:
            line = self.resp.readline()
            assert line, "the stream ended"
            line = line.rstrip(b"\n")
            if not line:
                if fields:
                    return fields
                continue
            name, _, value = line.decode().partition(": ")
            fields[name] = value

    def read_until(self, done: Callable[[], bool], pause_every: int = 50, pause: float = 0.005) -> None:
        """Read events until `done()`, sleeping `pause` s every `pause_every` events."""
        n = 0
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline, (self.received, self.losses, self.cuts)
            event = self.event()
            kind = event.get("event")
            if kind == "loss":
                self.losses.append(json.loads(event["data"]))
            elif kind == "cut":
                self.cuts.append(event["data"])
                raise AssertionError(f"cut: {event['data']}")
            elif "data" in event:
                assert event["id"] not in self.ids, event  # never twice
                self.ids.add(event["id"])
                msg = json.loads(event["data"])
                number = int(msg["payload"].split(" ")[0])
                self.messages.setdefault(msg["key_partition"], []).append(number)
            n += 1
            if n % pause_every == 0:
                time.sleep(pause)

    def close(self) -> None:
        self.conn.close()


def publish(server: ServerProcess, first: int, count: int, rate: float | None = None) -> None:
    """Messages first .. first + count - 1 on PARTITIONS in turn (each partition's numbers
    consecutive there), as fast as they go or at about `rate` per second."""

    async def main() -> None:
        async with broky.connect(server.url) as client:
            started = time.monotonic()
            for i in range(first, first + count):
                payload = f"{i // len(PARTITIONS)} {PAD}".encode()
                await client.publish("lag.x", payload, partition=PARTITIONS[i % 8])
                if rate is not None and i % 50 == 0:
                    await client.flush()
                    await asyncio.sleep(max(0.0, started + (i - first) / rate - time.monotonic()))
            await client.flush()

    asyncio.run(main())


class Background:
    """`target` in a thread; `join` raises what it raised."""

    def __init__(self, target: Callable[[], Any]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, args=(target,), daemon=True)
        self.thread.start()

    def run(self, target: Callable[[], Any]) -> None:
        try:
            target()
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the publisher did not finish"
        if self.error is not None:
            raise self.error


def gateway_stats(server: ServerProcess) -> dict[str, Any]:
    view: dict[str, Any] = debug_stats(server)["master"]["http"]
    return view


def wait_live(server: ServerProcess) -> dict[str, Any]:
    """The gateway's counters once no stream lags (within 10 s)."""
    deadline = time.monotonic() + 10
    while (view := gateway_stats(server))["lagging"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return view


def consecutive(reader: SlowReader, per_partition: int) -> None:
    for partition in PARTITIONS:
        assert reader.messages.get(partition) == list(range(per_partition)), partition


@pytest.mark.timeout(120)
def test_an_event_stream_read_slowly_through_a_burst_gets_every_event_from_history_then_live(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server()
    reader = SlowReader(server, "/v1/sub/lag.>")
    try:
        burst, trickle = 16_000, 2_000  # ~10 MB of events at once, then 500 a second while it reads

        def burst_then_trickle() -> None:
            publish(server, 0, burst)
            publish(server, burst, trickle, rate=500.0)

        publisher = Background(burst_then_trickle)
        time.sleep(2.0)  # the reader stops reading through the burst: its stream lags
        reader.read_until(lambda: reader.received >= burst + trickle)
        publisher.join()
        assert not reader.losses and not reader.cuts
        consecutive(reader, (burst + trickle) // len(PARTITIONS))
        view = wait_live(server)
        assert view["lagging"] == 0 and view["lag_entered"] >= 1, view
        assert 0 < view["from_history"] < burst + trickle, view  # the rest came live
        assert view["lag_evicted"] == 0 and view["streams_cut"] == 0, view
        # live again: what comes now is sent as it comes
        publish(server, burst + trickle, 800)
        reader.read_until(lambda: reader.received >= burst + trickle + 800)
        consecutive(reader, (burst + trickle + 800) // len(PARTITIONS))
        assert not reader.losses and gateway_stats(server)["from_history"] == view["from_history"]
    finally:
        reader.close()


@pytest.mark.timeout(120)
def test_a_stall_longer_than_the_replay_buffer_is_told_with_the_exact_count_then_live(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server("--replay-bytes", "1M", workers=1)
    reader = SlowReader(server, "/v1/sub/lag.>")
    try:
        burst = 16_000  # ~6 MB of messages: most of them evicted from 1 MiB before it reads
        publisher = Background(lambda: publish(server, 0, burst))
        time.sleep(3.0)
        publisher.join()
        reader.read_until(lambda: reader.received + sum(loss["dropped"] for loss in reader.losses) >= burst)
        assert reader.losses, "nothing was told"
        assert {(loss["reason"], loss["scope"]) for loss in reader.losses} == {("evicted", "stream")}
        told = sum(loss["dropped"] for loss in reader.losses)
        assert reader.received + told == burst, (reader.received, told)  # the count is exact
        for partition in PARTITIONS:  # in order, none twice (and the newest ones all there)
            numbers = reader.messages[partition]
            assert numbers == sorted(set(numbers)) and numbers[-1] == burst // len(PARTITIONS) - 1
        view = wait_live(server)
        assert view["lagging"] == 0 and view["lag_evicted"] == told and view["streams_cut"] == 0, view
        # then live, nothing more lost
        before = reader.received
        publish(server, burst, 800)
        reader.read_until(lambda: reader.received >= before + 800)
        assert sum(loss["dropped"] for loss in reader.losses) == told
        for partition in PARTITIONS:
            assert reader.messages[partition][-100:] == list(range(burst // 8, burst // 8 + 100))
    finally:
        reader.close()


@pytest.mark.timeout(120)
def test_curl_with_limit_rate_through_a_burst_gets_every_ndjson_line(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = start_server()
    out = tmp_path / "stream.ndjson"
    burst = 24_000  # ~13 MB of lines, taken at 3 MB/s
    url = f"http://{server.host}:{server.metrics_port}/v1/sub/lag.>"
    with out.open("wb") as sink:
        curl = subprocess.Popen([program("curl"), "-sN", "--limit-rate", "3M", url], stdout=sink)
    try:
        deadline = time.monotonic() + 10
        while gateway_stats(server)["streams"] < 1:  # subscribed
            assert time.monotonic() < deadline and curl.poll() is None
            time.sleep(0.05)
        publish(server, 0, burst)
        deadline = time.monotonic() + 60
        while out.read_bytes().count(b"\n") < burst:
            assert time.monotonic() < deadline and curl.poll() is None, out.read_bytes().count(b"\n")
            time.sleep(0.2)
    finally:
        curl.terminate()
        curl.wait(10)
    lines = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert not [line for line in lines if "loss" in line or "cut" in line]
    numbers: dict[str, list[int]] = {}
    for line in lines:
        numbers.setdefault(line["key_partition"], []).append(int(line["payload"].split(" ")[0]))
    assert numbers == {p: list(range(burst // len(PARTITIONS))) for p in PARTITIONS}
    view = wait_live(server)
    assert view["lag_entered"] >= 1 and view["from_history"] > 0 and view["lag_evicted"] == 0, view
