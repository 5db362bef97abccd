"""The examples in schema/README.md are what the codec produces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import xxhash

from broky import errors
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import Message, decode_frame, encode_message, vbucket_of
from tests.test_protocol_generated import generated_read

DOC = (Path(__file__).resolve().parent.parent / "schema" / "README.md").read_text()


def test_hex_dump_is_the_canonical_encoding() -> None:
    rows = re.findall(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} ){0,15}[0-9a-f]{2})", DOC, re.MULTILINE)
    assert rows, "no hex dump found in schema/README.md"
    dump = b"".join(bytes.fromhex(hexes) for _, hexes in rows)
    assert [int(offset, 16) for offset, _ in rows] == list(range(0, len(dump), 16))
    uid = bytes.fromhex("11e1a300" + "0123456789abcdef" * 2)
    stamped = (1_700_000_000_000_250_000, uid, 828, 0x5EED5EED5EED5EED, 42)
    msg = Message(b"t1", b"orders.eu", b"hello", 1_700_000_000_000_000_000, *stamped)
    assert dump == encode_message(*msg)
    assert generated_read(dump) == msg == decode_frame(dump)
    assert vbucket_of(b"t1") == msg.vbucket
    published = encode_message(b"t1", b"orders.eu", b"hello", msg.ts_producer, 0, uid)
    assert published == dump[:64] + bytes(32) + dump[96:]  # the publish: zeros where it is stamped
    assert len(encode_message(b"t1", b"orders.eu", b"hello")) == 144


def test_vbucket_example() -> None:
    assert "`t1` → 0xc03234fac12ac33c → vbucket 828" in DOC
    assert vbucket_of(b"t1") == 828


@pytest.mark.parametrize(
    "kp", [b"", b"t1", b"customer-42", "kéy-ü☃".encode(), b"x" * 100, bytes(range(256)) * 4]
)
def test_xxh3_table(kp: bytes) -> None:
    """Each row of §6's table: the length, the hash and the vbucket of its key_partition."""
    digest = xxhash.xxh3_64_intdigest(kp)
    assert f"| {len(kp)} | {digest:#018x} | {vbucket_of(kp)} |" in DOC
    assert digest % 1024 == vbucket_of(kp)


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        (b"a.b", [b"a.b"], [b"a.b.c", b"a"]),
        (b"a.*", [b"a.b", b"a."], [b"a", b"a.b.c"]),
        (b"a.>", [b"a.b", b"a.b.c"], [b"a"]),
        (b"*.*.>", [b"a.b.c", b"a.b.c.d"], [b"a.b"]),
    ],
)
def test_pattern_table(pattern: bytes, matching: list[bytes], not_matching: list[bytes]) -> None:
    row = f"| `{pattern.decode()}` "
    assert row in DOC
    tokens = parse_pattern(pattern)
    assert all(pattern_matches(tokens, k) for k in matching)
    assert not any(pattern_matches(tokens, k) for k in not_matching)


def test_protocol_error_table_matches_the_classes() -> None:
    rows = re.findall(
        r"^\| `(\w+Error)` \| (?:([A-Z_]+) \((\d+)\)|as given) \| (ours|the peer's)", DOC, re.MULTILINE
    )
    assert len(rows) == 8, rows
    for name, code_name, code, whose in rows:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ProtocolError)
        side = errors.LocalProtocolError if whose == "ours" else errors.RemoteProtocolError
        assert issubclass(cls, side), name
        if code_name:
            assert cls.code == errors.ErrorCode[code_name] == int(code), name
