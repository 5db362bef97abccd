"""Groups and acknowledgements in the SDK, without a server (broky.client.groups).

Bytes are fed to a WorkerProtocol under a real Link of a real Client (never
connected): Delivery frames announce a member's share, Ack frames come out
(decoded with broky.protocol.decode_frame), and a reconnect is played by
attaching a new WorkerProtocol with a Welcome naming the same or another
worker process. The same behaviour against a real `broky serve` is in
tests/client/test_groups_sdk.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

import broky
from broky.client.client import Client, Link
from broky.client.connection import WorkerProtocol
from broky.client.groups import ACK_POSITIONS, GroupMessage, GroupSpec, group_spec
from broky.client.subscription import Subscription
from broky.client.sync import SyncSubscription
from broky.errors import AckError, DrainExpiredError, ErrorCode, ServerError
from broky.protocol import (
    VBUCKETS,
    Ack,
    AckKind,
    Delivery,
    Error,
    Frame,
    GroupEvent,
    GroupNotice,
    Hello,
    LossNotice,
    LossReason,
    Message,
    NodeInfo,
    Ping,
    Position,
    Replay,
    Subscribe,
    Unsubscribe,
    VBucketMap,
    Welcome,
    decode_frame,
    encode_frame,
    encode_message,
)
from broky.protocol.frames import encode_hello

UID = bytes(range(20))
TS = 1_700_000_000_000_000_000


def message(i: int, vb: int = 5, key: bytes = b"orders.created") -> Message:
    """A delivery as a worker sends it (canonical, with a uid: the fast path reads it)."""
    return Message(b"kp-%d" % i, key, b"payload %d" % i, TS, TS + i, UID, vb, 77, 1000 + i)


def wire(msg: Message) -> bytes:
    return encode_message(
        msg.key_partition, msg.key, msg.payload, msg.ts_producer, msg.ts_broker, msg.uid,
        msg.vbucket, msg.epoch, msg.offset,
    )  # fmt: skip


class Recorder:
    def __init__(self) -> None:
        self.live: list[Message] = []
        self.frames: list[Frame] = []
        self.group: list[tuple[Message, int, int]] = []
        self.replayed: list[tuple[Message, int]] = []

    def on_message(self, msg: Message) -> None:
        self.live.append(msg)

    def on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)

    def on_lost(self, proto: WorkerProtocol, exc: BaseException | None) -> None:
        pass

    def on_group(self, msg: Message, sid: int, attempt: int) -> None:
        self.group.append((msg, sid, attempt))

    def on_replayed(self, msg: Message, sid: int) -> None:
        self.replayed.append((msg, sid))


class Transport:
    """Enough of a transport for a WorkerProtocol: keeps what is written."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            self.written += chunk

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def frames(self) -> list[Frame]:
        """Every frame written so far, decoded; then forgotten."""
        out, data, pos = [], bytes(self.written), 0
        while pos < len(data):
            end = pos + 4 + int.from_bytes(data[pos : pos + 4], "little")
            out.append(decode_frame(data, pos, end))
            pos = end
        self.written.clear()
        return out


def new_proto() -> tuple[WorkerProtocol, Transport]:
    proto = WorkerProtocol()
    transport = Transport()
    proto.transport = transport  # type: ignore[assignment]
    return proto, transport


def acks(frames: list[Frame]) -> list[Ack]:
    return [f for f in frames if isinstance(f, Ack)]


# ---------------------------------------------------------------- the WorkerProtocol


@pytest.mark.parametrize("split", [None, 1, 7])
def test_a_delivery_announces_messages_for_one_member_alone(split: int | None) -> None:
    """The Messages a Delivery announces go to on_group with its sid and attempt, never to
    on_message, and are not positions of the live stream; the next bare one is live. Read
    whole, or cut into any pieces."""
    group = [message(i, vb=3) for i in range(3)]
    bare = message(9, vb=4)
    odd = Message(b"kp", b"orders.x", b"no uid", 1, 2, None, 3, 88, 5)  # the general read path
    stream = (
        encode_frame(Delivery(7, 2, 3)) + wire(group[0]) + wire(group[1])
        + encode_frame(Delivery(8, 2)) + wire(group[2]) + encode_frame(odd)
        + wire(bare)
    )  # fmt: skip

    async def main() -> tuple[Recorder, WorkerProtocol]:
        proto, _ = new_proto()
        rec = Recorder()
        positions = ([0] * VBUCKETS, [0] * VBUCKETS, [0] * VBUCKETS)
        proto.attach(rec, positions, rec.on_replayed, rec.on_group)
        chunks = [stream] if split is None else [stream[i : i + split] for i in range(0, len(stream), split)]
        for chunk in chunks:
            proto.data_received(chunk)
        return rec, proto

    rec, proto = asyncio.run(main())
    assert proto.failure is None
    assert rec.group == [(group[0], 7, 3), (group[1], 7, 3), (group[2], 8, 1), (odd, 8, 1)]
    assert rec.live == [bare] and rec.frames == [] and rec.replayed == []
    assert proto.pos_offset[3] == 0  # the members' deliveries are no position of the live stream
    assert (proto.pos_epoch[4], proto.pos_offset[4], proto.pos_ts[4]) == (77, 1009, TS + 9)


