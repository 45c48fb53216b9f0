"""A toy engine, kept outside idmint the way docs/design.md ("How to add an engine") says:
compare-and-set cells in a directory (cells.py), one opener here, one registry row (ROW).
Segment keys, worker leases and quorum nodes come from idmint's code over any CasStore.

    toy:///path/to/dir

It is a real store, if a small one: processes on one host share it through the directory,
every change is fsynced before it is acknowledged, and its clock is the host's, which every
process on the host shares. tests/test_toy_engine.py runs idmint's contract suites on it.
"""

from __future__ import annotations

import time

from idmint.stores.engine import Engine
from idmint.stores.over_cas.leases import CasLeaseStore
from idmint.stores.over_cas.quorum import CasQuorumNode
from idmint.stores.over_cas.ranges import CasRangeStore
from idmint.stores.registry import ALL, EngineRow

from .cells import DirectoryCells

ROW = EngineRow("toy", ("toy",), "toy_engine:open_toy_engine", None, ALL)


def open_toy_engine(url: str, display: str, *, timeout: float) -> Engine:
    """The registry's opener: no I/O here (the directory is made on first use)."""
    directory = url[len("toy://") :]

    def now_ms() -> int:
        return time.time_ns() // 1_000_000  # the host's clock: the store lives on this host

    return Engine(
        "toy",
        display,
        {
            "cas": lambda _: DirectoryCells(directory, display, timeout=timeout),
            "ranges": lambda engine: CasRangeStore(engine.cas()),
            "leases": lambda engine: CasLeaseStore(engine.cas(), now_ms),
            "quorum": lambda engine: CasQuorumNode(engine.cas(), durability=None),
        },
    )
