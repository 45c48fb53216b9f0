"""The HTTP pieces every route module shares: the request and response the RSGI and ASGI shells
hand over and take back, the error a handler raises for a status, how idmint's errors map to
statuses, and the bearer checks. app.py (the routes) and dropin.py (the peers' routes) import
this module; it imports neither (docs/design.md, "Layers")."""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

from .._errors import (
    ClockMovedBackwards,
    Closed,
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    LeaseLost,
    StoreUnavailable,
    WorkersExhausted,
)
from ..ids import BATCH_CAP_MAX

MAX_IDS = 100_000
MAX_RANGE = BATCH_CAP_MAX
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
NUMBER = re.compile(r"[0-9]{1,19}")

STATUS_OF: list[tuple[type[IdmintError], int]] = [
    (InvalidArgument, 400),
    (KeyNotFound, 404),
    (KeyExists, 409),
    (Exhausted, 410),
    (StoreUnavailable, 503),
    (Closed, 503),
    (LeaseLost, 503),
    (ClockMovedBackwards, 503),
    (WorkersExhausted, 503),
]


@dataclass
class Response:
    status: int
    body: str
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()


class HttpError(Exception):
    def __init__(self, status: int, reason: str, headers: tuple[tuple[str, str], ...] = ()):
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers


@dataclass
class Request:
    method: str
    path: str
    query: str
    authorization: str | None
    client: str
    body: bytes
    #: The body was over MAX_BODY: the shell stopped reading it (and `body` is empty).
    oversized: bool = False

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.body or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"the body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise HttpError(400, "the body must be a JSON object")
        return data


def bearer_in(authorization: str | None, accepted: tuple[str, ...]) -> bool:
    """Whether the header is exactly one of the `accepted` ones (the hot path's check)."""
    if authorization is None:
        return False
    given = authorization.encode("utf-8", "backslashreplace")
    found = False
    for header in accepted:  # every one compared, in constant time
        found |= hmac.compare_digest(given, header.encode("utf-8"))
    return found


def bearer_is(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` as a bearer token. Compared as bytes:
    compare_digest refuses str with non-ASCII characters (a TypeError: a 500 on every request),
    and the ASGI shell hands over header bytes as latin-1 text."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = value.strip().encode("utf-8", "backslashreplace")
    return hmac.compare_digest(given, token.encode("utf-8"))


def json_response(data: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(data, separators=(",", ":")), JSON)
