"""The app in-process through its ASGI shell (the uvicorn fallback), and its settings."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import httpx
import pytest

import idmint
from idmint import InvalidArgument, ReservationSizing
from idmint.server import App, ServerConfig
from idmint.server.config import read_config_file

from checks import run_threads
from conftest import aged_sqlite_url


def call(
    app: App, method: str, path: str, *, client: str = "127.0.0.1", **kwargs: object
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(client, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://idmint") as http:
            return await http.request(method, path, **kwargs)  # type: ignore[arg-type]

    return asyncio.run(go())


@pytest.fixture
def app(tmp_path: Path) -> App:
    return App(ServerConfig(store=aged_sqlite_url(tmp_path / "app.db"), admin_loopback=True))


def test_asgi_shell_serves_every_kind_of_route(app: App) -> None:
    assert call(app, "POST", "/v1/keys", json={"name": "a", "start": 5}).status_code == 201
    assert call(app, "GET", "/api/segment/get/a").text == "5"
    assert call(app, "GET", "/v1/keys/a/ids?count=3").json()["ids"] == [6, 7, 8]
    assert call(app, "GET", "/v1/keys/zzz/ids").status_code == 404
    wrong = call(app, "PATCH", "/v1/keys")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
    assert call(app, "GET", "/metrics").headers["content-type"].startswith("text/plain")
    app.shutdown()
    assert call(app, "GET", "/readyz").status_code == 503


def test_admin_without_token_answers_loopback_only(app: App) -> None:
    refused = call(app, "GET", "/v1/keys", client="192.0.2.7")  # TEST-NET-1: never routed
    assert refused.status_code == 403 and "IDMINT_TOKEN" in refused.text
    assert call(app, "GET", "/v1/keys", client="::1").status_code == 200
    assert call(app, "POST", "/v1/keys", json={"name": "x"}, client="192.0.2.7").status_code == 403
    # The id routes are for everyone.
    call(app, "POST", "/v1/keys", json={"name": "x"})
    assert call(app, "GET", "/api/segment/get/x", client="192.0.2.7").status_code == 200


def test_admin_needs_the_token_unless_loopback_is_opted_in(tmp_path: Path) -> None:
    # Behind a reverse proxy on the same host every client is loopback: loopback alone must
    # not open key admin.
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'p.db'}"))
    for client in ("127.0.0.1", "::1", "192.0.2.7"):
        refused = call(app, "GET", "/v1/keys", client=client)
        assert refused.status_code == 403, client
        assert "--token" in refused.text and "--admin-loopback" in refused.text
        assert refused.text.count("\n") == 1
    assert call(app, "POST", "/v1/keys", json={"name": "x"}).status_code == 403
    with_token = App(ServerConfig(store=f"sqlite:///{tmp_path / 'p.db'}", token="tok"))
    assert call(with_token, "GET", "/v1/keys").status_code == 401  # loopback, no token
    good = {"authorization": "Bearer tok"}
    assert call(with_token, "GET", "/v1/keys", headers=good).status_code == 200


def test_non_ascii_tokens_are_no_500(tmp_path: Path) -> None:
    # A configured token granian could never receive is refused up front, and a header with
    # non-ASCII bytes (the ASGI shell decodes them as latin-1) is a wrong token, not a 500.
    with pytest.raises(InvalidArgument, match="ASCII"):
        ServerConfig(token="t\u00f6k\u00e9n")
    with pytest.raises(InvalidArgument, match="ASCII"):
        ServerConfig.from_mapping({"token": " padded"})
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'n.db'}", token="tok"))
    for value in ("Bearer t\u00f6k".encode(), b"Bearer \xff\xfe", b"bearer tok"):
        response = call(app, "GET", "/v1/keys", headers={"authorization": value})
        assert response.status_code == (200 if value == b"bearer tok" else 401), value


def test_token_is_checked_from_any_address(tmp_path: Path) -> None:
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 't.db'}", token="tok"))
    assert call(app, "GET", "/v1/keys").status_code == 401
    ok = call(app, "GET", "/v1/keys", client="192.0.2.7", headers={"authorization": "Bearer tok"})
    assert ok.status_code == 200


def test_unknown_names_make_no_generators(app: App) -> None:
    for i in range(50):
        assert call(app, "GET", f"/api/segment/get/made-up-{i}").status_code == 404
    assert app.minter.generators() == []


def test_config_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "idmint.toml"
    path.write_text('[server]\nport = 9000\nworkers = 2\nstore = "sqlite:///x.db"\n')
    config = ServerConfig.from_mapping(read_config_file(path))
    # A relative SQLite path in a config file is the file's neighbour (issue 31 row 2).
    assert (config.port, config.workers) == (9000, 2)
    assert config.store == f"sqlite:///{path.parent / 'x.db'}"
    monkeypatch.setenv("IDMINT_PORT", "9100")
    monkeypatch.setenv("IDMINT_MAX_STEP", "5000")
    env = ServerConfig.from_env()
    assert (env.port, env.max_step) == (9100, 5000)
    path.write_text("[server]\ncolour = 1\n")
    with pytest.raises(ValueError, match="unknown settings colour"):
        read_config_file(path)
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=0)
    with pytest.raises(ValueError, match="http"):
        ServerConfig(http="3")


def test_connection_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServerConfig().http == "1"  # only HTTP/1.1 times out connections that say nothing
    path = tmp_path / "idmint.toml"
    path.write_text("[server]\nkeep_alive = false\nmax_connections = 100\nheader_timeout = 2.5\n")
    config = ServerConfig.from_mapping(read_config_file(path))
    assert (config.keep_alive, config.max_connections, config.header_timeout) == (False, 100, 2.5)
    monkeypatch.setenv("IDMINT_KEEP_ALIVE", "false")  # not bool("false")
    monkeypatch.setenv("IDMINT_ADMIN_LOOPBACK", "yes")
    env = ServerConfig.from_env()
    assert (env.keep_alive, env.admin_loopback) == (False, True)
    monkeypatch.setenv("IDMINT_KEEP_ALIVE", "maybe")
    with pytest.raises(ValueError, match="keep_alive"):
        ServerConfig.from_env()
    for bad in ({"header_timeout": 0}, {"max_connections": 0}, {"backlog": 10}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig.from_mapping(bad)


def test_snowflake_routes(app: App) -> None:
    from idmint.layout import TWITTER

    one = int(call(app, "GET", "/api/snowflake/get/anything").text)
    batch = call(app, "GET", "/v1/snowflake/ids?count=5000").json()["ids"]
    assert len(batch) == 5000 and batch == sorted(batch) and one < batch[0]
    assert {TWITTER.decode(i).worker for i in [one, *batch]} == {0}
    decoded = call(app, "GET", f"/v1/snowflake/decode/{one}").json()
    assert decoded["worker"] == 0 and decoded["id"] == one
    leaf = call(app, "GET", f"/decodeSnowflakeId?snowflakeId={one}").json()
    # Leaf's shape (test_dropin pins it): "ms(local time)"; a bad id is its 200 errorMsg.
    assert leaf["workerId"] == "0" and leaf["timestamp"].startswith(f"{decoded['unix_ms']}(")
    assert "errorMsg" in call(app, "GET", "/decodeSnowflakeId?snowflakeId=-1").json()
    for path in (
        "/v1/snowflake/decode/abc",
        "/decodeSnowflakeId",
        "/v1/snowflake/ids?count=0",
        "/api/snowflake/get/bad%20key",
    ):
        assert call(app, "GET", path).status_code == 400, path
    stats = call(app, "GET", "/v1/stats").json()["snowflake"]
    assert stats["worker_id"] == 0 and stats["layout"] == "twitter"
    # SQLite reads this machine's clock: the offset is near zero, and bounded
    assert abs(stats["clock_offset_ms"]) <= stats["clock_offset_error_ms"] + 1
    metrics = call(app, "GET", "/metrics").text
    assert 'idmint_snowflake_worker_id{layout="twitter"} 0' in metrics
    assert 'idmint_snowflake_clock_offset_seconds{layout="twitter"} ' in metrics
    assert 'idmint_snowflake_clock_offset_error_seconds{layout="twitter"} ' in metrics
    app.shutdown()  # releases the worker id
    assert call(app, "GET", "/readyz").status_code == 503


def test_batch_caps_bound_ranges_and_batches(app: App) -> None:
    # A range request needed no credential and burned a 32-bit key in 215 requests: now each
    # request takes at most the key's cap, by default its step x 100.
    assert call(app, "POST", "/v1/keys", json={"name": "k", "step": 10}).status_code == 201
    over = call(app, "POST", "/v1/keys/k/ranges?size=1001")
    assert over.status_code == 400 and "cap of 1000" in over.text and "step x 100" in over.text
    assert over.headers["idmint-batch-cap"] == "1000" and over.text.count("\n") == 1
    assert call(app, "GET", "/v1/keys/k/ids?count=1001").status_code == 400
    taken = call(app, "POST", "/v1/keys/k/ranges?size=1000").json()
    assert taken["stop"] - taken["start"] == 1000 and taken["batch_cap"] == 1000
    assert len(call(app, "GET", "/v1/keys/k/ids?count=1000").json()["ids"]) == 1000
    # An admin sets it, and it is kept in the key's row.
    patched = call(app, "PATCH", "/v1/keys/k", json={"max_batch": 50})
    assert patched.status_code == 200, patched.text
    assert (patched.json()["max_batch"], patched.json()["batch_cap"]) == (50, 50)
    refused = call(app, "GET", "/v1/keys/k/ids?count=51")
    assert refused.status_code == 400 and "cap of 50" in refused.text and "admin" in refused.text
    assert len(call(app, "GET", "/v1/keys/k/ids?count=50").json()["ids"]) == 50
    for body in ({"max_batch": -1}, {"max_batch": "x"}, {}, {"max_batch": 5, "step": 1}):
        assert call(app, "PATCH", "/v1/keys/k", json=body).status_code == 400, body
    assert call(app, "PATCH", "/v1/keys/nope", json={"max_batch": 5}).status_code == 404
    made = call(app, "POST", "/v1/keys", json={"name": "wide", "step": 1000, "max_batch": 10})
    assert made.status_code == 201 and made.json()["batch_cap"] == 10
    # A cap below the step bounds a range of the default size too.
    default = call(app, "POST", "/v1/keys/wide/ranges").json()
    assert default["stop"] - default["start"] == 10
    assert call(app, "GET", "/v1/keys/wide").json()["max_batch"] == 10


def test_the_client_token_guards_the_id_routes(tmp_path: Path) -> None:
    store = aged_sqlite_url(tmp_path / "c.db")
    config = ServerConfig(store=store, token="adm", client_token="cli")
    app = App(config)
    admin = {"authorization": "Bearer adm"}
    assert call(app, "POST", "/v1/keys", json={"name": "k"}, headers=admin).status_code == 201
    client = {"authorization": "Bearer cli"}
    for method, path in (
        ("GET", "/api/segment/get/k"),
        ("GET", "/v1/keys/k/ids?count=3"),
        ("POST", "/v1/keys/k/ranges?size=3"),
        ("GET", "/api/snowflake/get/k"),
        ("GET", "/v1/snowflake/ids?count=3"),
    ):
        refused = call(app, method, path)
        assert refused.status_code == 401 and "client token" in refused.text, path
        wrong = {"authorization": "Bearer nope"}
        assert call(app, method, path, headers=wrong).status_code == 401, path
        assert call(app, method, path, headers=client).status_code == 200, path
        assert call(app, method, path, headers=admin).status_code == 200, path  # admin too
    for path in ("/livez", "/metrics", "/openapi.json", "/v1/snowflake/decode/1"):
        assert call(app, "GET", path).status_code == 200, path
    # The client token is not an admin token.
    assert call(app, "GET", "/v1/keys", headers=client).status_code == 401
    with pytest.raises(InvalidArgument, match="client_token"):
        ServerConfig(client_token="caf\u00e9")


def test_ids_handed_per_route(app: App) -> None:
    call(app, "POST", "/v1/keys", json={"name": "h", "step": 100})
    call(app, "GET", "/api/segment/get/h")
    call(app, "GET", "/v1/keys/h/ids?count=7")
    call(app, "POST", "/v1/keys/h/ranges?size=30")
    metrics = call(app, "GET", "/metrics").text
    assert 'idmint_ids_handed_total{route="/api/segment/get/{key}"} 1.0\n' in metrics
    assert 'idmint_ids_handed_total{route="/v1/keys/{key}/ids"} 7.0\n' in metrics
    assert 'idmint_ids_handed_total{route="/v1/keys/{key}/ranges"} 30.0\n' in metrics
    assert 'idmint_ids_handed_total{route="/v1/snowflake/ids"} 0.0\n' in metrics
    # Every key summed (the aggregates), and the same totals in /v1/stats for the dashboard.
    assert "idmint_keys_ids_issued_total 8.0\n" in metrics
    assert "idmint_keys_ranges_handed_total 30.0\n" in metrics
    totals = call(app, "GET", "/v1/stats").json()["totals"]
    assert totals["ids_issued"] == 8 and totals["ranges_handed"] == 30
    assert totals["ids_handed"]["/v1/keys/{key}/ids"] == 7 and totals["workers"] == 1


@pytest.fixture(params=["sqlite", "memory"])
def any_app(request: pytest.FixtureRequest, tmp_path: Path) -> App:
    """The app on SQLite (row locks) and on the memory store (ranges over compare-and-set)."""
    store = (
        f"sqlite:///{tmp_path / 'striped.db'}"
        if request.param == "sqlite"
        else f"memory://app-{tmp_path.name}"
    )
    return App(ServerConfig(store=store, admin_loopback=True))


def one_line(response: httpx.Response) -> bool:
    return response.text.endswith("\n") and response.text.count("\n") == 1


def test_striped_keys_over_http(any_app: App) -> None:
    app = any_app
    made = call(app, "POST", "/v1/keys", json={"name": "order", "start": 100, "stripes": 5})
    assert made.status_code == 201, made.text
    shown = made.json()
    assert (shown["stripes"], shown["stripe_next"]) == (5, [100, 101, 102, 103, 104])
    assert shown["max"] == 2**63 - 6  # the highest a key with 5 stripes may have
    assert call(app, "GET", "/v1/keys/order").json()["stripes"] == 5
    assert [k["stripes"] for k in call(app, "GET", "/v1/keys").json()["keys"]] == [5]
    taken = call(app, "POST", "/v1/keys/order/ranges?size=3&stripe=2").json()
    assert taken == {
        "key": "order",
        "start": 102,
        "stop": 117,
        "stride": 5,
        "stripe": 2,
        "stripes": 5,
        "step": 1000,
        "batch_cap": 100_000,
        "conflicts": 0,
    }
    again = call(app, "POST", "/v1/keys/order/ranges?size=3&stripe=2").json()
    assert (again["start"], again["stop"]) == (117, 132)
    chosen = call(app, "POST", "/v1/keys/order/ranges?size=4").json()  # the store's choice
    assert chosen["stride"] == 5 and chosen["start"] % 5 == chosen["stripe"]
    expected = [100, 101, 132, 103, 104]
    expected[chosen["stripe"]] = chosen["stop"]
    assert call(app, "GET", "/v1/keys/order").json()["stripe_next"] == expected
    # A plain key's ranges have stride 1 and stripe 0 of 1.
    call(app, "POST", "/v1/keys", json={"name": "plain", "start": 7})
    plain = call(app, "POST", "/v1/keys/plain/ranges?size=2").json()
    assert (plain["start"], plain["stop"], plain["stride"], plain["stripe"]) == (7, 9, 1, 0)
    assert call(app, "POST", "/v1/keys/plain/ranges?size=2&stripe=0").json()["start"] == 9


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"stripes": 0}, "stripes must be an integer from 1 to 1024, not 0"),
        ({"stripes": 1025}, "stripes must be an integer from 1 to 1024, not 1025"),
        ({"stripes": "5"}, "stripes must be an integer, not '5'"),
        ({"stripes": True}, "stripes must be an integer, not True"),
        ({"stripes": 2.5}, "stripes must be an integer, not 2.5"),
        ({"stripes": 5, "start": 1, "max": 4}, "a key with 5 stripes needs at least 5 ids"),
        ({"stripes": 5, "max": 2**63 - 2}, "max must be at most 9223372036854774783 over HTTP"),
    ],
)
def test_bad_stripes_are_400_with_a_reason(app: App, body: dict[str, object], reason: str) -> None:
    refused = call(app, "POST", "/v1/keys", json={"name": "s", **body})
    assert refused.status_code == 400 and one_line(refused), refused.text
    assert reason in refused.text
    assert call(app, "GET", "/v1/keys/s").status_code == 404  # nothing was made


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("stripe=3", "stripe must be an integer from 0 to 2 (the key has 3 stripes), not 3"),
        ("stripe=1023", "not 1023"),
        ("stripe=1024", "stripe must be an integer from 0 to 1023, not '1024'"),
        ("stripe=-1", "not '-1'"),
        ("stripe=x", "not 'x'"),
        ("stripe=", "not ''"),
        ("stripe=1.0", "not '1.0'"),
    ],
)
def test_bad_stripe_is_400_with_a_reason(app: App, query: str, reason: str) -> None:
    call(app, "POST", "/v1/keys", json={"name": "s", "stripes": 3})
    refused = call(app, "POST", f"/v1/keys/s/ranges?{query}")
    assert refused.status_code == 400 and one_line(refused), refused.text
    assert reason in refused.text
    call(app, "POST", "/v1/keys", json={"name": "p"})
    plain = call(app, "POST", "/v1/keys/p/ranges?stripe=1")
    assert plain.status_code == 400 and "(the key has 1 stripe)" in plain.text
    assert call(app, "GET", "/v1/keys/s").json()["stripe_next"] == [1, 2, 3]  # nothing taken


def test_a_stripe_row_never_replaces_the_key_row(any_app: App) -> None:
    # An allocation on stripe k > 0 comes back with that stripe's row, which has no batch cap:
    # the server must go on applying the key's own.
    app = any_app
    body = {"name": "c", "stripes": 3, "step": 10, "max_batch": 7}
    assert call(app, "POST", "/v1/keys", json=body).status_code == 201
    for stripe in (1, 2, 1, 0, 2):
        taken = call(app, "POST", f"/v1/keys/c/ranges?stripe={stripe}")
        assert taken.status_code == 200, taken.text
        got = taken.json()
        assert got["batch_cap"] == 7 and got["stripe"] == stripe
        assert len(range(got["start"], got["stop"], got["stride"])) == 7  # the cap bounds it
        over = call(app, "POST", f"/v1/keys/c/ranges?size=8&stripe={stripe}")
        assert over.status_code == 400 and "cap of 7" in over.text, over.text
        assert call(app, "GET", "/v1/keys/c/ids?count=8").status_code == 400


def test_an_exhausted_stripe_says_which(any_app: App) -> None:
    app = any_app
    # Stripe 0: 1, 3, 5, 7, 9; stripe 1: 2, 4, 6, 8, 10.
    made = call(app, "POST", "/v1/keys", json={"name": "t", "max": 10, "stripes": 2})
    assert made.status_code == 201
    last = call(app, "POST", "/v1/keys/t/ranges?stripe=1&size=9").json()
    assert (last["start"], last["stop"], last["stride"]) == (2, 12, 2)  # shorter at its end
    spent = call(app, "POST", "/v1/keys/t/ranges?stripe=1")
    assert spent.status_code == 410 and one_line(spent), spent.text
    assert "stripe 1 of key 't' is exhausted" in spent.text
    assert spent.headers["idmint-stripe"] == "1" and spent.headers["idmint-stripes"] == "2"
    assert spent.headers["idmint-last-id"] == "10"
    # No stripe asked for: any stripe with ids left, whichever the store would choose.
    for expected in ([1, 3], [5, 7], [9]):
        taken = call(app, "POST", "/v1/keys/t/ranges?size=2").json()
        assert list(range(taken["start"], taken["stop"], taken["stride"])) == expected
    gone = call(app, "POST", "/v1/keys/t/ranges")
    assert gone.status_code == 410 and one_line(gone)
    assert "key 't' is exhausted" in gone.text and "stripe" not in gone.text
    assert "idmint-stripe" not in gone.headers and gone.headers["idmint-last-id"] == "10"
    assert call(app, "GET", "/v1/keys/t").json()["remaining"] == 0


def test_the_id_routes_serve_a_striped_key(any_app: App) -> None:
    # The server's own generator picks a stripe, moves on when it runs out, and serves every
    # id of the key exactly once.
    app = any_app
    body = {"name": "s", "start": 10, "max": 129, "step": 4, "stripes": 3}
    assert call(app, "POST", "/v1/keys", json=body).status_code == 201
    ids = [int(call(app, "GET", "/api/segment/get/s").text) for _ in range(5)]
    while len(ids) < 120:
        # Never past the key's end: a batch that meets it drops the ids it drew (the
        # generator's next_ids raises Exhausted without them).
        answer = call(app, "GET", f"/v1/keys/s/ids?count={min(7, 120 - len(ids))}")
        assert answer.status_code == 200, answer.text
        ids += answer.json()["ids"]
    assert sorted(ids) == list(range(10, 130))
    answer = call(app, "GET", "/v1/keys/s/ids?count=7")
    assert answer.status_code == 410 and one_line(answer), answer.text
    assert "stripe" not in answer.text and "idmint-stripe" not in answer.headers
    assert call(app, "GET", "/api/segment/get/s").status_code == 410
    # /v1/stats reads no store: it shows each key's row as last read (the server reads them
    # all every KEY_REFRESH seconds, and on admin reads such as this one).
    assert call(app, "GET", "/v1/keys/s").status_code == 200
    [stats] = call(app, "GET", "/v1/stats").json()["keys"]
    assert stats["stripes"] == 3 and stats["generator"]["stripes"] == 3
    assert stats["remaining"] == 0 and stats["generator"]["issued"] == 120


def test_stripes_and_conflicts_in_metrics_and_stats(any_app: App) -> None:
    app = any_app
    call(app, "POST", "/v1/keys", json={"name": "s", "stripes": 3, "step": 10})
    call(app, "POST", "/v1/keys", json={"name": "p"})
    assert len(call(app, "GET", "/v1/keys/s/ids?count=5").json()["ids"]) == 5
    call(app, "GET", "/api/segment/get/p")
    stats = call(app, "GET", "/v1/stats").json()
    striped, plain = (next(k for k in stats["keys"] if k["name"] == n) for n in ("s", "p"))
    gen = striped["generator"]
    assert (striped["stripes"], gen["stripes"], gen["conflicts"]) == (3, 3, 0)
    # The stripe its next ranges come from (its first came from the store's choice).
    assert gen["current"]["stride"] == 3 and gen["stripe"] in (0, 1, 2)
    plain_gen = plain["generator"]
    assert (plain["stripes"], plain_gen["stripe"], plain_gen["stripes"]) == (1, 0, 1)
    metrics = call(app, "GET", "/metrics").text
    assert f'idmint_segment_stripe{{key="s"}} {gen["stripe"]}.0\n' in metrics
    assert 'idmint_segment_stripe{key="p"} 0.0\n' in metrics
    assert 'idmint_key_stripes{key="s"} 3.0\n' in metrics
    assert 'idmint_key_stripes{key="p"} 1.0\n' in metrics
    assert 'idmint_segment_conflicts_total{key="s"} 0.0\n' in metrics
    assert "# TYPE idmint_segment_conflicts_total counter\n" in metrics
    counts = getattr(app.minter.store, "counts", None)
    if counts is None:  # SQLite locks rows: no compare-and-set loops, nothing to count
        assert stats["cas"] is None and "idmint_cas_" not in metrics
        return

    # Allocations of one store racing each other on one stripe: some compare-and-sets lose.
    def race() -> None:
        for _ in range(50):
            app.minter.store.allocate("p", 1)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        deadline = time.monotonic() + 20
        while counts.conflicts == 0:
            assert time.monotonic() < deadline, "no conflict in 20 s"
            run_threads(race, 8)
    finally:
        sys.setswitchinterval(switch)
    assert 0 < counts.retries <= counts.conflicts
    metrics = call(app, "GET", "/metrics").text
    assert f"idmint_cas_conflicts_total {counts.conflicts}.0\n" in metrics
    assert f"idmint_cas_retries_total {counts.retries}.0\n" in metrics
    cas = call(app, "GET", "/v1/stats").json()["cas"]
    assert cas == {"conflicts": counts.conflicts, "retries": counts.retries}


def test_a_datacenter_server_reports_reservation_left_and_runway(tmp_path: Path) -> None:
    """A server of datacenter eu: its keys' reservation left, rate, runway and the datacenter
    level's counts in /metrics and /v1/stats (from the cell as last written: no store I/O)."""
    top, eu = f"sqlite:///{tmp_path / 'global.db'}", f"sqlite:///{tmp_path / 'eu.db'}"
    with idmint.connect(top) as minter:
        minter.add_datacenter_key(
            "order", step=10, max=2**31 - 1, sizing=ReservationSizing(min_reservation=1000)
        )
    app = App(ServerConfig(store=top, dc="eu", dc_store=eu))
    assert call(app, "GET", "/v1/keys/order/ids?count=3").json()["ids"] == [1, 2, 3]
    metrics = call(app, "GET", "/metrics").text
    # prometheus-client writes the labels by name, and every value as a float.
    left = re.search(r'^idmint_dc_reservation_left\{dc="eu",key="order"\} (\d+)\.0$', metrics, re.M)
    assert left is not None and 900 <= int(left[1]) <= 990  # less: the generator preloaded
    assert 'idmint_dc_grants{dc="eu",key="order"} 1.0' in metrics
    assert 'idmint_dc_global_cas_total{dc="eu"} 1' in metrics  # the grant, which binds
    assert 'idmint_dc_preload_failures_total{dc="eu"} 0' in metrics
    stats = call(app, "GET", "/v1/stats").json()["datacenter"]
    assert stats["dc"] == "eu" and stats["counts"]["grants"] == 1
    [order] = stats["keys"]
    assert order["reserved"] == {"start": 1, "stop": 1001} and 900 <= order["left"] <= 990
    # Retired by another process: on main the server showed the reservation as live for good.
    with idmint.connect(top) as admin:
        admin.datacenters("eu", dc_store=eu).retire("order")
    dcs = app.minter.store
    assert isinstance(dcs, idmint.DatacenterRanges)
    dcs.refresh_seen()  # what the server's rows refresh does every 5 s
    [order] = call(app, "GET", "/v1/stats").json()["datacenter"]["keys"]
    assert order["retired"] is True and order["left"] == 0
    app.shutdown()
    plain = App(ServerConfig(store=f"sqlite:///{tmp_path / 'plain.db'}"))
    assert call(plain, "GET", "/v1/stats").json()["datacenter"] is None
    assert "idmint_dc_" not in call(plain, "GET", "/metrics").text
    plain.shutdown()


