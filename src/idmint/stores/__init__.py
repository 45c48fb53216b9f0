"""Store URLs to store objects. One module per engine; drivers are imported on first use."""

from __future__ import annotations

import dataclasses
import functools
import os
import uuid

from .._errors import InvalidArgument
from ._urls import redact, scrub
from .base import CasStore, LeaseStore, RangeStore, StoreIdentity
from .engine import Engine
from .over_cas.loop import Backoff
from .over_cas.quorum import CasQuorumNode
from .over_cas.ranges import CasRangeStore
from .sql.cas import SqlCasStore
from .sql.leases import SqlLeaseStore
from .sql.quorum import SqlQuorumNode
from .sql.ranges import SqlRangeStore
from .sql.schema import Dialect

DEFAULT_STORE_URL = "sqlite:///./idmint.db"
DEFAULT_TIMEOUT = 2.0

SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")
#: Why a memory:// quorum node is unsafe (see QuorumNode.durability).
MEMORY_LOSES = "memory:// keeps its counters only while this process runs"
SCHEMES = (*SQL_SCHEMES, "redis", "rediss", "etcd", "zk", "cassandra", "memory")

__all__ = [
    "DEFAULT_STORE_URL",
    "Backoff",
    "CasRangeStore",
    "CasStore",
    "Engine",
    "LeaseStore",
    "RangeStore",
    "open_engine",
    "open_lease_store",
    "open_store",
    "redact",
]


def _resolve(url: str | None) -> tuple[str, str, str]:
    """(url, scheme, display) of a store URL, defaulted and checked."""
    if url is not None and not url.strip():
        raise InvalidArgument("the store URL is empty: give one, or leave it out for the default")
    url = url or os.environ.get("IDMINT_STORE") or DEFAULT_STORE_URL
    display = redact(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise InvalidArgument(
            f"bad store URL {display!r}: it must start with one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    return url, scheme, display


def _sql_dialect(scheme: str, url: str, display: str, timeout: float) -> Dialect:
    if scheme == "sqlite":
        from .sql.sqlite import sqlite_dialect

        dialect = sqlite_dialect(url, timeout=timeout)
    elif scheme in ("postgresql", "postgres"):
        from .sql.postgres import postgres_dialect

        dialect = postgres_dialect(url, display, timeout=timeout)
    else:
        from .sql.mysql import mysql_dialect

        dialect = mysql_dialect(url, display, timeout=timeout)
    # A driver's message may quote what it made of the URL: pieces of a password it misread.
    return dataclasses.replace(dialect, scrub=functools.partial(scrub, url=url))


def _cas_ranges(engine: Engine) -> CasRangeStore:
    return CasRangeStore(engine.cas())


def _sql_engine(kind: str, dialect: Dialect, display: str) -> Engine:
    # Each capability has its own connection: a long lease scan never waits behind a range.
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


def open_engine(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> Engine:
    """The engine a store URL names (default: $IDMINT_STORE, then sqlite:///./idmint.db),
    with the capabilities it has: ranges (segment keys), leases (snowflake worker ids), cas.

    `timeout` bounds connecting and each round trip, in seconds. No I/O happens here: a
    capability connects on first use, so an unreachable store is reported by the first
    operation; a bad URL or a missing driver is reported here.
    """
    url, scheme, display = _resolve(url)
    if scheme == "memory":
        from .memory.cas import open_memory_cas
        from .memory.leases import open_memory_leases

        # One store, one identity, whichever capability is asked (named stores keep theirs).
        identity = StoreIdentity(uuid.uuid4().hex, None)
        return Engine(
            "memory",
            display,
            {
                "ranges": _cas_ranges,
                "leases": lambda _: open_memory_leases(url, identity),
                "cas": lambda _: open_memory_cas(url, identity),
                "quorum": lambda engine: CasQuorumNode(engine.cas(), durability=MEMORY_LOSES),
            },
        )
    if scheme in ("redis", "rediss"):
        from .redis import open_redis_engine

        return open_redis_engine(url, display, timeout=timeout)
    if scheme == "etcd":
        from .etcd import open_etcd_engine

        return open_etcd_engine(url, display, timeout=timeout)
    if scheme == "zk":
        from .zookeeper import open_zookeeper_engine

        return open_zookeeper_engine(url, display, timeout=timeout)
    if scheme == "cassandra":
        from .cassandra import open_cassandra_engine

        return open_cassandra_engine(url, display, timeout=timeout)
    kind = {"postgres": "postgresql", "mariadb": "mysql"}.get(scheme, scheme)
    return _sql_engine(kind, _sql_dialect(scheme, url, display, timeout), display)


def open_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> RangeStore:
    """The segment-key store of a URL's engine: `open_engine(url).ranges()`."""
    return open_engine(url, timeout=timeout).ranges()


def open_lease_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> LeaseStore:
    """The worker-lease store of a URL's engine: `open_engine(url).leases()`."""
    return open_engine(url, timeout=timeout).leases()