def test_a_replay_and_a_delivery_keep_to_their_own_callbacks() -> None:
    a, b = message(1), message(2)

    async def main() -> Recorder:
        proto, _ = new_proto()
        rec = Recorder()
        proto.attach(rec, None, rec.on_replayed, rec.on_group)
        proto.data_received(encode_frame(Replay(4, 1)) + wire(a) + encode_frame(Delivery(5, 1, 2)) + wire(b))
        return rec

    rec = asyncio.run(main())
    assert rec.replayed == [(a, 4)] and rec.group == [(b, 5, 2)] and rec.live == []


def test_without_on_group_a_delivery_and_its_messages_go_to_the_handler() -> None:
    a = message(1)

    async def main() -> Recorder:
        proto, _ = new_proto()
        rec = Recorder()
        proto.attach(rec)
        proto.data_received(encode_frame(Delivery(5, 1, 1)) + wire(a))
        return rec

    rec = asyncio.run(main())
    assert rec.frames == [Delivery(5, 1, 1)] and rec.live == [a]


def test_the_sdk_says_protocol_version_3() -> None:
    hello = decode_frame(encode_hello(Hello(client_name="x")))
    assert isinstance(hello, Hello) and hello.protocol_version == 3


def test_every_message_has_an_age() -> None:
    import time

    msg = Message(b"kp", b"k", b"v", ts_broker=time.time_ns() - 2_000_000_000)
    assert 1.9 < msg.age < 10
    assert Message(b"kp", b"k", b"v").age == 0.0  # not stamped yet


# ---------------------------------------------------------------- a Link and its subscriptions


