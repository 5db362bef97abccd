"""An ack group whose members are all at their bound keeps positions, not copies
(broky.server.shard.groups, "Positions, not copies"; schema/README.md 5.4): a burst far
larger than --group-backlog-bytes waits as positions into the worker's replay buffer and
is delivered, every message once and in order per key_partition, as the members read on;
what the buffer evicted first is told, EVICTED, with the exact count and positions.
Against a real server, on the wire: the members are raw sockets that stop reading."""

from __future__ import annotations

import time
from typing import Any

from broky.protocol import Ack, AckKind, Delivery, LossNotice, LossReason, Message, Position, Subscribe
from broky.protocol.routing import vbucket_of
from tests.support.http import debug_stats
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire

KPS = [b"kp%d" % i for i in range(64)]
BURST = 4000  # x 1 KiB: 4 MiB, 64 times the group's backlog bound below
PAYLOAD = b"p" * 1024


def burst_to_paused_members(
    server: ServerProcess, key_shared: bool = True, leave: bool = False
) -> tuple[dict[int, list[tuple[bytes, int, int]]], list[LossNotice]]:
    """Two ack members (key-shared unless told) that take 20 messages each and then read
    nothing while BURST messages are published; then (`leave`: the first one closes its
    connection, and only the second reads on) they read on, acknowledging what they get.
    Per member: the (key_partition, offset, attempt) it was delivered, in order; and the
    LossNotices they were told."""
    members = [Wire.hello(server.address) for _ in range(2)]
    got: dict[int, list[tuple[bytes, int, int]]] = {0: [], 1: []}
    told: list[LossNotice] = []
    try:
        for w in members:
            w.send(Subscribe(1, b"o.>", group="g", key_shared=key_shared, ack=True, max_in_flight=20))
            assert w.flush() == []
        with Wire.hello(server.address) as pub:
            for i in range(BURST):
                pub.publish(KPS[i % len(KPS)], b"o.k", PAYLOAD)
            assert pub.flush(30) == []  # all processed while neither member reads nor acks
        stats = debug_stats(server)["workers"][0]
        assert stats["group_delivered"] <= 40  # the members are at their bound: the rest waits
        if leave:  # what it held and what waited for it go to the other member
            members[0].close()
        # The members read on: each acknowledges every Delivery as it reads it.
        announced = [0, 0]
        attempt = [1, 1]

        def take(i: int, frame: Any) -> None:
            if isinstance(frame, Delivery):
                announced[i], attempt[i] = frame.messages, frame.attempt
            elif isinstance(frame, Message):
                assert announced[i], frame  # every message of the group is announced
                announced[i] -= 1
                got[i].append((frame.key_partition, frame.offset, attempt[i]))
                members[i].send(Ack(1, AckKind.ACK, (Position(frame.vbucket, frame.epoch, frame.offset),)))
            elif isinstance(frame, LossNotice):
                told.append(frame)

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(got[0]) + len(got[1]) + sum(n.dropped for n in told) >= BURST:
                break
            for i, w in enumerate(members):  # what each has, then the other's
                if leave and i == 0:
                    continue
                try:
                    while True:
                        take(i, w.next(0.01))
                except TimeoutError:
                    continue
        for i, w in enumerate(members):  # anything still on its way (there must be nothing)
            if leave and i == 0:
                continue
            for frame in w.flush():
                take(i, frame)
    finally:
        for w in members:
            w.close()
    return got, told


def test_a_burst_past_the_backlog_bound_waits_as_positions_and_is_all_delivered_in_order(
    start_server: Any,
) -> None:
    # 4 MiB for members that take 40 messages: today (copies) all but 64 KiB of it is
    # dropped, GROUP_OVERFLOW. As positions it costs a Run per vbucket, and the replay
    # buffer (192 MiB by default) holds every message.
    server: ServerProcess = start_server("--group-backlog-bytes", "64KiB", workers=1)
    got, told = burst_to_paused_members(server)
    assert told == [], told[:3]
    deliveries = got[0] + got[1]
    assert len(deliveries) == BURST
    assert all(attempt == 1 for _, _, attempt in deliveries)
    assert len({(kp, off) for kp, off, _ in deliveries}) == BURST  # each message once
    for i, mine in got.items():  # in offset order per key_partition, each on one member
        by_kp: dict[bytes, list[int]] = {}
        for kp, off, _ in mine:
            by_kp.setdefault(kp, []).append(off)
        for kp, offsets in by_kp.items():
            assert offsets == sorted(offsets), f"member {i}, {kp!r}: out of order"
    owners = {kp: i for i, mine in got.items() for kp, _, _ in mine}
    assert all(kp in {k for k, _, _ in got[owners[kp]]} for kp in owners)
    assert not {kp for kp, _, _ in got[0]} & {kp for kp, _, _ in got[1]}  # key-shared
    stats = debug_stats(server)["workers"][0]
    assert stats["dropped"]["group_overflow"] == 0
    assert stats["group_evicted"] == 0
    assert stats["in_flight"] == 0 and stats["group_kept_bytes"] == 0  # all acknowledged


