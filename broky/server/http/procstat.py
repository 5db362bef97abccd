"""What each process of the server uses, as Prometheus' standard process metrics name it.

Theory of operation
-------------------
The master reads, at scrape time, /proc/<pid>/stat, /proc/<pid>/fd and
/proc/<pid>/limits of itself and of each live worker (one user owns them all,
so nothing has to be asked of the workers, and a hung worker is still
measured), as Prometheus' client libraries read their own process:

    process_cpu_seconds_total       user + system CPU time
    process_resident_memory_bytes   resident set size
    process_virtual_memory_bytes    virtual memory size
    process_open_fds                open file descriptors
    process_max_fds                 the soft limit of open file descriptors (none: unlimited)
    process_start_time_seconds      start time, seconds since the epoch

broky.server.http.metrics labels each series with the process, as the JSON log
does (`process="master"`, `process="worker-0"`, ...): one scrape target is
several processes. Where /proc is not there (not Linux), a process has no
figures, and its series are left out. A read costs a few file reads per
process (about 0.1 ms).
"""

from __future__ import annotations

import os
from typing import Any

_boot_time: float | None = None


def _boot() -> float:
    """Seconds since the epoch at which the machine booted (/proc/stat btime), read once."""
    global _boot_time
    if _boot_time is None:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    _boot_time = float(line.split()[1])
                    break
            else:
                raise OSError("no btime in /proc/stat")
    return _boot_time


def read(pid: int) -> dict[str, Any] | None:
    """The figures of process `pid` (see the theory of operation), or None: no such process,
    or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        max_fds = _max_fds(pid)
        boot = _boot()
    except (OSError, ValueError):
        return None
    # After the command's closing parenthesis (it may hold spaces and parentheses): field 3 on.
    fields = text[text.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "cpu_seconds": (int(fields[11]) + int(fields[12])) / ticks,  # utime, stime (fields 14, 15)
        "resident_bytes": int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),  # rss (24), in pages
        "virtual_bytes": int(fields[20]),  # vsize (23)
        "open_fds": fds,
        "max_fds": max_fds,
        "start_time_seconds": boot + int(fields[19]) / ticks,  # starttime (22), ticks after boot
    }


def _max_fds(pid: int) -> int | None:
    """The soft limit of open files (None: unlimited)."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
    raise ValueError("no 'Max open files' in limits")
