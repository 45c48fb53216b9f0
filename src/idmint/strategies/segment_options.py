"""What a segment generator is given (SegmentOptions) and what it reports (GeneratorCounts,
SegmentStats): plain data, for the server's metrics and the dashboard as much as for the
generator (segment.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from .._errors import InvalidArgument
from ..ids import Range, check_count, check_stripe


@dataclass(frozen=True)
class SegmentOptions:
    """How a segment generator sizes and refills its ranges. The defaults are Leaf's.

    preload_at: the fraction of the current range used when the next one is loaded.
    max_step: the largest range the dynamic step grows to (never below the key's step).
    grow_below / shrink_above: seconds a range lasted: under `grow_below` the next range is
        twice as large, over `shrink_above` half as large (never below the key's step).
    wait: seconds a caller waits for a range when nothing is buffered before it gets
        StoreUnavailable.
    retry_after: seconds a KeyNotFound or Exhausted answer is trusted before the store is asked
        again (a key may be created meanwhile).
    give_back: on close, return the unused tail to the store when nobody allocated after it.
    stripe: for a key with stripes, the stripe to start on (default: one chosen at random,
        which spreads processes over the stripes). A generator moves to another stripe when
        its own is contended (an allocation lost a compare-and-set) or exhausted.
    """

    preload_at: float = 0.1
    max_step: int = 1_000_000
    grow_below: float = 15 * 60.0
    shrink_above: float = 30 * 60.0
    wait: float = 1.0
    retry_after: float = 1.0
    give_back: bool = True
    stripe: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.preload_at <= 1.0:
            raise InvalidArgument(f"preload_at must be from 0 to 1, not {self.preload_at!r}")
        check_count(self.max_step, what="max_step")
        if not 0 <= self.grow_below <= self.shrink_above:
            raise InvalidArgument("grow_below must be from 0 to shrink_above")
        if self.wait <= 0 or self.retry_after < 0:
            raise InvalidArgument("wait must be above 0 and retry_after at least 0")
        if self.stripe is not None:
            check_stripe(self.stripe, 1 << 31)


class GeneratorCounts(NamedTuple):
    """A generator's running totals, read without the lock: cheap enough to read for
    100,000 generators each second (stats() builds far more)."""

    issued: int
    refills: int
    refill_seconds: float
    conflicts: int
    failing: bool  # the last refill failed


@dataclass(frozen=True)
class SegmentStats:
    """A snapshot of a generator, for metrics and the dashboard.

    density is issued / (taken - given_back - held): the share of the integers this generator
    used up that became ids. Ids still held (the rest of the current range, the next one) are
    not used up yet, so a running generator shows 1.0 unless ids were skipped; after close, a
    tail that could not be given back counts against it.
    """

    key: str
    issued: int
    taken: int
    given_back: int
    held: int
    current: Range | None
    position: int | None
    next: Range | None
    step: int | None
    refills: int
    refilling: bool
    last_refill_at: datetime | None
    last_refill_seconds: float | None
    refill_seconds_total: float
    error: str | None
    closed: bool
    #: The stripe this generator takes ranges from, of how many (1 for a plain key; None
    #: until the first refill read the key).
    stripe: int = 0
    stripes: int | None = None
    #: Compare-and-set conflicts its allocations met (engines without row locks).
    conflicts: int = 0

    @property
    def density(self) -> float:
        used_up = self.taken - self.given_back - self.held
        return self.issued / used_up if used_up else 1.0
