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

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol
from urllib.parse import parse_qs

from .._errors import IdmintError
from ..ids import ID_MAX, KEY_NAME_PATTERN, Allocation, Key, check_key_name, is_digits
from .config import ServerConfig
from .http import (
    MAX_IDS,
    MAX_RANGE,
    STATUS_OF,
    HttpError,
    Request,
    Response,
    bearer_in,
    bearer_is,
    json_response,
)
from .metrics import Counters
from .pools import PoolTimeout

TINYID_PREFIX = "/tinyid/id/"
TINYID_IDS = TINYID_PREFIX + "nextId"
TINYID_IDS_SIMPLE = TINYID_PREFIX + "nextIdSimple"
TINYID_SEGMENT = TINYID_PREFIX + "nextSegmentId"
TINYID_SEGMENT_SIMPLE = TINYID_PREFIX + "nextSegmentIdSimple"
COSID_ID = "/ids/{key}"
COSID_SEGMENT = "/segments/{namespace}/{key}"
COSID_DISTRIBUTOR = "/segments/distributor/{namespace}/{key}"
#: The routes that hand out ids, for the per-route counts.
ID_ROUTES = (
    TINYID_IDS,
    TINYID_IDS_SIMPLE,
    TINYID_SEGMENT,
    TINYID_SEGMENT_SIMPLE,
    COSID_ID,
    COSID_SEGMENT,
)
#: The access class of tinyid's routes: the client token (when one is set) as tinyid passes
#: it, in a `token` query parameter, or as a bearer header; checked by the handler, which
#: answers a wrong one in tinyid's own shape.
QUERY_TOKEN = "ids-query-token"

TINYID_OK = 200  # Response.java's code on success
TOKEN_ERR = 5  # ErrorCode.TOKEN_ERR, message "token is error"
SYS_ERR = 6  # ErrorCode.SYS_ERR: any other failure (the message says which)
LOADING_PERCENT = 20  # Constants.LOADING_PERCENT: where a tinyid client loads its next segment

Take = Callable[["Request", str], Awaitable[tuple[Any, str, int]]]


def _path_part(text: str, what: str) -> str:
    if not KEY_NAME_PATTERN.fullmatch(text):
        raise HttpError(400, f"bad {what} {text!r}: 1 to 128 of A-Z a-z 0-9 . _ : -")
    return text


class IdRoutes(Protocol):
    """What the drop-in routes use of the App (server/app.py) that builds them: its id
    paths, config and counters. Stated here so that this module does not import app.py,
    which imports it (imports point one way; tests/test_layers.py)."""

    config: ServerConfig
    counters: Counters
    _id_bearers: tuple[str, ...]

    async def _key_row(self, key: str) -> Key: ...

    async def _take_ids(self, key: str, count: int, what: str) -> list[int]: ...

    async def _allocate(
        self, key: str, size: int | None, stripe: int | None
    ) -> tuple[Allocation, Key]: ...


