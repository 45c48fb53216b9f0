"""A quorum node on the SQL engines: a table of (name, counter), made with the rest of the
schema. A claim is one conditional UPDATE (`WHERE counter < start`), atomic and committed
before it answers; the first claim of a key inserts its row instead.
"""

from __future__ import annotations

from typing import Any

from ..._errors import StoreUnavailable
from .connection import SqlConnection
from .schema import QUORUM_TABLE, Dialect


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
                return None
            cur.execute(self._read, (key,))
            row = cur.fetchone()
            return -1 if row is None else int(row[0])

        # Between our statements another caller may insert the row: then we go round again.
        for _ in range(3):
            counter = self._run(raise_or_read, transaction=False)
            if counter is None:
                return True, end
            if counter >= start:
                return False, counter
            if counter >= 0:
                continue  # the row appeared after the UPDATE, below start
            try:  # no row: the counter is 0, below any start
                self._run(lambda cur: cur.execute(self._insert, (key, end)), transaction=False)
            except self._dialect.duplicate:
                continue
            return True, end
        raise StoreUnavailable(f"store {self.display_url}: key {key!r} kept changing")

    def durability(self) -> str | None:
        return self._run(self._dialect.durability, transaction=False)
