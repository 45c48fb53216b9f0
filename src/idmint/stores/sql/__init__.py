"""The SQL engines (SQLite, PostgreSQL, MySQL/MariaDB): connection.py (the schema, the
`Dialect` each engine supplies, one connection with one transaction per operation), and the
capabilities over it, written once for every dialect: ranges.py (segment keys, one statement
per range), cells.py (compare-and-set cells, quorum nodes), leases.py. sqlite.py, postgres.py
and mysql.py are the dialects: how each connects, what it calls now, how it reports
replication."""

from __future__ import annotations

import dataclasses
import functools

from .._urls import scrub
from ..engine import Engine
from .cells import SqlCasStore, SqlQuorumNode
from .connection import Dialect
from .leases import SqlLeaseStore
from .ranges import SqlRangeStore


def sql_engine(kind: str, dialect: Dialect, url: str, display: str) -> Engine:
    """A SQL store's Engine: each capability on its own connection (so a long lease scan never
    waits behind a range)."""
    # A driver's message may quote what it made of the URL: pieces of a password it misread.
    dialect = dataclasses.replace(dialect, scrub=functools.partial(scrub, url=url))
    return Engine(
        kind,
        display,
        {
            "ranges": lambda _: SqlRangeStore(dialect, display),
            "leases": lambda _: SqlLeaseStore(dialect, display),
            "cas": lambda _: SqlCasStore(dialect, display),
            "quorum": lambda _: SqlQuorumNode(dialect, display),
        },
    )
