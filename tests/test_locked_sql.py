"""PostgreSQL and MariaDB locked down (issue 33): over TLS with the server verified, as the
least-privileged account docs/stores.md gives, on the session servers (tests/servers.py: the
same servers take the plain clients of every other test). What a user gets wrong is one line
naming the store and never a secret: a wrong CA, an expired server certificate (the server
made to present one: a reload, no second server), a wrong password, a plain connection to an
account that requires TLS, an account without a grant idmint needs; and the replication guard
refuses, naming the grant, rather than take a primary with hidden standbys for a standalone
server. The store contract suites run on these locked-down stores too (conftest.py's
LOCKED_ENGINES)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import psycopg
import pymysql
import pytest
from psycopg import sql

import idmint
from idmint import InvalidArgument, StoreUnavailable
from idmint.cli import main
from idmint.stores import redact

from certs import Certs
from replicated import mariadb_pair
from servers import (
    LOCKED_DATABASE,
    MARIADB_GRANTS,
    POSTGRES_CERT_ROLE,
    POSTGRES_GRANTS,
    MariaDBServer,
    PostgresServer,
    wait_until,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "stores.md"
_names = iter(range(1_000_000))


def _name(tag: str) -> str:
    return f"lk_{tag}_{next(_names)}"


def _password_of(url: str) -> str:
    """The URL's password, percent-decoded, and as written (both must stay out of messages)."""
    return url.split("://", 1)[1].rsplit("@", 1)[0].split(":", 1)[1]


def _refused(url: str, *, timeout: float = 5) -> str:
    """The message of the StoreUnavailable a first use of the store at `url` raises."""
    with pytest.raises(StoreUnavailable) as caught, idmint.connect(url, timeout=timeout) as m:
        m.add_key("k")
    return str(caught.value)


def _one_clear_line(message: str, url: str, *words: str) -> None:
    """One line, naming the store (its URL without the password), none of the password, and
    the `words` (regular expressions) that say what to fix."""
    written = _password_of(url)
    assert "\n" not in message, message
    assert message.startswith(f"store {redact(url)}"), message
    for secret in {written, unquote(written), unquote(written).strip("@:/")}:
        assert secret not in message, message
    for word in words:
        assert re.search(word, message), f"{word!r} not in {message!r}"


def _with_password(url: str, password: str) -> str:
    head, rest = url.split("://", 1)
    user = rest.split(":", 1)[0]
    return f"{head}://{user}:{quote(password, safe='')}@{rest.rsplit('@', 1)[1]}"


# -- the grants stated are the grants tested ------------------------------------------------


def test_docs_give_the_grants_the_tests_run_under() -> None:
    """docs/stores.md's "Locked down" statements are the ones every locked-down store in the
    tests is made with (servers.py), spelled for a database `idmint` and a user `idmint`."""
    text = " ".join(DOCS.read_text().split())
    for grant in POSTGRES_GRANTS:
        stated = grant.format(db="idmint", schema="public", user="idmint")
        assert stated.replace("public.", "") + ";" in text or stated + ";" in text, stated
    for grant in MARIADB_GRANTS:
        stated = grant.format(db="idmint", user="'idmint'@'%'")
        assert stated + ";" in text, stated


# -- PostgreSQL -----------------------------------------------------------------------------


def test_postgres_verify_full_and_the_least_grant_serve(postgres: PostgresServer) -> None:
    """The URL idmint is given: TLS, the CA and the server's name verified, a password; ids
    come, and the connection is encrypted (pg_stat_ssl, read by the role itself)."""
    url = postgres.locked_store_url(_name("pg"))
    assert "sslmode=verify-full" in url
    with idmint.connect(url, timeout=5) as minter:
        minter.add_key("k", step=10)
        assert list(minter.take("k", 3)) == [1, 2, 3]
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        ).fetchone()
    assert row is not None and row[0] is True and row[1].startswith("TLS"), row


def test_postgres_wrong_ca_expired_certificate_wrong_password(
    postgres: PostgresServer, certs: Certs
) -> None:
    url = postgres.locked_store_url(_name("pg"))
    wrong_ca = url.replace(str(certs.ca), str(certs.wrong_ca))
    _one_clear_line(_refused(wrong_ca), wrong_ca, "TLS", "certificate")
    with postgres.serving_certificate(certs.expired_cert, certs.expired_key):
        _one_clear_line(_refused(url), url, "TLS", "certificate")
    # a certificate that does not name the host the URL gives (the address stays the same)
    other = url.replace("@127.0.0.1:", "@db.invalid:").replace("?", "?hostaddr=127.0.0.1&")
    _one_clear_line(_refused(other), other, r"does not match host name \"db\.invalid\"")
    wrong = _with_password(url, "not-the-password")
    _one_clear_line(_refused(wrong), wrong, "password authentication failed")
    _one_clear_line(_refused(wrong), url)  # the right password is not in it either
    # a locked-down role without TLS: pg_hba.conf turns it away
    plain = url.replace("sslmode=verify-full", "sslmode=disable")
    _one_clear_line(_refused(plain), plain, "no encryption")
    # a CA file that is not there: a bad URL at once, no connection tried
    missing = url.replace(str(certs.ca), str(certs.directory / "missing.pem"))
    with pytest.raises(InvalidArgument, match=r"cannot read sslrootcert=.*missing\.pem"):
        idmint.connect(missing)


