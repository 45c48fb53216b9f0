"""/openapi.json and the routes cannot drift apart: every route and method the router answers
is in the document and nothing else is, and schemathesis (fixed seed, bounded examples) finds
no request the document allows that a route refuses, and no 5xx. On main it found 10 such
requests (the `max` of a new key with stripes among them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx

import idmint
from idmint.server import App, ServerConfig
from idmint.server.openapi import openapi_document

from http_server import ServerProcess

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
    spec = openapi_document(idmint.__version__)["paths"]

    def shape(path: str) -> str:  # the placeholders' names may differ: {key}, {id}
        return re.sub(r"\{[^}]*\}", "{}", path)

    routed = {(shape(p), m.lower()) for p, methods in app._routes.items() for m in methods}
    documented = {(shape(p), m) for p, ops in spec.items() for m in ops}
    assert routed == documented, (routed - documented, documented - routed)


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
