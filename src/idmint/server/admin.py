"""Key admin over HTTP: list, show, create, change the batch cap, raise the floor. Each route
is declared once in ROUTES, its body's fields with their types and limits."""

from __future__ import annotations

import functools
from dataclasses import replace

from ..ids import BATCH_CAP_MAX, DEFAULT_FIRST_ID, DEFAULT_STEP, ID_MAX, MAX_STRIPES
from .http import HttpError, Response, json_response
from .openapi import E400, E401, E403, E404, E409, E413, E503, json_ok
from .pools import Pool
from .routes import ADMIN, KEY, KEY_PATTERN, STR, Body, Call, Param, Route, body_int, path_key
from .service import IdService

#: The largest `max` of a key made over HTTP: a key with n stripes may go up to ID_MAX + 1 - n
#: (each stripe's counter must fit a BIGINT), which a schema cannot say per request; this bound
#: holds for every number of stripes. Leaving max out gives the key the highest it may have.
HTTP_KEY_MAX = ID_MAX + 1 - MAX_STRIPES

KEY_REF = {"$ref": "#/components/schemas/Key"}
ADMIN_ERRORS = {"400": E400, "401": E401, "403": E403, "404": E404, "503": E503}
MAX_BATCH = body_int(
    "max_batch",
    0,
    BATCH_CAP_MAX,
    f"the most ids one request may take from the key; 0: its step x 100, at most {BATCH_CAP_MAX}",
    default=0,
)

NEW_KEY = Body(
    (
        Param(
            "name",
            "body",
            KEY,
            required=True,
            missing="name is required and must be a string",
            pattern=KEY_PATTERN,
        ),
        body_int("step", 1, ID_MAX, default=DEFAULT_STEP),
        body_int("start", 0, ID_MAX, default=DEFAULT_FIRST_ID),
        body_int(
            "max",
            0,
            HTTP_KEY_MAX,
            "the largest id; absent: the highest a key with that many stripes may have",
            above="max must be at most {maximum} over HTTP, not {value}; leave it out for the "
            "highest the key may have",
        ),
        Param("description", "body", STR, max_length=256, default=""),
        MAX_BATCH,
        body_int(
            "stripes",
            1,
            MAX_STRIPES,
            "independent counters (a key needs at least as many ids); the default max is "
            "then lower by stripes - 1",
            default=1,
        ),
    )
)

ROUTES = (
    Route(
        "/v1/keys",
        ("GET",),
        ADMIN,
        "list_keys",
        "Every key",
        responses={
            "200": json_ok(
                {
                    "type": "object",
                    "required": ["keys"],
                    "properties": {"keys": {"type": "array", "items": KEY_REF}},
                }
            ),
            "401": E401,
            "403": E403,
            "503": E503,
        },
    ),
    Route(
        "/v1/keys",
        ("POST",),
        ADMIN,
        "add_key",
        "Create a key",
        body=NEW_KEY,
        responses={
            "201": json_ok(KEY_REF, "Created"),
            "400": E400,
            "401": E401,
            "403": E403,
            "409": E409,
            "413": E413,
            "503": E503,
        },
    ),
    Route(
        "/v1/keys/{key}",
        ("GET",),
        ADMIN,
        "show_key",
        "One key",
        (path_key(),),
        responses={"200": json_ok(KEY_REF), **ADMIN_ERRORS},
        trailing_slash=True,
    ),
    Route(
        "/v1/keys/{key}",
        ("PATCH",),
        ADMIN,
        "update_key",
        "Change the key's batch cap: the most ids one request may take (every server on the "
        "store applies it within seconds)",
        (path_key(),),
        Body(
            (replace(MAX_BATCH, required=True),),
            'the body must be {"max_batch": N} (0: the default cap)',
        ),
        responses={"200": json_ok(KEY_REF), **ADMIN_ERRORS, "413": E413},
        trailing_slash=True,
    ),
    Route(
        "/v1/keys/{key}/raise",
        ("POST",),
        ADMIN,
        "raise_key",
        "Raise the key's floor: every range from now on starts at or above `to`; it only moves up",
        (path_key(),),
        Body((body_int("to", 0, ID_MAX, required=True),), 'the body must be {"to": N}'),
        responses={"200": json_ok(KEY_REF), **ADMIN_ERRORS, "413": E413},
    ),
)


class AdminRoutes:
    """The handlers of ROUTES: store calls on the admin pool, within the store's deadline."""

    def __init__(self, service: IdService, pool: Pool) -> None:
        self.service = service
        self._minter = service.minter
        self.pool = pool

    async def list_keys(self, call: Call) -> Response:
        keys = await self.pool.run(self.service.store_deadline, self._minter().keys)
        rows = self.service.keep_rows(keys)
        # A token limited to some keys sees those only: the others are not its business.
        principal = call.principal
        if principal is not None and principal.keys != ("*",):
            rows = [k for k in rows if principal.covers(k.name)]
        return json_response({"keys": [k.as_dict() for k in rows]})

    async def show_key(self, call: Call) -> Response:
        key = call.key
        shown = await self.pool.run(self.service.store_deadline, self._minter().key, key)
        self.service.rows[key] = shown
        return json_response(shown.as_dict())

    async def update_key(self, call: Call) -> Response:
        key = call.key
        body = call.body()
        updated = await self.pool.run(
            self.service.store_deadline, self._minter().set_max_batch, key, body["max_batch"]
        )
        self.service.rows[key] = updated
        return json_response(updated.as_dict())

    async def add_key(self, call: Call) -> Response:
        body = call.body()
        name = body["name"]
        principal = call.principal
        if principal is not None and not principal.covers(name):
            raise HttpError(403, principal.not_admin_of(name))
        # Past the deadline the key may still be created: a retry then answers 409.
        created = await self.pool.run(
            self.service.store_deadline,
            functools.partial(
                self._minter().add_key,
                name,
                step=body["step"],
                start=body["start"],
                max=body["max"],
                description=body["description"],
                max_batch=body["max_batch"],
                stripes=body["stripes"],
            ),
        )
        self.service.forget_missing(name)
        self.service.rows[name] = created
        return json_response(created.as_dict(), 201)

    async def raise_key(self, call: Call) -> Response:
        key = call.key
        to = call.body()["to"]
        raised = await self.pool.run(
            self.service.store_deadline, self._minter().raise_floor, key, to
        )
        self.service.rows[key] = raised
        return json_response(raised.as_dict())
