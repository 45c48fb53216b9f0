"""The in-process engine, for strategy tests and trying idmint out: cas.py (cells, hence
segment keys over them) and leases.py (worker leases in a dict)."""

from __future__ import annotations

import uuid

from ..base import StoreIdentity
from ..engine import Engine
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore
from .cas import open_memory_cas
from .leases import open_memory_leases

#: Why a memory:// quorum node is unsafe (see QuorumNode.durability).
MEMORY_LOSES = "memory:// keeps its counters only while this process runs"


def open_memory_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The registry's opener (stores/registry.py). `timeout` is unused: nothing waits."""
    # One store, one identity, whichever capability is asked (named stores keep theirs).
    identity = StoreIdentity(uuid.uuid4().hex, None)
    return Engine(
        "memory",
        display,
        {
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": lambda _: open_memory_leases(url, identity),
            "cas": lambda _: open_memory_cas(url, identity),
            "quorum": lambda engine: CasQuorumNode(engine.cas(), durability=MEMORY_LOSES),
        },
    )
