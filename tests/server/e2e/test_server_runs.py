"""The fan-out fast path's route cache and runs of same-route messages, on the wire.

The worker remembers the targets of each (key_partition, key) and forwards a
run of consecutive messages with the same targets as one slice. These tests
drive one real `broky serve` with reads that mix routes, layouts, payload
sizes, refused partitions and control frames, and compare what every
subscriber receives with a model of the subscriptions.
"""

from __future__ import annotations

import random
import struct

from broky.errors import ErrorCode
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import Error, Message, Ping, Pong, encode_frame, encode_message, new_ksuid
from broky.protocol.layout import KEY_UOFFSET_AT, PAYLOAD_UOFFSET_AT
from tests.support.serverproc import ServerProcess
from tests.support.wire import Wire, kp_for_worker

KP_A = kp_for_worker(0, 2, "a")
KP_B = kp_for_worker(0, 2, "b")
KP_OTHER = kp_for_worker(1, 2, "c")  # owned by worker 1: NOT_MY_VBUCKET on worker 0
KEYS = [b"orders.eu", b"orders.us", b"orders.eu.deep", b"audit.x"]

# (pattern, key_partition or None) per subscriber connection
SUBSCRIBERS: list[list[tuple[bytes, bytes | None]]] = [
    [(b"orders.*", None)],
    [(b"orders.eu", KP_A)],
    [(b">", None), (b"orders.>", None)],  # two matching subscriptions: one delivery
    [(b"orders.>", KP_B), (b"*.us", None)],
]


def wanted(subs: list[tuple[bytes, bytes | None]], kp: bytes, key: bytes) -> bool:
    return any(pattern_matches(parse_pattern(p), key) and (part is None or part == kp) for p, part in subs)


def test_mixed_reads_reach_every_subscriber_as_the_model_says(server: ServerProcess) -> None:
    rnd = random.Random(7)
    subs = [Wire.hello(server.address, worker=0) for _ in SUBSCRIBERS]
    try:
        for w, patterns in zip(subs, SUBSCRIBERS):
            for sid, (pattern, part) in enumerate(patterns, 1):
                w.subscribe(sid, pattern, part)
            assert w.messages() == []
        with Wire.hello(server.address, worker=0) as pub:
            sent: list[tuple[bytes, bytes, bytes]] = []
            for _ in range(4):  # several reads, each warm or cold in the route cache
                frames: list[bytes] = []
                refused = 0
                route = (KP_A, KEYS[0])
                for i in range(1500):
                    if rnd.random() < 0.2:  # runs of the same route, broken now and then
                        route = (rnd.choice([KP_A, KP_B]), rnd.choice(KEYS))
                    if rnd.random() < 0.01:
                        frames.append(encode_message(KP_OTHER, route[1], b"refused"))
                        refused += 1
                        continue
                    if rnd.random() < 0.01:
                        frames.append(encode_frame(Ping(10_000 + i)))
                    payload = f"{len(sent)}".encode() * rnd.choice([1, 1, 1, 3])
                    uid = new_ksuid() if rnd.random() < 0.5 else None
                    frames.append(encode_message(route[0], route[1], payload, ts_producer=i, uid=uid))
                    sent.append((route[0], route[1], payload))
                pub.send(b"".join(frames))
                replies = pub.flush()
                errors = [f for f in replies if isinstance(f, Error)]
                assert len(errors) == refused
                assert {e.code for e in errors} <= {ErrorCode.NOT_MY_VBUCKET}
                assert all(isinstance(f, Error | Pong) for f in replies)
            for w, patterns in zip(subs, SUBSCRIBERS):
                got = w.messages(timeout=10)
                assert all(isinstance(m, Message) and m.ts_broker > 0 for m in got)
                expected = [s for s in sent if wanted(patterns, s[0], s[1])]
                assert [(m.key_partition, m.key, m.payload) for m in got] == expected
                assert expected  # the model sends each subscriber something
    finally:
        for w in subs:
            w.close()


