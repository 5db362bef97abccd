"""The canonical Message layout has one owner, broky.protocol.layout.

Its writer's and reader's views (`shape`, `read_shape`) agree with the
encoder; `struct_at` builds the formats the readers use.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broky.protocol import encode_message
from broky.protocol.layout import (
    HEADER_AT,
    HEADER_END,
    HEADER_NO_UID,
    HEADER_UID,
    KEY_UOFFSET_AT,
    PAYLOAD_UOFFSET_AT,
    TS_BROKER_AT,
    TS_PRODUCER_AT,
    UID_AT,
    UID_END,
    VECTORS_AT,
    read_shape,
    shape,
    struct_at,
)

lengths = st.integers(0, 300)


@settings(max_examples=300, deadline=None)
@given(has_uid=st.booleans(), kp_len=lengths, key_len=lengths, pay_len=lengths)
def test_shape_is_where_the_encoder_puts_the_vectors(
    has_uid: bool, kp_len: int, key_len: int, pay_len: int
) -> None:
    kp, key, payload = b"k" * kp_len, b"e" * key_len, b"p" * pay_len
    frame = encode_message(kp, key, payload, 1, 2, bytes(range(20)) if has_uid else None)
    v = shape(has_uid, kp_len, key_len, pay_len)
    assert v.frame_len == len(frame) and v.frame_len % 8 == 0
    assert frame[HEADER_AT:HEADER_END] == (HEADER_UID if has_uid else HEADER_NO_UID)
    assert struct.unpack_from("<qq", frame, TS_PRODUCER_AT) == (1, 2)
    assert struct.unpack_from("<q", frame, TS_BROKER_AT) == (2,)
    if has_uid:
        assert frame[UID_AT:UID_END] == bytes(range(20))
    for at, vector in ((v.kp_at, kp), (v.key_at, key), (v.payload_at, payload)):
        assert struct.unpack_from("<I", frame, at) == (len(vector),)
        assert frame[at + 4 : at + 4 + len(vector)] == vector
    key_uoffset, payload_uoffset = struct.unpack_from("<II", frame, KEY_UOFFSET_AT)
    assert read_shape(has_uid, len(frame) - 4, key_uoffset, payload_uoffset, kp_len) == v


def test_read_shape_refuses_vectors_out_of_order_or_outside_the_frame() -> None:
    v = shape(True, 2, 3, 5)
    key_uoffset, payload_uoffset = v.key_at - KEY_UOFFSET_AT, v.payload_at - PAYLOAD_UOFFSET_AT
    size = v.frame_len - 4
    assert read_shape(True, size, key_uoffset, payload_uoffset, 2) == v
    assert read_shape(True, size, key_uoffset + 4, payload_uoffset, 2) is None  # key not after key_partition
    assert read_shape(True, size, key_uoffset, payload_uoffset, 7) is None  # key_partition runs into it
    assert read_shape(False, size, key_uoffset, payload_uoffset, 2) is None  # vectors start elsewhere
    assert read_shape(True, size, key_uoffset, v.key_at - PAYLOAD_UOFFSET_AT, 2) is None  # payload on the key
    assert read_shape(True, v.payload_at - 4 + 3, key_uoffset, payload_uoffset, 2) is None  # past the end
    assert read_shape(True, v.payload_at, key_uoffset, payload_uoffset, 2) is not None  # just inside


def test_struct_at_fills_the_gaps_and_refuses_overlaps() -> None:
    assert struct_at((4, "I"), (12, "q"), start=4, end=24).format == "<I4xq4x"
    assert struct_at(
        (0, "I"), (HEADER_AT, "52s"), (KEY_UOFFSET_AT, "II"), (VECTORS_AT[True], "I")
    ).format == ("<I52s16xII20xI")
    with pytest.raises(ValueError, match="overlaps"):
        struct_at((0, "q"), (4, "I"))
    with pytest.raises(ValueError, match="past the end"):
        struct_at((0, "q"), end=4)
