"""No secret of a store URL shows anywhere: not in messages, logs, /metrics, /v1/stats or the
CLI's errors. A password may sit in the userinfo (holding any character, unencoded "/ # ? @ :"
too) or in a query parameter (`?password=`, valid for libpq)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, unquote

import httpx
import psycopg
import pymysql
import pytest
import redis
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from psycopg import sql

from idmint import InvalidArgument
from idmint.cli import main
from idmint.stores import open_lease_store, open_store, redact

from http_server import ServerProcess
from servers import MariaDBServer, PostgresServer

SCHEMES = ["postgresql", "postgres", "mysql", "mariadb", "redis", "rediss", "sqlite", "etcd"]
SECRET_NAMES = ["password", "passwd", "pwd", "sslpassword", "token", "secret", "api_key", "PASS"]
PUBLIC_NAMES = ["sslmode", "application_name", "prefix", "connect_timeout", "host"]

plain = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=12)
anything = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)
# Query parameters that carry nothing secret, as a URL would have them.
public_query = st.lists(st.tuples(st.sampled_from(PUBLIC_NAMES), plain), max_size=3)


def scrub(text: str, url: str) -> str:
    from idmint.stores._urls import scrub as scrub_secrets  # here: not on main, to compare

    return scrub_secrets(text, url)


def absent(secret: str, text: str, public: str = "") -> bool:
    """Neither the secret as written or decoded is in `text`, nor any piece of it (between
    URL delimiters) that `public`, the rest of the URL, does not hold anyway."""
    for form in (secret, unquote(secret)):
        if form in text:
            return False
        for piece in re.split(r"[/#?@:&=;,\s'\"]+", form):
            if piece and piece not in public and piece in text:
                return False
    return True


@settings(max_examples=500)
@given(
    scheme=st.sampled_from(SCHEMES),
    user=plain,
    password=anything,
    host=plain,
    port=st.integers(1, 65535),
    path=plain,
    query=public_query,
)
def test_a_userinfo_password_never_shows(
    scheme: str,
    user: str,
    password: str,
    host: str,
    port: int,
    path: str,
    query: list[tuple[str, str]],
) -> None:
    tail = f"{host}:{port}/{path}" + ("?" + "&".join(f"{k}={v}" for k, v in query) if query else "")
    public = f"{scheme}://{user}:***@{tail}"
    assume(password not in public and unquote(password) not in public)
    for written in (password, quote(password, safe="")):
        url = f"{scheme}://{user}:{written}@{tail}"
        shown = redact(url)
        assert absent(password, shown, public), (url, shown)
        assert shown == public  # nothing else is lost
        # A driver's message quoting the password, or what it made of it, loses it too.
        for said in (f"could not connect to {written} ({password})", f"bad port {written!r}"):
            words = public + " could not connect to bad port"  # not the secret's
            assert absent(password, scrub(said, url), words), said


@settings(max_examples=500)
@given(
    scheme=st.sampled_from(SCHEMES),
    name=st.sampled_from(SECRET_NAMES),
    value=anything,
    before=public_query,
    after=public_query,
    userinfo=st.sampled_from(["", "user@", "user:pw@"]),
)
def test_a_secret_query_parameter_never_shows(
    scheme: str,
    name: str,
    value: str,
    before: list[tuple[str, str]],
    after: list[tuple[str, str]],
    userinfo: str,
) -> None:
    # An unencoded "&name=" or " name=" inside the value starts another parameter, for any
    # URL parser: such a value is not one secret but two parameters.
    assume(not re.search(r"[&;\s][^\s?&;=#/@:'\"]+=", value))
    params = [f"{k}={v}" for k, v in before] + [f"{name}={{}}"] + [f"{k}={v}" for k, v in after]
    template = f"{scheme}://{userinfo}db.example:5432/app?" + "&".join(params)
    public = template.format("***").replace("user:pw@", "user:***@")
    assume(value not in public and unquote(value) not in public)
    for written in (value, quote(value, safe="")):
        url = template.format(written)
        shown = redact(url)
        assert absent(value, shown, public), (url, shown)
        for said in (f"bad parameter {written!r}", f"bad parameter '{written}'"):
            assert absent(value, scrub(said, url), public + " bad parameter"), said


@settings(max_examples=300)
@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=80))
def test_redact_and_scrub_never_raise(text: str) -> None:
    assert isinstance(redact(text), str)
    assert isinstance(scrub(text, text), str)
    assert isinstance(redact("postgresql://" + text), str)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:pw@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("postgresql://app:pa/ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa#ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa?ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:p@ss:w@db/app", "postgresql://app:***@db/app"),
        (
            "postgresql://db/app?password=x&sslmode=require",
            "postgresql://db/app?password=***&sslmode=require",
        ),
        ("postgresql://db/app?sslpassword=x#y", "postgresql://db/app?sslpassword=***"),
        ("redis://:pw@cache:6379/0?prefix=p", "redis://:***@cache:6379/0?prefix=p"),
        ("host=db password=secret dbname=app", "host=db password=*** dbname=app"),
        ("etcd://h1:2379,h2:2379/prefix", "etcd://h1:2379,h2:2379/prefix"),
        ("sqlite:///./idmint.db", "sqlite:///./idmint.db"),
    ],
)
def test_redact_examples(url: str, shown: str) -> None:
    assert redact(url) == shown


SECRET = "Zq7-s3cr3t-Pw9"
WEIRD = "Zq7#s3?cr:3t@Pw9"  # unencoded # ? : @ in the userinfo: libpq reads it whole


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app:{SECRET}@127.0.0.1:1/app",  # nobody listens on port 1
        f"postgresql://127.0.0.1:1/app?user=app&password={SECRET}",
        f"postgresql://app:{WEIRD}@127.0.0.1:1/app",
        f"postgresql://app:{SECRET}/x@127.0.0.1:1/app",  # libpq takes the start for host:port
        f"postgresql://app:ab@{SECRET}@127.0.0.1:1/app",  # libpq: password "ab", host "Zq7..."
        f"postgresql://app:%zz{SECRET}@127.0.0.1/app",  # libpq quotes its bad escape
        f"mysql://app:{SECRET}/x@127.0.0.1:1/app",
        f"mysql://app:{SECRET}@127.0.0.1:1/app",
        f"redis://app:{SECRET}/x@127.0.0.1:1/0",
        f"redis://:{SECRET}@127.0.0.1:1/0?prefix=p",
        f"etcd://127.0.0.1:x?token={SECRET}",
        f"cassandra://app:{SECRET}@127.0.0.1:1/k",
        f"cassandra://app:{SECRET}/x@127.0.0.1:1/k",
        f"cassandra://app:{SECRET}@127.0.0.1:1/k?serial=none",
        f"sqlite://app:{SECRET}@h/x",
        f"host=127.0.0.1 password={SECRET}",
    ],
)
def test_cli_errors_never_show_a_secret(capsys: pytest.CaptureFixture[str], url: str) -> None:
    command = ["snowflake"] if url.startswith(("redis", "etcd")) else ["keys", "list"]
    code = main(["--timeout", "1", "--store", url, *command])
    out, err = capsys.readouterr()
    assert code in (1, 2), err
    assert err.startswith("idmint: error: ") and err.count("\n") == 1, err
    for piece in ("Zq7", "s3cr3t", "Pw9", "cr:3t"):
        assert piece not in out + err, err


def test_a_served_store_url_shows_no_password(postgres: PostgresServer, tmp_path: Path) -> None:
    """`idmint serve` on a PostgreSQL URL with `?password=`, for a role that has that password:
    not in /metrics, /v1/stats, the server's log, nor anything the CLI prints."""
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE idmint_app LOGIN PASSWORD {}").format(sql.Literal(SECRET))
        )
        admin.execute("CREATE DATABASE secret_app OWNER idmint_app")
    url = f"postgresql://127.0.0.1:{postgres.port}/secret_app?user=idmint_app&password={SECRET}"
    printed = []

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "idmint", "--store", url, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        printed.append(done.stdout + done.stderr)
        return done

    assert cli("init").returncode == 0
    assert cli("keys", "add", "order", "--start", "1000").returncode == 0
    assert cli("keys", "add", "order").returncode == 2  # exists
    server = ServerProcess(url).start()
    try:
        assert httpx.get(server.url + "/api/segment/get/order").text.strip() == "1000"
        metrics = httpx.get(server.url + "/metrics").text
        stats = httpx.get(server.url + "/v1/stats").text
        assert "secret_app" in metrics and "secret_app" in stats  # the URL is shown, redacted
    finally:
        server.terminate()
        log = server.log()
        server.stop()
    assert "secret_app" in log
    # The same store, unreachable: errors name it.
    wrong = url.replace(str(postgres.port), "1")
    done = subprocess.run(
        [sys.executable, "-m", "idmint", "--timeout", "1", "--store", wrong, "keys", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 1 and "secret_app" in done.stderr
    printed.append(done.stdout + done.stderr)
    for where, text in [("/metrics", metrics), ("/v1/stats", stats), ("log", log)] + [
        ("cli", text) for text in printed
    ]:
        assert SECRET not in text, f"{where}: {text}"


# Every character a password must percent-encode in a URL, and what ENCODE_HINT tells users to do.
ODD = "p/w#x?y@z:1 %&="


def test_percent_encoded_credentials_connect(mariadb: MariaDBServer) -> None:
    """A user name and password written percent-encoded reach the server decoded."""
    from server_redis import RedisServer

    redis_server = RedisServer()
    redis_server.start()
    try:
        admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
        admin.acl_setuser(
            "app@o:k", enabled=True, passwords=[f"+{ODD}"], keys=["*"], commands=["+@all"]
        )
        admin.config_set("requirepass", ODD)
        port = redis_server.port
        password = quote(ODD, safe="")
        for userinfo in (f":{password}", f"{quote('app@o:k', safe='')}:{password}"):
            store = open_lease_store(f"redis://{userinfo}@127.0.0.1:{port}/0?prefix=enc", timeout=5)
            store.release(store.acquire("ns", workers=4, ttl=60, horizon_ms=1_800_000_000_000))
            store.close()
    finally:
        redis_server.close()

    admin_sql = pymysql.connect(host="127.0.0.1", port=mariadb.port, user="root")
    with admin_sql, admin_sql.cursor() as cur:
        cur.execute("CREATE DATABASE IF NOT EXISTS encoded")
        cur.execute("CREATE USER IF NOT EXISTS 'a@b:c'@'%%' IDENTIFIED BY %s", (ODD,))
        cur.execute("GRANT ALL ON encoded.* TO 'a@b:c'@'%'")
        # what the replication guard reads (docs/stores.md, MySQL and MariaDB: locked down)
        cur.execute("GRANT PROCESS, SLAVE MONITOR ON *.* TO 'a@b:c'@'%'")
    user = quote("a@b:c", safe="")
    url = f"mysql://{user}:{quote(ODD, safe='')}@127.0.0.1:{mariadb.port}/encoded"
    range_store = open_store(url, timeout=5)
    range_store.add_key("k", step=10, first_id=1, last_id=100)
    assert range_store.allocate("k").range.start == 1
    range_store.close()


def test_a_store_object_shows_no_secret() -> None:
    """What a debugger or an error tracker shows of a store (its repr, its attributes)."""
    for url in (
        f"postgresql://app:{SECRET}@127.0.0.1:1/app?sslpassword={SECRET}",
        f"mysql://app:{SECRET}@127.0.0.1:1/app",
        f"cassandra://app:{SECRET}@127.0.0.1:1/k",
    ):
        for store in (open_store(url), open_lease_store(url)):
            assert SECRET not in repr(store) + repr(vars(store)) + store.display_url
    # A SQLite URL takes no parameters: refused, and the refusal shows none of the secret.
    with pytest.raises(InvalidArgument, match="takes no parameters") as refused:
        open_store(f"sqlite:///app.db?password={SECRET}")
    assert SECRET not in str(refused.value)
    for url in (f"redis://:{SECRET}@127.0.0.1:1/0", "etcd://127.0.0.1:1", "zk://127.0.0.1:1"):
        store = open_lease_store(url)
        assert SECRET not in repr(store) + repr(vars(store)) + store.display_url