class Setup:
    """A Client (not connected) with one Link up on a WorkerProtocol whose writes are kept."""

    def __init__(self, conn_id: int = (0xAB << 32) | 1, flush_timeout: float = 10.0) -> None:
        self.client = Client(
            "127.0.0.1:1",
            ping_interval=None,
            flush_timeout=flush_timeout,
            on_loss=self.on_loss,
            on_error=self.on_error,
        )
        loop = asyncio.get_running_loop()
        self.client.loop = loop
        self.client.acks.bind(loop)
        self.link = Link(self.client, "n", 0)
        self.client.router.links[self.link.ref] = self.link
        self.losses: list[tuple[Any, int, int]] = []
        self.errors: list[BaseException] = []
        self.proto, self.transport = new_proto()
        self.link.attach(self.proto, self.welcome(conn_id), reconnect=False)
        self.client._connected = True

    def welcome(self, conn_id: int) -> Welcome:
        vmap = VBucketMap.single_node(NodeInfo("n", "127.0.0.1", 1, 1))
        return Welcome("n", 0, vmap, 1 << 20, 8 << 20, conn_id)

    def on_loss(self, ref: Any, dropped: int, reason: int) -> None:
        self.losses.append((ref, dropped, reason))

    def on_error(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def sub(self, sid: int) -> Subscription[Message]:
        """A plain subscription to orders.>."""
        sub: Subscription[Message] = Subscription(self.client, sid, b"orders.>", None, None, 1000, 1 << 20)
        self.client._subscriptions.add(sub, [self.link])
        return sub

    def member(
        self, sid: int, group: GroupSpec | None, callback: Callable[[GroupMessage], Any] | None = None
    ) -> Subscription[GroupMessage]:
        """A group member subscribed to orders.>."""
        assert group is not None
        sub: Subscription[GroupMessage] = Subscription(
            self.client, sid, b"orders.>", None, callback, 1000, 1 << 20, group=group
        )
        self.client._subscriptions.add(sub, [self.link])
        return sub

    def feed(self, data: bytes) -> None:
        self.proto.data_received(data)

    def reconnect(self, conn_id: int) -> None:
        """The connection drops and comes back to a worker process named by conn_id's high half."""
        self.link.on_lost(self.proto, None)
        assert self.link.task is not None
        self.link.task.cancel()  # no real reconnect: the new connection is attached below
        self.proto, self.transport = new_proto()
        self.link.attach(self.proto, self.welcome(conn_id), reconnect=True)


def run(main: Callable[[], Any]) -> None:
    async def wrapper() -> None:
        await main()

    asyncio.run(wrapper())


def test_a_member_and_a_plain_subscription_on_one_connection_get_their_own() -> None:
    async def main() -> None:
        s = Setup()
        plain = s.sub(1)
        member = s.member(2, group_spec("billing"))
        frames = s.transport.frames()
        subscribes = [f for f in frames if isinstance(f, Subscribe)]
        assert [(f.sid, f.group, f.ack, f.since) for f in subscribes] == [
            (1, None, False, ()),
            (2, "billing", False, ()),
        ]
        a, b, c = message(1), message(2), message(3)
        # a is bare (the plain subscription's), then b and c for the member (a Delivery),
        # the second time (attempt 2)
        s.feed(wire(a) + encode_frame(Delivery(2, 2, 2)) + wire(b) + wire(c) + wire(a))
        assert [await plain.next_msg(0) for _ in range(2)] == [a, a] and plain.pending == 0
        got = [await member.next_msg(0) for _ in range(2)]
        assert got == [b, c] and member.pending == 0
        assert all(isinstance(m, GroupMessage) and m.delivery_count == 2 for m in got)
        stats = s.client.stats
        assert (stats.received, stats.group_received, stats.redeliveries, s.link.received) == (4, 2, 2, 4)
        with pytest.raises(AckError):  # a member without ack has nothing to acknowledge
            got[0].ack()
        # a Delivery for a sid this client does not hold: counted as unmatched
        s.feed(encode_frame(Delivery(99, 1)) + wire(b))
        assert stats.unmatched == 1 and plain.pending == member.pending == 0

    run(main)


def test_acks_are_batched_into_one_frame_per_sid_kind_and_delay_per_iteration() -> None:
    async def main() -> None:
        s = Setup()
        spec = group_spec(
            "billing", ack=True, ack_wait=2.5, max_deliveries=3, backoff=(0.5, 2), dead_letter="dl"
        )
        assert spec is not None
        one, two = s.member(1, spec), s.member(2, spec)
        subscribes = [f for f in s.transport.frames() if isinstance(f, Subscribe)]
        assert subscribes[0] == Subscribe(
            1, b"orders.>", None, group="billing", ack=True, ack_wait_ms=2500, max_deliveries=3,
            backoff_ms=(500, 2000), max_in_flight=1000, max_in_flight_bytes=16 << 20,
            dead_letter=b"dl", drain_timeout_ms=10000,
        )  # fmt: skip
        msgs = [message(i, vb=i % 3) for i in range(6)]
        s.feed(encode_frame(Delivery(1, 5)) + b"".join(wire(m) for m in msgs[:5]))
        s.feed(encode_frame(Delivery(2, 1, 4)) + wire(msgs[5]))
        got = [await one.next_msg(0) for _ in range(5)]
        other = await two.next_msg(0)
        assert one.in_flight == 5 and two.in_flight == 1
        got[0].ack()
        got[1].nack()
        got[2].nack(delay=1.5)
        got[3].in_progress()
        got[4].ack()
        got[0].ack()  # twice: nothing more
        got[1].ack()  # settled (nacked) already: nothing
        other.nack(delay=1.5)
        assert s.transport.frames() == []  # nothing before the loop runs
        assert one.in_flight == 1 and two.in_flight == 0  # in_progress keeps it
        await asyncio.sleep(0)
        pos = [Position(m.vbucket, m.epoch, m.offset) for m in msgs]
        assert acks(s.transport.frames()) == [
            Ack(1, AckKind.ACK, (pos[0], pos[4])),
            Ack(1, AckKind.NACK, (pos[1],)),
            Ack(1, AckKind.NACK, (pos[2],), 1500),
            Ack(1, AckKind.IN_PROGRESS, (pos[3],)),
            Ack(2, AckKind.NACK, (pos[5],), 1500),
        ]
        stats = s.client.stats
        assert (stats.acks_sent, stats.nacks_sent, stats.in_progress_sent) == (2, 3, 1)
        got[3].in_progress()
        got[3].ack()
        await asyncio.sleep(0)
        assert acks(s.transport.frames()) == [
            Ack(1, AckKind.IN_PROGRESS, (pos[3],)),
            Ack(1, AckKind.ACK, (pos[3],)),
        ]
        assert one.in_flight == 0
        with pytest.raises(ValueError, match="delay"):
            got[3].nack(delay=-1)

    run(main)


def test_many_acks_go_in_frames_of_at_most_ack_positions() -> None:
    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True))
        n = ACK_POSITIONS + 10
        s.feed(encode_frame(Delivery(1, n)) + b"".join(wire(message(i)) for i in range(n)))
        for _ in range(n):
            (await member.next_msg(0)).ack()
        s.transport.frames()
        await asyncio.sleep(0)
        sent = acks(s.transport.frames())
        assert [len(a.positions) for a in sent] == [ACK_POSITIONS, 10]
        assert [p.offset for a in sent for p in a.positions] == [1000 + i for i in range(n)]

    run(main)