def test_metrics_keep_series_for_the_busiest_keys_only(tmp_path: Path) -> None:
    """metrics_keys=2 of 5 keys: per-key series for the two busiest, every key in the
    aggregates; ?key= shows any key as this process has it; /v1/stats likewise."""
    store = f"sqlite:///{tmp_path / 'top.db'}"
    app = App(ServerConfig(store=store, metrics_keys=2, admin_loopback=True))
    for n in range(5):
        call(app, "POST", "/v1/keys", json={"name": f"k{n}"})
        # k4 is the busiest, then k3 ...; k0 issues 1 id
        assert len(call(app, "GET", f"/v1/keys/k{n}/ids?count={n + 1}").json()["ids"]) == n + 1
    metrics = call(app, "GET", "/metrics").text
    shown = set(re.findall(r'^idmint_ids_issued_total\{key="(k\d)"\}', metrics, re.M))
    assert shown == {"k4", "k3"}
    assert "idmint_keys_ids_issued_total 15.0\n" in metrics  # 1 + 2 + 3 + 4 + 5
    assert "idmint_keys_served 5.0\n" in metrics and "idmint_keys 5.0\n" in metrics
    one = call(app, "GET", "/metrics?key=k0&key=nope")
    assert one.status_code == 200 and "k4" not in one.text
    assert f'idmint_ids_issued_total{{key="k0",pid="{one.headers["idmint-pid"]}"}} 1.0' in one.text
    assert call(app, "GET", "/metrics?key=").status_code == 400
    assert call(app, "GET", "/metrics?key=bad%20name").status_code == 400

    def names(query: str) -> list[str]:
        return [k["name"] for k in call(app, "GET", "/v1/stats" + query).json()["keys"]]

    assert names("") == ["k3", "k4"]  # the busiest, by name
    assert names("?key=k1&key=k0&key=nope") == ["k1", "k0"]
    assert names("?all=1") == [f"k{n}" for n in range(5)]
    shown_of = call(app, "GET", "/v1/stats").json()["keys_shown"]
    assert shown_of == {"which": "busiest", "count": 2, "of": 5, "truncated": False}
    assert call(app, "GET", "/v1/stats?all=yes").status_code == 400
    app.shutdown()
    none = App(ServerConfig(store=store, metrics_keys=0))
    call(none, "GET", "/v1/keys/k4/ids")
    metrics = call(none, "GET", "/metrics").text
    assert 'key="' not in metrics and "idmint_keys_ids_issued_total 1.0\n" in metrics
    none.shutdown()
    with pytest.raises(InvalidArgument, match="metrics_keys must be from 0 to 1000, not -1"):
        ServerConfig(metrics_keys=-1)
    assert ServerConfig.from_mapping({"metrics_keys": "7"}).metrics_keys == 7  # env, TOML


