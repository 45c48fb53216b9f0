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

import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, values
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .._errors import InvalidArgument
from .metrics_sources import (
    RATE_WINDOW,
    Counters,
    KeySnapshot,
    RateMeter,
    Sources,
    cas_counts,
    datacenter_stats,
    key_values,
    quorum_stats,
    runway_value,
)
from .metrics_specs import (
    COUNTER,
    DC_COUNTS,
    DC_KEY_FIELDS,
    GAUGE,
    KEY,
    QUORUM,
    SNOWFLAKE_FIELDS,
    SPEC,
    SPECS,
    Mode,
    Spec,
)
from .metrics_views import VIEW_PREFIX, VIEW_STALE, WorkerViews, combine_views

# This module is the metrics' public face (the app, run.py and the tests import from here).
# Its parts: metrics_specs.py (every metric, declared), metrics_sources.py (what a process
# knows, and the figures made from it), metrics_views.py (every worker's view, for
# /v1/stats); this module keeps the prometheus-client side, the Exporter.
__all__ = [
    "COUNTER",
    "DC_COUNTS",
    "DC_KEY_FIELDS",
    "GAUGE",
    "KEY",
    "MULTIPROC_ENV",
    "QUORUM",
    "RATE_WINDOW",
    "SNOWFLAKE_FIELDS",
    "SPEC",
    "SPECS",
    "VIEW_PREFIX",
    "VIEW_STALE",
    "Counters",
    "Exporter",
    "KeySnapshot",
    "Mode",
    "RateMeter",
    "Sources",
    "Spec",
    "WorkerViews",
    "cas_counts",
    "combine_views",
    "datacenter_stats",
    "key_values",
    "multiprocess_dir",
    "quorum_stats",
]


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


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
        # In the order the series were first written before this was split up: in a single
        # process, the exposition lists the metrics in the order they were first made.
        self._sync_totals(src)
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
            self._sync_datacenter(src.datacenter, set(top))
        if src.snowflake is not None:
            self._sync_snowflake(src.snowflake)
        if src.replication is not None:
            self._sync_replication(src.replication)
        for q in src.quorum or []:
            self._sync_quorum(q)

    def _sync_totals(self, src: Sources) -> None:
        """The aggregate `idmint_keys_*` series: every key counts, shown or not."""
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

    def _sync_datacenter(self, datacenter: dict[str, Any], chosen: set[str]) -> None:
        """A datacenter's keys among the `chosen` ones, and its level's counts."""
        dc = str(datacenter["dc"])
        for seen in datacenter["keys"]:
            if seen["key"] in chosen:
                for name, field_ in DC_KEY_FIELDS:
                    value = seen[field_]
                    if field_ == "runway_s" and seen["left"] is not None:
                        value = runway_value(value)
                    if value is not None:
                        self._put(name, (seen["key"], dc), float(value))
        reachable = datacenter["global"]["reachable"]
        if reachable is not None:
            self._put("idmint_dc_global_up", (dc,), float(reachable))
        for field_ in DC_COUNTS:
            value = float(datacenter["counts"][field_])
            self._put(f"idmint_dc_{field_}_total", (dc,), value)

    def _sync_snowflake(self, snowflake: dict[str, Any]) -> None:
        layout = (str(snowflake["layout"]),)
        for name, field_ in SNOWFLAKE_FIELDS:
            value = snowflake[field_]
            if value is None:  # no offset from a store without a clock (memory, static)
                continue
            self._put(name, layout, float(value) / (1000 if field_.endswith("_ms") else 1))

    def _sync_replication(self, replication: dict[str, Any]) -> None:
        state = replication["state"]
        if state is not None:
            self._put("idmint_store_replicas", (), float(state["replicas"]))
            self._put("idmint_store_replicas_waited", (), float(state["waits_for"]))
        self._put("idmint_store_failovers_total", (), float(replication["failovers"]))

    def _sync_quorum(self, q: dict[str, Any]) -> None:
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
