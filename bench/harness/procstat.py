"""CPU time and peak memory of processes, read from /proc (Linux only).

CPU is utime + stime of /proc/<pid>/stat, which covers every thread of the
process (nats-server's goroutine threads, Broky's worker processes are
separate pids and are summed by the caller), counted in clock ticks (10 ms);
`exact_cpu_seconds` reads the scheduler's own count instead (the first field
of /proc/<pid>/task/*/schedstat, in ns), for runs that last a few seconds
and compare a few percent. Peak RSS is VmHWM of /proc/<pid>/status; writing
"5" to /proc/<pid>/clear_refs resets it, so each scenario can report its own
peak. `machine_cpu` reads /proc/stat: how busy the whole machine was (other
users of a shared machine included).
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


def system_cpu_seconds(pid: int) -> float:
    """stime of one process in seconds: the part of `cpu_seconds` spent in the kernel
    (system calls, page faults), in clock ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    return int(stat[stat.rindex(")") + 2 :].split()[12]) / CLOCK_TICKS


def minor_faults(pid: int) -> int:
    """Minor page faults of one process so far (memory it touched for the first time, or
    the kernel had taken back): minflt of /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[7])


def exact_cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of one process, in seconds, to the nanosecond from
    the scheduler (/proc/<pid>/task/*/schedstat); `cpu_seconds` where the kernel has no
    schedstat. Threads that ended are not counted: read it while the process runs."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    total = 0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        except (OSError, ValueError, IndexError):
            return cpu_seconds(pid)
    return total / 1e9


def total_exact_cpu_seconds(pids: Iterable[int]) -> float:
    return sum(exact_cpu_seconds(pid) for pid in pids)


def machine_cpu() -> tuple[float, float, float]:
    """Since boot, summed over every CPU: (busy seconds, all seconds, steal seconds), from
    the first line of /proc/stat (busy: the time processes ran, user and system; not the
    interrupts, which the kernel does not charge to any process; steal: time the hypervisor
    gave this VM's CPUs to others)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0, 0.0
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = fields
    busy = user + nice + system
    return busy / CLOCK_TICKS, sum(fields) / CLOCK_TICKS, steal / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """VmRSS (resident set size now) of one process in bytes (0 if unknown)."""
    return _status_kb(pid, "VmRSS:") * 1024


def pss_bytes(pid: int) -> int:
    """Pss of /proc/<pid>/smaps_rollup (shared pages divided among their users), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


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
