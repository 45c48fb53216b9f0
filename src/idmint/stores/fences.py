"""How a failover's fence moves the counters kept in compare-and-set cells (issue 20).

A fence (stores/replication.py) moves every counter past what a lost primary may have handed
out. The stores do not know what a cell holds: each cell format's owner registers, by the
prefix of its cells' names, how its counters move up (`over_cas/ranges.py`: segment keys, `key/`;
`strategies.datacenter`: datacenter keys, `dc/`). Both register when imported, and importing
any store module imports the package first (idmint/__init__.py imports the strategies), so
every process that can meet a failover knows every format.
"""

from __future__ import annotations

from collections.abc import Callable

#: (cell name, value as stored, gap) -> the value with its counters `gap` ids further on.
CellFence = Callable[[str, str, int], str]

_fences: dict[str, CellFence] = {}


def register(prefix: str, fence: CellFence) -> None:
    """Cells whose names start with `prefix` are moved by `fence`."""
    _fences[prefix] = fence


def prefixes() -> list[str]:
    """The prefixes of the cells a fence moves."""
    return sorted(_fences)


def fenced(name: str, value: str, gap: int) -> str | None:
    """Cell `name`'s value moved up `gap` ids, or None when it holds no counter."""
    for prefix, fence in _fences.items():
        if name.startswith(prefix):
            return fence(name, value, gap)
    return None
