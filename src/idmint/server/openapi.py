"""The OpenAPI 3.0 document of the server, served at /openapi.json (offline, no CDN)."""

from __future__ import annotations

from typing import Any

from ..ids import BATCH_CAP_MAX, ID_MAX, KEY_NAME_PATTERN, KEY_NAME_RULE, MAX_STRIPES

TEXT = {"text/plain": {"schema": {"type": "string"}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description + " (a one-line reason in plain text)", "content": TEXT}


E400 = _error("Bad input: a key name, a count, a body")
E400_CAP = _error(
    "Bad input: a key name, a count or size, or more ids than the key's batch cap (its "
    "max_batch, also in the idmint-batch-cap header)"
)
E401 = _error("The bearer token is missing or wrong (when a token is configured)")
E401_IDS = _error("The client token is missing or wrong (when one is configured)")
E403 = _error(
    "Admin while no admin token is configured (loopback clients may with --admin-loopback)"
)
E404 = _error("Unknown key")
E409 = _error("The key already exists")
E410 = _error("The key is exhausted: every id up to its maximum is used")
E410_RANGE = {
    **_error(
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
E503 = _error(
    "The store is unreachable or did not answer in time and no ids are buffered, too many "
    "requests wait for the store already, or the server is stopping"
)

KEY_PARAM = {
    "name": "key",
    "in": "path",
    "required": True,
    "description": "A key name: " + KEY_NAME_RULE,
    "schema": {"type": "string", "pattern": "^" + KEY_NAME_PATTERN.pattern + "$"},
}

KEYS_QUERY = {
    "name": "key",
    "in": "query",
    "description": "Keys to show (repeat it: key=a&key=b), at most 1,000",
    "schema": {
        "type": "array",
        "maxItems": 1000,
        "items": {"type": "string", "pattern": "^" + KEY_NAME_PATTERN.pattern + "$"},
    },
    "style": "form",
    "explode": True,
}

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


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": TEXT}


ADMIN: dict[str, Any] = {"security": [{"bearer": []}, {}]}
IDS: dict[str, Any] = {"security": [{"bearer": []}, {}]}  # the client token, when one is set
MAX_BATCH = {
    "type": "integer",
    "minimum": 0,
    "maximum": BATCH_CAP_MAX,
    "description": "the most ids one request may take from the key; 0: its step x 100, "
    f"at most {BATCH_CAP_MAX}",
}


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


#: The methods a Spring @RequestMapping with no method answers: Leaf's and tinyid's routes.
SPRING_METHODS = ("get", "post", "put", "patch", "delete")
#: Leaf's routes (tinyid's are in dropin_paths), answered under every one of them.
LEAF_PATHS = ("/api/segment/get/{key}", "/api/snowflake/get/{key}", "/decodeSnowflakeId")


def spring(operation: dict[str, Any]) -> dict[str, Any]:
    """An operation under every method Leaf's and tinyid's controllers answer."""
    return dict.fromkeys(SPRING_METHODS, operation)


def dropin_paths() -> dict[str, Any]:
    """tinyid's and CosId's routes (server/dropin.py; docs/server.md, "Drop-in routes")."""
    biz_type = {
        "name": "bizType",
        "in": "query",
        "required": True,
        "description": "The key: " + KEY_NAME_RULE,
        "schema": {"type": "string", "pattern": "^" + KEY_NAME_PATTERN.pattern + "$"},
    }
    token = {
        "name": "token",
        "in": "query",
        "required": False,
        "description": "The client token (or the admin token), when the server has one",
        "schema": {"type": "string"},
    }
    batch_size = {
        "name": "batchSize",
        "in": "query",
        "required": False,
        "description": "How many ids, 1 to 100000, at most the key's batch cap; absent or "
        "empty: 1, as tinyid takes it",
        # A string: tinyid takes an empty batchSize (Spring leaves the Integer null), which an
        # integer schema cannot allow. The pattern is 1 to 100000, or nothing.
        "schema": {"type": "string", "pattern": "^([1-9][0-9]{0,4}|100000)?$", "default": "1"},
    }
    segment = {
        "type": "object",
        "required": ["maxId", "loadingId", "currentId", "delta", "remainder"],
        "description": "tinyid's SegmentId: its ids are those in (currentId, maxId] congruent "
        "to remainder modulo delta, a range idmint allocated",
        "properties": {
            name: {"type": "integer"}
            for name in ("maxId", "loadingId", "currentId", "delta", "remainder")
        },
    }

    def tinyid_json(data: dict[str, Any], summary: str, params: list[Any]) -> dict[str, Any]:
        body = {
            "type": "object",
            "required": ["data", "code", "message"],
            "properties": {
                "data": {**data, "nullable": True},
                "code": {"type": "integer", "enum": [200, 5, 6]},
                "message": {"type": "string"},
            },
        }
        answer = {
            "summary": summary,
            "parameters": params,
            "responses": {
                "200": _json(
                    body,
                    "OK (code 200), or tinyid's error codes: 5, a missing or "
                    "wrong token; 6, any other failure (the message says which)",
                ),
                "400": _json(body, "Bad input (code 6)"),
            },
        }
        return spring(answer)

    def tinyid_text(summary: str, params: list[Any]) -> dict[str, Any]:
        answer = {
            "summary": summary,
            "parameters": params,
            "responses": {
                "200": _text(summary),
                "400": E400_CAP,
                "401": E401_IDS,
                "404": E404,
                "410": E410,
                "503": E503,
            },
        }
        return spring(answer)

    namespace = {
        "name": "namespace",
        "in": "path",
        "required": True,
        "description": "CosId's namespace: checked, not used (the key is the name)",
        "schema": {"type": "string", "pattern": "^" + KEY_NAME_PATTERN.pattern + "$"},
    }
    cosid_error = {
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
    cosid_errors = {str(status): cosid_error for status in (400, 401, 404, 409, 410, 503)}
    long = {"type": "integer", "format": "int64"}
    return {
        "/tinyid/id/nextId": tinyid_json(
            {"type": "array", "items": {"type": "integer"}},
            "tinyid's nextId: batchSize ids of the key",
            [biz_type, token, batch_size],
        ),
        "/tinyid/id/nextIdSimple": tinyid_text(
            "tinyid's nextIdSimple: batchSize ids of the key, comma-separated",
            [biz_type, token, batch_size],
        ),
        "/tinyid/id/nextSegmentId": tinyid_json(
            segment, "tinyid's nextSegmentId: a fresh range of the key's step", [biz_type, token]
        ),
        "/tinyid/id/nextSegmentIdSimple": tinyid_text(
            "tinyid's nextSegmentIdSimple: a fresh range of the key's step, as "
            "currentId,loadingId,maxId,delta,remainder (tinyid-client parses it)",
            [biz_type, token],
        ),
        "/ids/{key}": {
            "get": {
                "summary": "CosId proxy's GET /ids/{name}: one id of the key, a JSON number",
                **IDS,
                "parameters": [KEY_PARAM],
                "responses": {"200": _json(long), **cosid_errors},
            }
        },
        "/segments/{namespace}/{key}": {
            "patch": {
                "summary": "CosId proxy's nextMaxId: a fresh range of step consecutive ids, "
                "answered as its last id (the client's segment is (maxId - step, maxId])",
                **IDS,
                "parameters": [
                    namespace,
                    KEY_PARAM,
                    {
                        "name": "step",
                        "in": "query",
                        "required": True,
                        "description": "How many ids, at most the key's batch cap",
                        "schema": {"type": "integer", "minimum": 1, "maximum": BATCH_CAP_MAX},
                    },
                ],
                "responses": {"200": _json(long), **cosid_errors},
            }
        },
        "/segments/distributor/{namespace}/{key}": {
            "post": {
                "summary": "CosId proxy's createDistributor: idempotent, an empty 200 when the "
                "key exists, has no stripes and hands out ids above offset",
                **IDS,
                "parameters": [
                    namespace,
                    KEY_PARAM,
                    {
                        "name": "offset",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 0, "maximum": ID_MAX},
                    },
                    {
                        "name": "step",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": ID_MAX},
                    },
                ],
                "responses": {"200": _text("Empty"), **cosid_errors},
            }
        },
    }


def openapi_document(version: str) -> dict[str, Any]:
    document = _document(version)
    for path in LEAF_PATHS:
        document["paths"][path] = spring(document["paths"][path]["get"])
    return document


def _document(version: str) -> dict[str, Any]:
    count = {
        "name": "count",
        "in": "query",
        "required": False,
        "description": "How many ids, 1 to 100000 (default 1), at most the key's batch cap",
        "schema": {"type": "integer", "minimum": 1, "maximum": 100_000, "default": 1},
    }
    flake_count = {**count, "description": "How many ids, 1 to 100000 (default 1)"}
    size = {
        "name": "size",
        "in": "query",
        "required": False,
        "description": "How many ids in the range, 1 to 10000000 and at most the key's batch "
        "cap (default: the key's step, or the cap when that is smaller)",
        "schema": {"type": "integer", "minimum": 1, "maximum": 10_000_000},
    }
    stripe = {
        "name": "stripe",
        "in": "query",
        "required": False,
        "description": "Which stripe of a striped key to take the range from, 0 to the key's "
        "stripes - 1 (default: any stripe with ids left)",
        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_STRIPES - 1},
    }
    ids = {
        "type": "object",
        "required": ["key", "ids"],
        "properties": {
            "key": {"type": "string"},
            "ids": {"type": "array", "items": {"type": "integer"}},
        },
    }
    range_ = {
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
    new_key = {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "pattern": "^" + KEY_NAME_PATTERN.pattern + "$"},
            "step": {"type": "integer", "minimum": 1, "maximum": ID_MAX, "default": 1000},
            "start": {"type": "integer", "minimum": 0, "maximum": ID_MAX, "default": 1},
            "max": {
                "type": "integer",
                "minimum": 0,
                # A key with n stripes may go up to ID_MAX + 1 - n (each stripe's counter must
                # fit a BIGINT), which a schema cannot say per request: this bound holds for
                # every number of stripes. Leave max out for the highest the key may have.
                "maximum": ID_MAX + 1 - MAX_STRIPES,
                "description": "the largest id; absent: the highest a key with that many "
                "stripes may have",
            },
            "description": {"type": "string", "maxLength": 256},
            "max_batch": MAX_BATCH,
            "stripes": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_STRIPES,
                "default": 1,
                "description": "independent counters (a key needs at least as many ids); "
                "the default max is then lower by stripes - 1",
            },
        },
    }
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
        "paths": {
            "/api/segment/get/{key}": {
                "get": {
                    "summary": "One id as plain decimal text (Leaf's route and body)",
                    **IDS,
                    "parameters": [KEY_PARAM],
                    "responses": {
                        "200": _text("The id"),
                        "400": E400,
                        "401": E401_IDS,
                        "404": E404,
                        "410": E410,
                        "503": E503,
                    },
                }
            },
            "/v1/keys/{key}/ids": {
                "get": {
                    "summary": "A batch of ids (fewer than asked only when the key ran out or "
                    "the store failed midway)",
                    **IDS,
                    "parameters": [KEY_PARAM, count],
                    "responses": {
                        "200": _json(ids),
                        "400": E400_CAP,
                        "401": E401_IDS,
                        "404": E404,
                        "410": E410,
                        "503": E503,
                    },
                }
            },
            "/v1/keys/{key}/ranges": {
                "post": {
                    "summary": "Take a whole range for serving ids locally (clients use this)",
                    **IDS,
                    "parameters": [KEY_PARAM, size, stripe],
                    "responses": {
                        "200": _json(range_),
                        "400": E400_CAP,
                        "401": E401_IDS,
                        "404": E404,
                        "410": E410_RANGE,
                        "503": E503,
                    },
                }
            },
            "/v1/keys": {
                "get": {
                    "summary": "Every key",
                    **ADMIN,
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["keys"],
                                "properties": {
                                    "keys": {
                                        "type": "array",
                                        "items": {"$ref": "#/components/schemas/Key"},
                                    }
                                },
                            }
                        ),
                        "401": E401,
                        "403": E403,
                        "503": E503,
                    },
                },
                "post": {
                    "summary": "Create a key",
                    **ADMIN,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": new_key}},
                    },
                    "responses": {
                        "201": _json({"$ref": "#/components/schemas/Key"}, "Created"),
                        "400": E400,
                        "401": E401,
                        "403": E403,
                        "409": E409,
                        "413": _error("The body is too large"),
                        "503": E503,
                    },
                },
            },
            "/v1/keys/{key}": {
                "get": {
                    "summary": "One key",
                    **ADMIN,
                    "parameters": [KEY_PARAM],
                    "responses": {
                        "200": _json({"$ref": "#/components/schemas/Key"}),
                        "400": E400,
                        "401": E401,
                        "403": E403,
                        "404": E404,
                        "503": E503,
                    },
                },
                "patch": {
                    "summary": "Change the key's batch cap: the most ids one request may take "
                    "(every server on the store applies it within seconds)",
                    **ADMIN,
                    "parameters": [KEY_PARAM],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["max_batch"],
                                    "additionalProperties": False,
                                    "properties": {"max_batch": MAX_BATCH},
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json({"$ref": "#/components/schemas/Key"}),
                        "400": E400,
                        "401": E401,
                        "403": E403,
                        "404": E404,
                        "413": _error("The body is too large"),
                        "503": E503,
                    },
                },
            },
            "/v1/keys/{key}/raise": {
                "post": {
                    "summary": "Raise the key's floor: every range from now on starts at or "
                    "above `to`; it only moves up",
                    **ADMIN,
                    "parameters": [KEY_PARAM],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["to"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "to": {"type": "integer", "minimum": 0, "maximum": ID_MAX}
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json({"$ref": "#/components/schemas/Key"}),
                        "400": E400,
                        "401": E401,
                        "403": E403,
                        "404": E404,
                        "413": _error("The body is too large"),
                        "503": E503,
                    },
                }
            },
            "/api/snowflake/get/{key}": {
                "get": {
                    "summary": "One snowflake id as plain text (Leaf's route; the key is "
                    "checked and otherwise ignored: one id space per server)",
                    **IDS,
                    "parameters": [KEY_PARAM],
                    "responses": {
                        "200": _text("The id"),
                        "400": E400,
                        "401": E401_IDS,
                        "503": E503,
                    },
                }
            },
            "/v1/snowflake/ids": {
                "get": {
                    "summary": "A batch of snowflake ids, increasing",
                    **IDS,
                    "parameters": [flake_count],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["ids"],
                                "properties": {
                                    "ids": {"type": "array", "items": {"type": "integer"}}
                                },
                            }
                        ),
                        "400": E400,
                        "401": E401_IDS,
                        "503": E503,
                    },
                }
            },
            "/v1/quorum/{key}/ids": {
                "get": {
                    "summary": "Consecutive ids of a quorum key, each above every id of the key "
                    "handed out before the request came (a server started with --quorum; "
                    "concurrent requests share one round: group commit)",
                    **IDS,
                    "parameters": [
                        KEY_PARAM,
                        {
                            "name": "count",
                            "in": "query",
                            "description": "How many ids (a range): 1 to 1,000,000",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                        },
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["key", "start", "stop", "count"],
                                "properties": {
                                    "key": {"type": "string"},
                                    "start": {"type": "integer"},
                                    "stop": {
                                        "type": "integer",
                                        "description": "one past the last id",
                                    },
                                    "count": {"type": "integer"},
                                },
                            }
                        ),
                        "400": E400,
                        "401": E401_IDS,
                        "404": _error("This server has no quorum nodes (start it with --quorum)"),
                        "410": E410,
                        "503": _error(
                            "No majority of the quorum nodes accepted a round before the deadline"
                        ),
                    },
                }
            },
            "/decodeSnowflakeId": {
                "get": {
                    "summary": "Leaf's decode (LeafMonitorController.decodeSnowflakeId): "
                    'timestamp ("ms(yyyy-MM-dd HH:mm:ss.SSS)", local time), workerId and '
                    "sequenceId as strings; an id it cannot decode is a 200 with errorMsg",
                    "parameters": [
                        {
                            "name": "snowflakeId",
                            "in": "query",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {"200": _json(LEAF_DECODED), "400": E400},
                }
            },
            **dropin_paths(),
            "/v1/snowflake/decode/{id}": {
                "get": {
                    "summary": "The time, worker and sequence of a snowflake id",
                    "parameters": [
                        {
                            "name": "id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"},
                        }
                    ],
                    "responses": {"200": _json({"type": "object"}), "400": E400},
                }
            },
            "/livez": {"get": {"summary": "The process is up", "responses": {"200": _text("ok")}}},
            "/readyz": {
                "get": {
                    "summary": "The store is reachable and buffers are warm",
                    "responses": {"200": _text("ready"), "503": E503},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics of every worker: aggregates and each "
                    "worker's busiest keys; with key=, those keys as the answering worker has them",
                    "parameters": [KEYS_QUERY],
                    "responses": {
                        "200": _text("Prometheus text format 0.0.4"),
                        "400": E400,
                        "503": E503,
                    },
                }
            },
            "/v1/stats": {
                "get": {
                    "summary": "Every worker's totals, and the busiest keys with each "
                    "worker's ranges (the keys named, or all: this process's), for the dashboard",
                    "parameters": [
                        KEYS_QUERY,
                        {
                            "name": "all",
                            "in": "query",
                            "description": "1: every key, by name, at most 10,000",
                            "schema": {"type": "string", "enum": ["0", "1", "true", "false"]},
                        },
                    ],
                    "responses": {"200": _json({"type": "object"}), "400": E400, "503": E503},
                }
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": _json({"type": "object"})}}
            },
            "/": {
                "get": {
                    "summary": "The dashboard (HTML, served offline)",
                    "responses": {
                        "200": {
                            "description": "HTML",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
    }
