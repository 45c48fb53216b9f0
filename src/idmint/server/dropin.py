"""Drop-in routes for callers of Didi's tinyid and of CosId's proxy: their wire formats,
translated onto idmint's generators and range allocations (docs/server.md, "Drop-in routes").

The shapes follow the peers' source:

- tinyid: tinyid-server `controller/IdContronller.java` (`/tinyid` is its context path, from
  its `application.properties`), `vo/Response.java`, `vo/ErrorCode.java`, and the segment as
  `service/impl/DbSegmentIdServiceImpl.java` builds it and tinyid-base `entity/SegmentId.java`
  consumes it: ids `(currentId, maxId]` congruent to `remainder` modulo `delta`.
- CosId: cosid-proxy-server `controller/IdController.java` and `SegmentController.java`,
  cosid-proxy-api `SegmentApi.java` and `ErrorResponse.java`; its client's segment is
  `(maxId - step, maxId]` (cosid-core `segment/DefaultIdSegment.java`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from .._errors import Exhausted, IdmintError
from ..ids import BATCH_CAP_MAX, ID_MAX, KEY_NAME_PATTERN, KEY_NAME_RULE
from . import http
from .http import JSON, MAX_IDS, STATUS_OF, HttpError, Response, bearer_in, json_response
from .openapi import E400_CAP, E401_IDS, E404, E410, E503, TEXT, json_ok, text_ok
from .pools import PoolTimeout
from .routes import (
    IDS,
    KEY,
    KEY_PATTERN,
    QUERY_TOKEN,
    SPRING_METHODS,
    STR,
    Call,
    Param,
    Route,
    path_key,
    query_int,
)
from .service import IdService, check_cap

TINYID_PREFIX = "/tinyid/id/"
TINYID_IDS = TINYID_PREFIX + "nextId"
TINYID_IDS_SIMPLE = TINYID_PREFIX + "nextIdSimple"
TINYID_SEGMENT = TINYID_PREFIX + "nextSegmentId"
TINYID_SEGMENT_SIMPLE = TINYID_PREFIX + "nextSegmentIdSimple"
COSID_ID = "/ids/{key}"
COSID_SEGMENT = "/segments/{namespace}/{key}"
COSID_DISTRIBUTOR = "/segments/distributor/{namespace}/{key}"

TINYID_OK = 200  # Response.java's code on success
TOKEN_ERR = 5  # ErrorCode.TOKEN_ERR, message "token is error"
SYS_ERR = 6  # ErrorCode.SYS_ERR: any other failure (the message says which)
LOADING_PERCENT = 20  # Constants.LOADING_PERCENT: where a tinyid client loads its next segment
#: CosId's largest nextMaxId step at its default segment step: SegmentChainId's prefetch asks
#: for step x segments, the segments doubling while its callers go hungry, up to
#: MAX_PREFETCH_DISTANCE (100,000,000), so 10 x 100,000,000.
COSID_MAX_STEP = 1_000_000_000

#: The GETs answer_now may answer before any routing: tinyid's nextId and nextIdSimple, and
#: CosId's /ids/{key} (a prefix of each).
NOW_PREFIXES = (TINYID_IDS, "/ids/")
_NOW_TEXT = [("content-type", http.TEXT)]
_NOW_JSON = [("content-type", JSON)]

#: Takes a tinyid answer's ids: its data as JSON, its plain text, how many ids.
Take = Callable[[Call, str], Awaitable[tuple[str, str, int]]]


def _path_part(text: str, what: str) -> str:
    if not KEY_NAME_PATTERN.fullmatch(text):
        raise HttpError(400, f"bad {what} {text!r}: 1 to 128 of A-Z a-z 0-9 . _ : -")
    return text


# -- the declarations ----------------------------------------------------------------------------

BIZ_TYPE = Param(
    "bizType",
    "query",
    KEY,
    "The key: " + KEY_NAME_RULE,
    required=True,
    missing="bizType is required: the name of an idmint key",
    pattern=KEY_PATTERN,
)
TOKEN = Param(
    "token",
    "query",
    STR,
    "The client token (or the admin token), when the server has one",
)
BATCH_SIZE = query_int(
    "batchSize",
    1,
    MAX_IDS,
    f"How many ids, 1 to {MAX_IDS}, at most the key's batch cap; absent or empty: 1, as "
    "tinyid takes it",
    default=1,
    blank_is_default=True,
)
NAMESPACE = Param(
    "namespace",
    "path",
    STR,
    "CosId's namespace: checked, not used (the key is the name)",
    required=True,
    pattern=KEY_PATTERN,
    check=lambda text: _path_part(text, "namespace"),
)
SEGMENT_ID: dict[str, Any] = {
    "type": "object",
    "required": ["maxId", "loadingId", "currentId", "delta", "remainder"],
    "description": "tinyid's SegmentId: its ids are those in (currentId, maxId] congruent "
    "to remainder modulo delta, a range idmint allocated",
    "properties": {
        name: {"type": "integer"}
        for name in ("maxId", "loadingId", "currentId", "delta", "remainder")
    },
}
COSID_ERROR = {
    "description": "CosId's ErrorResponse, its code the HTTP status; or, for a bad key "
    "name or a missing client token, idmint's one-line reason",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["code", "msg", "errors"],
                "properties": {
                    "code": {"type": "string"},
                    "msg": {"type": "string"},
                    "errors": {"type": "array", "items": {}},
                },
            }
        },
        **TEXT,
    },
}
COSID_ERRORS = {str(status): COSID_ERROR for status in (400, 401, 404, 409, 410, 503)}
LONG = {"type": "integer", "format": "int64"}


def _tinyid_json(data: dict[str, Any]) -> dict[str, Any]:
    """tinyid's JSON answers: HTTP 200 (or 400 for input it could not parse) and a code."""
    body = {
        "type": "object",
        "required": ["data", "code", "message"],
        "properties": {
            "data": {**data, "nullable": True},
            "code": {"type": "integer", "enum": [TINYID_OK, TOKEN_ERR, SYS_ERR]},
            "message": {"type": "string"},
        },
    }
    return {
        "200": json_ok(
            body,
            "OK (code 200), or tinyid's error codes: 5, a missing or wrong token; 6, any "
            "other failure (the message says which)",
        ),
        "400": json_ok(body, "Bad input (code 6)"),
    }


