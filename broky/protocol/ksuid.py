"""KSUIDs: 20-byte, time-ordered unique ids and their 27-character base62 text.

Layout: 4-byte big-endian seconds since 1400000000 (2014-05-13T16:53:20Z),
then 16 random bytes. The text form is the 160-bit big-endian integer in
base62 (0-9, A-Z, a-z), left-padded with '0' to 27 characters, so text order
equals byte order.

`new_ksuid` fills the 16 bytes with random bytes (from os.urandom, drawn in
blocks). `KsuidSequence`, used by the client's publish fast path, is cheaper:
per second it draws a fresh random 8-byte seed and a random 63-bit counter
start, and its ids are the 4-byte time, the seed, then the counter as 8
little-endian bytes, incremented by one per id (segmentio/ksuid's Sequence
idea, with a wider counter). Ids stay unique: within a sequence and a second
the counter never repeats (it cannot wrap: it starts below 2**63); a new second
or a clock going back means a new seed; a forked child reseeds before its next
id; distinct processes and sequences have independent 128-bit random seeds.
The 16 bytes are not unpredictable (ids from one second share their seed):
do not use them as secrets.
"""

from __future__ import annotations

import os
import time
import weakref

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


_NS = 1_000_000_000
_sequences: weakref.WeakSet[KsuidSequence] = weakref.WeakSet()


class KsuidSequence:
    """Cheap unique KSUIDs, in two parts: 12 bytes `pre`, then `next` as 8 little-endian bytes.

    Use (as the client does, inlined)::

        if not seq.start <= ts < seq.until:  # ts = time.time_ns()
            seq.roll(ts)
        n = seq.next
        seq.next = n + 1
        uid = seq.pre + n.to_bytes(8, "little")

    `pre` is the 4-byte big-endian time (seconds since EPOCH) of the second
    [start, until) in nanoseconds, then a random 8-byte seed; `next` starts
    at a random value below 2**63. Not thread-safe: one per encoder.
    """

    __slots__ = ("__weakref__", "next", "pre", "start", "until")

    def __init__(self) -> None:
        self.start = 0
        self.until = 0  # nothing valid yet: the first id rolls
        self.pre = b""
        self.next = 0
        _sequences.add(self)

    def roll(self, ts: int) -> None:
        """Start the second of `ts` (ns since the Unix epoch) with a fresh seed and counter."""
        second = ts // _NS
        seconds = second - EPOCH
        if not 0 <= seconds < 1 << 32:
            raise ValueError(f"time {second} is outside the KSUID range")
        seed = os.urandom(16)
        self.pre = seconds.to_bytes(4, "big") + seed[:8]
        self.next = int.from_bytes(seed[8:], "little") >> 1
        self.start = second * _NS
        self.until = self.start + _NS

    def new(self, ts: int | None = None) -> bytes:
        """A new 20-byte KSUID for the time `ts` in ns (default: now)."""
        ts = time.time_ns() if ts is None else ts
        if not self.start <= ts < self.until:
            self.roll(ts)
        n = self.next
        self.next = n + 1
        return self.pre + n.to_bytes(8, "little")


def _reset_sequences() -> None:
    # A forked child must not continue its parent's sequences: force a reseed.
    for seq in list(_sequences):
        seq.start = seq.until = 0


os.register_at_fork(after_in_child=_reset_sequences)


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


_PAIRS = [a + b for a in ALPHABET for b in ALPHABET]  # 62 * 62 two-digit strings, by value


def ksuid_text(uid: bytes) -> str:
    """Return the 27-character base62 text of a 20-byte KSUID."""
    if len(uid) != SIZE:
        raise ValueError(f"a KSUID has {SIZE} bytes, got {len(uid)}")
    n = int.from_bytes(uid, "big")
    out = []
    while n:  # two digits at a time: half the divisions of big ints (the Spark source's uid column)
        n, r = divmod(n, 3844)
        out.append(_PAIRS[r])
    return "".join(reversed(out)).rjust(TEXT_SIZE + 1, "0")[-TEXT_SIZE:]


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
