"""KSUIDs: 20-byte, time-ordered unique ids and their 27-character base62 text.

Layout: 4-byte big-endian seconds since 1400000000 (2014-05-13T16:53:20Z),
then 16 random bytes. The text form is the 160-bit big-endian integer in
base62 (0-9, A-Z, a-z), left-padded with '0' to 27 characters, so text order
equals byte order.
"""

from __future__ import annotations

import os
import time

EPOCH = 1_400_000_000
SIZE = 20
TEXT_SIZE = 27
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(ALPHABET)}
_MAX = (1 << 160) - 1

# Random bytes come from os.urandom in blocks: one syscall per 4096 ids.
_POOL_IDS = 4096
_pool = b""
_pool_pos = 0


def _reset_pool() -> None:
    # A forked child must not replay its parent's random bytes.
    global _pool, _pool_pos
    _pool, _pool_pos = b"", 0


os.register_at_fork(after_in_child=_reset_pool)


def new_ksuid(now: float | None = None) -> bytes:
    """Return a new 20-byte KSUID for the time `now` (default: the current time)."""
    global _pool, _pool_pos
    seconds = int(time.time() if now is None else now) - EPOCH
    if not 0 <= seconds < 1 << 32:
        raise ValueError(f"time {now} is outside the KSUID range")
    pos = _pool_pos
    if pos >= len(_pool):
        _pool = os.urandom(16 * _POOL_IDS)
        pos = 0
    _pool_pos = pos + 16
    return seconds.to_bytes(4, "big") + _pool[pos : pos + 16]


def ksuid_text(uid: bytes) -> str:
    """Return the 27-character base62 text of a 20-byte KSUID."""
    if len(uid) != SIZE:
        raise ValueError(f"a KSUID has {SIZE} bytes, got {len(uid)}")
    n = int.from_bytes(uid, "big")
    out = []
    while n:
        n, r = divmod(n, 62)
        out.append(ALPHABET[r])
    return "".join(reversed(out)).rjust(TEXT_SIZE, "0")


def parse_ksuid(text: str) -> bytes:
    """Return the 20 bytes of a KSUID given its 27-character base62 text."""
    if len(text) != TEXT_SIZE:
        raise ValueError(f"KSUID text has {TEXT_SIZE} characters, got {len(text)}")
    n = 0
    for c in text:
        try:
            n = n * 62 + _INDEX[c]
        except KeyError:
            raise ValueError(f"{c!r} is not a base62 character") from None
    if n > _MAX:
        raise ValueError("KSUID text out of range")
    return n.to_bytes(SIZE, "big")


def ksuid_time(uid: bytes) -> int:
    """Return the Unix time, in seconds, stored in a KSUID."""
    return int.from_bytes(uid[:4], "big") + EPOCH
