"""SQLite: the embedded default. Safe for many processes on one host.

`BEGIN IMMEDIATE` takes the database's write lock before reading the counter, so two processes
can never read the same `max_id`; other writers wait up to the busy timeout. WAL lets readers
(`keys list`) proceed meanwhile, and `synchronous=FULL` makes every commit durable before it
returns, so a power cut cannot roll a counter back under ids already served. (Switching a new
file to WAL needs retries of its own: see set_wal.)
"""

from __future__ import annotations

import random
import sqlite3
import time
from pathlib import Path

from ..._errors import InvalidArgument
from .._urls import redact
from ..engine import Engine
from . import sql_engine
from .connection import TABLE, Dialect
from .leases import CREATE_WORKERS_TABLE

CREATE_TABLE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    name        TEXT    PRIMARY KEY,
    max_id      INTEGER NOT NULL,
    step        INTEGER NOT NULL,
    first_id    INTEGER NOT NULL,
    last_id     INTEGER NOT NULL,
    description TEXT    NOT NULL DEFAULT '',
    updated_at  TEXT    NOT NULL,
    max_batch   INTEGER NOT NULL DEFAULT 0
)
"""


def sqlite_path(url: str) -> str:
    """The file of a `sqlite:///path` URL: `sqlite:///./x.db` and `sqlite:///x.db` are relative,
    `sqlite:////abs/x.db` is absolute (SQLAlchemy's convention)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise InvalidArgument(
            f"bad SQLite URL {redact(url)!r}: "
            "use sqlite:///relative/path.db or sqlite:////absolute/path.db"
        )
    path = url[len(prefix) :]
    if "?" in path or "#" in path:
        raise InvalidArgument(
            f"bad SQLite URL {redact(url)!r}: it takes no parameters (a file name with ? or # "
            "is not supported)"
        )
    return path


SQLITE_BUSY = 5  # the primary result code; extended codes (SQLITE_BUSY_RECOVERY...) add high bits


def set_wal(conn: sqlite3.Connection, timeout: float) -> None:
    """`PRAGMA journal_mode=WAL`, retried while it fails with SQLITE_BUSY, for up to `timeout`.

    On a file that is new, or that another process is switching to WAL at the same moment,
    SQLite returns SQLITE_BUSY here without calling the busy handler, so the connection's busy
    timeout does not apply. Each retry waits a little longer, at random, so that processes that
    collided do not collide again."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
            return
        except sqlite3.OperationalError as exc:
            left = deadline - time.monotonic()
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != SQLITE_BUSY or left <= 0:
                raise
            time.sleep(min(left, random.uniform(pause / 2, pause)))
            pause = min(pause * 2, 0.05)


def sqlite_dialect(url: str, *, timeout: float) -> Dialect:
    path = sqlite_path(url)
    if path != ":memory:" and not Path(path).parent.is_dir():
        raise InvalidArgument(
            f"bad SQLite URL {redact(url)!r}: directory {Path(path).parent} does not exist"
        )

    def connect() -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, as on the other engines.
        conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        try:
            set_wal(conn, timeout)
        except sqlite3.DatabaseError as exc:
            conn.close()
            if isinstance(exc, sqlite3.OperationalError):  # locked, unreadable: for now
                raise
            raise InvalidArgument(
                f"store {redact(url)}: {path} is not a SQLite database ({exc})"
            ) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    return Dialect(
        connect=connect,
        schema=(CREATE_TABLE, CREATE_WORKERS_TABLE),
        now_ms="CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
        begin="BEGIN IMMEDIATE",
        for_update="",
        now="strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
        unavailable=(sqlite3.OperationalError,),
        duplicate=(sqlite3.IntegrityError,),
        greatest="max",
        returning=sqlite3.sqlite_version_info >= (3, 35),
        on_connect=(  # journal_mode=WAL is set by connect()
            "PRAGMA synchronous=FULL",
            f"PRAGMA busy_timeout={int(timeout * 1000)}",
        ),
    )


def open_sqlite_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The registry's opener (stores/registry.py): checks the URL, imports the driver."""
    return sql_engine("sqlite", sqlite_dialect(url, timeout=timeout), url, display)