def _tinyid_text(summary: str) -> dict[str, Any]:
    """tinyid's plain answers: text, and idmint's statuses and reasons for errors."""
    return {
        "200": text_ok(summary),
        "400": E400_CAP,
        "401": E401_IDS,
        "404": E404,
        "410": E410,
        "503": E503,
    }


def _tinyid(
    path: str, handler: str, summary: str, params: tuple[Param, ...], data: dict[str, Any] | None
) -> Route:
    """A tinyid route: its JSON form (`data`: the schema of its data), or its plain form."""
    responses = _tinyid_json(data) if data is not None else _tinyid_text(summary)
    return Route(path, SPRING_METHODS, QUERY_TOKEN, handler, summary, params, None, responses, True)


IDS_PARAMS = (BIZ_TYPE, TOKEN, BATCH_SIZE)
SEGMENT_PARAMS = (BIZ_TYPE, TOKEN)
ROUTES = (
    _tinyid(
        TINYID_IDS,
        "tinyid_ids",
        "tinyid's nextId: batchSize ids of the key",
        IDS_PARAMS,
        {"type": "array", "items": {"type": "integer"}},
    ),
    _tinyid(
        TINYID_IDS_SIMPLE,
        "tinyid_ids",
        "tinyid's nextIdSimple: batchSize ids of the key, comma-separated",
        IDS_PARAMS,
        None,
    ),
    _tinyid(
        TINYID_SEGMENT,
        "tinyid_segment",
        "tinyid's nextSegmentId: a fresh range of the key's step",
        SEGMENT_PARAMS,
        SEGMENT_ID,
    ),
    _tinyid(
        TINYID_SEGMENT_SIMPLE,
        "tinyid_segment",
        "tinyid's nextSegmentIdSimple: a fresh range of the key's step, as "
        "currentId,loadingId,maxId,delta,remainder (tinyid-client parses it)",
        SEGMENT_PARAMS,
        None,
    ),
    Route(
        COSID_ID,
        ("GET",),
        IDS,
        "cosid_id",
        "CosId proxy's GET /ids/{name}: one id of the key, a JSON number",
        (path_key(),),
        responses={"200": json_ok(LONG), **COSID_ERRORS},
        hands_ids=True,
        greedy=True,
    ),
    Route(
        COSID_SEGMENT,
        ("PATCH",),
        IDS,
        "cosid_segment",
        "CosId proxy's nextMaxId: a fresh range of step consecutive ids, answered as its last "
        "id (the client's segment is (maxId - step, maxId])",
        (
            NAMESPACE,
            path_key(),
            query_int(
                "step",
                1,
                COSID_MAX_STEP,
                f"How many ids: at most the key's batch cap, or {COSID_MAX_STEP} on a key "
                f"without a maximum whose cap is the largest ({BATCH_CAP_MAX})",
                required=True,
                missing="step is required: how many ids the segment holds",
            ),
        ),
        responses={"200": json_ok(LONG), **COSID_ERRORS},
        hands_ids=True,
    ),
    Route(
        COSID_DISTRIBUTOR,
        ("POST",),
        IDS,
        "cosid_distributor",
        "CosId proxy's createDistributor: idempotent, an empty 200 when the key exists, has "
        "no stripes and hands out ids above offset",
        (
            NAMESPACE,
            path_key(),
            query_int("offset", 0, ID_MAX, default=0),
            # Checked, unused: each nextMaxId says its own step.
            query_int("step", 1, ID_MAX, default=1),
        ),
        responses={"200": text_ok("Empty"), **COSID_ERRORS},
    ),
)


