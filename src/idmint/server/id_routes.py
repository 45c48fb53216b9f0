"""idmint's own id routes and Leaf's: segment ids one by one, in batches, whole ranges;
snowflake ids and their decoding; quorum keys. Each route is declared once in ROUTES."""

from __future__ import annotations

import functools
import threading
import time
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs

from .._errors import Exhausted, IdmintError, KeyNotFound
from ..ids import MAX_STRIPES
from ..layout import layout_named
from ..strategies.quorum import QuorumGenerator
from ..strategies.quorum_nodes import QuorumOptions, split_nodes
from ..strategies.snowflake import SnowflakeGenerator, SnowflakeOptions
from .http import MAX_IDS, MAX_RANGE, NUMBER, HttpError, Response, json_response
from .openapi import E400, E400_CAP, E401_IDS, E404, E410, E410_RANGE, E503, error, json_ok, text_ok
from .pools import PoolTimeout
from .routes import IDS, OPEN, SPRING_METHODS, STR, Call, Param, Route, path_key, query_int
from .service import IdService

MAX_QUORUM = 1_000_000  # ids per quorum request: a range, however many
LEAF_PREFIX = "/api/segment/get/"
LEAF_ROUTE = LEAF_PREFIX + "{key}"
IDS_ROUTE = "/v1/keys/{key}/ids"
RANGES_ROUTE = "/v1/keys/{key}/ranges"
SNOWFLAKE_ROUTE = "/api/snowflake/get/{key}"
SNOWFLAKE_IDS_ROUTE = "/v1/snowflake/ids"
QUORUM_ROUTE = "/v1/quorum/{key}/ids"

ID_ERRORS = {"400": E400, "401": E401_IDS, "404": E404, "410": E410, "503": E503}
ID_LIST = {"type": "array", "items": {"type": "integer"}}

LEAF_DECODED: dict[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "required": ["timestamp", "workerId", "sequenceId"],
            "additionalProperties": False,
            "properties": {
                "timestamp": {"type": "string"},
                "workerId": {"type": "string"},
                "sequenceId": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["errorMsg"],
            "additionalProperties": False,
            "properties": {"errorMsg": {"type": "string"}},
        },
    ]
}

RANGE: dict[str, Any] = {
    "type": "object",
    "required": ["key", "start", "stop", "stride", "stripe", "stripes", "step"],
    "properties": {
        "key": {"type": "string"},
        "start": {"type": "integer", "description": "the first id of the range"},
        "stop": {
            "type": "integer",
            "description": "where the range ends, exclusive: start + its length x stride",
        },
        "stride": {
            "type": "integer",
            "description": "the gap between its ids: 1, or the key's stripes",
        },
        "stripe": {"type": "integer", "description": "the stripe it came from"},
        "stripes": {"type": "integer", "description": "the key's stripes"},
        "step": {"type": "integer", "description": "the key's step"},
        "batch_cap": {"type": "integer", "description": "the key's batch cap"},
        "conflicts": {
            "type": "integer",
            "description": "compare-and-set conflicts the allocation met (engines without "
            "row locks): a client moves to another stripe",
        },
    },
}

QUORUM_IDS: dict[str, Any] = {
    "type": "object",
    "required": ["key", "start", "stop", "count"],
    "properties": {
        "key": {"type": "string"},
        "start": {"type": "integer"},
        "stop": {"type": "integer", "description": "one past the last id"},
        "count": {"type": "integer"},
    },
}

