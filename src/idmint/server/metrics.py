"""What an operator watches, of every worker: Prometheus metrics for /metrics (the Exporter, on
prometheus-client), and one view for /v1/stats and the dashboard (WorkerViews, combine_views).
The metrics, and the figures they take from a process, are declared in metrics_sources.py.

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
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, values
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .._errors import InvalidArgument
from ..ids import is_digits
from .metrics_sources import (
    COUNTER,
    DC_COUNTS,
    DC_KEY_FIELDS,
    QUORUM,
    SNOWFLAKE_FIELDS,
    SPEC,
    SPECS,
    Sources,
    key_values,
    runway_value,
)

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
            (
                "idmint_keys_store_errors",
                sum(1 for name, c in src.counts.items() if src.store_error(name, c.failing)),
            ),
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
            if state.get("required") is not None:
                self._put("idmint_store_replicas_required", (), float(state["required"]))
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
            if not is_digits(pid) or int(pid) == os.getpid() or not pid_running(int(pid)):
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


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs (another user's too)."""
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
