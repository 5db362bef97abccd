"""Consumer groups: balance and server CPU, Broky's groups against nats-server queue groups.

    python -m bench.groups [--messages 100000] [--rate 10000] [--partitions 256] [--workers 2]
                           [--cpu-rounds 5] [--only SECTION,...] [--quick] [--name groups]

Every run starts a fresh server (`broky serve --workers 2`, or `nats-server`
with its monitoring port), one process per group member (Broky's asyncio SDK
or nats.py, `async for` over the subscription; one process each, for both
systems, so that neither shares a process or a GIL between members), and one
SDK publisher process, which publishes `--messages` messages of 100 B over
`--partitions` key_partitions at `--rate` msgs/s (in bursts: every 5 ms what
is due) and flushes. Broky: key `g.k`, key_partition `tenant-i`, members on
`g.>`; NATS: subject `g.k.tenant-i`, members on `g.>` in queue group `g`.
Each payload carries its key_partition's index, its sequence number within
the key_partition, its number in the run and its publish time, so every
member checks what it takes: copies (a message taken twice, by one member
or by two: a bitmap per member, compared at the end), loss (a message nobody
took), order within a key_partition (and for Broky, offsets), and the lag
from publish to take.

Sections (`--only`; each scenario once, the CPU rounds `--cpu-rounds` times):

- balance: load-balanced groups of 3 and 8 equally fast members (no work per
  message), Broky and NATS: deliveries per member, max/min and the
  coefficient of variation (target: max/min <= 1.2 over 100,000 messages).
- slow: 3 members, one three times slower than the others. Each member
  emulates work per message: it keeps a clock of when it would be done
  (`SERVICE`: every message adds its service time, and the member sleeps,
  `await asyncio.sleep`, whenever that clock is over a millisecond ahead of
  now; a member that waited for a message starts its clock again from now,
  so idle time is no credit), so its capacity is one message per service
  time whatever the machine. The fast members' service time is chosen so
  that the three members together can take `HEADROOM` (1.2) times the rate:
  at 10,000 msgs/s, 194 µs (5,143 msgs/s each) and 583 µs (1,714 msgs/s) for
  the slow one. A work-conserving dispatcher then gives the slow member at
  most its capacity (1,714/s) and the others the rest (4,143/s each): a
  share of 0.41 of theirs (a third would be the share of a group run at its
  full capacity). Broky without acks (a member's default queue of 1,000
  messages, and a plain subscription's 65,536: the server sees a member's
  backlog only once its connection stops reading), with acks (ack=True:
  in-flight messages count as the member's load; each member acks after its
  work), NATS. Reported: each member's share, the slow member's share of the fast
  ones', what was lost and told, slow-consumer cuts (Broky: /stats drops and
  the client's counters; NATS: /varz slow_consumers and nats.py's
  SlowConsumerError), and the lag.
- key_shared: Broky only (core NATS has no key-shared subscription; JetStream
  is out of scope here): 3 and 8 members, key_partitions uniform (round robin)
  and skewed (Zipf s=1.1 over the key_partitions, the same seeded draw for
  every run): per member counts, max/min, how many key_partitions went to more
  than one member (reported: without acks a vbucket may move once, at once and
  undrained, at the rebalance a second after the last member joined, which
  the run may straddle; schema/README.md 5.3 rule 3), how many changed member
  more than once (must be 0), order within each key_partition (sequence
  numbers and offsets: out of order or missing), and the hottest
  key_partition's share of all messages (a member holding it gets at least
  that: a key-shared group does not split a key_partition).
- acks: Broky load-balanced groups with ack=True (every member acks every
  message) of 3 and 8 members at the rate: balance, the server's ack counters
  (acks, redelivered, in flight at the end). Core NATS queue groups have no
  acks (JetStream pull consumers do; not measured here). Then throughput:
  the same messages published as fast as the publisher can (no rate), to 3
  members: Broky without and with acks, NATS.
- cpu: server CPU per delivered message (`--cpu-rounds` rounds, the setups
  alternating, the same load and the same delivered count): a Broky plain
  subscription (one subscriber process), the same with an idle group
  elsewhere on the server (a group member on `idle.>`, which the load never
  matches: what the existence of groups costs the plain path, target <=
  1.05x), a Broky load-balanced group of 1 (the group's dispatch on the same
  connections as the plain subscription's) and of 3, a NATS plain
  subscription and a NATS queue group of 3.

Server CPU is every server process's (Broky: master and workers; NATS: its
threads), from the scheduler (bench.harness.procstat), from the publisher's
first publish until every message was taken (the members are asked every
50 ms) and 0.2 s more. Results: bench/results/groups.md and .json, with the
machine (2 cores: members, publisher and server share them).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import statistics
import struct
import subprocess
import sys
import time
from array import array
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import options, procstat, roles, servers  # noqa: E402
from bench.harness.machine import describe, machine_info  # noqa: E402
from bench.harness.report import table, write_results  # noqa: E402

KEY = b"g.k"  # Broky's key; NATS subjects are g.k.tenant-i
PATTERN = "g.>"
GROUP = "g"
IDLE_PATTERN = "idle.>"  # the idle group's: no message of the load matches it
SIZE = 100  # payload bytes
HEADROOM = 1.2  # slow section: the members' capacity over the rate
SLOWER = 3  # the slow member's service time over the others'
ZIPF_S = 1.1
SEED = 24
TICK = 0.005  # the publisher publishes what is due every TICK seconds
POLL = 0.05  # the members' counts are asked for every POLL seconds
SETTLE = 0.2  # seconds after the last message, still counted (the last acks, the last writes)
QUIET = 3.0  # seconds without progress, once the publisher is done, after which a run ends
SLEEP_MIN = 0.001  # a member sleeps when its work clock is this far ahead (uvloop's timers: 1 ms)
IDLE_GAP = 0.0002  # a wait this long for a message means the member was idle
_head = struct.Struct("<IIId")  # key_partition index, sequence in it, message number, publish time


# ---------------------------------------------------------------- what a run is


@dataclass(frozen=True)
class Scenario:
    """One run's setup: which system, how many members and how they subscribe."""

    id: str
    title: str
    section: str
    system: str  # "broky" or "nats"
    members: int
    mode: str = "lb"  # "plain" (a plain subscription), "lb" (load-balanced), "ks" (key-shared)
    ack: bool = False
    skew: float = 0.0  # Zipf s over the key_partitions; 0: round robin
    slow: bool = False  # the last member SLOWER times slower than the others, all with work per message
    idle_group: bool = False  # a group member on IDLE_PATTERN in a process of its own
    burst: bool = False  # published as fast as the publisher can, not at the rate
    queue: int = 0  # Broky members' max_pending_msgs (0: the SDK's default)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("lb3_broky", "Broky, load-balanced, 3 members", "balance", "broky", 3),
    Scenario("lb3_nats", "NATS queue group, 3 members", "balance", "nats", 3),
    Scenario("lb8_broky", "Broky, load-balanced, 8 members", "balance", "broky", 8),
    Scenario("lb8_nats", "NATS queue group, 8 members", "balance", "nats", 8),
    Scenario(
        "slow3_broky",
        "Broky, load-balanced, no acks (a member's default queue: 1,000)",
        "slow",
        "broky",
        3,
        slow=True,
    ),
    Scenario(
        "slow3_broky_q65536",
        "Broky, load-balanced, no acks, SDK queue of 65,536 (a plain subscription's default)",
        "slow",
        "broky",
        3,
        slow=True,
        queue=65536,
    ),
    Scenario("slow3_broky_ack", "Broky, load-balanced, ack=True", "slow", "broky", 3, ack=True, slow=True),
    Scenario("slow3_nats", "NATS queue group", "slow", "nats", 3, slow=True),
    Scenario("ks3_uniform", "3 members, uniform", "key_shared", "broky", 3, mode="ks"),
    Scenario("ks3_zipf", f"3 members, Zipf s={ZIPF_S}", "key_shared", "broky", 3, mode="ks", skew=ZIPF_S),
    Scenario("ks8_uniform", "8 members, uniform", "key_shared", "broky", 8, mode="ks"),
    Scenario("ks8_zipf", f"8 members, Zipf s={ZIPF_S}", "key_shared", "broky", 8, mode="ks", skew=ZIPF_S),
    Scenario("ack3_broky", "Broky, ack=True, 3 members", "acks", "broky", 3, ack=True),
    Scenario("ack8_broky", "Broky, ack=True, 8 members", "acks", "broky", 8, ack=True),
    Scenario("burst3_broky", "Broky, no acks, 3 members", "acks", "broky", 3, burst=True),
    Scenario("burst3_broky_ack", "Broky, ack=True, 3 members", "acks", "broky", 3, ack=True, burst=True),
    Scenario("burst3_nats", "NATS queue group, 3 members", "acks", "nats", 3, burst=True),
)
CPU_SETUPS: tuple[Scenario, ...] = (
    Scenario("cpu_plain", "Broky, plain subscription", "cpu", "broky", 1, mode="plain"),
    Scenario("cpu_plain_idle", "Broky, plain, idle group elsewhere", "cpu", "broky", 1, mode="plain",
             idle_group=True),
    Scenario("cpu_lb1_broky", "Broky, load-balanced group of 1", "cpu", "broky", 1),
    Scenario("cpu_lb3_broky", "Broky, load-balanced group of 3", "cpu", "broky", 3),
    Scenario("cpu_plain_nats", "NATS, plain subscription", "cpu", "nats", 1, mode="plain"),
    Scenario("cpu_lb3_nats", "NATS queue group of 3", "cpu", "nats", 3),
)  # fmt: skip
# The CPU ratios reported: (numerator, denominator), medians of the rounds' ratios.
CPU_RATIOS = (
    ("cpu_lb1_broky", "cpu_plain"),  # the group's dispatch, on the same connections
    ("cpu_lb3_broky", "cpu_plain"),
    ("cpu_lb3_broky", "cpu_lb1_broky"),  # three members' connections instead of one's
    ("cpu_lb3_broky", "cpu_lb3_nats"),
    ("cpu_plain", "cpu_plain_nats"),
    ("cpu_lb3_nats", "cpu_plain_nats"),
)
SECTIONS = ("balance", "slow", "key_shared", "acks", "cpu")
QUICK = ("lb3_broky", "lb3_nats", "slow3_broky_ack", "ks3_zipf", "burst3_broky_ack")


