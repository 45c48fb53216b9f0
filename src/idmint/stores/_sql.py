"""The range store for SQL engines; each engine's module supplies a small `Dialect`.

Every connection runs in autocommit mode and each operation is one explicit transaction
(`BEGIN ... COMMIT`), so the code path is the same on every engine. One connection per store
object, used under a lock: allocations are rare (one per range), so there is nothing to gain
from a pool, and one connection keeps the number of server sessions predictable.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from .._errors import IdmintError, KeyExists, KeyNotFound, StoreUnavailable
from .._fork import ForkAware, orphan
from ..ids import Allocation, Key, Range, next_range, raised_floor
from .base import StoreIdentity

T = TypeVar("T")

TABLE = "idmint_keys"
INSERT_COLUMNS = "name, max_id, step, first_id, last_id, description, updated_at"
COLUMNS = INSERT_COLUMNS + ", max_batch"

# Columns added after a table may have been made: (table, column, definition). A table made by
# an older version gains each missing one when a connection is made (see _add_columns).
ADDED_COLUMNS = ((TABLE, "max_batch", "BIGINT NOT NULL DEFAULT 0"),)

# Written with the schema, on every engine: the store's identity (see StoreIdentity), and the
# worker ids reserved for static holders. Plain types every engine reads the same way.
META_TABLE = "idmint_meta"
RESERVED_TABLE = "idmint_reserved_workers"
COMMON_SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS {META_TABLE} (
    name       VARCHAR(64)  NOT NULL PRIMARY KEY,
    value      VARCHAR(255) NOT NULL,
    created_ms BIGINT       NOT NULL
)""",
    f"""CREATE TABLE IF NOT EXISTS {RESERVED_TABLE} (
    namespace VARCHAR(128) NOT NULL,
    worker_id INTEGER      NOT NULL,
    PRIMARY KEY (namespace, worker_id)
)""",
)


@dataclass(frozen=True)
class Dialect:
    """What differs between SQL engines; the statements themselves are shared."""

    connect: Callable[[], Any]
    #: CREATE TABLE IF NOT EXISTS statements, run on every new connection.
    schema: Sequence[str]
    #: SQL expression for the store's current time in Unix milliseconds (lease expiry).
    now_ms: str
    #: Statement that opens a transaction holding the row locks we need.
    begin: str = "BEGIN"
    #: Suffix that locks the selected row until commit ("" where `begin` already locks).
    for_update: str = " FOR UPDATE"
    #: SQL expression for the current UTC time.
    now: str = "CURRENT_TIMESTAMP"
    #: The driver's parameter marker; statements are written with "?" and translated.
    param: str = "?"
    #: Driver exceptions that mean "cannot reach or use the store now" (connection lost,
    #: server shutting down, lock wait timeout): reported as StoreUnavailable.
    unavailable: tuple[type[BaseException], ...] = ()
    #: Driver exceptions raised by a duplicate primary key.
    duplicate: tuple[type[BaseException], ...] = ()
    #: Statements run once on every new connection.
    on_connect: Sequence[str] = ()
    #: The engine's two-argument maximum.
    greatest: str = "GREATEST"
    #: UPDATE ... RETURNING: then a whole range is taken in one statement, one round trip
    #: (see SqlRangeStore.allocate).
    returning: bool = False
    #: Removes the URL's secrets from a driver's message (see stores._urls.scrub). It holds
    #: the URL: not in the repr, which a debugger or an error tracker may show.
    scrub: Callable[[str], str] = field(default=str, repr=False)


