"""CPU time and peak memory of processes, read from /proc (Linux only).

CPU is utime + stime of /proc/<pid>/stat, which covers every thread of the
process (nats-server's goroutine threads, Broky's worker processes are
separate pids and are summed by the caller). Peak RSS is VmHWM of
/proc/<pid>/status; writing "5" to /proc/<pid>/clear_refs resets it, so each
scenario can report its own peak.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process in seconds (0.0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # the command name (field 2) may hold spaces; fields after ")" are fixed
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def total_cpu_seconds(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def peak_rss_bytes(pid: int) -> int:
    """VmHWM (peak resident set size) of one process in bytes (0 if unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS; False if the kernel refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def children(pid: int) -> list[int]:
    """Pids of the live child processes of pid (children of any of its threads)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out.extend(int(p) for p in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return sorted(set(out))
