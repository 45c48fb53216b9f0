"""Store URLs to store objects. One module per engine; drivers are imported on first use."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from .._errors import InvalidArgument
from .base import RangeStore

DEFAULT_STORE_URL = "sqlite:///./idmint.db"
DEFAULT_TIMEOUT = 2.0

SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb", "memory")

__all__ = ["DEFAULT_STORE_URL", "RangeStore", "open_store", "redact"]


def redact(url: str) -> str:
    """`url` with its password replaced by ***, for messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))
    except ValueError:
        return url


def open_store(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> RangeStore:
    """Open the range store a URL names (default: $IDMINT_STORE, then sqlite:///./idmint.db).

    `timeout` bounds connecting and waiting for locks, in seconds. No I/O happens here: a
    store connects on first use, so an unreachable store is reported by the first operation.
    """
    url = url or os.environ.get("IDMINT_STORE") or DEFAULT_STORE_URL
    display = redact(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise InvalidArgument(
            f"bad store URL {display!r}: it must start with one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    if scheme == "sqlite":
        from .sqlite import open_sqlite

        return open_sqlite(url, timeout=timeout)
    if scheme in ("postgresql", "postgres"):
        from .postgres import open_postgres

        return open_postgres(url, display, timeout=timeout)
    if scheme in ("mysql", "mariadb"):
        from .mysql import open_mysql

        return open_mysql(url, display, timeout=timeout)
    from .memory import open_memory

    return open_memory(url)
