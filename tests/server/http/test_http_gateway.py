"""The HTTP way in (broky.server.http.gateway over broky.server.http.server), with real `curl` processes
against a real `broky serve`: a POST of 100,000 lines arrives intact and in order at an SDK
subscriber, `curl -N` streams what the SDK publishes, an event-stream client that is cut and
reconnects with Last-Event-ID misses nothing and gets nothing twice, errors and refusals say
why in JSON, and the server's bounds (body, connections, slow heads, slow readers) hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import broky
from broky.server.http import server as httpd
from tests.support.http import sse_events
from tests.support.paths import ROOT
from tests.support.requires import program
from tests.support.serverproc import ServerProcess

TOKEN = "gw-t0ken"
AUTH = ("-H", f"Authorization: Bearer {TOKEN}")
PARTITIONS = [f"p{i}" for i in range(8)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--auth-token", TOKEN).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def small() -> Iterator[ServerProcess]:
    """A server with small HTTP bounds, no token, no replay buffer (a slow stream is cut)."""
    proc = ServerProcess(
        "--http-max-body", "1000", "--http-max-connections", "4", "--max-pending-bytes", "64K",
        "--replay-bytes", "0",
    ).start()  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


def base(server: ServerProcess) -> str:
    return f"http://{server.host}:{server.metrics_port}"


def curl(*args: str, data: bytes | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """(HTTP status, body) of one curl run."""
    done = subprocess.run(
        [program("curl"), "-sS", "-w", "\n%{http_code}", *args],
        input=data,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    body, _, code = done.stdout.rpartition(b"\n")
    return int(code), body


def curl_json(*args: str, data: bytes | None = None) -> tuple[int, Any]:
    status, body = curl(*args, data=data)
    return status, json.loads(body)


# ---------------------------------------------------------------- publish


@pytest.mark.timeout(120)
def test_a_post_of_100000_lines_arrives_intact_and_in_order_at_an_sdk_subscriber(
    server: ServerProcess, tmp_path: Path
) -> None:
    lines = [json.dumps({"n": i, "text": f"line {i} \u00e9"}).encode() for i in range(100_000)]
    path = tmp_path / "events.ndjson"
    path.write_bytes(b"\n".join(lines) + b"\n")

    async def main() -> tuple[Any, list[broky.Message]]:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            sub = await client.subscribe("bulk.>", max_pending_msgs=200_000, max_pending_bytes=64 << 20)
            proc = await asyncio.create_subprocess_exec(
                program("curl"), "-sS", *AUTH, "-X", "POST", "--data-binary", f"@{path}",
                f"{base(server)}/v1/pub/bulk.events?partition=orders-7",
                stdout=subprocess.PIPE,
            )  # fmt: skip
            got: list[broky.Message] = []
            async with asyncio.timeout(90):
                while len(got) < len(lines):
                    got.append(await sub.next_msg())
                out, _ = await proc.communicate()
            assert proc.returncode == 0
            return json.loads(out), got

    answer, got = asyncio.run(main())
    assert [m.payload for m in got] == lines
    assert {(m.key, m.key_partition) for m in got} == {(b"bulk.events", b"orders-7")}
    assert answer["published"] == 100_000 and answer["exact"] is True
    first, last = got[0], got[-1]
    assert answer["first"] == [first.vbucket, str(first.epoch), first.offset]
    assert answer["last"] == [last.vbucket, str(last.epoch), last.offset]
    assert last.offset - first.offset == 99_999


def test_lines_0_publishes_the_body_as_one_message_and_chunked_bodies_are_taken(
    server: ServerProcess,
) -> None:
    async def main() -> list[bytes]:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            sub = await client.subscribe("whole.>")
            url = f"{base(server)}/v1/pub/whole.doc?lines=0"
            status, answer = await asyncio.to_thread(
                curl_json, *AUTH, "--data-binary", "@-", url, data=b"a\nb\n"
            )
            assert (status, answer["published"]) == (200, 1)
            status, answer = await asyncio.to_thread(
                curl_json, *AUTH, "-H", "Transfer-Encoding: chunked", "--data-binary", "@-",
                f"{base(server)}/v1/pub/whole.lines?partition=x", data=b"c\nd\n" * 5000,
            )  # fmt: skip
            assert (status, answer["published"]) == (200, 10_000)
            return [(await sub.next_msg(10)).payload for _ in range(10_001)]

    got = asyncio.run(main())
    assert got == [b"a\nb\n", *[b"c", b"d"] * 5000]


def test_lines_1_publishes_the_lines_of_a_text_file_empty_ones_included(server: ServerProcess) -> None:
    # HTTP.md: every LF ends a line, what follows the last LF is one more line unless it is
    # empty, and every line is a message (an empty line an empty message).
    cases = [
        (b"", []),
        (b"\n", [b""]),
        (b"a", [b"a"]),
        (b"a\n", [b"a"]),
        (b"a\n\n", [b"a", b""]),
        (b"\n\na", [b"", b"", b"a"]),
        (b"a\r\nb", [b"a\r", b"b"]),
    ]

    async def main() -> list[bytes]:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            sub = await client.subscribe("lines.>")
            url = f"{base(server)}/v1/pub/lines.x?partition=one"
            for body, expected in cases:
                status, answer = await asyncio.to_thread(
                    curl_json, *AUTH, "--data-binary", "@-", url, data=body
                )
                assert (status, answer["published"]) == (200, len(expected)), body
            status, answer = await asyncio.to_thread(
                curl_json, *AUTH, "--data-binary", "@-", url + "&lines=0", data=b""
            )
            assert (status, answer["published"]) == (200, 1)  # lines=0: the body, empty or not
            return [(await sub.next_msg(10)).payload for _ in range(sum(len(e) for _, e in cases) + 1)]

    got = asyncio.run(main())
    assert got == [*(line for _, expected in cases for line in expected), b""]


def test_ts_broker_is_a_decimal_string_exact_where_javascript_would_round_a_number(
    server: ServerProcess,
) -> None:
    async def main() -> tuple[broky.Message, list[Any]]:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            proc = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", *AUTH, f"{base(server)}/v1/sub/stamp.>", stdout=subprocess.PIPE
            )
            try:
                sub = await client.subscribe("stamp.>")
                await _warm_up(client, proc, "stamp.warm")
                await client.publish("stamp.x", b"stamped", partition="s")
                msg = await sub.next_msg(10)
                while msg.key != b"stamp.x":
                    msg = await sub.next_msg(10)
                lines = await _stream_until(proc, lambda ls: any(b"stamped" in x for x in ls))
            finally:
                proc.kill()
                await proc.wait()
            return msg, [json.loads(x) for x in lines if b"stamped" in x]

    msg, (record,) = asyncio.run(main())
    assert record["ts_broker"] == str(msg.ts_broker) and msg.ts_broker > 2**53  # exact, as "epoch"
    assert record["epoch"] == str(msg.epoch)


def test_keep_alive_carries_many_requests_on_one_connection(server: ServerProcess) -> None:
    url = f"{base(server)}/v1/pub/ka.x?partition=k"
    done = subprocess.run(
        [program("curl"), "-sS", *AUTH, "-w", "%{num_connects}\n", "--data-binary", "x",
         "-o", "/dev/null", url, "-o", "/dev/null", "--data-binary", "y", url,
         "-o", "/dev/null", "--data-binary", "z", url],
        capture_output=True, timeout=30, check=True,
    )  # fmt: skip
    assert done.stdout.split() == [b"1", b"0", b"0"]  # one connection for the three


def test_a_lane_gets_what_a_worker_refuses_back_in_order_and_carries_on(server: ServerProcess) -> None:
    """The gateway's second try after a move, on one node: a lane to a worker that does not
    own the vbucket gets the messages back (NOT_MY_VBUCKET), in order, between its Reads'
    refusals, and serves the next POST; the owner takes them, and the answer over both is
    exact."""
    from broky.client.connection import open_connection
    from broky.protocol import Error, Hello, ReadDone, encode_message, new_ksuid, vbucket_of
    from broky.server.http.gateway import Lane, _answer

    async def lane(worker: int) -> Lane:
        lane = Lane("node", worker)
        lane.proto, _ = await open_connection(
            server.host, server.port, Hello(worker=worker, auth_token=TOKEN), 5
        )
        lane.proto.attach(lane)
        return lane

    def kp_of(vmap: Any, worker: int) -> bytes:
        return next(
            kp for kp in (b"lane-%d" % i for i in range(1000)) if vmap.owners[vbucket_of(kp)] == (0, worker)
        )

    async def main() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            sub = await client.subscribe("lane.>")
            assert client.server_info is not None
            kp0, kp1 = kp_of(client.server_info.map, 0), kp_of(client.server_info.map, 1)
            vb = vbucket_of(kp0)
            frames = [encode_message(kp0, b"lane.x", b"m%d" % i, 1, uid=new_ksuid()) for i in range(3)]
            one, zero = await lane(1), await lane(0)
            try:
                refused = await one.publish(kp0, vb, frames, 10)
                assert refused.refused == frames and refused.accepted == 0 and not refused.errors
                assert [(type(p), p.rid) for p in refused.probes] == [(Error, 1), (Error, 1)]
                other = [encode_message(kp1, b"lane.y", b"y", 1, uid=new_ksuid())]
                ok = await one.publish(kp1, vbucket_of(kp1), other, 10)  # the lane carries on
                assert not ok.refused and [type(p) for p in ok.probes] == [ReadDone, ReadDone]
                placed = await zero.publish(kp0, vb, refused.refused, 10)
            finally:
                for each in (one, zero):
                    each.fail(ConnectionError("the test is over"))
            answer = _answer(vb, 3, [refused, placed])
            got = {m.payload: m for m in [await sub.next_msg(10) for _ in range(4)]}
            first, last = got[b"m0"], got[b"m2"]
            assert answer["exact"] is True
            assert answer["first"] == [vb, str(first.epoch), first.offset]
            assert answer["last"] == [vb, str(last.epoch), last.offset] and last.offset == first.offset + 2

    asyncio.run(main())


def test_a_post_that_cannot_be_placed_is_a_503_that_says_why(
    start_server: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's code in this process, against a real server that then goes: the POST is
    tried again until its deadline (1 s here, 30 s in the server), then refused with a 503
    naming the worker it could not reach and how many messages were published (none)."""
    from broky.protocol import new_ksuid, vbucket_of
    from broky.server.config import ServerConfig
    from broky.server.http import gateway
    from broky.server.http.server import HttpError

    server = start_server()
    monkeypatch.setattr(gateway, "PUBLISH_TIMEOUT", 1.0)
    config = ServerConfig(host=server.host, port=server.port, node_id="here")

    async def main() -> None:
        gw = gateway.Gateway(None, config, lambda: True, server.host)  # type: ignore[arg-type]  # no routes
        try:
            client = await gw.sdk()
            kp = b"placed"
            frame = gateway._encode(kp, b"p.x", b"m", 1, new_ksuid())
            answer = await gw._place(client, kp, vbucket_of(kp), [frame])
            assert answer["published"] == 1 and answer["exact"] is True
            server.stop()
            await asyncio.sleep(0.5)  # the lane takes the Goodbye and the end of its connection
            started = time.monotonic()
            with pytest.raises(HttpError) as refused:
                await gw._place(client, kp, vbucket_of(kp), [frame])
            assert 1.0 <= time.monotonic() - started < 5
        finally:
            await gw.close()
        body = json.loads(refused.value.answer().body)
        assert body["status"] == 503 and body["published"] == 0, body
        assert body["error"].startswith("publish failed: cannot reach worker "), body
        assert "then no owner of vbucket" in body["error"] and "within 1 s" in body["error"], body
        assert (gw.counters.publish_retries, gw.counters.publish_failed) == (1, 1)

    asyncio.run(main())


