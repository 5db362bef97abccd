"""The client's template encoder produces exactly the codec's bytes."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.client.encoder import PublishEncoder, as_bytes, payload_bytes
from broky.errors import LocalProtocolError, PayloadTooLargeError
from broky.matching import key_problem
from broky.protocol import decode_message, encode_message, vbucket_of
from broky.protocol.ksuid import ksuid_time
from broky.protocol.layout import UID_AT, UID_END

# What publish takes (broky.client.encoder.check_fields): a partition of any bytes but none,
# a key of literal tokens (no empty, `*` or `>` one).
partitions = st.binary(min_size=1, max_size=40)
keys = st.binary(min_size=1, max_size=40).filter(lambda k: key_problem(k) is None)


@settings(max_examples=300, deadline=None)
@given(
    kp=partitions,
    key=keys,
    payload=st.binary(max_size=300),
    ts=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
def test_template_frames_equal_encode_message(kp: bytes, key: bytes, payload: bytes, ts: int | None) -> None:
    enc = PublishEncoder(1 << 20)
    before = time.time_ns()
    for _ in range(2):  # the second time comes from the cached template
        frame, vb = enc.encode(kp, key, payload, ts)
        uid = frame[UID_AT:UID_END]
        msg = decode_message(frame)
        assert frame == encode_message(kp, key, payload, msg.ts_producer, 0, uid)
        assert (msg.key_partition, msg.key, msg.payload, msg.ts_broker, msg.uid) == (kp, key, payload, 0, uid)
        assert vb == vbucket_of(kp)
        if ts is None:
            assert before <= msg.ts_producer <= time.time_ns()
        else:
            assert msg.ts_producer == ts
        assert abs(ksuid_time(uid) - time.time()) < 5


@settings(max_examples=300, deadline=None)
@given(
    kp=partitions,
    key=keys,
    payload=st.binary(max_size=300),
    ts=st.integers(-(2**63), 2**63 - 1),
    uid=st.one_of(st.none(), st.binary(min_size=20, max_size=20)),
)
def test_given_uid_frames_equal_encode_message(
    kp: bytes, key: bytes, payload: bytes, ts: int, uid: bytes | None
) -> None:
    enc = PublishEncoder(1 << 20)
    for _ in range(2):  # the second time comes from the cached template
        frame, vb = enc.encode_any(kp, key, payload, ts, uid)
        assert frame == encode_message(kp, key, payload, ts, 0, uid)
        assert vb == vbucket_of(kp)


def test_uids_are_unique() -> None:
    enc = PublishEncoder(1 << 20)
    uids = {enc.encode(b"p", b"k", b"", None)[0][UID_AT:UID_END] for _ in range(10_000)}
    assert len(uids) == 10_000


def test_encode_any_with_and_without_uid() -> None:
    enc = PublishEncoder(1 << 20)
    frame, vb = enc.encode_any(b"p", b"k", b"v", 5, None)
    assert decode_message(frame).uid is None and vb == vbucket_of(b"p")
    frame, _ = enc.encode_any(b"p", b"k", b"v", 5, bytes(range(20)))
    assert decode_message(frame).uid == bytes(range(20))
    with pytest.raises(LocalProtocolError):
        enc.encode_any(b"p", b"k", b"v", 5, b"short")


def test_size_limit_is_checked_before_anything_is_returned() -> None:
    enc = PublishEncoder(200)
    enc.encode(b"p", b"k", b"x" * 50, None)
    with pytest.raises(PayloadTooLargeError) as info:
        enc.encode(b"p", b"k", b"x" * 200, None)
    assert info.value.limit == 200 and info.value.size > 200
    with pytest.raises(PayloadTooLargeError):
        enc.encode_any(b"p", b"k", b"x" * 200, None, None)
    enc.set_limit(4096)
    enc.encode(b"p", b"k", b"x" * 200, None)


def test_bad_field_types() -> None:
    assert as_bytes("é", "key") == "é".encode()
    assert as_bytes(bytearray(b"ab"), "key") == b"ab"
    with pytest.raises(LocalProtocolError, match="key must be bytes or str"):
        as_bytes(3, "key")
    with pytest.raises(LocalProtocolError, match="payload must be bytes"):
        payload_bytes("text")
    enc = PublishEncoder(1 << 20)
    with pytest.raises(LocalProtocolError):
        enc.encode(b"p", b"k", b"v", 2**63)


def test_forked_child_gets_fresh_random_bytes() -> None:
    enc = PublishEncoder(1 << 20)
    enc.encode(b"p", b"k", b"", None)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(w, enc.encode(b"p", b"k", b"", None)[0][UID_AT + 4 : UID_END])
        os._exit(0)
    os.close(w)
    child = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    assert child != enc.encode(b"p", b"k", b"", None)[0][UID_AT + 4 : UID_END]


def test_templates_only_for_shapes_that_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    import broky.client.encoder as encoder_module

    monkeypatch.setattr(encoder_module, "MAX_TEMPLATES", 3)
    monkeypatch.setattr(encoder_module, "MAX_SEEN", 10)
    enc = PublishEncoder(1 << 20)
    frames = [enc.encode(b"p", b"k", b"v", 5)[0] for _ in range(2)]
    assert enc.template_of(b"p", b"k", 1) is not None  # made at the second sighting
    assert enc.template_of(b"q", b"k", 1) is None
    enc.encode(b"q", b"k", b"v", 5)
    assert enc.template_of(b"q", b"k", 1) is None  # one sighting: a plain encode
    for kp in (b"a", b"b", b"c"):  # fill the cache: 3 templates
        enc.encode(kp, b"k", b"v", 5)
        enc.encode(kp, b"k", b"v", 5)
    assert [enc.template_of(kp, b"k", 1) is not None for kp in (b"a", b"b", b"c")] == [True, True, False]
    for i in range(12):  # MAX_SEEN shapes met once: the templates are refreshed
        enc.encode(b"once-%d" % i, b"k", b"v", 5)
    assert enc.template_of(b"p", b"k", 1) is None
    # plain or template, the bytes are the codec's
    for frame in frames:
        msg = decode_message(frame)
        assert frame == encode_message(b"p", b"k", b"v", 5, 0, msg.uid)