ROUTES = (
    Route(
        LEAF_ROUTE,
        SPRING_METHODS,
        IDS,
        "leaf_get",
        "One id as plain decimal text (Leaf's route and body)",
        (path_key(),),
        responses={"200": text_ok("The id"), **ID_ERRORS},
        hands_ids=True,
        greedy=True,
    ),
    Route(
        IDS_ROUTE,
        ("GET",),
        IDS,
        "ids",
        "A batch of ids (fewer than asked only when the key ran out or the store failed midway)",
        (
            path_key(),
            query_int(
                "count",
                1,
                MAX_IDS,
                f"How many ids, 1 to {MAX_IDS} (default 1), at most the key's batch cap",
                default=1,
            ),
        ),
        responses={
            "200": json_ok(
                {
                    "type": "object",
                    "required": ["key", "ids"],
                    "properties": {"key": {"type": "string"}, "ids": ID_LIST},
                }
            ),
            **ID_ERRORS,
            "400": E400_CAP,
        },
        hands_ids=True,
    ),
    Route(
        RANGES_ROUTE,
        ("POST",),
        IDS,
        "ranges",
        "Take a whole range for serving ids locally (clients use this)",
        (
            path_key(),
            query_int(
                "size",
                1,
                MAX_RANGE,
                f"How many ids in the range, 1 to {MAX_RANGE} and at most the key's batch "
                "cap (default: the key's step, or the cap when that is smaller)",
            ),
            query_int(
                "stripe",
                0,
                MAX_STRIPES - 1,
                "Which stripe of a striped key to take the range from, 0 to the key's "
                "stripes - 1 (default: any stripe with ids left)",
            ),
        ),
        responses={"200": json_ok(RANGE), **ID_ERRORS, "400": E400_CAP, "410": E410_RANGE},
        hands_ids=True,
    ),
    Route(
        SNOWFLAKE_ROUTE,
        SPRING_METHODS,
        IDS,
        "snowflake_get",
        "One snowflake id as plain text (Leaf's route; the key is checked and otherwise "
        "ignored: one id space per server)",
        (path_key(),),
        responses={"200": text_ok("The id"), "400": E400, "401": E401_IDS, "503": E503},
        hands_ids=True,
        greedy=True,
    ),
    Route(
        SNOWFLAKE_IDS_ROUTE,
        ("GET",),
        IDS,
        "snowflake_ids",
        "A batch of snowflake ids, increasing",
        (query_int("count", 1, MAX_IDS, f"How many ids, 1 to {MAX_IDS} (default 1)", default=1),),
        responses={
            "200": json_ok({"type": "object", "required": ["ids"], "properties": {"ids": ID_LIST}}),
            "400": E400,
            "401": E401_IDS,
            "503": E503,
        },
        hands_ids=True,
    ),
    Route(
        QUORUM_ROUTE,
        ("GET",),
        IDS,
        "quorum_ids",
        "Consecutive ids of a quorum key, each above every id of the key handed out before "
        "the request came (a server started with --quorum; concurrent requests share one "
        "round: group commit)",
        (
            path_key(),
            query_int("count", 1, MAX_QUORUM, "How many ids (a range): 1 to 1,000,000", default=1),
        ),
        responses={
            "200": json_ok(QUORUM_IDS),
            "400": E400,
            "401": E401_IDS,
            "404": error("This server has no quorum nodes (start it with --quorum)"),
            "410": E410,
            "503": error("No majority of the quorum nodes accepted a round before the deadline"),
        },
        hands_ids=True,
        greedy=True,
    ),
    Route(
        "/decodeSnowflakeId",
        SPRING_METHODS,
        OPEN,
        "leaf_decode",
        "Leaf's decode (LeafMonitorController.decodeSnowflakeId): timestamp "
        '("ms(yyyy-MM-dd HH:mm:ss.SSS)", local time), workerId and sequenceId as strings; an '
        "id it cannot decode is a 200 with errorMsg",
        (Param("snowflakeId", "query", STR, required=True),),
        responses={"200": json_ok(LEAF_DECODED), "400": E400},
    ),
    Route(
        "/v1/snowflake/decode/{id}",
        ("GET",),
        OPEN,
        "snowflake_decode",
        "The time, worker and sequence of a snowflake id",
        (Param("id", "path", STR, required=True, pattern="^[0-9]{1,19}$"),),
        responses={"200": json_ok({"type": "object"}), "400": E400},
        greedy=True,
        counted_as="/v1/snowflake/decode/{key}",
    ),
)


def check_query(call: Call) -> None:
    """Refuse query parameters the route does not declare, and any given twice, in one line.
    Call.arg reads the last value of its own names and nothing else, so `?cnt=5` (a typo)
    silently answered one id and `?count=1&count=2` took the last. Only idmint's own /v1 id
    routes check this: Leaf's routes and the peers' (dropin.py) take what their peers take."""
    given = parse_qs(call.request.query, keep_blank_values=True)
    declared = [p.name for p in call.route.params if p.where == "query"]
    unknown = sorted(set(given) - set(declared))
    if unknown:
        takes = f"takes only {', '.join(declared)}" if declared else "takes no query parameters"
        raise HttpError(400, f"unknown query parameter {unknown[0]!r}: {call.route.path} {takes}")
    for name, values in given.items():
        if len(values) > 1:
            raise HttpError(
                400, f"query parameter {name!r} is given {len(values)} times: give it once"
            )


