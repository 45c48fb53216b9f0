"""Every engine idmint knows, one row each: its URL schemes, the module that opens it, the
extra that installs its driver, and the capabilities it has. `open_engine` (stores/__init__.py),
the engine names in messages (engine.py) and the documentation's tables all read this list,
so an engine is added here once (docs/design.md, "How to add an engine").

A row names its module as text: nothing here imports an engine, so a driver is imported only
when a URL of its engine is opened.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidArgument

#: What an engine can do (see engine.py): segment keys, snowflake worker leases,
#: compare-and-set cells, quorum nodes.
ALL = frozenset({"ranges", "leases", "cas", "quorum"})


@dataclass(frozen=True)
class EngineRow:
    """One engine. `opener` is "module:function" under idmint.stores; the function takes
    (url, display, *, timeout) and returns the Engine, doing no I/O."""

    kind: str
    schemes: tuple[str, ...]
    opener: str
    #: `pip install 'idmint[extra]'` brings the driver; None when the standard library has it.
    extra: str | None
    capabilities: frozenset[str] = ALL

    def open(self, url: str, display: str, *, timeout: float) -> Any:
        """The row's Engine (typed by open_engine: engine.py imports this module, so this
        module does not name Engine)."""
        module, _, function = self.opener.partition(":")
        return getattr(importlib.import_module(module, __package__), function)(
            url, display, timeout=timeout
        )


#: The engines idmint ships.
SHIPPED: tuple[EngineRow, ...] = (
    EngineRow("sqlite", ("sqlite",), ".sql.sqlite:open_sqlite_engine", None),
    EngineRow(
        "postgresql", ("postgresql", "postgres"), ".sql.postgres:open_postgres_engine", "postgres"
    ),
    EngineRow("mysql", ("mysql", "mariadb"), ".sql.mysql:open_mysql_engine", "mysql"),
    # redis+sentinel://: the primary a set of Redis Sentinels names (stores/redis/__init__.py).
    EngineRow(
        "redis",
        ("redis", "rediss", "redis+sentinel", "rediss+sentinel"),
        ".redis:open_redis_engine",
        "redis",
    ),
    EngineRow("etcd", ("etcd",), ".etcd:open_etcd_engine", None),
    EngineRow("zookeeper", ("zk",), ".zookeeper:open_zookeeper_engine", "zookeeper"),
    # No quorum nodes: a quorum of Cassandra nodes would be one cluster's Paxos, not
    # independent nodes (docs/quorum.md).
    EngineRow(
        "cassandra",
        ("cassandra",),
        ".cassandra:open_cassandra_engine",
        "cassandra",
        ALL - {"quorum"},
    ),
    EngineRow("memory", ("memory",), ".memory:open_memory_engine", None),
)
#: The engines this process knows: those shipped, and any `register` added.
ENGINES: list[EngineRow] = list(SHIPPED)


def register(row: EngineRow) -> None:
    """Add an engine (or replace the one of that kind): for an engine kept outside idmint.
    Its module may then be any importable module (an absolute name in `opener`)."""
    taken = {s for other in ENGINES if other.kind != row.kind for s in other.schemes}
    if taken & set(row.schemes):
        raise ValueError(f"schemes {sorted(taken & set(row.schemes))} belong to another engine")
    ENGINES[:] = [other for other in ENGINES if other.kind != row.kind] + [row]


def schemes() -> tuple[str, ...]:
    return tuple(s for row in ENGINES for s in row.schemes)


def engines_with(capability: str) -> tuple[str, ...]:
    return tuple(row.kind for row in ENGINES if capability in row.capabilities)


def row_of(scheme: str, display: str) -> EngineRow:
    """The engine of a URL's scheme, or InvalidArgument naming the schemes there are."""
    for row in ENGINES:
        if scheme in row.schemes:
            return row
    raise InvalidArgument(
        f"bad store URL {display!r}: it must start with one of "
        + ", ".join(f"{s}://" for s in schemes())
    )
