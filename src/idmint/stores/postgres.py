"""PostgreSQL through psycopg 3.

The counter row is locked with `SELECT ... FOR UPDATE` inside the transaction, so concurrent
allocations of one key queue on the row, and the commit is durable under PostgreSQL's default
`synchronous_commit=on`.
"""

from __future__ import annotations

from typing import Any

from .._errors import DriverMissing, InvalidArgument
from ._sql import TABLE, Dialect
from ._sql_leases import CREATE_WORKERS_TABLE

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


def postgres_dialect(url: str, display_url: str, *, timeout: float) -> Dialect:
    try:
        import psycopg
    except ImportError as exc:
        raise DriverMissing(
            "postgresql:// stores need the psycopg driver: pip install 'idmint[postgres]'"
        ) from exc

    url = url.replace("postgres://", "postgresql://", 1)
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise InvalidArgument(f"bad PostgreSQL URL {display_url!r}: {exc}") from exc

    def connect() -> Any:
        return psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=max(1, round(timeout)),
            application_name="idmint",
        )

    dialect = Dialect(
        connect=connect,
        schema=(CREATE_TABLE, CREATE_WORKERS_TABLE),
        now_ms="CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        begin="BEGIN",
        now="now()",
        param="%s",
        unavailable=(psycopg.OperationalError, psycopg.InterfaceError),
        duplicate=(psycopg.errors.UniqueViolation,),
        returning=True,
    )
    return dialect