# ---------------------------------------------------------------- subscribe


async def _stream_until(
    proc: asyncio.subprocess.Process, want: Any, timeout: float = 30, or_timeout: bool = False
) -> list[bytes]:
    """Lines of `proc`'s stdout until `want(lines)` holds (`or_timeout`: or the time is up)."""
    assert proc.stdout is not None
    lines: list[bytes] = []
    try:
        async with asyncio.timeout(timeout):
            while not want(lines):
                line = await proc.stdout.readline()
                assert line, f"the stream ended: {lines[-5:]}"
                lines.append(line.rstrip(b"\n"))
    except TimeoutError:
        if not or_timeout:
            raise
    return lines


async def _warm_up(client: broky.Client, proc: asyncio.subprocess.Process, key: str) -> list[bytes]:
    """Publish to `key` until the stream shows one: then its subscription is in place."""
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        while True:
            await client.publish(key, b"warm", partition="warm")
            try:
                async with asyncio.timeout(0.1):
                    line = await proc.stdout.readline()
            except TimeoutError:
                continue
            return [line.rstrip(b"\n")]


def test_curl_n_streams_what_the_sdk_publishes_as_ndjson_and_raw(server: ServerProcess) -> None:
    async def main() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            for fmt in ("ndjson", "raw"):
                proc = await asyncio.create_subprocess_exec(
                    program("curl"), "-sSN", *AUTH, f"{base(server)}/v1/sub/live.>?format={fmt}",
                    stdout=subprocess.PIPE,
                )  # fmt: skip
                try:
                    await _warm_up(client, proc, "live.warm")
                    sent = [f"m-{i}".encode() for i in range(1000)]
                    for i, payload in enumerate(sent):
                        await client.publish(f"live.{i % 3}", payload, partition=PARTITIONS[i % 8])
                    lines = await _stream_until(proc, lambda ls: sum(1 for x in ls if b"m-" in x) >= 1000)
                finally:
                    proc.kill()
                    await proc.wait()
                if fmt == "raw":
                    payloads = [line for line in lines if line.startswith(b"m-")]
                else:
                    records = [json.loads(line) for line in lines]
                    payloads = [r["payload"].encode() for r in records if r["key"] != "live.warm"]
                    assert {r["key_partition"] for r in records if r["key"] != "live.warm"} == set(PARTITIONS)
                for p in PARTITIONS:  # in order per partition, every one
                    mine = [s for i, s in enumerate(sent) if PARTITIONS[i % 8] == p]
                    assert [x for x in payloads if x in set(mine)] == mine

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_streams_of_every_format_at_once_each_get_every_message_with_ids_of_their_own(
    server: ServerProcess,
) -> None:
    # The gateway formats a message once for all its streams (gateway.py, "Formatting once"):
    # each stream still gets every message, and each SSE stream its own ids.
    async def main() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            procs = []
            for fmt in ("sse", "sse", "ndjson", "raw"):
                procs.append(
                    await asyncio.create_subprocess_exec(
                        program("curl"), "-sSN", *AUTH, f"{base(server)}/v1/sub/many.>?format={fmt}",
                        stdout=subprocess.PIPE,
                    )
                )  # fmt: skip
            try:
                for proc in procs:
                    await _warm_up(client, proc, "many.warm")
                sent = [(PARTITIONS[i % 8], f"f-{i}".encode()) for i in range(300)]
                for part, payload in sent:
                    await client.publish("many.x", payload, partition=part)

                def done(ls: list[bytes]) -> bool:  # (an SSE event is whole at its empty line)
                    return sum(1 for x in ls if b'"f-' in x or x.startswith(b"f-")) >= len(sent) and (
                        ls[-1] == b"" or not ls[-1].startswith(b"data: ")
                    )

                lines = [await _stream_until(p, done) for p in procs]
            finally:
                for proc in procs:
                    proc.kill()
                    await proc.wait()
        events = [[e for e in sse_events(ls) if '"f-' in e.get("data", "")] for ls in lines[:2]]
        records = [json.loads(x) for x in lines[2] if b'"f-' in x]
        payloads = [r["payload"].encode() for r in records]  # every one, once (in order per partition:
        assert sorted(payloads) == sorted(p for _, p in sent)  # the other tests; workers interleave)
        assert [x for x in lines[3] if x.startswith(b"f-")] == payloads  # one client feeds every stream
        tails = []
        for stream in events:
            assert [json.loads(e["data"]) for e in stream] == records  # the same JSON as ndjson's
            for e, r in zip(stream, records, strict=True):
                vb, epoch, offset = (int(x, 36) for x in e["id"].split(".")[:3])
                assert (vb, str(epoch), offset) == (r["vbucket"], r["epoch"], r["offset"])
            tails.append({e["id"].split(".", 3)[3] for e in stream})
        assert len(tails[0]) == len(tails[1]) == 1 and tails[0] != tails[1]  # each stream's own

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_an_event_stream_cut_and_resumed_with_last_event_id_misses_nothing(server: ServerProcess) -> None:
    url = f"{base(server)}/v1/sub/sse.>"
    accept = ("-H", "Accept: text/event-stream")

    async def main() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            first = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", *accept, url + f"?access_token={TOKEN}", stdout=subprocess.PIPE
            )
            await _warm_up(client, first, "sse.warm")
            sent = [(PARTITIONS[i % 8], f"e-{i}".encode()) for i in range(600)]
            for part, payload in sent[:300]:
                await client.publish("sse.x", payload, partition=part)

            def enough(ls: list[bytes]) -> bool:
                return sum(1 for e in sse_events(ls) if e.get("data", "").find('"e-') >= 0) >= 150

            lines = await _stream_until(first, enough)
            first.kill()  # mid-stream: what it had not read is gone with it
            await first.wait()
            events = [e for e in sse_events(lines) if "id" in e]
            last_id = events[-1]["id"]
            for part, payload in sent[300:]:  # while it is away
                await client.publish("sse.x", payload, partition=part)
            second = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", *accept, "-H", f"Last-Event-ID: {last_id}",
                "--cookie", f"broky_token={TOKEN}", url, stdout=subprocess.PIPE,
            )  # fmt: skip
            need = len(sent) - sum(1 for e in events if '"e-' in e.get("data", ""))
            try:  # (on a timeout, what came: the comparison below says what is missing)
                more = await _stream_until(
                    second,
                    lambda ls: sum(1 for e in sse_events(ls) if '"e-' in e.get("data", "")) >= need,
                    20,
                    True,
                )
            finally:
                second.kill()
                await second.wait()
            resumed = sse_events(more)
            assert not [e for e in resumed if e.get("event") in ("loss", "cut")], resumed[:3]
            got = [
                json.loads(e["data"])
                for e in [*events, *(e for e in resumed if "id" in e)]
                if '"e-' in e.get("data", "")
            ]
            payloads = [g["payload"].encode() for g in got]
            assert sorted(payloads) == sorted(p for _, p in sent)  # each once
            for p in PARTITIONS:  # in order per partition
                mine = [pl for part, pl in sent if part == p]
                assert [g["payload"].encode() for g in got if g["key_partition"] == p] == mine
            for g, e in zip(got, [e for e in [*events, *resumed] if '"e-' in e.get("data", "")], strict=True):
                vb, epoch, offset = (int(x, 36) for x in e["id"].split(".")[:3])
                assert (vb, str(epoch), offset) == (g["vbucket"], g["epoch"], g["offset"])

    asyncio.run(main())


