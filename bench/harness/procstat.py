"""CPU time and peak memory of processes, read from /proc (Linux only).

CPU is utime + stime of /proc/<pid>/stat, which covers every thread of the
process (nats-server's goroutine threads, Broky's worker processes are
separate pids and are summed by the caller), counted in clock ticks (10 ms);
`exact_cpu_seconds` reads the scheduler's own count instead (the first field
of /proc/<pid>/task/*/schedstat, in ns), for runs that last a few seconds
and compare a few percent. Peak RSS is VmHWM of /proc/<pid>/status; writing
"5" to /proc/<pid>/clear_refs resets it, so each scenario can report its own
peak. `machine_cpu` reads /proc/stat: how busy the whole machine was (other
users of a shared machine included), `busy_share` between two readings.
`own_cpu_seconds` and `children_cpu_seconds` are the calling process's own
(getrusage), for a role process that reports its CPU (bench/harness/roles.py).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat from the state on (field 3; None if it is gone): the
    command name (field 2) may hold spaces, the fields after its ")" are fixed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process in seconds (0.0 if it is gone)."""
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def total_cpu_seconds(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def system_cpu_seconds(pid: int) -> float:
    """stime of one process in seconds: the part of `cpu_seconds` spent in the kernel
    (system calls, page faults), in clock ticks."""
    fields = _stat(pid)
    return 0.0 if fields is None else int(fields[12]) / CLOCK_TICKS


def minor_faults(pid: int) -> int:
    """Minor page faults of one process so far (memory it touched for the first time, or
    the kernel had taken back): minflt of /proc/<pid>/stat."""
    fields = _stat(pid)
    return 0 if fields is None else int(fields[7])


def tree_cpu_seconds(pid: int) -> float:
    """CPU of `pid` and all its descendants: the live ones' own, and what each reaped of
    its children that ended (cutime, cstime)."""
    todo, total, seen = [pid], 0.0, set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        fields = _stat(p)
        if fields is None:
            continue
        total += sum(int(f) for f in fields[11:15]) / CLOCK_TICKS
        todo.extend(children(p))
    return total


def own_cpu_seconds() -> float:
    """User + system CPU of the calling process so far (getrusage: every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_seconds() -> float:
    """User + system CPU of the calling process's children that ended and were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of one process's main thread so far."""
    fields = ("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")
    return sum(_status_kb(pid, field) for field in fields)


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


def busy_share(before: tuple[float, float, float], after: tuple[float, float, float]) -> float | None:
    """The share of the machine's CPU time that was busy between two `machine_cpu()`
    readings (None if no time passed)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def rss_bytes(pid: int) -> int:
    """VmRSS (resident set size now) of one process in bytes (0 if unknown)."""
    return _status_kb(pid, "VmRSS:") * 1024


def total_rss_bytes(pids: Iterable[int]) -> int:
    return sum(rss_bytes(pid) for pid in pids)


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
    """The number after `field` in /proc/<pid>/status (kB for sizes; 0 if unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_bytes(pid: int) -> int:
    """VmHWM (peak resident set size) of one process in bytes (0 if unknown)."""
    return _status_kb(pid, "VmHWM:") * 1024


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


class RssSampler(threading.Thread):
    """The summed RSS of `pids()` every `every` seconds, in a thread, from `start()` to
    `stop()`: the peak, and every sample as (seconds since the start, bytes)."""

    def __init__(self, pids: Callable[[], Iterable[int]], every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self._done.wait(self.every):
            rss = total_rss_bytes(self.pids())
            self.peak = max(self.peak, rss)
            self.samples.append((round(time.monotonic() - start, 1), rss))

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(10)


class CpuSampler(threading.Thread):
    """Every `every` seconds, in a thread, each of `pids`' CPU share of one core since the
    last sample (`shares`, a list per pid; nothing once a process is gone)."""

    def __init__(self, pids: list[int], every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.shares: list[list[float]] = [[] for _ in pids]
        self._done = threading.Event()

    def run(self) -> None:
        last = [cpu_seconds(pid) for pid in self.pids]
        t = time.monotonic()
        while not self._done.wait(self.every):
            now = time.monotonic()
            cpu = [cpu_seconds(pid) for pid in self.pids]
            for i, (a, b) in enumerate(zip(last, cpu, strict=True)):
                if b:  # (0.0: the process is gone)
                    self.shares[i].append(round((b - a) / (now - t), 3))
            last, t = cpu, now

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(10)