def test_a_position_delivered_again_while_held_is_open_once() -> None:
    """A redelivery (ack_wait passed) of a message the application still holds: one
    position in flight; settling either copy settles it, the other is a no-op."""

    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True))
        s.feed(
            encode_frame(Delivery(1, 1))
            + wire(message(1))
            + encode_frame(Delivery(1, 1, 2))
            + wire(message(1))
        )
        first, again = await member.next_msg(0), await member.next_msg(0)
        assert (first.delivery_count, again.delivery_count, member.in_flight) == (1, 2, 1)
        again.in_progress()
        first.ack()
        again.ack()
        first.nack()
        assert member.in_flight == 0
        await asyncio.sleep(0)
        pos = (Position(5, 77, 1001),)
        assert acks(s.transport.frames()) == [Ack(1, AckKind.IN_PROGRESS, pos), Ack(1, AckKind.ACK, pos)]

    run(main)


def test_the_blocking_clients_members_ack_from_any_thread() -> None:
    """Four threads ack 4,000 deliveries of a blocking client's member while its I/O thread
    (here: the loop, in its own thread) delivers more: every position is sent once, in
    fewer frames than acks, and in_flight ends at 0."""
    n, threads = 4000, 4
    loop = asyncio.new_event_loop()
    io = threading.Thread(target=loop.run_forever, daemon=True)
    io.start()
    try:

        async def setup() -> tuple[Setup, SyncSubscription[GroupMessage]]:
            s = Setup()
            sync_sub: SyncSubscription[GroupMessage] = SyncSubscription(
                s.client, lambda coro: coro.close(), 65536, 1 << 26
            )
            sub = s.member(1, group_spec("g", ack=True), sync_sub.push)
            sync_sub.attach(sub)
            return s, sync_sub

        s, sync_sub = asyncio.run_coroutine_threadsafe(setup(), loop).result()
        data = [wire(message(i, vb=i % 1024)) for i in range(n)]

        def feed(part: list[bytes]) -> None:
            s.feed(encode_frame(Delivery(1, len(part))) + b"".join(part))

        def acker() -> None:
            for msg in sync_sub.iter(timeout=5, count=n // threads):
                msg.ack()
                msg.ack()  # twice, from the thread that has it: nothing more

        workers = [threading.Thread(target=acker) for _ in range(threads)]
        for w in workers:
            w.start()
        for at in range(0, n, 100):  # the I/O thread delivers in reads of 100
            loop.call_soon_threadsafe(feed, data[at : at + 100])
        for w in workers:
            w.join(30)

        async def settled() -> list[Ack]:
            for _ in range(100):
                await asyncio.sleep(0.01)
                if s.client.stats.acks_sent == n:
                    break
            return acks(s.transport.frames())

        sent = asyncio.run_coroutine_threadsafe(settled(), loop).result()
        offsets = sorted(p.offset for a in sent for p in a.positions)
        assert offsets == [1000 + i for i in range(n)]  # each once
        assert all(a.sid == 1 and a.kind == AckKind.ACK for a in sent) and len(sent) < n
        assert sync_sub.in_flight == 0 and s.client.stats.acks_sent == n
    finally:
        loop.call_soon_threadsafe(loop.stop)
        io.join(10)
        loop.close()


def test_paused_resumed_and_drain_expired_notices() -> None:
    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True, key_shared=True))
        assert not member.paused_by_server
        s.feed(encode_frame(GroupNotice(1, GroupEvent.PAUSED, 1000)))
        assert member.paused_by_server and s.client.stats.group_paused == 1
        s.feed(encode_frame(GroupNotice(1, GroupEvent.RESUMED)))
        assert not member.paused_by_server
        s.feed(encode_frame(GroupNotice(1, GroupEvent.PAUSED, 1000)))
        s.reconnect((0xAB << 32) | 2)  # a lost connection was the paused member
        assert not member.paused_by_server and s.client.stats.group_paused == 2
        s.feed(encode_frame(GroupNotice(1, GroupEvent.DRAIN_EXPIRED, 12, 517)))
        await asyncio.sleep(0)
        [err] = [e for e in s.errors if isinstance(e, DrainExpiredError)]
        assert (err.sid, err.vbucket, err.messages) == (1, 517, 12)
        assert s.client.stats.group_drain_expired == 1

    run(main)