def test_an_id_the_server_cannot_use_resumes_its_vbucket_and_says_so(server: ServerProcess) -> None:
    url = f"{base(server)}/v1/sub/gone.>"
    done = subprocess.run(
        [program("curl"), "-sSN", "-m", "2", *AUTH, "-H", "Accept: text/event-stream",
         "-H", "Last-Event-ID: 1.2.3.zzzz.nope", url],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    events = sse_events(done.stdout.split(b"\n"))
    loss = [json.loads(e["data"]) for e in events if e.get("event") == "loss"]
    # First the id the server could not use, then the worker's word on its position: an epoch
    # it never had (told to this stream alone: the subscription's own LossNotice).
    assert loss == [
        {"dropped": None, "reason": "resume_unknown", "scope": "stream"},
        {"dropped": None, "reason": "epoch_changed", "scope": "stream"},  # how many: not known
    ]


@pytest.mark.timeout(90)
def test_a_count_the_server_does_not_know_is_null_never_0(start_server: Callable[..., ServerProcess]) -> None:
    # Without a replay buffer a start from a time is told EVICTED without a count (the
    # protocol's 0: schema/README.md 5.1); the stream must say null, not "0 lost". A resume
    # with Last-Event-ID across a cut starts the vbuckets it reached from their positions
    # (an exact count) and the others from a time (unknown): neither may read as 0.
    # (Each vbucket takes messages before the time too: the server cannot know which of its
    # offsets came after it. A vbucket whose whole sequence came after it is told exactly.)
    s = start_server("--replay-bytes", "0")
    url = f"{base(s)}/v1/sub/unk.>"

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        async with broky.connect(s.url) as client:
            for i in range(8):
                await client.publish("unk.before", b"before", partition=PARTITIONS[i % 8])
            await client.flush()
            await asyncio.sleep(0.01)
            began = time.time()
            await asyncio.sleep(0.01)
            for i in range(40):
                await client.publish("unk.early", b"early", partition=PARTITIONS[i % 8])
            await client.flush()
            ndjson = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", "-m", "3", f"{url}?since_time={began:.6f}", stdout=subprocess.PIPE
            )  # fmt: skip
            out, _ = await ndjson.communicate()
            told = [json.loads(x)["loss"] for x in out.split(b"\n") if x.startswith(b'{"loss"')]
            first = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", "-H", "Accept: text/event-stream", url, stdout=subprocess.PIPE
            )
            await _warm_up(client, first, "unk.warm")
            for i in range(80):
                await client.publish("unk.x", b"u-%d" % i, partition=PARTITIONS[i % 8])
            lines = await _stream_until(first, lambda ls: sum(1 for x in ls if b'"u-' in x) >= 40)
            first.kill()
            await first.wait()
            # What the resume stands on: the events up to the last one with an id (a line of
            # an event still incomplete when the stream was cut is not among them).
            events = sse_events(lines)
            through = max(i for i, e in enumerate(events) if "id" in e)
            last_id = events[through]["id"]
            got = sum(1 for e in events[: through + 1] if '"u-' in e.get("data", ""))
            for i in range(80, 160):  # while it is away: gone (nothing is retained)
                await client.publish("unk.x", b"u-%d" % i, partition=PARTITIONS[i % 8])
            await client.flush()
            second = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", "-m", "3", "-H", "Accept: text/event-stream",
                "-H", f"Last-Event-ID: {last_id}", url, stdout=subprocess.PIPE,
            )  # fmt: skip
            more, _ = await second.communicate()
            again = sse_events(more.split(b"\n"))
            resumed = [json.loads(e["data"]) for e in again if e.get("event") == "loss"]
            return told, resumed, 160 - got

    told, resumed, lost = asyncio.run(main())
    assert told and all(t == {"dropped": None, "reason": "evicted", "scope": "stream"} for t in told), told
    assert resumed, "the resume was told nothing"
    counts = [r["dropped"] for r in resumed]
    assert all(n is None or n > 0 for n in counts), resumed  # never "0 lost"
    assert sum(n for n in counts if n is not None) <= lost, (resumed, lost)


