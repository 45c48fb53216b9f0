"""What one process knows of its keys, read without store I/O (Sources), and the figures made
from it: a key's snapshot for the dashboard, its per-key series, and the stats blocks of the
other strategies. The Exporter (metrics.py) copies these into prometheus-client; the app
reads them for /v1/stats. Nothing here imports prometheus-client.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ids import Key, Range
from ..stores.over_cas.ranges import CasCounts
from ..strategies.datacenter import DatacenterRanges
from ..strategies.quorum import QuorumGenerator
from ..strategies.segment import GeneratorCounts, SegmentGenerator, SegmentStats

RATE_WINDOW = 1.0  # seconds between two samples of every key's issued count


@dataclass(slots=True)
class RateMeter:
    """Ids per second of one key, between the last two samples of its issued counter (the
    server takes one every RATE_WINDOW, on its own thread, whoever reads the rate)."""

    at: float = 0.0
    issued: int = 0
    rate: float = 0.0

    def update(self, issued: int, now: float) -> None:
        if self.at and now > self.at:
            self.rate = max(0.0, (issued - self.issued) / (now - self.at))
        self.at, self.issued = now, issued


@dataclass
class KeySnapshot:
    key: Key
    stats: SegmentStats | None
    rate: float
    ranges_handed: int = 0

    @property
    def runway_s(self) -> float | None:
        """Seconds until a bounded key runs out at this process's current rate."""
        if not self.key.bounded or self.rate <= 0:
            return None
        return self.key.remaining / self.rate

    @property
    def fill(self) -> float | None:
        """Share of the current range still unserved."""
        s = self.stats
        if s is None or s.current is None or s.position is None or not len(s.current):
            return None
        return len(Range(s.position, s.current.stop, s.current.stride)) / len(s.current)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.key.as_dict())
        s = self.stats
        out["ranges_handed"] = self.ranges_handed
        out["generator"] = None
        if s is not None:
            out["generator"] = {
                "current": _range(s.current),
                "position": s.position,
                "next": _range(s.next),
                "fill": self.fill,
                "step": s.step,
                "refills": s.refills,
                "refilling": s.refilling,
                "last_refill_at": s.last_refill_at.isoformat() if s.last_refill_at else None,
                "last_refill_ms": (
                    s.last_refill_seconds * 1000 if s.last_refill_seconds is not None else None
                ),
                "issued": s.issued,
                "taken": s.taken,
                "given_back": s.given_back,
                "density": s.density,
                "rate_per_s": self.rate,
                "runway_s": self.runway_s,
                "error": s.error,
                # The stripe this process takes ranges from, of how many (None until its
                # first range), and the compare-and-set conflicts its allocations met.
                "stripe": s.stripe,
                "stripes": s.stripes,
                "conflicts": s.conflicts,
            }
        return out


def _range(r: Range | None) -> dict[str, int] | None:
    return None if r is None else r.as_dict()


def cas_counts(store: object) -> dict[str, int] | None:
    """What the compare-and-set loops of a store over CAS cells did (CasRangeStore.counts);
    None for stores with row locks (SQL), which have no such loops."""
    counts = getattr(store, "counts", None)
    if not isinstance(counts, CasCounts):
        return None
    return {"conflicts": counts.conflicts, "retries": counts.retries}


def datacenter_stats(store: object) -> dict[str, Any] | None:
    """A datacenter's keys as this process last saw them (reservation left, rate, runway) and
    what its datacenter level did; None unless the server serves datacenter keys."""
    if not isinstance(store, DatacenterRanges) or store.serves is None:
        return None
    return {
        "dc": store.dc,
        "global": store.global_level.as_dict(),
        "counts": asdict(store.counts),
        "keys": [s.as_dict() for s in store.seen()],
    }


def quorum_stats(quorums: list[QuorumGenerator]) -> list[dict[str, Any]] | None:
    """Each quorum key this process served: ids, rounds, retries, burnt ids, and its nodes'
    health as the last calls showed it (no node call here); None for a server without."""
    if not quorums:
        return None
    return [asdict(q.stats()) for q in quorums]


