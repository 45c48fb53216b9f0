"""Redis locked down (issue 33), on real servers over real TLS handshakes: what goes wrong is
one line naming the store, never the password (a wrong CA, an expired server certificate, a
wrong password, a user whose ACL lacks a command idmint needs); and the replication guard
keeps working under docs/stores.md's rule, a failover fenced by the least-privileged user.

The store contract suites run on `redis-locked` (conftest.LOCKED_ENGINES) on the session
server's TLS port; these add the failures."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import idmint
from idmint import StoreUnavailable
from idmint.stores.redis.acl import COMMANDS, acl_rule

from certs import Certs
from checks import one_clear_line, refusal
from server_redis import RedisServer
from servers import wait_until


def _one_clear_line(error: Exception, password: str, port: int) -> str:
    return one_clear_line(error, password, f":{port}/")


def _user(server: RedisServer, name: str, rule: str | None = None) -> tuple[str, str]:
    """A URL over TLS as a new ACL user `name` under prefix `name` (docs' rule by default)."""
    password = server.make_user(name, rule if rule is not None else acl_rule(name))
    return server.tls_url(name, name, password), password


def test_the_rule_names_every_command_and_nothing_else() -> None:
    rule = acl_rule("p")
    assert rule.startswith("resetkeys ~p:* resetchannels -@all ")
    assert "+info" in rule and "+wait" in rule  # the replication guard's
    assert "config" not in rule and "config|get" in acl_rule("p", quorum=True)


def test_the_documented_rule_is_the_tested_one() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "stores.md").read_text()
    assert acl_rule("idmint") in docs
    assert acl_rule("idmint", quorum=True).removeprefix(acl_rule("idmint")) in docs


def test_a_wrong_ca_is_refused_in_one_line(redis_server: RedisServer, certs: Certs) -> None:
    url, password = _user(redis_server, "lr_ca")
    url = url.replace(f"ca={certs.ca}", f"ca={certs.wrong_ca}")
    text = _one_clear_line(refusal(url), password, redis_server.tls_port or 0)
    assert "TLS: the server's certificate was not accepted" in text


def test_a_wrong_password_is_refused_in_one_line(redis_server: RedisServer) -> None:
    url, password = _user(redis_server, "lr_pw")
    wrong = "Wr0ng-" + password[::-1]
    text = _one_clear_line(refusal(url.replace(password, wrong)), wrong, redis_server.tls_port or 0)
    assert "refused the URL's user and password" in text


def test_plain_text_on_the_tls_port_is_no_store(redis_server: RedisServer) -> None:
    """The client certificate is required there: TLS without one fails its handshake."""
    url, password = _user(redis_server, "lr_nocert")
    url = re.sub(r"&cert=[^&]*&key=[^&]*", "", url)
    text = _one_clear_line(refusal(url), password, redis_server.tls_port or 0)
    assert "TLS:" in text


@pytest.mark.parametrize(
    ("missing", "said"),
    [
        ("info", "may not run INFO"),  # the replication guard's, inside every writing script
        ("evalsha", "may not run EVALSHA"),
        ("hmget", "may not run HMGET"),
        ("hset", "may not run a command of idmint's scripts"),  # inside a script
    ],
)
def test_a_user_without_a_command_idmint_needs_is_told_which(
    redis_server: RedisServer, missing: str, said: str
) -> None:
    assert missing in COMMANDS
    name = f"lr_no_{missing}"
    rule = acl_rule(name).replace(f" +{missing}", "")
    url, password = _user(redis_server, name, rule)
    text = _one_clear_line(refusal(url), password, redis_server.tls_port or 0)
    assert said in text and "docs/stores.md" in text


def test_a_user_of_another_prefix_is_refused_its_keys(redis_server: RedisServer) -> None:
    url, password = _user(redis_server, "lr_keys", acl_rule("someone_else"))
    text = _one_clear_line(refusal(url), password, redis_server.tls_port or 0)
    assert "may not use the keys under its prefix" in text