def test_an_id_resolves_as_often_as_it_is_sent() -> None:
    # A resume that dies before its first event is sent the same Last-Event-ID again (a
    # browser keeps the last id it got): the ledger must still find it, with the same answer.
    from broky.server.http.gateway import Ledger

    ledger = Ledger(1, "secret", 0)
    for offset in range(1, 11):
        ledger.add((offset % 3, 7, offset))
    first = ledger.resume_at(2, 7, 5)
    assert first == {1: (7, 4), 2: (7, 5), 0: (7, 3)}
    assert ledger.resume_at(2, 7, 5) == first  # sent again: the same positions
    assert ledger.resume_at(1, 7, 4) == {1: (7, 4), 2: (7, 2), 0: (7, 3)}  # an earlier one too
    assert ledger.resume_at(2, 7, 5) is None  # (forgotten: events after the one resumed are sent again)
    ledger.add((2, 7, 5))
    assert ledger.resume_at(2, 7, 5) == first


@pytest.mark.timeout(60)
def test_the_same_last_event_id_sent_twice_loses_nothing(server: ServerProcess) -> None:
    url = f"{base(server)}/v1/sub/twice.>?format=sse&access_token={TOKEN}"

    def sse(*args: str) -> Any:
        return asyncio.create_subprocess_exec(program("curl"), "-sSN", *args, url, stdout=subprocess.PIPE)

    async def main() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            first = await sse()
            await _warm_up(client, first, "twice.warm")
            sent = [(PARTITIONS[i % 8], b"t-%d" % i) for i in range(200)]
            for part, payload in sent[:100]:
                await client.publish("twice.x", payload, partition=part)
            lines = await _stream_until(first, lambda ls: sum(1 for x in ls if b'"t-' in x) >= 50)
            first.kill()
            await first.wait()
            events = [e for e in sse_events(lines) if '"t-' in e.get("data", "")]
            last_id = events[-1]["id"]
            # The reconnect dies before its first event: nothing is published meanwhile.
            second = await sse("-H", f"Last-Event-ID: {last_id}")
            assert second.stdout is not None
            async with asyncio.timeout(10):
                assert (await second.stdout.readline()).startswith(b"retry:")
            second.kill()
            await second.wait()
            for part, payload in sent[100:]:
                await client.publish("twice.x", payload, partition=part)
            third = await sse("-H", f"Last-Event-ID: {last_id}")
            need = len(sent) - len(events)
            try:
                more = await _stream_until(
                    third,
                    lambda ls: sum(1 for e in sse_events(ls) if '"t-' in e.get("data", "")) >= need,
                    20,
                    True,
                )
            finally:
                third.kill()
                await third.wait()
            resumed = sse_events(more)
            assert not [e for e in resumed if e.get("event") == "loss"], resumed[:3]
            got = [
                json.loads(e["data"])["payload"].encode()
                for e in [*events, *resumed]
                if '"t-' in e.get("data", "")
            ]
            assert sorted(got) == sorted(p for _, p in sent)  # each once

    asyncio.run(main())


