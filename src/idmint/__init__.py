"""idmint: short, unique integer ids from the databases you already run.

import idmint

minter = idmint.connect()                  # sqlite:///./idmint.db
minter.add_key("order", start=100_000_000)
orders = minter.segment("order")
orders.next_id()
minter.close()                             # gives unused ids back
"""

from typing import TYPE_CHECKING, Any

from ._errors import (
    ClockMovedBackwards,
    Closed,
    CounterWentBack,
    DatacenterRetired,
    DriverMissing,
    Exhausted,
    IdmintError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    LeaseLost,
    LostReservations,
    NameTaken,
    QuorumUnavailable,
    RunwaySpent,
    StoreUnavailable,
    WorkerInUse,
    WorkersExhausted,
    WrongKind,
)
from ._minter import Minter, connect, open_quorum
from .aio import AsyncSegment
from .ids import ID_MAX, UINT31_MAX, Key, Range
from .keyspace import QuorumKey
from .layout import Decoded, Layout
from .stores import DEFAULT_STORE_URL, RangeStore, open_store
from .strategies.datacenter import DatacenterRanges
from .strategies.datacenter_cells import DatacenterStatus, ReservationSizing
from .strategies.quorum import QuorumGenerator
from .strategies.quorum_nodes import QuorumOptions, QuorumStats
from .strategies.refills import SegmentOptions
from .strategies.segment import SegmentGenerator, SegmentStats
from .strategies.snowflake import SnowflakeGenerator, SnowflakeOptions

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .client import AsyncClient, Client


def __getattr__(name: str) -> Any:
    # The HTTP clients import httpx; load them only when asked for, to keep the CLI quick.
    if name in ("Client", "AsyncClient"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'idmint' has no attribute {name!r}")


__all__ = [
    "DEFAULT_STORE_URL",
    "ID_MAX",
    "UINT31_MAX",
    "AsyncClient",
    "AsyncSegment",
    "Client",
    "ClockMovedBackwards",
    "Closed",
    "CounterWentBack",
    "DatacenterRanges",
    "DatacenterRetired",
    "DatacenterStatus",
    "Decoded",
    "DriverMissing",
    "Exhausted",
    "IdmintError",
    "InvalidArgument",
    "Key",
    "KeyExists",
    "KeyNotFound",
    "Layout",
    "LeaseLost",
    "LostReservations",
    "Minter",
    "NameTaken",
    "QuorumGenerator",
    "QuorumKey",
    "QuorumOptions",
    "QuorumStats",
    "QuorumUnavailable",
    "Range",
    "RangeStore",
    "ReservationSizing",
    "RunwaySpent",
    "SegmentGenerator",
    "SegmentOptions",
    "SegmentStats",
    "SnowflakeGenerator",
    "SnowflakeOptions",
    "StoreUnavailable",
    "WorkerInUse",
    "WorkersExhausted",
    "WrongKind",
    "__version__",
    "connect",
    "open_quorum",
    "open_store",
]
