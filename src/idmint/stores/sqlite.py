"""SQLite: the embedded default. Safe for many processes on one host.

`BEGIN IMMEDIATE` takes the database's write lock before reading the counter, so two processes
can never read the same `max_id`; other writers wait up to the busy timeout. WAL lets readers
(`keys list`) proceed meanwhile, and `synchronous=FULL` makes every commit durable before it
returns, so a power cut cannot roll a counter back under ids already served.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from .._errors import InvalidArgument
from ._sql import TABLE, Dialect
from ._sql_leases import CREATE_WORKERS_TABLE

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
            f"bad SQLite URL {url!r}: use sqlite:///relative/path.db or sqlite:////absolute/path.db"
        )
    return url[len(prefix) :]


def sqlite_dialect(url: str, *, timeout: float) -> Dialect:
    path = sqlite_path(url)
    if path != ":memory:" and not Path(path).parent.is_dir():
        raise InvalidArgument(
            f"bad SQLite URL {url!r}: directory {Path(path).parent} does not exist"
        )

    def connect() -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, as on the other engines.
        return sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)

    dialect = Dialect(
        connect=connect,
        schema=(CREATE_TABLE, CREATE_WORKERS_TABLE),
        now_ms="CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
        begin="BEGIN IMMEDIATE",
        for_update="",
        now="strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
        param="?",
        unavailable=(sqlite3.OperationalError,),
        duplicate=(sqlite3.IntegrityError,),
        greatest="max",
        returning=sqlite3.sqlite_version_info >= (3, 35),
        on_connect=(
            "PRAGMA journal_mode=WAL",
            "PRAGMA synchronous=FULL",
            f"PRAGMA busy_timeout={int(timeout * 1000)}",
        ),
    )
    return dialect
