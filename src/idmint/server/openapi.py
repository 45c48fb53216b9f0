"""The OpenAPI 3.0 document of the server, served at /openapi.json (offline, no CDN), made
from the route table (routes.py): each route's path, methods, access, parameters (their types
and limits, as the route checks them) and responses. The response descriptions the routes
share are here."""

from __future__ import annotations

from typing import Any

from ..ids import BATCH_CAP_MAX
from .routes import ADMIN, CHOICE, IDS, INT, KEY_PATTERN, KEYS, STR, Param, Route

TEXT = {"text/plain": {"schema": {"type": "string"}}}


def error(description: str) -> dict[str, Any]:
    return {"description": description + " (a one-line reason in plain text)", "content": TEXT}


E400 = error("Bad input: a key name, a count, a body")
E400_CAP = error(
    "Bad input: a key name, a count or size, or more ids than the key's batch cap (its "
    "max_batch, also in the idmint-batch-cap header)"
)
E401 = error("The bearer token is missing or wrong (when a token is configured)")
E401_IDS = error("The client token is missing or wrong (when one is configured)")
E403 = error(
    "Admin while no admin token is configured (loopback clients may with --admin-loopback)"
)
E404 = error("Unknown key")
E409 = error("The key already exists")
E410 = error("The key is exhausted: every id up to its maximum is used")
E410_RANGE = {
    **error(
        "The key is exhausted: every id up to its maximum is used; or, when a stripe was "
        "asked for, that stripe of a striped key is (the idmint-stripe and idmint-stripes "
        "headers say which, of how many: take a range from another stripe)"
    ),
    "headers": {
        "idmint-last-id": {
            "description": "the key's maximum",
            "schema": {"type": "integer"},
        },
        "idmint-stripe": {
            "description": "the stripe that is exhausted (absent when the whole key is)",
            "schema": {"type": "integer", "minimum": 0},
        },
        "idmint-stripes": {
            "description": "how many stripes the key has (with idmint-stripe)",
            "schema": {"type": "integer", "minimum": 1},
        },
    },
}
E503 = error(
    "The store is unreachable or did not answer in time and no ids are buffered, too many "
    "requests wait for the store already, or the server is stopping"
)

KEY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "next_id", "step", "start", "max", "remaining", "bounded"],
    "properties": {
        "name": {"type": "string"},
        "next_id": {"type": "integer", "description": "where the next range taken starts"},
        "step": {"type": "integer"},
        "start": {"type": "integer", "description": "the key's floor"},
        "max": {"type": "integer", "description": "the largest id the key hands out"},
        "remaining": {"type": "integer"},
        "bounded": {"type": "boolean"},
        "description": {"type": "string"},
        "updated_at": {"type": "string", "format": "date-time", "nullable": True},
        "max_batch": {
            "type": "integer",
            "description": "the most ids one request may take, as set; 0: the default rule",
        },
        "batch_cap": {
            "type": "integer",
            "description": "the most ids one request may take: max_batch, or the step x 100, "
            f"at most {BATCH_CAP_MAX}",
        },
        "stripes": {
            "type": "integer",
            "description": "the key's independent counters: stripe k hands out start + k, "
            "start + k + stripes, ...",
        },
        "stripe_next": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "with stripes > 1: where each stripe's next range starts, by stripe",
        },
    },
}


def json_ok(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def text_ok(description: str) -> dict[str, Any]:
    return {"description": description, "content": TEXT}


E413 = error("The body is too large")


def _schema(param: Param) -> dict[str, Any]:
    """The JSON schema of a parameter, from the same fields its parsing reads."""
    if param.blank_is_default:
        # A string: tinyid takes an empty batchSize (Spring leaves the Integer null), which an
        # integer schema cannot allow: digits from 1 to the maximum, or nothing.
        return {
            "type": "string",
            "pattern": f"^({_up_to(param.maximum)})?$",
            "default": str(param.default),
        }
    if param.kind == INT:
        schema: dict[str, Any] = {
            "type": "integer",
            "minimum": param.minimum,
            "maximum": param.maximum,
        }
        default = param.default
        if not param.required and default is not None and param.minimum <= default <= param.maximum:
            schema["default"] = default
        return schema
    if param.kind == KEYS:
        items = {"type": "string", "pattern": KEY_PATTERN}
        return {"type": "array", "maxItems": param.max_items, "items": items}
    if param.kind == CHOICE:
        return {"type": "string", "enum": list(param.choices)}
    schema = {"type": "string"}
    if param.pattern:
        schema["pattern"] = param.pattern
    if param.max_length:
        schema["maxLength"] = param.max_length
    if param.kind == STR and param.default is not None:
        schema["default"] = param.default
    return schema


def _up_to(maximum: int) -> str:
    """A regex of the decimal integers from 1 to `maximum`, a power of ten."""
    digits = len(str(maximum)) - 1
    assert maximum == 10**digits and digits > 0, maximum
    return f"[1-9][0-9]{{0,{digits - 1}}}|{maximum}"


def parameter(param: Param) -> dict[str, Any]:
    """The OpenAPI parameter object of a path or query parameter."""
    found: dict[str, Any] = {
        "name": param.name,
        "in": param.where,
        "required": param.required or param.where == "path",
    }
    if param.description:
        found["description"] = param.description
    found["schema"] = _schema(param)
    if param.kind == KEYS:
        found |= {"style": "form", "explode": True}
    return found


def body_schema(fields: tuple[Param, ...]) -> dict[str, Any]:
    properties = {}
    for field in fields:
        schema = _schema(field)
        if field.description:
            schema["description"] = field.description
        properties[field.name] = schema
    schema = {"type": "object", "additionalProperties": False, "properties": properties}
    required = [f.name for f in fields if f.required]
    return {**schema, "required": required} if required else schema


def operation(route: Route) -> dict[str, Any]:
    found: dict[str, Any] = {"summary": route.summary}
    if route.access in (IDS, ADMIN):  # a bearer token, when the server has one
        found["security"] = [{"bearer": []}, {}]
    params = [parameter(p) for p in route.params if p.where != "body"]
    if params:
        found["parameters"] = params
    if route.body is not None:
        schema = body_schema(route.body.fields)
        found["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    found["responses"] = dict(route.responses)
    return found


def openapi_document(version: str, routes: tuple[Route, ...]) -> dict[str, Any]:
    """The document of `routes`: every route under each of its methods."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op = operation(route)
        for method in route.methods:
            paths.setdefault(route.path, {})[method.lower()] = op
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "idmint",
            "version": version,
            "description": "Short, unique integer ids. Errors answer with a real status code "
            "and a one-line plain-text reason.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Key": KEY_SCHEMA},
        },
        "paths": paths,
    }
