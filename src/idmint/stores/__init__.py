"""Store URLs to store objects. One module per engine; drivers are imported on first use."""

from __future__ import annotations

import dataclasses
import functools
import os

from .._errors import InvalidArgument
from ._sql import Dialect, SqlRangeStore
from ._sql_leases import SqlLeaseStore
from ._urls import redact, scrub
from .base import LeaseStore, RangeStore

DEFAULT_STORE_URL = "sqlite:///./idmint.db"
DEFAULT_TIMEOUT = 2.0

SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb", "memory")
LEASE_SCHEMES = (*SCHEMES, "redis", "rediss", "etcd", "zk")

__all__ = [
    "DEFAULT_STORE_URL",
    "LeaseStore",
    "RangeStore",
    "open_lease_store",
    "open_store",
    "redact",
]


def _resolve(url: str | None, schemes: tuple[str, ...]) -> tuple[str, str, str]:
    """(url, scheme, display) of a store URL, defaulted and checked against `schemes`."""
    url = url or os.environ.get("IDMINT_STORE") or DEFAULT_STORE_URL
    display = redact(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in schemes:
        raise InvalidArgument(
            f"bad store URL {display!r}: it must start with one of "
            + ", ".join(f"{s}://" for s in schemes)
        )
    return url, scheme, display


def _sql_dialect(scheme: str, url: str, display: str, timeout: float) -> Dialect:
    if scheme == "sqlite":
        from .sqlite import sqlite_dialect

        dialect = sqlite_dialect(url, timeout=timeout)
    elif scheme in ("postgresql", "postgres"):
        from .postgres import postgres_dialect

        dialect = postgres_dialect(url, display, timeout=timeout)
    else:
        from .mysql import mysql_dialect

        dialect = mysql_dialect(url, display, timeout=timeout)
    # A driver's message may quote what it made of the URL: pieces of a password it misread.
    return dataclasses.replace(dialect, scrub=functools.partial(scrub, url=url))


def open_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> RangeStore:
    """Open the range store a URL names (default: $IDMINT_STORE, then sqlite:///./idmint.db).

    `timeout` bounds connecting and waiting for locks, in seconds. No I/O happens here: a
    store connects on first use, so an unreachable store is reported by the first operation.
    """
    url, scheme, display = _resolve(url, SCHEMES)
    if scheme == "memory":
        from .memory import open_memory

        return open_memory(url)
    return SqlRangeStore(_sql_dialect(scheme, url, display, timeout), display)


def open_lease_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> LeaseStore:
    """Open the worker-id lease store a URL names: the range stores' URLs, plus redis://,
    etcd:// and zk://. Lazy like open_store."""
    url, scheme, display = _resolve(url, LEASE_SCHEMES)
    if scheme == "memory":
        from .memory_leases import open_memory_leases

        return open_memory_leases(url)
    if scheme in ("redis", "rediss"):
        from .redis import open_redis_leases

        return open_redis_leases(url, display, timeout=timeout)
    if scheme == "etcd":
        from .etcd import open_etcd_leases

        return open_etcd_leases(url, display, timeout=timeout)
    if scheme == "zk":
        from .zookeeper import open_zookeeper_leases

        return open_zookeeper_leases(url, display, timeout=timeout)
    return SqlLeaseStore(_sql_dialect(scheme, url, display, timeout), display)
