"""Client.publish's fast path (cached template and Link) behaves like the general path."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import broky
from broky.client.client import Link
from broky.client.link import frames_in, publishes_in
from broky.matching import key_problem
from broky.protocol import VBUCKETS, decode_message, encode_message
from broky.protocol.ksuid import EPOCH, KsuidSequence, ksuid_time
from broky.protocol.routing import NodeInfo, VBucketMap
from tests.support.sdk import FakeProto, unconnected_client
from tests.support.serverproc import ServerProcess


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


# What publish takes (broky.client.encoder.check_fields): a partition of any bytes but none,
# a key of literal tokens (no empty, `*` or `>` one).
small = st.binary(min_size=1, max_size=40)
keys = small.filter(lambda k: key_problem(k) is None)
text_keys = st.text(min_size=1, max_size=10).filter(lambda k: key_problem(k.encode()) is None)


@settings(max_examples=200, deadline=None)
@given(
    kp=st.one_of(small, st.text(min_size=1, max_size=10)),
    key=st.one_of(keys, text_keys),
    payload=st.binary(max_size=300),
    ts=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
def test_fast_path_frames_equal_encode_message(
    kp: bytes | str, key: bytes | str, payload: bytes, ts: int | None
) -> None:
    async def main() -> None:
        client, link = unconnected_client()
        before = time.time_ns()
        for _ in range(3):  # the general path, then the cached fast path
            await client.publish(key, payload, partition=kp, ts_producer=ts)
        assert client._fast_count >= 1
        bkp = kp.encode() if isinstance(kp, str) else kp
        bkey = key.encode() if isinstance(key, str) else key
        uids = set()
        for frame in link.out:
            msg = decode_message(frame)
            assert msg.uid is not None
            uids.add(msg.uid)
            assert frame == encode_message(bkp, bkey, payload, msg.ts_producer, 0, msg.uid)
            if ts is None:
                assert before <= msg.ts_producer <= time.time_ns()
                assert ksuid_time(msg.uid) == msg.ts_producer // 1_000_000_000
            else:
                assert msg.ts_producer == ts
            assert abs(ksuid_time(msg.uid) - time.time()) < 5
        assert len(uids) == 3 and client.stats.published == 3

    run(main)


@settings(max_examples=200, deadline=None)
@given(
    kp=small,
    key=keys,
    payload=st.binary(max_size=300),
    ts=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    uids=st.lists(st.binary(min_size=20, max_size=20), min_size=3, max_size=3),
)
def test_fast_path_with_given_uids_equals_encode_message(
    kp: bytes, key: bytes, payload: bytes, ts: int | None, uids: list[bytes]
) -> None:
    async def main() -> None:
        client, link = unconnected_client()
        before = time.time_ns()
        for uid in uids:  # the general path, then the cached fast path
            await client.publish(key, payload, partition=kp, ts_producer=ts, uid=uid)
        assert client._fast_count >= 1
        for frame, uid in zip(link.out, uids):
            msg = decode_message(frame)
            assert msg.uid == uid
            assert frame == encode_message(kp, key, payload, msg.ts_producer, 0, uid)
            if ts is None:
                assert before <= msg.ts_producer <= time.time_ns()
            else:
                assert msg.ts_producer == ts
        assert client.stats.published == 3

    run(main)


def test_fast_path_errors_and_other_types() -> None:
    async def main() -> None:
        client, link = unconnected_client(max_frame=300)
        await client.publish(b"k", b"x" * 10, partition=b"p")
        # a cached template with wrong field types goes the general way and raises the same errors
        with pytest.raises(broky.LocalProtocolError, match="payload must be bytes"):
            await client.publish(b"k", "x" * 10, partition=b"p")  # type: ignore[arg-type]
        with pytest.raises(broky.LocalProtocolError):
            await client.publish(b"k", b"x" * 10, partition=b"p", ts_producer=2**63)
        with pytest.raises(broky.LocalProtocolError, match="key must be bytes or str"):
            await client.publish(3, b"x", partition=b"p")  # type: ignore[arg-type]
        with pytest.raises(broky.PayloadTooLargeError):
            await client.publish(b"k", b"x" * 300, partition=b"p")
        assert len(link.out) == 1
        # bytes-like fields are accepted and encoded like bytes
        await client.publish(memoryview(b"k"), memoryview(b"x" * 10), partition=bytearray(b"p"))  # type: ignore[arg-type]
        await client.publish(b"k", bytearray(b"y" * 10), partition=b"p")  # type: ignore[arg-type]
        await client.publish(b"k", b"z", partition=b"p", uid=False)
        await client.publish(b"k", b"z" * 10, partition=b"p", uid=bytes(range(20)))
        msgs = [decode_message(f) for f in link.out]
        assert [m.payload for m in msgs] == [b"x" * 10, b"x" * 10, b"y" * 10, b"z", b"z" * 10]
        assert msgs[3].uid is None and msgs[4].uid == bytes(range(20))
        assert client.stats.published == 5
        # a closed client refuses even cached publishes
        client._closed, client._open = True, False
        with pytest.raises(broky.ClientClosedError):
            await client.publish(b"k", b"x" * 10, partition=b"p")

    run(main)


def test_publish_nowait_takes_the_same_paths_and_raises_the_same_errors() -> None:
    async def main() -> None:
        client, link = unconnected_client(max_frame=300)
        for i in range(4):  # general path, then the cached fast path
            client.publish_nowait(b"k", b"%02d" % i, partition=b"p")
        client.publish_nowait("k", b"s", partition="p")  # str fields: the general path
        client.publish_nowait(b"k", b"u" * 2, partition=b"p", uid=bytes(range(20)))
        client.publish_nowait(b"k", b"n", partition=b"p", uid=False)
        assert client._fast_count >= 1
        msgs = [decode_message(f) for f in link.out]
        assert [m.payload for m in msgs] == [b"00", b"01", b"02", b"03", b"s", b"uu", b"n"]
        assert msgs[5].uid == bytes(range(20)) and msgs[6].uid is None
        assert len({m.uid for m in msgs[:5]}) == 5
        assert client.stats.published == 7
        with pytest.raises(broky.PayloadTooLargeError):
            client.publish_nowait(b"k", b"x" * 300, partition=b"p")
        with pytest.raises(broky.LocalProtocolError, match="payload must be bytes"):
            client.publish_nowait(b"k", "xy", partition=b"p")  # type: ignore[arg-type]
        client._closed, client._open = True, False
        with pytest.raises(broky.ClientClosedError):
            client.publish_nowait(b"k", b"00", partition=b"p")
        assert client.stats.published == 7

    run(main)


def test_publish_nowait_across_batches_against_a_server(server: ServerProcess) -> None:
    # A batch written by publish_nowait would make `publish` yield; publish_nowait
    # must not (and must not leave an un-awaited coroutine behind: warnings are errors).
    async def main() -> None:
        async with broky.connect(server.url, batch_size=1000) as pub, broky.connect(server.url) as sub:
            got: list[broky.Message] = []
            s = await sub.subscribe("nowait.>", callback=got.append)
            for i in range(2000):
                pub.publish_nowait(b"nowait.k", b"%d" % i, partition=b"kp-%d" % (i % 7))
            await pub.flush()
            deadline = time.monotonic() + 10
            while len(got) < 2000 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert pub.stats.published == 2000
            by_kp: dict[bytes, list[int]] = {}
            for m in got:
                by_kp.setdefault(m.key_partition, []).append(int(m.payload))
            assert sorted(by_kp) == [b"kp-%d" % j for j in range(7)]
            for j in range(7):  # everything arrived, in publish order per key_partition
                assert by_kp[b"kp-%d" % j] == list(range(j, 2000, 7))
            await s.unsubscribe()

    run(main)


def test_refused_publishes_are_resent_to_the_new_owner_or_counted() -> None:
    # NOT_MY_VBUCKET returns the refused frame; after the map refresh it goes to the
    # owner the fresh map names. When that is the refusing worker again, or the map
    # could not be refreshed, or the frame is unreadable, it is dropped and counted.
    async def main() -> None:
        errors: list[BaseException] = []
        client, link = unconnected_client()
        client.on_error = errors.append
        other = Link(client, "n", 1)
        other.proto = FakeProto()  # type: ignore[assignment]
        frame = encode_message(b"p", b"k", b"v")
        client.router.to_resend = [(link, frame), (other, frame), (link, b"garbage")]
        client.router.resend_refused()
        assert other.out == [] and link.out == [frame]  # refused by other, owned by link: resent
        assert client.stats.resent == 1 and client.stats.misrouted == 2  # again link; unreadable
        client.router.to_resend = [(other, frame)]
        client.router.resend_refused(refresh_failed=True)
        assert client.stats.resent == 1 and client.stats.misrouted == 3
        await asyncio.sleep(0)
        assert len(errors) == 3 and client.router.to_resend == []

    run(main)


def test_a_publish_waiting_for_room_on_a_worker_whose_node_left_goes_to_the_new_owner() -> None:
    # Issue 37: `publish` waits for room while the owner's Link is down with a full buffer;
    # when the Link is retired meanwhile (its node left the map), the fast path put the
    # frame in the retired Link, which nobody sends: lost untold. It goes to the new owner.
    async def main() -> None:
        client, link = unconnected_client()
        client.max_reconnect_buffer_bytes = 400
        router = client.router
        router.map = VBucketMap(1, (NodeInfo("n", "h", 1, 1),), ((0, 0),) * VBUCKETS)
        router.links[link.ref] = link
        for _ in range(2):  # the shape seen twice: the fast path from now on
            await client.publish(b"k", b"v" * 100, partition=b"p")
        frame = link.out[0]
        link.proto = None  # down (its node died)
        while link.out_bytes + len(frame) <= 400:  # its buffer fills
            link.out.append(frame)
            link.out_bytes += len(frame)
        queued = len(link.out)
        waiting = asyncio.ensure_future(client.publish(b"k", b"v" * 100, partition=b"p"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # waits for room
        new = Link(client, "m", 0)
        fake = FakeProto()
        new.proto = fake  # type: ignore[assignment]
        router.links[new.ref] = new
        router.apply(VBucketMap(2, (NodeInfo("m", "h", 2, 1),), ((0, 0),) * VBUCKETS))  # n left
        async with asyncio.timeout(5):
            await waiting
        await asyncio.sleep(0.05)  # the move settles (the old owner is not waited for)
        assert link.retired and link.out == []
        written = [f for chunk in fake.written for f in publishes_in(chunk)]
        assert len(written) == queued + 1, (len(written), queued)  # the buffered ones, then this one
        assert client.stats.published == 3 and client.stats.refused == 0

    run(main)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([b"a", b"bb", "cc"]),
            st.sampled_from([b"k.1", "k.2"]),
            st.sampled_from([b"", b"x", b"xyz" * 10]),
            st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        ),
        max_size=40,
    ),
    given_uids=st.booleans(),
)
def test_publish_rows_equals_publishing_each_row(
    rows: list[tuple[bytes | str, bytes | str, bytes, int | None]], given_uids: bool
) -> None:
    # The Spark sink's bulk path: the same frames as `publish` row by row, the
    # fast path once a shape repeats, the general path otherwise.
    async def main() -> None:
        client, link = unconnected_client()
        kps, keys, payloads = ([r[i] for r in rows] for i in range(3))
        ts = [r[3] for r in rows]
        prefix = bytes(range(12)) if given_uids else None
        before = time.time_ns()
        await client.publish_rows(kps, keys, payloads, ts, prefix, 7 << 32)
        frames = frames_in(link.out)  # the compiled bulk path packs chunks of frames
        assert client.stats.published == len(rows) == len(frames) == len(link.out) + link.out_extra
        seen = set()
        for i, (frame, (kp, key, payload, t)) in enumerate(zip(frames, rows, strict=True)):
            msg = decode_message(frame)
            bkp = kp.encode() if isinstance(kp, str) else kp
            bkey = key.encode() if isinstance(key, str) else key
            assert (msg.key_partition, msg.key, msg.payload) == (bkp, bkey, payload)
            if t is None:
                assert before <= msg.ts_producer <= time.time_ns()
            else:
                assert msg.ts_producer == t
            if prefix is not None:
                assert msg.uid == prefix + ((7 << 32) + i).to_bytes(8, "little")
            assert msg.uid is not None
            seen.add(msg.uid)
            assert frame == encode_message(bkp, bkey, payload, msg.ts_producer, 0, msg.uid)
        assert len(seen) == len(rows)

    run(main)


def test_publish_rows_raises_like_publish() -> None:
    async def main() -> None:
        client, _ = unconnected_client(max_frame=300)
        ok = [b"p"] * 3
        await client.publish_rows(ok, [b"k"] * 3, [b"v"] * 3, None, None)
        with pytest.raises(broky.PayloadTooLargeError):
            await client.publish_rows(ok, [b"k"] * 3, [b"v", b"x" * 300, b"v"], None, None)
        with pytest.raises(broky.LocalProtocolError, match="payload must be bytes"):
            await client.publish_rows(ok, [b"k"] * 3, [b"v", "s", b"v"], None, None)
        with pytest.raises(broky.LocalProtocolError):
            await client.publish_rows(ok, [b"k"] * 3, [b"v"] * 3, [0, 2**63, 0], None)
        assert client.stats.published == 6  # every row before the one that raised
        client._closed, client._open = True, False
        with pytest.raises(broky.ClientClosedError):
            await client.publish_rows(ok, [b"k"] * 3, [b"v"] * 3, None, None)
        assert client.stats.published == 6

    run(main)


def test_fast_path_cache_follows_map_and_limit() -> None:
    async def main() -> None:
        client, link = unconnected_client()
        await client.publish("k", b"v", partition="p")
        assert client._fast == {}  # a shape met once gets no template
        await client.publish("k", b"v", partition="p")
        assert client._fast["p"]["k"][1][-1] is link and client._fast[b"p"][b"k"][1][-1] is link
        other = Link(client, "n", 1)
        other.proto = FakeProto()  # type: ignore[assignment]
        assert client.router.map is None
        client.router.links[other.ref] = other
        client.router.apply(VBucketMap(1, (NodeInfo("n", "h", 1, 2),), ((0, 1),) * VBUCKETS))
        assert client._fast == {}
        await client.publish("k", b"v", partition="p")
        assert other.out and decode_message(other.out[0]).key_partition == b"p"
        client._encoder.set_limit(1 << 20)
        assert client._fast
        assert client._encoder.set_limit(100) and client._encoder._templates == {}

    run(main)


def test_ksuid_sequence_is_unique_and_reseeds() -> None:
    seq = KsuidSequence()
    now = time.time_ns()
    uids = [seq.new(now) for _ in range(1000)]
    assert len(set(uids)) == 1000
    assert all(ksuid_time(u) == now // 1_000_000_000 for u in uids)
    assert all(u[:12] == uids[0][:12] for u in uids)  # one seed per second
    later = seq.new(now + 1_000_000_000)
    assert later[4:12] != uids[0][4:12] and ksuid_time(later) == now // 1_000_000_000 + 1
    back = seq.new(now)  # a clock going back means a new seed too
    assert back[4:12] not in (uids[0][4:12], later[4:12])
    assert KsuidSequence().new(now)[4:12] != back[4:12]
    assert seq.next < 2**63 + 2  # starts below 2**63: cannot wrap within a second
    with pytest.raises(ValueError):
        seq.new((EPOCH - 1) * 1_000_000_000)


def test_ksuid_sequence_reseeds_after_fork() -> None:
    seq = KsuidSequence()
    now = time.time_ns()
    first = seq.new(now)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(w, seq.new(now))
        os._exit(0)
    os.close(w)
    child = os.read(r, 20)
    os.close(r)
    os.waitpid(pid, 0)
    parent = seq.new(now)
    assert parent[:12] == first[:12] and child[4:12] != first[4:12]