# ---------------------------------------------------------------- errors and refusals


def test_4xx_answers_say_what_was_wrong_in_json(server: ServerProcess) -> None:
    b = base(server)
    cases = [
        (("-X", "POST", f"{b}/v1/pub/a.b?lines=2"), 400, "lines must be 0"),
        (("-X", "POST", f"{b}/v1/pub/"), 400, "the key is missing"),
        ((f"{b}/v1/sub/a..b",), 400, "bad pattern 'a..b': an empty token"),
        ((f"{b}/v1/sub/a.>.b",), 400, "bad pattern 'a.>.b': '>' may only be the last token"),
        ((f"{b}/v1/sub/a.b*",), 400, "bad pattern 'a.b*': a wildcard inside a token"),
        ((f"{b}/v1/sub/",), 400, "bad pattern '': the pattern is empty"),
        ((f"{b}/v1/sub/a?format=xml",), 400, "format must be one of ndjson, raw, sse"),
        ((f"{b}/v1/sub/a?last=-1",), 400, "last must be a count"),
        ((f"{b}/v1/sub/a?since_time=yesterday",), 400, "since_time must be"),
        ((f"{b}/v1/sub/a?format=ndjson&last_event_id=x",), 400, "resumes an event stream"),
        ((f"{b}/v1/sub/a?format=sse&last_event_id=x",), 400, "is not an id this server gave"),
        ((f"{b}/v1/sub/a?since_time=-1",), 400, "since_time '-1' is out of range: from 1970"),
        ((f"{b}/v1/sub/a?since_time=1969-12-31T23:59:59Z",), 400, "since_time '1969-12-31T23:59:59Z' is out"),
        ((f"{b}/v1/sub/a?since_time=9223372037",), 400, "since_time '9223372037' is out of range"),
        ((f"{b}/v1/sub/a?since_time=9999-01-01T00:00:00%2B00:00",), 400, "is out of range"),
        ((f"{b}/v1/sub/a?since_time=nan",), 400, "since_time must be seconds"),
        ((f"{b}/v1/sub/a?last=4294967296",), 400, "last must be a count (0 .. 4294967295)"),
        ((f"{b}/v1/sub/a?format=sse&last_event_id=1.{'1' + '0' * 13}.1.1.x",), 400, "not an id this server"),
        ((f"{b}/v1/sub/a?format=sse&last_event_id=1.1.{'1' + '0' * 13}.1.x",), 400, "not an id this server"),
        ((f"{b}/v1/pub/a.b",), 405, "POST only"),
        (("-X", "POST", f"{b}/v1/sub/a"), 405, "GET, HEAD only"),
        ((f"{b}/v1/nothing",), 404, "no such path"),
        (("-X", "PUT", f"{b}/v1/pub/a"), 405, "GET, HEAD, POST, OPTIONS only"),
    ]
    too_big = b"x" * (1 << 20)  # --max-frame-bytes is 1 MiB: no room for the rest of the frame
    status, body = curl_json(*AUTH, "--data-binary", "@-", f"{b}/v1/pub/big.x?lines=0", data=too_big)
    assert status == 413 and body["error"].startswith("a message of 1048576 bytes: at most ")
    for args, status, text in cases:
        got_status, body = curl_json(*AUTH, *args)
        assert (got_status, body["status"]) == (status, status), (args, body)
        assert body["error"].startswith(text) or text in body["error"], (args, body)


