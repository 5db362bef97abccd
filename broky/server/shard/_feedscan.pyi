from typing import Any

VERSION: int

def configure(layout: object, min_frame_size: int, /) -> None: ...
def layout() -> dict[str, Any] | None: ...
def scan(
    data: bytes,
    pos: int,
    buf: bytearray | None,
    t0: int,
    routes: dict[Any, Any],
    max_frame: int,
    runs: list[Any],
    seqs: bytearray,
    log: bytearray | None,
    index: list[bytearray] | None,
    seg: int,
    /,
) -> tuple[int, bytearray | None, int, int]: ...
def settle(log: bytearray, index: list[bytearray], /) -> None: ...
def gather(entries: bytes, segments: dict[int, Any], room: int, first: bool, /) -> tuple[bytes, int]: ...
def note(
    buf: bytearray, start: int, end: int, owed: dict[int, list[list[int]]], epochs: dict[int, int], /
) -> None: ...
