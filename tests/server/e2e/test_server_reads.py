"""Bounded reads against a real server (broky.server.shard.positions): a known sequence is
published, then read back with raw Read frames: ranges from positions, times and
the oldest retained, up to positions or to the Read; what was evicted counted
exactly; the read paced by the connection's drain."""

from __future__ import annotations

import json
import time
from typing import Any

from broky.errors import ErrorCode
from broky.protocol import (
    VBUCKETS,
    Error,
    Frame,
    Message,
    Pause,
    Read,
    ReadDone,
    Replay,
    Resume,
    encode_message,
)
from broky.protocol.frames import Position
from broky.protocol.routing import vbucket_of
from tests.support.http import http_get
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP = kp_for_worker(0, 1, "read")
VB = vbucket_of(KP)


class Answer:
    """What a Read got: its messages in order, its ReadDones by vbucket, and the
    number of Replay frames that announced the messages."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.dones: dict[int, ReadDone] = {}
        self.batches = 0

    def payloads(self, vb: int | None = VB) -> list[int]:
        """The numbers the messages of vbucket `vb` (None: of all) carry, in order."""
        return [int(m.payload.split(b".")[0]) for m in self.messages if vb is None or m.vbucket == vb]

    def done(self, vb: int = VB) -> ReadDone:
        return self.dones[vb]


def read(w: Wire, rd: Read, timeout: float = 10.0) -> Answer:
    """Send `rd` and take its answer, checking its shape: Replay{rid, n} + n Messages of
    one vbucket, that vbucket's ReadDone after them, ReadDones in vbucket order with
    `remaining` counting down to 0."""
    w.send(rd)
    return take(w, rd.rid, timeout)


def take(w: Wire, rid: int, timeout: float = 10.0, received: list[Frame] | None = None) -> Answer:
    """The answer to read `rid` (starting with the frames already `received`)."""
    early = iter(received or ())
    answer = Answer()
    last_vb = -1

    def next_frame() -> Frame:
        return next(early, None) or w.next(timeout)

    while True:
        frame = next_frame()
        if isinstance(frame, Replay):
            assert frame.rid == rid and frame.sid == 0 and frame.messages > 0, frame
            answer.batches += 1
            batch = [next_frame() for _ in range(frame.messages)]
            assert all(isinstance(m, Message) for m in batch), batch
            assert {m.vbucket for m in batch} == {batch[0].vbucket}, "a batch is one vbucket's"  # type: ignore[union-attr]
            assert batch[0].vbucket > last_vb, "messages of a vbucket come before its ReadDone"  # type: ignore[union-attr]
            answer.messages.extend(batch)  # type: ignore[arg-type]
            continue
        assert isinstance(frame, ReadDone), frame
        assert frame.rid == rid and frame.vbucket > last_vb, frame
        last_vb = frame.vbucket
        answer.dones[frame.vbucket] = frame
        if frame.remaining == 0:
            return answer


def publish(w: Wire, start: int, stop: int, key: bytes = b"r.k", kp: bytes = KP, pad: int = 0) -> None:
    for i in range(start, stop):
        w.publish(kp, key, b"%d" % i + b"." * pad)
    assert w.flush() == []


def offsets(messages: list[Message]) -> list[int]:
    return [m.offset for m in messages]


def test_a_known_sequence_is_read_back_exactly_and_twice_the_same(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 50)
        first = read(reader, Read(1, b">"))
        assert first.payloads() == list(range(50))
        assert offsets(first.messages) == list(range(1, 51))  # a fresh worker: offsets from 1
        assert len(first.dones) == VBUCKETS  # every vbucket, even the empty ones
        done = first.done()
        assert (done.next, done.evicted, done.epoch_changed) == (51, 0, False)
        assert done.epoch == first.messages[0].epoch
        assert all(d.next == 1 and d.evicted == 0 for vb, d in first.dones.items() if vb != VB)
        stop = tuple(Position(vb, d.epoch, d.next - 1) for vb, d in first.dones.items())
        publish(pub, 50, 60)  # after the range
        again = read(reader, Read(2, b">", stop=stop))
        assert again.payloads() == list(range(50))
        assert [bytes(m.uid or b"") for m in again.messages] == [bytes(m.uid or b"") for m in first.messages]
        assert {vb: (d.epoch, d.next) for vb, d in again.dones.items()} == {
            vb: (d.epoch, d.next) for vb, d in first.dones.items()
        }
        # Without a stop, up to the last message accepted before the Read: nothing live after it.
        now = read(reader, Read(3, b"r.*"))
        assert now.payloads() == list(range(60)) and now.done().next == 61
        publish(pub, 60, 61)
        reader.expect_silence()
        stats = json.loads(http_get(server, "/stats")[1])["workers"][0]
        assert stats["bounded_reads"] == 3 and stats["bounded_read_messages"] == 160


def test_start_and_stop_positions_start_time_pattern_and_key_partition(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    other = kp_for_worker(0, 1, "other")
    assert vbucket_of(other) != VB
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 10, b"r.a")
        publish(pub, 10, 20, b"r.b")
        publish(pub, 100, 105, b"r.a", kp=other)
        time.sleep(0.01)
        middle = time.time_ns()
        time.sleep(0.01)
        publish(pub, 20, 30, b"r.a")
        epoch = read(reader, Read(1, b">", KP)).messages[0].epoch
        # After offset 9 (payload 8), up to and including offset 25 (payload 24).
        got = read(reader, Read(2, b">", start=(Position(VB, epoch, 9),), stop=(Position(VB, epoch, 25),)))
        assert got.payloads() == list(range(9, 25)) and got.done().next == 26
        assert got.payloads(vbucket_of(other)) == [100, 101, 102, 103, 104]  # from its oldest, to now
        # From a time: the first retained message at or after it.
        got = read(reader, Read(3, b">", start_time=middle))
        assert got.payloads() == list(range(20, 30)) and all(m.ts_broker >= middle for m in got.messages)
        assert got.done(vbucket_of(other)).next == 6  # empty: its last came before the time
        # The pattern and the key_partition choose; the range is the same.
        got = read(reader, Read(4, b"r.b"))
        assert got.payloads() == list(range(10, 20)) and got.done().next == 31
        got = read(reader, Read(5, b"r.a", KP))
        assert list(got.dones) == [VB] and got.payloads() == list(range(10)) + list(range(20, 30))
        # A stop before the start: an empty range, where the start was.
        got = read(
            reader, Read(6, b">", KP, start=(Position(VB, epoch, 20),), stop=(Position(VB, epoch, 5),))
        )
        assert got.messages == [] and got.done().next == 21


def test_evicted_offsets_are_counted_exactly(start_server: Any) -> None:
    # A 64 KiB buffer: each publish below is its own read, so its own segment.
    server: ServerProcess = start_server("--replay-bytes", "64K", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 200, pad=1000)
        # From the first position: the retained tail, and exactly how many before it are gone.
        epoch = read(reader, Read(1, b">", KP)).done().epoch
        got = read(reader, Read(2, b">", KP, start=(Position(VB, epoch, 1),)))
        oldest = got.messages[0].offset
        assert oldest > 2 and offsets(got.messages) == list(range(oldest, 201))
        done = got.done()
        assert (done.evicted, done.next, done.epoch_changed) == (oldest - 2, 201, False)
        assert len(got.messages) + done.evicted == 199  # every offset after the start: read or counted
        # From the oldest retained: nothing was asked for that is gone.
        assert read(reader, Read(3, b">", KP)).done().evicted == 0
        # A range wholly gone: all of it counted, none read.
        gone = read(
            reader, Read(4, b">", KP, start=(Position(VB, epoch, 1),), stop=(Position(VB, epoch, 3),))
        )
        assert gone.messages == [] and (gone.done().evicted, gone.done().next) == (2, 4)


def test_messages_evicted_while_the_read_waits_are_counted(start_server: Any) -> None:
    # 1,500 messages of 1 KiB (1.7 MB) retained. The reader pauses its connection right
    # after its Read, so its read waits after the first batch (the kernel's socket buffers
    # would take the whole range otherwise), while 1.1 MB more evict the oldest segments.
    server: ServerProcess = start_server("--replay-bytes", "2M", "--max-pending-bytes", "64K", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        pub.send(*(encode_message(KP, b"r.k", b"%d." % i + bytes(1000)) for i in range(1500)))
        assert pub.flush() == []
        reader.send(Read(1, b">", KP), Pause())
        before = reader.flush()  # the first batch, sent before the Pause
        pub.send(*(encode_message(KP, b"r.k", b"x." + bytes(1000)) for i in range(1000)))
        assert pub.flush() == []
        reader.send(Resume())
        got = take(reader, 1, received=before)
    done = got.done()
    assert done.next == 1501 and done.evicted > 0
    assert all(o <= 1500 for o in offsets(got.messages))  # nothing accepted after the Read
    assert len(got.messages) + done.evicted == 1500  # read, or counted as gone: nothing else
    assert offsets(got.messages) == [int(p) + 1 for p in got.payloads()]
    # read before the pause, then after what was evicted: one gap, exactly `evicted` long
    gaps = [
        b - a for a, b in zip(offsets(got.messages), offsets(got.messages)[1:], strict=False) if b - a > 1
    ]
    assert gaps == [done.evicted + 1]


def test_another_epoch_starts_the_current_one_from_its_first_offset(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 5)
        got = read(reader, Read(1, b">", KP, start=(Position(VB, 12345, 77),)))
        assert got.payloads() == list(range(5))
        done = got.done()
        assert (done.epoch_changed, done.evicted, done.next) == (True, 0, 6) and done.epoch != 12345
        # A stop of another epoch: what it named is gone; nothing of the current epoch.
        got = read(reader, Read(2, b">", KP, start=(Position(VB, 12345, 1),), stop=(Position(VB, 12345, 9),)))
        assert got.messages == [] and (got.done().next, got.done().epoch_changed) == (1, True)


def test_a_start_time_never_says_epoch_changed(start_server: Any) -> None:
    # schema/README.md 5.2: epoch_changed is for a `start` of another epoch only. On a fresh
    # server every epoch began after a start_time of 1 ns past 1970: whether an earlier epoch
    # held anything after it, the worker does not know, and does not say.
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 5)
        got = read(reader, Read(1, b">", start_time=1))
        assert got.payloads() == list(range(5)) and len(got.dones) == VBUCKETS
        assert not any(d.epoch_changed or d.evicted for d in got.dones.values())


def test_a_pong_after_a_read_follows_its_refusal_and_fixed_ranges_not_its_answer(start_server: Any) -> None:
    # schema/README.md 5.2 "A Read and the Pong of a later Ping", 6.4: the Pong follows a
    # refused Read's Error; after an accepted one it says that the ranges are fixed, while
    # the batches and ReadDones go out as the connection drains, before or after it.
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 5)
        reader.send(Read(1, b"a..b"))
        [refusal] = reader.flush()
        assert isinstance(refusal, Error) and refusal.code == ErrorCode.BAD_PATTERN and refusal.rid == 1
        # Paused: nothing of the read goes out before Resume, and the Pong does.
        reader.send(Pause(), Read(2, b">"))
        assert reader.flush() == []  # no Error of rid 2: accepted
        publish(pub, 5, 8)  # after the Pong: not in the read
        reader.send(Resume())
        got = take(reader, 2)
        assert got.payloads() == list(range(5)) and got.done().next == 6 and len(got.dones) == VBUCKETS
        # Not paused: every ReadDone comes, some before the Pong, the rest after it.
        reader.send(Read(3, b">"))
        before = reader.flush()
        assert not [f for f in before if isinstance(f, Error)]
        got = take(reader, 3, received=before)
        assert got.payloads() == list(range(8)) and len(got.dones) == VBUCKETS
        reader.expect_silence()


def test_bad_reads_are_refused_and_the_connection_stays(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 3)
        epoch = read(reader, Read(1, b">", KP)).done().epoch

        def refused(rd: Read) -> Error:
            reader.send(rd)
            [err] = reader.flush()
            assert isinstance(err, Error) and not err.fatal and err.rid == rd.rid, err
            return err

        assert refused(Read(2, b">", KP, start=(Position(VB, epoch, 4),))).code == ErrorCode.BAD_POSITION
        assert refused(Read(3, b">", KP, stop=(Position(VB, epoch, 4),))).code == ErrorCode.BAD_POSITION
        twice = (Position(VB, epoch, 1), Position(VB, epoch, 2))
        assert refused(Read(4, b">", start=twice)).code == ErrorCode.BAD_POSITION
        assert refused(Read(5, b"a..b")).code == ErrorCode.BAD_PATTERN
        assert refused(Read(0, b">")).code == ErrorCode.READ_REFUSED
        # The last accepted offset is a good stop and a good start (an empty range).
        got = read(reader, Read(6, b">", KP, start=(Position(VB, epoch, 3),), stop=(Position(VB, epoch, 3),)))
        assert got.messages == [] and got.done().next == 4


def test_one_read_at_a_time_per_connection(start_server: Any) -> None:
    server: ServerProcess = start_server("--max-pending-bytes", "64K", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 300, pad=1000)
        # Paused (by the client) after its first batch, read 1 is in progress.
        reader.send(Read(1, b">", KP), Pause(), Read(2, b">", KP), Read(1, b">", KP))
        before = reader.flush()
        errors = [f for f in before if isinstance(f, Error)]
        assert [(e.code, e.rid, e.fatal) for e in errors] == [
            (ErrorCode.READ_REFUSED, 2, False),
            (ErrorCode.READ_REFUSED, 1, False),
        ]
        reader.send(Resume())
        got = take(reader, 1, received=[f for f in before if not isinstance(f, Error)])
        assert got.payloads() == list(range(300))
        assert read(reader, Read(2, b">", KP)).payloads() == list(range(300))  # now it may


def test_reads_in_one_write_are_served_on_turns_of_their_own_in_order(start_server: Any) -> None:
    # A Read is handled over turns of the worker's loop, and the input after it waits for
    # the next turn (broky.server.shard.positions, "Turns of the loop"): each Read of one write is
    # handled by a read of its own, whose clock reading its Replay carries (`ts`), and the
    # answers keep the order of the Reads, the Pong after them.
    server: ServerProcess = start_server(workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 20)
        reader.send(Read(1, b">", KP), Read(2, b">", KP), Read(3, b"r.*", KP))
        frames = reader.flush()
        replays = [f for f in frames if isinstance(f, Replay)]
        assert [(r.rid, r.messages) for r in replays] == [(1, 20), (2, 20), (3, 20)]
        assert replays[0].ts < replays[1].ts < replays[2].ts
        dones = [f for f in frames if isinstance(f, ReadDone)]
        assert [(d.rid, d.vbucket, d.next, d.remaining) for d in dones] == [
            (rid, VB, 21, 0) for rid in (1, 2, 3)
        ]
        assert [type(f).__name__ for f in frames] == (["Replay"] + ["Message"] * 20 + ["ReadDone"]) * 3
        assert read(reader, Read(4, b">", KP)).payloads() == list(range(20))  # the connection goes on


def connection_view(server: ServerProcess, name: str) -> dict[str, Any]:
    body = json.loads(http_get(server, "/connections?limit=100")[1])
    [conn] = [c for c in body["connections"] if c["name"] == name]
    return conn  # type: ignore[no-any-return]


def test_a_read_far_larger_than_the_pending_bound_keeps_within_it(start_server: Any) -> None:
    # 7 MB retained: more than the kernel's socket buffers take (up to 4 MiB of send
    # buffer on loopback), so the rest waits in the worker, paced by the reader.
    limit = 64 << 10
    total = 6400
    server: ServerProcess = start_server("--max-pending-bytes", "64K", workers=1)
    kps = [kp_for_worker(0, 1, f"big{i}") for i in range(4)]
    with Wire.hello(server.address) as pub:
        pub.send(*(encode_message(kps[i % 4], b"r.big", b"%d." % i + bytes(1000)) for i in range(total)))
        assert pub.flush() == []
    with Wire.hello(server.address, name="big-reader", rcvbuf=8192) as reader:
        # Paused right behind the Read until the worker shows the read under way (without
        # it, a read the kernel's buffers take whole can be over before the first look).
        reader.send(Read(7, b"r.big"), Pause())
        deadline = time.monotonic() + 5
        while connection_view(server, "big-reader")["bounded_read"] != 7:
            assert time.monotonic() < deadline, connection_view(server, "big-reader")
            time.sleep(0.01)
        reader.send(Resume())
        peak = 0
        got = Answer()
        frames = 0
        while True:  # read slowly, looking at what the worker has pending for us
            if frames % 100 == 0:
                conn = connection_view(server, "big-reader")
                if conn["bounded_read"]:
                    peak = max(peak, conn["pending_bytes"])
                    assert conn["bounded_read"] == 7
            frame = reader.next()
            frames += 1
            if isinstance(frame, Message):
                got.messages.append(frame)
            elif isinstance(frame, ReadDone):
                got.dones[frame.vbucket] = frame
                if frame.remaining == 0:
                    break
        assert 0 < peak <= limit + 1100, peak  # at most one message over the bound
        by_kp: dict[bytes, list[int]] = {}
        for m in got.messages:
            by_kp.setdefault(m.key_partition, []).append(int(m.payload.split(b".")[0]))
        assert {kp: by_kp[kp] for kp in kps} == {kp: list(range(i, total, 4)) for i, kp in enumerate(kps)}
        assert len(got.messages) == total and len(got.dones) == VBUCKETS
        assert connection_view(server, "big-reader")["bounded_read"] == 0
    stats = json.loads(http_get(server, "/stats")[1])["workers"][0]
    assert stats["dropped"]["slow_consumer"] == 0 and stats["bounded_read_messages"] == total


def test_a_reader_that_goes_away_mid_read_frees_its_cursor(start_server: Any) -> None:
    server: ServerProcess = start_server("--max-pending-bytes", "64K", workers=1)
    with Wire.hello(server.address) as pub:
        publish(pub, 0, 500, pad=1000)
        for _ in range(3):
            with Wire.hello(server.address, name="quitter", rcvbuf=8192) as quitter:
                # Paused right behind the Read: the read waits for a Resume that never comes
                # (without it, the kernel's send buffer on loopback can take the whole read
                # before anyone looks).
                quitter.send(Read(1, b">"), Pause())
                deadline = time.monotonic() + 5
                while connection_view(server, "quitter")["bounded_read"] != 1:
                    assert time.monotonic() < deadline, connection_view(server, "quitter")
                    time.sleep(0.01)
        # The worker serves the others: a read, a subscription.
        with Wire.hello(server.address) as reader:
            assert read(reader, Read(1, b">", KP)).payloads() == list(range(500))
            reader.subscribe(1, b"r.>")
            reader.flush()
            publish(pub, 500, 501)
            assert [int(m.payload) for m in reader.messages()] == [500]
        body = json.loads(http_get(server, "/connections?limit=100")[1])
        assert [c["name"] for c in body["connections"] if c["bounded_read"]] == []


def test_without_a_replay_buffer_every_vbucket_ends_at_once(start_server: Any) -> None:
    server: ServerProcess = start_server("--replay-bytes", "0", workers=1)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 5)
        got = read(reader, Read(1, b">"))
        assert got.messages == [] and len(got.dones) == VBUCKETS and got.batches == 0
        done = got.done()
        assert (done.next, done.evicted) == (6, 0)  # where the vbucket stands; nothing was asked for
        got = read(reader, Read(2, b">", KP, start=(Position(VB, done.epoch, 2),)))
        assert got.messages == [] and got.done().evicted == 3  # offsets 3, 4, 5: gone


def test_a_read_across_two_workers_gets_each_its_own_vbuckets(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=2)
    kp0, kp1 = kp_for_worker(0, 2, "two"), kp_for_worker(1, 2, "two")
    with Wire.hello(server.address, worker=0) as pub0, Wire.hello(server.address, worker=1) as pub1:
        publish(pub0, 0, 5, kp=kp0)
        publish(pub1, 5, 10, kp=kp1)
        with Wire.hello(server.address, worker=0) as r0, Wire.hello(server.address, worker=1) as r1:
            a, b = read(r0, Read(1, b">")), read(r1, Read(1, b">"))
        assert a.payloads(None) == list(range(5)) and b.payloads(None) == list(range(5, 10))
        assert len(a.dones) + len(b.dones) == VBUCKETS and not set(a.dones) & set(b.dones)
        with Wire.hello(server.address, worker=0) as r0:
            r0.send(Read(2, b">", kp1))
            [err] = r0.flush()
            assert isinstance(err, Error) and err.code == ErrorCode.NOT_MY_VBUCKET and err.rid == 2


def distinct_kps(worker: int, workers: int, n: int, prefix: str) -> list[bytes]:
    """n key_partitions of `worker`, each in a vbucket of its own."""
    kps: dict[int, bytes] = {}
    i = 0
    while len(kps) < n:
        kp = kp_for_worker(worker, workers, f"{prefix}{i}")
        kps.setdefault(vbucket_of(kp), kp)
        i += 1
    return list(kps.values())


def remaining(answer: Answer) -> list[int]:
    return [answer.dones[vb].remaining for vb in sorted(answer.dones)]


def test_a_read_narrowed_to_vbuckets_answers_for_those_only(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    kps = distinct_kps(0, 1, 4, "narrow")
    vbs = [vbucket_of(kp) for kp in kps]
    empty = next(vb for vb in range(VBUCKETS) if vb not in vbs)  # nothing published there
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        for n, kp in enumerate(kps):
            publish(pub, 10 * n, 10 * n + 5, kp=kp)
        # Two of the four, and an empty one, named in no particular order.
        asked = [vbs[2], empty, vbs[0]]
        got = read(reader, Read(1, b">", vbuckets=tuple(asked)))
        assert sorted(got.dones) == sorted(asked) and remaining(got) == [2, 1, 0]
        assert {m.vbucket for m in got.messages} == {vbs[0], vbs[2]}
        assert got.payloads(vbs[0]) == list(range(5)) and got.payloads(vbs[2]) == list(range(20, 25))
        assert (got.dones[empty].next, got.dones[vbs[2]].next) == (1, 6)
        # With key_partition among them: that vbucket only; with its positions, as any read.
        epoch = got.dones[vbs[0]].epoch
        got = read(
            reader, Read(2, b">", kps[0], start=(Position(vbs[0], epoch, 2),), vbuckets=(vbs[1], vbs[0]))
        )
        assert list(got.dones) == [vbs[0]] and got.payloads(None) == [2, 3, 4]
        # Positions of vbuckets the read does not cover are ignored, as for another worker's.
        got = read(reader, Read(3, b">", stop=(Position(vbs[1], epoch, 10**6),), vbuckets=(vbs[3],)))
        assert list(got.dones) == [vbs[3]] and got.payloads(None) == list(range(30, 35))


def test_a_read_narrowed_across_two_workers_gets_each_its_own_of_them(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=2)
    mine = [distinct_kps(w, 2, 3, f"narrow{w}-") for w in (0, 1)]
    with Wire.hello(server.address, worker=0) as pub0, Wire.hello(server.address, worker=1) as pub1:
        for w, pub in enumerate((pub0, pub1)):
            for n, kp in enumerate(mine[w]):
                publish(pub, 100 * w + 10 * n, 100 * w + 10 * n + 3, kp=kp)
        asked = [vbucket_of(mine[0][0]), vbucket_of(mine[0][2]), vbucket_of(mine[1][1])]
        rd = Read(1, b">", vbuckets=tuple(asked))
        with Wire.hello(server.address, worker=0) as r0, Wire.hello(server.address, worker=1) as r1:
            a, b = read(r0, rd), read(r1, rd)  # the same Read to both: each answers for its own
            assert sorted(a.dones) == sorted(asked[:2]) and remaining(a) == [1, 0]
            assert list(b.dones) == [asked[2]] and remaining(b) == [0]
            assert a.payloads(asked[0]) == [0, 1, 2] and a.payloads(asked[1]) == [20, 21, 22]
            assert len(a.messages) == 6 and b.payloads(None) == [110, 111, 112]
            # None of them here: refused as a read of another worker's key_partition is.
            r1.send(Read(2, b">", vbuckets=tuple(asked[:2])))
            [err] = r1.flush()
            assert isinstance(err, Error) and (err.code, err.rid, err.fatal) == (
                ErrorCode.NOT_MY_VBUCKET,
                2,
                False,
            )
            assert "none of the vbuckets" in (err.message or "")
            assert read(r1, Read(3, b">", vbuckets=(asked[2],))).payloads(None) == [110, 111, 112]


def test_bad_vbuckets_refuse_the_read_and_the_connection_stays(start_server: Any) -> None:
    server: ServerProcess = start_server(workers=1)
    other = next(vb for vb in range(VBUCKETS) if vb != VB)
    with Wire.hello(server.address) as pub, Wire.hello(server.address) as reader:
        publish(pub, 0, 3)
        for rid, rd, named in [
            (1, Read(1, b">", vbuckets=(VB, VBUCKETS)), f"vbucket {VBUCKETS}"),
            (2, Read(2, b">", vbuckets=(65535,)), "vbucket 65535"),
            (3, Read(3, b">", vbuckets=(other, VB, other)), f"vbucket {other} is named twice"),
            (4, Read(4, b">", KP, vbuckets=(other,)), f"in vbucket {VB}, not among"),
        ]:
            reader.send(rd)
            [err] = reader.flush()
            assert isinstance(err, Error) and (err.code, err.rid, err.fatal) == (
                ErrorCode.BAD_POSITION,
                rid,
                False,
            ), err
            assert named in (err.message or ""), err
            got = read(reader, Read(10 + rid, b">", vbuckets=(VB,)))  # the next read is served
            assert list(got.dones) == [VB] and got.payloads() == [0, 1, 2]
        stats = json.loads(http_get(server, "/stats")[1])["workers"][0]
        assert stats["bounded_reads"] == 4  # the refused ones did nothing
