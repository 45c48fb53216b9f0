"""Issue 31's rough edges of the server's id routes, in-process through the ASGI shell: unknown
and repeated query parameters (row 9), and the 410 of a retired key (row 10)."""

from __future__ import annotations

from pathlib import Path

import pytest

import idmint
from idmint.server import App, ServerConfig

from conftest import aged_sqlite_url
from test_app import call


@pytest.fixture
def store(tmp_path: Path) -> str:
    return aged_sqlite_url(tmp_path / "edges.db")


@pytest.fixture
def app(store: str) -> App:
    return App(ServerConfig(store=store, admin_loopback=True))


@pytest.mark.parametrize(
    ("query", "says"),
    [
        # On main: one id, the typo unseen.
        ("cnt=5", "unknown query parameter 'cnt': /v1/keys/{key}/ids takes only count"),
        # On main: two ids, the last value taken.
        ("count=1&count=2", "query parameter 'count' is given 2 times: give it once"),
        ("count=2&token=x", "unknown query parameter 'token'"),
    ],
)
def test_the_ids_route_refuses_unknown_and_repeated_parameters(
    app: App, query: str, says: str
) -> None:
    assert call(app, "POST", "/v1/keys", json={"name": "k"}).status_code == 201
    answer = call(app, "GET", f"/v1/keys/k/ids?{query}")
    assert answer.status_code == 400 and says in answer.text, answer.text
    assert answer.text.count("\n") == 1  # one line
    # The documented parameter still works, and nothing was taken by the refusals.
    assert call(app, "GET", "/v1/keys/k/ids?count=3").json()["ids"] == [1, 2, 3]
    assert call(app, "GET", "/v1/keys/k/ids").json()["ids"] == [4]


def test_the_other_routes_keep_their_parameters(app: App) -> None:
    """idmint's other /v1 id routes check alike; Leaf's and the drop-in routes (dropin.py)
    take what their peers take, unknown parameters included, as before."""
    assert call(app, "POST", "/v1/keys", json={"name": "k"}).status_code == 201
    ranges = call(app, "POST", "/v1/keys/k/ranges?size=2&stripe=0")
    assert ranges.status_code == 200 and ranges.json()["stop"] - ranges.json()["start"] == 2
    refused = call(app, "POST", "/v1/keys/k/ranges?size=2&sise=3")
    assert refused.status_code == 400 and "'sise'" in refused.text
    assert call(app, "GET", "/v1/snowflake/ids?count=2&count=3").status_code == 400
    assert call(app, "GET", "/v1/snowflake/decode/5?x=1").status_code == 400
    assert call(app, "GET", "/v1/snowflake/decode/5").status_code == 200
    # Leaf's route ignores a query (a cache buster, say), as Leaf does.
    assert call(app, "GET", "/api/segment/get/k?x=1").status_code == 200
    tinyid = call(app, "GET", "/tinyid/id/nextIdSimple?bizType=k&batchSize=2&extra=1")
    assert tinyid.status_code == 200 and len(tinyid.text.split(",")) == 2
    cosid = call(app, "GET", "/ids/k?whatever=1")
    assert cosid.status_code == 200, cosid.text


def test_a_retired_key_answers_that_it_is_retired(app: App, store: str) -> None:
    """On main its 410 said "every id up to its maximum 100 is used": false, as the key was
    retired with ids left."""
    assert call(app, "POST", "/v1/keys", json={"name": "old", "max": 100}).status_code == 201
    assert call(app, "GET", "/v1/keys/old/ids?count=3").json()["ids"] == [1, 2, 3]
    with idmint.connect(store) as minter:
        minter.retire_key("old")
    # A new process: no range held (one that holds ranges serves them out first).
    fresh = App(ServerConfig(store=store, admin_loopback=True))
    for method, path in (
        ("GET", "/v1/keys/old/ids?count=2"),
        ("GET", "/api/segment/get/old"),
        ("POST", "/v1/keys/old/ranges"),
        ("POST", "/v1/keys/old/ranges?size=1&stripe=0"),
    ):
        answer = call(fresh, method, path)
        assert answer.status_code == 410, (path, answer.text)
        assert answer.text == (
            "key 'old' is retired (idmint keys retire): it hands out no id again, and its "
            "unused ids are never reused\n"
        ), (path, answer.text)
        assert answer.headers["idmint-last-id"] == "100"
        assert "idmint-stripe" not in answer.headers  # the whole key, whichever stripe
    # The peers' routes say it too, each in its own form (they said "every id ... is used").
    said = "key 'old' is retired (idmint keys retire)"
    simple = call(fresh, "GET", "/tinyid/id/nextIdSimple?bizType=old")
    assert simple.status_code == 410 and simple.text.startswith(said), simple.text
    tinyid = call(fresh, "GET", "/tinyid/id/nextId?bizType=old").json()
    assert tinyid["code"] == 6 and tinyid["message"].startswith(said), tinyid  # SYS_ERR
    cosid = call(fresh, "GET", "/ids/old")
    assert cosid.status_code == 410 and cosid.json()["msg"].startswith(said), cosid.text
    # Past the id budget's first burst: a retired key's pace of 0 ids a second divided by
    # zero, a 500 with a traceback in the log.
    with idmint.connect(store) as minter:
        minter.set_max_batch("old", 10)  # a burst of 10 ids: spent by the first request
    paced = App(ServerConfig(store=store, admin_loopback=True))
    for count in (10, 1):
        assert call(paced, "GET", f"/v1/keys/old/ids?count={count}").status_code == 410
    # Its refills fail by design: no store error in /metrics (they counted one).
    metrics = call(paced, "GET", "/metrics").text
    assert 'idmint_store_errors{key="old"} 0.0' in metrics
    assert "idmint_keys_store_errors 0.0" in metrics
    # An exhausted key still says so.
    assert call(fresh, "POST", "/v1/keys", json={"name": "full", "max": 2}).status_code == 201
    call(fresh, "GET", "/v1/keys/full/ids?count=2")
    spent = call(fresh, "GET", "/v1/keys/full/ids")
    assert spent.status_code == 410 and "every id up to its maximum 2 is used" in spent.text