def test_a_multiprocess_directory_that_is_not_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match=r"PROMETHEUS_MULTIPROC_DIR=.*missing is not a dir"):
        App(ServerConfig(store=f"sqlite:///{tmp_path / 'x.db'}"))


def test_a_bounded_key_cannot_be_burnt_over_http(tmp_path: Path) -> None:
    """On main, with no client token, large ranges burnt a whole 32-bit key in 11 s. Each key
    now has a budget of ids a second over HTTP (its id space over --id-budget-days, 30): a
    32-bit key's first full batch goes, then 429 with Retry-After; a 64-bit key is unlimited."""
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'a.db'}", admin_loopback=True))
    assert call(app, "POST", "/v1/keys", json={"name": "t", "max": 2**31 - 1}).status_code == 201
    assert call(app, "POST", "/v1/keys", json={"name": "wide"}).status_code == 201
    handed, refused = 0, None
    for i in range(40):  # an hour of its budget (2,982,616 ids) goes at once, then no more
        path = "/segments/ns/t?step=100000" if i % 2 else "/v1/keys/t/ranges?size=100000"
        got = call(app, "PATCH" if i % 2 else "POST", path)
        if got.status_code != 200:
            refused = got
            break
        handed += 100_000
    assert handed == 2_900_000
    assert refused is not None and refused.status_code == 429, refused
    assert "829 ids/s" in refused.text and int(refused.headers["retry-after"]) >= 1
    again = call(app, "POST", "/v1/keys/t/ranges?size=100000")
    assert again.status_code == 429  # nothing slips past: the rest comes at 829 ids/s
    assert call(app, "GET", "/v1/keys/t/ids?count=10").status_code == 200
    for _ in range(5):
        assert call(app, "POST", "/v1/keys/wide/ranges?size=100000").status_code == 200
    app.shutdown()
    off = App(
        ServerConfig(store=f"sqlite:///{tmp_path / 'a.db'}", id_budget_days=0, admin_loopback=True)
    )
    assert call(off, "POST", "/v1/keys/t/ranges?size=100000").status_code == 200
    off.shutdown()
    with pytest.raises(InvalidArgument, match="id_budget_days"):
        ServerConfig(id_budget_days=float("nan"))


def test_a_placeholder_takes_any_character(app: App) -> None:
    """A key with a newline or a slash in it reaches its route, which refuses it as a key."""
    for key in ("a\nb", "a/b", "\n"):
        assert app.router.match(f"/api/snowflake/get/{key}") == (
            "/api/snowflake/get/{key}",
            {"key": key},
        )
    assert app.router.match("/v1/keys/a\nb")[0] == "/v1/keys/{key}"