def service_times(rate: int) -> tuple[float, float]:
    """The slow section's service times (s): a fast member's and the slow one's, so that
    two fast and one slow member take HEADROOM times `rate` together."""
    fast = (2 + 1 / SLOWER) / (HEADROOM * rate)
    return fast, fast * SLOWER


def partition_sequence(n: int, parts: int, skew: float) -> list[int]:
    """The key_partition index of each message number: round robin, or a seeded Zipf draw."""
    if not skew:
        return [k % parts for k in range(n)]
    weights = [1 / (i + 1) ** skew for i in range(parts)]
    return random.Random(SEED).choices(range(parts), weights=weights, k=n)


def expected_per_partition(n: int, parts: int, skew: float) -> list[int]:
    counts = [0] * parts
    for i in partition_sequence(n, parts, skew):
        counts[i] += 1
    return counts


def random_assignment_spread(per_partition: Sequence[int], members: int, trials: int = 1000) -> list[float]:
    """What a key-shared group's max/min would be if each occupied vbucket went to a member
    drawn at random (what an ideal hash does): the 10th, 50th and 90th percentiles over
    `trials` seeded draws, for these messages per key_partition (`tenant-i`)."""
    from broky.protocol.routing import vbucket_of

    per_vbucket: dict[int, int] = {}
    for i, count in enumerate(per_partition):
        vb = vbucket_of(b"tenant-%d" % i)
        per_vbucket[vb] = per_vbucket.get(vb, 0) + count
    rng = random.Random(SEED)
    ratios = []
    for _ in range(trials):
        counts = [0] * members
        for count in per_vbucket.values():
            counts[rng.randrange(members)] += count
        ratios.append(max(counts) / max(min(counts), 1))  # a member with none: as if it had one
    ratios.sort()
    return [round(ratios[int(p * trials)], 3) for p in (0.1, 0.5, 0.9)]


def nats_subject(i: int) -> str:
    return f"g.k.tenant-{i}"


# ---------------------------------------------------------------- a member's process