class DropIn:
    """The handlers of ROUTES, on the id service's generators and allocations (service.py)."""

    def __init__(self, service: IdService) -> None:
        self.service = service
        self.counters = service.counters

    # -- one id before any routing ------------------------------------------------------------

    def answer_now(self, path: str, scope: Any) -> tuple[str, list[tuple[str, str]]] | None:
        """One id for a GET of tinyid's nextId or nextIdSimple or of CosId's /ids/{key}, from
        the key's buffer, as the app answers Leaf's route before routing (App.__rsgi__): its
        body and headers. `scope` is granian's: its query string and headers are read only
        when needed (each is made for the asking). None when the routed path must answer: a
        query with escapes, a batchSize other than 1, a token not given as the hot path takes
        it, a key not loaded yet, a spent budget, an empty buffer, an error. The router answers
        alike, only slower (docs/benchmarks.md, HTTP server: the drop-in routes)."""
        service = self.service
        accepted = service.bearers
        if path.startswith("/ids/"):
            key, route = path[5:], COSID_ID
            if accepted:
                header = scope.headers.get("authorization")
                tokens = service.tokens
                if not (
                    bearer_in(header, accepted) if tokens is None else tokens.may_take(key, header)
                ):
                    return None
        elif path in (TINYID_IDS, TINYID_IDS_SIMPLE):
            query = scope.query_string
            if "%" in query or "+" in query:
                return None  # parse_qs's to undo
            biz: str | None = None
            token: str | None = None
            for part in query.split("&"):  # the last of each wins, as in Call.arg
                name, _, value = part.partition("=")
                if name == "bizType":
                    biz = value
                elif name == "token":
                    token = value
                elif name == "batchSize" and value.strip() not in ("", "1"):
                    return None  # more ids, or a bad count: Call.arg checks every value
            if biz is None:
                return None
            if accepted:
                tokens = service.tokens
                if tokens is None:
                    ok = (token is not None and bearer_in(f"Bearer {token}", accepted)) or (
                        bearer_in(scope.headers.get("authorization"), accepted)
                    )
                else:
                    ok = (token is not None and tokens.may_take(biz, f"Bearer {token}")) or (
                        tokens.may_take(biz, scope.headers.get("authorization"))
                    )
                if not ok:
                    return None
            key, route = biz, path
        else:
            return None
        i = service.one_now(key)
        if i is None:
            return None
        self.counters.handed[route] += 1
        if route == TINYID_IDS:
            return f'{{"data":[{i}],"code":{TINYID_OK},"message":""}}', _NOW_JSON
        return str(i), _NOW_JSON if route == COSID_ID else _NOW_TEXT

    # -- errors ------------------------------------------------------------------------------

    def _failure(self, route: str, exc: Exception) -> tuple[int, str]:
        """The status idmint answers an error with, and its one-line reason (counted)."""
        if isinstance(exc, Exhausted):
            exc = self.service.retired_or(exc)  # a retired key said so, as on idmint's routes
        if isinstance(exc, HttpError):
            status = exc.status
        elif isinstance(exc, PoolTimeout):
            status = 503
        else:
            status = next((code for kind, code in STATUS_OF if isinstance(exc, kind)), 500)
        self.counters.error(route, status)
        return status, " ".join(str(exc).split())

    # -- tinyid ------------------------------------------------------------------------------

    def _token_ok(self, call: Call) -> bool:
        """With a client token set, the `token` parameter (or the bearer header) must be it or
        the admin token; without one, anything goes, as on idmint's own id routes. With a
        tokens file, either must be a token that may take ids of the bizType: else this
        raises its 401 or 403."""
        accepted = self.service.bearers
        if not accepted:
            return True
        given = call.arg("token")
        tokens = self.service.tokens
        if tokens is not None:
            key = call.arg("bizType")
            found = [
                t
                for t in (
                    tokens.identify_secret(given) if given else None,
                    tokens.identify(call.request.authorization),
                )
                if t is not None
            ]
            allowed = tokens.takers(key).names
            token = next((t for t in found if t.name in allowed), found[0] if found else None)
            self.service.check_access(key, token, "token=..., as tinyid's clients send it")
            return True
        if given is not None and bearer_in(f"Bearer {given}", accepted):
            return True
        # A bearer header, spelt as the other id routes take it.
        return self.service.accepts(call.request.authorization)

    async def _tinyid(self, call: Call, take: Take) -> Response:
        """tinyid's JSON form (`{"data", "code", "message"}`, HTTP 200 as tinyid answers, but
        400 for input it could not parse), or its plain form (text; errors are idmint's)."""
        route = call.route.path
        simple = route.endswith("Simple")
        request = call.request
        if request.body:
            # tinyid's users POST forms (`curl -d 'bizType=order'`): Spring reads the fields of
            # a form body as it reads query parameters.
            form = request.body.decode("utf-8", "replace")
            request = replace(request, query=f"{request.query}&{form}" if request.query else form)
            call = replace(call, request=request)
        try:
            if not self._token_ok(call):
                raise HttpError(
                    401,
                    "this route needs the client token (token=..., as tinyid's clients send it)",
                )
            data, text, handed = await take(call, call.arg("bizType"))
        except (HttpError, IdmintError, PoolTimeout) as exc:
            if simple:  # the router answers it: a status and a one-line reason
                if isinstance(exc, Exhausted):
                    raise self.service.retired_or(exc) from None
                raise
            status, reason = self._failure(route, exc)
            if status == 401:
                return json_response({"data": None, "code": TOKEN_ERR, "message": "token is error"})
            if status == 403:  # a token of the tokens file, not for this bizType: tinyid's code
                message = f"token is error: {reason}"
                return json_response({"data": None, "code": TOKEN_ERR, "message": message})
            body = {"data": None, "code": SYS_ERR, "message": reason}
            return json_response(body, 400 if status == 400 else 200)
        self.counters.handed[route] += handed
        if simple:
            return Response(200, text)
        # The data comes encoded: json.dumps of the whole answer took about 3 us.
        return Response(200, f'{{"data":{data},"code":{TINYID_OK},"message":""}}', JSON)

    async def _ids(self, call: Call, key: str) -> tuple[str, str, int]:
        # tinyid takes an empty batchSize as 1 (an Integer parameter left null)
        ids = await self.service.take_ids(key, call.arg("batchSize"), "batchSize")
        text = ",".join(map(str, ids))
        return f"[{text}]", text, len(ids)

    async def _segment(self, call: Call, key: str) -> tuple[str, str, int]:
        """A fresh range of the key (its step), as tinyid's SegmentId: a client hands out the
        ids in (currentId, maxId] that are congruent to remainder modulo delta, which are the
        range's ids exactly (a striped key's range has stride delta)."""
        taken, _ = await self.service.allocate(key, None, None)
        ids = taken.range
        current = ids.start - 1  # SegmentId.init() moves it to start - delta when delta > 1
        segment = {  # SegmentId's fields in their order (Jackson writes them so)
            "maxId": ids.last,
            "loadingId": current + (ids.stop - ids.start) * LOADING_PERCENT // 100,
            "currentId": current,
            "delta": ids.stride,
            "remainder": ids.start % ids.stride,
        }
        text = ",".join(
            str(segment[name]) for name in ("currentId", "loadingId", "maxId", "delta", "remainder")
        )
        return json.dumps(segment, separators=(",", ":")), text, len(ids)

    # Each serves its route's JSON form and its plain one (the route's path says which).
    async def tinyid_ids(self, call: Call) -> Response:
        return await self._tinyid(call, self._ids)

    async def tinyid_segment(self, call: Call) -> Response:
        return await self._tinyid(call, self._segment)

    # -- CosId -------------------------------------------------------------------------------

    async def _cosid(self, route: str, answer: Awaitable[tuple[int | None, int]]) -> Response:
        """CosId's answers: the id as a JSON number, or its ErrorResponse `{"code", "msg",
        "errors"}` with idmint's status (its code the status, as text)."""
        try:
            value, handed = await answer
        except (HttpError, IdmintError, PoolTimeout) as exc:
            status, reason = self._failure(route, exc)
            headers = exc.headers if isinstance(exc, HttpError) else ()
            response = json_response({"code": str(status), "msg": reason, "errors": []}, status)
            response.headers = headers
            return response
        if value is None:  # createDistributor: Spring's empty 200 for a void method
            return Response(200, "")
        self.counters.handed[route] += handed
        return Response(200, str(value), JSON)  # a JSON number: json.dumps took 2 us for it

    async def cosid_id(self, call: Call) -> Response:
        key = call.key

        async def one() -> tuple[int | None, int]:
            [i] = await self.service.take_ids(key, 1, "count")
            return i, 1

        return await self._cosid(COSID_ID, one())

    async def cosid_segment(self, call: Call) -> Response:
        key = call.key

        async def next_max_id() -> tuple[int | None, int]:
            call.arg("namespace")
            step = call.arg("step")
            row = await self.service.key_row(key)
            if row.stripes > 1:
                raise HttpError(400, self._striped(key))
            # CosId's client makes its segment (maxId - step, maxId] from the step it asked
            # (IdSegmentDistributor.nextIdSegment, DefaultIdSegment): a shorter range would
            # make it count down into ids handed out before. So the whole step, or the cap's
            # 400, unless the key opted in: no maximum, and the largest cap.
            if row.batch_cap < BATCH_CAP_MAX or row.bounded:
                check_cap(row, step, "step")
            ids = (await self.service.allocate(key, step, None, capped=False))[0].range
            if len(ids) < step:  # a bounded key's last ids: never served, so no gap
                raise HttpError(
                    410,
                    f"key {key!r} has fewer than {step} ids left: CosId's segment must hold "
                    f"exactly step ids (the last {len(ids)} are skipped)",
                )
            return ids.last, len(ids)

        return await self._cosid(COSID_SEGMENT, next_max_id())

    async def cosid_distributor(self, call: Call) -> Response:
        """The key must exist (keys are idmint's admin's to make), with every id it hands out
        above `offset`, as CosId's would be."""
        key = call.key

        async def check() -> tuple[int | None, int]:
            call.arg("namespace")
            offset = call.arg("offset")
            call.arg("step")  # checked, unused: each call says its own
            row = await self.service.key_row(key)
            if row.stripes > 1:
                raise HttpError(400, self._striped(key))
            if row.max_id <= offset:
                raise HttpError(
                    409,
                    f"key {key!r} would hand out ids from {row.max_id}, not above the offset "
                    f"{offset}: raise it first (POST /v1/keys/{key}/raise)",
                )
            return None, 0

        return await self._cosid(COSID_DISTRIBUTOR, check())

    @staticmethod
    def _striped(key: str) -> str:
        return (
            f"key {key!r} has stripes: its ranges are not consecutive ids, and CosId's segments "
            "must be; use a key without stripes"
        )
