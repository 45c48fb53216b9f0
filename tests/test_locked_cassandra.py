"""Cassandra locked down (issue 33), on a real node over real TLS handshakes: the session
node's locked companion (tests/server_cassandra.py: TLS only, client certificates required,
PasswordAuthenticator, CassandraAuthorizer). What goes wrong is one line naming the store,
never the password: a wrong CA, a client without its certificate, a wrong password, no
password at all, a user without docs/stores.md's grant (each permission missing in turn).

The store contract suites run on `cassandra-locked` (conftest.LOCKED_ENGINES). An expired
server certificate is served by a TLS listener in front of the driver (certs.tls_listener), not
by a third Cassandra JVM (10 to 40 s to start): the check is the client's, by Python's ssl
module under the driver, and the listener shows the driver's error as the user reads it."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest

import idmint
from idmint.stores.cassandra.grants import GRANTS, grant_cql

from certs import Certs, tls_listener
from checks import one_clear_line, refusal
from server_cassandra import CassandraServer, keyspace_name

_names = itertools.count(1)


@pytest.fixture(scope="module")
def locked(cassandra_server: CassandraServer) -> tuple[CassandraServer, str, str]:
    """The locked node, a keyspace an administrator made and its URL as a user with
    docs/stores.md's grant; and that user's password. One for the module: each test only
    fails to connect, or makes a user of its own (a keyspace and a user cost seconds)."""
    name = f"lc{os.getpid()}_{next(_names)}"
    url = cassandra_server.locked_store_url(name)
    password = re.search(r"://[^:]+:([^@]+)@", url)
    assert password is not None
    return cassandra_server.locked_node(), url, password.group(1)


def _one_clear_line(error: Exception, secret: str, node: CassandraServer) -> str:
    return one_clear_line(error, secret, f"{node.host}:{node.port}/")


def test_the_documented_grant_is_the_tested_one() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "stores.md").read_text()
    for line in grant_cql("idmint"):
        assert line in docs


def test_the_documented_procedure(cassandra_server: CassandraServer) -> None:
    """docs/stores.md's steps: an administrator runs `idmint init` with a superuser's URL,
    makes idmint's user and grants it SELECT and MODIFY; idmint then works as that user.
    (Leases and cells under the grant: the contract suites on cassandra-locked.)"""
    node = cassandra_server.locked_node()
    keyspace = keyspace_name(f"lc{os.getpid()}_doc")
    with idmint.connect(node.admin_url(keyspace), timeout=30) as admin:
        admin.init()
    password = node.make_user(keyspace, GRANTS, keyspace)
    with idmint.connect(node.tls_url(keyspace, keyspace, password)) as minter:
        minter.add_key("k")
        assert minter.take("k", 3).start == 1
        assert minter.identity() is not None


def test_a_wrong_ca_is_refused_in_one_line(
    locked: tuple[CassandraServer, str, str], certs: Certs
) -> None:
    node, url, password = locked
    text = _one_clear_line(
        refusal(url.replace(f"ca={certs.ca}", f"ca={certs.wrong_ca}")), password, node
    )
    assert "TLS: the server's certificate was not accepted" in text


def test_an_expired_server_certificate_is_refused_in_one_line(
    locked: tuple[CassandraServer, str, str], certs: Certs
) -> None:
    node, url, password = locked
    with tls_listener(certs.expired_cert, certs.expired_key) as port:
        served = url.replace(f"@{node.host}:{node.port}/", f"@127.0.0.1:{port}/")
        assert served != url
        text = one_clear_line(refusal(served, timeout=5), password, f"127.0.0.1:{port}/")
    assert "TLS: the server's certificate was not accepted (certificate has expired)" in text


def test_a_client_without_its_certificate_is_refused(
    locked: tuple[CassandraServer, str, str],
) -> None:
    node, url, password = locked
    text = _one_clear_line(refusal(re.sub(r"&cert=[^&]*&key=[^&]*", "", url)), password, node)
    assert "TLS: the handshake failed" in text


def test_a_wrong_password_is_refused_in_one_line(locked: tuple[CassandraServer, str, str]) -> None:
    node, url, password = locked
    wrong = "Wr0ng-" + password[::-1]
    text = _one_clear_line(refusal(url.replace(password, wrong)), wrong, node)
    assert "refused the URL's user and password" in text


def test_no_password_is_asked_for(locked: tuple[CassandraServer, str, str]) -> None:
    node, url, password = locked
    text = _one_clear_line(refusal(re.sub(r"//[^@]+@", "//", url)), password, node)
    assert "requires a user and password" in text


@pytest.mark.parametrize("missing", GRANTS)
def test_a_user_without_the_grant_is_told_what_is_missing(
    locked: tuple[CassandraServer, str, str], missing: str
) -> None:
    node, url, _ = locked
    found = re.search(r"@[^/]+/(\w+)\?", url)
    assert found is not None
    keyspace = found.group(1)
    user = keyspace_name(f"{keyspace}_no_{missing}")
    grants = tuple(g for g in GRANTS if g != missing)
    password = node.make_user(user, grants, keyspace)
    shown = re.sub(r"//[^@]+@", f"//{user}:{password}@", url)
    text = _one_clear_line(refusal(shown), password, node)
    assert f"lacks a permission (User {user} has no {missing} permission" in text
    assert "docs/stores.md" in text


def test_a_user_may_not_make_what_an_administrator_did_not(
    locked: tuple[CassandraServer, str, str],
) -> None:
    """A keyspace nobody made: the user may not make it, and is told so (not that the
    keyspace is missing)."""
    node, url, password = locked
    elsewhere = re.sub(r"/(\w+)\?", r"/\1_none?", url)
    text = _one_clear_line(refusal(elsewhere), password, node)
    assert "lacks a permission" in text and "CREATE" in text
