"""How far the local clock is from the lease store's, measured on the lease round trips.

Nothing relies on this for safety (leases are fenced by recorded horizons, not by clocks
agreeing); it is for the operator: a host whose clock is off mints ids whose time part is off,
and hands its worker ids over slowly.

Each acquire or renew reads the store's clock (`Lease.store_ms`) at some instant between the
moment the call was sent and the moment its answer came back. So one round trip bounds the
offset (store minus local) to an interval as wide as the round trip plus the clocks'
resolutions. Intervals of successive round trips are intersected, NTP-style, which narrows a
coarse clock (etcd's Date header counts whole seconds) to a few milliseconds after some
renewals. When the intersection would be empty, a clock was stepped or has drifted: the older
samples are dropped.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

KEEP = 16  # round trips intersected: at the default ttl of 10 s, the last ~53 s
WARN_MS = 1000.0  # an offset surely beyond this is logged: ids' times are off by as much


@dataclass(frozen=True)
class Offset:
    """The store's clock minus the local clock lies within [low_ms, high_ms]."""

    low_ms: float
    high_ms: float

    @property
    def ms(self) -> float:
        """The best estimate: the middle of the interval."""
        return (self.low_ms + self.high_ms) / 2

    @property
    def error_ms(self) -> float:
        """How far the true offset can be from `ms`."""
        return (self.high_ms - self.low_ms) / 2

    def surely_beyond(self, limit_ms: float) -> bool:
        """True if the offset is larger than `limit_ms` in size, whatever its error."""
        return self.low_ms > limit_ms or self.high_ms < -limit_ms


class ClockOffset:
    """Thread-safe accumulator of round-trip samples; `current()` is the tightest bound."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=KEEP)
        self._lock = threading.Lock()

    def add(self, *, sent_ms: int, received_ms: int, store_ms: int, step_ms: int = 1) -> Offset:
        """Record one round trip and return the new estimate.

        sent_ms, received_ms: the local clock (whole ms) before the call and after its answer.
        store_ms: the store's clock during the call, truncated to a multiple of `step_ms`.
        """
        # The store's true time was in [store_ms, store_ms + step_ms), the local clock's in
        # [sent_ms, received_ms + 1) at that same instant.
        low = store_ms - (received_ms + 1)
        high = store_ms + step_ms - sent_ms
        with self._lock:
            self._samples.append((float(low), float(high)))
            return self._intersect()

    def current(self) -> Offset | None:
        with self._lock:
            return self._intersect() if self._samples else None

    def _intersect(self) -> Offset:
        """The newest samples' common interval; older ones that disagree are dropped."""
        low, high = self._samples[-1]
        kept = 1
        for sample_low, sample_high in reversed(list(self._samples)[:-1]):
            if max(low, sample_low) > min(high, sample_high):
                break
            low, high = max(low, sample_low), min(high, sample_high)
            kept += 1
        while len(self._samples) > kept:
            self._samples.popleft()
        return Offset(low, high)