def test_an_expired_server_certificate_is_refused(certs: Certs) -> None:
    server = RedisServer(certs=certs, server_cert=certs.expired_cert)
    server.start()
    try:
        url, password = _user(server, "lr_expired")
        text = _one_clear_line(refusal(url), password, server.tls_port or 0)
        assert "certificate has expired" in text
    finally:
        server.close()


@pytest.fixture
def locked_pair(certs: Certs) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica, each with TLS; replication over the plain port."""
    primary = RedisServer(certs=certs)
    primary.start()
    replica = RedisServer(certs=certs, replica_of=(primary.host, primary.port))
    try:
        replica.start()
        client = primary.client()
        wait_until(
            lambda: client.info("replication").get("slave0", {}).get("state") == "online",
            30,
            "the replica to sync",
        )
        client.close()
        yield primary, replica
    finally:
        replica.close()
        primary.close()


def test_the_guard_waits_and_fences_under_the_rule(
    locked_pair: tuple[RedisServer, RedisServer],
) -> None:
    """The least-privileged user writes through the guard (INFO, WAIT for the replica), and
    after a failover (the replica promoted) fences the store: the fence's scripts and lock run
    under the same rule. ACL users are not replicated: each server gets its own."""
    primary, replica = locked_pair
    name = "lr_guard"
    password = primary.make_user(name, acl_rule(name))
    replica_client = cast(Any, replica.client())
    replica_client.execute_command(
        "ACL", "SETUSER", name, "reset", "on", f">{password}", *acl_rule(name).split()
    )
    with idmint.connect(primary.tls_url(name, name, password)) as minter:
        minter.add_key("k")
        before = minter.take("k", 10)
        state = minter.replication()
        assert state is not None and state.replicas == 1 and state.required == 1
    replica_client.execute_command("REPLICAOF", "NO", "ONE")
    primary.kill()
    replica_client.close()
    with idmint.connect(replica.tls_url(name, name, password)) as minter:
        # alone below the requirement of one replica: refused, clearly, by the guard
        with pytest.raises(StoreUnavailable, match="replica"):
            minter.take("k", 10)
        minter.set_required_replicas(0)  # the operator's move (fences: a new lineage)
        after = minter.take("k", 10)
    assert after.start > before.stop  # fenced past the old primary's ranges


def test_quorum_nodes_over_tls_under_the_quorum_rule(redis_server: RedisServer) -> None:
    """Quorum claims go over the TLS connection's socket as raw RESP (quorum.py): three
    prefixes of the session server, each its own user with the quorum rule, stand in for
    three nodes (each prefix has its own identity)."""
    urls = []
    for i in range(3):
        name = f"lr_q{i}"
        urls.append(_user(redis_server, name, acl_rule(name, quorum=True))[0])
    gen, other = idmint.open_quorum("ticket", urls), idmint.open_quorum("ticket", urls)
    try:
        ids = [gen.next_id() for _ in range(20)]
        ids += list(gen.take(5))
        # Each call after the other's starts from a stale guess: placed above the counter.
        ids += [g.next_id() for _ in range(5) for g in (other, gen)]
    finally:
        gen.close()
        other.close()
    assert ids == sorted(ids) and len(set(ids)) == len(ids) == 35


def test_a_quorum_node_that_may_not_read_its_settings_is_refused(
    redis_server: RedisServer,
) -> None:
    """Without `+config|get` nothing shows the node fsyncs its claims: refused, saying so."""
    urls, passwords = [], []
    for i in range(3):
        url, password = _user(redis_server, f"lr_qc{i}")
        urls.append(url)
        passwords.append(password)
    with pytest.raises(idmint.IdmintError) as caught:
        gen = idmint.open_quorum("ticket", urls)
        try:
            gen.next_id()
        finally:
            gen.close()
    text = str(caught.value)
    assert "persistence settings cannot be read" in text and "config" in text.lower()
    assert not any(password in text for password in passwords)