def test_401_says_why_for_each_way_of_giving_the_token(server: ServerProcess) -> None:
    b = base(server)
    pub = f"{b}/v1/pub/auth.x"
    status, body = curl_json("--data-binary", "x", pub)
    assert status == 401 and body["error"] == (
        "/v1/pub/auth.x needs the server's auth token: send 'Authorization: Bearer <token>', "
        "the broky_token cookie or ?access_token=<token>"
    )
    status, body = curl_json("-H", "Authorization: Basic dXNlcjpwdw==", "--data-binary", "x", pub)
    assert (status, body["error"]) == (401, "malformed Authorization header: expected 'Bearer <token>'")
    for way in (("-H", "Authorization: Bearer nope"), ("--cookie", "broky_token=nope"), ()):
        target = pub + ("?access_token=nope" if not way else "")
        status, body = curl_json(*way, "--data-binary", "x", target)
        assert (status, body["error"]) == (401, "wrong auth token"), way
    for way in (AUTH, ("--cookie", f"a=1; broky_token={TOKEN}"), ()):
        target = pub + (f"?access_token={TOKEN}" if not way else "")
        status, body = curl_json(*way, "--data-binary", "x", target)
        assert (status, body["published"]) == (200, 1), way
    log = server.log()
    assert TOKEN not in log and "Traceback" not in log


def test_a_body_over_http_max_body_is_413_with_either_framing(small: ServerProcess) -> None:
    url = f"{base(small)}/v1/pub/big.x"
    status, body = curl_json("--data-binary", "@-", url, data=b"x" * 1001)
    assert (status, body["error"]) == (413, "body of 1001 bytes over 1000 (--http-max-body)")
    status, body = curl_json("-H", "Transfer-Encoding: chunked", "--data-binary", "@-", url, data=b"x" * 1001)
    assert (status, body["error"]) == (413, "body over 1000 bytes (--http-max-body)")
    status, body = curl_json("--data-binary", "@-", url, data=b"x" * 1000)
    assert (status, body["published"]) == (200, 1)


def _raw(server: ServerProcess) -> socket.socket:
    return socket.create_connection((server.host, server.metrics_port), timeout=15)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.timeout(60)
