"""The HTTP way in on a cluster: real etcd, two real nodes, real `curl` processes.

- A POST on either node publishes at the owner of its vbucket, whichever node
  that is (the gateway forwards it on its lane to that worker): the answers'
  positions are the ones an SDK subscriber receives, and it receives all.
- A stream on one node (ndjson, and SSE resumed with Last-Event-ID) carries the
  messages of the vbuckets the other node owns; a Last-Event-ID taken to the
  other node resumes its own vbucket only, and says so.
- A POST whose owner died is placed at the new owner once the map says so
  (the gateway refreshes the map and tries again within the request's time),
  and POSTs during a join and a drain all arrive, each once, in order, at the
  positions their answers name.

Leases of 2 s, moves committed within 4 s, one worker per node: seconds, not
minutes. Processes are stopped by pid (tests/support/cluster.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import broky
from broky.protocol import VBucketMap, vbucket_of
from tests.support import requires
from tests.support.cluster import Cluster, EtcdServer, kp_owned_by
from tests.support.http import sse_events
from tests.support.requires import program
from tests.support.serverproc import ServerProcess


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    """Nodes a and b, one worker each, settled on one map."""
    requires.program("etcd")
    etcd = EtcdServer().start()
    c = Cluster(etcd, lease_ttl=2, move_timeout=4.0)
    try:
        c.start("a", workers=1)
        c.start("b", workers=1)
        c.wait_settled()
        yield c
    finally:
        c.stop()
        etcd.stop()


def base(node: ServerProcess) -> str:
    return f"http://{node.host}:{node.metrics_port}"


def current_map(cluster: Cluster) -> VBucketMap:
    return cluster.history()[-1]


async def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """(status, JSON answer) of `curl --data-binary @- url`."""
    proc = await asyncio.create_subprocess_exec(
        program("curl"), "-sS", "-w", "\n%{http_code}", "--data-binary", "@-", url,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate(body)
    assert proc.returncode == 0, err
    answer, _, code = out.rpartition(b"\n")
    return int(code), json.loads(answer)


def owner(vmap: VBucketMap, kp: str) -> str:
    return vmap.nodes[vmap.owners[vbucket_of(kp.encode())][0]].node_id


def http_view(cluster: Cluster, node_id: str) -> dict[str, Any]:
    view: dict[str, Any] = cluster.stats(node_id)["master"]["http"]
    return view


def test_a_post_on_either_node_is_published_at_the_owner_and_an_sdk_subscriber_gets_all(two: Cluster) -> None:
    vmap = current_map(two)
    kps = {owner: kp_owned_by(vmap, owner, 0, "pub") for owner in ("a", "b")}
    forwarded = {n: http_view(two, n)["forwarded"] for n in ("a", "b")}

    async def main() -> list[tuple[str, str, dict[str, Any]]]:
        async with broky.connect(two.nodes["a"].url) as client:
            sub = await client.subscribe("h.>")
            answers = []
            for at in ("a", "b"):
                for owner, kp in kps.items():
                    body = b"".join(b"%s-%s-%d\n" % (at.encode(), owner.encode(), i) for i in range(50))
                    url = f"{base(two.nodes[at])}/v1/pub/h.{at}?partition={kp.decode()}"
                    status, answer = await post(url, body)
                    assert status == 200, answer
                    answers.append((at, owner, answer))
            got = [await sub.next_msg(10) for _ in range(200)]
            by_body = {m.payload: m for m in got}
            assert len(by_body) == 200  # each once
            for at, owner, answer in answers:
                mine = [m for m in got if m.payload.startswith(b"%s-%s-" % (at.encode(), owner.encode()))]
                assert [m.payload for m in mine] == [
                    b"%s-%s-%d" % (at.encode(), owner.encode(), i) for i in range(50)
                ]
                first, last = mine[0], mine[-1]
                assert answer["published"] == 50 and answer["exact"] is True and "resent" not in answer
                assert answer["vbucket"] == vbucket_of(kps[owner]) == first.vbucket
                assert answer["first"] == [first.vbucket, str(first.epoch), first.offset]
                assert answer["last"] == [last.vbucket, str(last.epoch), last.offset]
                assert last.offset - first.offset == 49
            return answers

    asyncio.run(main())
    # each node forwarded the 50 messages of the other node's vbucket, and only those
    assert {n: http_view(two, n)["forwarded"] - forwarded[n] for n in ("a", "b")} == {"a": 50, "b": 50}


async def _lines_until(proc: asyncio.subprocess.Process, want: Any, timeout: float = 20) -> list[bytes]:
    assert proc.stdout is not None
    lines: list[bytes] = []
    async with asyncio.timeout(timeout):
        while not want(lines):
            line = await proc.stdout.readline()
            assert line, f"the stream ended: {lines[-5:]}"
            lines.append(line.rstrip(b"\n"))
    return lines


def _data(events: list[dict[str, str]], marker: str) -> list[dict[str, Any]]:
    return [json.loads(e["data"]) for e in events if "id" in e and marker in e.get("data", "")]


async def _stream(url: str, *headers: str) -> asyncio.subprocess.Process:
    args = [a for h in headers for a in ("-H", h)]
    return await asyncio.create_subprocess_exec(program("curl"), "-sSN", *args, url, stdout=subprocess.PIPE)


async def _warm(client: broky.Client, proc: asyncio.subprocess.Process, kp: bytes, key: str) -> None:
    """Publish to kp until the stream shows it: its subscription reaches kp's owner."""
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        while True:
            await client.publish(key, b"warm", partition=kp)
            try:
                async with asyncio.timeout(0.2):
                    if b"warm" in await proc.stdout.readline():
                        return
            except TimeoutError:
                continue


