"""A subscription's queue, its flow control and its hard bounds, without a server.

The server side of Pause is tested with real servers in test_client.py; here, what the
queue does with deliveries that keep coming after it paused its connections (a server that
does not pause): queued up to `hard_bounds`, dropped, counted and reported past them."""

from __future__ import annotations

import asyncio

import broky
from broky.client.losses import LossLog
from broky.client.stats import ClientStats
from broky.client.subscription import DEFAULT_MAX_PENDING_BYTES, DEFAULT_MAX_PENDING_MSGS, hard_bounds
from broky.client.sync import SyncSubscription
from broky.protocol import Message


class Owner:
    def __init__(self) -> None:
        self.stats = ClientStats()
        self.errors: list[BaseException] = []
        self.pauses = 0
        self.resumes = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the blocking client's resumes go through it

    def report_error(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def pause_subscription(self, sub: broky.Subscription) -> None:
        self.pauses += 1

    def resume_subscription(self, sub: broky.Subscription) -> None:
        self.resumes += 1

    async def remove_subscription(self, sub: broky.Subscription) -> None:
        sub.mark_closed()

    def lag_of(self, sub: broky.Subscription) -> tuple[int, int, int]:
        return 0, 0, 0


def msg(i: int) -> Message:
    return Message(b"kp", b"k", b"%06d" % i)


def test_hard_bounds_are_eight_times_the_queue_and_never_below_the_defaults() -> None:
    assert hard_bounds(5, 10) == (DEFAULT_MAX_PENDING_MSGS, DEFAULT_MAX_PENDING_BYTES)
    assert hard_bounds(100_000, 100 << 20) == (800_000, 800 << 20)


def test_a_full_queue_pauses_once_queues_to_the_hard_bound_then_drops_and_reports() -> None:
    async def main() -> None:
        owner = Owner()
        sub = broky.Subscription(owner, 1, b"k", None, None, 5, 1 << 30)
        hard = hard_bounds(5, 1 << 30)[0]
        for i in range(5):
            sub.deliver(msg(i))
        assert owner.pauses == 0  # room for every one
        for i in range(5, hard + 100):
            sub.deliver(msg(i))
        assert sub.pending == hard and sub.dropped == 100 == owner.stats.dropped_local
        assert owner.pauses > 1  # once when full, then on every drop (a Link put on since)
        await asyncio.sleep(0)  # one report for the burst, with its count
        assert [(e.sid, e.dropped) for e in owner.errors] == [(1, 100)]  # type: ignore[attr-defined]
        # the consumer takes it down to half the queue: released once, in order
        got = [int((await sub.next_msg(0)).payload) for _ in range(hard - 2)]
        assert got == list(range(hard - 2)) and owner.resumes == 1
        assert sub.pending == 2

    asyncio.run(main())


def test_the_blocking_clients_queue_follows_the_same_rule() -> None:
    # SyncSubscription is the same Inbox behind a lock: pushed by the I/O thread (here, the
    # loop's), taken by `next`; it resumes from the consumer's thread through the loop.
    async def main() -> None:
        owner = Owner()
        owner.loop = asyncio.get_running_loop()
        feed = broky.Subscription(owner, 1, b"k", None, lambda m: None, 5, 1 << 30)
        sub = SyncSubscription(owner, lambda coro: coro.close(), 5, 1 << 30)  # type: ignore[arg-type]
        sub.attach(feed)
        hard = hard_bounds(5, 1 << 30)[0]
        for i in range(5):
            sub.push(msg(i))
        assert owner.pauses == 0
        for i in range(5, hard + 100):
            sub.push(msg(i))
        assert sub.pending == hard and sub.dropped == 100 == owner.stats.dropped_local
        assert owner.pauses > 1  # once when full, then on every drop (a Link put on since)
        await asyncio.sleep(0)
        assert [(e.sid, e.dropped) for e in owner.errors] == [(1, 100)]  # type: ignore[attr-defined]
        got = [int(sub.next(0).payload) for _ in range(hard - 2)]
        await asyncio.sleep(0)  # the resume, handed to the I/O thread's loop
        assert got == list(range(hard - 2)) and owner.resumes == 1
        assert sub.pending == 2 and sub.delivered == hard - 2
        sub.mark_closed()
        assert [int(m.payload) for m in sub.iter(0)] == [hard - 2, hard - 1]

    asyncio.run(main())


def test_the_loss_log_writes_one_line_per_source_per_interval_with_the_running_count() -> None:
    async def main() -> None:
        lines: list[str] = []
        losses = LossLog(lines.append, interval=0.2)
        losses.add("a", "subscription 1", 5)  # the first loss of a source: at once
        assert lines == ["subscription 1: 5 messages lost"]
        for _ in range(100):  # a burst: counted, not written
            losses.add("a", "subscription 1", 1)
        losses.add("b", "worker 0 of n (slow_consumer)", 3)  # another source: its own line
        assert lines[1:] == ["worker 0 of n (slow_consumer): 3 messages lost"]
        await asyncio.sleep(0.3)  # the interval is over: one line for the whole burst
        assert lines[2:] == ["subscription 1: 100 messages lost since the last report, 105 in all"]
        await asyncio.sleep(0.3)
        assert len(lines) == 3  # nothing new, nothing written
        losses.add("a", "subscription 1", 7)  # the interval has passed: at once again
        losses.add("a", "subscription 1", 1)
        losses.close()  # what is left is written
        assert lines[3:] == [
            "subscription 1: 7 messages lost since the last report, 112 in all",
            "subscription 1: 1 message lost since the last report, 113 in all",
        ]

    asyncio.run(main())