def test_postgres_a_client_certificate_logs_in_without_a_password(
    postgres: PostgresServer, certs: Certs
) -> None:
    """pg_hba.conf takes role idmint by its client certificate alone (`cert`: the server checks
    it against its CA, and its common name names the role): libpq's sslcert and sslkey in the
    URL, no password. Without the certificate, or with one the server's CA did not sign, the
    role is refused in one line."""
    store = _name("pg")
    postgres.locked_store_url(store)  # the schema and its tables, made by their owner
    names = {
        "db": sql.Identifier(LOCKED_DATABASE),
        "schema": sql.Identifier(store),
        "user": sql.Identifier(POSTGRES_CERT_ROLE),
    }
    with psycopg.connect(postgres.url(LOCKED_DATABASE), autocommit=True) as conn:
        with contextlib.suppress(psycopg.errors.DuplicateObject):
            conn.execute(sql.SQL("CREATE ROLE {user} LOGIN").format(**names))
        conn.execute(sql.SQL("ALTER ROLE {user} SET search_path = {schema}").format(**names))
        for grant in POSTGRES_GRANTS:
            conn.execute(sql.SQL(grant).format(**names))
    base = postgres.locked_url(POSTGRES_CERT_ROLE, "", LOCKED_DATABASE).replace(":@", "@")
    url = f"{base}&sslcert={certs.client_cert}&sslkey={certs.client_key}"
    with idmint.connect(url, timeout=5) as minter:
        minter.add_key("k")
        assert list(minter.take("k", 3)) == [1, 2, 3]
    refused = _refused(base)
    assert "\n" not in refused and refused.startswith(f"store {redact(base)}"), refused
    assert "certificate" in refused, refused