def _as_datetime(value: object) -> datetime | None:
    """Normalise the engines' timestamps (aware, naive-UTC or ISO text) to aware UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


class SqlConnection(ForkAware):
    """One connection, used under a lock, made again after a failure; every operation one
    transaction (or one statement), driver errors mapped to idmint's."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        self.display_url = display_url
        self._dialect = dialect
        self._lock = threading.Lock()
        self._conn: Any = None
        self._identity: StoreIdentity | None = None  # read on every new connection
        self._closed = False
        self._watch_fork()

    def _after_fork(self) -> None:
        # The parent's socket (or SQLite handle) is not ours: make our own on the next call.
        self._lock = threading.Lock()
        orphan(self._conn)
        self._conn = None

    def close(self) -> None:
        self._closed = True
        # A call stuck on a hung store holds the lock: leave the connection to it (it fails
        # when its own deadline passes) rather than wait.
        if self._lock.acquire(timeout=0.5):
            try:
                self._drop_connection()
            finally:
                self._lock.release()

    # -- connection handling ---------------------------------------------------------------

    def _cursor(self) -> Any:
        if self._closed:
            raise StoreUnavailable(f"store {self.display_url} is closed")
        if self._conn is None:
            conn = self._dialect.connect()
            try:
                cur = conn.cursor()
                for statement in self._dialect.on_connect:
                    cur.execute(statement)
                # PostgreSQL's CREATE TABLE IF NOT EXISTS can lose a race with another process
                # creating the same table; the table is there, which is the goal.
                for statement in (*self._dialect.schema, *COMMON_SCHEMA):
                    with contextlib.suppress(*self._dialect.duplicate):
                        cur.execute(statement)
                self._add_columns(cur)
                self._identity = self._read_identity(cur)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn.cursor()

    @staticmethod
    def _add_columns(cur: Any) -> None:
        """Add the ADDED_COLUMNS a table lacks. Generic (the columns a query returns, then a
        plain ALTER TABLE ADD COLUMN) and race-safe: of two processes adding a column at once,
        one fails ("duplicate column") and succeeds by finding the column there."""

        def columns(table: str) -> set[str]:
            cur.execute(f"SELECT * FROM {table} WHERE 1 = 0")
            cur.fetchall()
            return {str(d[0]).lower() for d in cur.description}

        for table, column, definition in ADDED_COLUMNS:
            if column in columns(table):
                continue
            try:
                cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            except Exception:
                if column not in columns(table):  # not the race: a real failure
                    raise

    def _read_identity(self, cur: Any) -> StoreIdentity:
        """The store's identity, made by the first connection ever (the others lose the race
        to insert it, and read the winner's)."""
        p = self._dialect.param
        select = f"SELECT value, created_ms FROM {META_TABLE} WHERE name = {p}"
        cur.execute(select, ("store",))
        row = cur.fetchone()
        if row is None:
            with contextlib.suppress(*self._dialect.duplicate):
                cur.execute(
                    f"INSERT INTO {META_TABLE} (name, value, created_ms) "
                    f"VALUES ({p}, {p}, {self._dialect.now_ms})",
                    ("store", uuid.uuid4().hex),
                )
            cur.execute(select, ("store",))
            row = cur.fetchone()
        return StoreIdentity(str(row[0]), int(row[1]))

    def identity(self) -> StoreIdentity | None:
        """The store's identity, as read by the current connection (connecting if needed)."""
        self._run(lambda cur: None, transaction=False)
        return self._identity

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken: closing is best effort
                conn.close()

    def _run(self, body: Callable[[Any], T], *, transaction: bool = True) -> T:
        """Run `body(cursor)` in one transaction; map driver errors to idmint's."""
        self._check_fork()
        with self._lock:
            try:
                cur = self._cursor()
                if not transaction:
                    return body(cur)
                cur.execute(self._dialect.begin)
                try:
                    result = body(cur)
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                # If COMMIT fails the outcome is unknown: the caller gets an error and the
                # result (a range, say) is dropped, never served.
                cur.execute("COMMIT")
                return result
            except IdmintError:
                raise
            except self._dialect.duplicate:
                raise
            except self._dialect.unavailable as exc:
                self._drop_connection()
                why = self._dialect.scrub(_one_line(exc))
                raise StoreUnavailable(f"store {self.display_url} unavailable: {why}") from exc


