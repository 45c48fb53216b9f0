"""MySQL and MariaDB through PyMySQL.

InnoDB's row lock from `SELECT ... FOR UPDATE` serialises allocations of a key; commits are
durable under the default `innodb_flush_log_at_trx_commit=1`. A lock wait ends after the store
timeout (`innodb_lock_wait_timeout`, whole seconds); the client's read and write timeouts, a
second longer, end a call to a server that stopped answering.
"""

from __future__ import annotations

import functools
import math
import ssl
from dataclasses import replace
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ..._errors import DriverMissing, InvalidArgument
from .._urls import ENCODE_HINT, misplaced_at, scrub
from ..engine import Engine
from ..replication import (
    REPLICA,
    ReplicationState,
    mysql_state,
    semi_sync_fields,
    take_replication_parameters,
)
from ..tls import TLS_PARAMS, handshake_failure, tls_settings
from . import sql_engine
from .connection import CELLS_TABLE, QUORUM_TABLE, TABLE, Dialect, MissingPrivilege, privilege_hint
from .leases import CREATE_WORKERS_TABLE

CREATE_TABLE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    name        VARCHAR(128) NOT NULL PRIMARY KEY,
    max_id      BIGINT       NOT NULL,
    step        BIGINT       NOT NULL,
    first_id    BIGINT       NOT NULL,
    last_id     BIGINT       NOT NULL,
    description VARCHAR(256) NOT NULL DEFAULT '',
    updated_at  DATETIME(6)  NOT NULL,
    max_batch   BIGINT       NOT NULL DEFAULT 0
) ENGINE=InnoDB
"""

# Quorum counters: byte-for-byte names too, so "k" and "K" are two keys as on the other nodes.
CREATE_QUORUM_TABLE = f"""
CREATE TABLE IF NOT EXISTS {QUORUM_TABLE} (
    name    VARBINARY(512) NOT NULL PRIMARY KEY,
    counter BIGINT         NOT NULL
) ENGINE=InnoDB
"""


def durability(cur: Any) -> str | None:
    """InnoDB writes and flushes its redo log at every commit only with
    innodb_flush_log_at_trx_commit=1 (the default); 0 and 2 can lose the last second."""
    cur.execute("SELECT @@innodb_flush_log_at_trx_commit")
    flush = int(cur.fetchone()[0])
    return None if flush == 1 else f"MySQL runs with innodb_flush_log_at_trx_commit={flush}"


# Replicas are the threads sending them the binary log (seen with the PROCESS privilege;
# without it, none: the server looks standalone).
MYSQL_QUERY = """
SELECT @@read_only, @@server_id, {uuid},
       (SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%%')
"""


def replication(cur: Any) -> ReplicationState:
    """The server's role, lineage (MySQL's server_uuid, MariaDB's server_id), replicas and
    semi-synchronous replication (see stores/replication.py)."""
    # The version the handshake gave: no round trip (this runs before every write).
    mariadb = "mariadb" in str(cur.connection.get_server_info()).lower()
    cur.execute(MYSQL_QUERY.format(uuid="NULL" if mariadb else "@@server_uuid"))
    row = tuple(cur.fetchone())
    replicating = _replicating(_replica_status(cur))
    if replicating is not None:
        return ReplicationState(REPLICA, None, 0, 0, replicating)
    state = mysql_state(row, [], _semi_sync(cur, "VARIABLES", "STATUS"))
    # Fallen back with no replica connected is not replicas that stopped acknowledging for a
    # while: there is none. The store's requirement alone says whether writes go on (a
    # promoted primary alone is refused for it, and told of `idmint replicas --set`), and a
    # commit that falls back is still refused after it (confirm_commit).
    return state if state.replicas else replace(state, degraded=False)


def _replica_status(cur: Any) -> list[dict[str, str]]:
    """SHOW REPLICA STATUS (SHOW SLAVE STATUS before MySQL 8.0.22 and MariaDB 10.5): a row per
    replication channel, its columns named as MariaDB does (Slave_IO_Running,
    Read_Master_Log_Pos, ...: MySQL 8.0.22 says Replica_ and Source). MissingPrivilege when
    the user may run neither: a replica must not pass for a primary for want of a grant (on
    main it did: the guard read "no channel")."""
    import pymysql

    refused: BaseException | None = None
    for statement in ("SHOW REPLICA STATUS", "SHOW SLAVE STATUS"):
        try:
            cur.execute(statement)
        except pymysql.err.ProgrammingError:
            continue  # an older server's syntax: try the older spelling
        except pymysql.err.OperationalError as exc:
            if _errno(exc) not in _DENIED:
                raise
            refused = exc
            continue
        names = [
            str(d[0]).replace("Replica_", "Slave_").replace("Source", "Master")
            for d in cur.description or ()
        ]
        return [dict(zip(names, map(str, row), strict=False)) for row in cur.fetchall()]
    if refused is not None:
        raise MissingPrivilege(
            f"the replication guard cannot tell whether the server is a replica: "
            f"{_message(refused)}; GRANT SLAVE MONITOR ON *.* (MariaDB 10.5.9+; REPLICATION "
            "CLIENT on MySQL) to idmint's user"
        )
    return []


#: Server errors that mean "not allowed": an account's missing grant (1044: a database, 1142
#: and 1143: a table or column, 1227: a privilege such as PROCESS), 1045 a refused login.
_DENIED = frozenset({1044, 1142, 1143, 1227})
_LOGIN_REFUSED = 1045


def _errno(exc: BaseException) -> int | None:
    code = exc.args[0] if exc.args else None
    return code if isinstance(code, int) else None


def _message(exc: BaseException) -> str:
    """The server's words without PyMySQL's (code, "...") tuple around them."""
    if len(exc.args) >= 2 and isinstance(exc.args[1], str):
        return exc.args[1]
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_process(cur: Any) -> None:
    """MissingPrivilege unless the user holds PROCESS, which the replication guard reads the
    replicas with: without it information_schema.PROCESSLIST shows the user's own threads only,
    no error, and a primary with replicas passes for a standalone server whose writes need
    wait for nothing. SHOW ENGINE INNODB MUTEX is run only to be refused without PROCESS (with
    it, it answers a few rows, none on MariaDB; a query of INNODB_TRX with an impossible WHERE
    is not even checked); once per connection, as a global grant takes effect at connect."""
    import pymysql

    try:
        cur.execute("SHOW ENGINE INNODB MUTEX")
        cur.fetchall()
    except pymysql.err.OperationalError as exc:
        if _errno(exc) != 1227:
            raise
        raise MissingPrivilege(
            "the replication guard cannot see the replicas (information_schema.PROCESSLIST "
            f"shows other users' threads only with PROCESS): {_message(exc)}; GRANT PROCESS "
            "ON *.* to idmint's user (or accept unguarded replicas: ?unsafe_replication=1)"
        ) from None


def _explain(exc: BaseException, *, tls: bool) -> str | None:
    """One line for a refused connection or statement (None: the driver's own words do):
    a TLS handshake, a login, a grant."""
    handshake = handshake_failure(exc)
    if handshake is not None:
        return handshake
    code = _errno(exc)
    if code == _LOGIN_REFUSED:
        why = (
            "a wrong user name or password, or an account that requires a client certificate "
            "(?cert=...&key=...)"
            if tls
            else "a wrong user name or password, or an account that requires TLS (?ca=...)"
        )
        return f"{_message(exc)}: {why}"
    if code in _DENIED:
        return f"{_message(exc)} ({privilege_hint(_message(exc))})"
    return None


def _replicating(channels: list[dict[str, str]]) -> str | None:
    """Why a server is still a replica by SHOW REPLICA STATUS, or None. A replication thread
    that is not stopped (running, or the IO thread connecting: a primary that came back would
    pour its writes in). Or both stopped before the SQL thread applied what the IO thread had
    received: semi-synchronous replication acknowledges a commit once a replica has received
    it, not applied it, so that relay log holds acknowledged commits, and a replica promoted
    without them hands their ranges out again; RESET SLAVE throws them away, and what it
    leaves cannot tell (docs/stores.md, MySQL and MariaDB)."""
    for channel in channels:
        threads = [
            f"{name} {channel[name]}"
            for name in ("Slave_IO_Running", "Slave_SQL_Running")
            if channel.get(name, "No") != "No"
        ]
        if threads:
            return f"replicating (SHOW REPLICA STATUS: {', '.join(threads)})"
        received = channel.get("Master_Log_File", ""), channel.get("Read_Master_Log_Pos", "")
        applied = channel.get("Relay_Master_Log_File", ""), channel.get("Exec_Master_Log_Pos", "")
        if received[0] and received != applied:
            return (
                "replication stopped before the relay log was applied: received up to "
                f"{':'.join(received)}, applied up to {':'.join(applied)}; finish the "
                "promotion: START SLAVE SQL_THREAD, wait until it has applied everything "
                "(MASTER_GTID_WAIT), then RESET SLAVE ALL"
            )
    return None


def _semi_sync(cur: Any, *kinds: str) -> dict[str, str]:
    rows: list[tuple[str, str]] = []
    for kind in kinds:
        cur.execute(f"SHOW GLOBAL {kind} LIKE 'rpl_semi_sync_%'")
        rows += [(str(name), str(value)) for name, value in cur.fetchall()]
    return semi_sync_fields(rows)


def confirm_commit(cur: Any, last: str | None) -> tuple[str | None, str | None]:
    """After a commit on a primary: why that commit may not have reached a replica, or None.
    MySQL and MariaDB answer a commit no replica acknowledged within
    rpl_semi_sync_master_timeout anyway, fall back to asynchronous replication and count it in
    Rpl_semi_sync_master_no_tx: so the status must be on and the count as this connection last
    saw it (`last`; None on a new connection, which only takes the count). A server not set to
    wait (semi-sync off, or no plugin) promised nothing: a replica connected to it was refused
    before the write. Read after every commit, whatever the server said when the connection
    was made: semi-sync is turned on (a replica added to a running primary) and off (a primary
    left alone) while processes run. Returns the count (never None: there is always something
    to confirm) and the why."""
    fields = _semi_sync(cur, "STATUS")
    no_tx = fields.get("no_tx", "")
    if last is None:
        return no_tx, None
    if fields.get("status") == "ON":
        if no_tx == last:
            return no_tx, None
        return no_tx, f"commits went without a replica's acknowledgement (no_tx {last} -> {no_tx})"
    if _semi_sync(cur, "VARIABLES").get("enabled") != "ON":
        return no_tx, None
    return no_tx, (
        "semi-synchronous replication has fallen back to asynchronous (status OFF): no replica "
        "acknowledged the commit in time, and writes wait until one does (a primary meant to "
        "run alone: set rpl_semi_sync_master_enabled=OFF)"
    )


# Made before the common schema, whose CREATE TABLE IF NOT EXISTS then leaves it as it is. Cell
# names compare byte for byte: the default collations ignore case, accents and trailing blanks,
# which would make "k", "K" and "k " one cell. 1020 bytes: the 255 characters of the others.
CREATE_CELLS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {CELLS_TABLE} (
    name    VARBINARY(1020)                  NOT NULL PRIMARY KEY,
    value   MEDIUMTEXT CHARACTER SET utf8mb4 NOT NULL,
    version BIGINT                           NOT NULL
) ENGINE=InnoDB
"""


def _address(url: str, display_url: str) -> tuple[SplitResult, str, int, dict[str, str]]:
    """The URL's parts, database, port and query, or InvalidArgument."""
    if misplaced_at(url):
        raise InvalidArgument(f"bad MySQL URL {display_url!r}: {ENCODE_HINT}")
    parts = urlsplit(url)
    database = parts.path.lstrip("/")
    if not database or not parts.hostname:
        raise InvalidArgument(
            f"bad MySQL URL {display_url!r}: use mysql://user:password@host:port/database"
        )
    try:
        port = parts.port or 3306
    except ValueError as exc:
        # urlsplit takes a password's first characters for the port when it holds a "/"
        raise InvalidArgument(f"bad MySQL URL {display_url!r}: {scrub(str(exc), url)}") from exc
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    # A misspelt TLS parameter (ssl-ca=, sslmode=) must not leave the connection plain unseen.
    unknown = sorted(set(query) - TLS_PARAMS)
    if unknown:
        raise InvalidArgument(
            f"bad MySQL URL {display_url!r}: unknown parameter {unknown[0]!r} (TLS: "
            f"{', '.join(sorted(TLS_PARAMS))}; replication: unsafe_replication, "
            "fewer_replicas, failover_gap)"
        )
    return parts, database, port, query


def mysql_dialect(url: str, display_url: str, *, timeout: float) -> Dialect:
    try:
        import pymysql
    except ImportError as exc:
        raise DriverMissing(
            "mysql:// stores need the PyMySQL driver: pip install 'idmint[mysql]'"
        ) from exc

    url, replicated = take_replication_parameters(url, display_url)
    parts, database, port, query = _address(url, display_url)
    tls = tls_settings(query, display_url)
    # Files are read now: a CA or key that cannot be used is a bad URL, not a failed connect.
    context: ssl.SSLContext | None = None if tls is None else tls.context(display_url)
    # Plain unless the URL asks for TLS: PyMySQL 1.2 would otherwise try TLS without checking
    # the certificate, which protects nothing and makes "plain" depend on the driver's version.
    encryption: dict[str, Any] = {"ssl": context} if context else {"ssl_disabled": True}

    # The server reports a lock wait that lasted the store timeout; the client waits a second
    # more for any answer, so that the server's error (which keeps the connection) comes first.
    lock_wait = max(1, math.ceil(timeout))
    io_timeout = lock_wait + 1.0

    def connect() -> Any:
        return pymysql.connect(
            host=parts.hostname,
            port=port,
            user=unquote(parts.username or "root"),
            password=unquote(parts.password or ""),
            database=database,
            autocommit=True,
            connect_timeout=timeout,
            read_timeout=io_timeout,
            write_timeout=io_timeout,
            init_command=f"SET SESSION innodb_lock_wait_timeout = {lock_wait}",
            charset="utf8mb4",
            # rowcount = rows matched, not rows changed: a renewal that changes nothing
            # visible is still a renewal.
            client_flag=pymysql.constants.CLIENT.FOUND_ROWS,
            **encryption,
        )

    return Dialect(
        connect=connect,
        schema=(CREATE_TABLE, CREATE_WORKERS_TABLE, CREATE_CELLS_TABLE, CREATE_QUORUM_TABLE),
        durability=durability,
        replication=replication,
        unsafe_replication=replicated.unsafe,
        fewer_replicas=replicated.fewer,
        replication_hint=(
            "semi-synchronous replication: rpl_semi_sync_master_enabled=ON on the primary, "
            "rpl_semi_sync_slave_enabled=ON on every replica"
        ),
        failover_gap=replicated.gap,
        confirm_commit=confirm_commit,
        now_ms="CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
        begin="START TRANSACTION",
        now="UTC_TIMESTAMP(6)",
        param="%s",
        unavailable=(pymysql.err.OperationalError, pymysql.err.InterfaceError),
        duplicate=(pymysql.err.IntegrityError,),
        on_connect=("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",),
        # with unsafe_replication the replicas are accepted unwaited: not seeing them is no risk
        check_grants=(lambda cur: None) if replicated.unsafe else _check_process,
        tables="SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()",
        explain=functools.partial(_explain, tls=context is not None),
    )


def open_mysql_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The registry's opener (stores/registry.py): checks the URL, imports the driver."""
    return sql_engine("mysql", mysql_dialect(url, display, timeout=timeout), url, display)
