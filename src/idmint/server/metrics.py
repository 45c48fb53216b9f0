"""What an operator watches: one snapshot per key, as JSON for the dashboard, and Prometheus
metrics for /metrics (prometheus-client).

Each granian worker has its own generators and counts. Under `idmint serve` every worker writes
its figures to prometheus-client's multiprocess files (PROMETHEUS_MULTIPROC_DIR) and a scrape of
any worker reads all the files: counters are summed over every worker that ever ran in this
server run (a dead worker's file stays), so no counter goes down between two scrapes, whichever
worker answers. An App built without that variable (a library user's, the tests') keeps its own
registry.

Nothing here is on the hot path: the generators and the app keep plain counts; `Exporter.sync`
copies them into prometheus-client once a second (on the app's sampling thread) and right
before a scrape is rendered, counters by their increase since the last sync.

Per-key series exist only for each process's busiest `metrics_keys` keys (most ids issued):
with 100,000 keys a series per key would be millions of lines, and a multiprocess file never
forgets a label set. Every key counts in the aggregate `idmint_keys_*` series."""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, values
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .._errors import InvalidArgument
from ..ids import Key, Range, is_digits
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


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
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


def _runway(seconds: float | None) -> float:
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
            out.append(("idmint_key_runway_seconds", _runway(snapshot.runway_s)))
    return out


def multiprocess_dir() -> str | None:
    """The multiprocess directory (PROMETHEUS_MULTIPROC_DIR), None when the variable is not
    set; one that is not a directory is refused (prometheus-client would fail on every metric,
    and an in-memory fallback would hide that each worker counts alone)."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return None
    if not os.path.isdir(path):
        raise InvalidArgument(f"{MULTIPROC_ENV}={path} is not a directory")
    return path


class _Families:
    """A collector of ready-made families, for generate_latest."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