def test_postgres_a_role_without_its_grants_is_told_which(postgres: PostgresServer) -> None:
    store = _name("pg")
    url = postgres.locked_store_url(store)
    with idmint.connect(url, timeout=5) as minter:
        minter.add_key("k")
    # No rights on the tables (connect and the schema only): the first statement says so.
    _, bare = postgres.add_locked_role(_name("bare"), grants=POSTGRES_GRANTS[:2], schema=store)
    _one_clear_line(_refused(bare), bare, "permission denied for table idmint_", "Locked down")
    # The runtime role in a schema nobody made: it cannot make it (no CREATE), and says so.
    empty = _name("empty")
    with psycopg.connect(postgres.url(LOCKED_DATABASE), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {empty}")
    _, fresh = postgres.add_locked_role(_name("fresh"), grants=POSTGRES_GRANTS[:3], schema=empty)
    _one_clear_line(_refused(fresh), fresh, "permission denied for schema", "`idmint init` run as")


@contextlib.contextmanager
def _walsender(server: PostgresServer) -> Iterator[None]:
    """A walsender on the server for the block: pg_receivewal, streaming WAL as a backup
    does (not a standby idmint waits for; pg_stat_replication shows it as it shows one)."""
    with tempfile.TemporaryDirectory() as into:
        proc = subprocess.Popen(
            [
                *(str(server.bindir / "pg_receivewal"), "-h", "127.0.0.1"),
                *("-p", str(server.port), "-U", "postgres", "-D", into, "--no-sync", "--no-loop"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:

            def streaming() -> bool:
                with psycopg.connect(server.url(), autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                    ).fetchone()
                return bool(row and row[0])

            wait_until(streaming, 20, "pg_receivewal to stream")
            yield
        finally:
            proc.terminate()
            proc.wait(10)


def test_postgres_replication_guard_under_the_least_grant(postgres: PostgresServer) -> None:
    """pg_stat_replication shows a walsender's state only to pg_read_all_stats (or a
    superuser): with the grant the guard sees it (pg_receivewal is no standby: writes go on),
    without it the guard refuses, naming the grant; on main it read "no standby", and a
    primary with standbys passed for a standalone server whose writes wait for nothing."""
    store = _name("pg")
    url = postgres.locked_store_url(store)
    _, blind = postgres.add_locked_role(_name("blind"), grants=POSTGRES_GRANTS[:-1], schema=store)
    with _walsender(postgres):
        with idmint.connect(url, timeout=5) as minter:
            minter.add_key("k")
            assert list(minter.take("k", 2)) == [1, 2]
            state = minter.replication()
            assert state is not None and state.replicas == 0 and state.risk is None, state
        message = _refused(blind)
        _one_clear_line(message, blind, r"hides 1 of them", "GRANT pg_read_all_stats")
    # no walsender, nothing hidden: the same role is served (the grant matters once one is)
    with idmint.connect(blind, timeout=5) as minter:
        minter.add_key("k2")


# -- MariaDB --------------------------------------------------------------------------------


def test_mariadb_tls_with_a_client_certificate_and_the_least_grant_serve(
    mariadb: MariaDBServer,
) -> None:
    url = mariadb.locked_store_url(_name("my"))
    assert "?ca=" in url and "&cert=" in url and "&key=" in url
    with idmint.connect(url, timeout=5) as minter:
        minter.add_key("k", step=10)
        assert list(minter.take("k", 3)) == [1, 2, 3]
    parts = urlsplit(url)
    conn = pymysql.connect(
        host="127.0.0.1",
        port=mariadb.port,
        user=parts.username,
        password=unquote(parts.password or ""),
        ssl_ca=str(mariadb.certs.ca) if mariadb.certs else None,
        ssl_cert=str(mariadb.certs.client_cert) if mariadb.certs else None,
        ssl_key=str(mariadb.certs.client_key) if mariadb.certs else None,
    )
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            row = cur.fetchone()
    finally:
        conn.close()
    assert row is not None and str(row[1]).startswith("TLS"), row


def test_mariadb_wrong_ca_expired_certificate_wrong_password(
    mariadb: MariaDBServer, certs: Certs
) -> None:
    url = mariadb.locked_store_url(_name("my"))
    wrong_ca = url.replace(str(certs.ca), str(certs.wrong_ca))
    _one_clear_line(_refused(wrong_ca), wrong_ca, "TLS: the server's certificate was not accepted")
    with mariadb.serving_certificate(certs.expired_cert, certs.expired_key):
        _one_clear_line(_refused(url), url, "TLS", "expired")
    wrong = _with_password(url, "not-the-password")
    _one_clear_line(_refused(wrong), wrong, "Access denied", "wrong user name or password")
    _one_clear_line(_refused(wrong), url)
    # The account requires a client certificate (REQUIRE X509): without one, refused...
    no_cert = url.split("&cert=")[0]
    _one_clear_line(_refused(no_cert), no_cert, "Access denied", r"client certificate")
    # ... and plain, refused, the message pointing at TLS
    plain = url.split("?")[0]
    _one_clear_line(_refused(plain), plain, "Access denied", r"requires TLS \(\?ca=")
    # bad URLs at once, naming the store: a CA file that is not there, a misspelt parameter
    with pytest.raises(InvalidArgument, match=r"store mysql://.*:\*\*\*@.*cannot use ca="):
        idmint.connect(url.replace(str(certs.ca), str(certs.directory / "missing.pem")))
    with pytest.raises(InvalidArgument, match=r"unknown parameter 'ssl-ca'"):
        idmint.connect(plain + f"?ssl-ca={certs.ca}")


def test_mariadb_an_account_that_requires_tls_refuses_a_plain_connection(
    mariadb: MariaDBServer,
) -> None:
    """REQUIRE SSL (what require_secure_transport makes of every account): the same account
    is served over TLS and refused plain."""
    store = _name("my")
    mariadb.locked_store_url(store)
    _, url = mariadb.add_locked_user(_name("ssl"), store, require="SSL")
    assert "&cert=" not in url
    with idmint.connect(url, timeout=5) as minter:
        minter.add_key("k")
    plain = url.split("?")[0]
    _one_clear_line(_refused(plain), plain, "Access denied", r"requires TLS")


def test_mariadb_an_account_without_its_grants_is_told_which(mariadb: MariaDBServer) -> None:
    store = _name("my")
    mariadb.locked_store_url(store)
    rows, process, monitor = (
        MARIADB_GRANTS[0],
        "GRANT PROCESS ON *.* TO {user}",
        ("GRANT SLAVE MONITOR ON *.* TO {user}"),
    )
    # rows read only: the first write says which
    _, reader = mariadb.add_locked_user(
        _name("ro"), store, ("GRANT SELECT ON {db}.* TO {user}", process, monitor)
    )
    _one_clear_line(_refused(reader), reader, "INSERT command denied", "Locked down")
    # the runtime account where nobody made the tables: it cannot, and is told who does
    empty = _name("empty")
    mariadb.create_database(empty)
    _, fresh = mariadb.add_locked_user(_name("fresh"), empty, (rows, process, monitor))
    _one_clear_line(_refused(fresh), fresh, "CREATE command denied", "`idmint init` run as")
    # no PROCESS: the replicas are out of sight, and the guard says so
    _, no_process = mariadb.add_locked_user(_name("np"), store, (rows, MARIADB_GRANTS[1], monitor))
    _one_clear_line(_refused(no_process), no_process, "cannot see the replicas", "GRANT PROCESS")
    # no SLAVE MONITOR: whether the server replicates cannot be read, and the guard says so
    _, no_monitor = mariadb.add_locked_user(_name("nm"), store, (rows, MARIADB_GRANTS[1], process))
    _one_clear_line(_refused(no_monitor), no_monitor, "is a replica", "GRANT SLAVE MONITOR")


def test_the_store_url_from_a_file(
    mariadb: MariaDBServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """IDMINT_STORE_FILE holds the locked-down URL (its password out of `ps`): the CLI works
    with it, and a wrong password in it is one line on stderr without the password."""
    url = mariadb.locked_store_url(_name("my"))
    secret = tmp_path / "store"
    monkeypatch.setenv("IDMINT_STORE_FILE", str(secret))
    secret.write_text(url + "\n")
    assert main(["keys", "add", "k", "--start", "7"]) == 0
    assert main(["next", "k", "-n", "2"]) == 0
    assert capsys.readouterr().out.split()[-2:] == ["7", "8"]
    wrong = _with_password(url, "not-the-password")
    secret.write_text(wrong + "\n")
    assert main(["--timeout", "2", "next", "k"]) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Access denied" in err, err
    _one_clear_line(err.removeprefix("idmint: error: ").strip(), url)


# -- the replication guard under the least grant, on a real replica ------------------------


def _least_privileged(
    primary: MariaDBServer, replica: MariaDBServer, grants: tuple[str, ...]
) -> Callable[[int], str]:
    """An account on `primary` with `grants` on database `g`, its schema made by root, once
    the replica has it too; its URL on a server given by port."""
    name = _name("repl")
    password = "pw-" + name
    conn = pymysql.connect(host="127.0.0.1", port=primary.port, user="root", autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE IF NOT EXISTS g")
        with idmint.connect(primary.url("g"), timeout=5) as minter:
            minter.init()
        with conn.cursor() as cur:
            cur.execute(f"CREATE USER '{name}'@'%%' IDENTIFIED BY %s", (password,))
            for grant in grants:
                cur.execute(grant.format(db="g", user=f"'{name}'@'%'"))
    finally:
        conn.close()

    def replicated() -> bool:
        conn = pymysql.connect(host="127.0.0.1", port=replica.port, user="root")
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT COUNT(*) FROM mysql.user WHERE user = %s", (name,))
                row = cur.fetchone()
        finally:
            conn.close()
        return bool(row and row[0])

    wait_until(replicated, 20, "the account to replicate")
    return lambda port: f"mysql://{name}:{password}@127.0.0.1:{port}/g"


def test_mariadb_replication_guard_under_the_least_grant() -> None:
    """A primary with a replica, seen by the least-privileged account: the replica is seen
    (PROCESS), so asynchronous replication is refused as it is for root; the replica is a
    replica (SLAVE MONITOR). Without PROCESS, on main the primary looked standalone and
    writes went on; now the guard refuses, naming the grant. Then require_secure_transport
    on the primary: a plain connection is refused, pointing at TLS."""
    with mariadb_pair(semi_sync=False) as (primary, replica):
        url = _least_privileged(primary, replica, MARIADB_GRANTS)
        message = _refused(url(primary.port))
        _one_clear_line(message, url(primary.port), r"1 replica\(s\) connected")
        message = _refused(url(replica.port))
        _one_clear_line(message, url(replica.port), "is a replica")
        monitor = "GRANT SLAVE MONITOR ON *.* TO {user}"
        blind = _least_privileged(primary, replica, (MARIADB_GRANTS[0], monitor))
        _one_clear_line(_refused(blind(primary.port)), blind(primary.port), "GRANT PROCESS")
        # require_secure_transport (a server of this test's own: it turns every plain client
        # away) answers a plain login as a wrong password; the message names both
        admin = pymysql.connect(host="127.0.0.1", port=primary.port, user="root", autocommit=True)
        with admin, admin.cursor() as cur:
            cur.execute("SET GLOBAL require_secure_transport = ON")
        message = _refused(url(primary.port))
        _one_clear_line(message, url(primary.port), "Access denied", r"requires TLS \(\?ca=")