def test_group_losses_reach_on_loss() -> None:
    async def main() -> None:
        s = Setup()
        s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(LossNotice(3, LossReason.GROUP_OVERFLOW, 1)))
        s.feed(encode_frame(LossNotice(1, LossReason.MAX_DELIVERIES, 1)))
        await asyncio.sleep(0)
        ref = s.link.ref
        assert s.losses == [(ref, 3, LossReason.GROUP_OVERFLOW), (ref, 1, LossReason.MAX_DELIVERIES)]
        assert s.client.stats.server_lost == 4 and s.link.told_lost == 0  # not the connection's account

    run(main)


# ---------------------------------------------------------------- reconnects: UNACKED_LOST


def test_the_next_hello_names_the_group_deliveries_of_the_lost_connection() -> None:
    """Hello.previous.group_received: of the deliveries received, those a Delivery announced
    (a resume by positions replays the others, never these: the server tells their loss)."""

    async def main() -> None:
        s = Setup()
        s.sub(1)
        s.member(2, group_spec("g"))
        s.feed(wire(message(1)) + encode_frame(Delivery(2, 2)) + wire(message(2)) + wire(message(3)))
        s.feed(encode_frame(Replay(1, 1)) + wire(message(4)))
        s.link.on_lost(s.proto, None)
        assert s.link.task is not None
        s.link.task.cancel()
        previous = s.link.previous
        assert previous is not None
        assert (previous.connection_id, previous.received, previous.group_received) == (
            (0xAB << 32) | 1,
            4,
            2,
        )
        s.proto, s.transport = new_proto()
        s.link.attach(s.proto, s.welcome((0xAB << 32) | 2), reconnect=True)
        assert (s.link.received, s.link.group_received) == (0, 0)  # counted per connection

    run(main)


def test_back_to_the_same_worker_process_the_settlements_made_while_down_are_sent() -> None:
    async def main() -> None:
        s = Setup(conn_id=(0xAB << 32) | 1)
        member = s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(Delivery(1, 3)) + b"".join(wire(message(i)) for i in range(3)))
        got = [await member.next_msg(0) for _ in range(3)]
        got[0].ack()
        await asyncio.sleep(0)
        s.link.on_lost(s.proto, None)
        assert s.link.task is not None
        s.link.task.cancel()
        got[1].ack()  # while down: kept
        got[2].nack(delay=0)
        await asyncio.sleep(0)
        assert s.client.stats.acks_sent == 1
        s.proto, s.transport = new_proto()
        s.link.attach(s.proto, s.welcome((0xAB << 32) | 2), reconnect=True)  # the same process
        frames = s.transport.frames()
        subscribe = next(i for i, f in enumerate(frames) if isinstance(f, Subscribe))
        sent = [(i, f) for i, f in enumerate(frames) if isinstance(f, Ack)]
        assert [f for _, f in sent] == [
            Ack(1, AckKind.ACK, (Position(5, 77, 1001),)),
            Ack(1, AckKind.NACK, (Position(5, 77, 1002),), 0),
        ]
        assert all(i > subscribe for i, _ in sent)  # after its Subscribe
        assert frames[subscribe] == Subscribe(1, b"orders.>", group="g", ack=True, ack_wait_ms=30000,
                                              max_deliveries=5, backoff_ms=(1000, 5000, 30000),
                                              max_in_flight=1000, max_in_flight_bytes=16 << 20,
                                              drain_timeout_ms=10000)  # fmt: skip
        assert s.losses == [] and member.in_flight == 0

    run(main)