class IdRoutes:
    """The handlers of ROUTES, on the service's generators and the server's snowflake and
    quorum generators."""

    def __init__(self, service: IdService) -> None:
        self.service = service
        self.config = config = service.config
        self._minter = service.minter
        self.pool = service.pool
        self.counters = service.counters
        # How long a request waits for the store and a range on top of it.
        self.id_deadline = config.timeout + config.wait
        #: The server's snowflake generator, made on first use.
        self.flake: SnowflakeGenerator | None = None
        self._flake_lock = threading.Lock()
        self.quorums: dict[str, QuorumGenerator] = {}

    # -- segment ids -------------------------------------------------------------------------

    async def leaf_get(self, call: Call) -> Response:
        key = call.key
        service = self.service
        service.charge(service.rows.get(key) or await service.key_row(key), 1)
        gen = await service.generator(key)
        try:
            i = gen.try_next_id()
            if i is None:
                i = (await service.draw(gen, 1))[0]
        except Exhausted as exc:
            raise self.service.retired_or(exc) from None
        self.counters.handed[LEAF_ROUTE] += 1
        return Response(200, str(i))

    async def ids(self, call: Call) -> Response:
        key = call.key
        check_query(call)
        try:
            ids = await self.service.take_ids(key, call.arg("count"), "count")
        except Exhausted as exc:
            raise self.service.retired_or(exc) from None
        self.counters.handed[IDS_ROUTE] += len(ids)
        return json_response({"key": key, "ids": ids})

    async def ranges(self, call: Call) -> Response:
        key = call.key
        check_query(call)
        size = call.arg("size")  # absent: the key's own step
        stripe = call.arg("stripe")  # absent: any stripe with ids left, the store's choice
        try:
            taken, row = await self.service.allocate(key, size, stripe)
        except Exhausted as exc:
            raise self.service.retired_or(exc) from None
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

    # -- snowflake ---------------------------------------------------------------------------

    async def _snowflake(self) -> SnowflakeGenerator:
        """The server's snowflake generator, made on first use, on a thread: leasing a worker id,
        and the first tick, which may wait out a previous holder's horizon or a young store's
        quarantine (up to a lease's ttl on top of the store's answer)."""
        flake = self.flake
        if flake is None:
            deadline = self.id_deadline + SnowflakeOptions().ttl
            try:
                flake = await self.pool.run(deadline, self._make_snowflake)
            except PoolTimeout as exc:
                raise HttpError(
                    503,
                    f"the snowflake generator is not ready ({exc}): taking a worker id, or "
                    "waiting out its previous holder's horizon; try again shortly",
                    PoolTimeout.headers,
                ) from exc
        return flake

    def _make_snowflake(self) -> SnowflakeGenerator:
        """Made and kept on the thread, under a thread lock: when the request's deadline
        passes first, the next request finds the generator, not a second worker id."""
        with self._flake_lock:
            if self.flake is None:
                options = SnowflakeOptions(namespace=self.config.snowflake_namespace)
                gen = self._minter().snowflake(self.config.snowflake_layout, options)
                gen.next_id()  # the first tick, off the event loop
                self.flake = gen
            return self.flake

    async def snowflake_get(self, call: Call) -> Response:
        gen = await self._snowflake()
        i = gen.next_id()
        self.counters.handed[SNOWFLAKE_ROUTE] += 1
        return Response(200, str(i))

    async def snowflake_ids(self, call: Call) -> Response:
        check_query(call)
        count = call.arg("count")
        gen = await self._snowflake()
        # A large batch spans ticks and waits for them: on a thread.
        ids = (
            gen.next_ids(count)
            if count <= 256
            else await self.pool.run(self.id_deadline, gen.next_ids, count)
        )
        # No per-key cap here: a snowflake generator cannot run ahead of the clock, so a large
        # batch costs time (up to 100,000 ids, 25 ms of a twitter layout's ids), not ids.
        self.counters.handed[SNOWFLAKE_IDS_ROUTE] += len(ids)
        return json_response({"ids": ids})

    def _decode(self, text: str) -> dict[str, Any]:
        if not NUMBER.fullmatch(text):
            raise HttpError(400, f"{text!r} is not an id: ids are non-negative integers")
        return layout_named(self.config.snowflake_layout).decode(int(text)).as_dict()

    async def snowflake_decode(self, call: Call) -> Response:
        check_query(call)
        return json_response(self._decode(call.arg("id")))

    async def leaf_decode(self, call: Call) -> Response:
        # Leaf's shapes (see the route's summary); a missing parameter is Spring's 400.
        text = call.arg("snowflakeId")
        try:
            parts = self._decode(text.strip())
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

    # -- quorum keys -------------------------------------------------------------------------

    async def quorum_ids(self, call: Call) -> Response:
        key = call.key
        if not self.config.quorum:
            raise HttpError(404, "this server has no quorum nodes (start it with --quorum URLS)")
        check_query(call)
        count = call.arg("count")
        # One bound for the whole request, its first use's node check included (docs/server.md)
        until = time.monotonic() + QuorumOptions.deadline
        gen = self.quorums.get(key)
        if gen is None:  # the first request reads the key and checks the nodes: on a thread
            missing = f"quorum:{key}"  # a name may be no quorum key and a segment key
            self.service.check_missing(missing)
            options = QuorumOptions(
                unsafe=self.config.unsafe_nodes,
                replicated_nodes=self.config.replicated_nodes,
                max_batch=MAX_QUORUM,
            )
            make = functools.partial(
                self._minter().quorum, key, split_nodes(self.config.quorum), options
            )
            try:
                gen = await self.pool.run(self.id_deadline, make)
            except KeyNotFound as exc:  # only keys an admin made: `idmint quorum add`
                self.service.remember_missing(missing, exc)
                raise
            self.quorums[key] = gen
        ids = await gen.take_async(count, until=until)
        self.counters.handed[QUORUM_ROUTE] += len(ids)
        return json_response({"key": key, "start": ids.start, "stop": ids.stop, "count": len(ids)})
