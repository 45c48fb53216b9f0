"""Compare-and-set cells on the SQL engines: a table of (name, value, version).

A swap is one conditional UPDATE (`WHERE version = ?`), atomic and committed before it
answers on every engine; the version column stands in for the versions the key-value engines
keep themselves. Segment keys on SQL use the one-statement allocation of sql/ranges.py instead (it
is faster: no lost swaps, one round trip); these cells serve the generic strategies.
"""

from __future__ import annotations

from typing import Any

from .connection import SqlConnection
from .schema import CELLS_TABLE, Dialect


class SqlCasStore(SqlConnection):
    """A CasStore on the idmint_cells table (made with the rest of the schema)."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        super().__init__(dialect, display_url)
        p = dialect.param
        self._read = f"SELECT value, version FROM {CELLS_TABLE} WHERE name = {p}"
        self._create = f"INSERT INTO {CELLS_TABLE} (name, value, version) VALUES ({p}, {p}, 1)"
        self._swap = (
            f"UPDATE {CELLS_TABLE} SET value = {p}, version = version + 1 "
            f"WHERE name = {p} AND version = {p}"
        )
        # Prefixes are matched in Python: LIKE treats "_" as a wildcard, and a MySQL table's
        # collation may ignore case.
        self._scan = f"SELECT name, value FROM {CELLS_TABLE} WHERE name >= {p}"

    def init(self) -> None:
        self._run(lambda cur: None, transaction=False)  # connecting creates the table

    def read(self, key: str) -> tuple[str, int] | None:
        def body(cur: Any) -> tuple[str, int] | None:
            cur.execute(self._read, (key,))
            row = cur.fetchone()
            return None if row is None else (str(row[0]), int(row[1]))

        return self._run(body, transaction=False)

    def create(self, key: str, value: str) -> bool:
        def body(cur: Any) -> bool:
            cur.execute(self._create, (key, value))
            self._confirm_write(cur)
            return True

        try:
            return self._run(body, transaction=False)
        except self._dialect.duplicate:
            return False

    def swap(self, key: str, version: int, value: str) -> bool:
        def body(cur: Any) -> bool:
            cur.execute(self._swap, (value, key, version))
            done = bool(cur.rowcount == 1)
            if done:
                self._confirm_write(cur)
            return done

        return self._run(body, transaction=False)

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        def body(cur: Any) -> list[tuple[str, str]]:
            cur.execute(self._scan, (prefix,))
            found = ((_text(name), str(value)) for name, value in cur.fetchall())
            return sorted((name, value) for name, value in found if name.startswith(prefix))

        return self._run(body, transaction=False)


def _text(name: Any) -> str:
    """A cell name as read: MySQL's (a byte string column, see mysql.py) comes as bytes."""
    return name.decode() if isinstance(name, bytes | bytearray) else str(name)