class Tally:
    """What one member took, checked message by message (see the header)."""

    def __init__(self, n: int, parts: int) -> None:
        self.count = 0
        self.seen = bytearray((n + 7) // 8)  # bit k: message number k taken
        self.twice = 0  # messages this member took again (any attempt)
        self.redelivered = 0  # deliveries with delivery_count > 1 (Broky)
        self.per_partition = [0] * parts  # first deliveries per key_partition
        self.last_seq = [-1] * parts
        self.last_offset = [-1] * parts
        self.out_of_order = 0  # a sequence number below one this member took before (first deliveries)
        self.offset_backwards = 0  # an offset not above the last one of its key_partition (Broky)
        self.lags = array("d")  # seconds from publish to take
        self.first_at = 0.0
        self.last_at = 0.0

    def take(self, payload: bytes, offset: int, attempt: int) -> None:
        i, seq, k, sent = _head.unpack_from(payload)
        now = time.time()
        self.count += 1
        if not self.first_at:
            self.first_at = now
        self.last_at = now
        self.lags.append(now - sent)
        byte, bit = k >> 3, 1 << (k & 7)
        if self.seen[byte] & bit:
            self.twice += 1
        self.seen[byte] |= bit
        if attempt > 1:
            self.redelivered += 1
            return
        self.per_partition[i] += 1
        if seq < self.last_seq[i]:
            self.out_of_order += 1
        self.last_seq[i] = max(seq, self.last_seq[i])
        if offset:
            if offset <= self.last_offset[i]:
                self.offset_backwards += 1
            self.last_offset[i] = offset

    def report(self) -> dict[str, Any]:
        lags = sorted(self.lags)

        def pct(p: float) -> float | None:
            return round(lags[min(len(lags) - 1, int(p * len(lags)))] * 1e3, 3) if lags else None

        return {
            "taken": self.count,
            "twice": self.twice,
            "redelivered": self.redelivered,
            "out_of_order": self.out_of_order,
            "offset_backwards": self.offset_backwards,
            "per_partition": self.per_partition,
            "lag_ms_p50": pct(0.5),
            "lag_ms_p99": pct(0.99),
            "lag_ms_max": round(lags[-1] * 1e3, 3) if lags else None,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "seen": base64.b64encode(bytes(self.seen)).decode(),
        }


class Work:
    """A member's work per message (see the header's slow section): sleeps so that it
    takes at most one message per `service` seconds; nothing when `service` is 0."""

    def __init__(self, service: float) -> None:
        self.service = service
        self.busy_until = 0.0  # when the member would be done with what it took
        self.waited_from = time.perf_counter()

    def waiting(self) -> None:
        """Called before waiting for the next message."""
        self.waited_from = time.perf_counter()

    async def done(self) -> None:
        """Called after taking a message: the time it takes."""
        if not self.service:
            return
        now = time.perf_counter()
        if now - self.waited_from > IDLE_GAP:  # it was idle: no credit for that
            self.busy_until = max(self.busy_until, now)
        else:  # at most a sleep's overshoot of credit
            self.busy_until = max(self.busy_until, now - 2 * SLEEP_MIN)
        self.busy_until += self.service
        ahead = self.busy_until - now
        if ahead > SLEEP_MIN:
            await asyncio.sleep(ahead)


async def _take_until_stopped(
    it: AsyncIterator[Any], take: Callable[[Tally, Any], None], n: int, parts: int, service: float
) -> dict[str, Any]:
    """Take messages from `it` (each: `take`, then its work) until the orchestrator says stop."""
    tally, work = Tally(n, parts), Work(service)

    async def serve() -> None:
        while True:
            work.waiting()
            msg = await it.__anext__()
            take(tally, msg)
            await work.done()

    serving = asyncio.create_task(serve())
    roles.ready()
    async for _ in roles.lines():  # "count", until "stop"
        roles.answer(tally.count)
    error = None
    if serving.done() and serving.exception() is not None:  # the subscription ended under it
        error = repr(serving.exception())[:300]
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await serving
    return {**tally.report(), "member_error": error}


async def broky_member(
    address: str, n: int, parts: int, mode: str, ack: bool, service: float, pattern: str = PATTERN,
    queue: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """A Broky SDK member (mode "plain": a plain subscription; "lb", "ks": a group's member)."""
    import broky

    told: dict[str, int] = {}
    errors: list[str] = []

    def on_loss(ref: Any, dropped: int, reason: Any) -> None:
        told[str(reason)] = told.get(str(reason), 0) + dropped

    def take(tally: Tally, msg: Any) -> None:
        tally.take(msg.payload, msg.offset, getattr(msg, "delivery_count", 1))
        if ack:
            msg.ack()

    async with broky.connect(address, on_loss=on_loss, on_error=lambda e: errors.append(str(e))) as client:
        kwargs: dict[str, Any] = {"max_pending_msgs": queue} if queue else {}
        if mode != "plain":
            kwargs |= {
                "group": GROUP if pattern == PATTERN else "idle",
                "key_shared": mode == "ks",
                "ack": ack,
            }
        sub = await client.subscribe(pattern, **kwargs)
        result = await _take_until_stopped(sub.__aiter__(), take, n, parts, service)
        stats = asdict(client.stats)
        keep = ("dropped_local", "pauses", "server_lost", "group_paused", "redeliveries", "acks_sent")
        result.update(
            told_lost=told,
            errors=errors[-10:],
            client={k: stats[k] for k in keep if k in stats},
            paused_by_server=getattr(sub, "paused_by_server", None),
        )
        await asyncio.sleep(0.05)  # the last acks' frame
    return result


async def nats_member(address: str, n: int, parts: int, service: float) -> dict[str, Any]:
    """A nats.py member of queue group GROUP on PATTERN."""
    import nats

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:  # nats.py reports its slow-consumer drops here
        errors.append(type(exc).__name__)

    nc = await nats.connect(f"nats://{address}", error_cb=on_error)
    sub = await nc.subscribe(PATTERN, queue=GROUP)
    await nc.flush()
    result = await _take_until_stopped(
        sub.messages.__aiter__(), lambda tally, msg: tally.take(msg.data, 0, 1), n, parts, service
    )
    result.update(slow_consumer_errors=errors.count("SlowConsumerError"), errors=errors[-10:])
    await nc.close()
    return result


# ---------------------------------------------------------------- the publisher's process


async def _paced(publish: Callable[[int], Any], n: int, rate: int) -> None:
    """publish(k) for k in 0..n-1: at `rate` (every TICK what is due), or at once (0)."""
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0
    while sent < n:
        due = n if not rate else min(n, int((loop.time() - start) * rate) + 1)
        while sent < due:
            await publish(sent)
            sent += 1
        if sent < n:
            await asyncio.sleep(TICK)


def _payloads(n: int, parts: int, skew: float) -> tuple[list[int], Callable[[int], bytes]]:
    order = partition_sequence(n, parts, skew)
    seq = [0] * parts
    pad = b"x" * (SIZE - _head.size)

    def payload(k: int) -> bytes:
        i = order[k]
        seq[i] += 1
        return _head.pack(i, seq[i] - 1, k, time.time()) + pad

    return order, payload


def _published(n: int, started: float, cpu0: float) -> dict[str, Any]:
    """The publisher's report: its time and rate, and its CPU from "go" on."""
    seconds = time.time() - started
    return {"published": n, "started_at": started, "seconds": round(seconds, 3),
            "rate": round(n / seconds) if seconds else None,
            "cpu_s": round(procstat.own_cpu_seconds() - cpu0, 3)}  # fmt: skip


async def broky_publisher(address: str, n: int, parts: int, rate: int, skew: float) -> dict[str, Any]:
    import broky

    order, payload = _payloads(n, parts, skew)
    names = [b"tenant-%d" % i for i in range(parts)]
    async with broky.connect(address) as client:
        await roles.ready_then_go()
        started, cpu0 = time.time(), procstat.own_cpu_seconds()
        await _paced(lambda k: client.publish(KEY, payload(k), partition=names[order[k]]), n, rate)
        await client.flush()
        return _published(n, started, cpu0)


async def nats_publisher(address: str, n: int, parts: int, rate: int, skew: float) -> dict[str, Any]:
    import nats

    order, payload = _payloads(n, parts, skew)
    names = [nats_subject(i) for i in range(parts)]
    nc = await nats.connect(f"nats://{address}")
    await roles.ready_then_go()
    started, cpu0 = time.time(), procstat.own_cpu_seconds()
    await _paced(lambda k: nc.publish(names[order[k]], payload(k)), n, rate)
    await nc.flush()
    result = _published(n, started, cpu0)
    await nc.close()
    return result


# ---------------------------------------------------------------- one run


def _start(procs: list[roles.Role], what: str, *argv: str) -> roles.Role:
    """One of this program's role processes (`_role`); `Role.ready` waits for it."""
    role = roles.spawn("bench.groups", *argv, what=what)
    procs.append(role)
    return role


def _counts(members: Sequence[roles.Role]) -> list[int]:
    """Every member's count so far (asked of all of them first, then read)."""
    for m in members:
        m.say("count")
    return [int(m.read()) for m in members]


# Broky /stats counters kept per run, summed over the workers (those the server has).
STAT_KEYS = (
    "messages_published", "messages_delivered", "slow_consumer_disconnects", "budget_cuts", "groups",
    "group_members", "group_delivered", "acks", "nacks", "redelivered", "acks_unknown", "in_flight",
    "group_paused", "group_drain_expired", "group_vbuckets_moved",
)  # fmt: skip


def server_counters(server: servers.Server) -> dict[str, Any]:
    """Broky: STAT_KEYS and the drops by reason (non-zero), summed over the workers (/stats);
    NATS: /varz's slow_consumers, in_msgs, out_msgs."""
    if server.name == "nats":
        varz = json.loads(server.http_get("/varz"))
        return {k: varz.get(k, 0) for k in ("slow_consumers", "in_msgs", "out_msgs")}
    workers = server.stats()["workers"]
    out: dict[str, Any] = {k: sum(w.get(k, 0) for w in workers) for k in STAT_KEYS if k in workers[0]}
    dropped: dict[str, int] = {}
    for w in workers:
        for reason, count in w.get("dropped", {}).items():
            if count:
                dropped[reason] = dropped.get(reason, 0) + count
    out["dropped"] = dropped
    return out


def one_run(sc: Scenario, n: int, rate: int, parts: int, workers: int) -> dict[str, Any]:
    """Start the server, the members and the publisher; publish; count; stop everything."""
    fast, slow = service_times(rate) if sc.slow else (0.0, 0.0)
    server = servers.start_broky(workers) if sc.system == "broky" else servers.start_nats(monitor=True)
    procs: list[roles.Role] = []
    idle_taken = None
    try:
        address = f"{server.host}:{server.port}"
        common = ("--address", address, "--messages", str(n), "--partitions", str(parts))
        if sc.idle_group:
            idle = _start(procs, "the idle group's member", "--role", "member", "--system", "broky",
                          "--mode", "lb", "--pattern", IDLE_PATTERN, *common).ready()  # fmt: skip
        members = []
        for m in range(sc.members):  # they all start at once
            service = slow if sc.slow and m == sc.members - 1 else fast
            argv = ["--role", "member", "--system", sc.system, "--mode", sc.mode, "--service", repr(service)]
            argv += ["--queue", str(sc.queue), *(["--ack"] if sc.ack else [])]
            members.append(_start(procs, f"member {m}", *argv, *common))
        for member in members:
            member.ready()
        pace = str(0 if sc.burst else rate)
        argv = ["--role", "publisher", "--system", sc.system, "--rate", pace, "--skew", str(sc.skew)]
        publisher = _start(procs, "the publisher", *argv, *common).ready()
        time.sleep(0.3)  # every subscription in place everywhere
        expected = n * (1 if sc.mode != "plain" else sc.members)
        pids = server.pids()
        busy0, all0, _ = procstat.machine_cpu()
        cpu0 = procstat.total_exact_cpu_seconds(pids)
        members0 = roles.total_cpu_seconds(members)
        mine0 = time.process_time()
        t0 = time.monotonic()
        publisher.say("go")
        got, last_progress = 0, t0
        deadline = t0 + 3 * n / rate + 60
        while time.monotonic() < deadline:
            time.sleep(POLL)
            total = sum(_counts(members))
            now = time.monotonic()
            if total != got:
                got, last_progress = total, now
            if got >= expected or (publisher.poll() is not None and now - last_progress > QUIET):
                break
        done_at = last_progress
        time.sleep(SETTLE)
        cpu = procstat.total_exact_cpu_seconds(pids) - cpu0
        members_cpu = roles.total_cpu_seconds(members) - members0
        mine = time.process_time() - mine0
        busy1, all1, _ = procstat.machine_cpu()
        counters = server_counters(server)
        published = publisher.finish(None)
        taken = [m.finish(timeout=30) for m in members]
        if sc.idle_group:
            idle_taken = idle.finish(timeout=30)["taken"]
    finally:
        roles.kill_all(procs)
        server.stop()
    result = analyse(sc, n, parts, published, taken, expected)
    delivered = result["taken"]
    cores = (all1 - all0) or 1.0
    result.update(
        publisher=published,
        server=counters,
        elapsed_s=round(done_at - t0, 3),
        server_cpu_s=round(cpu, 4),
        server_cpu_us_per_delivery=round(cpu / max(delivered, 1) * 1e6, 3),
        members_cpu_us_per_delivery=round(members_cpu / max(delivered, 1) * 1e6, 3),
        # what the rest of the machine used meanwhile (other users of a shared machine)
        others_cpu_share=round(max(0.0, (busy1 - busy0) - cpu - members_cpu - mine - published["cpu_s"])
                               / cores, 3),
        service_us=[round((slow if sc.slow and m == sc.members - 1 else fast) * 1e6, 1)
                    for m in range(sc.members)],
    )  # fmt: skip
    if sc.idle_group:
        result["idle_group_taken"] = idle_taken
    return result


def analyse(
    sc: Scenario, n: int, parts: int, published: dict[str, Any], taken: list[dict[str, Any]], expected: int
) -> dict[str, Any]:
    """Balance, loss, copies and order of one run from its members' reports."""
    counts = [t["taken"] for t in taken]
    seen_any, copies = 0, 0
    for t in taken:
        bits = int.from_bytes(base64.b64decode(t["seen"]), "little")
        copies += (seen_any & bits).bit_count()
        seen_any |= bits
    nobody = n - seen_any.bit_count()
    out: dict[str, Any] = {
        "scenario": sc.id,
        "published": published["published"],
        "taken": sum(counts),
        "expected": expected,
        "per_member": counts,
        "max_over_min": round(max(counts) / min(counts), 3) if min(counts) else None,
        "cv": round(statistics.pstdev(counts) / statistics.mean(counts), 4) if sum(counts) else None,
        # a message nobody took; taken twice by one member; taken by two members
        "lost": nobody if sc.mode != "plain" or sc.members == 1 else None,
        "twice_by_one": sum(t["twice"] for t in taken),
        "by_two": copies if sc.mode != "plain" else None,
        "redelivered": sum(t["redelivered"] for t in taken),
        "out_of_order": sum(t["out_of_order"] for t in taken),
        "offset_backwards": sum(t["offset_backwards"] for t in taken),
        "lag_ms_p99": [t["lag_ms_p99"] for t in taken],
        "lag_ms_max": [t["lag_ms_max"] for t in taken],
        "last_at_after_publish_end": round(
            max(t["last_at"] for t in taken) - published["started_at"] - published["seconds"], 3
        ),
        "members": [{k: v for k, v in t.items() if k not in ("seen", "per_partition")} for t in taken],
    }
    if sc.slow:
        fast = counts[:-1]
        out["slow_share_of_fast"] = round(counts[-1] / statistics.mean(fast), 3) if sum(fast) else None
    if sc.mode == "ks":
        want = expected_per_partition(n, parts, sc.skew)
        owners = [sum(1 for t in taken if t["per_partition"][i]) for i in range(parts)]
        out["partitions_per_member"] = [sum(1 for c in t["per_partition"] if c) for t in taken]
        out["partitions_split"] = sum(1 for o in owners if o > 1)  # went to more than one member
        # key_partitions whose member changed more than once in publish order: without acks a
        # group moves a vbucket at most once (the rebalance a second after the last join), so
        # a key_partition has one member, then perhaps another; never back and forth
        member_of: list[int | None] = [None] * n
        for m, t in enumerate(taken):
            seen = base64.b64decode(t["seen"])
            for k in range(n):
                if seen[k >> 3] >> (k & 7) & 1 and member_of[k] is None:
                    member_of[k] = m
        last: list[int | None] = [None] * parts
        changes = [0] * parts
        for k, i in enumerate(partition_sequence(n, parts, sc.skew)):
            who = member_of[k]
            if who is not None and who != last[i]:
                changes[i] += last[i] is not None
                last[i] = who
        out["partitions_moved_back_and_forth"] = sum(1 for c in changes if c > 1)
        # key_partitions whose one member did not get all of it (first deliveries)
        out["partitions_incomplete"] = sum(
            1 for i in range(parts) if want[i] and max(t["per_partition"][i] for t in taken) != want[i]
        )
        out["hottest_partition_share"] = round(max(want) / n, 4)
        out["random_assignment_max_over_min_p10_p50_p90"] = random_assignment_spread(want, sc.members)
    return out


# ---------------------------------------------------------------- the whole benchmark


def run(
    scenarios: Iterable[Scenario], cpu_rounds: int, n: int, rate: int, parts: int, workers: int,
    on_run: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Every scenario once, then `cpu_rounds` rounds of CPU_SETUPS (their order reversed
    every other round); a run that fails is recorded with its error."""
    plan = list(scenarios)
    for r in range(cpu_rounds):
        plan += CPU_SETUPS if r % 2 == 0 else tuple(reversed(CPU_SETUPS))
    results: dict[str, list[dict[str, Any]]] = {}
    for sc in plan:
        try:
            got = one_run(sc, n, rate, parts, workers)
        except (servers.ServerError, RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
            got = {"scenario": sc.id, "error": f"{type(exc).__name__}: {exc}"[:500]}
        results.setdefault(sc.id, []).append(got)
        if on_run is not None:
            on_run(sc.id, got)
    return results


BY_ID = {sc.id: sc for sc in (*SCENARIOS, *CPU_SETUPS)}


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _ok(results: dict[str, list[dict[str, Any]]], sid: str) -> list[dict[str, Any]]:
    return [x for x in results.get(sid, []) if "error" not in x]


def _f(v: Any, fmt: str = "{:,}") -> str:
    return "-" if v is None else fmt.format(v)


def _error_rows(results: dict[str, list[dict[str, Any]]], ids: Iterable[str]) -> list[str]:
    return [f"- {BY_ID[s].title}: {x['error']}" for s in ids for x in results.get(s, []) if "error" in x]


def cpu_ratios(results: dict[str, list[dict[str, Any]]], a: str, b: str) -> list[float]:
    """Per CPU round, a's server CPU per delivered message over b's (rounds where both ran)."""
    key = "server_cpu_us_per_delivery"
    return [x[key] / y[key] for x, y in zip(results.get(a, []), results.get(b, []), strict=False)
            if x.get(key) and y.get(key)]  # fmt: skip


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The headline figures and the issue's targets, each with whether it was met."""
    out: dict[str, Any] = {"targets": []}

    def target(name: str, value: float | None, met: bool | None) -> None:
        out["targets"].append({"target": name, "value": value, "met": met})

    for sid in ("lb3_broky", "lb8_broky", "lb3_nats", "lb8_nats"):
        for x in _ok(results, sid):
            v = x["max_over_min"]
            target(f"{BY_ID[sid].title}: max/min <= 1.2", v, None if v is None else v <= 1.2)
    for sid in ("slow3_broky", "slow3_broky_q65536", "slow3_broky_ack", "slow3_nats"):
        for x in _ok(results, sid):
            v = x.get("slow_share_of_fast")
            # "about a third": a work-conserving dispatcher gives 1/3 .. its capacity's share (0.41)
            target(f"slow member, {BY_ID[sid].title}: share of a fast member's about 1/3 (0.25-0.5)", v,
                   None if v is None else 0.25 <= v <= 0.5)  # fmt: skip
            cut = _cut_or_dropped(x) + (x["lost"] or 0)
            target(f"slow member, {BY_ID[sid].title}: nobody cut off or dropped, nothing lost", cut, cut == 0)
    for sid in ("ks3_uniform", "ks8_uniform"):
        for x in _ok(results, sid):
            v = x["max_over_min"]
            target(f"key-shared, {BY_ID[sid].title}: max/min <= 1.2", v, None if v is None else v <= 1.2)
    for sid in ("ks3_uniform", "ks3_zipf", "ks8_uniform", "ks8_zipf"):
        for x in _ok(results, sid):
            bad = x["out_of_order"] + x["offset_backwards"] + (x["lost"] or 0) + (x["by_two"] or 0)
            bad += x["partitions_moved_back_and_forth"]
            target(f"key-shared, {BY_ID[sid].title}: each member's key_partitions in offset order, "
                   "none moved more than once, nothing lost or taken twice", bad, bad == 0)  # fmt: skip
            # Without acks the worker weighs the vbuckets once, a second after the members joined,
            # and moves what must move (broky.server.shard.groups): a key_partition moved then has had
            # two members, one after the other. Reported, no target.
            target(f"key-shared, {BY_ID[sid].title}: key_partitions moved by the rebalance after "
                   "the members joined (had two members, one after the other)", x["partitions_split"],
                   None)  # fmt: skip
    idle = cpu_ratios(results, "cpu_plain_idle", "cpu_plain")
    med = _median(idle)
    target("plain path's server CPU per delivery with an idle group / without: <= 1.05x (median of rounds)",
           None if med is None else round(med, 3), None if med is None else med <= 1.05)  # fmt: skip
    for a, b in CPU_RATIOS:
        med = _median(cpu_ratios(results, a, b))
        out[f"{a}_over_{b.removeprefix('cpu_')}"] = None if med is None else round(med, 3)
    return out


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, info: dict[str, Any]) -> str:
    fast, slow = service_times(args.rate)
    summary = summarize(results)
    command = (
        f"python -m bench.groups --messages {args.messages} --rate {args.rate} "
        f"--partitions {args.partitions} --workers {args.workers} --cpu-rounds {args.cpu_rounds}"
        + (f" --only {args.only}" if args.only else "")
        + (" --quick" if args.quick else "")
    )
    lines = [
        f"# {TITLE}",
        "",
        f"Machine: {describe(info)}. {info['cores']} cores: the server, the publisher and every member "
        "process share them.",
        "",
        f"Command: `{command}`",
        "",
        f"Every run: a fresh server (Broky: `broky serve --workers {args.workers}`; NATS: `nats-server`), "
        "one process per member (Broky's asyncio SDK or nats.py, `async for`), one SDK publisher process "
        f"publishing {args.messages:,} messages of {SIZE} B over {args.partitions} key_partitions "
        f"(NATS: subjects) at {args.rate:,} msgs/s (every {TICK * 1000:g} ms what is due), defaults "
        "everywhere else. Why this rate: up to ten processes share two cores, and both systems keep up with "
        "it with room to spare (the runs below say how long after the publisher's end the last message "
        "was taken, and the lag); a faster rate would measure the machine, not the dispatch. Members "
        "check every message: loss (nobody took it), copies (taken twice, or by two members), order "
        "within a key_partition, the lag from publish to take. NATS queue groups pick a "
        "member at random among those subscribed; core NATS has neither key-shared subscriptions nor "
        "acks (JetStream has acks: out of scope here).",
        "",
    ]
    lines += _balance(results)
    lines += _slow(results, args, fast, slow)
    lines += _key_shared(results, args)
    lines += _acks(results)
    lines += _cpu(results)
    targets = [
        (t["target"], _f(t["value"], "{}"), "-" if t["met"] is None else ("yes" if t["met"] else "**no**"))
        for t in summary["targets"]
    ]
    lines += ["## Targets", "", *table(("target", "value", "met"), targets, "lrl")]
    lines += ["", "Every run (without the per-member details, which are in groups.json):", "", "```"]
    for sid, runs in results.items():
        for x in runs:
            brief = {k: v for k, v in x.items() if k not in ("members", "publisher", "lag_ms_max")}
            lines.append(f"{sid}: {json.dumps(brief)}")
    lines += ["```", ""]
    return "\n".join(lines)


BALANCE = ("", "taken / published", "per member", "max/min", "CV", "lost", "copies",
           "last taken after publish end (s)", "lag p99 (ms, worst member)",
           "server CPU per delivery (µs)")  # fmt: skip
SLOW = ("", "per member (slow last)", "slow / fast", "lost", "told lost", "slow-consumer cuts or drops",
        "lag p99, fast / slow (ms)", "lag max, slow (ms)", "last taken after publish end (s)")  # fmt: skip
KEY_SHARED = ("", "per member", "max/min", "an ideal hash: max/min p10 / p50 / p90", "CV",
              "key_partitions per member", "hottest key_partition's share", "split", "incomplete",
              "out of order", "lost", "copies")  # fmt: skip
ACKS = ("", "per member", "max/min", "CV", "acks (server)", "redelivered", "in flight at the end", "lost",
        "copies", "server CPU per delivery (µs)")  # fmt: skip
BURST = ("", "publisher's rate (msgs/s)", "taken / published",
         "taken per second (first publish to last take)", "per member", "max/min", "lost",
         "server CPU per delivery (µs)")  # fmt: skip


def _members_cell(x: dict[str, Any]) -> str:
    return " / ".join(f"{c:,}" for c in x["per_member"])


def _balance(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    ids = ("lb3_broky", "lb3_nats", "lb8_broky", "lb8_nats")
    lines = [
        "## Load-balanced groups, equally fast members",
        "",
        *table(BALANCE, [
            (BY_ID[sid].title, f"{x['taken']:,} / {x['published']:,}", _members_cell(x),
             _f(x["max_over_min"], "{:.3f}"), _f(x["cv"], "{:.4f}"), _f(x["lost"]),
             x["twice_by_one"] + (x["by_two"] or 0), f"{max(0.0, x['last_at_after_publish_end']):.2f}",
             _f(_max(x["lag_ms_p99"]), "{:.1f}"), f"{x['server_cpu_us_per_delivery']:.2f}")
            for sid in ids
            for x in _ok(results, sid)
        ], "lrlrrrrrrr"),
    ]  # fmt: skip
    return [*lines, *_error_rows(results, ids), ""]


def _max(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return max(kept) if kept else None


def _slow(
    results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, fast: float, slow: float
) -> list[str]:
    ids = ("slow3_broky", "slow3_broky_q65536", "slow3_broky_ack", "slow3_nats")
    cap_fast, cap_slow = 1 / fast, 1 / slow
    conserving = cap_slow / ((args.rate - cap_slow) / 2)
    lines = [
        "## Load-balanced groups, one member three times slower",
        "",
        f"Work per message (see the module's header): {fast * 1e6:.0f} µs for the two fast members "
        f"({cap_fast:,.0f} msgs/s each), {slow * 1e6:.0f} µs for the slow one ({cap_slow:,.0f} msgs/s); "
        f"together {2 * cap_fast + cap_slow:,.0f} msgs/s, {HEADROOM}x the rate. Given at most its capacity "
        f"and the fast members the rest, the slow member's share is {conserving:.2f} of a fast member's; "
        "proportional to capacity, 1/3.",
        "",
        *table(SLOW, [
            (BY_ID[sid].title, _members_cell(x), _f(x.get("slow_share_of_fast"), "{:.3f}"), _f(x["lost"]),
             _told(x), _cuts(x),
             f"{_f(_max(x['lag_ms_p99'][:-1]), '{:.1f}')} / {_f(x['lag_ms_p99'][-1], '{:.1f}')}",
             _f(x["lag_ms_max"][-1], "{:,.0f}"), f"{max(0.0, x['last_at_after_publish_end']):.2f}")
            for sid in ids
            for x in _ok(results, sid)
        ], "llrrrllrr"),
    ]  # fmt: skip
    return [*lines, *_error_rows(results, ids), ""]


def _told(x: dict[str, Any]) -> str:
    told = sum(sum(m.get("told_lost", {}).values()) for m in x["members"])
    return f"{told:,}" if any("told_lost" in m for m in x["members"]) else "-"


def _cut_or_dropped(x: dict[str, Any]) -> int:
    """Slow-consumer cuts and drops of one run, server's and members' together."""
    server = x["server"]
    if "slow_consumers" in server:  # NATS
        return int(server["slow_consumers"]) + sum(
            int(m.get("slow_consumer_errors", 0)) for m in x["members"]
        )
    drops = sum(int(server.get("dropped", {}).get(r, 0)) for r in ("slow_consumer", "group_overflow"))
    local = sum(int(m.get("client", {}).get("dropped_local", 0)) for m in x["members"])
    return int(server.get("slow_consumer_disconnects", 0)) + drops + local


def _cuts(x: dict[str, Any]) -> str:
    """Slow-consumer cuts and drops, from the server and the members."""
    server = x["server"]
    if "slow_consumers" in server:  # NATS
        errors = sum(m.get("slow_consumer_errors", 0) for m in x["members"])
        return f"server: {server['slow_consumers']}, nats.py: {errors}"
    drops = sum(server.get("dropped", {}).get(r, 0) for r in ("slow_consumer", "group_overflow"))
    local = sum(m.get("client", {}).get("dropped_local", 0) for m in x["members"])
    return f"server: {server.get('slow_consumer_disconnects', 0)} cut, {drops} dropped; SDK: {local} dropped"


def _key_shared(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    ids = ("ks3_uniform", "ks3_zipf", "ks8_uniform", "ks8_zipf")
    lines = [
        "## Key-shared groups (Broky only)",
        "",
        f"{args.partitions} key_partitions; uniform: round robin; Zipf: each message's key_partition drawn "
        f"with weight 1/rank^{ZIPF_S} (seeded, the same in every run). Whole vbuckets go to members (a "
        "rendezvous hash), so a member's share is a sum of whole vbuckets' messages: it cannot be below the "
        "hottest key_partition's share, and with a few hundred vbuckets the hash's own spread shows. "
        'The column "an ideal hash" says what max/min a group would have if each occupied vbucket went to '
        "a member drawn at random (what a perfect hash does; 1,000 seeded draws, the 10th, 50th and 90th "
        "percentiles): a target below its range needs an assignment that looks at the counts, not a "
        "hash. Split: key_partitions taken by more than one member, one after the other (without acks "
        "the rebalance a second after the members joined moves a vbucket at once, undrained, and a run "
        "may straddle it; none may move twice: a target below); incomplete: whose member missed some "
        "of its messages; out of order: by sequence number or by offset (first deliveries).",
        "",
        *table(KEY_SHARED, [
            (BY_ID[sid].title, _members_cell(x), _f(x["max_over_min"], "{:.3f}"),
             " / ".join(f"{v:.2f}" for v in x["random_assignment_max_over_min_p10_p50_p90"]),
             _f(x["cv"], "{:.4f}"), " / ".join(str(c) for c in x["partitions_per_member"]),
             f"{x['hottest_partition_share']:.1%}", x["partitions_split"], x["partitions_incomplete"],
             x["out_of_order"] + x["offset_backwards"], _f(x["lost"]), x["twice_by_one"] + (x["by_two"] or 0))
            for sid in ids
            for x in _ok(results, sid)
        ], "llrlrlrrrrrr"),
    ]  # fmt: skip
    return [*lines, *_error_rows(results, ids), ""]


def _acks(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    ids = ("ack3_broky", "ack8_broky")
    lines = [
        "## Acks",
        "",
        "Broky load-balanced groups with ack=True, every member acking every message as it takes it "
        "(core NATS queue groups have no acks). The server's counters are summed over its workers at "
        "the end of the run.",
        "",
        *table(ACKS, [
            (BY_ID[sid].title, _members_cell(x), _f(x["max_over_min"], "{:.3f}"), _f(x["cv"], "{:.4f}"),
             _f(x["server"].get("acks")), _f(x["server"].get("redelivered")),
             _f(x["server"].get("in_flight")),
             _f(x["lost"]), x["twice_by_one"] + (x["by_two"] or 0), f"{x['server_cpu_us_per_delivery']:.2f}")
            for sid in ids
            for x in _ok(results, sid)
        ], "llrrrrrrrr"),
    ]  # fmt: skip
    burst = ("burst3_broky", "burst3_broky_ack", "burst3_nats")
    lines += [
        "",
        "Throughput: the same messages published as fast as the publisher can, to 3 members.",
        "",
        *table(BURST, [
            (BY_ID[sid].title, _f(x["publisher"]["rate"]), f"{x['taken']:,} / {x['published']:,}",
             f"{x['taken'] / (x['publisher']['seconds'] + x['last_at_after_publish_end']):,.0f}",
             _members_cell(x), _f(x["max_over_min"], "{:.3f}"), _f(x["lost"]),
             f"{x['server_cpu_us_per_delivery']:.2f}")
            for sid in burst
            for x in _ok(results, sid)
        ], "lrrrlrrr"),
    ]  # fmt: skip
    return [*lines, *_error_rows(results, (*ids, *burst)), ""]


def _cpu(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    ids = [sc.id for sc in CPU_SETUPS]
    key = "server_cpu_us_per_delivery"
    rounds = max((len(results.get(s, [])) for s in ids), default=0)
    lines = [
        "## Server CPU per delivered message",
        "",
        "The same load, the setups alternating in every round (the order reversed every other round); "
        "every setup delivers each message once (the plain subscription to its one subscriber, the groups "
        "to one member). The idle group: a member of a group on `idle.>`, in a process of its own, which "
        "no message of the load matches.",
        "",
    ]
    rows: list[list[Any]] = []
    for r in range(rounds):
        runs = [results[s][r] if r < len(results.get(s, [])) else {} for s in ids]
        cells = [f"{x[key]:.2f}" if x.get(key) else "-" for x in runs]
        plain, idle = (results[s][r].get(key) if r < len(results.get(s, [])) else None
                       for s in ("cpu_plain", "cpu_plain_idle"))  # fmt: skip
        busy = max((x.get("others_cpu_share") or 0.0) for x in runs)
        rows.append([r + 1, *cells, (plain and idle and f"{idle / plain:.3f}") or "-", f"{busy:.0%}"])
    meds = [_median(x.get(key) for x in results.get(s, [])) for s in ids]
    idle_ratios = cpu_ratios(results, "cpu_plain_idle", "cpu_plain")
    idle_cell = (
        f"{statistics.median(idle_ratios):.3f} ({min(idle_ratios):.3f}-{max(idle_ratios):.3f})"
        if idle_ratios else "-"
    )  # fmt: skip
    rows.append(["median", *(_f(m, "{:.2f}") for m in meds), idle_cell, ""])
    head = ("round", *(BY_ID[s].title for s in ids), "idle group / plain", "others' CPU")
    ratios = []
    for a, b in CPU_RATIOS:
        got = cpu_ratios(results, a, b)
        cell = f"{statistics.median(got):.2f}x ({min(got):.2f}-{max(got):.2f})" if got else "-"
        ratios.append((f"{BY_ID[a].title} / {BY_ID[b].title}", cell))
    lines += [*table(head, rows), "", "Medians of the rounds' ratios (min-max):", ""]
    lines += [*table(("", "ratio"), ratios), ""]
    return [*lines, *_error_rows(results, ids)]


# ---------------------------------------------------------------- command line

TITLE = "Consumer groups: balance and server CPU, Broky against nats-server queue groups"


def _role(args: argparse.Namespace) -> dict[str, Any]:
    import uvloop

    shape = (args.address, args.messages, args.partitions)
    if args.role == "member":
        if args.system == "broky":
            return uvloop.run(
                broky_member(*shape, args.mode, args.ack, args.service, args.pattern, args.queue)
            )
        return uvloop.run(nats_member(*shape, args.service))
    publisher = broky_publisher if args.system == "broky" else nats_publisher
    return uvloop.run(publisher(*shape, args.rate, args.skew))


def chosen(only: str, quick: bool) -> tuple[list[Scenario], int | None]:
    """The scenarios of `--only` (sections or scenario ids, comma-separated) or `--quick`,
    and whether the CPU rounds run (None: as many as asked)."""
    if quick:
        return [BY_ID[s] for s in QUICK], None
    if not only:
        return list(SCENARIOS), None
    names = {s for s in only.split(",") if s}
    unknown = names - set(SECTIONS) - {sc.id for sc in SCENARIOS}
    if unknown:
        raise ValueError(f"unknown sections or scenarios: {sorted(unknown)}")
    picked = [sc for sc in SCENARIOS if sc.section in names or sc.id in names]
    return picked, (None if "cpu" in names else 0)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "bench.groups", __doc__, out=options.RESULTS, workers=2, quick=True, name="groups",
        role=("member", "publisher"), helps={"quick": "one scenario of each kind (the CI smoke run)"},
    )  # fmt: skip
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=10_000, help="msgs/s published")
    parser.add_argument("--partitions", type=int, default=256, help="key_partitions (NATS: subjects)")
    parser.add_argument("--cpu-rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="sections (" + ",".join(SECTIONS) + ") or scenario ids")
    options.role_options(parser, "address", "system", "mode", ack=bool, service=float, skew=float, queue=int)
    parser.add_argument("--pattern", default=PATTERN, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return roles.done(_role(args))
    try:
        picked, rounds = chosen(args.only, args.quick)
    except ValueError as exc:
        parser.error(str(exc))
    cpu_rounds = args.cpu_rounds if rounds is None else rounds
    info = machine_info()

    def show(sid: str, got: dict[str, Any]) -> None:
        brief = {k: v for k, v in got.items() if k not in ("members", "publisher", "server")}
        print(f"{sid}: {json.dumps(brief)}", file=sys.stderr, flush=True)

    results = run(picked, cpu_rounds, args.messages, args.rate, args.partitions, args.workers, show)
    summary = summarize(results)
    write_results(args.out, args.name, report(results, args, info), info, args, summary=summary,
                  results=results)  # fmt: skip
    return 0


__all__ = ["SCENARIOS", "CPU_SETUPS", "Scenario", "one_run", "run", "summarize", "report", "main"]

if __name__ == "__main__":
    sys.exit(main())