def test_back_to_another_worker_process_only_the_nacks_are_told_lost() -> None:
    """The worker restarted: the deliveries the application holds are still its own (an ACK
    of them, made while down or later, is dropped: nothing is lost); a NACK asks for a
    redelivery nobody can make: each is told lost once (UNACKED_LOST), whenever it is made."""

    async def main() -> None:
        s = Setup(conn_id=(0xAB << 32) | 1)
        member = s.member(1, group_spec("g", ack=True))
        other = s.member(2, group_spec("h", ack=True))
        plain = s.member(3, group_spec("k"))  # no ack: nothing to lose
        s.feed(encode_frame(Delivery(1, 6)) + b"".join(wire(message(i)) for i in range(6)))
        s.feed(encode_frame(Delivery(2, 1)) + wire(message(9)))
        s.feed(encode_frame(Delivery(3, 1)) + wire(message(10)))
        got = [await member.next_msg(0) for _ in range(6)]
        got[0].ack()
        got[1].in_progress()  # not settled: still unacked
        s.link.on_lost(s.proto, None)
        assert s.link.task is not None
        s.link.task.cancel()
        got[2].ack()  # settled while down: waits for the reconnect, then dropped (not a loss)
        got[5].nack()  # while down: waits, then lost (the new process cannot redeliver it)
        assert member.in_flight == 3 and other.in_flight == 1
        s.proto, s.transport = new_proto()
        s.link.attach(s.proto, s.welcome((0xCD << 32) | 1), reconnect=True)  # the worker restarted
        await asyncio.sleep(0)
        assert acks(s.transport.frames()) == []  # nothing for the new process
        ref = s.link.ref
        assert s.losses == [(ref, 1, LossReason.UNACKED_LOST)]
        stats = s.client.stats
        # dropped: the ACK and IN_PROGRESS of 0 and 1 (not sent before the cut) and the ACK of 2
        assert stats.unacked_lost == 1 and stats.acks_dropped == 3
        assert member.in_flight == 3 and other.in_flight == 1  # 1, 3, 4: the application holds them
        got[3].ack()
        got[4].nack()
        got[4].nack()  # (settled already: nothing)
        await asyncio.sleep(0)
        assert s.losses == [(ref, 1, LossReason.UNACKED_LOST), (ref, 1, LossReason.UNACKED_LOST)]
        assert stats.unacked_lost == 2 and stats.acks_dropped == 4 and acks(s.transport.frames()) == []
        assert member.in_flight == 1  # 1: it said IN_PROGRESS and never settled it
        # what the new process delivers is acknowledged as usual
        s.feed(encode_frame(Delivery(1, 1, 2)) + wire(message(0)))
        fresh = await member.next_msg(0)
        assert fresh.delivery_count == 2 and member.in_flight == 2
        fresh.ack()
        await asyncio.sleep(0)
        assert acks(s.transport.frames()) == [Ack(1, AckKind.ACK, (Position(5, 77, 1000),))]
        assert plain.in_flight == 0

    run(main)


def test_a_retired_link_tells_only_the_nacks_it_cannot_send() -> None:
    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(Delivery(1, 2)) + wire(message(1)) + wire(message(2)))
        first, second = await member.next_msg(0), await member.next_msg(0)
        s.link.retire()
        assert s.losses == [] and member.in_flight == 2
        first.ack()
        second.nack()
        await asyncio.sleep(0)
        assert s.losses == [(s.link.ref, 1, LossReason.UNACKED_LOST)] and member.in_flight == 0

    run(main)


def test_unsubscribing_sends_what_was_settled_first_then_drops_later_acks() -> None:
    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(Delivery(1, 2)) + wire(message(1)) + wire(message(2)))
        first, second = await member.next_msg(0), await member.next_msg(0)
        s.transport.frames()
        first.ack()
        await member.unsubscribe()
        second.ack()
        await asyncio.sleep(0)
        assert [type(f) for f in s.transport.frames()] == [Ack, Unsubscribe]
        assert s.losses == [] and s.client.stats.acks_dropped == 1

    run(main)


