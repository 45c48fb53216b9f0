"""The SQL engines' two small tables, made with the rest of the schema; every change one
conditional UPDATE, atomic and committed before it answers.

- Compare-and-set cells (name, value, version) for the generic strategies: a swap is
  `WHERE version = ?`, the version column standing in for the versions the key-value engines
  keep themselves. Segment keys on SQL use the one-statement allocation of sql/ranges.py
  instead (faster: no lost swaps, one round trip).
- A quorum node's counters (name, counter): a claim is `WHERE counter < start`; the first
  claim of a key inserts its row instead. Its replication (`replication()`, from the
  connection) is checked by the strategy: quorum nodes must be independent.
"""

from __future__ import annotations

from typing import Any

from ..._errors import StoreUnavailable
from .connection import CELLS_TABLE, QUORUM_TABLE, Dialect, SqlConnection, _text


class SqlCasStore(SqlConnection):
    """A CasStore on the idmint_cells table."""

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
            return self._run(body, transaction=False, write=True)
        except self._dialect.duplicate:
            return False

    def swap(self, key: str, version: int, value: str) -> bool:
        def body(cur: Any) -> bool:
            cur.execute(self._swap, (value, key, version))
            done = bool(cur.rowcount == 1)
            if done:
                self._confirm_write(cur)
            return done

        return self._run(body, transaction=False, write=True)

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        def body(cur: Any) -> list[tuple[str, str]]:
            cur.execute(self._scan, (prefix,))
            found = ((_text(name), str(value)) for name, value in cur.fetchall())
            return sorted((name, value) for name, value in found if name.startswith(prefix))

        return self._run(body, transaction=False)


class SqlQuorumNode(SqlConnection):
    """QuorumNode on the idmint_quorum table."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        super().__init__(dialect, display_url)
        p = dialect.param
        self._read = f"SELECT counter FROM {QUORUM_TABLE} WHERE name = {p}"
        self._raise = f"UPDATE {QUORUM_TABLE} SET counter = {p} WHERE name = {p} AND counter < {p}"
        self._insert = f"INSERT INTO {QUORUM_TABLE} (name, counter) VALUES ({p}, {p})"

    def read(self, key: str) -> int:
        def body(cur: Any) -> int:
            cur.execute(self._read, (key,))
            row = cur.fetchone()
            return 0 if row is None else int(row[0])

        return self._run(body, transaction=False)

    def claim(self, key: str, start: int, end: int) -> tuple[bool, int]:
        def raise_or_read(cur: Any) -> int | None:
            cur.execute(self._raise, (end, key, start))
            if cur.rowcount == 1:
                # Confirmed as a swap is: a claim is acknowledged only once the replicas its
                # commit waits for have it (MySQL's semi-synchronous replication may fall
                # back to asynchronous), else a failover could take it back.
                self._confirm_write(cur)
                return None
            cur.execute(self._read, (key,))
            row = cur.fetchone()
            return -1 if row is None else int(row[0])

        def insert(cur: Any) -> None:
            cur.execute(self._insert, (key, end))
            self._confirm_write(cur)

        # Between our statements another caller may insert the row: then we go round again.
        # Writes (write=True): the replication is read first, and the replicas idmint waits
        # for itself (PostgreSQL's asynchronous standbys) have a claim before it counts.
        for _ in range(3):
            counter = self._run(raise_or_read, transaction=False, write=True)
            if counter is None:
                return True, end
            if counter >= start:
                return False, counter
            if counter >= 0:
                continue  # the row appeared after the UPDATE, below start
            try:  # no row: the counter is 0, below any start
                self._run(insert, transaction=False, write=True)
            except self._dialect.duplicate:
                continue
            return True, end
        raise StoreUnavailable(f"store {self.display_url}: key {key!r} kept changing")

    def durability(self) -> str | None:
        return self._run(self._dialect.durability, transaction=False)