class SqlRangeStore(SqlConnection):
    """A RangeStore on a table of keys, one row per key (see docs/stores.md)."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        super().__init__(dialect, display_url)
        p = dialect.param
        now = dialect.now
        self._select = f"SELECT {COLUMNS} FROM {TABLE} WHERE name = {p}"
        self._select_locked = self._select + dialect.for_update
        self._select_all = f"SELECT {COLUMNS} FROM {TABLE} ORDER BY name"
        self._insert = (
            f"INSERT INTO {TABLE} ({INSERT_COLUMNS}) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {now})"
        )
        self._set_max_batch = (
            f"UPDATE {TABLE} SET max_batch = {p}, updated_at = {now} WHERE name = {p}"
        )
        self._set_max = f"UPDATE {TABLE} SET max_id = {p}, updated_at = {now} WHERE name = {p}"
        self._set_floor = (
            f"UPDATE {TABLE} SET first_id = {p}, max_id = {p}, updated_at = {now} WHERE name = {p}"
        )
        g = dialect.greatest
        # Takes a whole range or nothing; written so no expression can overflow a BIGINT.
        self._take_whole = dialect.returning and (
            f"UPDATE {TABLE} SET max_id = {g}(max_id, first_id) + COALESCE({p}, step), "
            f"updated_at = {now} WHERE name = {p} "
            f"AND COALESCE({p}, step) <= last_id + 1 - {g}(max_id, first_id) RETURNING {COLUMNS}"
        )
        self._give_back = (
            f"UPDATE {TABLE} SET max_id = {p}, updated_at = {now} "
            f"WHERE name = {p} AND max_id = {p} AND first_id <= {p}"
        )

    def _key(self, cur: Any, name: str, *, lock: bool) -> Key:
        cur.execute(self._select_locked if lock else self._select, (name,))
        row = cur.fetchone()
        if row is None:
            raise KeyNotFound(name)
        return _row_to_key(row)

    # -- the RangeStore protocol -------------------------------------------------------------

    def init(self) -> None:
        self._run(lambda cur: None, transaction=False)  # connecting creates the table

    def add_key(
        self, name: str, *, step: int, first_id: int, last_id: int, description: str = ""
    ) -> Key:
        def body(cur: Any) -> Key:
            cur.execute(self._insert, (name, first_id, step, first_id, last_id, description))
            return self._key(cur, name, lock=False)

        try:
            return self._run(body)
        except self._dialect.duplicate as exc:
            raise KeyExists(name) from exc

    def get_key(self, name: str) -> Key:
        return self._run(lambda cur: self._key(cur, name, lock=False), transaction=False)

    def list_keys(self) -> list[Key]:
        def body(cur: Any) -> list[Key]:
            cur.execute(self._select_all)
            return [_row_to_key(row) for row in cur.fetchall()]

        return self._run(body, transaction=False)

    def allocate(self, name: str, count: int | None = None) -> Allocation:
        if self._take_whole:
            # One statement, atomic on its own: the row lock is held for one round trip.
            def take_whole(cur: Any) -> Any:
                cur.execute(self._take_whole, (count, name, count))
                return cur.fetchone()

            row = self._run(take_whole, transaction=False)
            if row is not None:
                key = _row_to_key(row)
                size = key.step if count is None else count
                return Allocation(Range(key.max_id - size, key.max_id), key)
            # No row: an unknown key, or fewer ids left than a whole range. The transaction
            # below tells which, and clamps the range of a bounded key at its end.

        def body(cur: Any) -> Allocation:
            taken = next_range(self._key(cur, name, lock=True), count)
            cur.execute(self._set_max, (taken.stop, name))
            return Allocation(taken, self._key(cur, name, lock=False))

        return self._run(body)

    def give_back(self, name: str, unused: Range) -> bool:
        if not unused:
            return False

        def body(cur: Any) -> bool:
            cur.execute(self._give_back, (unused.start, name, unused.stop, unused.start))
            return bool(cur.rowcount == 1)

        return self._run(body)

    def raise_floor(self, name: str, to: int) -> Key:
        def body(cur: Any) -> Key:
            first_id, max_id = raised_floor(self._key(cur, name, lock=True), to)
            cur.execute(self._set_floor, (first_id, max_id, name))
            return self._key(cur, name, lock=False)

        return self._run(body)

    def set_max_batch(self, name: str, max_batch: int) -> Key:
        """Set the most ids one request may take over HTTP (0: the default rule)."""

        def body(cur: Any) -> Key:
            self._key(cur, name, lock=True)  # KeyNotFound
            cur.execute(self._set_max_batch, (max_batch, name))
            return self._key(cur, name, lock=False)

        return self._run(body)


def _row_to_key(row: Sequence[Any]) -> Key:
    name, max_id, step, first_id, last_id, description, updated_at, max_batch = row
    return Key(
        name=str(name),
        max_id=int(max_id),
        step=int(step),
        first_id=int(first_id),
        last_id=int(last_id),
        description=str(description or ""),
        updated_at=_as_datetime(updated_at),
        max_batch=int(max_batch),
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
