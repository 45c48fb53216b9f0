"""Fixtures: real PostgreSQL and MariaDB servers started from the installed binaries, and a
fresh database on every store for each test that asks for one."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idmint
from idmint.stores import registry

import toy_engine
from certs import Certs, make_certs
from http_server import ServerProcess
from servers import MariaDBServer, PostgresServer

# The toy engine (tests/toy_engine/, docs/design.md "How to add an engine") is registered in
# this process, so it runs the contract suites of one process; other processes, which know
# only the engines idmint ships, never get its URLs.
registry.register(toy_engine.ROW)

# In CI every server must be there: a missing one is a failure, never a skip.
ENGINES = ("memory", "sqlite", "postgres", "mariadb", "redis", "etcd", "zookeeper", "cassandra")
STORES = (*ENGINES, "toy")  # every engine keeps segment keys
# Those other processes can reach.
SHARED_STORES = ENGINES[1:]
SHARED_SQL_STORES = ("sqlite", "postgres", "mariadb")  # for tests of the SQL schema itself
LEASE_STORES = (*ENGINES, "toy")
CAS_STORES = (*ENGINES, "toy")  # every engine keeps compare-and-set cells
SHARED_LEASE_STORES = ENGINES[1:]  # all but memory: those other processes can reach
#: Every server engine again, locked down (issue 33): over TLS (certificates made at test time,
#: tests/certs.py), as the least-privileged user docs/stores.md gives. The session servers of
#: PostgreSQL, MariaDB, Redis and ZooKeeper take plain and locked-down clients side by side;
#: etcd (whose auth would lock every plain client out) and Cassandra 2.1 (no TLS beside plain on
#: one port) start a locked companion on first use. The contract suites run on them; each
#: session server has `locked_store_url(name)`.
LOCKED_ENGINES: tuple[str, ...] = (
    "postgres",
    "mariadb",
    "redis",
    "etcd",
    "zookeeper",
    "cassandra",
)
LOCKED_STORES = tuple(f"{engine}-locked" for engine in LOCKED_ENGINES)
KV_SERVERS = {
    "redis": "RedisServer",
    "etcd": "EtcdServer",
    "zookeeper": "ZooKeeperServer",
    "cassandra": "CassandraServer",
}

_db_numbers = itertools.count(1)


def pytest_report_header() -> str:
    from torture_kit import CI_SEED

    return f"torture seed {CI_SEED} (IDMINT_TORTURE_SEED={CI_SEED} replays tests/test_torture.py)"


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """The test run's CA and what it signed (tests/certs.py)."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def postgres(certs: Certs) -> Iterator[PostgresServer]:
    server = PostgresServer(certs=certs)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def mariadb(certs: Certs) -> Iterator[MariaDBServer]:
    server = MariaDBServer(certs=certs)
    server.start()
    yield server
    server.close()


def fresh_store_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL to an empty store of `kind`, private to the calling test."""
    name = f"t{os.getpid()}_{next(_db_numbers)}"
    if kind == "memory":
        return f"memory://{name}"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'idmint.db'}"
    if kind == "toy":
        return f"toy://{tmp_path / 'toy'}"
    if kind.endswith("-locked"):
        engine = kind.removesuffix("-locked")
        server = request.getfixturevalue(f"{engine}_server" if engine in KV_SERVERS else engine)
        locked: str = server.locked_store_url(name)
        return locked
    if kind in KV_SERVERS:
        kv = request.getfixturevalue(f"{kind}_server")
        kv_url: str = kv.store_url(name)  # a fresh prefix on the shared server
        return kv_url
    server = request.getfixturevalue("postgres" if kind == "postgres" else "mariadb")
    url: str = server.create_database(name)
    return url


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store of every kind, in turn."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture(params=LEASE_STORES)
def lease_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty lease store of every kind, in turn."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture(params=SHARED_LEASE_STORES)
def shared_lease_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty lease store of every kind several processes can share, in turn."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture(params=CAS_STORES)
def cas_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store of every engine, in turn, for its compare-and-set cells."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture(params=SHARED_STORES)
def shared_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store of every kind that several processes can share, in turn."""
    return fresh_store_url(request.param, request, tmp_path)


@pytest.fixture(params=SHARED_SQL_STORES)
def shared_sql_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty SQL store of every kind that several processes can share, in turn."""
    return fresh_store_url(request.param, request, tmp_path)


def aged_sqlite_url(path: Path) -> str:
    """A new SQLite store at `path`, made a minute ago. A store younger than a lease ttl makes
    its first snowflake holder wait until it is a ttl old (it may have lost the leases of an
    earlier life: strategies/snowflake.py); tests about something else need not wait 10 s.
    The tests of that wait use a store made now."""
    url = f"sqlite:///{path}"
    with idmint.connect(url) as minter:
        minter.identity()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE idmint_meta SET created_ms = created_ms - 60000 WHERE name = 'store'")
    return url


@pytest.fixture
def idmint_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A running `idmint serve` on a fresh SQLite store (made a minute ago: aged_sqlite_url)."""
    server = ServerProcess(aged_sqlite_url(tmp_path / "served.db")).start()
    yield server
    server.stop()


def _kv_server(kind: str, certs: Certs) -> Iterator[Any]:
    module = importlib.import_module(f"server_{kind}")
    server = getattr(module, KV_SERVERS[kind])(certs=certs)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_server(certs: Certs) -> Iterator[Any]:
    yield from _kv_server("redis", certs)


@pytest.fixture(scope="session")
def etcd_server(certs: Certs) -> Iterator[Any]:
    yield from _kv_server("etcd", certs)


@pytest.fixture(scope="session")
def zookeeper_server(certs: Certs) -> Iterator[Any]:
    yield from _kv_server("zookeeper", certs)


@pytest.fixture(scope="session")
def cassandra_server(certs: Certs) -> Iterator[Any]:
    yield from _kv_server("cassandra", certs)
