"""What an operator watches: one snapshot per key, as JSON for the dashboard and as Prometheus
text for /metrics. Figures are this server process's own (each granian worker has its own
generators); the key's remaining ids come from the store and are the same everywhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ids import Key, Range
from ..stores.cas_ranges import CasCounts
from ..strategies.datacenter import DatacenterRanges
from ..strategies.quorum import QuorumGenerator
from ..strategies.segment import SegmentStats

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


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(
    snapshots: list[KeySnapshot],
    counters: Counters,
    info: dict[str, Any],
    snowflake: dict[str, Any] | None = None,
    cas: dict[str, int] | None = None,
    datacenter: dict[str, Any] | None = None,
    quorum: list[dict[str, Any]] | None = None,
) -> str:
    """The Prometheus text exposition format, version 0.0.4."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, rows: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in rows:
            text = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {value:.17g}" if text else f"{name} {value:.17g}")

    live = [(s, s.stats) for s in snapshots if s.stats is not None]

    def k(snapshot: KeySnapshot) -> dict[str, str]:
        return {"key": snapshot.key.name}

    metric(
        "idmint_up",
        "gauge",
        "1 while the server runs; labels describe it.",
        [
            (
                {
                    "version": str(info["version"]),
                    "store": str(info["store"]),
                    "store_id": str(info.get("store_id", "")),
                },
                1,
            )
        ],
    )
    metric(
        "idmint_ids_issued_total",
        "counter",
        "Ids handed out by this process.",
        [(k(s), st.issued) for s, st in live],
    )
    metric(
        "idmint_allocations_total",
        "counter",
        "Ranges taken from the store by generators.",
        [(k(s), st.refills) for s, st in live],
    )
    metric(
        "idmint_allocation_seconds_total",
        "counter",
        "Time spent taking those ranges.",
        [(k(s), st.refill_seconds_total) for s, st in live],
    )
    metric(
        "idmint_allocation_last_seconds",
        "gauge",
        "Latency of the last range taken.",
        [(k(s), st.last_refill_seconds or 0.0) for s, st in live],
    )
    metric(
        "idmint_buffer_fill_ratio",
        "gauge",
        "Share of the current range still unserved.",
        [(k(s), s.fill or 0.0) for s, _ in live],
    )
    metric(
        "idmint_buffer_next_ready",
        "gauge",
        "1 when the next range is already loaded.",
        [(k(s), 1.0 if st.next is not None else 0.0) for s, st in live],
    )
    metric(
        "idmint_step",
        "gauge",
        "The dynamic step: size of the last range taken.",
        [(k(s), st.step or 0) for s, st in live],
    )
    metric(
        "idmint_density_ratio",
        "gauge",
        "Ids issued / integers used up (held ones excluded).",
        [(k(s), st.density) for s, st in live],
    )
    metric(
        "idmint_store_errors",
        "gauge",
        "1 while the last refill of the key failed.",
        [(k(s), 1.0 if st.error else 0.0) for s, st in live],
    )
    metric(
        "idmint_ids_rate",
        "gauge",
        "Ids handed out per second, recently.",
        [(k(s), s.rate) for s, _ in live],
    )
    metric(
        "idmint_segment_conflicts_total",
        "counter",
        "Compare-and-set conflicts this process's allocations met (engines without row locks); "
        "each moves the generator to another stripe of a striped key.",
        [(k(s), st.conflicts) for s, st in live],
    )
    metric(
        "idmint_segment_stripe",
        "gauge",
        "The stripe this process's generator takes ranges from (0 for a plain key).",
        [(k(s), st.stripe) for s, st in live],
    )
    metric(
        "idmint_key_stripes",
        "gauge",
        "The key's stripes: independent counters (store).",
        [(k(s), s.key.stripes) for s in snapshots],
    )
    metric(
        "idmint_ranges_handed_total",
        "counter",
        "Ids handed to clients as whole ranges.",
        [(k(s), s.ranges_handed) for s in snapshots],
    )
    metric(
        "idmint_key_remaining",
        "gauge",
        "Ids a bounded key can still hand out (store).",
        [(k(s), s.key.remaining) for s in snapshots if s.key.bounded],
    )
    metric(
        "idmint_key_runway_seconds",
        "gauge",
        "Seconds until a bounded key runs out at this process's current rate.",
        [(k(s), s.runway_s) for s in snapshots if s.runway_s is not None],
    )
    metric(
        "idmint_ids_handed_total",
        "counter",
        "Ids handed out by this process over HTTP, per route (a range counts all its ids).",
        [({"route": route}, n) for route, n in sorted(counters.handed.items())],
    )
    metric(
        "idmint_http_errors_total",
        "counter",
        "Requests answered with an error status.",
        [({"route": r, "status": str(c)}, n) for (r, c), n in sorted(counters.errors.items())],
    )
    if cas is not None:
        metric(
            "idmint_cas_conflicts_total",
            "counter",
            "Compare-and-set writes of this process another writer won (stores over CAS cells).",
            [({}, cas["conflicts"])],
        )
        metric(
            "idmint_cas_retries_total",
            "counter",
            "Store operations of this process that needed more than one compare-and-set.",
            [({}, cas["retries"])],
        )
    if datacenter is not None:
        _datacenter_metrics(metric, datacenter)
    if snowflake is not None:
        layout = {"layout": str(snowflake["layout"])}
        for name, kind, help_, field in (
            ("idmint_snowflake_worker_id", "gauge", "The leased worker id.", "worker_id"),
            (
                "idmint_snowflake_lease_deadline_seconds",
                "gauge",
                "Seconds until the lease lapses without a renewal.",
                "lease_deadline_s",
            ),
            (
                "idmint_snowflake_clock_rollbacks_total",
                "counter",
                "Clock steps back larger than the generator waits out.",
                "rollbacks",
            ),
            (
                "idmint_snowflake_runway_years",
                "gauge",
                "Years until the layout's time bits run out.",
                "runway_years",
            ),
            (
                "idmint_snowflake_clock_offset_seconds",
                "gauge",
                "The lease store's clock minus this process's, measured on lease round trips.",
                "clock_offset_ms",
            ),
            (
                "idmint_snowflake_clock_offset_error_seconds",
                "gauge",
                "How far the true clock offset can be from the measured one.",
                "clock_offset_error_ms",
            ),
        ):
            value = snowflake[field]
            if value is None:  # no offset from a store without a clock (memory, static)
                continue
            if field.endswith("_ms"):
                value = float(value) / 1000
            metric(name, kind, help_, [(layout, float(value))])
    if quorum is not None:
        _quorum_metrics(metric, quorum)
    metric(
        "idmint_uptime_seconds",
        "gauge",
        "Seconds since this process started.",
        [({}, time.time() - float(info["started"]))],
    )
    return "\n".join(lines) + "\n"


