"""The SQL engines' schema, the `Dialect` each engine's module supplies (what differs between
engines; the statements are shared), and `SqlConnection`: one connection per store object,
used under a lock, made again after a failure. Every connection runs in autocommit mode and
each operation is one explicit transaction (`BEGIN ... COMMIT`), so the code path is the same
on every engine. No pool: allocations are rare (one per range), and one connection keeps the
number of server sessions predictable.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..._errors import IdmintError, InvalidArgument, StoreUnavailable
from ..._fork import ForkAware, orphan
from ...ids import is_digits
from .. import fences
from .._once import Once
from ..base import StoreIdentity
from ..replication import FAILOVER_GAP, REPLICA, ReplicationState, note_failover

TABLE = "idmint_keys"
INSERT_COLUMNS = "name, max_id, step, first_id, last_id, description, updated_at, stripes"
COLUMNS = INSERT_COLUMNS + ", max_batch"

# Stripes 1 to n - 1 of a striped key (stripe 0 is the key's own row): the same counter
# columns, so one allocation statement serves both tables.
STRIPES_TABLE = "idmint_stripes"
STRIPE_COLUMNS = "name, max_id, step, first_id, last_id, stripes, stripe"

CELLS_TABLE = "idmint_cells"  # compare-and-set cells (sql/cells.py)
QUORUM_TABLE = "idmint_quorum"  # quorum keys' counters on a quorum node (sql/cells.py)

# Columns added after a table may have been made: (table, column, definition). A table made by
# an older version gains each missing one when a connection is made (see _add_columns).
ADDED_COLUMNS = (
    (TABLE, "max_batch", "BIGINT NOT NULL DEFAULT 0"),
    (TABLE, "stripes", "INTEGER NOT NULL DEFAULT 1"),
)

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
    f"""CREATE TABLE IF NOT EXISTS {STRIPES_TABLE} (
    name     VARCHAR(128) NOT NULL,
    stripe   INTEGER      NOT NULL,
    max_id   BIGINT       NOT NULL,
    step     BIGINT       NOT NULL,
    first_id BIGINT       NOT NULL,
    last_id  BIGINT       NOT NULL,
    stripes  INTEGER      NOT NULL,
    PRIMARY KEY (name, stripe)
)""",
    f"""CREATE TABLE IF NOT EXISTS {CELLS_TABLE} (
    name    VARCHAR(255) NOT NULL PRIMARY KEY,
    value   TEXT         NOT NULL,
    version BIGINT       NOT NULL
)""",
    f"""CREATE TABLE IF NOT EXISTS {QUORUM_TABLE} (
    name    VARCHAR(128) NOT NULL PRIMARY KEY,
    counter BIGINT       NOT NULL
)""",
)


class MissingPrivilege(Exception):
    """The store's user lacks a grant idmint needs (what, and the GRANT, in the message): a
    dialect raises it where the server would not refuse but answer less (a replication view
    that hides rows), SqlConnection reports it as StoreUnavailable naming the store."""


def privilege_hint(refused: str) -> str:
    """What to do about a statement the server refused for want of a grant (its message)."""
    if re.search(r"\b(CREATE|ALTER)\b|for schema|must be owner", refused, re.IGNORECASE):
        return (
            "idmint's tables are made, and changed after an upgrade, by `idmint init` run as "
            "their owner: docs/stores.md, Locked down"
        )
    return "docs/stores.md, Locked down, gives the grants idmint needs"


#: The table a schema statement makes.
_CREATED = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)")


@dataclass(frozen=True)
class Dialect:
    """What differs between SQL engines."""

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
    #: The driver's parameter marker.
    param: str = "?"
    #: Driver exceptions that mean "cannot reach or use the store now" (connection lost,
    #: server shutting down, lock wait timeout): reported as StoreUnavailable.
    unavailable: tuple[type[BaseException], ...] = ()
    #: Driver exceptions raised by a duplicate primary key.
    duplicate: tuple[type[BaseException], ...] = ()
    #: Statements run once on every new connection.
    on_connect: Sequence[str] = ()
    #: Run with a cursor on every new connection of a store (not on Dialect.connect: a peer
    #: database read by `idmint import` needs no more than SELECT): MissingPrivilege when the
    #: user lacks a grant the server would not refuse a statement for, only answer less.
    check_grants: Callable[[Any], None] = field(default=lambda cur: None, repr=False)
    #: The engine's two-argument maximum.
    greatest: str = "GREATEST"
    #: UPDATE ... RETURNING: then a whole range is taken in one statement, one round trip
    #: (see SqlRangeStore.allocate).
    returning: bool = False
    #: Why a commit the server acknowledged might not survive its crash (settings that skip
    #: the fsync), read with a cursor; None when commits are durable.
    durability: Callable[[Any], str | None] = field(default=lambda cur: None, repr=False)
    #: The server's replication (role, lineage, replicas, what a commit waits for), read with
    #: a cursor; None for an engine without replication (SQLite).
    replication: Callable[[Any], ReplicationState | None] = field(
        default=lambda cur: None, repr=False
    )
    #: What makes a commit wait for the replicas, in the engine's settings (for messages).
    replication_hint: str = ""
    #: Accept a primary whose writes do not wait for every replica (the URL says so).
    unsafe_replication: bool = False
    #: Ids every key skips when a failover is fenced (the URL's failover_gap).
    failover_gap: int = FAILOVER_GAP
    #: Serve with fewer replicas than the store has waited for (the URL's fewer_replicas).
    fewer_replicas: bool = False
    #: After each commit on a primary whose commits wait for replicas, when the engine may
    #: answer a commit they did not acknowledge (MySQL's semi-sync fallback): (cursor, what
    #: it returned last time or None) -> (its mark now, why the commit may not be on a
    #: replica or None). None for engines that never answer early (PostgreSQL).
    confirm_commit: Callable[[Any, str | None], tuple[str | None, str | None]] | None = field(
        default=None, repr=False
    )
    #: After each write on a primary with replicas its commit does not wait for and idmint
    #: does (ReplicationState.waited_after_commit: PostgreSQL's asynchronous standbys): wait
    #: for them, bounded, with the cursor that wrote; why they do not have it, or None.
    await_replicas: Callable[[Any], str | None] | None = field(default=None, repr=False)
    #: A query for the names of the tables in the connection's database or schema; the schema
    #: statements of the tables there are skipped, so that an account granted rows only (no
    #: CREATE: docs/stores.md, "Locked down") can use a schema its owner made. "": always run.
    tables: str = ""
    #: One line for a driver's error a user can act on (a TLS handshake, a login, a missing
    #: grant), or None for the driver's own words.
    explain: Callable[[BaseException], str | None] = field(default=lambda exc: None, repr=False)
    #: Removes the URL's secrets from a driver's message (see stores._urls.scrub). It holds
    #: the URL: not in the repr, which a debugger or an error tracker may show.
    scrub: Callable[[str], str] = field(default=str, repr=False)


log = logging.getLogger(__name__)

#: The idmint_meta row holding the lineage of the primary the store last ran on.
LINEAGE = "lineage"
#: The idmint_meta row holding the most replicas the store's writes have waited for: it only
#: goes up by itself (a fence keeps it); `set_required` lowers it, and fences.
REQUIRED = "replicas"
_warned = Once()  # stores whose unsafe replication was logged

T = TypeVar("T")


def _text(name: Any) -> str:
    """A name as read: MySQL's (a byte string column, see mysql.py) comes as bytes."""
    return name.decode() if isinstance(name, bytes | bytearray) else str(name)


