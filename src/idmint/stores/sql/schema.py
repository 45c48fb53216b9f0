"""The SQL engines' schema (table names, columns, CREATE statements) and the `Dialect`
each engine's module supplies: what differs between engines; the statements are shared."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..replication import (
    FAILOVER_GAP,
    ReplicationState,
)

TABLE = "idmint_keys"
INSERT_COLUMNS = "name, max_id, step, first_id, last_id, description, updated_at, stripes"
COLUMNS = INSERT_COLUMNS + ", max_batch"

# Stripes 1 to n - 1 of a striped key (stripe 0 is the key's own row): the same counter
# columns, so one allocation statement serves both tables.
STRIPES_TABLE = "idmint_stripes"
STRIPE_COLUMNS = "name, max_id, step, first_id, last_id, stripes, stripe"

# Compare-and-set cells (see sql/cas.py).
CELLS_TABLE = "idmint_cells"

# Quorum keys' counters on a quorum node (see sql/quorum.py).
QUORUM_TABLE = "idmint_quorum"

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
    #: After each commit on a primary whose commits wait for replicas, when the engine may
    #: answer a commit they did not acknowledge (MySQL's semi-sync fallback): (cursor, what
    #: it returned last time or None) -> (its mark now, why the commit may not be on a
    #: replica or None). None for engines that never answer early (PostgreSQL).
    confirm_commit: Callable[[Any, str | None], tuple[str | None, str | None]] | None = field(
        default=None, repr=False
    )
    #: Removes the URL's secrets from a driver's message (see stores._urls.scrub). It holds
    #: the URL: not in the repr, which a debugger or an error tracker may show.
    scrub: Callable[[str], str] = field(default=str, repr=False)
