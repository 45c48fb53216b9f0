"""Routes declared as data: each `Route` states once its path, methods, access, handler,
parameters (with their types and limits) and responses. The router (`Router`), the parsing and
checking of each parameter (`Call.arg`, `Call.body`) and /openapi.json (openapi.py) are all
made from these declarations, so the document cannot promise what a route refuses.

Parameters are parsed when a handler asks for them, not before it runs: some routes answer
bad input in their peer's shape (tinyid's, CosId's), or check other things first (a server
without quorum nodes answers 404 to any count).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from ..ids import KEY_NAME_PATTERN, KEY_NAME_RULE, check_key_name, is_digits
from .http import NUMBER, HttpError, Request, Response
from .tokens import Token

# Who may call a route: anyone, holders of the client token (when one is set), the admin;
# tinyid's routes take the client token as `token=` too, checked by their handler.
OPEN, IDS, ADMIN, QUERY_TOKEN = "open", "ids", "admin", "ids-query-token"
#: The methods a Spring @RequestMapping with no method answers: Leaf's and tinyid's routes
#: answer them all, so their clients may use any.
SPRING_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
KEY_PATTERN = "^" + KEY_NAME_PATTERN.pattern + "$"

INT, STR, KEY, KEYS, CHOICE = "integer", "string", "key", "keys", "choice"


@dataclass(frozen=True)
class Param:
    """One parameter: in the path, the query or the JSON body. `kind` is INT (digits in the
    query, a JSON integer in a body) in [minimum, maximum]; STR; KEY (a key name); KEYS
    (repeated key names, at most max_items); or CHOICE (one of `choices`)."""

    name: str
    where: str  # "path", "query" or "body"
    kind: str
    description: str = ""
    minimum: int = 0
    maximum: int = 0
    #: What an absent parameter is; documented when it is a valid value.
    default: Any = None
    required: bool = False
    #: The reason a required parameter that is absent is refused with.
    missing: str = ""
    pattern: str = ""
    max_length: int = 0
    max_items: int = 0
    choices: tuple[str, ...] = ()
    #: tinyid's batchSize: empty means the default, and every value given is checked (a
    #: string in the document, as an integer schema cannot allow the empty one).
    blank_is_default: bool = False
    #: The reason a body integer over `maximum` is refused with, when it says more.
    above: str = ""
    #: How a STR is checked beyond its pattern (the namespace and id of some paths), raising
    #: HttpError; returns the value.
    check: Callable[[str], Any] | None = None

    def refused(self, value: object) -> HttpError:
        return HttpError(
            400,
            f"{self.name} must be an integer from {self.minimum} to {self.maximum}, not {value!r}",
        )

    def parse_text(self, values: list[str]) -> Any:
        """The parameter from its query (or path) values: the last one counts."""
        if self.kind == KEYS:
            if len(values) > self.max_items:
                raise HttpError(
                    400, f"at most {self.max_items} keys per request, not {len(values)}"
                )
            return [check_key_name(name) for name in dict.fromkeys(values)]
        if self.blank_is_default:
            for value in values:  # every one checked: the last one is used
                text = value.strip()
                if text and not (is_digits(text) and self.minimum <= int(text) <= self.maximum):
                    raise self.refused(text)
            if values and values[-1].strip():
                return int(values[-1])
            values = []
        if not values:
            if self.required:
                raise HttpError(400, self.missing or f"{self.name} is required")
            return self.default
        text = values[-1]
        if self.kind == INT:
            text = text.strip()
            if not NUMBER.fullmatch(text) or not self.minimum <= int(text) <= self.maximum:
                raise self.refused(text)
            return int(text)
        if self.kind == KEY:
            return check_key_name(text)
        if self.kind == CHOICE and text not in self.choices:
            raise HttpError(
                400, f"{self.name} must be one of {', '.join(self.choices)}, not {text!r}"
            )
        return self.check(text) if self.check else text

    def parse_json(self, data: Mapping[str, Any]) -> Any:
        """The parameter from a JSON body."""
        if self.name not in data:
            if self.required:
                raise HttpError(400, self.missing or f"{self.name} is required")
            return self.default
        value = data[self.name]
        if self.kind == INT:
            if isinstance(value, bool) or not isinstance(value, int):
                raise HttpError(400, f"{self.name} must be an integer, not {value!r}")
            if value > self.maximum and self.above:
                raise HttpError(400, self.above.format(maximum=self.maximum, value=value))
            if not self.minimum <= value <= self.maximum:
                raise self.refused(value)
            return value
        if not isinstance(value, str):
            raise HttpError(400, self.missing or f"{self.name} must be a string")
        if self.max_length and len(value) > self.max_length:
            raise HttpError(400, f"{self.name} must be at most {self.max_length} characters")
        return check_key_name(value) if self.kind == KEY else value


def query_int(name: str, minimum: int, maximum: int, description: str = "", **more: Any) -> Param:
    return Param(name, "query", INT, description, minimum, maximum, **more)


def body_int(name: str, minimum: int, maximum: int, description: str = "", **more: Any) -> Param:
    return Param(name, "body", INT, description, minimum, maximum, **more)


def path_key(description: str = "A key name: " + KEY_NAME_RULE) -> Param:
    return Param("key", "path", KEY, description, required=True, pattern=KEY_PATTERN)


@dataclass(frozen=True)
class Body:
    """A JSON object body: its fields, and the reason any other shape is refused with (or
    the default reasons: which fields are unknown, which is missing)."""

    fields: tuple[Param, ...]
    usage: str = ""


@dataclass(frozen=True)
class Route:
    path: str  # an OpenAPI path template: /v1/keys/{key}/ids
    methods: tuple[str, ...]
    access: str
    #: The name of the handler method on the object that serves the route (App binds it).
    handler: str
    summary: str
    params: tuple[Param, ...] = ()
    body: Body | None = None
    responses: Mapping[str, Any] = field(default_factory=dict)
    #: The route hands out ids: counted per route from the start.
    hands_ids: bool = False
    #: Placeholders take '/' too: Leaf's prefix routes always took the whole rest of the
    #: path, so a key with a slash is a 400 naming it rather than a 404.
    greedy: bool = False
    #: A trailing '/' matches too (the admin key route always took one).
    trailing_slash: bool = False
    #: The route's name in the metrics, when it is not its path (kept as it always was).
    counted_as: str = ""

    @property
    def label(self) -> str:
        return self.counted_as or self.path

    def param(self, name: str) -> Param:
        """The declared parameter: asking for an undeclared one is a bug in the route."""
        for p in self.params:
            if p.name == name:
                return p
        raise LookupError(f"route {self.path} declares no parameter {name!r}")

    def regex(self) -> str:
        """The path's regex: each placeholder a named group, matching up to the next '/'
        unless the route is greedy."""
        part = "(?P<{}>.*)" if self.greedy else "(?P<{}>[^/]*)"
        pieces = re.split(r"\{([^}]+)\}", self.path)
        text = "".join(
            part.format(piece) if i % 2 else re.escape(piece) for i, piece in enumerate(pieces)
        )
        return text + ("/?" if self.trailing_slash else "")


Handler = Callable[["Call"], Awaitable[Response]]


@dataclass
class Call:
    """One request to a matched route: the handler reads its parameters through it, each
    parsed and checked as the route declares it."""

    request: Request
    route: Route
    path_args: dict[str, str]
    #: Who called an admin route (the keys it may administer); None on the other routes.
    principal: Token | None = None

    @property
    def key(self) -> str:
        return self.path_args["key"]

    @functools.cached_property
    def query(self) -> dict[str, list[str]]:
        """The query string's parameters, parsed once for all the arg()s of a call (tinyid's
        handler reads three, and each parse_qs took about 1.5 us)."""
        return parse_qs(self.request.query, keep_blank_values=True)

    def arg(self, name: str) -> Any:
        param = self.route.param(name)
        if param.where == "path":
            return param.parse_text([self.path_args[name]])
        return param.parse_text(self.query.get(name, []))

    def body(self) -> dict[str, Any]:
        """The JSON body's fields as declared (absent ones at their default)."""
        body = self.route.body
        assert body is not None, f"route {self.route.path} declares no body"
        data = self.request.json()
        names = [p.name for p in body.fields]
        unknown = sorted(set(data) - set(names))
        missing = [p for p in body.fields if p.required and p.name not in data]
        if body.usage and (unknown or missing):
            raise HttpError(400, body.usage)
        if unknown:
            raise HttpError(400, f"unknown fields: {', '.join(unknown)}")
        return {p.name: p.parse_json(data) for p in body.fields}