class DropIn:
    """The handlers of the drop-in routes, on the app's generators, allocations and counters."""

    def __init__(self, app: IdRoutes) -> None:
        self.app = app

    # -- routing -----------------------------------------------------------------------------

    @staticmethod
    def match(path: str) -> tuple[str, str | None]:
        """CosId's segment routes and the key (its `name`) in them; ("", None) otherwise."""
        if path.startswith("/segments/"):
            parts = path[len("/segments/") :].split("/")
            if len(parts) == 3 and parts[0] == "distributor":
                return COSID_DISTRIBUTOR, parts[2]
            if len(parts) == 2:
                return COSID_SEGMENT, parts[1]
        return "", None

    @staticmethod
    def _namespace(request: Request) -> str:
        """CosId's namespace, from the path: checked, and otherwise unused (see the docs)."""
        return _path_part(request.path.split("/")[-2], "namespace")

    # -- errors ------------------------------------------------------------------------------

    def _failure(self, route: str, exc: Exception) -> tuple[int, str]:
        """The status idmint answers an error with, and its one-line reason (counted)."""
        if isinstance(exc, HttpError):
            status = exc.status
        elif isinstance(exc, PoolTimeout):
            status = 503
        else:
            status = next((code for kind, code in STATUS_OF if isinstance(exc, kind)), 500)
        self.app.counters.error(route, status)
        return status, " ".join(str(exc).split())

    # -- tinyid ------------------------------------------------------------------------------

    def _token_ok(self, request: Request) -> bool:
        """With a client token set, the `token` parameter (or the bearer header) must be it or
        the admin token; without one, anything goes, as on idmint's own id routes."""
        accepted = self.app._id_bearers
        if not accepted:
            return True
        given = parse_qs(request.query, keep_blank_values=True).get("token")
        if given and bearer_in(f"Bearer {given[-1]}", accepted):
            return True
        config = self.app.config  # a bearer header, spelt as the other id routes take it
        tokens = (t for t in (config.client_token, config.token) if t)
        return any(bearer_is(request.authorization, token) for token in tokens)

    async def _tinyid(self, request: Request, route: str, take: Take) -> Response:
        """tinyid's JSON form (`{"data", "code", "message"}`, HTTP 200 as tinyid answers, but
        400 for input it could not parse), or its plain form (text; errors are idmint's)."""
        simple = route.endswith("Simple")
        if request.body:
            # tinyid's users POST forms (`curl -d 'bizType=order'`): Spring reads the fields of
            # a form body as it reads query parameters.
            form = request.body.decode("utf-8", "replace")
            request = replace(request, query=f"{request.query}&{form}" if request.query else form)
        try:
            if not self._token_ok(request):
                raise HttpError(
                    401,
                    "this route needs the client token (token=..., as tinyid's clients send it)",
                )
            biz = parse_qs(request.query, keep_blank_values=True).get("bizType")
            if not biz:
                raise HttpError(400, "bizType is required: the name of an idmint key")
            data, text, handed = await take(request, check_key_name(biz[-1]))
        except (HttpError, IdmintError, PoolTimeout) as exc:
            if simple:
                raise  # the router answers it: a status and a one-line reason
            status, reason = self._failure(route, exc)
            if status == 401:
                return json_response({"data": None, "code": TOKEN_ERR, "message": "token is error"})
            body = {"data": None, "code": SYS_ERR, "message": reason}
            return json_response(body, 400 if status == 400 else 200)
        self.app.counters.handed[route] += handed
        if simple:
            return Response(200, text)
        return json_response({"data": data, "code": TINYID_OK, "message": ""})

    async def _ids(self, request: Request, key: str) -> tuple[Any, str, int]:
        given = parse_qs(request.query, keep_blank_values=True).get("batchSize") or []
        for value in given:  # every one checked: the last one is used
            text = value.strip()
            if text and not (is_digits(text) and 1 <= int(text) <= MAX_IDS):
                raise HttpError(
                    400, f"batchSize must be an integer from 1 to {MAX_IDS}, not {text!r}"
                )
        # tinyid takes an empty batchSize as 1 (an Integer parameter left null)
        count = int(given[-1]) if given and given[-1].strip() else 1
        ids = await self.app._take_ids(key, count, "batchSize")
        return ids, ",".join(map(str, ids)), len(ids)

    async def _segment(self, request: Request, key: str) -> tuple[Any, str, int]:
        """A fresh range of the key (its step), as tinyid's SegmentId: a client hands out the
        ids in (currentId, maxId] that are congruent to remainder modulo delta, which are the
        range's ids exactly (a striped key's range has stride delta)."""
        taken, _ = await self.app._allocate(key, None, None)
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
        return segment, text, len(ids)

    async def tinyid_ids(self, request: Request, key: str | None) -> Response:
        return await self._tinyid(request, TINYID_IDS, self._ids)

    async def tinyid_ids_simple(self, request: Request, key: str | None) -> Response:
        return await self._tinyid(request, TINYID_IDS_SIMPLE, self._ids)

    async def tinyid_segment(self, request: Request, key: str | None) -> Response:
        return await self._tinyid(request, TINYID_SEGMENT, self._segment)

    async def tinyid_segment_simple(self, request: Request, key: str | None) -> Response:
        return await self._tinyid(request, TINYID_SEGMENT_SIMPLE, self._segment)

    # -- CosId -------------------------------------------------------------------------------

    async def _cosid(self, route: str, answer: Awaitable[tuple[Any, int]]) -> Response:
        """CosId's answers: the value as JSON, or its ErrorResponse `{"code", "msg",
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
        self.app.counters.handed[route] += handed
        return json_response(value)

    async def cosid_id(self, request: Request, key: str | None) -> Response:
        """One id of key `key`: a bare JSON number, as CosId's `GET /ids/{name}`."""
        assert key is not None

        async def one() -> tuple[Any, int]:
            [i] = await self.app._take_ids(key, 1, "count")
            return i, 1

        return await self._cosid(COSID_ID, one())

    async def cosid_segment(self, request: Request, key: str | None) -> Response:
        """CosId's nextMaxId: a fresh range of `step` consecutive ids of key `key`, answered as
        its last id, so the client's (maxId - step, maxId] is that range exactly."""
        assert key is not None

        async def next_max_id() -> tuple[Any, int]:
            self._namespace(request)
            step = request.param("step", 0, MAX_RANGE)
            if not step:
                raise HttpError(400, "step is required: how many ids the segment holds")
            if (await self.app._key_row(key)).stripes > 1:
                raise HttpError(400, self._striped(key))
            taken, _ = await self.app._allocate(key, step, None)
            if len(taken.range) < step:  # a bounded key's last ids: never served, so no gap
                raise HttpError(
                    410,
                    f"key {key!r} has fewer than {step} ids left: CosId's segment must hold "
                    f"exactly step ids (the last {len(taken.range)} are skipped)",
                )
            return taken.range.last, len(taken.range)

        return await self._cosid(COSID_SEGMENT, next_max_id())

    async def cosid_distributor(self, request: Request, key: str | None) -> Response:
        """CosId's createDistributor: idempotent; the key must exist (keys are idmint's admin's
        to make), and every id it hands out must be above `offset`, as CosId's would be."""
        assert key is not None

        async def check() -> tuple[Any, int]:
            self._namespace(request)
            query = parse_qs(request.query, keep_blank_values=True)
            offset = (query.get("offset") or ["0"])[-1].strip()
            if not is_digits(offset) or len(offset) > 19:
                raise HttpError(400, f"offset must be a non-negative integer, not {offset!r}")
            request.param("step", 1, ID_MAX)  # checked, unused: each call says its own
            row = await self.app._key_row(key)
            if row.stripes > 1:
                raise HttpError(400, self._striped(key))
            if row.max_id <= int(offset):
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