def test_subscription_changes_reroute_cached_keys(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as pub, Wire.hello(server.address, worker=0) as sub:
        pub.publish(KP_A, b"late.key", b"nobody")  # caches "no targets"
        assert pub.flush() == []
        sub.subscribe(1, b"late.*")
        assert sub.messages() == []
        pub.publish(KP_A, b"late.key", b"one")
        assert pub.flush() == []
        assert [m.payload for m in sub.messages()] == [b"one"]
        with Wire.hello(server.address, worker=0) as second:
            second.subscribe(1, b"late.key")
            assert second.messages() == []
            pub.publish(KP_A, b"late.key", b"two")
            assert pub.flush() == []
            assert [m.payload for m in second.messages()] == [b"two"]
            assert [m.payload for m in sub.messages()] == [b"two"]
        # `second` is gone: its cached route must not be used any more.
        sub.unsubscribe(1)
        assert sub.messages() == []
        pub.publish(KP_A, b"late.key", b"three")
        assert pub.flush() == []
        sub.expect_silence()


def tamper_payload_length(frame: bytes, value: int) -> bytes:
    """The same canonical frame with another payload length (positions from broky.protocol.layout)."""
    at = PAYLOAD_UOFFSET_AT + struct.unpack_from("<I", frame, PAYLOAD_UOFFSET_AT)[0]
    return frame[:at] + struct.pack("<I", value) + frame[at + 4 :]


def test_bad_payload_length_inside_a_run_is_refused(server: ServerProcess) -> None:
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as other:
        sub.subscribe(1, b"run.key")
        assert sub.messages() == []
        good = [encode_message(KP_A, b"run.key", b"payload", ts_producer=i) for i in range(3)]
        bad = tamper_payload_length(good[0], 1 << 20)  # same size, same route, lies about its payload
        with Wire.hello(server.address, worker=0) as pub:
            pub.send(b"".join([*good, bad, good[0]]))
            frames = pub.expect_closed()
            assert [type(f) for f in frames] == [Error]
            assert frames[0].code == ErrorCode.MALFORMED_FRAME  # type: ignore[union-attr]
        got = sub.messages()
        assert [m.ts_producer for m in got] == [0, 1, 2]  # before the bad frame, nothing after
        other.publish(KP_A, b"run.key", b"still served")
        assert other.flush() == []
        assert [m.payload for m in sub.messages()] == [b"still served"]


def overlapping_key(payload: bytes) -> tuple[bytes, bytes]:
    """A valid but odd frame whose key vector runs on into the payload vector;
    return it with the key a FlatBuffers reader sees."""
    frame = bytearray(encode_message(KP_A, b"ab", payload))
    k = KEY_UOFFSET_AT + struct.unpack_from("<I", frame, KEY_UOFFSET_AT)[0]
    p = PAYLOAD_UOFFSET_AT + struct.unpack_from("<I", frame, PAYLOAD_UOFFSET_AT)[0]
    key_len = p + 8 - (k + 4)  # through the payload's length and its first 4 bytes
    struct.pack_into("<I", frame, k, key_len)
    return bytes(frame), bytes(frame[k + 4 : k + 4 + key_len])


def test_a_key_overlapping_the_payload_is_routed_by_its_real_bytes(server: ServerProcess) -> None:
    first, first_key = overlapping_key(b"1111-rest")
    second, second_key = overlapping_key(b"2222-rest")
    assert first_key != second_key  # same bytes up to the payload length, other keys
    with Wire.hello(server.address, worker=0) as sub, Wire.hello(server.address, worker=0) as pub:
        sub.subscribe(1, first_key)
        assert sub.messages() == []
        pub.send(first + second + first)
        assert pub.flush() == []
        got = sub.messages()
        assert [m.key for m in got] == [first_key, first_key]
