"""The latency histograms (the broker's, the producer's): fixed log2 buckets, one integer add per read.

Theory of operation
-------------------
The histogram counts delivered messages (one per message and subscribing
connection, like broky_messages_delivered_total), each with the time its
read spent inside the broker: from the moment the worker started handling
the read (one `time.time_ns()`, the same one stamped into `ts_broker`) to the
moment the read's writes were handed to the transports. All the messages of
one read share that time, so the worker measures once per read and adds the
read's delivery count to one bucket and time x count to the sum: a busy
worker pays one clock call and a few integer operations per read whatever
the batch size, and a read of 1000 deliveries weighs 1000 times one of 1.
Its count therefore equals the delivered counter.

The bucket of a duration of `ns` nanoseconds is `(ns >> 10).bit_length()`
(capped at LAST), so bucket i holds durations with `ns < 2 ** (i + 10)`
and `ns >= 2 ** (i + 9)` (bucket 0: under 1.024 us). No float, no bisect, no
lock: the counts are a plain list of ints that the worker sends to the master
when it is scraped (`observe` is the reference implementation of the inline
update in broky.server.shard.core, and the tests prove they agree).

The producer latency is a second histogram of the same layout: the time
from ts_producer (the publisher's clock, set by the SDK when the message is
published) to ts_broker (this worker's, when it began handling the read that
brought the message). The worker looks at the first frame of each read that
published messages: when it is a Message with a ts_producer, its age counts
once for every message of the read (a read's first message is its oldest, so
this is an upper bound for the others). It costs one struct read, a
subtraction and a bucket add per such read, in the same place as the broker
histogram's. The two clocks are only comparable when they agree: on one host
they are the same clock; across hosts the worker cannot know, so it takes an
age between PRODUCER_AHEAD_NS in the future (a producer's clock a little
ahead: counted as 0) and PRODUCER_BEHIND_NS in the past as comparable, and
counts the messages of the other reads as not comparable instead
(`producer_bucket` is the reference of that inline update).

The master turns the counts into a Prometheus histogram in seconds
(`prometheus_buckets`): the first bound is 8.2 us (buckets 0-3 folded into
it: finer resolution is noise next to a syscall, and every bucket costs a
time series per worker), then powers of two up to 17.2 s, then +Inf.
"""

from __future__ import annotations

from collections.abc import Sequence

BUCKETS = 32  # bucket 31 also holds everything above 2**40 ns (about 18 minutes)
LAST = BUCKETS - 1
FIRST_EXPORTED = 4  # buckets 0..3 are exported as one, le = 2**13 ns = 8.2 us
LAST_EXPORTED = 24  # le = 2**34 ns = 17.2 s; above goes to +Inf only
# A ts_producer this far ahead of ts_broker, or this far behind it, is not comparable.
PRODUCER_AHEAD_NS = 1_000_000_000  # 1 s
PRODUCER_BEHIND_NS = 60_000_000_000  # 60 s


def bucket_of(ns: int) -> int:
    """The bucket index of a duration in nanoseconds (negative counts as 0)."""
    if ns < 0:
        return 0
    return min((ns >> 10).bit_length(), LAST)


def producer_bucket(age_ns: int) -> int | None:
    """The bucket of a producer latency (ts_broker - ts_producer), None when the two
    clocks are not comparable (see the header)."""
    if age_ns < -PRODUCER_AHEAD_NS or age_ns > PRODUCER_BEHIND_NS:
        return None
    return bucket_of(max(age_ns, 0))


def upper_bound_seconds(index: int) -> float:
    """The exclusive upper bound of bucket `index`, in seconds."""
    return (1 << (index + 10)) / 1e9


class LatencyHistogram:
    """Counts and sum of observed durations (the worker's and the tests' reference)."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.sum_ns = 0

    def observe(self, ns: int, count: int = 1) -> None:
        """`count` deliveries of one read that took `ns` nanoseconds."""
        self.counts[bucket_of(ns)] += count
        self.sum_ns += ns * count


def merge(counts: Sequence[Sequence[int]]) -> list[int]:
    """Bucket-wise sum of several count lists (shorter lists are padded with zeros)."""
    out = [0] * BUCKETS
    for one in counts:
        for i, n in enumerate(one[:BUCKETS]):
            out[i] += int(n)
    return out


def prometheus_buckets(counts: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs in seconds, ending with +Inf = the total count."""
    counts = list(counts[:BUCKETS]) + [0] * max(0, BUCKETS - len(counts))
    out: list[tuple[str, float]] = []
    running = sum(counts[:FIRST_EXPORTED])
    out.append((_le(FIRST_EXPORTED - 1), float(running)))
    for i in range(FIRST_EXPORTED, LAST_EXPORTED + 1):
        running += counts[i]
        out.append((_le(i), float(running)))
    out.append(("+Inf", float(sum(counts))))
    return out


def _le(index: int) -> str:
    # repr: the shortest text that reads back as the exact bound (".9g" rounded
    # 1.073741824 down to 1.07374182, below durations the bucket holds)
    return repr(upper_bound_seconds(index))


def quantile(counts: Sequence[int], q: float) -> float | None:
    """An upper bound of the q-quantile in seconds (None with no observation)."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    running = 0
    for i, n in enumerate(counts):
        running += n
        if running >= rank and n:
            return upper_bound_seconds(i)
    return upper_bound_seconds(len(counts) - 1)
