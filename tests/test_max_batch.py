"""A key's batch cap (`max_batch`): kept in the key's row on every store, and added to the
tables older versions made, by processes that may do it at the same time."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

import idmint
from idmint import InvalidArgument, KeyNotFound
from idmint.stores import redact
from idmint.stores.sql import connection as sql_schema
from idmint.stores.sql.connection import TABLE, Dialect, SqlConnection
from idmint.stores.sql.mysql import mysql_dialect
from idmint.stores.sql.postgres import postgres_dialect
from idmint.stores.sql.sqlite import sqlite_dialect

from checks import run_threads


def test_max_batch_is_kept_in_the_key_row(store_url: str) -> None:
    with idmint.connect(store_url) as minter:
        plain = minter.add_key("plain", step=1000)
        assert (plain.max_batch, plain.batch_cap) == (0, 100_000)  # the step x 100
        assert minter.add_key("big", step=1_000_000).batch_cap == 10_000_000  # at most 10M
        capped = minter.add_key("capped", step=10, max_batch=5)
        assert (capped.max_batch, capped.batch_cap) == (5, 5)
        assert minter.set_max_batch("plain", 250).batch_cap == 250
        assert minter.key("plain").max_batch == 250
        assert minter.set_max_batch("capped", 0).batch_cap == 1000  # back to the default
        keys = minter.keys()
        listed = {k.name: k.as_dict() for k in keys}
        assert (listed["plain"]["max_batch"], listed["plain"]["batch_cap"]) == (250, 250)
        with pytest.raises(KeyNotFound):
            minter.set_max_batch("nope", 5)
        for bad in (-1, 10_000_001, True, 1.5):
            with pytest.raises(InvalidArgument, match="max_batch"):
                minter.set_max_batch("plain", bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="max_batch"):
            minter.add_key("never", max_batch=-1)
        with pytest.raises(KeyNotFound):
            minter.key("never")  # refused before anything was created
        # Allocation reads the new column too (one statement with RETURNING on some engines).
        taken = minter.store.allocate("plain", 7)
        assert taken.key.max_batch == 250 and len(taken.range) == 7


def _dialect(url: str) -> Dialect:
    """The SQL dialect of a test store URL, as its engine would make it."""
    scheme = url.split("://", 1)[0]
    if scheme == "sqlite":
        return sqlite_dialect(url, timeout=5.0)
    if scheme in ("postgresql", "postgres"):
        return postgres_dialect(url, redact(url), timeout=5.0)
    return mysql_dialect(url, redact(url), timeout=5.0)


def _old_table(url: str) -> Any:
    """A raw connection to `url` holding idmint_keys as versions before max_batch made it,
    with one key in it."""
    dialect = _dialect(url)
    old = re.sub(r",\s*\n\s*max_batch[^\n]*", "", dialect.schema[0])
    assert "max_batch" not in old and "updated_at" in old
    conn = dialect.connect()
    cur = conn.cursor()
    cur.execute(old)
    # The other tables are there already, as an older version left them: what is raced here
    # is adding the column, not making tables.
    for statement in (*dialect.schema[1:], *getattr(sql_schema, "COMMON_SCHEMA", ())):
        cur.execute(statement)
    p = dialect.param
    cur.execute(
        f"INSERT INTO {TABLE} (name, max_id, step, first_id, last_id, description, updated_at) "
        f"VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {dialect.now})",
        ("old", 500, 100, 1, 2**31 - 1, "made before max_batch"),
    )
    return conn


def test_an_old_table_gains_the_column_from_many_processes_at_once(
    shared_sql_store_url: str,
) -> None:
    _old_table(shared_sql_store_url).close()
    barrier = threading.Barrier(6)
    seen: list[idmint.Key] = []

    def connect_and_read() -> None:
        # Each its own store, so its own connection: to the database, another process.
        minter = idmint.connect(shared_sql_store_url, timeout=10)
        try:
            barrier.wait(10)
            seen.append(minter.key("old"))
        finally:
            minter.close()

    run_threads(connect_and_read, 6)
    assert [(k.max_id, k.max_batch, k.batch_cap) for k in seen] == [(500, 0, 10_000)] * 6
    with idmint.connect(shared_sql_store_url) as minter:
        assert minter.set_max_batch("old", 42).max_batch == 42
        assert minter.take("old", 3) == idmint.Range(500, 503)


def test_adding_the_column_survives_losing_the_race(shared_sql_store_url: str) -> None:
    # The other process adds the column between our look and our ALTER TABLE: ours fails
    # ("duplicate column") and the connection goes on, finding the column there.
    other = _old_table(shared_sql_store_url)
    dialect = _dialect(shared_sql_store_url)
    conn = dialect.connect()

    class Raced:
        def __init__(self, cur: Any) -> None:
            self.cur = cur
            self.lost = False

        def execute(self, sql: str, *args: Any) -> Any:
            if sql.startswith("ALTER TABLE") and not self.lost:
                self.lost = True
                other.cursor().execute(sql)  # the other process wins
            return self.cur.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.cur, name)

    try:
        raced = Raced(conn.cursor())
        SqlConnection._add_columns(raced)
        assert raced.lost
        SqlConnection._add_columns(conn.cursor())  # and again: nothing to do
    finally:
        conn.close()
        other.close()
    with idmint.connect(shared_sql_store_url) as minter:
        assert minter.key("old").max_batch == 0
