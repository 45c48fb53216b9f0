"""Every metric idmint exports, declared once: name, type, help, labels, and for a gauge how
the workers' values combine. The Exporter (metrics.py) makes each prometheus-client metric
from its Spec on first use; tests/test_monitoring.py checks the alerts, dashboards and
runbooks against this list, so a renamed metric fails there. Data only: importing it loads
no prometheus-client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
