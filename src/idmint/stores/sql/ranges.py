"""Segment keys on the SQL engines: one row per key, one statement per range where the engine
allows (see SqlRangeStore.allocate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._errors import KeyExists, KeyNotFound
from ...ids import (
    ID_MAX,
    MAX_STRIPES,
    Allocation,
    Key,
    Range,
    check_stripe,
    next_range,
    raised_floor,
    stripe_row,
)
from ..over_cas.ranges import with_stripes
from .connection import (
    COLUMNS,
    INSERT_COLUMNS,
    STRIPE_COLUMNS,
    STRIPES_TABLE,
    TABLE,
    Dialect,
    SqlConnection,
    _as_datetime,
)


class _Counter:
    """The statements on one table of counters: the keys table (stripe 0) or the stripes
    table (stripes 1 to n - 1), told apart by `where`."""

    def __init__(self, dialect: Dialect, table: str, columns: str, where: str) -> None:
        p, now, g = dialect.param, dialect.now, dialect.greatest
        stamp = f", updated_at = {now}" if table == TABLE else ""
        self.select = f"SELECT {columns} FROM {table} WHERE {where}"
        self.select_locked = self.select + dialect.for_update
        self.set_max = f"UPDATE {table} SET max_id = {p}{stamp} WHERE {where}"
        self.set_floor = f"UPDATE {table} SET first_id = {p}, max_id = {p}{stamp} WHERE {where}"
        # Takes a whole range or nothing: `count` ids (the step when NULL), `stripes` apart.
        # Written so no expression can overflow a BIGINT (allocate keeps count small enough).
        self.take_whole = dialect.returning and (
            f"UPDATE {table} SET max_id = {g}(max_id, first_id) + COALESCE({p}, step) * stripes"
            f"{stamp} WHERE {where} AND (COALESCE({p}, step) - 1) * stripes <= "
            f"last_id - {g}(max_id, first_id) RETURNING {columns}"
        )
        self.give_back = (
            f"UPDATE {table} SET max_id = {p}{stamp} "
            f"WHERE {where} AND max_id = {p} AND first_id <= {p}"
        )


class SqlRangeStore(SqlConnection):
    """A RangeStore on a table of keys, one row per key, and a table of the stripes of
    striped keys, one row per stripe after the first (see docs/stores.md)."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        super().__init__(dialect, display_url)
        p = dialect.param
        now = dialect.now
        self._keys = _Counter(dialect, TABLE, COLUMNS, f"name = {p}")
        self._stripes = _Counter(
            dialect, STRIPES_TABLE, STRIPE_COLUMNS, f"name = {p} AND stripe = {p}"
        )
        self._select_stripes = (
            f"SELECT {STRIPE_COLUMNS} FROM {STRIPES_TABLE} WHERE name = {p} ORDER BY stripe"
        )
        self._lock_stripes = self._select_stripes + dialect.for_update
        self._select_all = f"SELECT {COLUMNS} FROM {TABLE} ORDER BY name"
        self._select_all_stripes = f"SELECT {STRIPE_COLUMNS} FROM {STRIPES_TABLE}"
        self._insert = (
            f"INSERT INTO {TABLE} ({INSERT_COLUMNS}) "
            f"VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {now}, {p})"
        )
        self._insert_stripe = (
            f"INSERT INTO {STRIPES_TABLE} ({STRIPE_COLUMNS}) "
            f"VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p})"
        )
        self._set_max_batch = (
            f"UPDATE {TABLE} SET max_batch = {p}, updated_at = {now} WHERE name = {p}"
        )

    def _counter(self, name: str, stripe: int) -> tuple[_Counter, tuple[object, ...]]:
        """The statements of a stripe's row, and the parameters of their WHERE clause."""
        return (self._keys, (name,)) if stripe == 0 else (self._stripes, (name, stripe))

    def _row(self, cur: Any, name: str, stripe: int = 0, *, lock: bool = False) -> Key:
        """A stripe's row (the key's own for stripe 0). Raises KeyNotFound, or
        InvalidArgument for a stripe the key does not have."""
        counter, where = self._counter(name, stripe)
        cur.execute(counter.select_locked if lock else counter.select, where)
        row = cur.fetchone()
        if row is not None:
            return _row_to_key(row) if stripe == 0 else _stripe_to_key(row)
        if stripe != 0:
            check_stripe(stripe, self._row(cur, name).stripes)
        raise KeyNotFound(name)

    def _key(self, cur: Any, name: str, *, lock: bool = False) -> Key:
        """The key's row with every stripe's next id."""
        key = self._row(cur, name, lock=lock)
        if key.stripes == 1:
            return key
        cur.execute(self._lock_stripes if lock else self._select_stripes, (name,))
        return with_stripes(key, [key, *map(_stripe_to_key, cur.fetchall())])

    # -- the RangeStore protocol -------------------------------------------------------------

    def add_key(
        self,
        name: str,
        *,
        step: int,
        first_id: int,
        last_id: int,
        description: str = "",
        stripes: int = 1,
    ) -> Key:
        def body(cur: Any) -> Key:
            cur.execute(
                self._insert, (name, first_id, step, first_id, last_id, description, stripes)
            )
            key = self._row(cur, name)
            for stripe in range(1, stripes):
                row = stripe_row(key, stripe)
                cur.execute(
                    self._insert_stripe,
                    (name, row.max_id, step, row.first_id, last_id, stripes, stripe),
                )
            return self._key(cur, name)

        try:
            return self._run(body)
        except self._dialect.duplicate as exc:
            raise KeyExists(name) from exc

    def get_key(self, name: str) -> Key:
        return self._run(lambda cur: self._key(cur, name), transaction=False)

    def list_keys(self) -> list[Key]:
        def body(cur: Any) -> list[Key]:
            cur.execute(self._select_all)
            keys = [_row_to_key(row) for row in cur.fetchall()]
            if not any(key.stripes > 1 for key in keys):
                return keys
            cur.execute(self._select_all_stripes)
            stripes: dict[str, list[Key]] = {}
            for row in sorted(map(_stripe_to_key, cur.fetchall()), key=lambda r: r.stripe):
                stripes.setdefault(row.name, []).append(row)
            return [
                with_stripes(key, [key, *stripes.get(key.name, [])]) if key.stripes > 1 else key
                for key in keys
            ]

        return self._run(body, transaction=False)

    def allocate(
        self, name: str, count: int | None = None, *, stripe: int | None = None
    ) -> Allocation:
        stripe = stripe or 0  # a row lock queues writers: any stripe does, so the key's own
        counter, where = self._counter(name, stripe)
        if counter.take_whole and (count is None or count <= ID_MAX // MAX_STRIPES):
            # One statement, atomic on its own: the row lock is held for one round trip.
            def take_whole(cur: Any) -> Any:
                cur.execute(counter.take_whole, (count, *where, count))
                return cur.fetchone()

            row = self._run(take_whole, transaction=False, write=True)
            if row is not None:
                key = _row_to_key(row) if stripe == 0 else _stripe_to_key(row)
                size = key.step if count is None else count
                return Allocation(
                    Range(key.max_id - size * key.stripes, key.max_id, key.stripes), key
                )
            # No row: an unknown key or stripe, or fewer ids left than a whole range. The
            # transaction below tells which, and clamps the range at the key's end.

        def body(cur: Any) -> Allocation:
            taken = next_range(self._row(cur, name, stripe, lock=True), count)
            cur.execute(counter.set_max, (taken.stop, *where))
            return Allocation(taken, self._row(cur, name, stripe))

        return self._run(body)

    def give_back(self, name: str, unused: Range) -> bool:
        if not unused:
            return False

        def body(cur: Any) -> bool:
            stripe = 0
            if unused.stride > 1:  # which stripe: the one whose ids it holds
                key = self._row(cur, name)
                if key.stripes != unused.stride:
                    return False
                stripe = (unused.start - key.first_id) % key.stripes
            counter, where = self._counter(name, stripe)
            cur.execute(counter.give_back, (unused.start, *where, unused.stop, unused.start))
            return bool(cur.rowcount == 1)

        try:
            return self._run(body)
        except KeyNotFound:
            return False

    def raise_floor(self, name: str, to: int) -> Key:
        def body(cur: Any) -> Key:
            key = self._key(cur, name, lock=True)
            raised_floor(key, to)  # InvalidArgument before anything moves
            for stripe in range(key.stripes):
                row = self._row(cur, name, stripe)
                first_id, max_id = raised_floor(row, to)
                counter, where = self._counter(name, stripe)
                cur.execute(counter.set_floor, (first_id, max_id, *where))
            return self._key(cur, name)

        return self._run(body)

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        def body(cur: Any) -> Key:
            self._row(cur, name, lock=True)  # KeyNotFound
            cur.execute(self._set_max_batch, (max_batch, name))
            return self._key(cur, name)

        return self._run(body)


def _row_to_key(row: Sequence[Any]) -> Key:
    name, max_id, step, first_id, last_id, description, updated_at, stripes, max_batch = row
    return Key(
        name=str(name),
        max_id=int(max_id),
        step=int(step),
        first_id=int(first_id),
        last_id=int(last_id),
        description=str(description or ""),
        updated_at=_as_datetime(updated_at),
        max_batch=int(max_batch),
        stripes=int(stripes),
    )


def _stripe_to_key(row: Sequence[Any]) -> Key:
    name, max_id, step, first_id, last_id, stripes, stripe = row
    return Key(
        name=str(name),
        max_id=int(max_id),
        step=int(step),
        first_id=int(first_id),
        last_id=int(last_id),
        stripes=int(stripes),
        stripe=int(stripe),
    )
