from collections.abc import Sequence as Columns
from typing import Any

VERSION: int

class Sequence:
    start: int
    until: int
    next: int
    pre: bytes

class LinkState:
    proto: Any
    out: list[bytes]
    out_bytes: int
    flush_handle: Any

class FastPath:
    batch_size: int
    def __init__(self, fast: dict[Any, Any], seq: Sequence, batch_size: int, /) -> None: ...
    def publish(self, key_partition: Any, key: Any, payload: Any, ts_producer: Any, /) -> Any: ...

def configure(layout: object, /) -> None: ...
def layout() -> dict[str, Any] | None: ...
def encode(key_partition: bytes, key: bytes, payload: bytes, ts_producer: int, uid: bytes, /) -> bytes: ...
def stamp(sample: bytes, payload: Any, ts_producer: Any, seq: Sequence, out: list[bytes] = ..., /) -> Any: ...
def pack_rows(
    key_partitions: Columns[Any],
    keys: Columns[Any],
    payloads: Columns[Any],
    ts_producers: Columns[Any] | None,
    start: int,
    slots: dict[Any, int],
    outs: list[list[bytes]],
    added: list[int],
    counts: list[int],
    room: list[int],
    part: int,
    max_frame: int,
    seq: Sequence,
    uid_prefix: bytes | None,
    uid_base: int,
    /,
) -> tuple[int, int]: ...
