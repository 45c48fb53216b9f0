"""ZooKeeper locked down (issue 33), on real servers over real TLS handshakes: idmint's nodes
carry an ACL naming its digest user alone, so an anonymous client (or another user) can neither
change nor delete a counter; what goes wrong is one line naming the store, never the password
(a wrong CA, an expired server certificate, a wrong password, no client certificate).

The store contract suites run on `zookeeper-locked` (conftest.LOCKED_ENGINES): on the session
server's TLS port (server_zookeeper.py), in a chroot made beforehand with docs/stores.md's
grant."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, make_digest_acl_credential
from server_zookeeper import ZooKeeperServer

import idmint
from idmint import InvalidArgument
from idmint.cli import main
from idmint.stores import open_engine, open_lease_store

from certs import Certs
from checks import one_clear_line, refusal

SECRET = "Zq7-s3cr3t-Pw9"


def _name() -> str:
    return f"lz{secrets.token_hex(4)}"


def _user(server: ZooKeeperServer) -> tuple[str, str, str]:
    """A chroot made with docs/stores.md's grant for a new digest user: (chroot, user,
    password)."""
    chroot, password = _name(), "Pw-" + secrets.token_urlsafe(12)
    server.make_chroot(chroot, chroot, password)
    return chroot, chroot, password


def _one_clear_line(error: Exception, password: str, port: int) -> str:
    return one_clear_line(error, password, "zk://", f":{port}/")


@pytest.fixture
def zk(zookeeper_server: ZooKeeperServer) -> ZooKeeperServer:
    """The session server, its TLS port warmed up (the JVM's first handshake is slow)."""
    zookeeper_server.locked_store_url(_name())
    return zookeeper_server


def test_the_documented_grant_is_the_tested_one() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "stores.md").read_text()
    assert "create /idmint '' digest:idmint:HASH:cdrw" in docs


def test_idmint_nodes_name_its_user_alone(zk: ZooKeeperServer) -> None:
    """Every node idmint made, the parents it made on the way too, has one ACL entry: the
    URL's digest user with every permission."""
    chroot, user, password = _user(zk)
    with idmint.connect(zk.url_as(user, password, chroot)) as minter:
        minter.add_key("k")
        assert minter.take("k", 1).start == 1
        minter.snowflake()  # a lease: w/, h/ and their children
    admin = KazooClient(hosts=f"127.0.0.1:{zk.port}", auth_data=[("digest", f"{user}:{password}")])
    admin.start(timeout=10)
    try:
        mine = f"digest:{make_digest_acl_credential(user, password)}"
        nodes, todo = [], [f"/{chroot}"]
        while todo:
            node = todo.pop()
            todo += [f"{node}/{child}" for child in admin.get_children(node)]
            nodes.append(node)
        assert {f"/{chroot}/c", f"/{chroot}/meta", f"/{chroot}/h"} <= set(nodes)
        for node in nodes[1:]:  # the chroot is the admin's, with its grant
            acls: list[ACL] = admin.get_acls(node)[0]
            assert [(f"{a.id.scheme}:{a.id.id}", a.perms) for a in acls] == [(mine, 31)], node
    finally:
        admin.stop()
        admin.close()


def test_an_anonymous_client_cannot_touch_a_counter(zk: ZooKeeperServer) -> None:
    chroot, user, password = _user(zk)
    with idmint.connect(zk.url_as(user, password, chroot)) as minter:
        minter.add_key("k")
        minter.take("k", 5)
    for auth in ([], [("digest", f"{user}:wrong")], [("digest", f"other:{password}")]):
        stranger = KazooClient(hosts=f"127.0.0.1:{zk.port}", auth_data=auth)
        stranger.start(timeout=10)
        try:
            # the counter's cell (listing children takes READ on c/, which it lacks)
            with pytest.raises(NoAuthError):
                stranger.get_children(f"/{chroot}/c")
            for cell in _cells(zk, chroot, user, password):
                with pytest.raises(NoAuthError):
                    stranger.set(cell, b'{"next": 1}')
                with pytest.raises(NoAuthError):
                    stranger.delete(cell)
                with pytest.raises(NoAuthError):
                    stranger.get(cell)
                with pytest.raises(NoAuthError):
                    stranger.set_acls(cell, OPEN_ACL_UNSAFE)
            with pytest.raises(NoAuthError):
                stranger.create(f"/{chroot}/c/evil", b"{}")
        finally:
            stranger.stop()
            stranger.close()
    with idmint.connect(zk.url_as(user, password, chroot)) as minter:
        assert minter.take("k", 1).start == 6  # untouched


