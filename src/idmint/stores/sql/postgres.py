"""PostgreSQL through psycopg 3.

The counter row is locked with `SELECT ... FOR UPDATE` inside the transaction, so concurrent
allocations of one key queue on the row, and the commit is durable under PostgreSQL's default
`synchronous_commit=on`. A commit waits for the synchronous standbys; idmint waits after it
for the others, until they have flushed it (await_standbys).

Every call is bounded (see docs/stores.md, "Bounds"): the server cancels a statement after the
store timeout (`lock_timeout`, `statement_timeout`) and ends a session left idle inside a
transaction; the client gives up on a statement the server does not answer at all (a frozen
server acknowledges packets, so no TCP timeout fires) by shutting the socket down.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import socket
import time
from typing import Any

from ..._errors import DriverMissing, InvalidArgument
from ...ids import is_digits
from .._deadline import WATCHDOG
from .._urls import scrub
from ..engine import Engine
from ..replication import (
    POSTGRES_FLUSH_QUERY,
    POSTGRES_QUERY,
    ReplicationState,
    postgres_state,
    take_replication_parameters,
)
from ..tls import handshake_failure
from . import sql_engine
from .connection import TABLE, Dialect, MissingPrivilege, privilege_hint
from .leases import CREATE_WORKERS_TABLE

CREATE_TABLE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    name        VARCHAR(128) PRIMARY KEY,
    max_id      BIGINT       NOT NULL,
    step        BIGINT       NOT NULL,
    first_id    BIGINT       NOT NULL,
    last_id     BIGINT       NOT NULL,
    description VARCHAR(256) NOT NULL DEFAULT '',
    updated_at  TIMESTAMPTZ  NOT NULL,
    max_batch   BIGINT       NOT NULL DEFAULT 0
)
"""


#: How much longer than the server's own timeouts the client waits for an answer: the server's
#: error, when it can send one, keeps the connection; the client's deadline drops it.
CLIENT_MARGIN = 1.0


class _BoundedConnection:
    """A psycopg connection whose every statement ends within `limit` seconds: when the server
    does not answer by then, the socket is shut down and the statement fails."""

    def __init__(self, conn: Any, limit: float) -> None:
        self._conn = conn
        self._limit = limit
        # Our own handle on the socket: libpq may close its descriptor (on a broken connection)
        # while a deadline is armed, and the number could be reused by then.
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        #: The server cancelled a commit's wait for the synchronous standbys (see
        #: _BoundedCursor.execute) since this was last looked at.
        self.wait_cancelled = False
        conn.add_notice_handler(self._notice)

    def _notice(self, diag: Any) -> None:
        if "wait for synchronous replication" in (diag.message_primary or ""):
            self.wait_cancelled = True

    def cursor(self) -> _BoundedCursor:
        return _BoundedCursor(self._conn.cursor(), self)

    def close(self) -> None:
        try:
            self._conn.close()
        finally:
            self._sock.close()

    def abort(self) -> None:
        """Make the blocked read return (end of file): libpq then reports a lost connection."""
        with contextlib.suppress(OSError):  # already closed: nothing is waiting on it
            self._sock.shutdown(socket.SHUT_RDWR)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _BoundedCursor:
    def __init__(self, cur: Any, conn: _BoundedConnection) -> None:
        self._cur = cur
        self._bounded = conn

    def execute(self, query: Any, params: Any = None) -> _BoundedCursor:
        import psycopg

        limit = self._bounded._limit
        token = WATCHDOG.arm(limit, self._bounded.abort)
        try:
            self._cur.execute(query, params)
        except psycopg.Error as exc:
            if not WATCHDOG.disarm(token):  # the deadline passed: say so, not "server closed"
                raise psycopg.OperationalError(f"no answer within {limit:g} s") from exc
            raise
        except BaseException:
            WATCHDOG.disarm(token)
            raise
        if not WATCHDOG.disarm(token):
            # The answer came just as the deadline passed, and the socket is shut down: fail
            # now (the outcome of a COMMIT is then unknown, as for any lost connection) rather
            # than leave a dead connection for the next call on a healthy server.
            raise psycopg.OperationalError(f"no answer within {limit:g} s")
        if self._bounded.wait_cancelled:
            # PostgreSQL ends a commit's wait for the synchronous standbys when the session
            # is cancelled (pg_cancel_backend, a timeout) and answers the commit as done,
            # saying so only in a WARNING ("...committed locally, but might not have been
            # replicated to the standby"). Its outcome is unknown to a failover: fail it, as a
            # lost connection, so that nothing it took is served.
            self._bounded.wait_cancelled = False
            raise psycopg.OperationalError(
                "the commit's wait for the synchronous standbys was cancelled: it committed "
                "on the primary only"
            )
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def durability(cur: Any) -> str | None:
    """A commit is on disk when it is acknowledged unless fsync or synchronous_commit is off
    (the session's setting: a role or database may have turned it off)."""
    cur.execute("SELECT current_setting('fsync'), current_setting('synchronous_commit')")
    fsync, commit = cur.fetchone()
    weak = [f"fsync={fsync}"] if fsync != "on" else []
    weak += [f"synchronous_commit={commit}"] if commit == "off" else []
    return f"PostgreSQL runs with {', '.join(weak)}" if weak else None