def test_what_the_replay_buffer_evicted_before_delivery_is_told_exactly(start_server: Any) -> None:
    # A replay buffer of 512 KiB under a 4 MiB burst: most positions are evicted before the
    # members read on. Each is told once, EVICTED, to the member of its key_partition, with
    # the positions it spans; delivered and told add up to the burst, per vbucket offset by
    # offset.
    server: ServerProcess = start_server(
        "--group-backlog-bytes", "64KiB", "--replay-bytes", "512KiB", workers=1
    )
    got, told = burst_to_paused_members(server)
    deliveries = got[0] + got[1]
    assert all(n.reason == LossReason.EVICTED and n.sid == 1 for n in told), told[:3]
    evicted = sum(n.dropped for n in told)
    assert evicted > BURST // 2 and len(deliveries) + evicted == BURST
    seen: dict[int, set[int]] = {}
    for kp, off, _ in deliveries:
        vb = vbucket_of(kp)
        assert off not in seen.setdefault(vb, set()), (kp, off)
        seen[vb].add(off)
    for n in told:
        assert n.at is not None and n.through is not None
        assert n.at.vbucket == n.through.vbucket and n.through.offset - n.at.offset + 1 == n.dropped
        span = set(range(n.at.offset, n.through.offset + 1))
        assert not span & seen.setdefault(n.at.vbucket, set()), n  # told once, never delivered
        seen[n.at.vbucket] |= span
    for vb, offsets in seen.items():  # every offset of every vbucket: delivered or told
        assert offsets == set(range(1, len(offsets) + 1)), vb
    stats = debug_stats(server)["workers"][0]
    assert stats["group_evicted"] == evicted
    assert stats["dropped"]["group_overflow"] == 0


def test_without_a_replay_buffer_the_backlog_keeps_copies_within_its_bound(start_server: Any) -> None:
    # --replay-bytes 0: nothing to read positions from. What waits is a copy, 64 KiB of
    # them at most; the rest is dropped and told, GROUP_OVERFLOW, exactly.
    server: ServerProcess = start_server("--group-backlog-bytes", "64KiB", "--replay-bytes", "0", workers=1)
    got, told = burst_to_paused_members(server)
    deliveries = got[0] + got[1]
    assert all(n.reason == LossReason.GROUP_OVERFLOW for n in told), told[:3]
    overflowed = sum(n.dropped for n in told)
    assert len(deliveries) + overflowed == BURST
    assert 40 < len(deliveries) <= 40 + (64 << 10) // len(PAYLOAD)  # in flight, then the backlog's copies
    assert len({(kp, off) for kp, off, _ in deliveries}) == len(deliveries)
    stats = debug_stats(server)["workers"][0]
    assert stats["dropped"]["group_overflow"] == overflowed and stats["group_evicted"] == 0


def test_positions_go_on_in_order_when_a_member_leaves_and_in_a_load_balanced_group(
    start_server: Any,
) -> None:
    # The first member closes with 20 in flight and its share of the burst waiting as
    # positions: the other gets its 20 again (attempt 2) and every waiting position, in
    # offset order per key_partition. A load-balanced group's backlog is positions too.
    server: ServerProcess = start_server("--group-backlog-bytes", "64KiB", workers=1)
    got, told = burst_to_paused_members(server, leave=True)
    assert told == [] and got[0] == []
    firsts = [(kp, off) for kp, off, attempt in got[1] if attempt == 1]
    again = [(kp, off) for kp, off, attempt in got[1] if attempt == 2]
    assert len(again) == 20 and len(set(firsts) | set(again)) == len(firsts) + len(again) == BURST
    by_kp: dict[bytes, list[int]] = {}
    for kp, off in firsts:
        by_kp.setdefault(kp, []).append(off)
    assert all(offsets == sorted(offsets) for offsets in by_kp.values())
    stats = debug_stats(server)["workers"][0]
    assert stats["dropped"]["group_overflow"] == 0 and stats["in_flight"] == 0

    server = start_server("--group-backlog-bytes", "64KiB", workers=1)
    got, told = burst_to_paused_members(server, key_shared=False)
    assert told == []
    deliveries = got[0] + got[1]
    assert len({(kp, off) for kp, off, _ in deliveries}) == len(deliveries) == BURST
    stats = debug_stats(server)["workers"][0]
    assert stats["dropped"]["group_overflow"] == 0 and stats["in_flight"] == 0