class Router:
    """Paths to routes: static paths by lookup, templated ones by their regexes in order."""

    def __init__(self, routes: tuple[tuple[Route, Handler], ...]) -> None:
        self.routes = tuple(route for route, _ in routes)
        self.handlers = {(route.path, m): h for route, h in routes for m in route.methods}
        #: path template -> method -> route
        self.by_path: dict[str, dict[str, Route]] = {}
        for route in self.routes:
            methods = self.by_path.setdefault(route.path, {})
            for method in route.methods:
                assert method not in methods, f"{method} {route.path} declared twice"
                methods[method] = route
        # Templated paths by their first segment, each with its literal start: a request tries
        # the regexes of the few templates that could match it, not all of them.
        self._templates: dict[str, list[tuple[str, re.Pattern[str], str]]] = {}
        for path, route in {r.path: r for r in self.routes if "{" in r.path}.items():
            first = path.split("/", 2)[1]
            assert "{" not in first, f"{path}: a template's first segment is literal"
            # DOTALL: a placeholder takes any character, a newline too; a bad key is then
            # refused as a key (400), not as a path (404), as the document says.
            start, regex = path[: path.index("{")], re.compile(route.regex(), re.DOTALL)
            self._templates.setdefault(first, []).append((start, regex, path))

    def match(self, path: str) -> tuple[str, dict[str, str]]:
        """The template a path matches and its placeholders' values; ("", {}) for none."""
        if path in self.by_path and "{" not in path:
            return path, {}
        parts = path.split("/", 2)
        for start, regex, template in self._templates.get(parts[1] if len(parts) > 1 else "", ()):
            if path.startswith(start) and (found := regex.fullmatch(path)):
                return template, found.groupdict()
        return "", {}