Emit = Callable[[str, str, str, list[tuple[dict[str, str], float]]], None]


def _quorum_metrics(metric: Emit, quorum: list[dict[str, Any]]) -> None:
    for field_, help_ in (
        ("ids", "Ids of the quorum key this process handed out."),
        ("rounds", "Rounds a majority of the nodes accepted."),
        ("retries", "Rounds lost (no majority: contention, nodes down) and tried again."),
        ("burnt", "Ids a lost round claimed on some nodes: skipped, never handed out."),
        ("requests", "Requests served (group commit: many per round)."),
        ("failures", "Requests that ended in an error (QuorumUnavailable past the deadline)."),
    ):
        rows = [({"key": q["key"]}, float(q[field_])) for q in quorum]
        metric(f"idmint_quorum_{field_}_total", "counter", help_, rows)
    nodes = [(q["key"], n) for q in quorum for n in q["nodes"]]
    metric(
        "idmint_quorum_node_up",
        "gauge",
        "1 if the node's last call answered, 0 if it failed (no series before the first call).",
        [({"key": k, "node": n["url"]}, float(n["up"])) for k, n in nodes if n["up"] is not None],
    )
    metric(
        "idmint_quorum_node_counter",
        "gauge",
        "The highest counter of the key the node answered with.",
        [({"key": k, "node": n["url"]}, float(n["counter"])) for k, n in nodes],
    )


def _datacenter_metrics(metric: Emit, datacenter: dict[str, Any]) -> None:
    dc = str(datacenter["dc"])
    keys = datacenter["keys"]
    for name, help_, field_ in (
        (
            "idmint_dc_reservation_left",
            "Ids the datacenter can hand out without the global level (its reservation's rest "
            "and the preloaded one), as this process last saw them.",
            "left",
        ),
        (
            "idmint_dc_runway_seconds",
            "Seconds the datacenter can serve cut off from the global level, at its rate.",
            "runway_s",
        ),
        ("idmint_dc_rate_ids_per_second", "The datacenter's rate over its window.", "rate"),
        ("idmint_dc_grants", "Reservations the datacenter has taken.", "grants"),
    ):
        rows = [
            ({"key": s["key"], "dc": dc}, float(s[field_])) for s in keys if s[field_] is not None
        ]
        metric(name, "gauge", help_, rows)
    for field_, help_ in (
        ("global_cas", "Compare-and-sets this process tried on global cells."),
        ("global_conflicts", "Global compare-and-sets another writer won."),
        ("local_conflicts", "Compare-and-sets on the datacenter's cells another process won."),
        ("preload_failures", "Background reservations that failed (global level out of reach)."),
        ("runway_spent", "Allocations refused with RunwaySpent (cut off, nothing left)."),
    ):
        value = float(datacenter["counts"][field_])
        metric(f"idmint_dc_{field_}_total", "counter", help_, [({"dc": dc}, value)])
