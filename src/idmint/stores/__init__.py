"""Store URLs to store objects: one folder per engine (stores/registry.py lists them); a
driver is imported when a URL of its engine is opened."""

from __future__ import annotations

import os

from .._errors import InvalidArgument
from ._urls import redact
from .base import CasStore, LeaseStore, RangeStore
from .engine import Engine
from .over_cas.loop import Backoff
from .over_cas.ranges import CasRangeStore
from .registry import row_of

DEFAULT_STORE_URL = "sqlite:///./idmint.db"
DEFAULT_TIMEOUT = 2.0

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


def open_engine(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> Engine:
    """The engine a store URL names (default: $IDMINT_STORE, then sqlite:///./idmint.db),
    with the capabilities it has: ranges (segment keys), leases (snowflake worker ids), cas.
    Which module opens which scheme is stores/registry.py's table.

    `timeout` bounds connecting and each round trip, in seconds. No I/O happens here: a
    capability connects on first use, so an unreachable store is reported by the first
    operation; a bad URL or a missing driver is reported here.
    """
    if url is not None and not url.strip():
        raise InvalidArgument("the store URL is empty: give one, or leave it out for the default")
    url = url or os.environ.get("IDMINT_STORE") or DEFAULT_STORE_URL
    display = redact(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    engine: Engine = row_of(scheme, display).open(url, display, timeout=timeout)
    return engine


def open_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> RangeStore:
    """The segment-key store of a URL's engine: `open_engine(url).ranges()`."""
    return open_engine(url, timeout=timeout).ranges()


def open_lease_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> LeaseStore:
    """The worker-lease store of a URL's engine: `open_engine(url).leases()`."""
    return open_engine(url, timeout=timeout).leases()
