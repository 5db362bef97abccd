"""The examples in schema/README.md are what the codec produces."""

from __future__ import annotations

import re
import struct

import pytest
import xxhash

from broky import errors
from broky.fbs import Body
from broky.matching import parse_pattern, pattern_matches
from broky.protocol import (
    Ack,
    AckKind,
    Delivery,
    GroupEvent,
    GroupNotice,
    LossReason,
    Message,
    NodeInfo,
    Position,
    Subscribe,
    VBucketMap,
    decode_frame,
    encode_frame,
    encode_message,
    vbucket_of,
)
from tests.support.generated import generated_read
from tests.support.paths import ROOT

SCHEMA = ROOT / "schema"
DOC = (SCHEMA / "README.md").read_text()
FBS = (SCHEMA / "broky.fbs").read_text()
SCALARS = {"bool", "byte", "ubyte", "short", "ushort", "int", "uint", "long", "ulong", "float", "double"}


def hex_dumps() -> list[bytes]:
    """The hex dumps of the document, one per fenced block, each checked to count its rows from 0."""
    dumps = []
    for block in re.findall(r"^```\n(.*?)^```", DOC, re.MULTILINE | re.DOTALL):
        rows = re.findall(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} ){0,15}[0-9a-f]{2})", block, re.MULTILINE)
        if rows:
            dump = b"".join(bytes.fromhex(hexes) for _, hexes in rows)
            assert [int(offset, 16) for offset, _ in rows] == list(range(0, len(dump), 16))
            dumps.append(dump)
    return dumps


def test_the_document_has_its_three_hex_dumps() -> None:
    # §4.1's Message, then §5.4's Delivery and Ack: a new dump needs its own test.
    assert len(hex_dumps()) == 3


def test_hex_dump_is_the_canonical_encoding() -> None:
    dump = hex_dumps()[0]
    uid = bytes.fromhex("11e1a300" + "0123456789abcdef" * 2)
    stamped = (1_700_000_000_000_250_000, uid, 828, 0x5EED5EED5EED5EED, 42)
    msg = Message(b"t1", b"orders.eu", b"hello", 1_700_000_000_000_000_000, *stamped)
    assert dump == encode_message(*msg)
    assert generated_read(dump) == msg == decode_frame(dump)
    assert vbucket_of(b"t1") == msg.vbucket
    published = encode_message(b"t1", b"orders.eu", b"hello", msg.ts_producer, 0, uid)
    assert published == dump[:64] + bytes(32) + dump[96:]  # the publish: zeros where it is stamped
    assert len(encode_message(b"t1", b"orders.eu", b"hello")) == 144


def test_the_group_example_frames_are_what_the_codec_writes() -> None:
    # §5.4's example: the redelivery's Delivery, and the NACK before it, of §4.1's message.
    _, delivery, nack = hex_dumps()
    assert delivery == encode_frame(Delivery(1, 1, 2))
    assert generated_read(delivery) == decode_frame(delivery) == Delivery(sid=1, messages=1, attempt=2)
    at = Position(828, 0x5EED5EED5EED5EED, 42)
    assert nack == encode_frame(Ack(1, AckKind.NACK, (at,), 500))
    assert generated_read(nack) == decode_frame(nack) == Ack(1, AckKind.NACK, (at,), delay_ms=500)
    # The sizes the annotations give.
    assert struct.unpack_from("<I", delivery)[0] == len(delivery) - 4 == 52
    assert struct.unpack_from("<I", nack)[0] == len(nack) - 4 == 92
    example = DOC[DOC.index("**Example.** A client on worker 1 joins group") :]
    assert "C: Ack         { sid: 1, kind: NACK, positions: [(828, E, 42)], delay_ms: 500 }" in example
    assert "S: Delivery    { sid: 1, messages: 1, attempt: 2 }" in example
    assert vbucket_of(b"t1") == 828 and vbucket_of(b"customer-42") == 609
    vmap = VBucketMap.single_node(NodeInfo("n", "h", 4777, 2))
    assert vmap.owners[828] == vmap.owners[609] == (0, 1)  # both on worker 1 of a two-worker node


