"""What the server knows of itself and says about it: the store's identity and replication
as last read, the keys' rows kept fresh, rates sampled, the metrics kept in step (background
threads), and the routes that report them: /livez, /readyz, /metrics, /v1/stats, the
dashboard and /openapi.json. Each route is declared once in ROUTES."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from .. import __version__
from .._errors import IdmintError, KeyNotFound
from .._minter import Minter
from ..ids import Key
from ..stores.base import StoreIdentity
from ..stores.replication import ReplicationState, failovers
from ..strategies.datacenter import DatacenterRanges
from ..strategies.quorum import QuorumGenerator
from ..strategies.segment import GeneratorCounts
from .http import Response, json_response
from .id_routes import LEAF_ROUTE, IdRoutes
from .metrics import Exporter, WorkerViews, combine_views
from .metrics_sources import (
    RATE_WINDOW,
    RateMeter,
    Sources,
    cas_counts,
    datacenter_stats,
    quorum_stats,
)
from .openapi import E400, E503, json_ok, openapi_document, text_ok
from .pools import Pool, PoolTimeout
from .routes import CHOICE, KEYS, OPEN, Call, Param, Route
from .service import IdService

log = logging.getLogger("idmint.server")

HTML = "text/html; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
KEY_REFRESH = 5.0  # seconds between reads of every key's row (its batch cap) from the store
# ... or longer with many keys: reading them all takes at most this share of the time (100,000
# rows take about 0.3 s on SQLite, so they are read every 15 s rather than every 5).
KEY_REFRESH_SHARE = 0.02
#: With this many keys, the long-lived objects (rows, generators) are moved out of the garbage
#: collector's sight after each read of the rows (gc.freeze): a full collection over 100,000
#: keys' objects holds every thread, the event loop's too, for about 0.35 s.
FREEZE_KEYS = 10_000
#: Generators whose totals are sampled each RATE_WINDOW, in turn (a sample is about 2 us).
SAMPLE_BATCH = 20_000
#: Keys /v1/stats lists at most with ?all=1 (each is a few hundred bytes of JSON), and keys one
#: request may name with ?key=.
STATS_ALL_MAX = 10_000
NAMED_KEYS_MAX = 1000
#: How long /metrics and /v1/stats may take on their probe thread (no store call: the
#: multiprocess collection of every worker's files), within Prometheus's default 10 s timeout.
RENDER_DEADLINE = 8.0

NAMED_KEYS = Param(
    "key",
    "query",
    KEYS,
    f"Keys to show (repeat it: key=a&key=b), at most {NAMED_KEYS_MAX:,}",
    max_items=NAMED_KEYS_MAX,
)

ROUTES = (
    Route(
        "/",
        ("GET",),
        OPEN,
        "dashboard",
        "The dashboard (HTML, served offline)",
        responses={
            "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}
        },
    ),
    Route("/livez", ("GET",), OPEN, "livez", "The process is up", responses={"200": text_ok("ok")}),
    Route(
        "/readyz",
        ("GET",),
        OPEN,
        "readyz",
        "The store is reachable and buffers are warm",
        responses={"200": text_ok("ready"), "503": E503},
    ),
    Route(
        "/metrics",
        ("GET",),
        OPEN,
        "metrics",
        "Prometheus metrics of every worker: aggregates and each worker's busiest keys; with "
        "key=, those keys as the answering worker has them",
        (NAMED_KEYS,),
        responses={"200": text_ok("Prometheus text format 0.0.4"), "400": E400, "503": E503},
    ),
    Route(
        "/openapi.json",
        ("GET",),
        OPEN,
        "openapi",
        "This document",
        responses={"200": json_ok({"type": "object"})},
    ),
    Route(
        "/v1/stats",
        ("GET",),
        OPEN,
        "stats",
        "Every worker's totals, and the busiest keys with each worker's ranges (the keys "
        "named, or all: this process's), for the dashboard",
        (
            NAMED_KEYS,
            Param(
                "all",
                "query",
                CHOICE,
                f"1: every key, by name, at most {STATS_ALL_MAX:,}",
                choices=("0", "1", "true", "false"),
                default="0",
            ),
        ),
        responses={"200": json_ok({"type": "object"}), "400": E400, "503": E503},
    ),
)


class Monitor:
    """The server's view of itself and its store, the threads that keep it current, and the
    handlers of ROUTES. `opened` is the app's minter if it was opened yet (metrics never open
    it); `hot_handed` the ids the app's hot path handed out (counted apart, for speed)."""

    def __init__(
        self,
        service: IdService,
        ids: IdRoutes,
        pool: Pool,
        opened: Callable[[], Minter | None],
        hot_handed: Callable[[], int],
    ) -> None:
        self.config = config = service.config
        self._minter, self._opened = service.minter, opened
        self.service, self.ids, self.counters, self.pool = service, ids, service.counters, pool
        self._hot_handed = hot_handed
        self.started = time.time()
        self.shutting_down = False
        self.stopped = threading.Event()
        self._rates: dict[str, RateMeter] = {}
        self._counts: dict[str, GeneratorCounts] = {}  # each generator's, as last sampled
        #: prometheus-client: in multiprocess mode under `idmint serve`, the whole server's.
        self.exporter = Exporter(config.metrics_keys)
        #: Each worker's own part of /v1/stats, shared with the others (metrics.WorkerViews):
        #: with one worker, its own view is the whole.
        self.views = WorkerViews(self.exporter.path if config.workers > 1 else None)
        #: The store's identity as last read (StoreIdentity); every answer names it in the
        #: `idmint-store` header, so a client can refuse servers of two different stores.
        self.identity: StoreIdentity | None = None
        #: The store's replication as last read (every KEY_REFRESH s), None for a store
        #: without any (stores/replication.py).
        self.replication: ReplicationState | None = None
        self._dashboard: str | None = None
        #: The document of every route, set by the app once its routes are bound.
        self.document: Callable[[], dict[str, Any]] = lambda: openapi_document(__version__, ())

    def start(self) -> None:
        for target, name in (
            (self._warm_up, "idmint-warm-up"),
            (self._sample_rates, "idmint-rates"),
            (self._refresh_rows, "idmint-keys"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()

    # -- the store, as last read -------------------------------------------------------------

    def _probe_store(self) -> list[Key]:
        """Every key, and the store's identity as it is now (on a probe thread)."""
        keys = self._minter().keys()
        self._check_identity()
        self.replication = self._minter().replication()
        return keys

    def _check_identity(self) -> None:
        """Read the store's identity, and say so loudly if it changed."""
        identity = self._minter().identity()
        # Compared by id: a fenced failover moves created_ms (a new life), not the identity.
        if self.identity is not None and identity is not None and identity.id != self.identity.id:
            log.error(
                "the store's identity changed from %s to %s: it lost its data (wiped, or a "
                "new store behind the same URL); generators refuse ranges below ids they took",
                self.identity.id,
                identity.id,
            )
        self.identity = identity

    def _warm_up(self) -> None:
        """Start every key's generator, as Leaf loads every tag at start, so the first requests
        find ids buffered; /readyz says 503 until they do."""
        wait = 1.0
        while True:
            try:
                keys = self._probe_store()
                break
            except IdmintError as exc:  # the store is down: /readyz says so meanwhile
                log.warning(
                    "cannot list keys to warm up (they warm up on first use), trying again in "
                    "%g s: %s",
                    wait,
                    exc,
                )
            if self.stopped.wait(wait):
                return
            wait = min(wait * 2, 30.0)
        self.service.keep_rows(keys)
        gens = self.service.generators
        for key in keys[: self.config.warm_keys]:
            if self.shutting_down:
                return
            gens.setdefault(key.name, self._minter().segment(key.name))

    def _refresh_rows(self) -> None:
        """Read every key's row (and the store's identity) every KEY_REFRESH seconds, so a
        batch cap an admin changed on any server applies here too within that time, without a
        store read per request, and a store that changed identity is noticed without probes.
        With many keys, less often: the reads take at most KEY_REFRESH_SHARE of the time."""
        interval = KEY_REFRESH
        while not self.stopped.wait(interval):
            started = time.monotonic()
            try:
                self.service.keep_rows(self._probe_store())
            except IdmintError as exc:
                log.debug("cannot refresh the keys' rows: %s", exc)
            dcs = self._serving_datacenter()
            if dcs is not None:  # what other processes of the datacenter did (dc retire)
                try:
                    dcs.refresh_seen()
                except IdmintError as exc:
                    log.debug("cannot read the datacenter's cells again: %s", exc)
            if len(self.service.rows) >= FREEZE_KEYS:
                # Rows and generators live as long as the server; reference counting still
                # frees them when they go (they hold no cycles).
                gc.freeze()
            interval = max(KEY_REFRESH, (time.monotonic() - started) / KEY_REFRESH_SHARE)

    def _serving_datacenter(self) -> DatacenterRanges | None:
        store = self._minter().store
        return store if isinstance(store, DatacenterRanges) and store.serves else None

    # -- what this process counted -----------------------------------------------------------

    def _sample_rates(self) -> None:
        """Sample the generators' running totals once a RATE_WINDOW, so the rates are ready at
        the first read and do not depend on how often, or by how many, they are read; and copy
        this process's counts into the metrics (the other workers' scrapes read them so, at
        most a RATE_WINDOW late). At most SAMPLE_BATCH generators a window, in turn: with
        100,000 keys each is sampled every 5 s, for a few percent of a core."""
        names: list[str] = []
        gens = self.service.generators
        while not self.stopped.wait(RATE_WINDOW):
            if not names:
                names = list(gens)
            batch, names = names[:SAMPLE_BATCH], names[SAMPLE_BATCH:]
            now = time.monotonic()
            for name in batch:
                gen = gens.get(name)
                if gen is not None:
                    c = self._counts[name] = gen.counts()
                    self._rates.setdefault(name, RateMeter()).update(c.issued, now)
            try:
                src = self.sources(fresh=False)
                self.exporter.sync(src)
                if self.views.path is not None:
                    self.views.publish(self._view(src, src.busiest(self.config.metrics_keys)))
            except Exception:  # never the end of the sampling (rates, metrics) for good
                log.exception("cannot update the metrics")

    def sources(self, *, fresh: bool = True) -> Sources:
        """What this process counted, for the metrics: no store call. `fresh`: the
        generators' totals as they are now, unless there are more than SAMPLE_BATCH (then as
        last sampled: at most a few seconds old)."""
        gens = dict(self.service.generators)
        if fresh and len(gens) <= SAMPLE_BATCH:
            counts = {name: gen.counts() for name, gen in gens.items()}
        else:
            counts = dict(self._counts)
        handed = dict(self.counters.handed)
        handed[LEAF_ROUTE] += self._hot_handed()
        minter = self._opened()
        flake = self.ids.flake
        return Sources(
            counts=counts,
            gens=gens,
            rates={name: meter.rate for name, meter in list(self._rates.items())},
            rows=dict(self.service.rows),
            ranges_handed=dict(self.counters.ranges_handed),
            handed=handed,
            errors=dict(self.counters.errors),
            started=self.started,
            snowflake=flake.stats() if flake is not None else None,
            cas=cas_counts(minter.store) if minter is not None else None,
            datacenter=datacenter_stats(minter.store) if minter is not None else None,
            quorum=quorum_stats(minter.quorums()) if minter is not None else None,
            replication=self._replication_stats(),
        )

    def _replication_stats(self) -> dict[str, Any] | None:
        """The store's replication as last read and the failovers this process fenced."""
        fenced = failovers()
        if self.replication is None and not fenced:
            return None
        return {
            "state": self.replication.as_dict() if self.replication is not None else None,
            "failovers": len(fenced),
            "last_failover": asdict(fenced[-1]) if fenced else None,
        }

    # -- /livez, /readyz ---------------------------------------------------------------------

    async def livez(self, call: Call) -> Response:
        return Response(200, "ok\n")

    async def readyz(self, call: Call) -> Response:
        if self.shutting_down:
            return Response(503, "shutting down\n")
        try:
            cold = await self.pool.run(self.service.store_deadline, self._readiness)
        except (IdmintError, PoolTimeout) as exc:
            return Response(503, f"store not reachable: {' '.join(str(exc).split())}\n")
        if cold:
            return Response(503, f"not ready: {'; '.join(cold[:10])}\n")
        store = f" (store {self.identity.id})" if self.identity else ""
        return Response(200, f"ready{store}{self._replication_note()}{self._global_note()}\n")

    def _replication_note(self) -> str:
        """The store's replication as last read, for the /readyz body (never gating it: a
        store that cannot take a write safely fails the write, and the probe with it)."""
        state = self.replication
        if state is None:
            return ""
        note = f"; store {state.role}, {state.replicas} replica(s), writes wait for "
        note += str(state.waits_for)
        if state.required is not None:
            note += f", the store requires {state.required}"
        if state.shortfall is not None:
            note += f" (writes refused: {state.shortfall})"
        elif state.risk is not None:
            note += f" (at risk: {state.risk})"
        fenced = failovers()
        if fenced:
            note += f"; {len(fenced)} failover(s) fenced, the last at "
            note += datetime.fromtimestamp(fenced[-1].at, UTC).isoformat(timespec="seconds")
        return note

    def _global_note(self) -> str:
        """A datacenter server's global level and runway, for the /readyz body: reported
        beside readiness, never gating it (the datacenter serves through a partition)."""
        dcs = self._serving_datacenter()
        if dcs is None:
            return ""
        level = dcs.global_level
        if level.reachable is False:
            since = (
                f" for {time.time() - (level.since or time.time()):.0f} s" if level.since else ""
            )
            state = f"not reachable{since}: {level.error}"
        else:
            state = "reachable" if level.reachable else "not asked yet"
        runways = [s for s in dcs.seen() if s.left is not None]
        shortest = min(runways, key=lambda s: s.runway_s or math.inf, default=None)
        runway = ""
        if shortest is not None:
            left = f"{shortest.runway_s:.0f} s" if shortest.runway_s else "rate not known yet"
            runway = f"; shortest runway: key {shortest.key}, {shortest.left} ids ({left})"
        return f"; datacenter {dcs.dc} serves from its own store; global level {state}{runway}"

    def _readiness(self) -> list[str]:
        """On a probe thread: check the store answers (one key's row, and its identity; not
        every row, which with 100,000 keys would make each probe a scan), then name the keys
        with nothing buffered yet: still loading their first range, or their refills failing.
        An exhausted key ends its refills, and is no reason to take the server out."""
        dcs = self._serving_datacenter()
        if dcs is not None:
            # Ready means it can hand out ids now: through a partition from the global level,
            # a datacenter does so from its own store and its reservations.
            dcs.check_local()
        else:
            known = next(iter(self.service.rows), None)
            if known is None:  # none read yet: there are few or none
                self.service.keep_rows(self._minter().keys())
            else:
                with contextlib.suppress(KeyNotFound):  # deleted meanwhile: the store answered
                    self._minter().key(known)
            self._check_identity()
        cold = self._quorums_without_majority()
        for name, gen in sorted(list(self.service.generators.items())):
            if gen.cold():
                why = gen.failing()
                cold.append(name if why is None else f"{name} (its refills fail: {why})")
        return cold

    def _quorums_without_majority(self) -> list[str]:
        """Quorum keys whose nodes do not answer in a majority: one key per node set asks
        its nodes, as the set's keys share them."""
        cold = []
        by_set: dict[int, list[QuorumGenerator]] = {}
        for quorum in self._minter().quorums():
            by_set.setdefault(id(quorum.counter.nodes), []).append(quorum)
        for keys in by_set.values():
            counter = keys[0].counter
            answering = counter.answering(counter.options.round_wait)
            if answering < counter.majority:
                more = f" and {len(keys) - 1} more keys on its nodes" if len(keys) > 1 else ""
                cold.append(
                    f"quorum key {counter.key}{more}: {answering} of {len(counter.health())} "
                    f"nodes answer, a majority is {counter.majority}"
                )
        return cold

    # -- /metrics, /v1/stats -----------------------------------------------------------------

    async def metrics(self, call: Call) -> Response:
        """Rendered on a probe thread from what the process keeps (no store call): the event
        loop goes on answering while a scrape is read and written."""
        names = call.arg("key")
        render = self._render_metrics
        if names:
            render = functools.partial(self._render_keys, names)
        body = await self.pool.run(RENDER_DEADLINE, render)
        return Response(200, body, PROMETHEUS, (("idmint-pid", str(os.getpid())),))

    def _render_metrics(self) -> str:
        up = {
            "version": __version__,
            "store": self._minter().url,
            "store_id": self.identity.id if self.identity else "",
        }
        return self.exporter.render(self.sources(), up)

    def _render_keys(self, names: list[str]) -> str:
        return self.exporter.render_keys(self.sources(), names)

    async def stats(self, call: Call) -> Response:
        names = call.arg("key")
        everything = call.arg("all") in ("1", "true")
        body = await self.pool.run(RENDER_DEADLINE, self._stats_body, names, everything)
        return json_response(body)

    def _view(self, src: Sources, names: list[str]) -> dict[str, Any]:
        """This process's own part of /v1/stats (metrics.combine_views): keys `names` as its
        generators have them, and its snowflake worker, quorum keys and datacenter."""
        return {
            "pid": os.getpid(),
            "started": self.started,
            "keys": [s.as_dict() for name in names if (s := src.snapshot(name)) is not None],
            "snowflake": src.snowflake,
            "cas": src.cas,
            "datacenter": src.datacenter,
            "quorum": src.quorum,
            "replication": src.replication,
        }

    def _stats_body(self, names: list[str], everything: bool) -> dict[str, Any]:
        src = self.sources()
        totals = self.exporter.totals(src)
        if names:
            chosen, which = names, "named"
        elif everything:
            chosen, which = sorted(src.rows)[:STATS_ALL_MAX], "all"
        else:
            chosen, which = src.busiest(self.config.metrics_keys), "busiest"
        others = self.views.others()
        if which != "busiest":
            # Named keys, or all, as this process has them: the others write their busiest only.
            others = [view | {"keys": []} for view in others]
        # Every live worker, whichever answers: the dashboard's rows no longer change with it.
        whole = combine_views([self._view(src, chosen), *others])
        keys = whole["keys"]
        if which == "busiest":
            keys.sort(key=lambda k: str(k["name"]))  # rows that keep their place; by pid within
        return {
            "server": self._server_part(whole),
            "totals": totals,
            # Which keys follow, of how many the store has (as last read).
            "keys_shown": {
                "which": which,
                "count": len({k["name"] for k in keys}),  # keys, not rows (one per worker)
                "of": len(src.rows),
                "truncated": which == "all" and len(src.rows) > STATS_ALL_MAX,
            },
            "keys": keys,
            **{
                part: whole[part]
                for part in ("snowflake", "cas", "datacenter", "quorum", "replication")
            },
        }

    def _server_part(self, whole: dict[str, Any]) -> dict[str, Any]:
        identity = self.identity
        return {
            "version": __version__,
            "store": self._minter().url,
            "store_id": identity.id if identity else None,
            "store_created_at": (
                datetime.fromtimestamp(identity.created_ms / 1000, UTC).isoformat()
                if identity and identity.created_ms
                else None
            ),
            "pid": os.getpid(),  # the answering worker's
            "pids": whole["pids"],  # every live worker's
            "workers": self.config.workers,
            # The oldest live worker's start (each worker's would change with the answer).
            "started_at": datetime.fromtimestamp(whole["started"], UTC).isoformat(),
            "uptime_s": time.time() - whole["started"],
            "ready": not self.shutting_down,
        }

    # -- the dashboard and this document -----------------------------------------------------

    async def openapi(self, call: Call) -> Response:
        return json_response(self.document())

    async def dashboard(self, call: Call) -> Response:
        if self._dashboard is None:
            self._dashboard = (
                resources.files("idmint.server")
                .joinpath("dashboard.html")
                .read_text(encoding="utf-8")
            )
        return Response(200, self._dashboard, HTML)
