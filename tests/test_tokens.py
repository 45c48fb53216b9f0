"""Per-key tokens (`idmint serve --tokens FILE`, issue 33): which token may take ids of which
keys and who may administer them, on idmint's routes and the drop-in ones; the file's errors;
reloads (in process, and SIGHUP to a real server with two workers while requests run); and
the audit lines of key admin, which name a token and never hold its secret."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import idmint
from idmint import InvalidArgument
from idmint.server import App, ServerConfig
from idmint.server.run import JsonFormatter, check_tls
from idmint.server.tokens import SMALL, TokenTable, parse_tokens

from conftest import aged_sqlite_url
from http_server import ServerProcess
from servers import free_port
from test_app import call

ORDERS = "orders-secret-0123456789"  # takes ids of order* keys
OPS = "ops-secret-0123456789abcd"  # every key: ids and admin
ORDER_ADMIN = "order-admin-0123456789"  # admin of order* keys, no ids
NEW = "new-secret-0123456789abcd"
SECRETS = (ORDERS, OPS, ORDER_ADMIN, NEW)

TOKENS = f"""
[tokens.orders]
secret = "{ORDERS}"
keys = ["order*"]

[tokens.ops]
secret = "{OPS}"
keys = ["*"]
admin = true

[tokens.order-admin]
secret = "{ORDER_ADMIN}"
keys = ["order*"]
admin = true
ids = false
"""


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    return path


@pytest.fixture
def app(tmp_path: Path, tokens_file: Path) -> App:
    # Aged: a new store holds the snowflake routes 10 s (its leases' ttl) before their first id.
    store = aged_sqlite_url(tmp_path / "t.db")
    made = App(ServerConfig(store=store, tokens=str(tokens_file)))
    for name in ("order_1", "user"):
        assert call(made, "POST", "/v1/keys", json={"name": name}, headers=bearer(OPS)).is_success
    return made


def test_a_token_takes_ids_of_its_keys_only(app: App) -> None:
    for path in ("/api/segment/get/{}", "/v1/keys/{}/ids?count=2", "/v1/keys/{}/ranges"):
        method = "POST" if "ranges" in path else "GET"
        assert call(app, method, path.format("order_1"), headers=bearer(ORDERS)).is_success
        refused = call(app, method, path.format("user"), headers=bearer(ORDERS))
        assert refused.status_code == 403, path
        assert refused.text == "token 'orders' may not take ids of key 'user' (not in its keys)\n"
        # No token, or one the file does not have: who it is is unknown, so 401.
        for headers in ({}, bearer("not-a-token-0123456789"), {"authorization": ORDERS}):
            assert call(app, method, path.format("order_1"), headers=headers).status_code == 401
    # Bearer spelt otherwise (the hot paths take the exact form only) is still the token.
    spelt = {"authorization": f"bearer   {ORDERS} "}
    assert call(app, "GET", "/api/segment/get/order_1", headers=spelt).status_code == 200
    # A token with ids = false takes none, whatever its keys.
    denied = call(app, "GET", "/api/segment/get/order_1", headers=bearer(ORDER_ADMIN))
    assert denied.status_code == 403 and "ids = false" in denied.text
    # The snowflake routes have no key: any token with ids = true.
    assert call(app, "GET", "/v1/snowflake/ids", headers=bearer(ORDERS)).status_code == 200
    assert call(app, "GET", "/v1/snowflake/ids", headers=bearer(ORDER_ADMIN)).status_code == 403
    assert call(app, "GET", "/v1/snowflake/ids").status_code == 401
    # Probes stay open.
    assert call(app, "GET", "/livez").status_code == 200


def test_admin_needs_admin_true_and_stays_within_its_keys(app: App) -> None:
    refused = call(app, "GET", "/v1/keys", headers=bearer(ORDERS))
    assert refused.status_code == 403 and "admin = false" in refused.text
    assert call(app, "GET", "/v1/keys").status_code == 401  # loopback, but no --admin-loopback
    listed = call(app, "GET", "/v1/keys", headers=bearer(ORDER_ADMIN)).json()["keys"]
    assert [k["name"] for k in listed] == ["order_1"]  # not the keys it may not administer
    assert len(call(app, "GET", "/v1/keys", headers=bearer(OPS)).json()["keys"]) == 2
    made = call(app, "POST", "/v1/keys", json={"name": "order_2"}, headers=bearer(ORDER_ADMIN))
    assert made.status_code == 201
    for method, path, body in (
        ("POST", "/v1/keys", {"name": "user_2"}),
        ("GET", "/v1/keys/user", None),
        ("PATCH", "/v1/keys/user", {"max_batch": 5}),
        ("POST", "/v1/keys/user/raise", {"to": 99}),
    ):
        answer = call(app, method, path, json=body, headers=bearer(ORDER_ADMIN))
        assert answer.status_code == 403, path
        assert "may not administer key 'user" in answer.text
    raised = call(app, "POST", "/v1/keys/order_1/raise", json={"to": 99}, headers=bearer(OPS))
    assert raised.json()["next_id"] == 99


def test_drop_in_routes_map_through_the_file(app: App) -> None:
    ok = call(app, "GET", f"/tinyid/id/nextIdSimple?bizType=order_1&token={ORDERS}")
    assert ok.status_code == 200 and ok.text.isdigit()
    # tinyid's JSON form: its token error (code 5), with the reason; the plain form a 403.
    json_form = call(app, "GET", f"/tinyid/id/nextId?bizType=user&token={ORDERS}").json()
    assert json_form["code"] == 5 and "may not take ids of key 'user'" in json_form["message"]
    plain = call(app, "GET", f"/tinyid/id/nextIdSimple?bizType=user&token={ORDERS}")
    assert plain.status_code == 403
    unknown = call(app, "GET", "/tinyid/id/nextId?bizType=order_1&token=nope").json()
    assert unknown == {"data": None, "code": 5, "message": "token is error"}
    # A bearer header works for tinyid too, and either credential that covers the key does.
    headers = bearer(OPS)
    assert call(app, "GET", "/tinyid/id/nextIdSimple?bizType=user", headers=headers).is_success
    mixed = f"/tinyid/id/nextSegmentIdSimple?bizType=user&token={ORDERS}"
    assert call(app, "GET", mixed, headers=headers).is_success
    # CosId's routes, a bearer header.
    assert call(app, "GET", "/ids/order_1", headers=bearer(ORDERS)).status_code == 200
    cosid = call(app, "GET", "/ids/user", headers=bearer(ORDERS))
    assert cosid.status_code == 403 and "'user'" in cosid.text
    segment = "/segments/ns/{}?step=10"
    assert call(app, "PATCH", segment.format("order_1"), headers=bearer(ORDERS)).is_success
    assert call(app, "PATCH", segment.format("user"), headers=bearer(ORDERS)).status_code == 403


def test_the_settings_tokens_join_the_file(tmp_path: Path, tokens_file: Path) -> None:
    admin, client = "admin-token", "client-token"
    app = App(
        ServerConfig(
            store=f"sqlite:///{tmp_path / 'i.db'}",
            tokens=str(tokens_file),
            token=admin,
            client_token=client,
        )
    )
    assert call(app, "POST", "/v1/keys", json={"name": "user"}, headers=bearer(admin)).is_success
    for secret in (admin, client, OPS):
        assert call(app, "GET", "/api/segment/get/user", headers=bearer(secret)).is_success
    assert call(app, "GET", "/v1/keys", headers=bearer(client)).status_code == 403
    # The same secret twice could not tell who a request is: refused.
    with pytest.raises(InvalidArgument, match="same secret"):
        App(ServerConfig(store="memory://", tokens=str(tokens_file), token=OPS))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tokens.a]\nsecret = 'short'\nkeys = ['*']", "at least 16"),
        (f"[tokens.a]\nsecret = '{ORDERS}'", "keys must be a list"),
        (f"[tokens.a]\nsecret = '{ORDERS}'\nkeys = ['a b']", "bad key pattern"),
        (f"[tokens.a]\nsecret = '{ORDERS}'\nkeys = ['*']\nadmin = 'yes'", "admin must be true"),
        (f"[tokens.a]\nsecret = '{ORDERS}'\nkeys = ['*']\nkey = 1", "did you mean keys"),
        (f"[tokens.-a]\nsecret = '{ORDERS}'\nkeys = ['*']", "bad token name"),
        ("[tokens.a]\nkeys = ['*']", "secret or secret_sha256"),
        ("[tokens.a]\nsecret_sha256 = 'ab'\nkeys = ['*']", "64 hex digits"),
        (f"secret = '{ORDERS}'", "unknown top-level keys secret"),
        (f"[tokens.a]\nsecret = '{ORDERS}\nkeys = ['*']", "line 2"),
        (
            f"[tokens.a]\nsecret = '{ORDERS}'\nkeys = ['*']\n[tokens.b]\nsecret = '{ORDERS}'"
            "\nkeys = ['*']",
            "same secret",
        ),
    ],
)
def test_a_bad_file_is_one_line_without_the_secret(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as caught:
        App(ServerConfig(store="memory://", tokens=str(path)))
    message = str(caught.value)
    assert says in message and "\n" not in message and ORDERS not in message


def test_secret_sha256_and_many_tokens_on_one_key(tmp_path: Path) -> None:
    # The hot check compares up to SMALL headers one by one, and looks the rest up by digest
    # (a secret_sha256 token's only way): both must take the same tokens.
    import hashlib

    hashed = hashlib.sha256(ORDERS.encode()).hexdigest()
    [token] = parse_tokens(f"[tokens.h]\nsecret_sha256 = '{hashed}'\nkeys = ['o*']", "f")
    assert token.covers("order") and not token.covers("user")
    assert ORDERS not in repr(token) and hashed not in repr(token)
    many = [f"many-{i}-0123456789abcdef" for i in range(SMALL + 2)]
    path = tmp_path / "many.toml"
    for count in (1, len(many)):  # the one-by-one form, then the digests' one
        path.write_text(
            f"[tokens.h]\nsecret_sha256 = '{hashed}'\nkeys = ['o*']\n"
            + "".join(
                f"[tokens.m{i}]\nsecret = '{m}'\nkeys = ['*']\n" for i, m in enumerate(many[:count])
            )
        )
        table = TokenTable(str(path), [])
        for secret in (ORDERS, *many[:count]):
            assert table.may_take("order", f"Bearer {secret}"), (count, secret)
        assert not table.may_take("user", f"Bearer {ORDERS}")
        assert not table.may_take("order", f"Bearer {many[-1]}x")
        assert not table.may_take("order", None) and not table.may_take("order", ORDERS)


def test_reload_in_process_and_a_bad_file_keeps_the_tokens(
    app: App, tokens_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    leaf = "/api/segment/get/{}"
    assert call(app, "GET", leaf.format("user"), headers=bearer(ORDERS)).status_code == 403
    # orders now takes user's ids too (a cached answer for "user" must go), and new comes in.
    tokens_file.write_text(
        TOKENS.replace('keys = ["order*"]', 'keys = ["order*", "user"]', 1)
        + f'[tokens.new]\nsecret = "{NEW}"\nkeys = ["user"]\n'
    )
    assert app.reload_tokens()
    assert call(app, "GET", leaf.format("user"), headers=bearer(ORDERS)).status_code == 200
    assert call(app, "GET", leaf.format("user"), headers=bearer(NEW)).status_code == 200
    tokens_file.write_text(TOKENS.replace("[tokens.orders]", "[tokens.orders_gone]\nkeys=[]\n"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="idmint.server"):
        assert not app.reload_tokens()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "tokens not reloaded" in errors[0].getMessage()
    assert call(app, "GET", leaf.format("user"), headers=bearer(NEW)).status_code == 200
    tokens_file.write_text(TOKENS)  # new removed
    assert app.reload_tokens()
    assert call(app, "GET", leaf.format("user"), headers=bearer(NEW)).status_code == 401
    assert all(s not in caplog.text for s in SECRETS)


def test_an_audit_line_per_admin_action(app: App, caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="idmint.audit"):
        call(app, "POST", "/v1/keys", json={"name": "order_9"}, headers=bearer(ORDER_ADMIN))
        call(app, "PATCH", "/v1/keys/user", json={"max_batch": 5}, headers=bearer(ORDER_ADMIN))
        call(app, "GET", "/v1/keys", headers=bearer(OPS))
        call(app, "GET", "/v1/keys", headers=bearer(ORDERS))  # admin = false: refused
        call(app, "GET", "/v1/keys", headers=bearer("not-a-token-0123456789"))  # unknown: none
        call(app, "GET", "/api/segment/get/order_1", headers=bearer(ORDERS))  # not admin
    records = [r for r in caplog.records if r.name == "idmint.audit"]
    lines = [json.loads(JsonFormatter().format(r)) for r in records]
    picked = [(e["token"], e["action"], e["key"], e["status"]) for e in lines]
    assert picked == [
        ("order-admin", "add_key", "order_9", 201),
        ("order-admin", "update_key", "user", 403),
        ("ops", "list_keys", None, 200),
        ("orders", "list_keys", None, 403),
    ]
    assert all(e["event"] == "admin" and e["at"] and e["client"] for e in lines)
    assert all(s not in caplog.text for s in SECRETS)


def test_audit_without_a_tokens_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    app = App(ServerConfig(store=f"sqlite:///{tmp_path / 'a.db'}", token="t", admin_loopback=True))
    with caplog.at_level(logging.INFO, logger="idmint.audit"):
        call(app, "POST", "/v1/keys", json={"name": "a"}, headers=bearer("t"))
        call(app, "POST", "/v1/keys", json={"name": "b"})  # loopback
    names = [r.__dict__["audit"]["token"] for r in caplog.records if r.name == "idmint.audit"]
    assert names == ["--token", "(loopback)"]


def test_a_bad_tokens_file_or_certificate_at_start_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(f"[tokens.a]\nsecret = '{ORDERS}'\nkeys = 'order*'\n")
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    runs = [["--tokens", str(bad)], ["--tls-cert", str(cert), "--tls-key", str(cert)]]
    procs = [  # at once: each is a Python start
        subprocess.Popen(
            [
                *(sys.executable, "-m", "idmint", "--store", "memory://", "serve"),
                *("--port", str(free_port()), *args),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in runs
    ]
    said = []
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and err.count("\n") == 1, err
        said.append(err)
    assert "keys must be a list" in said[0] and ORDERS not in said[0]
    assert "cannot serve TLS with --tls-cert" in said[1]
    # The same checks, in process.
    with pytest.raises(InvalidArgument, match="cannot read tokens file"):
        App(ServerConfig(store="memory://", tokens=str(tmp_path / "nope.toml")))
    with pytest.raises(InvalidArgument, match="tls_cert and tls_key go together"):
        ServerConfig(tls_cert=str(cert))
    with pytest.raises(InvalidArgument, match="cannot serve TLS"):
        check_tls(str(cert), str(tmp_path / "missing.pem"))


def _children(pid: int) -> set[int]:
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(name))
    return found


def test_sighup_reloads_every_worker_while_requests_run(tmp_path: Path, tokens_file: Path) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}"
    with idmint.connect(store) as minter:
        for name in ("order_1", "user"):
            minter.add_key(name)
    server = ServerProcess(
        store,
        workers=2,
        admin_loopback=False,
        args=["--tokens", str(tokens_file), "--log-format", "json"],
    ).start()
    assert server.proc is not None
    leaf = server.url + "/api/segment/get/{}"
    stop = threading.Event()
    failures: list[str] = []
    served = [0]

    def load() -> None:
        # Keep-alive connections and new ones (so both workers serve), the whole time.
        with httpx.Client(headers=bearer(OPS), timeout=5) as kept:
            while not stop.is_set():
                for answer in (
                    kept.get(leaf.format("order_1")),
                    httpx.get(leaf.format("user"), headers=bearer(OPS), timeout=5),
                ):
                    served[0] += 1
                    if answer.status_code != 200:
                        failures.append(f"{answer.status_code} {answer.text}")
                time.sleep(0.01)  # leaves the two cores to the checks below too

    def on_fresh_connections(secret: str, status: int) -> bool:
        # Every worker has to agree: a fresh connection lands on either.
        return all(
            httpx.get(leaf.format("user"), headers=bearer(secret), timeout=5).status_code == status
            for _ in range(6)
        )

    def wait_for(check: object, what: str) -> None:
        deadline = time.monotonic() + 20
        while not check():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"{what}: {server.log()}"
            time.sleep(0.1)

    try:
        workers = _children(server.proc.pid)
        assert len(workers) == 2
        loader = threading.Thread(target=load)
        loader.start()
        try:
            # Hot path (no idmint-store header: answered before routing) for a covered key.
            hot = httpx.get(leaf.format("order_1"), headers=bearer(ORDERS))
            hot = httpx.get(leaf.format("order_1"), headers=bearer(ORDERS))
            assert hot.status_code == 200 and "idmint-store" not in hot.headers
            assert httpx.get(leaf.format("user"), headers=bearer(ORDERS)).status_code == 403
            tokens_file.write_text(
                "[tokens.ops]"
                + TOKENS.split("[tokens.ops]")[1]  # orders gone
                + f'[tokens.new]\nsecret = "{NEW}"\nkeys = ["user"]\n'
            )
            server.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: on_fresh_connections(NEW, 200), "the new token")
            assert on_fresh_connections(ORDERS, 401)
            # A bad file: the workers keep their tokens, one error line.
            tokens_file.write_text("[tokens.x]\nsecret = 'short'\nkeys = ['*']\n")
            server.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "tokens not reloaded" in server.log_path.read_text(), "an error")
            assert on_fresh_connections(NEW, 200)
        finally:
            stop.set()
            loader.join()
        assert not failures, failures[:5]
        assert served[0] > 20
        assert _children(server.proc.pid) == workers  # reloaded in place, not restarted
        admin = httpx.post(server.url + "/v1/keys", json={"name": "k"}, headers=bearer(OPS))
        assert admin.status_code == 201
        assert server.terminate() == 0
        text = server.log_path.read_text()
    finally:
        server.stop()
    entries = [json.loads(line) for line in text.splitlines()]
    messages = [e["message"] for e in entries]
    assert sum(m.startswith("tokens reloaded") for m in messages) == 2, messages  # per worker
    assert sum("tokens not reloaded" in m for m in messages) == 1, messages
    [line] = [e for e in entries if e.get("event") == "admin"]
    assert line["token"] == "ops" and line["action"] == "add_key" and line["key"] == "k"
    assert line["status"] == 201 and line["logger"] == "idmint.audit"
    assert all(s not in text for s in SECRETS)


def test_the_hot_paths_check_per_key(app: App) -> None:
    """The answers before routing (Leaf's in App.__rsgi__, tinyid's and CosId's in
    DropIn.answer_now) take a covered key's token and leave every other case to the router."""
    import asyncio

    from test_dropin import _Proto, _Scope

    for key in ("order_1", "user"):  # loaded: the hot paths serve loaded keys only
        call(app, "GET", f"/api/segment/get/{key}", headers=bearer(OPS))
    now = app.dropin.answer_now
    assert now("/ids/order_1", _Scope("", "", bearer(ORDERS))) is not None
    assert now("/ids/user", _Scope("", "", bearer(ORDERS))) is None
    assert now("/ids/user", _Scope("", "", {})) is None
    tinyid = "/tinyid/id/nextIdSimple"
    assert now(tinyid, _Scope("", f"bizType=order_1&token={ORDERS}", {})) is not None
    assert now(tinyid, _Scope("", f"bizType=user&token={ORDERS}", {})) is None
    assert now(tinyid, _Scope("", "bizType=user", bearer(OPS))) is not None

    def leaf(key: str, secret: str) -> tuple[int, str]:
        proto = _Proto()
        asyncio.run(app.__rsgi__(_Scope(f"/api/segment/get/{key}", "", bearer(secret)), proto))
        [(status, _, body)] = proto.answers
        return status, body

    handed = app.hot_handed
    assert leaf("order_1", ORDERS)[0] == 200 and app.hot_handed == handed + 1
    assert leaf("user", ORDERS)[0] == 403 and app.hot_handed == handed + 1  # routed
    assert "ids = false" in leaf("user", ORDER_ADMIN)[1]
