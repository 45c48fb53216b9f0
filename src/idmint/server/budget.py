"""How fast a key's ids may go out over HTTP: a budget per key and server process.

Without a client token the id routes are open to anyone, and a bounded key (a 32-bit key has
about 2.1 billion ids) would be burnt for good by a few seconds of large requests. So each key
gets a token bucket of ids: it refills at the key's whole id space over `days` (a 32-bit key
over 30 days: 829 ids/s), holds an hour of that (about 3 million ids of a 32-bit key: bursts,
backfills) or one full batch, whichever is more, and a request it cannot pay for is refused
with 429 and Retry-After. A 64-bit key's budget is beyond
any request rate, so it gets no bucket and the hot path pays one comparison.
"""

from __future__ import annotations

import math
import time

from ..ids import Key

SECONDS_A_DAY = 86_400
#: Above this many ids a second a budget never binds: no bucket is kept.
UNLIMITED_RATE = 1e9
#: Seconds of the budget a full bucket holds (a burst after a quiet while).
BURST_SECONDS = 3600.0


class OverBudget(Exception):
    """A request the key's budget cannot pay for now."""

    def __init__(self, key: Key, rate: float, days: float, retry_after: float) -> None:
        super().__init__(
            f"key {key.name!r} hands out at most {rate:,.0f} ids/s over HTTP per server process "
            f"(its {key.last_id - key.first_id + 1:,} ids would last {days:g} days at that rate; "
            f"--id-budget-days, IDMINT_ID_BUDGET_DAYS); try again in {retry_after:.0f} s"
        )
        self.retry_after = retry_after


class _Bucket:
    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, time.monotonic()


class IdBudget:
    """The budgets of every key this process serves (event-loop use only: no lock)."""

    def __init__(self, days: float) -> None:
        self.days = days  # 0: no budget
        self._buckets: dict[str, _Bucket | None] = {}

    def rate(self, key: Key) -> float:
        """The key's budget in ids a second (infinite with no budget)."""
        if not self.days:
            return math.inf
        return (key.last_id - key.first_id + 1) / (self.days * SECONDS_A_DAY)

    def charge(self, key: Key, ids: int) -> None:
        """Take `ids` from the key's budget, or raise OverBudget (nothing taken)."""
        bucket = self._buckets[key.name] if key.name in self._buckets else self._make(key)
        if bucket is None:
            return
        now = time.monotonic()
        bucket.level = min(bucket.capacity, bucket.level + (now - bucket.stamp) * bucket.rate)
        bucket.stamp = now
        if ids > bucket.level:
            wait = (ids - bucket.level) / bucket.rate
            raise OverBudget(key, bucket.rate, self.days, max(1.0, math.ceil(wait)))
        bucket.level -= ids

    def _make(self, key: Key) -> _Bucket | None:
        rate = self.rate(key)
        made = None
        if rate < UNLIMITED_RATE:
            made = _Bucket(rate, max(rate * BURST_SECONDS, float(key.batch_cap)))
        if len(self._buckets) > 1_000_000:  # made-up names never get here: rows exist
            self._buckets.clear()
        self._buckets[key.name] = made
        return made
