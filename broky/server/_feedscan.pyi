from typing import Any

VERSION: int

def configure(
    header_uid: bytes, header_no_uid: bytes, ts_broker_offset: int, min_frame_size: int, /
) -> None: ...
def scan(
    data: bytes,
    pos: int,
    buf: bytearray | None,
    t0: int,
    routes: dict[Any, Any],
    max_frame: int,
    runs: list[Any],
    /,
) -> tuple[int, bytearray | None, int, int]: ...
