"""Give the heap that freed objects left behind back to the operating system.

CPython allocates objects over 512 bytes (a subscription's pattern, its trie
tokens, large dict tables) with the C library's malloc. glibc returns freed
memory to the OS only from the top of its heap, so after a connection's many
subscriptions are freed, the heap's free pages below live objects stay
resident: a worker flooded with 50,000 subscriptions of 4 KB went from 44 MB
to 490 MB, and was still at 100-290 MB after the connection closed.
`malloc_trim(0)` releases every whole free page of the heap (madvise), which
brought it back to about its baseline. Where there is no glibc (musl, macOS)
`trim` does nothing and says so. ctypes is loaded at the first trim, not
before: an idle worker does not keep it (0.4 MB). `rss_bytes` tells what the
process has resident, for the trim's log line and the worker's snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def _load() -> Callable[[int], int] | None:
    import ctypes

    try:
        fn = ctypes.CDLL(None).malloc_trim  # the C library already linked into the interpreter
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim: Callable[[int], int] | None = None
_loaded = False


def trim() -> bool:
    """Call malloc_trim(0); False if this C library has none."""
    global _malloc_trim, _loaded
    if not _loaded:
        _malloc_trim, _loaded = _load(), True
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def rss_bytes() -> int:
    """The resident set size of this process (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