def _as_datetime(value: object) -> datetime | None:
    """Normalise the engines' timestamps (aware, naive-UTC or ISO text) to aware UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


class SqlConnection(ForkAware):
    """One connection (see the module doc); every operation one transaction (or one
    statement), driver errors mapped to idmint's."""

    def __init__(self, dialect: Dialect, display_url: str) -> None:
        self.display_url = display_url
        self._dialect = dialect
        self._lock = threading.Lock()
        self._conn: Any = None
        self._identity: StoreIdentity | None = None  # read on every new connection
        #: Each commit is confirmed (Dialect.confirm_commit) on this connection: its primary's
        #: commits are set to wait for replicas; and the mark the last confirmation returned.
        self._confirming = False
        self._commit_mark: str | None = None
        #: The primary's lineage when this connection was made (None: no replication, SQLite).
        self._lineage: str | None = None
        self._stale = False  # the server is no longer the primary this connection met
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
                self._dialect.check_grants(cur)
                replication = self._check_primary(cur)
                # PostgreSQL's CREATE TABLE IF NOT EXISTS can lose a race with another process
                # creating the same table; the table is there, which is the goal.
                present = self._tables(cur)
                for statement in (*self._dialect.schema, *COMMON_SCHEMA):
                    made = _CREATED.search(statement)
                    if made is not None and made.group(1) in present:
                        # even IF NOT EXISTS needs CREATE, which a runtime account lacks
                        continue
                    with contextlib.suppress(*self._dialect.duplicate):
                        cur.execute(statement)
                self._add_columns(cur)
                self._lineage, self._stale = None, False
                if replication is not None and replication.lineage is not None:
                    self._check_lineage(cur, replication.lineage)
                    self._meta_row(cur, REQUIRED, str(replication.waits_for))
                    self._lineage = replication.lineage
                confirm = self._dialect.confirm_commit
                self._commit_mark = None
                if confirm is not None and not self._dialect.unsafe_replication:
                    self._commit_mark, _ = confirm(cur, None)  # the mark commits count from
                self._confirming = self._commit_mark is not None
                # Made by the first connection ever (see _meta_row); after a fence: its new life.
                self._identity = StoreIdentity(*self._meta_row(cur, "store", uuid.uuid4().hex))
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn.cursor()

    def _confirm_write(self, cur: Any) -> None:
        """After a write committed on its own (autocommit): confirm it as a transaction's
        commit is (see _confirm_commit)."""
        if self._confirming:
            self._confirm_commit(cur)

    def _confirm_commit(self, cur: Any) -> None:
        """Raise StoreUnavailable when the commit just made may not be on a replica: it
        applied here, and a failover to the replica would undo it, so whatever it took (a
        range) is dropped, never served, as when a COMMIT fails."""
        assert self._dialect.confirm_commit is not None
        self._commit_mark, why = self._dialect.confirm_commit(cur, self._commit_mark)
        self._unconfirmed(why)

    def _await_replicas(self, cur: Any, state: ReplicationState | None) -> None:
        """After a write committed, when the replication it met (`state`, None: not
        replicated) has replicas the commit did not wait for and idmint does: wait for them
        (Dialect.await_replicas, bounded). StoreUnavailable when they do not get it in time:
        whatever it took is dropped, never served, as when a COMMIT fails."""
        if state is not None and state.waited_after_commit:
            assert self._dialect.await_replicas is not None
            why = self._dialect.await_replicas(cur)
            self._unconfirmed(why)

    def _unconfirmed(self, why: str | None) -> None:
        """StoreUnavailable when `why` says a write that applied here may be missing from a
        replica (a failover to it would undo the write); nothing when it is None."""
        if why is not None:
            raise StoreUnavailable(
                f"store {self.display_url}: {why}; not used (a failover could undo it)"
            )

    def _check_primary(self, cur: Any) -> ReplicationState | None:
        """On every new connection: refuse a server that takes no writes (a standby, a
        read-only replica: while a failover moves the URL's address, a connection can land
        on one). What its replicas wait for is checked with every write (_check_replication)."""
        state = self._dialect.replication(cur)
        if state is not None and state.role == REPLICA:
            raise StoreUnavailable(
                f"store {self.display_url} is a replica ({state.detail}): it takes no writes; "
                "give the primary's address (or wait for the failover to finish)"
            )
        return state

    def _check_replication(self, cur: Any) -> ReplicationState:
        """At the start of every transaction on a replicated engine: the server's replication
        as it is now, which the transaction's commit will meet. StoreUnavailable (the
        transaction then rolls back, nothing it took is served) when the server became a
        replica or another primary took the address (the next connection fences), when
        replicas are connected that a commit does not wait for, or when a commit waits for
        fewer replicas than the store has waited for (a failback to an older copy, or a
        promoted primary alone, could repeat ids) unless the URL accepts it. A commit that
        waits for more raises the store's requirement, in the same transaction."""
        state = self._dialect.replication(cur)
        assert state is not None  # only called where the engine replicates
        if state.role == REPLICA or state.lineage != self._lineage:
            self._stale = True  # drop the connection after this: the next one looks again
            why = (
                f"is a replica ({state.detail})"
                if state.role == REPLICA
                else (f"has another primary ({state.lineage}, was {self._lineage})")
            )
            raise StoreUnavailable(f"store {self.display_url} {why}; connecting again")
        p = self._dialect.param
        state = replace(state, required=self._required(cur))
        if state.waits_for > (state.required or 0):
            cur.execute(
                f"UPDATE {META_TABLE} SET value = {p} WHERE name = {p}",
                (str(state.waits_for), REQUIRED),
            )
        unsafe, fewer = self._dialect.unsafe_replication, self._dialect.fewer_replicas
        risk = state.risk
        if risk is None or unsafe or (fewer and state.shortfall == risk):
            if risk is not None and _warned.first(self.display_url):
                log.warning("store %s: %s; going on as the URL says", self.display_url, risk)
            return state
        # Fewer replicas than required first: that is what an operator can act on (a
        # promoted primary alone also reads as a semi-sync that fell back).
        if state.shortfall == risk:
            raise StoreUnavailable(
                f"store {self.display_url}: {risk} ({state.detail}). Writes resume when a "
                "replica is back; if one is gone for good, lower the requirement with "
                "`idmint replicas --set N --yes` (docs/stores.md)"
            )
        if state.degraded:
            raise StoreUnavailable(
                f"store {self.display_url}: {risk} ({state.detail}); writes wait until the "
                "replicas acknowledge again"
            )
        raise StoreUnavailable(
            f"store {self.display_url}: {risk} ({state.detail}). Make every commit wait for "
            f"the replicas ({self._dialect.replication_hint}: docs/stores.md)"
        )

    def _check_lineage(self, cur: Any, lineage: str) -> None:
        """On every new connection, before anything is served through it: compare the
        primary's lineage with the one the store recorded. Another lineage means a failover
        (a replica promoted): the first connection to see it fences the store (see _fence)."""
        for _ in range(3):  # another process may fence at the same time
            recorded, _ = self._meta_row(cur, LINEAGE, lineage)
            if recorded == lineage or self._fence(cur, recorded, lineage):
                return
        raise StoreUnavailable(f"store {self.display_url}: its lineage kept changing")

    def _fence(self, cur: Any, recorded: str, lineage: str) -> bool:
        """After a failover, in one transaction with recording the new lineage: every key and
        stripe moves up the gap (the URL's failover_gap, FAILOVER_GAP by default; never past
        one above its maximum: a bounded key may end spent), and the store's life starts again
        (its identity's created_ms: snowflake holders then wait a ttl). The promoted replica
        may lack the old primary's last ranges, lease renewals and new leases; ids handed out
        under them must not come again. False if another process fenced first."""
        p = self._dialect.param
        with self._bare_transaction(cur):
            cur.execute(
                f"UPDATE {META_TABLE} SET value = {p} WHERE name = {p} AND value = {p}",
                (lineage, LINEAGE, recorded),
            )
            if cur.rowcount != 1:
                return False  # another process fenced: this transaction changed nothing
            self._move_counters(cur)
        log.error(
            "store %s: FAILOVER: the primary's lineage is %s, the store recorded %s: another "
            "server became the primary, and may lack the last ranges and leases. Fenced: every "
            "key moved up %d ids; new snowflake holders wait out the longest lease ttl before "
            "their first id",
            self.display_url,
            lineage,
            recorded,
            self._dialect.failover_gap,
        )
        note_failover(self.display_url, recorded, lineage)
        return True

    @contextlib.contextmanager
    def _bare_transaction(self, cur: Any) -> Iterator[None]:
        """A transaction on `cur` without _run's replication check: committed when the block
        ends (returns included), rolled back when it raises."""
        cur.execute(self._dialect.begin)
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")

    def _move_counters(self, cur: Any) -> None:
        """A fence's writes, inside its transaction: every key and stripe up the gap (never
        past one above its maximum), every counter in a cell too, and the store's new life."""
        p = self._dialect.param
        least = "LEAST" if self._dialect.greatest == "GREATEST" else "MIN"
        for table in (TABLE, STRIPES_TABLE):
            cur.execute(
                f"UPDATE {table} SET max_id = {self._dialect.greatest}"
                f"(max_id, {least}(max_id + {p} * stripes, last_id + 1))",
                (self._dialect.failover_gap,),
            )
        self._fence_cells(cur)
        cur.execute(
            f"UPDATE {META_TABLE} SET created_ms = {self._dialect.now_ms} WHERE name = {p}",
            ("store",),
        )

    def set_required(self, replicas: int) -> int:
        """Set how many replicas every write must wait for (`idmint replicas --set`); the
        requirement it replaces. Lowering it fences the store as a failover does, in the same
        transaction: the operator says the missing replicas are gone, and what only they had
        (or a copy that goes on without them) must not be handed out twice."""
        p = self._dialect.param

        def change(cur: Any) -> int:
            # Not _run's transaction: its replication check refuses the very shortfall this
            # is run to resolve.
            with self._bare_transaction(cur):
                select = f"SELECT value FROM {META_TABLE} WHERE name = {p}"
                cur.execute(select + self._dialect.for_update, (REQUIRED,))
                row = cur.fetchone()
                if row is None:
                    raise InvalidArgument(
                        f"store {self.display_url} does not replicate: it has no replica "
                        "requirement"
                    )
                old = int(row[0]) if is_digits(str(row[0])) else 0
                cur.execute(
                    f"UPDATE {META_TABLE} SET value = {p} WHERE name = {p}",
                    (str(replicas), REQUIRED),
                )
                if replicas < old:
                    self._move_counters(cur)
            return old

        old = self._run(change, transaction=False)
        if replicas < old:
            log.error(
                "store %s: the replica requirement lowered from %d to %d: fenced as a "
                "failover (every key moved up %d ids; new snowflake holders wait out the "
                "longest lease ttl)",
                self.display_url,
                old,
                replicas,
                self._dialect.failover_gap,
            )
            note_failover(self.display_url, f"{old} replica(s)", f"{replicas} replica(s)")
        return old

    def _fence_cells(self, cur: Any) -> None:
        """Inside the fence's transaction: every counter kept in a compare-and-set cell
        (datacenter keys, segment keys over cells: stores/fences.py) moved up the gap."""
        p, gap = self._dialect.param, self._dialect.failover_gap
        if not gap:
            return
        cur.execute(f"SELECT name, value FROM {CELLS_TABLE}")
        for raw, value in cur.fetchall():
            up = fences.fenced(_text(raw), str(value), gap)
            if up is not None and up != value:
                cur.execute(
                    f"UPDATE {CELLS_TABLE} SET value = {p}, version = version + 1 WHERE name = {p}",
                    (up, raw),
                )

    def _tables(self, cur: Any) -> set[str]:
        """The tables already in the connection's database or schema (Dialect.tables)."""
        if not self._dialect.tables:
            return set()
        cur.execute(self._dialect.tables)
        return {_text(row[0]).lower() for row in cur.fetchall()}

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

    def _meta_row(self, cur: Any, name: str, first: str) -> tuple[str, int]:
        """(value, created_ms) of idmint_meta row `name`, made with `first` if there is none
        (of processes racing to make it, one insert wins and every one reads the winner's)."""
        p = self._dialect.param
        select = f"SELECT value, created_ms FROM {META_TABLE} WHERE name = {p}"
        cur.execute(select, (name,))
        row = cur.fetchone()
        if row is None:
            with contextlib.suppress(*self._dialect.duplicate):
                cur.execute(
                    f"INSERT INTO {META_TABLE} (name, value, created_ms) "
                    f"VALUES ({p}, {p}, {self._dialect.now_ms})",
                    (name, first),
                )
            cur.execute(select, (name,))
            row = cur.fetchone()
        return str(row[0]), int(row[1])

    def _required(self, cur: Any) -> int:
        """The replicas the store's writes have waited for (its REQUIRED row)."""
        cur.execute(
            f"SELECT value FROM {META_TABLE} WHERE name = {self._dialect.param}", (REQUIRED,)
        )
        row = cur.fetchone()
        return int(row[0]) if row is not None and is_digits(str(row[0])) else 0

    def replication(self) -> ReplicationState | None:
        """The server's replication as it is now, with the store's requirement (see
        stores/replication.py)."""

        def read(cur: Any) -> ReplicationState | None:
            state = self._dialect.replication(cur)
            if state is None or self._lineage is None:
                return state
            return replace(state, required=self._required(cur))

        return self._run(read, transaction=False)

    def init(self) -> None:
        self._run(lambda cur: None, transaction=False)  # connecting creates the tables

    def identity(self) -> StoreIdentity | None:
        """The store's identity, as read by the current connection (connecting if needed)."""
        self.init()
        return self._identity

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken: closing is best effort
                conn.close()

    def _run(self, body: Callable[[Any], T], *, transaction: bool = True, write: bool = False) -> T:
        """Run `body(cursor)` in one transaction; map driver errors to idmint's. Every
        transaction, and a body that writes on its own (`write`, one statement in autocommit),
        first meets the server's replication as it is now (see _check_replication), and once
        committed waits for the replicas idmint waits for itself (see _await_replicas)."""
        self._check_fork()
        with self._lock:
            try:
                cur = self._cursor()
                state: ReplicationState | None = None  # the replication the write met
                if not transaction:
                    if not write or self._lineage is None:
                        return body(cur)
                    try:
                        state = self._check_replication(cur)
                    finally:
                        if self._stale:
                            self._drop_connection()
                    result = body(cur)
                    self._await_replicas(cur, state)
                    return result
                cur.execute(self._dialect.begin)
                try:
                    if self._lineage is not None:
                        state = self._check_replication(cur)
                    result = body(cur)
                except BaseException:
                    cur.execute("ROLLBACK")
                    if self._stale:  # _check_replication saw another server
                        self._drop_connection()
                    raise
                # If COMMIT fails the outcome is unknown: the caller gets an error and the
                # result (a range, say) is dropped, never served.
                cur.execute("COMMIT")
                if self._confirming:
                    self._confirm_commit(cur)
                self._await_replicas(cur, state)
                return result
            except IdmintError:
                raise
            except MissingPrivilege as exc:
                self._drop_connection()
                why = self._dialect.scrub(" ".join(str(exc).split()))
                raise StoreUnavailable(f"store {self.display_url}: {why}") from None
            except self._dialect.duplicate:
                raise
            except self._dialect.unavailable as exc:
                self._drop_connection()
                said = self._dialect.explain(exc) or str(exc) or type(exc).__name__
                why = self._dialect.scrub(" ".join(said.split()))
                raise StoreUnavailable(f"store {self.display_url} unavailable: {why}") from exc