@dataclass
class Counters:
    """Request outcomes: errors by status, ranges handed per key, ids handed per route."""

    errors: dict[tuple[str, int], int] = field(default_factory=dict)
    ranges_handed: dict[str, int] = field(default_factory=dict)
    #: Ids handed out per route (the route's pattern): one int add per request, no lock (the
    #: event loop is the only writer).
    handed: dict[str, int] = field(default_factory=dict)

    def error(self, route: str, status: int) -> None:
        self.errors[route, status] = self.errors.get((route, status), 0) + 1


@dataclass
class Sources:
    """What one process knows, read without store I/O: its generators' stats (taken once per
    sync), rates, the keys' rows as last read, and its request counts."""

    #: Every generator's running totals (cheap); full stats only of the keys shown, read on
    #: demand (stats_of) from `gens`.
    counts: dict[str, GeneratorCounts]
    gens: dict[str, SegmentGenerator]
    rates: dict[str, float]
    rows: dict[str, Key]
    ranges_handed: dict[str, int]
    handed: dict[str, int]
    errors: dict[tuple[str, int], int]
    started: float
    snowflake: dict[str, Any] | None = None
    cas: dict[str, int] | None = None
    datacenter: dict[str, Any] | None = None
    quorum: list[dict[str, Any]] | None = None
    replication: dict[str, Any] | None = None
    _stats: dict[str, SegmentStats] = field(default_factory=dict)

    def stats_of(self, name: str) -> SegmentStats | None:
        """The key's generator's stats, read once per Sources; None without a generator."""
        stats = self._stats.get(name)
        if stats is None and (gen := self.gens.get(name)) is not None:
            stats = self._stats[name] = gen.stats()
        return stats

    def snapshot(self, name: str) -> KeySnapshot | None:
        row = self.rows.get(name)
        if row is None:
            return None
        stats = self.stats_of(name)
        rate = self.rates.get(name, 0.0) if stats is not None else 0.0
        return KeySnapshot(row, stats, rate, self.ranges_handed.get(name, 0))

    def busiest(self, n: int) -> list[str]:
        """The n keys this process handed out most ids of (generators and ranges), busiest
        first; keys known from the store fill the rest (by name), when there is room."""
        if n <= 0:
            return []

        def handed(name: str) -> int:
            counts = self.counts.get(name)
            return (counts.issued if counts is not None else 0) + self.ranges_handed.get(name, 0)

        active = set(self.counts) | set(self.ranges_handed)
        top = heapq.nsmallest(n, active, key=lambda name: (-handed(name), name))
        if len(top) < n:
            top += heapq.nsmallest(n - len(top), set(self.rows) - active)
        return top


def runway_value(seconds: float | None) -> float:
    """A runway gauge's value: with no ids going out (no rate), none runs out: +Inf. Written,
    not left out, as a gauge not written keeps its last value: a burst's short runway would
    stay on the graphs, and in the alerts, after the burst."""
    return math.inf if seconds is None else seconds


def key_values(name: str, src: Sources) -> list[tuple[str, float]]:
    """The per-key series of one key as this process sees them: (metric, value)."""
    out: list[tuple[str, float]] = [("idmint_ranges_handed_total", src.ranges_handed.get(name, 0))]
    st = src.stats_of(name)
    if st is not None:
        rate = src.rates.get(name, 0.0)
        out += [
            ("idmint_ids_issued_total", st.issued),
            ("idmint_allocations_total", st.refills),
            ("idmint_allocation_seconds_total", st.refill_seconds_total),
            ("idmint_allocation_last_seconds", st.last_refill_seconds or 0.0),
            ("idmint_buffer_next_ready", 1.0 if st.next is not None else 0.0),
            ("idmint_step", st.step or 0),
            ("idmint_density_ratio", st.density),
            ("idmint_store_errors", 1.0 if st.error else 0.0),
            ("idmint_ids_rate", rate),
            ("idmint_segment_conflicts_total", st.conflicts),
            ("idmint_segment_stripe", st.stripe),
        ]
    snapshot = src.snapshot(name)
    if snapshot is not None:
        if st is not None:
            out.append(("idmint_buffer_fill_ratio", snapshot.fill or 0.0))
        out.append(("idmint_key_stripes", snapshot.key.stripes))
        if snapshot.key.bounded:
            out.append(("idmint_key_remaining", snapshot.key.remaining))
            out.append(("idmint_key_runway_seconds", runway_value(snapshot.runway_s)))
    return out