class _WithoutCreated:
    """A registry's families without the `_created` samples prometheus-client adds to counters
    in a single process (multiprocess mode has none): the same series either way."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Exporter:
    """The prometheus-client side of one process: its metric objects, the values last copied
    into them (a counter grows by the increase since), and the collection a scrape reads."""

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self.path = multiprocess_dir()
        self._lock = threading.Lock()
        self._closed = False
        self._metrics: dict[str, Counter | Gauge] = {}
        self._synced: dict[tuple[str, tuple[str, ...]], float] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector: MultiProcessCollector | _WithoutCreated
        if self.path is not None:
            # prometheus-client picks its value class when first imported; a process that
            # imported it before the variable was set would keep its values in memory only.
            if not getattr(values.ValueClass, "_multiprocess", False):
                values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
            self._collector = MultiProcessCollector(None, self.path)  # type: ignore[no-untyped-call]
        else:
            self._collector = _WithoutCreated(self.registry)

    @property
    def multiprocess(self) -> bool:
        return self.path is not None

    def _metric(self, name: str) -> Counter | Gauge:
        metric = self._metrics.get(name)
        if metric is None:  # made on first use: a metric without labels shows from then on
            spec = SPEC[name]
            # In multiprocess mode the values live in the files, not in a registry.
            registry = None if self.multiprocess else self.registry
            if spec.kind == COUNTER:
                metric = Counter(name, spec.help, spec.labels, registry=registry)
            else:
                metric = Gauge(
                    name, spec.help, spec.labels, registry=registry, multiprocess_mode=spec.mode
                )
            self._metrics[name] = metric
        return metric

    def _put(self, name: str, labels: tuple[str, ...], value: float) -> None:
        metric = self._metric(name)
        child = metric.labels(*labels) if labels else metric
        last = self._synced.get((name, labels))
        if isinstance(child, Counter):
            # By the increase: a count that went down came from a new source (a generator made
            # again), counted from zero.
            grown = value - last if last is not None and value >= last else value
            if grown > 0 or last is None:
                child.inc(grown)
        elif value != last:
            child.set(value)
        self._synced[name, labels] = value

    def sync(self, src: Sources) -> None:
        """Copy what the process counted into prometheus-client (once a second, and before a
        scrape is rendered); serialised, so two syncs never count one increase twice."""
        with self._lock:
            if not self._closed:  # nothing after mark_process_dead: it would be a live gauge
                self._sync(src)

    def _sync(self, src: Sources) -> None:
        counts = list(src.counts.values())
        for name, value in (
            ("idmint_keys_ids_issued_total", sum(c.issued for c in counts)),
            ("idmint_keys_allocations_total", sum(c.refills for c in counts)),
            ("idmint_keys_allocation_seconds_total", sum(c.refill_seconds for c in counts)),
            ("idmint_keys_ranges_handed_total", sum(src.ranges_handed.values())),
            ("idmint_keys_conflicts_total", sum(c.conflicts for c in counts)),
            ("idmint_keys_store_errors", sum(1 for c in counts if c.failing)),
            ("idmint_keys_served", len(counts)),
            ("idmint_keys_ids_rate", sum(src.rates.get(k, 0.0) for k in src.counts)),
            ("idmint_keys", len(src.rows)),
            ("idmint_uptime_seconds", time.time() - src.started),
        ):
            self._put(name, (), float(value))
        top = src.busiest(self.keys)
        for key in top:
            for name, value in key_values(key, src):
                self._put(name, (key,), float(value))
        for route, n in src.handed.items():
            self._put("idmint_ids_handed_total", (route,), n)
        for (route, status), n in src.errors.items():
            self._put("idmint_http_errors_total", (route, str(status)), n)
        if src.cas is not None:
            self._put("idmint_cas_conflicts_total", (), src.cas["conflicts"])
            self._put("idmint_cas_retries_total", (), src.cas["retries"])
        if src.datacenter is not None:
            dc = str(src.datacenter["dc"])
            chosen = set(top)
            for seen in src.datacenter["keys"]:
                if seen["key"] in chosen:
                    for name, field_ in DC_KEY_FIELDS:
                        value = seen[field_]
                        if field_ == "runway_s" and seen["left"] is not None:
                            value = _runway(value)
                        if value is not None:
                            self._put(name, (seen["key"], dc), float(value))
            reachable = src.datacenter["global"]["reachable"]
            if reachable is not None:
                self._put("idmint_dc_global_up", (dc,), float(reachable))
            for field_ in DC_COUNTS:
                value = float(src.datacenter["counts"][field_])
                self._put(f"idmint_dc_{field_}_total", (dc,), value)
        if src.snowflake is not None:
            layout = (str(src.snowflake["layout"]),)
            for name, field_ in SNOWFLAKE_FIELDS:
                value = src.snowflake[field_]
                if value is None:  # no offset from a store without a clock (memory, static)
                    continue
                self._put(name, layout, float(value) / (1000 if field_.endswith("_ms") else 1))
        if src.replication is not None:
            state = src.replication["state"]
            if state is not None:
                self._put("idmint_store_replicas", (), float(state["replicas"]))
                self._put("idmint_store_replicas_waited", (), float(state["waits_for"]))
            self._put("idmint_store_failovers_total", (), float(src.replication["failovers"]))
        for q in src.quorum or []:
            for field_, _ in QUORUM:
                self._put(f"idmint_quorum_{field_}_total", (q["key"],), float(q[field_]))
            for node in q["nodes"]:
                labels = (q["key"], node["url"])
                if node["up"] is not None:
                    self._put("idmint_quorum_node_up", labels, float(node["up"]))
                self._put("idmint_quorum_node_counter", labels, float(node["counter"]))

    def collect(self) -> list[Metric]:
        """Every worker's series (multiprocess), or this process's."""
        return list(self._collector.collect())

    def render(self, src: Sources, up: dict[str, str]) -> str:
        """The exposition: `idmint_up` (the answering worker's labels), then every series."""
        self.sync(src)
        family = GaugeMetricFamily(
            "idmint_up", "1 while the server runs; labels describe it.", labels=list(up)
        )
        family.add_metric(list(up.values()), 1)
        return (generate_latest(_Families([family])) + generate_latest(self)).decode()

    def render_keys(self, src: Sources, keys: list[str]) -> str:
        """The per-key series of `keys` as this process has them (label pid): no aggregation,
        no store call; keys this process knows nothing of have no series."""
        pid = str(os.getpid())
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for key in keys:
            for name, value in key_values(key, src):
                family = families.get(name)
                if family is None:
                    spec = SPEC[name]
                    kind = CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily
                    family = families[name] = kind(name, spec.help, labels=["key", "pid"])
                family.add_metric([key, pid], float(value))
        ordered = [families[s.name] for s in SPECS if s.name in families]
        return generate_latest(_Families(ordered)).decode()

    def totals(self, src: Sources) -> dict[str, Any]:
        """The aggregate figures of every worker, from the same collection as /metrics."""
        self.sync(src)
        sums: dict[str, float] = {}
        routes: dict[str, float] = {}
        workers, errors = 0, 0.0
        for family in self.collect():
            for sample in family.samples:
                if sample.name == "idmint_ids_handed_total":
                    routes[sample.labels["route"]] = sample.value
                elif sample.name == "idmint_http_errors_total":
                    errors += sample.value
                elif sample.name == "idmint_uptime_seconds":
                    workers += 1  # one series per live worker (liveall)
                elif not sample.labels:
                    sums[sample.name] = sample.value

        def whole(value: float) -> int | float:
            return int(value) if float(value).is_integer() else value

        return {
            "ids_issued": whole(sums.get("idmint_keys_ids_issued_total", 0)),
            "allocations": whole(sums.get("idmint_keys_allocations_total", 0)),
            "allocation_seconds": sums.get("idmint_keys_allocation_seconds_total", 0.0),
            "ranges_handed": whole(sums.get("idmint_keys_ranges_handed_total", 0)),
            "conflicts": whole(sums.get("idmint_keys_conflicts_total", 0)),
            "store_errors": whole(sums.get("idmint_keys_store_errors", 0)),
            "keys_served": whole(sums.get("idmint_keys_served", 0)),
            "rate_per_s": sums.get("idmint_keys_ids_rate", 0.0),
            "keys": whole(sums.get("idmint_keys", 0)),
            "ids_handed": {route: whole(n) for route, n in sorted(routes.items())},
            "http_errors": whole(errors),
            "workers": workers,
        }

    def close(self, src: Sources | None = None) -> None:
        """A last sync (counters complete for a graceful stop), then this worker's live gauges
        go (prometheus-client's mark_process_dead); its counters stay in the totals."""
        if src is not None:
            self.sync(src)
        with self._lock:
            self._closed = True
        if self.path is not None:
            mark_process_dead(os.getpid(), self.path)  # type: ignore[no-untyped-call]


# -- one view of every worker, for /v1/stats -------------------------------------------------
#
# /metrics combines the workers by prometheus-client's rules, but the dashboard shows more than
# numbers: each generator's ranges, each quorum node's last error, a datacenter key retired.
# So each worker also writes its own part of /v1/stats (a "view") next to its metrics files,
# once a RATE_WINDOW on its sampling thread, and whichever worker answers reads the others'
# and combines them: every answer then shows every worker, the same whichever answers. Ranges
# are each worker's own, so they stay one row per worker (nothing is made up by adding them);
# what the workers share (a quorum node, a datacenter's cell, a store's counts) is combined by
# the rules below. Cost, measured with the default 100 keys: a 62 KB file per worker written
# once a second (2.8 ms), and 0.5 ms per other worker to read and combine on each /v1/stats.

VIEW_PREFIX = "idmint_view_"  # not *.db: prometheus-client's collector reads only those
#: A view not written again for this long is left out: its worker writes one every RATE_WINDOW
#: and removes it when it stops gracefully, so it is a hung worker's, or a killed one's whose
#: pid runs another process.
VIEW_STALE = 10.0


class WorkerViews:
    """This worker's view written to the multiprocess directory, and the other workers' read
    from it; does nothing without a directory (one worker: its own view is the whole)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._closed = False

    def _file(self, pid: int) -> str:
        assert self.path is not None
        return os.path.join(self.path, f"{VIEW_PREFIX}{pid}.json")

    def publish(self, view: dict[str, Any]) -> None:
        """Replace this worker's view (atomically: a reader sees the old one or the new)."""
        if self.path is None:
            return
        body = json.dumps(view, separators=(",", ":"))
        with self._lock:
            if self._closed:  # after remove(): a view written now would outlive the worker
                return
            own = self._file(os.getpid())
            with open(own + ".tmp", "w", encoding="utf-8") as out:
                out.write(body)
            os.replace(own + ".tmp", own)

    def others(self) -> list[dict[str, Any]]:
        """The other live workers' views (not this one's: the caller has it fresh)."""
        if self.path is None:
            return []
        now, found = time.time(), []
        try:
            entries = list(os.scandir(self.path))
        except OSError:  # the directory goes when the server exits
            return []
        for entry in entries:
            if not entry.name.startswith(VIEW_PREFIX) or not entry.name.endswith(".json"):
                continue
            pid = entry.name[len(VIEW_PREFIX) : -len(".json")]
            if not is_digits(pid) or int(pid) == os.getpid() or not _running(int(pid)):
                continue  # this worker's (the caller has it fresh), or a killed worker's
            try:
                if now - entry.stat().st_mtime > VIEW_STALE:
                    continue
                with open(entry.path, encoding="utf-8") as view:
                    found.append(json.load(view))
            except (OSError, ValueError):  # removed meanwhile: its worker stopped
                continue
        return found

    def remove(self) -> None:
        """This worker stops: its view goes (its counters stay in the totals)."""
        with self._lock:
            self._closed = True
            if self.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._file(os.getpid()))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: not ours, but running
        return True
    return True