def test_close_sends_the_last_settlements_before_its_round_trip() -> None:
    async def main() -> None:
        s = Setup(flush_timeout=0.05)  # no server answers the close's Ping
        member = s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(Delivery(1, 1)) + wire(message(1)))
        (await member.next_msg(0)).ack()
        s.transport.frames()
        await s.client.close()
        frames = s.transport.frames()
        assert frames[0] == Ack(1, AckKind.ACK, (Position(5, 77, 1001),)) and isinstance(frames[1], Ping)

    run(main)


# ---------------------------------------------------------------- subscribe's arguments


def test_bad_group_refuses_the_subscription_like_a_subscription_limit() -> None:
    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(Error(ErrorCode.BAD_GROUP, "settings differ", fatal=False, sid=1)))
        limited = s.client._subscriptions.limited.get(1)
        assert limited is not None and isinstance(limited[0], ServerError)
        assert limited[0].code == ErrorCode.BAD_GROUP
        assert 1 not in s.link.subs and member.sid not in s.link.ledgers

    run(main)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key_shared": True}, "group"),
        ({"ack": True}, "group"),
        ({"group": ""}, "group"),
        ({"group": b"bytes"}, "group"),
        ({"group": "g", "last": 10}, "starts live"),
        ({"group": "g", "since_time": 1.5}, "starts live"),
        ({"group": "g", "since": [Position(1, 2, 3)]}, "starts live"),
        ({"group": "g", "ack": True, "ack_wait": 0}, "ack_wait"),
        ({"group": "g", "ack": True, "ack_wait": float("nan")}, "ack_wait"),
        ({"group": "g", "ack": True, "max_deliveries": 0}, "max_deliveries"),
        ({"group": "g", "ack": True, "max_deliveries": 2.5}, "max_deliveries"),
        ({"group": "g", "ack": True, "backoff": ()}, "backoff"),
        ({"group": "g", "ack": True, "backoff": (1, -1)}, "backoff"),
        ({"group": "g", "ack": True, "max_in_flight": 0}, "max_in_flight"),
        ({"group": "g", "ack": True, "max_in_flight_bytes": -1}, "max_in_flight_bytes"),
        ({"group": "g", "ack": True, "dead_letter": ""}, "dead_letter"),
        ({"group": "g", "ack": True, "drain_timeout": -1}, "drain_timeout"),
        ({"group": "g", "ack": True, "ack_wait": 1e10}, "ack_wait"),
    ],
)
def test_nonsense_is_refused_at_once_with_its_name(kwargs: dict[str, Any], match: str) -> None:
    async def main() -> None:
        client = broky.Client("127.0.0.1:1")  # never connected: the arguments are checked first
        with pytest.raises(ValueError, match=match):
            await client.subscribe("orders.>", **kwargs)

    run(main)


def test_settings_in_seconds_become_ms_and_go_only_with_ack() -> None:
    spec = group_spec("g", key_shared=True, ack_wait=0.25, backoff=[0, 0.001, 60])
    assert spec == GroupSpec("g", True)  # no ack: no ack settings
    assert spec.subscribe(4, b"a.>", b"kp") == Subscribe(4, b"a.>", b"kp", group="g", key_shared=True)
    spec = group_spec("g", ack=True, ack_wait=0.25, backoff=[0, 0.001, 60], max_in_flight_bytes=1 << 40)
    assert spec is not None
    assert (spec.ack_wait_ms, spec.backoff_ms, spec.max_in_flight_bytes) == (250, (0, 1, 60000), 1 << 40)
    assert group_spec(None) is None


def test_the_clis_json_says_a_members_delivery_count() -> None:
    import json

    from broky.client.cli import message_json

    msg = message(1)
    assert "delivery_count" not in json.loads(message_json(msg))
    assert json.loads(message_json(GroupMessage(msg, 3)))["delivery_count"] == 3


def test_a_copy_of_a_members_message_keeps_its_fields_but_cannot_be_acked() -> None:
    import copy
    import pickle

    async def main() -> None:
        s = Setup()
        member = s.member(1, group_spec("g", ack=True))
        s.feed(encode_frame(Delivery(1, 1, 4)) + wire(message(1)))
        msg = await member.next_msg(0)
        for clone in (pickle.loads(pickle.dumps(msg)), copy.copy(msg)):
            assert clone == msg and clone.delivery_count == 4
            with pytest.raises(AckError):
                clone.ack()
        msg.ack()
        assert member.in_flight == 0

    run(main)
