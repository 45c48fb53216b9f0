"""Every metric idmint exports, declared once (SPECS), and what one process knows of its keys,
read without store I/O (Sources), with the figures made from it for the metrics and /v1/stats:
a key's snapshot, its per-key series, the stats blocks of the other strategies. The Exporter
(metrics.py) makes each metric from its Spec on first use; tests/test_monitoring.py checks the
alerts, dashboards and runbooks against SPECS, so a renamed metric fails there. Nothing here
imports prometheus-client.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..ids import Key, Range
from ..stores.over_cas.ranges import CasCounts
from ..strategies.datacenter import DatacenterRanges
from ..strategies.quorum import QuorumGenerator
from ..strategies.segment import GeneratorCounts, SegmentGenerator, SegmentStats

COUNTER, GAUGE = "counter", "gauge"
KEY = ("key",)
Mode = Literal["liveall", "livemin", "livemax", "livesum"]


@dataclass(frozen=True)
class Spec:
    """One metric: its name, type, help and labels, and for a gauge how the values of the
    workers combine in multiprocess mode (prometheus-client's modes; all are live ones, so a
    worker that stops gracefully takes its gauges along)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    mode: Mode = "livesum"


QUORUM = (
    ("ids", "Ids of the quorum key handed out."),
    ("rounds", "Rounds a majority of the nodes accepted."),
    ("retries", "Rounds lost (no majority: contention, nodes down) and tried again."),
    ("burnt", "Ids a lost round claimed on some nodes: skipped, never handed out."),
    ("requests", "Requests served (group commit: many per round)."),
    ("failures", "Requests that ended in an error (QuorumUnavailable past the deadline)."),
)
SPECS = [
    # Every key, summed: what stays meaningful with 100,000 keys.
    Spec("idmint_keys_ids_issued_total", COUNTER, "Ids handed out by the generators, all keys."),
    Spec("idmint_keys_allocations_total", COUNTER, "Ranges the generators took, all keys."),
    Spec("idmint_keys_allocation_seconds_total", COUNTER, "Time spent taking them, all keys."),
    Spec("idmint_keys_ranges_handed_total", COUNTER, "Ids handed to clients as ranges, all keys."),
    Spec(
        "idmint_keys_conflicts_total",
        COUNTER,
        "Compare-and-set conflicts the allocations met, all keys.",
    ),
    Spec("idmint_keys_store_errors", GAUGE, "Keys whose last refill failed, over live workers."),
    Spec(
        "idmint_keys_served",
        GAUGE,
        "Keys with a generator, summed over the live workers (each has its own).",
    ),
    Spec("idmint_keys_ids_rate", GAUGE, "Ids handed out per second, recently, all keys."),
    Spec("idmint_keys", GAUGE, "Keys in the store, as last read.", mode="livemax"),
    # Per key, for each process's busiest keys.
    Spec("idmint_ids_issued_total", COUNTER, "Ids handed out by the key's generators.", KEY),
    Spec("idmint_allocations_total", COUNTER, "Ranges taken from the store by generators.", KEY),
    Spec("idmint_allocation_seconds_total", COUNTER, "Time spent taking those ranges.", KEY),
    Spec(
        "idmint_allocation_last_seconds",
        GAUGE,
        "Latency of the last range taken (the slowest worker's).",
        KEY,
        "livemax",
    ),
    Spec(
        "idmint_buffer_fill_ratio",
        GAUGE,
        "Share of the current range still unserved (the emptiest worker's).",
        KEY,
        "livemin",
    ),
    Spec(
        "idmint_buffer_next_ready",
        GAUGE,
        "1 when the next range is already loaded (in every worker).",
        KEY,
        "livemin",
    ),
    Spec(
        "idmint_step",
        GAUGE,
        "The dynamic step: size of the last range taken (largest).",
        KEY,
        "livemax",
    ),
    Spec(
        "idmint_density_ratio",
        GAUGE,
        "Ids issued / integers used up, held ones excluded (the lowest worker's).",
        KEY,
        "livemin",
    ),
    Spec(
        "idmint_store_errors",
        GAUGE,
        "1 while the last refill of the key failed (in any worker).",
        KEY,
        "livemax",
    ),
    Spec("idmint_ids_rate", GAUGE, "Ids handed out per second, recently (all workers).", KEY),
    Spec(
        "idmint_segment_conflicts_total",
        COUNTER,
        "Compare-and-set conflicts the allocations met (engines without row locks); each moves "
        "the generator to another stripe of a striped key.",
        KEY,
    ),
    Spec(
        "idmint_segment_stripe",
        GAUGE,
        "The stripe each worker's generator takes ranges from (0 for a plain key).",
        KEY,
        "liveall",
    ),
    Spec(
        "idmint_key_stripes",
        GAUGE,
        "The key's stripes: independent counters (store).",
        KEY,
        "livemax",
    ),
    Spec("idmint_ranges_handed_total", COUNTER, "Ids handed to clients as whole ranges.", KEY),
    Spec(
        "idmint_key_remaining",
        GAUGE,
        "Ids a bounded key can still hand out (store, as last read).",
        KEY,
        "livemin",
    ),
    Spec(
        "idmint_key_runway_seconds",
        GAUGE,
        "Seconds until a bounded key runs out at one worker's current rate (the lowest).",
        KEY,
        "livemin",
    ),
    # The server's requests.
    Spec(
        "idmint_ids_handed_total",
        COUNTER,
        "Ids handed out over HTTP, per route (a range counts all its ids).",
        ("route",),
    ),
    Spec(
        "idmint_http_errors_total",
        COUNTER,
        "Requests answered with an error status.",
        ("route", "status"),
    ),
    Spec(
        "idmint_cas_conflicts_total",
        COUNTER,
        "Compare-and-set writes another writer won (stores over CAS cells).",
    ),
    Spec(
        "idmint_cas_retries_total",
        COUNTER,
        "Store operations that needed more than one compare-and-set.",
    ),
    # A datacenter's keys (labels key, dc) and its level's counts (label dc).
    Spec(
        "idmint_dc_reservation_left",
        GAUGE,
        "Ids the datacenter can hand out without the global level (its reservation's rest and "
        "the preloaded one), as the workers last saw them (the lowest).",
        ("key", "dc"),
        "livemin",
    ),
    Spec(
        "idmint_dc_runway_seconds",
        GAUGE,
        "Seconds the datacenter can serve cut off from the global level, at its rate.",
        ("key", "dc"),
        "livemin",
    ),
    Spec(
        "idmint_dc_rate_ids_per_second",
        GAUGE,
        "The datacenter's rate over its window.",
        ("key", "dc"),
        "livemax",
    ),
    Spec(
        "idmint_dc_grants",
        GAUGE,
        "Reservations the datacenter has taken.",
        ("key", "dc"),
        "livemax",
    ),
    Spec(
        "idmint_store_replicas",
        GAUGE,
        "Replicas connected to the store's primary, as last read (Redis, PostgreSQL).",
        (),
        "livemax",
    ),
    Spec(
        "idmint_store_replicas_waited",
        GAUGE,
        "Replicas each write waits for before it counts; below idmint_store_replicas, a "
        "failover can lose acknowledged ranges (the fence then moves keys past them).",
        (),
        "livemin",
    ),
    Spec(
        "idmint_store_replicas_required",
        GAUGE,
        "Replicas the store requires each write to wait for (the most its writes have "
        "waited for; only `idmint replicas --set` lowers it). Above "
        "idmint_store_replicas_waited, every write is refused.",
        (),
        "livemax",
    ),
    Spec(
        "idmint_store_failovers_total",
        COUNTER,
        "Failovers of the store's primary this server detected and fenced.",
        (),
    ),
    Spec(
        "idmint_dc_global_up",
        GAUGE,
        "1 while the datacenter's last call to the global level answered, 0 while cut off "
        "(it serves on its reservations meanwhile: see idmint_dc_runway_seconds).",
        ("dc",),
        "livemin",
    ),
    Spec(
        "idmint_dc_global_cas_total",
        COUNTER,
        "Compare-and-sets tried on global cells.",
        ("dc",),
    ),
    Spec(
        "idmint_dc_global_conflicts_total",
        COUNTER,
        "Global compare-and-sets another writer won.",
        ("dc",),
    ),
    Spec(
        "idmint_dc_local_conflicts_total",
        COUNTER,
        "Compare-and-sets on the datacenter's cells another process won.",
        ("dc",),
    ),
    Spec(
        "idmint_dc_preload_failures_total",
        COUNTER,
        "Background reservations that failed (global level out of reach).",
        ("dc",),
    ),
    Spec(
        "idmint_dc_runway_spent_total",
        COUNTER,
        "Allocations refused with RunwaySpent (cut off, nothing left).",
        ("dc",),
    ),
    # The snowflake generator: each worker leases its own worker id.
    Spec("idmint_snowflake_worker_id", GAUGE, "The leased worker id.", ("layout",), "liveall"),
    Spec(
        "idmint_snowflake_lease_deadline_seconds",
        GAUGE,
        "Seconds until the lease lapses without a renewal.",
        ("layout",),
        "liveall",
    ),
    Spec(
        "idmint_snowflake_clock_rollbacks_total",
        COUNTER,
        "Clock steps back larger than the generator waits out.",
        ("layout",),
    ),
    Spec(
        "idmint_snowflake_runway_years",
        GAUGE,
        "Years until the layout's time bits run out.",
        ("layout",),
        "livemin",
    ),
    Spec(
        "idmint_snowflake_clock_offset_seconds",
        GAUGE,
        "The lease store's clock minus this worker's, measured on lease round trips.",
        ("layout",),
        "liveall",
    ),
    Spec(
        "idmint_snowflake_clock_offset_error_seconds",
        GAUGE,
        "How far the true clock offset can be from the measured one.",
        ("layout",),
        "liveall",
    ),
    # Quorum keys (few, configured): every one served.
    *(Spec(f"idmint_quorum_{field_}_total", COUNTER, help_, KEY) for field_, help_ in QUORUM),
    Spec(
        "idmint_quorum_node_up",
        GAUGE,
        "1 if the node's last call answered, 0 if it failed, in every worker (no series before "
        "the first call).",
        ("key", "node"),
        "livemin",
    ),
    Spec(
        "idmint_quorum_node_counter",
        GAUGE,
        "The highest counter of the key the node answered with.",
        ("key", "node"),
        "livemax",
    ),
    Spec(
        "idmint_uptime_seconds",
        GAUGE,
        "Seconds since each worker started.",
        mode="liveall",
    ),
]
SPEC = {s.name: s for s in SPECS}
DC_KEY_FIELDS = (
    ("idmint_dc_reservation_left", "left"),
    ("idmint_dc_runway_seconds", "runway_s"),
    ("idmint_dc_rate_ids_per_second", "rate"),
    ("idmint_dc_grants", "grants"),
)
DC_COUNTS = (
    "global_cas",
    "global_conflicts",
    "local_conflicts",
    "preload_failures",
    "runway_spent",
)
SNOWFLAKE_FIELDS = (
    ("idmint_snowflake_worker_id", "worker_id"),
    ("idmint_snowflake_lease_deadline_seconds", "lease_deadline_s"),
    ("idmint_snowflake_clock_rollbacks_total", "rollbacks"),
    ("idmint_snowflake_runway_years", "runway_years"),
    ("idmint_snowflake_clock_offset_seconds", "clock_offset_ms"),
    ("idmint_snowflake_clock_offset_error_seconds", "clock_offset_error_ms"),
)

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

    def store_error(self, name: str, failing: bool) -> bool:
        """Whether the key's failing refills are a store error: not for a retired key, whose
        refills fail by design (`idmint keys retire`; issue 31 row 10)."""
        row = self.rows.get(name)
        return failing and not (row is not None and row.retired)

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
            ("idmint_store_errors", 1.0 if src.store_error(name, st.error is not None) else 0.0),
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
