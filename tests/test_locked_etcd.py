"""etcd locked down (issue 33), on real servers over real TLS handshakes: what goes wrong is one
line naming the store, never the password (a wrong CA, an expired server certificate, a wrong
password, a user without the role, a client certificate missing or one etcd's gateway refuses);
the token is renewed when etcd drops it; and the URL's secrets show nowhere.

The store contract suites run on `etcd-locked` (conftest.LOCKED_ENGINES): on the session etcd's
locked-down twin (server_etcd.py), as a user whose one role is docs/stores.md's grant."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

import idmint
from idmint import InvalidArgument
from idmint.cli import main
from idmint.stores import open_engine
from idmint.stores.etcd import EtcdCasStore

from certs import Certs
from checks import one_clear_line, refusal
from server_etcd import EtcdServer


@pytest.fixture
def locked(etcd_server: EtcdServer) -> EtcdServer:
    """The session etcd's locked-down twin (TLS, client certificates, RBAC)."""
    return etcd_server.locked()


SECRET = "Zq7-s3cr3t-Pw9"


def _name() -> str:
    return f"le{secrets.token_hex(4)}"


def _user(server: EtcdServer, prefix: str | None) -> tuple[str, str]:
    """A new user (a role with docs/stores.md's grant on `prefix`, none for None): its name
    and password."""
    user, password = _name(), "Pw-" + secrets.token_urlsafe(12)
    server.add_user(user, password, prefix)
    return user, password


def _one_clear_line(error: Exception, password: str, port: int) -> str:
    return one_clear_line(error, password, "etcd://", f":{port}/")


def test_the_documented_grant_is_the_tested_one() -> None:
    """docs/stores.md gives the role server_etcd.add_user makes: readwrite on PREFIX/."""
    docs = (Path(__file__).parents[1] / "docs" / "stores.md").read_text()
    assert "etcdctl role grant-permission idmint --prefix=true readwrite idmint/" in docs


def test_the_least_privileged_user_mints_ids(locked: EtcdServer) -> None:
    prefix = _name()
    user, password = _user(locked, prefix)
    with idmint.connect(locked.url_as(user, password, prefix)) as minter:
        minter.add_key("k", step=10)
        taken = minter.take("k", 3)
        assert (taken.start, taken.stop) == (1, 4)


def test_a_wrong_ca_is_refused_in_one_line(locked: EtcdServer, certs: Certs) -> None:
    prefix = _name()
    user, password = _user(locked, prefix)
    url = locked.url_as(user, password, prefix, ca=certs.wrong_ca)
    text = _one_clear_line(refusal(url), password, locked.port)
    assert "TLS: the server's certificate was not accepted" in text


@pytest.fixture(scope="module")
def expired_etcd(certs: Certs) -> Iterator[EtcdServer]:
    """A real etcd serving a certificate that expired yesterday (about a second to start)."""
    server = EtcdServer(certs=certs, tls=True, server_pair=(certs.expired_cert, certs.expired_key))
    server.start()
    yield server
    server.close()


def test_an_expired_server_certificate_is_refused_in_one_line(expired_etcd: EtcdServer) -> None:
    password = "Pw-" + secrets.token_urlsafe(12)
    url = expired_etcd.url_as("idmint", password, "x")
    text = _one_clear_line(refusal(url), password, expired_etcd.port)
    assert "TLS: the server's certificate was not accepted (certificate has expired)" in text


def test_a_wrong_password_is_refused_in_one_line(locked: EtcdServer) -> None:
    prefix = _name()
    user, password = _user(locked, prefix)
    wrong = "Wr0ng-" + password[::-1]
    text = _one_clear_line(refusal(locked.url_as(user, wrong, prefix)), wrong, locked.port)
    assert f"authentication failed: wrong user name or password for etcd user {user!r}" in text


def test_a_user_without_the_role_is_refused_in_one_line(locked: EtcdServer) -> None:
    user, password = _user(locked, None)
    text = _one_clear_line(refusal(locked.url_as(user, password, "nr")), password, locked.port)
    assert f"permission denied: etcd user {user!r} needs a role with readwrite" in text
    assert "'nr/'" in text


def test_a_role_on_another_prefix_grants_nothing_here(locked: EtcdServer) -> None:
    """The grant is the prefix's range: a user of prefix A cannot touch prefix B's keys."""
    mine, theirs = _name(), _name()
    user, password = _user(locked, mine)
    text = _one_clear_line(refusal(locked.url_as(user, password, theirs)), password, locked.port)
    assert "permission denied" in text


def test_no_user_on_an_etcd_with_auth_is_refused_in_one_line(locked: EtcdServer) -> None:
    url = locked.url_as("u", "p", "anon").replace("u:p@", "")
    text = _one_clear_line(refusal(url), "p@", locked.port)
    assert "permission denied: a client without a user (add user:password@)" in text


def test_tls_without_the_client_certificate_is_refused_in_one_line(
    locked: EtcdServer, certs: Certs
) -> None:
    prefix = _name()
    user, password = _user(locked, prefix)
    url = locked.url_as(user, password, prefix).partition("&cert=")[0]
    text = _one_clear_line(refusal(url), password, locked.port)
    assert "TLS: the handshake failed" in text and "client certificate? cert=PATH" in text