#: POSTGRES_QUERY and, in the same round trip, the walsenders pg_stat_replication hides from
#: this role (it shows only their pid to a role neither superuser nor in pg_read_all_stats,
#: and their state is never NULL otherwise) and the role's name.
GUARD_QUERY = f"""
SELECT q.*, (SELECT count(*) FROM pg_stat_replication WHERE state IS NULL), current_user
  FROM ({POSTGRES_QUERY}) q
"""


def replication(cur: Any, *, waits: bool) -> ReplicationState:
    """The server's replication (see stores/replication.py). MissingPrivilege when standbys
    are hidden from idmint's role: each would pass for no standby (the primary for a
    standalone server whose writes need wait for nothing), as on main."""
    cur.execute(GUARD_QUERY)
    *row, hidden, role = tuple(cur.fetchone())
    if hidden:
        raise MissingPrivilege(
            f"the replication guard cannot see the standbys: pg_stat_replication hides "
            f'{hidden} of them from role {role!r}; GRANT pg_read_all_stats TO "{role}" '
            "(or pg_monitor)"
        )
    return postgres_state(tuple(row), waits=waits)


#: libpq's words before its reason ("connection failed: connection to server at "h", port
#: 5432 failed: FATAL:  ..."), dropped: the store's URL names the server already.
_LIBPQ_PREFIX = re.compile(
    r"^(?:connection failed: )?(?:connection to server at .*?, port \d+ failed: )?"
    r"(?:(?:FATAL|ERROR): +)?",
    re.DOTALL,
)


def _explain(exc: BaseException) -> str | None:
    """One line for a refused connection or statement (None: the driver's own words do)."""
    import psycopg

    said = " ".join(str(exc).split())
    reason = _LIBPQ_PREFIX.sub("", said, count=1)
    handshake = handshake_failure(exc)
    if handshake is not None:
        # libpq's reason is the most a user gets ("certificate verify failed"): keep both
        return f"{handshake}: {reason}" if reason and "SSL" in reason else handshake
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        # the server's own line, without the statement it quotes
        primary = getattr(exc.diag, "message_primary", None) or reason
        return f"{primary} ({privilege_hint(primary)})"
    return reason if reason != said else None


#: The connection parameters naming a file libpq reads (sslrootcert=system: the system's CAs).
_FILE_PARAMETERS = ("sslrootcert", "sslcert", "sslkey", "sslcrl")


#: The first pause between two readings of the standbys' flush positions, and the longest. A
#: standby on the same network flushes within a millisecond or so: the first readings come
#: close together; a slower one is read a hundred times a second, not more.
FLUSH_POLL_FIRST, FLUSH_POLL_MAX = 0.0002, 0.01


def await_standbys(cur: Any, bound: float) -> str | None:
    """After a write committed on a primary with standbys its commit did not wait for (they
    are not in synchronous_standby_names): wait until every standby that can be promoted has
    flushed the WAL past it, so that a failover to any of them keeps it. None once they have;
    else which lag, after `bound` seconds. PostgreSQL has no way to wait for an asynchronous
    standby: its flush position (pg_stat_replication.flush_lsn, which a standby reports as
    soon as it flushes) is read until it is far enough, with short pauses growing from
    FLUSH_POLL_FIRST."""
    deadline = time.monotonic() + bound
    lsn, pause = None, FLUSH_POLL_FIRST
    while True:
        cur.execute(POSTGRES_FLUSH_QUERY, (lsn,))
        lsn, lagging = cur.fetchone()  # the position is read once: later writes do not count
        if lagging is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            return f"standby {lagging} did not flush the write (WAL {lsn}) within {bound:g} s"
        time.sleep(min(pause, left))
        pause = min(2 * pause, FLUSH_POLL_MAX)


