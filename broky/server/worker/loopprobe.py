"""A debug probe: how long each of the worker's own jobs holds its event loop.

Set BROKY_LOOP_PROBE=PREFIX in the environment of `broky serve` and every
worker times, with `time.perf_counter_ns`, each call of the jobs below, and
writes what it saw to PREFIX-worker-N.json when it stops (SIGTERM). Without
the variable nothing here is imported: the worker checks it once, at start
(broky.server.worker.process `main`). bench/tail_sources.py drives it; its figures
are in bench/README.md, "Tail sources".

What is timed (the probe wraps these methods on their classes, and a
function where the shard's core calls it, in this process only):
  read            Shard.feed: one socket read, from its arrival to its writes
  gc0, gc1, gc2   the cyclic garbage collector, by generation (gc.callbacks)
  accounts_commit AccountBook.commit_read: a read's counters to the accounts (inside read)
  flush           Shard.flush: a read's writes, one per touched connection (inside read)
  tick            Shard.tick: the periodic sweep (broky.server.shard.core)
  accounts_expire AccountBook.expire (every tick)
  replay_expire   ReplayBuffer.expire (inside tick)
  replay_trim     ReplayBuffer.trim_all (inside tick, before it was spread: a scrape now)
  replay_trim_some ReplayBuffer.trim_some (inside tick)
  replay_settle   ReplayBuffer.settle: the log into the indexes (in trim_some, lookups, a full log)
  heap_trim       budget_enforcement.trim_heap, as the core calls it (inside tick, when due)
  control         Worker._on_channel: messages from the master
  bounded_read    Positions.bounded_read: a Read frame and its first batch
  read_batch      Positions.continue_read: a later batch of a bounded read
Each is reported as count, total, p50, p99 and max of the wall time, and p99
and max of the thread's CPU time (a job the kernel preempted takes longer
than its CPU time), in microseconds; the collector also says what each
generation collected, and when each older generation ran.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import time
from array import array
from collections.abc import Callable
from typing import Any

ENV = "BROKY_LOOP_PROBE"
MOST = 2_000_000  # durations kept per job (16 MB at most): enough for minutes of reads

_clock = time.perf_counter_ns
_cpu = time.thread_time_ns


class Probe:
    def __init__(self, path: str) -> None:
        self.path = path
        self.times: dict[str, array[int]] = {}
        self.cpu: dict[str, array[int]] = {}
        self.collected = [0, 0, 0]
        self.gc_at: list[tuple[float, int, float]] = []  # (seconds since start, generation, us)
        self.started = _clock()
        self._gc_started = self._gc_cpu = 0
        self.full_us = 0.0

    def add(self, name: str, ns: int, cpu_ns: int) -> None:
        got = self.times.get(name)
        if got is None:
            got = self.times[name] = array("q")
            self.cpu[name] = array("q")
        if len(got) < MOST:
            got.append(ns)
            self.cpu[name].append(cpu_ns)

    def wrap(self, owner: object, method: str, name: str) -> None:
        """Time every call of `owner`'s attribute `method` (a class's method, or a
        module's function as that module calls it)."""
        inner: Callable[..., Any] = getattr(owner, method)
        add = self.add

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = _clock()
            c = _cpu()
            try:
                return inner(*args, **kwargs)
            finally:
                add(name, _clock() - t, _cpu() - c)

        setattr(owner, method, timed)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = _clock()
            self._gc_cpu = _cpu()
        else:
            generation = info["generation"]
            took = _clock() - self._gc_started
            self.add(f"gc{generation}", took, _cpu() - self._gc_cpu)
            self.collected[generation] += info["collected"]
            if generation:
                self.gc_at.append((round((self._gc_started - self.started) / 1e9, 3), generation, took / 1e3))

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "gc_collected": self.collected,
            "gc_older": self.gc_at,
            "gc_objects": len(gc.get_objects()),
            "gc_frozen": gc.get_freeze_count(),
            "gc_full_us": self.full_us,
            "jobs": {},
        }
        for name, got in sorted(self.times.items()):
            ordered = sorted(got)
            cpu = sorted(self.cpu[name])
            n = len(ordered)
            out["jobs"][name] = {
                "count": n,
                "total_us": sum(ordered) / 1e3,
                "p50_us": ordered[n // 2] / 1e3,
                "p99_us": ordered[min(n - 1, n * 99 // 100)] / 1e3,
                "max_us": ordered[-1] / 1e3,
                "cpu_p99_us": cpu[min(n - 1, n * 99 // 100)] / 1e3,
                "cpu_max_us": cpu[-1] / 1e3,
            }
        return out

    def write(self) -> None:
        gc.callbacks.remove(self.on_gc)
        t = _clock()
        gc.collect()  # what a full collection costs now
        self.full_us = (_clock() - t) / 1e3
        with open(self.path, "w") as f:
            json.dump(self.report(), f, indent=1)


def install(index: int, prefix: str, worker: type) -> Probe:
    """Time this worker's jobs (see the header); the report is written at exit. `worker`:
    broky.server.worker.process's Worker class (passed in: the worker imports this module)."""
    from broky.server.accounts import AccountBook
    from broky.server.shard import core
    from broky.server.shard.core import Shard
    from broky.server.shard.positions import Positions
    from broky.server.shard.replay import ReplayBuffer

    probe = Probe(f"{prefix}-worker-{index}.json")
    probe.wrap(Shard, "feed", "read")
    probe.wrap(Shard, "tick", "tick")
    probe.wrap(AccountBook, "commit_read", "accounts_commit")
    probe.wrap(Shard, "flush", "flush")
    probe.wrap(AccountBook, "expire", "accounts_expire")
    probe.wrap(ReplayBuffer, "expire", "replay_expire")
    probe.wrap(ReplayBuffer, "trim_all", "replay_trim")
    probe.wrap(ReplayBuffer, "trim_some", "replay_trim_some")
    probe.wrap(ReplayBuffer, "settle", "replay_settle")
    probe.wrap(core, "trim_heap", "heap_trim")  # (Shard.tick calls it by that name)
    probe.wrap(worker, "_on_channel", "control")
    probe.wrap(Positions, "bounded_read", "bounded_read")
    probe.wrap(Positions, "continue_read", "read_batch")
    gc.callbacks.append(probe.on_gc)
    atexit.register(probe.write)
    return probe