def _cells(zk: ZooKeeperServer, chroot: str, user: str, password: str) -> list[str]:
    """The paths of the chroot's cells, listed as their owner."""
    owner = KazooClient(hosts=f"127.0.0.1:{zk.port}", auth_data=[("digest", f"{user}:{password}")])
    owner.start(timeout=10)
    try:
        cells = [f"/{chroot}/c/{name}" for name in owner.get_children(f"/{chroot}/c")]
    finally:
        owner.stop()
        owner.close()
    assert cells
    return cells


def test_a_wrong_ca_is_refused_in_one_line(zk: ZooKeeperServer, certs: Certs) -> None:
    chroot, user, password = _user(zk)
    url = zk.url_as(user, password, chroot, ca=certs.wrong_ca)
    text = _one_clear_line(refusal(url), password, zk.secure_port or 0)
    assert "TLS: the server's certificate was not accepted" in text


@pytest.fixture(scope="module")
def expired_zookeeper(certs: Certs) -> Iterator[ZooKeeperServer]:
    """A real ZooKeeper whose TLS port serves a certificate that expired yesterday (a JVM:
    a few seconds to start)."""
    server = ZooKeeperServer(certs=certs, server_pair=(certs.expired_cert, certs.expired_key))
    server.start()
    yield server
    server.close()


def test_an_expired_server_certificate_is_refused_in_one_line(
    expired_zookeeper: ZooKeeperServer,
) -> None:
    password = "Pw-" + secrets.token_urlsafe(12)
    url = expired_zookeeper.url_as("idmint", password, "x")
    # the JVM's first handshake is slow, and this server's is its first
    text = _one_clear_line(refusal(url, 30), password, expired_zookeeper.secure_port or 0)
    assert "TLS: the server's certificate was not accepted (certificate has expired)" in text


def test_a_wrong_password_is_refused_in_one_line(zk: ZooKeeperServer) -> None:
    """ZooKeeper takes any digest (it only names an identity): the ACL refuses it."""
    chroot, user, password = _user(zk)
    wrong = "Wr0ng-" + password[::-1]
    text = _one_clear_line(refusal(zk.url_as(user, wrong, chroot)), wrong, zk.secure_port or 0)
    assert f"permission denied: the node's ACL does not let ZooKeeper user {user!r}" in text
    assert "a wrong password is another digest identity" in text


def test_tls_without_the_client_certificate_is_refused_in_one_line(zk: ZooKeeperServer) -> None:
    chroot, user, password = _user(zk)
    url = zk.url_as(user, password, chroot).partition("&cert=")[0]
    text = _one_clear_line(refusal(url), password, zk.secure_port or 0)
    assert "TLS: the handshake failed" in text and "client certificate? cert=PATH" in text


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (f"zk://:{SECRET}@127.0.0.1:2181/x", "needs a user name"),
        (f"zk://a%3Ab:{SECRET}@127.0.0.1:2181/x", "without ':'"),
        (f"zk://u:{SECRET}@127.0.0.1:2181/x?ca=", "ca= needs a file path"),
        (f"zk://u:{SECRET}@127.0.0.1:2181/x?key=/k", "give cert= too"),
        (f"zk://u:{SECRET}@127.0.0.1:2181/x?acl=open", "unknown parameter 'acl'"),
        (f"zk://u:{SECRET}@127.0.0.1:2181/x?ca=/nowhere/ca.pem", "cannot use ca=/nowhere"),
    ],
)
def test_a_bad_locked_url_is_invalid_at_once(url: str, said: str) -> None:
    with pytest.raises(InvalidArgument, match="store") as refused:
        open_engine(url)
    assert said in str(refused.value) and SECRET not in str(refused.value)


def test_the_password_shows_in_no_object_nor_cli_error(
    zk: ZooKeeperServer, capsys: pytest.CaptureFixture[str]
) -> None:
    chroot, user, password = _user(zk)
    url = zk.url_as(user, password, chroot)
    store: Any = open_lease_store(url)
    shown = repr(store) + repr(vars(store)) + store.display_url + repr(store._target)
    assert password not in shown
    store.close()
    with idmint.connect(url) as minter:
        minter.add_key("k")  # so there is a node to be refused (a missing one is no refusal)
    code = main(["--timeout", "10", "--store", zk.url_as(user, "wr0ng", chroot), "keys", "list"])
    out, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1 and "wr0ng" not in out + err, err


def test_the_url_from_a_file(
    zk: ZooKeeperServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """IDMINT_STORE_FILE: the locked-down URL, password and all, out of `ps`."""
    chroot, user, password = _user(zk)
    secret = tmp_path / "store"
    secret.write_text(zk.url_as(user, password, chroot) + "\n")
    monkeypatch.setenv("IDMINT_STORE_FILE", str(secret))
    monkeypatch.setenv("IDMINT_TIMEOUT", "10")
    assert main(["keys", "add", "order", "--start", "100"]) == 0
    assert main(["next", "order", "-n", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.split()[-2:] == ["100", "101"] and password not in out + err
