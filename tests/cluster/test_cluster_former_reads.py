"""A planned move loses nothing for a reader behind it: the old owner serves what it retained.

Real etcd, real nodes (tests/support/cluster.py), one worker each. Node a takes
publishes over many key_partitions alone; node b joins and half the
vbuckets move to it (same epoch, the next offset: broky.server.shard.moves);
more publishes follow. Message data never crosses nodes, so a moved
vbucket's offsets up to the handover H - 1 stay at a, whose worker keeps
them (a *former* vbucket) and answers a bounded Read that names it, with
ReadDone.moved, while b holds the rest from H on. A whole read (no
`vbuckets`) still covers each vbucket at its owner only. Then b drains:
it hands its vbuckets back and, since it retains messages of them, serves
on for --drain-linger seconds, during which a Read of one is answered;
then it exits as before.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

import broky
from broky.protocol import Error, Message, Read, ReadDone, Replay, vbucket_of
from broky.protocol.frames import Position
from tests.support.cluster import Cluster, owners_by_id
from tests.support.wire import Wire

PARTITIONS = 64
KPS = [b"kp-%d" % i for i in range(PARTITIONS)]
BEFORE, AFTER = 5, 3  # messages per key_partition before the join, and after it
LINGER = 8.0


def publish(seed: str, phase: int, count: int) -> None:
    """`count` messages to every key_partition, round-robin; payload b"phase:n"."""

    async def main() -> None:
        async with broky.connect(seed) as client:
            for n in range(count):
                for kp in KPS:
                    await client.publish("w.x", b"%d:%d" % (phase, n), partition=kp)
            await client.flush()

    asyncio.run(main())


def sent(vb: int, phase: int, count: int) -> list[tuple[bytes, bytes]]:
    """What `publish` sent to vbucket vb, in its order: (key_partition, payload)."""
    return [(kp, b"%d:%d" % (phase, n)) for n in range(count) for kp in KPS if vbucket_of(kp) == vb]


def read_raw(address: tuple[str, int], rd: Read) -> tuple[list[Message], list[ReadDone]]:
    """A Read on a connection of its own to worker 0: its messages and its ReadDones."""
    msgs: list[Message] = []
    dones: list[ReadDone] = []
    with Wire.hello(address, worker=0) as w:
        w.send(rd)
        while True:
            frame = w.next(10)
            assert not isinstance(frame, Error), frame
            if isinstance(frame, Message):
                msgs.append(frame)
            elif isinstance(frame, ReadDone):
                dones.append(frame)
                if frame.remaining == 0:
                    return msgs, dones
            else:
                assert isinstance(frame, Replay) or type(frame).__name__ == "MapUpdate", frame


@pytest.mark.timeout(120)
def test_a_moved_vbucket_is_read_at_its_old_owner_up_to_the_handover_and_a_draining_node_lingers(
    cluster: Cluster,
) -> None:
    a = cluster.start("a", workers=1)
    cluster.wait_settled()
    seed = f"{a.host}:{a.port}"
    publish(seed, 1, BEFORE)
    first_map = cluster.history()[-1]
    b = cluster.start("b", "--drain-linger", str(LINGER), workers=1)
    cluster.wait_settled()
    joined = cluster.history()[-1]
    used = {vbucket_of(kp) for kp in KPS}
    moved = {vb for vb in used if owners_by_id(first_map)[vb] != owners_by_id(joined)[vb]}
    assert moved and moved != used and all(owners_by_id(joined)[vb] == ("b", 0) for vb in moved)
    publish(seed, 2, AFTER)
    # a keeps what it retained of the vbuckets it handed over: every message published before
    worker = cluster.stats("a")["workers"][0]
    kept = sum(len(sent(vb, 1, BEFORE)) for vb in moved)
    handed = sum(1 for was, now in zip(owners_by_id(first_map), owners_by_id(joined)) if was != now)
    assert (worker["former_vbuckets"], worker["former_messages"]) == (handed, kept)
    assert worker["replay_dropped_messages"] == 0

    x = min(moved, key=lambda vb: -len(sent(vb, 1, BEFORE)))  # a moved vbucket with most messages
    h = len(sent(x, 1, BEFORE)) + 1  # the handover offset: b went on from there
    # (i) At a, named in `vbuckets`: its first messages up to H - 1, ReadDone.moved, next H.
    msgs, dones = read_raw(a.address, Read(1, b">", vbuckets=(x,)))
    epoch = msgs[0].epoch
    assert [(m.key_partition, m.payload) for m in msgs] == sent(x, 1, BEFORE)
    assert [(m.vbucket, m.epoch, m.offset) for m in msgs] == [(x, epoch, o) for o in range(1, h)]
    assert dones == [ReadDone(1, x, epoch, h, 0, False, 0, True)]
    # ... and a stop past the handover (a batch planned later) ends the range there.
    msgs, dones = read_raw(a.address, Read(2, b">", stop=(Position(x, epoch, h + 100),), vbuckets=(x,)))
    assert len(msgs) == h - 1 and dones == [ReadDone(2, x, epoch, h, 0, False, 0, True)]
    # (ii) At b from (E, H - 1): the rest, same epoch, not moved.
    rest = len(sent(x, 2, AFTER))
    msgs, dones = read_raw(b.address, Read(3, b">", start=(Position(x, epoch, h - 1),), vbuckets=(x,)))
    assert [(m.key_partition, m.payload) for m in msgs] == sent(x, 2, AFTER)
    assert [(m.epoch, m.offset) for m in msgs] == [(epoch, o) for o in range(h, h + rest)]
    assert dones == [ReadDone(3, x, epoch, h + rest, 0, False, 0, False)]
    # b never had what came before H: from (E, 0) it counts them evicted (a has them).
    _, dones = read_raw(b.address, Read(4, b">", start=(Position(x, epoch, 0),), vbuckets=(x,)))
    assert dones == [ReadDone(4, x, epoch, h + rest, h - 1, False, 0, False)]

    # (iii) A whole read through the SDK covers each vbucket at its owner only, as before.
    async def whole() -> broky.ReadResult:
        async with broky.connect(seed) as client:
            return await client.read(">", timeout=30)

    result = asyncio.run(whole())
    got = sorted((m.vbucket, m.key_partition, m.payload) for m in result.messages)
    expected = sorted(
        (vb, kp, payload)
        for vb in used
        for kp, payload in (sent(vb, 2, AFTER) if vb in moved else sent(vb, 1, BEFORE) + sent(vb, 2, AFTER))
    )
    assert got == expected and result.evicted == 0
    assert {(vb, result.ends[vb].next) for vb in moved} == {
        (vb, len(sent(vb, 1, BEFORE)) + len(sent(vb, 2, AFTER)) + 1) for vb in moved
    }

    # b drains: its vbuckets go back to a, and it lingers since it retains messages of them.
    b.signal(signal.SIGTERM)
    b.wait_log(f"lingering {LINGER:g} s so readers can fetch what this node retained", timeout=40)
    msgs, dones = read_raw(b.address, Read(5, b">", vbuckets=(x,)))
    assert [(m.key_partition, m.payload) for m in msgs] == sent(x, 2, AFTER)
    assert dones == [ReadDone(5, x, epoch, h + rest, 0, False, 0, True)]
    assert b.wait(LINGER + 20) == 0
    log = cluster.nodes.pop("b").log()
    assert "left the cluster" in log and log.index("lingering") < log.index("drained: shutting down")
    b.stop()
    # a took x back: what it retained of x from before is dropped (counted), x is a's again.
    worker = wait_former(cluster, "a")
    assert worker["replay_dropped_messages"] == kept


def wait_former(cluster: Cluster, node_id: str) -> dict[str, object]:
    """Worker 0's /stats once it has no former vbucket left (they all came back)."""
    from tests.support.cluster import wait_for

    def check() -> dict[str, object] | None:
        worker: dict[str, object] = cluster.stats(node_id)["workers"][0]
        return worker if worker["former_vbuckets"] == 0 else None

    return wait_for(check, 10, f"{node_id}: every former vbucket came back")
