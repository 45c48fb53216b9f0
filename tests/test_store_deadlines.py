"""Every store call has a deadline.

A hung store (its server SIGSTOPped: the kernel still acknowledges every packet, so the sockets
stay open and no TCP timeout fires) must give `StoreUnavailable` within about the store timeout,
on a connection made before the pause and on one made during it, and work again once the server
resumes. So must a call that waits on a row lock held by a stuck client.

Each test that pauses a server starts its own, so no other test sees it hang.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pymysql
import pytest

from idmint import IdmintError
from idmint.stores import open_engine, open_lease_store, open_store
from idmint.stores.base import Lease, LeaseStore, RangeStore

from checks import assert_within_bound, works
from servers import MariaDBServer, PostgresServer, wait_until

TIMEOUT = 1.0
# What a call may take: the store timeout plus what each engine adds (PostgreSQL: the client
# waits 1 s longer than the server's own timeouts, and libpq connects in whole seconds, at least
# 2; MariaDB: lock waits count whole seconds, and the client waits 1 s longer), plus room for a
# loaded machine.
BOUND = TIMEOUT + 3.0
NOW = 1_800_000_000_000
KV_SERVERS = {"redis": "RedisServer", "etcd": "EtcdServer", "zookeeper": "ZooKeeperServer"}


# -- a hung server -----------------------------------------------------------------------------


@pytest.fixture(params=["postgres", "mariadb"])
def private_sql_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    server = PostgresServer() if request.param == "postgres" else MariaDBServer()
    server.start()
    yield server
    server.resume()
    server.close()


def test_sql_calls_end_on_a_paused_server(private_sql_server: Any) -> None:
    server = private_sql_server
    url = server.create_database("hung")
    ranges = open_store(url, timeout=TIMEOUT)
    leases = open_lease_store(url, timeout=TIMEOUT)
    ranges.add_key("k", step=10, first_id=1, last_id=10**12)
    lease = leases.acquire("ns", workers=8, ttl=60, horizon_ms=NOW)
    later_ranges: list[RangeStore] = []
    later_leases: list[LeaseStore] = []

    def new_ranges() -> RangeStore:
        later_ranges.append(store := open_store(url, timeout=TIMEOUT))
        return store

    def new_leases() -> LeaseStore:
        later_leases.append(store := open_lease_store(url, timeout=TIMEOUT))
        return store

    server.pause()
    try:
        assert_within_bound(
            BOUND,
            {
                "allocate, connected before": lambda: ranges.allocate("k"),
                "renew, connected before": lambda: leases.renew(lease, NOW + 1),
                "allocate, connecting during": lambda: new_ranges().allocate("k"),
                "acquire, connecting during": lambda: new_leases().acquire(
                    "ns", workers=8, ttl=60, horizon_ms=NOW
                ),
            },
        )
    finally:
        server.resume()
    # Every store object works again, without being made anew.
    for range_store in (ranges, *later_ranges):
        wait_until(functools.partial(works, range_store.allocate, "k"), 15, "allocate again")
    for lease_store in (leases, *later_leases):
        wait_until(functools.partial(works, lease_store.holders, "ns"), 15, "holders again")
    assert leases.acquire("ns", workers=8, ttl=60, horizon_ms=NOW).worker_id != lease.worker_id
    for range_store in (ranges, *later_ranges):
        range_store.close()
    for lease_store in (leases, *later_leases):
        lease_store.close()


@pytest.fixture(params=sorted(KV_SERVERS))
def private_kv_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    module = importlib.import_module(f"server_{request.param}")
    server = getattr(module, KV_SERVERS[request.param])()
    server.start()
    yield server
    server.resume()
    server.close()


def test_kv_calls_end_on_a_paused_server(private_kv_server: Any) -> None:
    """Leases and compare-and-set cells (each on its own engine: ZooKeeper's cells share a
    session with the lease store's reads)."""
    server = private_kv_server
    url = server.store_url("hung")
    store = open_lease_store(url, timeout=TIMEOUT)
    lease = store.acquire("ns", workers=8, ttl=60, horizon_ms=NOW)
    other = store.acquire("ns", workers=8, ttl=60, horizon_ms=NOW)
    store.holders("ns")
    newcomer = open_lease_store(url, timeout=TIMEOUT)
    engines = [open_engine(url, timeout=TIMEOUT) for _ in range(2)]
    cells, new_cells = (engine.cas() for engine in engines)
    cells.create("c", "v")
    _, version = cells.read("c") or ("", -1)
    cells.scan("")
    server.pause()
    try:
        assert_within_bound(
            BOUND,
            {
                "renew, connected before": lambda: store.renew(lease, NOW + 1),
                "holders, connected before": lambda: store.holders("ns"),
                "release, connected before": lambda: store.release(other),
                "acquire, connecting during": lambda: newcomer.acquire(
                    "ns", workers=8, ttl=60, horizon_ms=NOW
                ),
                "cas read, connected before": lambda: cells.read("c"),
                "cas swap, connected before": lambda: cells.swap("c", version, "w"),
                "cas scan, connected before": lambda: cells.scan(""),
                "cas create, connecting during": lambda: new_cells.create("d", "v"),
            },
        )
    finally:
        server.resume()
    for each in (store, newcomer):
        wait_until(functools.partial(works, each.holders, "ns"), 15, "holders again")
    for cas in (cells, new_cells):
        wait_until(functools.partial(works, cas.read, "c"), 15, "cas read again")
    # The swap's outcome was unknown: it may have been applied when the server resumed.
    value, version = cells.read("c") or ("", -1)
    assert value in ("v", "w")
    assert new_cells.swap("c", version, "x") is True
    assert cells.read("c") == new_cells.read("c")
    for engine in engines:
        engine.close()
    taken: list[Lease] = []

    def acquire() -> None:
        taken.append(newcomer.acquire("ns", workers=8, ttl=60, horizon_ms=NOW))

    wait_until(functools.partial(works, acquire), 15, "acquire again")
    # Leave nothing behind: a ZooKeeper lease's session (and its threads) outlives the store.
    for holder, held in ((store, lease), (store, other), (newcomer, taken[0])):
        with contextlib.suppress(IdmintError):
            holder.release(held)
    store.close()
    newcomer.close()


# -- a row lock held by a stuck client ----------------------------------------------------------


def test_postgres_allocate_gives_up_on_a_locked_row(postgres: PostgresServer) -> None:
    url = postgres.create_database("locked_row")
    store = open_store(url, timeout=TIMEOUT)
    store.add_key("k", step=10, first_id=1, last_id=10**12)
    with psycopg.connect(url) as holder:  # a transaction, left open: its process is stuck
        holder.execute("SELECT * FROM idmint_keys WHERE name = 'k' FOR UPDATE")
        assert_within_bound(BOUND, {"allocate": lambda: store.allocate("k")})
        assert_within_bound(BOUND, {"allocate a count": lambda: store.allocate("k", 5)})
        holder.rollback()
    assert store.allocate("k").range.start == 1  # nothing was taken meanwhile
    store.close()


def test_mariadb_allocate_gives_up_on_a_locked_row(mariadb: MariaDBServer) -> None:
    url = mariadb.create_database("locked_row")
    store = open_store(url, timeout=TIMEOUT)
    store.add_key("k", step=10, first_id=1, last_id=10**12)
    holder = pymysql.connect(
        host="127.0.0.1", port=mariadb.port, user="root", database="locked_row"
    )
    try:
        with holder.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute("SELECT * FROM idmint_keys WHERE name = 'k' FOR UPDATE")
            assert_within_bound(BOUND, {"allocate": lambda: store.allocate("k")})
            cur.execute("ROLLBACK")
    finally:
        holder.close()
    assert store.allocate("k").range.start == 1
    store.close()
