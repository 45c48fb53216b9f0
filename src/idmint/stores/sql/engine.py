"""The Engine of a SQL store: each capability on its own connection (so a long lease scan
never waits behind a range), every statement written once for every dialect."""

from __future__ import annotations

import dataclasses
import functools

from .._urls import scrub
from ..engine import Engine
from .cas import SqlCasStore
from .leases import SqlLeaseStore
from .quorum import SqlQuorumNode
from .ranges import SqlRangeStore
from .schema import Dialect


def sql_engine(kind: str, dialect: Dialect, url: str, display: str) -> Engine:
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
