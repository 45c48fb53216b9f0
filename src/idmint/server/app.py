"""The HTTP app: one request handler with an RSGI shell (granian) and an ASGI shell (uvicorn).

The id routes call the generator's non-blocking hot path on the event loop; only when nothing is
buffered does a request wait for the store, on a thread. Store work for admin, readiness and
metrics always runs on a thread. Each kind has its own bounded pool, and every wait for the
store has a deadline (pools.py), so a hung store holds up no route behind another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import ipaddress
import logging
import math
import os
import threading
import time
from collections.abc import MutableMapping
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from .. import __version__
from .._errors import (
    Exhausted,
    IdmintError,
    KeyNotFound,
    StoreUnavailable,
)
from .._minter import Minter, allocate_any, connect
from ..ids import (
    BATCH_CAP_MAX,
    BATCH_CAP_STEPS,
    DEFAULT_FIRST_ID,
    DEFAULT_STEP,
    ID_MAX,
    MAX_STRIPES,
    Allocation,
    Key,
    check_key_name,
    check_stripe,
    is_digits,
)
from ..layout import layout_named
from ..stores.base import STORE_HEADER, StoreIdentity
from ..stores.replication import ReplicationState, failovers
from ..strategies.datacenter import DatacenterRanges
from ..strategies.quorum import QuorumGenerator, QuorumOptions, split_nodes
from ..strategies.refills import set_shared_threads
from ..strategies.segment import GeneratorCounts, SegmentGenerator, SegmentOptions
from ..strategies.snowflake import SnowflakeGenerator, SnowflakeOptions
from .budget import IdBudget, OverBudget
from .config import ServerConfig
from .dropin import (
    COSID_DISTRIBUTOR,
    COSID_ID,
    COSID_SEGMENT,
    ID_ROUTES,
    QUERY_TOKEN,
    TINYID_IDS,
    TINYID_IDS_SIMPLE,
    TINYID_SEGMENT,
    TINYID_SEGMENT_SIMPLE,
    DropIn,
)
from .http import (
    MAX_IDS,
    MAX_RANGE,
    NUMBER,
    STATUS_OF,
    TEXT,
    Handler,
    HttpError,
    Request,
    Response,
    bearer_in,
    bearer_is,
    json_response,
)
from .metrics import (
    RATE_WINDOW,
    Counters,
    Exporter,
    RateMeter,
    Sources,
    WorkerViews,
    cas_counts,
    combine_views,
    datacenter_stats,
    quorum_stats,
)
from .openapi import openapi_document
from .pools import Pool, PoolTimeout

log = logging.getLogger("idmint.server")

#: The largest `max` of a key made over HTTP: what a key with the most stripes may have, which
#: /openapi.json can state for every request (a key's bound depends on its stripes). Leaving
#: max out gives the key the highest it may have.
HTTP_KEY_MAX = ID_MAX + 1 - MAX_STRIPES
MAX_QUORUM = 1_000_000  # ids per quorum request: a range, however many
MAX_BODY = 64 * 1024
NEGATIVE_CACHE_SECONDS = 1.0
# Threads, and jobs queued or running, per pool (see pools.py): the id routes' slow path
# (waiting for a range, unknown keys, whole ranges, the snowflake generator), key admin, and
# the probes (readiness, metrics, stats).
ID_THREADS, ID_SLOTS = 16, 64
ADMIN_THREADS, ADMIN_SLOTS = 4, 16
PROBE_THREADS, PROBE_SLOTS = 4, 16
CLOSE_SHARE = 0.6  # of the shutdown timeout, for giving unused ids back

HTML = "text/html; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
_HOT_HEADERS = [("content-type", TEXT)]
_HOT_PREFIX = "/api/segment/get/"
LEAF_ROUTE = _HOT_PREFIX + "{key}"
IDS_ROUTE = "/v1/keys/{key}/ids"
RANGES_ROUTE = "/v1/keys/{key}/ranges"
SNOWFLAKE_ROUTE = "/api/snowflake/get/{key}"
#: The methods a Spring @RequestMapping with no method answers: Leaf's and tinyid's routes
#: answer them all, so their clients may use any.
SPRING_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
SNOWFLAKE_IDS_ROUTE = "/v1/snowflake/ids"
QUORUM_ROUTE = "/v1/quorum/{key}/ids"
DECODE_ROUTE = "/v1/snowflake/decode/{key}"
# Who may call a route: anyone, holders of the client token (when one is set), the admin.
OPEN, IDS, ADMIN = "open", "ids", "admin"
BATCH_CAP_HEADER = "idmint-batch-cap"
# On a 410: the key's maximum, and for one exhausted stripe of a striped key, which stripe and
# how many the key has (a client's generator then moves to another stripe).
LAST_ID_HEADER = "idmint-last-id"
STRIPE_HEADER = "idmint-stripe"
STRIPES_HEADER = "idmint-stripes"
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


_CLOSE = (("connection", "close"),)


async def _read_body(length: str | None, proto: Any) -> bytes | None:
    """The request body as granian streams it, or None as soon as it is over MAX_BODY: the
    rest is never read (reading the whole body first let a 1 GiB POST take a worker to
    2.7 GB before its size was checked)."""
    if length is not None and is_digits(length.strip()) and int(length) > MAX_BODY:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in proto:
        size += len(chunk)
        if size > MAX_BODY:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _wake(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Settle `future` on its loop, from a refill thread."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
        loop.call_soon_threadsafe(_settle, future)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _check_cap(row: Key, asked: int, what: str) -> None:
    """Refuse a request for more ids than the key's batch cap, naming the cap (also in a
    header, for clients that size their requests by it)."""
    if asked <= row.batch_cap:
        return
    rule = (
        "set by an admin"
        if row.max_batch
        else f"the default: the key's step x {BATCH_CAP_STEPS}, at most {BATCH_CAP_MAX}"
    )
    raise HttpError(
        400,
        f"{what} {asked} is over key {row.name!r}'s cap of {row.batch_cap} ids per request "
        f"({rule}); ask for fewer, or have an admin change max_batch "
        f"(PATCH /v1/keys/{row.name})",
        ((BATCH_CAP_HEADER, str(row.batch_cap)),),
    )


def _is_loopback(client: str) -> bool:
    try:
        return ipaddress.ip_address(client).is_loopback
    except ValueError:
        return False


def _int_field(data: dict[str, Any], name: str, default: int) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{name} must be an integer, not {value!r}")
    return value


def _exhausted_headers(exc: Exhausted) -> tuple[tuple[str, str], ...]:
    """What a 410 says besides its reason: the key's maximum and, when only one stripe of a
    striped key is exhausted, which one and how many the key has."""
    headers: list[tuple[str, str]] = []
    if exc.last_id is not None:
        headers.append((LAST_ID_HEADER, str(exc.last_id)))
    if exc.stripe is not None and exc.stripes:
        headers += [(STRIPE_HEADER, str(exc.stripe)), (STRIPES_HEADER, str(exc.stripes))]
    return tuple(headers)


class App:
    """The idmint server. Build it with a config (or from IDMINT_* variables) and serve it with
    granian (RSGI) or any ASGI server."""

    def __init__(self, config: ServerConfig | None = None, minter: Minter | None = None) -> None:
        self.config = config or ServerConfig.from_env()
        set_shared_threads(self.config.refill_threads)
        self._minter = minter
        self.options = SegmentOptions(
            wait=self.config.wait,
            max_step=self.config.max_step,
            preload_at=self.config.preload_at,
        )
        self.started = time.time()
        self.shutting_down = False
        self.counters = Counters()
        self._dropin = DropIn(self)  # tinyid's and CosId's routes
        # Every id route from the start, so a request adds to an entry that is there; the hot
        # path counts its ids apart (hot_handed), added to Leaf's route when metrics are read.
        for route in (
            LEAF_ROUTE,
            IDS_ROUTE,
            RANGES_ROUTE,
            SNOWFLAKE_ROUTE,
            SNOWFLAKE_IDS_ROUTE,
            QUORUM_ROUTE,
            *ID_ROUTES,
        ):
            self.counters.handed[route] = 0
        self.hot_handed = 0
        self._gens: dict[str, SegmentGenerator] = {}
        self._quorums: dict[str, QuorumGenerator] = {}
        # Names found to be no key (of the kind asked for), and until when that is trusted.
        self._missing: dict[str, tuple[float, KeyNotFound]] = {}
        # Ids per second each key may hand out over HTTP in this process (budget.py).
        self._budget = IdBudget(self.config.id_budget_days)
        self._rates: dict[str, RateMeter] = {}
        self._counts: dict[str, GeneratorCounts] = {}  # each generator's, as last sampled
        #: prometheus-client: in multiprocess mode under `idmint serve`, the whole server's.
        self.exporter = Exporter(self.config.metrics_keys)
        #: Each worker's own part of /v1/stats, shared with the others (metrics.WorkerViews):
        #: with one worker, its own view is the whole.
        self.views = WorkerViews(self.exporter.path if self.config.workers > 1 else None)
        self._stopped = threading.Event()
        #: The store's identity as last read (StoreIdentity); every answer names it in the
        #: `idmint-store` header, so a client can refuse servers of two different stores.
        self.identity: StoreIdentity | None = None
        #: The store's replication as last read (every KEY_REFRESH s), None for a store
        #: without any (stores/replication.py).
        self.replication: ReplicationState | None = None
        self._dashboard: str | None = None
        self._flake: SnowflakeGenerator | None = None
        self._flake_lock = threading.Lock()
        self.pools = {
            "id": Pool("id", ID_THREADS, ID_SLOTS),
            "admin": Pool("admin", ADMIN_THREADS, ADMIN_SLOTS),
            "probe": Pool("probe", PROBE_THREADS, PROBE_SLOTS),
        }
        # How long a request waits for the store: a store call, or a range on top of it.
        self._store_deadline = self.config.timeout
        self._id_deadline = self.config.timeout + self.config.wait
        # Bearer headers the hot path accepts as they are (any other form of a good token
        # takes the full path, which parses the header): none, and the id routes are open,
        # unless a client token is set (the admin token alone guards admin only).
        self._id_bearers = (
            tuple(f"Bearer {t}" for t in (self.config.client_token, self.config.token) if t)
            if self.config.client_token
            else ()
        )
        self._key_rows: dict[str, Key] = {}  # each key's row as last read: its batch cap
        self._routes: dict[str, dict[str, tuple[Handler, str]]] = {
            "/": {"GET": (self.dashboard, OPEN)},
            "/livez": {"GET": (self.livez, OPEN)},
            "/readyz": {"GET": (self.readyz, OPEN)},
            "/metrics": {"GET": (self.metrics, OPEN)},
            "/openapi.json": {"GET": (self.openapi, OPEN)},
            "/v1/stats": {"GET": (self.stats, OPEN)},
            "/v1/keys": {"GET": (self.list_keys, ADMIN), "POST": (self.add_key, ADMIN)},
            LEAF_ROUTE: dict.fromkeys(SPRING_METHODS, (self.leaf_get, IDS)),
            "/v1/keys/{key}": {"GET": (self.show_key, ADMIN), "PATCH": (self.update_key, ADMIN)},
            IDS_ROUTE: {"GET": (self.ids, IDS)},
            RANGES_ROUTE: {"POST": (self.ranges, IDS)},
            "/v1/keys/{key}/raise": {"POST": (self.raise_key, ADMIN)},
            SNOWFLAKE_ROUTE: dict.fromkeys(SPRING_METHODS, (self.snowflake_get, IDS)),
            SNOWFLAKE_IDS_ROUTE: {"GET": (self.snowflake_ids, IDS)},
            QUORUM_ROUTE: {"GET": (self.quorum_ids, IDS)},
            "/decodeSnowflakeId": dict.fromkeys(SPRING_METHODS, (self.leaf_decode, OPEN)),
            DECODE_ROUTE: {"GET": (self.snowflake_decode, OPEN)},
            # Drop-in routes (dropin.py): tinyid's take the client token as `token=` too.
            **{
                route: dict.fromkeys(SPRING_METHODS, (handler, QUERY_TOKEN))
                for route, handler in (
                    (TINYID_IDS, self._dropin.tinyid_ids),
                    (TINYID_IDS_SIMPLE, self._dropin.tinyid_ids_simple),
                    (TINYID_SEGMENT, self._dropin.tinyid_segment),
                    (TINYID_SEGMENT_SIMPLE, self._dropin.tinyid_segment_simple),
                )
            },
            COSID_ID: {"GET": (self._dropin.cosid_id, IDS)},
            COSID_SEGMENT: {"PATCH": (self._dropin.cosid_segment, IDS)},
            COSID_DISTRIBUTOR: {"POST": (self._dropin.cosid_distributor, IDS)},
        }

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def minter(self) -> Minter:
        if self._minter is None:
            self._minter = connect(
                self.config.store,
                timeout=self.config.timeout,
                segment_options=self.options,
                dc=self.config.dc or None,
                dc_store=self.config.dc_store or None,
            )
        return self._minter

    def startup(self) -> None:
        self.minter  # noqa: B018 - a bad store URL fails the start, not the first request
        log.info("idmint %s serving %s (pid %d)", __version__, self.minter.url, os.getpid())
        threading.Thread(target=self._warm_up, name="idmint-warm-up", daemon=True).start()
        threading.Thread(target=self._sample_rates, name="idmint-rates", daemon=True).start()
        threading.Thread(target=self._refresh_rows, name="idmint-keys", daemon=True).start()

    def _probe_store(self) -> list[Key]:
        """Every key, and the store's identity as it is now (on a probe thread)."""
        keys = self.minter.keys()
        self._check_identity()
        self.replication = self.minter.replication()
        return keys

    def _check_identity(self) -> None:
        """Read the store's identity, and say so loudly if it changed."""
        identity = self.minter.identity()
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
            if self._stopped.wait(wait):
                return
            wait = min(wait * 2, 30.0)
        self._keep_rows(keys)
        for key in keys[: self.config.warm_keys]:
            if self.shutting_down:
                return
            self._gens.setdefault(key.name, self.minter.segment(key.name))

    def _sample_rates(self) -> None:
        """Sample the generators' running totals once a RATE_WINDOW, so the rates are ready at
        the first read and do not depend on how often, or by how many, they are read; and copy
        this process's counts into the metrics (the other workers' scrapes read them so, at
        most a RATE_WINDOW late). At most SAMPLE_BATCH generators a window, in turn: with
        100,000 keys each is sampled every 5 s, for a few percent of a core."""
        names: list[str] = []
        while not self._stopped.wait(RATE_WINDOW):
            if not names:
                names = list(self._gens)
            batch, names = names[:SAMPLE_BATCH], names[SAMPLE_BATCH:]
            now = time.monotonic()
            for name in batch:
                gen = self._gens.get(name)
                if gen is not None:
                    c = self._counts[name] = gen.counts()
                    self._rates.setdefault(name, RateMeter()).update(c.issued, now)
            try:
                src = self._sources(fresh=False)
                self.exporter.sync(src)
                if self.views.path is not None:
                    self.views.publish(self._view(src, src.busiest(self.config.metrics_keys)))
            except Exception:  # never the end of the sampling (rates, metrics) for good
                log.exception("cannot update the metrics")

    def _sources(self, *, fresh: bool = True) -> Sources:
        """What this process counted, for the metrics: no store call. `fresh`: the
        generators' totals as they are now, unless there are more than SAMPLE_BATCH (then as
        last sampled: at most a few seconds old)."""
        gens = dict(self._gens)
        if fresh and len(gens) <= SAMPLE_BATCH:
            counts = {name: gen.counts() for name, gen in gens.items()}
        else:
            counts = dict(self._counts)
        handed = dict(self.counters.handed)
        handed[LEAF_ROUTE] += self.hot_handed
        minter = self._minter
        return Sources(
            counts=counts,
            gens=gens,
            rates={name: meter.rate for name, meter in list(self._rates.items())},
            rows=dict(self._key_rows),
            ranges_handed=dict(self.counters.ranges_handed),
            handed=handed,
            errors=dict(self.counters.errors),
            started=self.started,
            snowflake=self._flake.stats() if self._flake is not None else None,
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

    def shutdown(self) -> None:
        """Stop being ready and give every unused tail back to the store, within a share of
        the shutdown timeout whatever the store does (granian kills a worker that overruns
        the whole of it)."""
        self.shutting_down = True
        self._stopped.set()
        self.views.remove()
        for pool in self.pools.values():
            pool.close()
        if self._minter is None:
            self.exporter.close()
            return
        generators = self._minter.generators()
        # The rest of the timeout is for in-flight requests (bounded by their deadlines) and
        # the process's exit. Minter.close logs what it could not give back in time.
        self._minter.close(timeout=self.config.shutdown_timeout * CLOSE_SHARE)
        returned = sum(gen.stats().given_back for gen in generators)
        log.info("stopped; %d unused ids given back to the store", returned)
        try:  # the last counts into the totals; this worker's gauges go
            self.exporter.close(self._sources())
        except Exception:
            log.exception("cannot write the last metrics")

    # -- RSGI (granian) ----------------------------------------------------------------------

    def __rsgi_init__(self, loop: Any) -> None:
        self.startup()

    def __rsgi_del__(self, loop: Any) -> None:
        self.shutdown()

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        path = scope.path
        if scope.method == "GET" and path.startswith(_HOT_PREFIX):
            # Leaf's route without the router: the generator's lock-free hot path, right here.
            gen = self._gens.get(path[len(_HOT_PREFIX) :])
            if gen is not None and (
                not self._id_bearers
                or bearer_in(scope.headers.get("authorization"), self._id_bearers)
            ):
                try:
                    i = gen.try_next_id()
                except IdmintError:
                    i = None  # the full path below answers with the right status
                if i is not None:
                    self.hot_handed += 1  # a plain attribute: the cheapest count there is
                    proto.response_str(200, _HOT_HEADERS, str(i))
                    return
        body: bytes | None = b""
        if scope.method in ("POST", "PUT", "PATCH"):
            body = await _read_body(scope.headers.get("content-length"), proto)
        client = scope.client.rsplit(":", 1)[0].strip("[]") if scope.client else ""
        request = Request(
            scope.method,
            path,
            scope.query_string,
            scope.headers.get("authorization"),
            client,
            body or b"",
            oversized=body is None,
        )
        response = await self.handle(request)
        headers = [("content-type", response.content_type), *response.headers]
        proto.response_str(response.status, headers, response.body)

    # -- ASGI (uvicorn and others) -----------------------------------------------------------

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.startup()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY:
                break  # stop reading: the rest is never buffered
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization")
        client = (scope.get("client") or ("", 0))[0]
        request = Request(
            scope["method"],
            scope["path"],
            scope.get("query_string", b"").decode(),
            auth.decode("latin-1") if auth else None,
            client,
            b"" if len(body) > MAX_BODY else body,
            oversized=len(body) > MAX_BODY,
        )
        response = await self.handle(request)
        raw = [(b"content-type", response.content_type.encode())]
        raw += [(k.encode(), v.encode()) for k, v in response.headers]
        await send({"type": "http.response.start", "status": response.status, "headers": raw})
        await send({"type": "http.response.body", "body": response.body.encode()})

    # -- routing -----------------------------------------------------------------------------

    def _match(self, path: str) -> tuple[str, str | None]:
        """The route pattern and the key in it; ("", None) when nothing matches."""
        if path in self._routes and "{" not in path:
            return path, None
        if path.startswith("/v1/quorum/") and path.endswith("/ids"):
            return QUORUM_ROUTE, path[len("/v1/quorum/") : -len("/ids")]
        for prefix in (
            "/api/segment/get/",
            "/api/snowflake/get/",
            "/v1/snowflake/decode/",
            "/ids/",
        ):
            if path.startswith(prefix):
                return prefix + "{key}", path[len(prefix) :]
        if path.startswith("/v1/keys/"):
            key, _, tail = path[len("/v1/keys/") :].partition("/")
            pattern = "/v1/keys/{key}" + (f"/{tail}" if tail else "")
            if pattern in self._routes:
                return pattern, key
        return self._dropin.match(path)

    async def handle(self, request: Request) -> Response:
        """Answer one request; every error becomes a status code and a one-line reason. Every
        answer names the store's identity once it is known."""
        response = await self._answer(request)
        identity = self.identity
        if identity is not None:
            response.headers = (*response.headers, (STORE_HEADER, identity.id))
        return response

    async def _answer(self, request: Request) -> Response:
        pattern, key = self._match(request.path)
        try:
            if not pattern:
                raise HttpError(404, f"no route {request.path}; see /openapi.json")
            methods = self._routes[pattern]
            if request.method not in methods:
                allow = ", ".join(sorted(methods))
                raise HttpError(
                    405,
                    f"{request.method} not allowed on {pattern}; use {allow}",
                    (("allow", allow),),
                )
            if request.oversized or len(request.body) > MAX_BODY:
                # Close: the rest of the body was never read, and is not worth draining.
                raise HttpError(413, f"the body is over {MAX_BODY} bytes", _CLOSE)
            handler, access = methods[request.method]
            if access == ADMIN:
                self._authorize(request)
            elif access == IDS and self._id_bearers:
                self._authorize_ids(request)
            if key is not None and pattern != DECODE_ROUTE:  # decode's is an id, not a key
                check_key_name(key)
            return await handler(request, key)
        except HttpError as exc:
            self.counters.error(pattern or "unknown", exc.status)
            return Response(exc.status, exc.reason + "\n", headers=exc.headers)
        except PoolTimeout as exc:
            self.counters.error(pattern, 503)
            return Response(503, f"{exc}\n", headers=PoolTimeout.headers)
        except IdmintError as exc:
            status = next((code for kind, code in STATUS_OF if isinstance(exc, kind)), 500)
            self.counters.error(pattern, status)
            headers = _exhausted_headers(exc) if isinstance(exc, Exhausted) else ()
            return Response(status, " ".join(str(exc).split()) + "\n", headers=headers)
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            self.counters.error(pattern, 500)
            return Response(500, "internal error; see the server log\n")

    def _authorize(self, request: Request) -> None:
        """Admin needs the admin token; without it, only a loopback client of a server started
        with --admin-loopback (behind a reverse proxy on the same host every client is
        loopback, so that is never the default)."""
        token = self.config.token
        if token and bearer_is(request.authorization, token):
            return
        if self.config.admin_loopback and _is_loopback(request.client):
            return
        if token:
            raise HttpError(
                401,
                "this route needs the admin token (Authorization: Bearer ...)",
                (("www-authenticate", 'Bearer realm="idmint"'),),
            )
        if self.config.admin_loopback:
            raise HttpError(
                403,
                "key admin answers only to loopback clients (--admin-loopback) when no admin "
                "token is configured (IDMINT_TOKEN)",
            )
        raise HttpError(
            403,
            "key admin over HTTP needs an admin token (--token, IDMINT_TOKEN), or "
            "--admin-loopback for loopback clients; the idmint keys command works on the store",
        )

    def _authorize_ids(self, request: Request) -> None:
        """With a client token set, the routes that hand out ids need it (or the admin
        token): without a credential, anyone could burn a key's ids for good."""
        for token in (self.config.client_token, self.config.token):
            if token and bearer_is(request.authorization, token):
                return
        raise HttpError(
            401,
            "this route needs the client token (Authorization: Bearer ...)",
            (("www-authenticate", 'Bearer realm="idmint"'),),
        )

    async def _key_row(self, key: str) -> Key:
        """The key's row as last read (the refresher reads every row each KEY_REFRESH
        seconds), or read now the first time; so a flood of made-up names costs one store
        read per name per second (KeyNotFound is remembered that long) and no threads."""
        row = self._key_rows.get(key)
        if row is not None:
            return row
        self._check_missing(key)
        try:
            row = await self.pools["id"].run(self._store_deadline, self.minter.key, key)
        except KeyNotFound as exc:
            self._remember_missing(key, exc)
            raise
        self._key_rows[key] = row
        return row

    def _check_missing(self, name: str) -> None:
        """Raise the KeyNotFound `name` was last answered with, while it is trusted."""
        missing = self._missing.get(name)
        if missing is not None and missing[0] > time.monotonic():
            raise missing[1].again()

    def _remember_missing(self, name: str, error: KeyNotFound) -> None:
        if len(self._missing) > 10_000:
            self._missing.clear()
        self._missing[name] = (time.monotonic() + NEGATIVE_CACHE_SECONDS, error)

    def _keep_rows(self, keys: list[Key]) -> list[Key]:
        self._key_rows.update((k.name, k) for k in keys)
        return keys

    def _keep_allocated_row(self, row: Key) -> Key:
        """Keep the row an allocation came back with when it is the key's own (stripe 0's:
        the batch cap as the store has it now); a stripe's row has no batch cap or description,
        so the key's row as last read stays. Returns the key's row."""
        if row.stripe == 0:
            self._key_rows[row.name] = row
            return row
        return self._key_rows.get(row.name) or row

    def _refresh_rows(self) -> None:
        """Read every key's row (and the store's identity) every KEY_REFRESH seconds, so a
        batch cap an admin changed on any server applies here too within that time, without a
        store read per request, and a store that changed identity is noticed without probes.
        With many keys, less often: the reads take at most KEY_REFRESH_SHARE of the time."""
        interval = KEY_REFRESH
        while not self._stopped.wait(interval):
            started = time.monotonic()
            try:
                self._keep_rows(self._probe_store())
            except IdmintError as exc:
                log.debug("cannot refresh the keys' rows: %s", exc)
            dcs = self._serving_datacenter()
            if dcs is not None:  # what other processes of the datacenter did (dc retire)
                try:
                    dcs.refresh_seen()
                except IdmintError as exc:
                    log.debug("cannot read the datacenter's cells again: %s", exc)
            if len(self._key_rows) >= FREEZE_KEYS:
                # Rows and generators live as long as the server; reference counting still
                # frees them when they go (they hold no cycles).
                gc.freeze()
            interval = max(KEY_REFRESH, (time.monotonic() - started) / KEY_REFRESH_SHARE)

    async def _generator(self, key: str) -> SegmentGenerator:
        """The key's generator; made only for keys that exist."""
        gen = self._gens.get(key)
        if gen is not None:
            return gen
        await self._key_row(key)
        gen = self._gens.get(key) or self.minter.segment(key)
        self._gens[key] = gen
        return gen

    async def _draw(self, gen: SegmentGenerator, count: int) -> list[int]:
        """`count` ids of a key, waiting for its refills on the event loop, so a request that
        waits for the store holds no thread (100,000 cold keys asked at once hold none), for
        at most the generator's `wait`. Fewer ids than asked, rather than losing the ones
        already drawn, when the store fails midway."""
        ids = gen.try_next_ids(count)
        if len(ids) == count:
            return ids
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.wait
        try:
            while len(ids) < count:
                refilled: asyncio.Future[None] = loop.create_future()
                gen.on_refill(functools.partial(_wake, loop, refilled))
                # Again after listening: a load that ended before it would never call back.
                ids += gen.try_next_ids(count - len(ids))
                if len(ids) == count:
                    break
                left = deadline - loop.time()
                if left <= 0 or not (await asyncio.wait({refilled}, timeout=left))[0]:
                    raise StoreUnavailable(
                        f"no ids buffered for key {gen.key!r} and the store gave no range "
                        f"within {self.options.wait:g} s"
                    )
        except IdmintError:
            if not ids:
                raise
        return ids

    # -- id routes ---------------------------------------------------------------------------

    def _charge(self, row: Key, ids: int) -> None:
        """Take `ids` from the key's HTTP budget (budget.py), or answer 429."""
        try:
            self._budget.charge(row, ids)
        except OverBudget as exc:
            raise HttpError(429, str(exc), (("retry-after", f"{exc.retry_after:.0f}"),)) from None

    async def leaf_get(self, request: Request, key: str | None) -> Response:
        assert key is not None
        self._charge(self._key_rows.get(key) or await self._key_row(key), 1)
        gen = await self._generator(key)
        i = gen.try_next_id()
        if i is None:
            i = (await self._draw(gen, 1))[0]
        self.counters.handed[LEAF_ROUTE] += 1
        return Response(200, str(i))

    async def ids(self, request: Request, key: str | None) -> Response:
        assert key is not None
        ids = await self._take_ids(key, request.param("count", 1, MAX_IDS), "count")
        self.counters.handed[IDS_ROUTE] += len(ids)
        return json_response({"key": key, "ids": ids})

    async def _take_ids(self, key: str, count: int, what: str) -> list[int]:
        """`count` ids from the key's generator, within its batch cap (`what` names the count
        in a refusal); fewer when the store fails after some were drawn."""
        row = self._key_rows.get(key) or await self._key_row(key)
        if count > 1:
            _check_cap(row, count, what)
        self._charge(row, count)
        return await self._draw(await self._generator(key), count)

    async def ranges(self, request: Request, key: str | None) -> Response:
        assert key is not None
        size = request.param("size", 0, MAX_RANGE) or None  # absent: the key's own step
        stripe = request.stripe()  # absent: any stripe with ids left, the store's choice
        taken, row = await self._allocate(key, size, stripe)
        self.counters.handed[RANGES_ROUTE] += len(taken.range)
        return json_response(
            {
                "key": key,
                **taken.range.as_dict(),
                "stripe": taken.key.stripe,
                "stripes": taken.key.stripes,
                "step": taken.key.step,
                "batch_cap": row.batch_cap,
                "conflicts": taken.conflicts,
            }
        )

    async def _allocate(
        self, key: str, size: int | None, stripe: int | None
    ) -> tuple[Allocation, Key]:
        """A fresh range of the key (of `size` ids, or its step; from `stripe`, or any), and the
        key's row as it stands after it."""
        row = await self._key_row(key)
        if stripe is not None:
            check_stripe(stripe, row.stripes)
        if size is not None:
            _check_cap(row, size, "size")
        elif row.step > row.batch_cap:
            size = row.batch_cap  # a cap below the step bounds the default size too
        self._charge(row, size or row.step)
        # A range the store commits after the deadline is dropped: skipped, never served.
        taken = await self.pools["id"].run(
            self._store_deadline,
            functools.partial(allocate_any, self.minter.ranges, key, size, stripe=stripe),
        )
        # The allocation's row is its stripe's: only the key's own row (stripe 0) has the
        # batch cap, so a stripe's row never replaces it.
        row = self._keep_allocated_row(taken.key)
        handed = self.counters.ranges_handed
        handed[key] = handed.get(key, 0) + len(taken.range)
        return taken, row

    # -- snowflake ---------------------------------------------------------------------------

    async def _snowflake(self) -> SnowflakeGenerator:
        """The server's snowflake generator, made on first use: leasing a worker id and the
        first tick (which may wait out a previous holder's horizon) run on a thread."""
        flake = self._flake
        if flake is None:
            # Made and kept on the thread, under a thread lock: when the request's deadline
            # passes first, the next request finds the generator, not a second worker id.
            def make() -> SnowflakeGenerator:
                with self._flake_lock:
                    if self._flake is None:
                        options = SnowflakeOptions(namespace=self.config.snowflake_namespace)
                        gen = self.minter.snowflake(self.config.snowflake_layout, options)
                        gen.next_id()  # the first tick, off the event loop
                        self._flake = gen
                    return self._flake

            # Its first tick may wait out a previous holder's horizon, or a young store's
            # quarantine: up to a lease's ttl on top of the store's answer.
            deadline = self._id_deadline + SnowflakeOptions().ttl
            try:
                flake = await self.pools["id"].run(deadline, make)
            except PoolTimeout as exc:
                raise HttpError(
                    503,
                    f"the snowflake generator is not ready ({exc}): taking a worker id, or "
                    "waiting out its previous holder's horizon; try again shortly",
                    PoolTimeout.headers,
                ) from exc
        return flake

    async def snowflake_get(self, request: Request, key: str | None) -> Response:
        # Leaf's route takes a key and ignores it: one id space per server. We check the name.
        gen = await self._snowflake()
        i = gen.next_id()
        self.counters.handed[SNOWFLAKE_ROUTE] += 1
        return Response(200, str(i))

    async def snowflake_ids(self, request: Request, key: str | None) -> Response:
        count = request.param("count", 1, MAX_IDS)
        gen = await self._snowflake()
        # A large batch spans ticks and waits for them: on a thread.
        ids = (
            gen.next_ids(count)
            if count <= 256
            else await self.pools["id"].run(self._id_deadline, gen.next_ids, count)
        )
        # No per-key cap here: a snowflake generator cannot run ahead of the clock, so a large
        # batch costs time (up to 100,000 ids, 25 ms of a twitter layout's ids), not ids.
        self.counters.handed[SNOWFLAKE_IDS_ROUTE] += len(ids)
        return json_response({"ids": ids})

    # -- quorum keys -------------------------------------------------------------------------

    async def quorum_ids(self, request: Request, key: str | None) -> Response:
        """`count` consecutive ids of quorum key `key`, above every id of the key handed out
        before the request came (group commit: concurrent requests share one round)."""
        assert key is not None
        if not self.config.quorum:
            raise HttpError(404, "this server has no quorum nodes (start it with --quorum URLS)")
        count = request.param("count", 1, MAX_QUORUM)
        # One bound for the whole request, its first use's node check included (docs/server.md)
        until = time.monotonic() + QuorumOptions.deadline
        gen = self._quorums.get(key)
        if gen is None:  # the first request reads the key and checks the nodes: on a thread
            missing = f"quorum:{key}"  # a name may be no quorum key and a segment key
            self._check_missing(missing)
            options = QuorumOptions(unsafe=self.config.unsafe_nodes, max_batch=MAX_QUORUM)
            make = functools.partial(
                self.minter.quorum, key, split_nodes(self.config.quorum), options
            )
            try:
                gen = await self.pools["id"].run(self._id_deadline, make)
            except KeyNotFound as exc:  # only keys an admin made: `idmint quorum add`
                self._remember_missing(missing, exc)
                raise
            self._quorums[key] = gen
        ids = await gen.take_async(count, until=until)
        self.counters.handed[QUORUM_ROUTE] += len(ids)
        return json_response({"key": key, "start": ids.start, "stop": ids.stop, "count": len(ids)})

    def _decode(self, text: str) -> dict[str, Any]:
        if not NUMBER.fullmatch(text):
            raise HttpError(400, f"{text!r} is not an id: ids are non-negative integers")
        return layout_named(self.config.snowflake_layout).decode(int(text)).as_dict()

    async def snowflake_decode(self, request: Request, key: str | None) -> Response:
        assert key is not None
        return json_response(self._decode(key))

    async def leaf_decode(self, request: Request, key: str | None) -> Response:
        # Leaf's LeafMonitorController.decodeSnowflakeId: all strings, the timestamp as
        # "ms(yyyy-MM-dd HH:mm:ss.SSS)" in the server's time zone; an id it cannot decode is
        # an HTTP 200 with only "errorMsg" (a missing parameter is Spring's 400).
        values = parse_qs(request.query, keep_blank_values=True).get("snowflakeId")
        if not values:
            raise HttpError(400, "snowflakeId is required")
        try:
            parts = self._decode(values[-1].strip())
        except (HttpError, IdmintError) as exc:
            return json_response({"errorMsg": " ".join(str(exc).split())})
        ms = parts["unix_ms"]
        local = datetime.fromtimestamp(ms // 1000).strftime("%Y-%m-%d %H:%M:%S")
        return json_response(
            {
                "timestamp": f"{ms}({local}.{ms % 1000:03d})",
                "workerId": str(parts["worker"]),
                "sequenceId": str(parts["sequence"]),
            }
        )

    # -- key admin ---------------------------------------------------------------------------

    async def list_keys(self, request: Request, key: str | None) -> Response:
        keys = await self.pools["admin"].run(self._store_deadline, self.minter.keys)
        return json_response({"keys": [k.as_dict() for k in self._keep_rows(keys)]})

    async def show_key(self, request: Request, key: str | None) -> Response:
        assert key is not None
        shown = await self.pools["admin"].run(self._store_deadline, self.minter.key, key)
        self._key_rows[key] = shown
        return json_response(shown.as_dict())

    async def update_key(self, request: Request, key: str | None) -> Response:
        assert key is not None
        data = request.json()
        if set(data) != {"max_batch"}:
            raise HttpError(400, 'the body must be {"max_batch": N} (0: the default cap)')
        updated = await self.pools["admin"].run(
            self._store_deadline,
            self.minter.set_max_batch,
            key,
            _int_field(data, "max_batch", 0),
        )
        self._key_rows[key] = updated
        return json_response(updated.as_dict())

    async def add_key(self, request: Request, key: str | None) -> Response:
        data = request.json()
        fields = {"name", "step", "start", "max", "description", "max_batch", "stripes"}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise HttpError(400, f"unknown fields: {', '.join(unknown)}")
        name = data.get("name")
        if not isinstance(name, str):
            raise HttpError(400, "name is required and must be a string")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise HttpError(400, "description must be a string")
        stripes = _int_field(data, "stripes", 1)
        # No max: the highest a key with that many stripes may have (Minter.add_key's rule).
        top = _int_field(data, "max", 0) if "max" in data else None
        if top is not None and top > HTTP_KEY_MAX:  # /openapi.json's bound, for any stripes
            raise HttpError(
                400,
                f"max must be at most {HTTP_KEY_MAX} over HTTP, not {top}; leave it out for "
                "the highest the key may have",
            )
        # Past the deadline the key may still be created: a retry then answers 409.
        created = await self.pools["admin"].run(
            self._store_deadline,
            functools.partial(
                self.minter.add_key,
                check_key_name(name),
                step=_int_field(data, "step", DEFAULT_STEP),
                start=_int_field(data, "start", DEFAULT_FIRST_ID),
                max=top,
                description=description,
                max_batch=_int_field(data, "max_batch", 0),
                stripes=stripes,
            ),
        )
        self._missing.pop(name, None)
        self._key_rows[name] = created
        return json_response(created.as_dict(), 201)

    async def raise_key(self, request: Request, key: str | None) -> Response:
        assert key is not None
        data = request.json()
        if set(data) != {"to"}:
            raise HttpError(400, 'the body must be {"to": N}')
        to = _int_field(data, "to", 0)
        raised = await self.pools["admin"].run(
            self._store_deadline, self.minter.raise_floor, key, to
        )
        self._key_rows[key] = raised
        return json_response(raised.as_dict())

    # -- operations --------------------------------------------------------------------------

    async def livez(self, request: Request, key: str | None) -> Response:
        return Response(200, "ok\n")

    async def readyz(self, request: Request, key: str | None) -> Response:
        if self.shutting_down:
            return Response(503, "shutting down\n")
        try:
            cold = await self.pools["probe"].run(self._store_deadline, self._readiness)
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
        if state.risk is not None:
            note += f" (at risk: {state.risk})"
        fenced = failovers()
        if fenced:
            note += f"; {len(fenced)} failover(s) fenced, the last at "
            note += datetime.fromtimestamp(fenced[-1].at, UTC).isoformat(timespec="seconds")
        return note

    def _serving_datacenter(self) -> DatacenterRanges | None:
        store = self.minter.store
        return store if isinstance(store, DatacenterRanges) and store.serves else None

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
            known = next(iter(self._key_rows), None)
            if known is None:
                self._keep_rows(self.minter.keys())  # none read yet: there are few or none
            else:
                with contextlib.suppress(KeyNotFound):  # deleted meanwhile: the store answered
                    self.minter.key(known)
            self._check_identity()
        cold = []
        # One key per node set asks its nodes: the set's keys share them.
        by_set: dict[int, list[QuorumGenerator]] = {}
        for quorum in self.minter.quorums():
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
        for name, gen in sorted(list(self._gens.items())):
            if gen.cold():
                why = gen.failing()
                cold.append(name if why is None else f"{name} (its refills fail: {why})")
        return cold

    def _named_keys(self, request: Request) -> list[str]:
        """The keys a request names (`?key=a&key=b`), checked, at most NAMED_KEYS_MAX."""
        names = parse_qs(request.query, keep_blank_values=True).get("key", [])
        if len(names) > NAMED_KEYS_MAX:
            raise HttpError(400, f"at most {NAMED_KEYS_MAX} keys per request, not {len(names)}")
        return [check_key_name(name) for name in dict.fromkeys(names)]

    async def metrics(self, request: Request, key: str | None) -> Response:
        """Every worker's series (the aggregates, each worker's busiest keys), or with
        `?key=a&key=b` those keys as the answering process has them (label pid). Rendered on a
        probe thread from what the process keeps (no store call): the event loop goes on
        answering while a scrape is read and written."""
        names = self._named_keys(request)
        render = self._render_metrics
        if names:
            render = functools.partial(self._render_keys, names)
        body = await self.pools["probe"].run(RENDER_DEADLINE, render)
        return Response(200, body, PROMETHEUS, (("idmint-pid", str(os.getpid())),))

    def _render_metrics(self) -> str:
        up = {
            "version": __version__,
            "store": self.minter.url,
            "store_id": self.identity.id if self.identity else "",
        }
        return self.exporter.render(self._sources(), up)

    def _render_keys(self, names: list[str]) -> str:
        return self.exporter.render_keys(self._sources(), names)

    async def stats(self, request: Request, key: str | None) -> Response:
        """The dashboard's data: the server, every worker's totals, and keys with this
        process's view of them: its busiest `metrics_keys` by default, the ones named by
        `?key=`, or with `?all=1` every key (by name, at most STATS_ALL_MAX)."""
        names = self._named_keys(request)
        everything = parse_qs(request.query, keep_blank_values=True).get("all", ["0"])[-1]
        if everything not in ("0", "1", "true", "false"):
            raise HttpError(400, f"all must be 1 or 0 (true or false), not {everything!r}")
        body = await self.pools["probe"].run(
            RENDER_DEADLINE, self._stats_body, names, everything in ("1", "true")
        )
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
        src = self._sources()
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
        server = {
            "version": __version__,
            "store": self.minter.url,
            "store_id": self.identity.id if self.identity else None,
            "store_created_at": (
                datetime.fromtimestamp(self.identity.created_ms / 1000, UTC).isoformat()
                if self.identity and self.identity.created_ms
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
        return {
            "server": server,
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

    async def openapi(self, request: Request, key: str | None) -> Response:
        return json_response(openapi_document(__version__))

    async def dashboard(self, request: Request, key: str | None) -> Response:
        if self._dashboard is None:
            self._dashboard = (
                resources.files("idmint.server")
                .joinpath("dashboard.html")
                .read_text(encoding="utf-8")
            )
        return Response(200, self._dashboard, HTML)


def create_app() -> App:
    """The app factory granian and uvicorn call in each worker (config from IDMINT_*)."""
    return App()