def test_a_client_certificate_with_a_common_name_is_explained(
    locked: EtcdServer, certs: Certs
) -> None:
    """etcd's gateway, auth on, refuses a certificate with a CN (tests/certs.py's has one)."""
    prefix = _name()
    user, password = _user(locked, prefix)
    assert locked.client is not None
    url = (
        locked.url_as(user, password, prefix)
        .replace(str(locked.client.cert), str(certs.client_cert))
        .replace(str(locked.client.key), str(certs.client_key))
    )
    text = _one_clear_line(refusal(url), password, locked.port)
    assert "refuses a client certificate with a CommonName" in text


def test_plain_http_to_the_tls_port_is_no_store(locked: EtcdServer) -> None:
    prefix = _name()
    user, password = _user(locked, prefix)
    url = locked.url_as(user, password, prefix).partition("?")[0]
    _one_clear_line(refusal(url), password, locked.port)


def test_a_dropped_token_is_replaced(locked: EtcdServer) -> None:
    """etcd drops a user's tokens when its password is set (also on a member restart, or
    after --auth-token-ttl unused): the next call authenticates again and goes on."""
    prefix = _name()
    user, password = _user(locked, prefix)
    engine = open_engine(locked.url_as(user, password, prefix))
    try:
        cas = cast(EtcdCasStore, engine.cas())
        assert cas.create("k", "1")
        token = cas._etcd._token
        assert token
        locked.admin(
            "auth/user/changepw", {"name": user, "password": password}, locked.root_token()
        )
        found = cas.read("k")  # refused for its token, authenticated again, sent again
        assert found is not None and found[0] == "1"
        assert cas._etcd._token not in ("", token)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (f"etcd://:{SECRET}@127.0.0.1:2379/x", "a password needs a user name"),
        (f"etcd://u:{SECRET}@127.0.0.1:2379/x?ca=", "ca= needs a file path"),
        (f"etcd://u:{SECRET}@127.0.0.1:2379/x?key=/k", "give cert= too"),
        (f"etcd://u:{SECRET}@127.0.0.1:2379/x?tls=maybe", "tls must be 1 or 0"),
        (f"etcd://u:{SECRET}@127.0.0.1:2379/x?password={SECRET}", "unknown parameter 'password'"),
        (f"etcd://u:{SECRET}@127.0.0.1:2379/x?ca=/nowhere/ca.pem", "cannot use ca=/nowhere"),
    ],
)
def test_a_bad_locked_url_is_invalid_at_once(url: str, said: str) -> None:
    with pytest.raises(InvalidArgument, match="store") as refused:
        open_engine(url)
    assert said in str(refused.value) and SECRET not in str(refused.value)


def test_a_password_with_url_delimiters_works_percent_encoded(locked: EtcdServer) -> None:
    prefix = _name()
    user, password = _name(), "p@ss:w/o?rd#" + secrets.token_hex(4)
    locked.add_user(user, password, prefix)
    with idmint.connect(locked.url_as(user, password, prefix)) as minter:
        minter.add_key("k")
        assert minter.take("k", 1).start == 1


def test_the_password_shows_in_no_object_nor_cli_error(
    locked: EtcdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _name()
    user, password = _user(locked, prefix)
    url = locked.url_as(user, password, prefix)
    engine = open_engine(url)
    for store in (engine.cas(), engine.leases(), engine.ranges()):
        shown = repr(store) + repr(vars(store)) + store.display_url
        shown += repr(vars(cast(EtcdCasStore, engine.cas())._etcd))
        assert password not in shown
    engine.close()
    wrong = "Wr0ng-" + password[::-1]
    code = main(["--timeout", "5", "--store", locked.url_as(user, wrong, prefix), "keys", "list"])
    out, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1 and wrong not in out + err, err


def test_the_url_from_a_file(
    locked: EtcdServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """IDMINT_STORE_FILE: the locked-down URL, password and all, out of `ps`."""
    prefix = _name()
    user, password = _user(locked, prefix)
    secret = tmp_path / "store"
    secret.write_text(locked.url_as(user, password, prefix) + "\n")
    monkeypatch.setenv("IDMINT_STORE_FILE", str(secret))
    assert main(["keys", "add", "order", "--start", "100"]) == 0
    assert main(["next", "order", "-n", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.split()[-2:] == ["100", "101"] and password not in out + err


def test_a_user_on_an_etcd_without_auth_sends_no_token(etcd_server: EtcdServer) -> None:
    """etcd with auth off refuses to authenticate anyone: the URL's user is then moot, and the
    store works (asking once, not on every call)."""
    url = etcd_server.store_url(_name()).replace("etcd://", f"etcd://u:{SECRET}@")
    engine = open_engine(url)
    try:
        cas = cast(EtcdCasStore, engine.cas())
        assert cas.create("k", "1") and cas.read("k") is not None
        assert cas._etcd._token == ""
    finally:
        engine.close()