def test_the_frame_table_names_every_body_type() -> None:
    rows = re.findall(r"^\| (\d+) +\| (\w+) +\| (client|server|both) +\|", DOC, re.MULTILINE)
    union = {name: value for name, value in vars(Body).items() if type(value) is int and name != "NONE"}
    assert {name: int(value) for value, name, _ in rows} == union
    last = max(union.values())
    assert f"A body type above {last} is UNKNOWN_FRAME" in DOC
    assert "`Delivery { sid: uint, messages: uint, attempt: uint }`" in DOC
    assert "`Ack { sid: uint, kind: AckKind, positions: [Position], delay_ms: int = -1 }`" in DOC
    assert "`GroupNotice { sid: uint, event: GroupEvent, messages: ulong, vbucket: ushort }`" in DOC
    assert Delivery._fields == ("sid", "messages", "attempt")
    assert Ack._fields == ("sid", "kind", "positions", "delay_ms")
    assert GroupNotice._fields == ("sid", "event", "messages", "vbucket")


def schema_fields() -> dict[str, list[str]]:
    """Every table's and struct's fields, in their order in broky.fbs."""
    return {
        name: re.findall(r"^\s+(\w+):", body, re.MULTILINE)
        for name, body in re.findall(
            r"^(?:table|struct) (\w+) \{(\}|\n.*?^\})", FBS, re.MULTILINE | re.DOTALL
        )
    }


def test_every_signature_in_the_document_is_the_whole_table() -> None:
    # `Name { field: type, ... }` written with types lists every field of that table or
    # struct, in the schema's order: an outside client is written from these lines (the
    # VBucketMap line once left `incoming` out). Lines with values are examples: skipped.
    fields = schema_fields()
    types = set(fields) | set(re.findall(r"^(?:enum|union) (\w+)", FBS, re.MULTILINE)) | SCALARS | {"string"}
    checked = set()
    for name, inner in re.findall(r"\b([A-Z]\w*) \{ ([^{}`]*?);? \}", DOC):
        if name not in fields:
            continue
        entries = [
            re.fullmatch(r"(\w+): \[?(\w+)\]?(?: \(required\)| = -?\d+)?", e.strip())
            for e in re.split(r"[,;]", inner)
        ]
        if not all(e is not None and e.group(2) in types for e in entries):
            continue
        assert [e.group(1) for e in entries if e] == fields[name], name
        checked.add(name)
    assert checked >= {
        "Frame", "PreviousConnection", "Resumed", "VBucketMap", "Node", "VBucketOwner", "Position",
        "Delivery", "Ack", "GroupNotice", "MapUpdate", "MapApplied", "Ping", "LossNotice", "Error",
    }  # fmt: skip


def test_the_error_table_names_every_error_code() -> None:
    rows = re.findall(r"^\| (\d+) +\| ([A-Z_]+) +\| (yes|no) +\|", DOC, re.MULTILINE)
    assert {name: int(code) for code, name, _ in rows} == {e.name: int(e) for e in errors.ErrorCode if e}


def test_the_loss_reasons_are_listed_with_their_values() -> None:
    text = DOC[DOC.index("`LossReason`: 0 UNKNOWN") :]
    text = text[: text.index("A client treats a")]
    listed = dict(re.findall(r"(\d+)\s+([A-Z_]+)", text))
    assert {int(v): name.lower() for v, name in listed.items()} == LossReason.NAMES


def test_the_subscribe_table_names_every_field() -> None:
    section = DOC[DOC.index("### Subscribe / Unsubscribe") : DOC.index("### Key patterns")]
    named = re.findall(r"^\| (?:Subscribe)? +\| (\w+) +\|", section, re.MULTILINE)
    assert named[: len(Subscribe._fields)] == list(Subscribe._fields)


def test_the_ack_kinds_and_group_events_are_given_their_values() -> None:
    for name, value in (("ACK", 0), ("NACK", 1), ("IN_PROGRESS", 2)):
        assert getattr(AckKind, name) == value
        assert f"| {name} | {value} |" in DOC
    for name, value in (("PAUSED", 0), ("RESUMED", 1), ("DRAIN_EXPIRED", 2)):
        assert getattr(GroupEvent, name) == value
        assert f"{name} ({value})" in DOC


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
    assert len(rows) == 9, rows
    for name, code_name, code, whose in rows:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ProtocolError)
        side = errors.LocalProtocolError if whose == "ours" else errors.RemoteProtocolError
        assert issubclass(cls, side), name
        if code_name:
            assert cls.code == errors.ErrorCode[code_name] == int(code), name