def combine_views(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Every worker's view as one: keys, snowflake, cas, datacenter, quorum, replication, and
    the workers' pids and first start. The same whatever order the views come in."""
    views = sorted(views, key=lambda v: int(v["pid"]))
    return {
        "pids": [v["pid"] for v in views],
        "started": min(float(v["started"]) for v in views),
        "keys": _combine_keys(views),
        "snowflake": _combine_snowflake([v["snowflake"] for v in views if v["snowflake"]]),
        "cas": _sum_fields([v["cas"] for v in views if v["cas"]]),
        "datacenter": _combine_datacenter([v["datacenter"] for v in views if v["datacenter"]]),
        "quorum": _combine_quorum([q for v in views for q in v["quorum"] or []]),
        "replication": _combine_replication([v["replication"] for v in views if v["replication"]]),
    }


def _combine_keys(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per key and worker that has a generator for it (with its pid); a key no
    worker serves yet, once (pid None: its row as the first worker has it). Keys in the order
    first met, each one's workers by pid."""
    met: dict[str, list[dict[str, Any]]] = {}
    for view in views:
        for key in view["keys"]:
            met.setdefault(key["name"], []).append(key | {"pid": view["pid"]})
    shown = []
    for seen in met.values():
        shown += [k for k in seen if k["generator"] is not None] or [seen[0] | {"pid": None}]
    return shown


def _sum_fields(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Counts of each worker, added up (a store's compare-and-sets, a datacenter's calls)."""
    if not parts:
        return None
    return {name: sum(part[name] for part in parts) for name in parts[0]}


def _combine_snowflake(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each worker leases its own worker id: all of them, the lease nearest to lapsing, the
    clock furthest off the store's, the rollbacks and renewals of all."""
    if not parts:
        return None
    deadlines = [p["lease_deadline_s"] for p in parts if p["lease_deadline_s"] is not None]
    clock = max(parts, key=lambda p: abs(p["clock_offset_ms"] or 0.0))
    return parts[0] | {
        "worker_id": min(p["worker_id"] for p in parts),
        "worker_ids": sorted(p["worker_id"] for p in parts),
        "lease_deadline_s": min(deadlines, default=None),
        "clock_offset_ms": clock["clock_offset_ms"],
        "clock_offset_error_ms": clock["clock_offset_error_ms"],
        "rollbacks": sum(p["rollbacks"] for p in parts),
        "renewals": sum(p["renewals"] for p in parts),
        "runway_years": min(p["runway_years"] for p in parts),
    }


def _combine_datacenter(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A datacenter's cell of a key is one, which each worker saw when it last wrote or read
    it: the most advanced sight of it (most grants applied, then the highest next id; retired
    first on a tie, as retiring moves nothing forward) is the newest. The global level: the
    latest change any worker saw (a worker that needs no reservation does not call it, and
    would show a partition long healed). The level's calls: every worker's."""
    if not parts:
        return None
    cells: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        for cell in part["keys"]:
            cells.setdefault(cell["key"], []).append(cell)
    newest = [
        max(seen, key=lambda c: (c["grants"], c["next_id"] or 0, c["retired"]))
        for _, seen in sorted(cells.items())
    ]
    asked = [p["global"] for p in parts if p["global"]["reachable"] is not None]
    level = max(asked, key=lambda g: g["since"] or 0.0, default=parts[0]["global"])
    return {
        "dc": parts[0]["dc"],
        "global": level,
        "counts": _sum_fields([p["counts"] for p in parts]),
        "keys": newest,
    }


def _combine_quorum(parts: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Each quorum key any worker served: every worker's counts added up, and each node as
    idmint_quorum_node_up has it: down if its last call failed in any worker (up only if it
    answered in every worker that called it), its highest counter and latest answer."""
    if not parts:
        return None
    by_key: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        by_key.setdefault(part["key"], []).append(part)
    shown = []
    for name, stats in sorted(by_key.items()):
        nodes: dict[str, list[dict[str, Any]]] = {}
        for part in stats:
            for node in part["nodes"]:
                nodes.setdefault(node["url"], []).append(node)
        shown.append(
            stats[0]
            | {
                field_: sum(p[field_] for p in stats)
                for field_ in ("ids", "rounds", "retries", "burnt", "requests", "failures")
            }
            | {
                "key": name,
                "largest_batch": max(p["largest_batch"] for p in stats),
                "last_error": next((p["last_error"] for p in stats if p["last_error"]), None),
                "closed": any(p["closed"] for p in stats),
                "workers": len(stats),
                "nodes": [_combine_node(seen) for seen in nodes.values()],
            }
        )
    return shown


def _combine_node(seen: list[dict[str, Any]]) -> dict[str, Any]:
    ups = [n["up"] for n in seen if n["up"] is not None]
    down = next((n for n in seen if n["up"] is False), None)
    answered = [n["last_ok_at"] for n in seen if n["last_ok_at"] is not None]
    return seen[0] | {
        "up": None if not ups else all(ups),
        "counter": max(n["counter"] for n in seen),
        "last_error": down["last_error"] if down else None,
        "last_ok_at": max(answered, default=None),
        "in_flight": any(n["in_flight"] for n in seen),
        "refused": next((n["refused"] for n in seen if n["refused"]), None),
    }


def _combine_replication(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Every worker reads the same store's replication: the first state read; a failover is
    one however many workers fenced it."""
    if not parts:
        return None
    fenced = [p["last_failover"] for p in parts if p["last_failover"]]
    return {
        "state": next((p["state"] for p in parts if p["state"]), None),
        "failovers": max(p["failovers"] for p in parts),
        "last_failover": max(fenced, key=lambda f: f["at"], default=None),
    }