def test_a_stream_on_one_node_carries_the_other_nodes_vbuckets_and_sse_resumes_across_them(
    two: Cluster,
) -> None:
    vmap = current_map(two)
    kps = [kp_owned_by(vmap, owner, 0, f"s{i}") for i in range(4) for owner in ("a", "b")]
    assert {vmap.nodes[vmap.owners[vbucket_of(kp)][0]].node_id for kp in kps} == {"a", "b"}
    a = base(two.nodes["a"])

    async def main() -> None:
        async with broky.connect(two.nodes["b"].url) as client:
            nd = await _stream(f"{a}/v1/sub/nd.>")
            try:
                await _warm(client, nd, kps[1], "nd.warm")  # a kp of node b
                sent = [(kps[i % 8], b"n-%d" % i) for i in range(400)]
                for kp, payload in sent:
                    await client.publish("nd.x", payload, partition=kp)
                lines = await _lines_until(nd, lambda ls: sum(b'"n-' in x for x in ls) >= 400)
            finally:
                nd.kill()
                await nd.wait()
            records = [json.loads(x) for x in lines if b'"n-' in x]
            for kp in kps:  # every one, in order, both nodes' vbuckets
                assert [r["payload"] for r in records if r["key_partition"] == kp.decode()] == [
                    p.decode() for k, p in sent if k == kp
                ]

            sse = await _stream(f"{a}/v1/sub/ev.>", "Accept: text/event-stream")
            await _warm(client, sse, kps[1], "ev.warm")
            events = [(kps[i % 8], b"e-%d" % i) for i in range(400)]
            for kp, payload in events[:200]:
                await client.publish("ev.x", payload, partition=kp)
            seen = sse_events(await _lines_until(sse, lambda ls: len(_data(sse_events(ls), '"e-')) >= 100))
            sse.kill()
            await sse.wait()
            first = _data(seen, '"e-')
            last_id = [e for e in seen if "id" in e][-1]["id"]
            for kp, payload in events[200:]:  # while it is away
                await client.publish("ev.x", payload, partition=kp)
            again = await _stream(
                f"{a}/v1/sub/ev.>", "Accept: text/event-stream", f"Last-Event-ID: {last_id}"
            )
            try:
                need = 400 - len(first)
                arrived = await _lines_until(again, lambda ls: len(_data(sse_events(ls), '"e-')) >= need)
                more = sse_events(arrived)
            finally:
                again.kill()
                await again.wait()
            assert not [e for e in more if e.get("event") in ("loss", "cut")], more[:3]
            got = first + _data(more, '"e-')
            assert sorted(g["payload"] for g in got) == sorted(p.decode() for _, p in events)  # each once
            for kp in kps:
                assert [g["payload"] for g in got if g["key_partition"] == kp.decode()] == [
                    p.decode() for k, p in events if k == kp
                ]

            # the stream's ledger is on node a: node b resumes the id's own vbucket only, and says so
            other = await _stream(
                f"{base(two.nodes['b'])}/v1/sub/ev.>",
                "Accept: text/event-stream",
                f"Last-Event-ID: {last_id}",
            )
            try:
                told = sse_events(
                    await _lines_until(
                        other, lambda ls: any(e.get("event") == "loss" for e in sse_events(ls)), 10
                    )
                )
            finally:
                other.kill()
                await other.wait()
            loss = [json.loads(e["data"]) for e in told if e.get("event") == "loss"]
            assert loss[0] == {"dropped": None, "reason": "resume_unknown", "scope": "stream"}

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_post_whose_owner_died_is_placed_at_the_new_owner_within_the_request(cluster: Cluster) -> None:
    cluster.start("a", workers=1)
    cluster.start("b", workers=1)
    cluster.wait_settled()
    vmap = current_map(cluster)
    kp = kp_owned_by(vmap, "b", 0, "died").decode()
    url = f"{base(cluster.nodes['a'])}/v1/pub/d.x?partition={kp}"

    async def main() -> None:
        async with broky.connect(cluster.nodes["a"].url) as client:
            sub = await client.subscribe("d.>")
            status, before = await post(url, b"one\n")  # the lane to b's worker is open
            assert status == 200 and "resent" not in before, before
            assert (await sub.next_msg(10)).payload == b"one"
            cluster.kill("b")
            status, answer = await post(url, b"two\nthree\n")  # b's lease runs out meanwhile
            assert status == 200, answer
            assert answer["published"] == 2 and answer["exact"] is True
            assert answer["resent"]["messages"] == 2 and answer["resent"]["maybe_twice"] is False
            assert "worker 0 of node 'b'" in answer["resent"]["why"], answer
            assert answer["first"][1] != before["first"][1]  # a new epoch at the new owner
            got = [await sub.next_msg(15) for _ in range(2)]
            assert [m.payload for m in got] == [b"two", b"three"]
            assert answer["last"] == [got[1].vbucket, str(got[1].epoch), got[1].offset]

    asyncio.run(main())
    view = http_view(cluster, "a")
    assert (view["publish_retries"], view["publish_failed"]) == (1, 0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_posts_during_a_join_and_a_drain_all_arrive_each_once_in_order_at_the_positions_answered(
    cluster: Cluster,
) -> None:
    cluster.start("a", workers=1)
    cluster.wait_settled()
    a = cluster.nodes["a"]
    kps = [f"j{i}" for i in range(16)]
    answers: list[tuple[str, int, dict[str, Any]]] = []  # (kp, round, answer)
    failures: list[BaseException] = []
    forwarded: list[int] = []  # node a's count once b took its share
    stop = threading.Event()

    def posting() -> None:
        """One curl process per round: a POST of 5 lines to each key_partition, keep-alive."""
        round_ = 0
        try:
            while not stop.is_set():
                args: list[str] = []
                for kp in kps:
                    lines = "".join(f"{kp}:{round_}:{i}\n" for i in range(5))
                    url = f"{base(a)}/v1/pub/j.x?partition={kp}"
                    args += ["--next", "-sS", "-w", "\n", "--data-binary", lines, url]
                done = subprocess.run(
                    [program("curl"), *args[1:]], capture_output=True, timeout=60, check=True
                )
                out = [json.loads(line) for line in done.stdout.split(b"\n") if line]
                assert len(out) == len(kps), done.stdout
                answers.extend((kp, round_, answer) for kp, answer in zip(kps, out, strict=True))
                round_ += 1
        except BaseException as exc:  # for the test to see
            failures.append(exc)

    async def main() -> list[broky.Message]:
        async with broky.connect(a.url) as client:
            sub = await client.subscribe("j.>", max_pending_msgs=1_000_000)
            thread = threading.Thread(target=posting)
            thread.start()
            try:
                await asyncio.sleep(0.5)
                await asyncio.to_thread(cluster.start, "b", workers=1)
                await asyncio.to_thread(cluster.wait_settled)
                await asyncio.sleep(0.5)
                vmap = await asyncio.to_thread(current_map, cluster)
                assert [kp for kp in kps if owner(vmap, kp) == "b"]  # some went to b: forwarded now
                forwarded.append(http_view(cluster, "a")["forwarded"])
                await asyncio.to_thread(cluster.leave, "b")  # hands them back, Goodbye
                await asyncio.to_thread(cluster.wait_settled)
                await asyncio.sleep(0.5)
            finally:
                stop.set()
                await asyncio.to_thread(thread.join)
            assert not failures, failures
            got: list[broky.Message] = []
            distinct: set[bytes] = set()
            async with asyncio.timeout(30):
                while len(distinct) < 5 * len(answers):
                    got.append(await sub.next_msg())
                    distinct.add(got[-1].payload)
            return got

    got = asyncio.run(main())
    assert not [x for x in answers if "error" in x[2] or x[2]["published"] != 5], answers[:3]
    # each once: twice only what a lost lane's POST sent again, and said so (maybe_twice)
    maybe_twice = {(kp, r) for kp, r, answer in answers if answer.get("resent", {}).get("maybe_twice")}
    by_payload: dict[str, broky.Message] = {}
    for m in got:
        text = m.payload.decode()
        of, at, _ = text.split(":")
        assert text not in by_payload or (of, int(at)) in maybe_twice, text
        by_payload.setdefault(text, m)
    assert len(by_payload) == 5 * len(answers)
    for kp in kps:  # in order
        mine = [p for p in by_payload if p.startswith(f"{kp}:")]
        assert mine == sorted(mine, key=lambda p: (int(p.split(":")[1]), int(p.split(":")[2])))
    unknown = 0
    for kp, round_, answer in answers:  # where the answer said (nobody else publishes there)
        if (kp, round_) in maybe_twice:
            continue
        first, last = by_payload[f"{kp}:{round_}:0"], by_payload[f"{kp}:{round_}:4"]
        if answer["exact"]:
            assert answer["first"] == [first.vbucket, str(first.epoch), first.offset], (kp, round_, answer)
            assert answer["last"] == [last.vbucket, str(last.epoch), last.offset], (kp, round_, answer)
        else:  # a move under way: the bounds, or nothing when the taker could not say where it stood
            assert answer["first"] is answer["last"] is None, (kp, round_, answer)
            assert ("after" in answer) == ("at_most" in answer), (kp, round_, answer)
            unknown += 1
    assert unknown < len(answers) / 4, unknown  # a few, around the moves
    view = http_view(cluster, "a")
    assert forwarded[0] > 0 and view["publish_failed"] == 0
    assert view["publish_retries"] == sum(1 for x in answers if "resent" in x[2])
