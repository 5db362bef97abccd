"""How fast each client address may open connections: a token bucket per address.

Theory of operation
-------------------
`AddressRate.allow(address, now)` says whether a handshake from `address` may
go on: each address has a bucket of `burst` tokens, refilled at `rate` per
second, and a handshake takes one. So an address may open `burst`
connections at once (an SDK client that connects to every worker, a process
pool starting together), then `rate` a second; a client that reconnects in a
loop, or a flood from one address, is refused before its Hello is read
(broky.server.master.process), which costs the master an accept and one small write.

The table of buckets is bounded: past MAX_ADDRESSES, the buckets that have
refilled (those addresses are owed nothing) are dropped, and if that is not
enough, the least recently used half. A dropped bucket starts full again,
so the bound can only make the limit more lenient, never refuse a client that
is within it. Rate 0 turns the limit off.
"""

from __future__ import annotations

MAX_ADDRESSES = 65_536


class AddressRate:
    """Token buckets keyed by client address (`rate` per second, at most `burst` at once)."""

    __slots__ = ("rate", "burst", "buckets", "max_addresses")

    def __init__(self, rate: float, burst: int, max_addresses: int = MAX_ADDRESSES) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.max_addresses = max_addresses
        self.buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, as of when); LRU order

    def allow(self, address: str, now: float) -> bool:
        """Take a token of `address`'s bucket if it has one (`now`: a monotonic time)."""
        if self.rate <= 0:
            return True
        buckets = self.buckets
        got = buckets.pop(address, None)
        if got is None:
            tokens = float(self.burst)
            if len(buckets) >= self.max_addresses:
                self._shrink(now)
        else:
            tokens = min(float(self.burst), got[0] + (now - got[1]) * self.rate)
        allowed = tokens >= 1.0
        buckets[address] = (tokens - 1.0 if allowed else tokens, now)  # the most recent last
        return allowed

    def _shrink(self, now: float) -> None:
        full_after = self.burst / self.rate
        buckets = self.buckets
        for address in [a for a, (_, when) in buckets.items() if now - when >= full_after]:
            del buckets[address]
        if len(buckets) >= self.max_addresses:
            for address in list(buckets)[: len(buckets) // 2]:
                del buckets[address]


__all__ = ["AddressRate"]
