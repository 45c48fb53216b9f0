"""/openapi.json and the routes cannot drift apart: every route and method the router answers
is in the document and nothing else is, every integer limit a route declares is the one it
enforces and the one the document states, and schemathesis (fixed seed, bounded examples) finds
no request the document allows that a route refuses, and no 5xx. On main it found 10 such
requests (the `max` of a new key with stripes among them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

import idmint
from idmint.server import App, ServerConfig
from idmint.server.routes import INT, Param, Route

from http_server import ServerProcess
from test_app import call

TOKEN = "drift-token"
#: Refusals by a rule of the key a request names (its batch cap, its stripes, its maximum) or
#: between two fields of one body: a document cannot state them per key, and docs/server.md
#: does. Anything else a schema-valid request is refused for is drift.
PER_KEY = re.compile(
    r"is over key '.*''s cap of|is below start|cannot raise key .* to the key's maximum"
    r"|stripe must be an integer from 0 to \d+ \(the key has"
)


def test_the_document_names_exactly_the_routes_the_router_answers(tmp_path: Path) -> None:
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'a.db'}"))
    spec = call(app, "GET", "/openapi.json").json()["paths"]  # as served

    def shape(path: str) -> str:  # the placeholders' names may differ: {key}, {id}
        return re.sub(r"\{[^}]*\}", "{}", path)

    routed = {(shape(p), m.lower()) for p, methods in app.router.by_path.items() for m in methods}
    documented = {(shape(p), m) for p, ops in spec.items() for m in ops}
    assert routed == documented, (routed - documented, documented - routed)
    assert len(routed) >= 40
    # Every path the document names is one the router matches, to the same template.
    for path in spec:
        example = path.replace("{id}", "1").replace("{namespace}", "ns").replace("{key}", "k")
        assert app.router.match(example)[0] == path, path


def _documented(spec: dict[str, Any], route: Route, method: str, param: Param) -> dict[str, Any]:
    """The schema the served document gives `param` of `route`."""
    op = spec["paths"][route.path][method.lower()]
    if param.where == "body":
        body = op["requestBody"]["content"]["application/json"]["schema"]
        return dict(body["properties"][param.name])
    [found] = [p for p in op.get("parameters", []) if p["name"] == param.name]
    return dict(found["schema"])


def _request(route: Route, param: Param, value: int) -> tuple[str, dict[str, Any]]:
    """A request to `route` with `param` at `value` and every other required one valid."""
    path = route.path.replace("{key}", "order").replace("{namespace}", "ns")
    query = {p.name: "order" if p.name == "bizType" else "1" for p in route.params}
    query = {n: v for n, v in query.items() if route.param(n).required and n != param.name}
    body: dict[str, Any] = {}
    if route.body is not None:
        body = {f.name: 0 if f.kind == INT else "fresh" for f in route.body.fields if f.required}
    if param.where == "body":
        body[param.name] = value
    else:
        query[param.name] = str(value)
    return path, {"params": query, **({"json": body} if route.body is not None else {})}


def test_each_integer_limit_is_enforced_and_documented_from_one_declaration(
    tmp_path: Path,
) -> None:
    """For every integer a route declares (query or body), one past either end of its range
    is a 400, and the served document states that range: both read the same declaration.
    (A quorum route checks its count before it asks its nodes, which need not exist.)"""
    config = ServerConfig(
        store=f"sqlite:///{tmp_path / 'a.db'}",
        admin_loopback=True,
        quorum="memory://a,memory://b,memory://c",
    )
    app = App(config)
    assert call(app, "POST", "/v1/keys", json={"name": "order"}).status_code == 201
    spec = call(app, "GET", "/openapi.json").json()
    checked = 0
    for route in app.router.routes:
        params = [*route.params, *(route.body.fields if route.body else ())]
        for param in (p for p in params if p.kind == INT):
            method = route.methods[0]
            schema = _documented(spec, route, method, param)
            if param.blank_is_default:  # a string of digits in the document
                pattern = re.compile(schema["pattern"])
                assert pattern.fullmatch(str(param.maximum)), (route.path, param.name)
                assert not pattern.fullmatch(str(param.maximum + 1)), (route.path, param.name)
                assert not pattern.fullmatch(str(param.minimum - 1)), (route.path, param.name)
            else:
                assert (schema["minimum"], schema["maximum"]) == (param.minimum, param.maximum)
            for past in (param.minimum - 1, param.maximum + 1):
                path, kwargs = _request(route, param, past)
                refused = call(app, method, path, **kwargs)
                where = (method, route.path, param.name, past, refused.text)
                assert refused.status_code == 400, where
                checked += 1
    assert checked >= 30, checked


def test_schemathesis_finds_no_schema_valid_request_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    with idmint.connect(url) as minter:
        minter.add_key("order")
    server = ServerProcess(url, token=TOKEN, args=["--id-budget-days", "0"]).start()
    try:
        run = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "positive_data_acceptance,not_a_server_error",
                "--max-examples",
                "10",
                "--seed",
                "1",
                "--generation-deterministic",
                "-H",
                f"Authorization: Bearer {TOKEN}",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        out = run.stdout + run.stderr
        assert "Tested:" in out, out[-3000:]
        # Each failure: its check, then the status and the reason the route gave.
        failures = []
        for block in out.split("\n- ST")[1:]:
            status = re.search(r"^\[(\d+)\]", block, re.MULTILINE)
            reason = re.search(r"^ +`(.*)`$", block, re.MULTILINE)
            failures.append(
                (
                    "ST" + block.split()[0],
                    status and status[1],
                    (reason and reason[1]) or block[:300],
                )
            )
        drifted = [f for f in failures if not (f[1] == "400" and PER_KEY.search(str(f[2])))]
        assert not drifted, (drifted, out[-6000:])
        assert httpx.get(server.url + "/livez").status_code == 200
    finally:
        server.stop()