def _conninfo(psycopg: Any, url: str, display_url: str) -> dict[str, Any]:
    """The URL's connection parameters as libpq reads them, or InvalidArgument."""
    try:
        given: dict[str, Any] = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        why = scrub(" ".join(str(exc).split()), url)  # libpq may quote a piece of the password
        raise InvalidArgument(f"bad PostgreSQL URL {display_url!r}: {why}") from exc
    for port in str(given.get("port", "")).split(","):  # libpq takes a list, one per host
        if port and not (is_digits(port) and 0 < int(port) < 65536):
            # What libpq took for a port may be a piece of a password with an unencoded "/"
            # in it: scrubbed, like libpq's own messages.
            why = scrub(f"port {port!r} is not a number from 1 to 65535", url)
            raise InvalidArgument(f"bad PostgreSQL URL {display_url!r}: {why}")
    for name in _FILE_PARAMETERS:
        # Read now, as the other engines' ca=, cert=, key=: a file that cannot be used is a bad
        # URL at once, not a failure at every connection.
        path = str(given.get(name) or "")
        if path and path != "system" and not os.access(path, os.R_OK):
            why = scrub(f"cannot read {name}={path}", url)  # sslkey= counts as a secret
            raise InvalidArgument(f"bad PostgreSQL URL {display_url!r}: {why}")
    return given


def _tcp_bounds(psycopg: Any, timeout: float) -> dict[str, Any]:
    """TCP-level bounds (the URL's own win): keepalives notice a peer gone silent on an idle
    connection; tcp_user_timeout drops a connection whose sent data stays unacknowledged."""
    tcp: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout)),
        "keepalives_interval": max(1, math.ceil(timeout)),
        "keepalives_count": 3,
        "tcp_user_timeout": _ms(timeout + CLIENT_MARGIN),
    }
    if psycopg.pq.version() < 120000:  # libpq before 12 has no tcp_user_timeout
        del tcp["tcp_user_timeout"]
    return tcp


def postgres_dialect(url: str, display_url: str, *, timeout: float) -> Dialect:
    """PostgreSQL's Dialect for a URL (checked here). Long for one reason: the Dialect is one
    literal, a line and its why for each setting."""
    try:
        import psycopg
    except ImportError as exc:
        raise DriverMissing(
            "postgresql:// stores need the psycopg driver: pip install 'idmint[postgres]'"
        ) from exc

    url = url.replace("postgres://", "postgresql://", 1)
    url, replicated = take_replication_parameters(url, display_url)
    given = _conninfo(psycopg, url, display_url)
    tcp = {
        name: value for name, value in _tcp_bounds(psycopg, timeout).items() if name not in given
    }

    def connect() -> Any:
        conn = psycopg.connect(
            url,
            autocommit=True,
            # libpq counts whole seconds and waits at least 2
            connect_timeout=max(1, round(timeout)),
            application_name="idmint",
            **tcp,
        )
        try:
            return _BoundedConnection(conn, timeout + CLIENT_MARGIN)
        except BaseException:
            conn.close()
            raise

    return Dialect(
        connect=connect,
        schema=(CREATE_TABLE, CREATE_WORKERS_TABLE),
        now_ms="CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        now="now()",
        param="%s",
        unavailable=(
            psycopg.OperationalError,
            psycopg.InterfaceError,
            # the server ended a session left idle in a transaction (this process was paused)
            psycopg.errors.IdleInTransactionSessionTimeout,
            # a grant the role lacks: named in one line, not a traceback (see _explain)
            psycopg.errors.InsufficientPrivilege,
        ),
        # Concurrent first connections race to create the schema: CREATE TABLE IF NOT EXISTS
        # can still fail on the table's row type or name; the table is there either way.
        duplicate=(
            psycopg.errors.UniqueViolation,
            psycopg.errors.DuplicateTable,
            psycopg.errors.DuplicateObject,
        ),
        returning=True,
        tables="SELECT tablename FROM pg_tables WHERE schemaname = current_schema()",
        explain=_explain,
        durability=durability,
        replication=functools.partial(replication, waits=not replicated.unsafe),
        # Half the store timeout: a write that waited that long for a standby still fails
        # well within the caller's own bound (docs/stores.md, "Bounds").
        await_replicas=functools.partial(await_standbys, bound=timeout / 2),
        unsafe_replication=replicated.unsafe,
        fewer_replicas=replicated.fewer,
        replication_hint="synchronous_standby_names naming the standbys, synchronous_commit on",
        failover_gap=replicated.gap,
        # The server's own bounds, in one round trip. lock_timeout is the store timeout; a
        # statement gets a little more, so that a lock wait is reported as one; a session
        # idle inside a transaction for twice that (its process is paused) is ended, so its row
        # locks do not hold up every other process.
        on_connect=(
            f"SELECT set_config('lock_timeout', '{_ms(timeout)}', false),"
            f" set_config('statement_timeout', '{_ms(timeout + CLIENT_MARGIN / 2)}', false),"
            " set_config('idle_in_transaction_session_timeout',"
            f" '{max(1000, _ms(2 * timeout))}', false)",
        ),
    )


def open_postgres_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The registry's opener (stores/registry.py): checks the URL, imports the driver."""
    return sql_engine("postgresql", postgres_dialect(url, display, timeout=timeout), url, display)