def test_connections_past_the_bound_get_503_and_slow_heads_are_cut(small: ServerProcess) -> None:
    held = [_raw(small) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(b"GET /v1/sub/x HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
        time.sleep(0.3)
        with _raw(small) as extra:
            answer = _read_all(extra)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 503 ") and b"\r\nRetry-After: 1\r\n" in head
        assert json.loads(body)["error"].startswith("the server serves 4 HTTP connections already")
        # An event stream's request is asked to come back instead (an EventSource gives up on a 503).
        with _raw(small) as extra:
            extra.sendall(b"GET /v1/sub/x HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
            head, _, body = _read_all(extra).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Type: text/event-stream" in head
        retry, event = body.split(b"\n\n")[:2]
        assert retry == b"retry: 1000"
        assert event.split(b"\n")[0] == b"event: unavailable"
        told = json.loads(event.split(b"\n")[1].removeprefix(b"data: "))
        assert told["status"] == 503 and told["error"].startswith("the server serves 4 HTTP connections")
        started = time.monotonic()
        for sock in held:  # each cut after REQUEST_TIMEOUT, told why
            head, _, body = _read_all(sock).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 408 "), head
            assert json.loads(body)["error"] == f"no complete request head within {httpd.REQUEST_TIMEOUT:g} s"
        assert time.monotonic() - started < httpd.REQUEST_TIMEOUT + 2
    finally:
        for sock in held:
            sock.close()
    status, body = curl("-o", "/dev/null", f"{base(small)}/healthz")
    assert status == 200  # served again once they are gone
    metrics = curl(f"{base(small)}/metrics")[1].decode()
    assert "broky_http_refused_total 2" in metrics
    assert "broky_http_cut_slow_total 4" in metrics


@pytest.mark.timeout(60)
def test_connections_open_at_sigterm_end_without_an_error_logged(
    start_server: Callable[..., ServerProcess],
) -> None:
    # A refused connection lingers after its 503 until its client closes (or 1 s); one open
    # at SIGTERM must end quietly, as must an idle one and a stream.
    s = start_server("--http-max-connections", "2", workers=1)
    stream, idle = _raw(s), _raw(s)
    stream.sendall(b"GET /v1/sub/x.> HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
    assert stream.recv(65536).startswith(b"HTTP/1.1 200 OK")
    with _raw(s) as refused:
        assert refused.recv(65536).startswith(b"HTTP/1.0 503 ")  # and it stays open
        s.signal(signal.SIGTERM)
        assert s.wait(15) == 0
    stream.close()
    idle.close()
    log = s.log()
    assert "stopped in" in log
    assert "Traceback" not in log and " ERROR " not in log, log


@pytest.mark.timeout(60)
def test_without_a_replay_buffer_a_reader_that_does_not_read_is_cut_told_and_the_stream_ends_cleanly(
    small: ServerProcess,
) -> None:
    # (with one, its stream lags instead: tests/server/http/test_http_lag.py)
    with _raw(small) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /v1/sub/slow.> HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        time.sleep(0.5)

        async def flood() -> None:
            async with broky.connect(small.url) as client:
                for i in range(3000):
                    await client.publish(
                        "slow.x", os.urandom(500).hex().encode(), partition=PARTITIONS[i % 8]
                    )
                await client.flush()

        asyncio.run(flood())
        time.sleep(1.0)
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in data
    assert data.endswith(b"0\r\n\r\n")  # the stream's end, not a cut connection
    assert b"event: cut\ndata: " in data
    cut = data[data.index(b"event: cut") :].split(b"\n")[1]
    told = json.loads(cut.removeprefix(b"data: "))
    assert told["reason"] == "slow_consumer" and told["limit"] == 64 << 10
    metrics = curl(f"{base(small)}/metrics")[1].decode()
    assert "broky_http_streams_cut_total 1" in metrics


# ---------------------------------------------------------------- the docs' examples


def _docs_http() -> tuple[list[str], list[str]]:
    """docs/http.md: its shell command lines, and its JSON examples."""
    section = (ROOT / "docs" / "http.md").read_text()
    commands = [
        line
        for block in re.findall(r"```sh\n(.*?)```", section, re.S)
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return commands, re.findall(r"```json\n(.*?)\n```", section, re.S)


def _gauge(server: ServerProcess, name: str) -> float:
    text = curl(f"{base(server)}/metrics")[1].decode()
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.timeout(60)
def test_the_docs_curl_examples_work_as_written(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    s = start_server()
    commands, examples = _docs_http()
    here = f"{s.host}:{s.metrics_port}"
    env = {**os.environ, "BROKY_AUTH_TOKEN": "unused: this server has no token"}
    streams = [c for c in commands if "curl -N" in c]
    others = [c for c in commands if "curl -N" not in c]
    assert len(streams) == 3 and len(others) == 5, commands
    procs = [
        subprocess.Popen(
            ["bash", "-c", c.replace("localhost:9477", here)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        for c in streams
    ]
    try:
        deadline = time.monotonic() + 20
        while _gauge(s, "broky_http_streams") < 3:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.1)
        outputs = [
            subprocess.run(
                ["bash", "-c", c.replace("localhost:9477", here)],
                cwd=tmp_path,
                capture_output=True,
                env=env,
                timeout=30,
                check=True,
            ).stdout
            for c in others
        ]
        time.sleep(1.0)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
    got = [proc.communicate(timeout=10)[0] for proc in procs]
    # The outputs are those shown, but for the epoch (a new one per server start) and the uid.
    published = [json.loads(out) for out in outputs if out.startswith(b'{"published"')]
    assert [p["published"] for p in published] == [2, 1, 2]
    shown = json.loads(examples[0])
    first = published[0]
    epoch = first["first"][1]
    assert json.dumps(first) == json.dumps(shown).replace(shown["first"][1], epoch)
    assert outputs[-1].decode().strip() == examples[-1].strip()  # the 400
    ndjson, raw, sse = got
    line = json.loads(ndjson.split(b"\n")[0])
    example = json.loads(examples[1])
    assert list(line) == list(example)
    assert {k: line[k] for k in ("key", "key_partition", "payload", "vbucket", "offset")} == {
        k: example[k] for k in ("key", "key_partition", "payload", "vbucket", "offset")
    }
    assert raw.split(b"\n")[:2] == [b'{"id": 1}', b'{"id": 2}']
    events = sse_events(sse.split(b"\n"))
    assert [json.loads(e["data"])["payload"] for e in events if "id" in e][:2] == ['{"id": 1}', '{"id": 2}']


def test_last_and_since_time_start_with_retained_messages(server: ServerProcess) -> None:
    began = time.time()

    async def publish() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            for i in range(5):
                await client.publish("hist.x", b"h-%d" % i, partition="hist")

    asyncio.run(publish())
    url = f"{base(server)}/v1/sub/hist.>"
    for query, expected in (
        ("?format=raw&last=2", [b"h-3", b"h-4"]),
        (f"?format=raw&since_time={began:.6f}", [b"h-0", b"h-1", b"h-2", b"h-3", b"h-4"]),
        ("?format=raw&since_time=" + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began - 1)),
         [b"h-0", b"h-1", b"h-2", b"h-3", b"h-4"]),
        ("?format=raw", []),
    ):  # fmt: skip
        done = subprocess.run(
            [program("curl"), "-sSN", "-m", "1.5", *AUTH, url + query],
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert done.stdout.split(b"\n")[:-1] == expected, query


def test_a_resume_of_a_stream_still_open_ends_that_stream_and_takes_it_over(server: ServerProcess) -> None:
    url = f"{base(server)}/v1/sub/over.>?format=sse"

    async def main() -> None:
        async with broky.connect(server.url, auth_token=TOKEN) as client:
            first = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", *AUTH, url, stdout=subprocess.PIPE
            )
            await _warm_up(client, first, "over.warm")
            for i in range(5):
                await client.publish("over.x", b"o-%d" % i, partition="o")
            lines = await _stream_until(
                first, lambda ls: sum(1 for e in sse_events(ls) if "o-" in e.get("data", "")) >= 2
            )
            mid = [e for e in sse_events(lines) if "o-" in e.get("data", "")][1]["id"]  # after o-1
            second = await asyncio.create_subprocess_exec(
                program("curl"), "-sSN", *AUTH, "-H", f"Last-Event-ID: {mid}", url, stdout=subprocess.PIPE
            )
            try:
                async with asyncio.timeout(10):
                    assert await first.wait() == 0  # its stream ended (with its last chunk)
                more = await _stream_until(
                    second, lambda ls: sum(1 for e in sse_events(ls) if "o-" in e.get("data", "")) >= 3
                )
            finally:
                second.kill()
                await second.wait()
            events = sse_events(more)
            assert not [e for e in events if e.get("event") == "loss"]
            assert [json.loads(e["data"])["payload"] for e in events if "id" in e] == ["o-2", "o-3", "o-4"]

    asyncio.run(main())


def test_an_sse_stream_gets_a_keepalive_at_the_second_tick_without_a_write() -> None:
    # The gateway ticks every KEEPALIVE_SECONDS / 2 (one task for all streams, gateway.py
    # "Keepalives"): a comment goes to a stream that wrote nothing since the tick before.
    from broky.server.http.gateway import KEEPALIVE, SubStream

    async def main() -> None:
        stream = SubStream(None, "sse", 1 << 20, None)  # type: ignore[arg-type]  # no gateway: none used
        stream._put(b"id: x\ndata: {}\n\n")
        stream.keepalive()  # the first tick after a write: nothing yet
        assert await stream.next() == b"id: x\ndata: {}\n\n"
        stream.keepalive()  # written since the tick before
        assert not stream.parts
        stream.keepalive()  # a whole tick without a write
        assert await stream.next() == KEEPALIVE
        stream.keepalive()
        stream.keepalive()  # and again a whole tick later
        assert await stream.next() == KEEPALIVE
        stream.ended = True
        stream.keepalive()
        stream.keepalive()  # an ended stream gets none
        assert await stream.next() is None

    asyncio.run(main())


def test_an_event_stream_the_workers_cannot_serve_yet_is_asked_to_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A request waits up to READY_WAIT for the workers (a server that starts), then an event
    # stream is answered 200 with `retry:` and why (a browser's EventSource would give up on
    # a 503), and the other formats 503.
    from broky.server.config import ServerConfig
    from broky.server.http import gateway
    from broky.server.http.server import HttpServer, Request

    monkeypatch.setattr(gateway, "READY_WAIT", 0.2)

    async def main() -> None:
        gw = gateway.Gateway(HttpServer(), ServerConfig(), lambda: False, "127.0.0.1")
        sse = Request("GET", "/v1/sub/a.>", {}, {"accept": "text/event-stream"})
        started = time.monotonic()
        status, ctype, body = await gw.subscribe(sse)  # type: ignore[misc]
        assert time.monotonic() - started >= 0.2
        assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
        assert body == (
            b'retry: 1000\n\nevent: unavailable\ndata: {"error": "the workers are not ready after 0.2 s; '
            b'try again in a moment", "status": 503}\n\n'
        )
        assert gw.counters.retry_later == 1
        with pytest.raises(httpd.HttpError) as refused:
            await gw.subscribe(Request("GET", "/v1/sub/a.>", {}, {}))
        assert refused.value.status == 503
        with pytest.raises(httpd.HttpError) as bad:  # bad input is still a 400, at once
            await gw.subscribe(Request("GET", "/v1/sub/a.>", {"last": "x"}, {"accept": "text/event-stream"}))
        assert bad.value.status == 400

    asyncio.run(main())
