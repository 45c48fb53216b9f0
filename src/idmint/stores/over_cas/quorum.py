"""A quorum node over any compare-and-set store: set-if-less-than as read, then swap.

Engines with a one-statement set-if-less-than have their own node (Redis: a Lua script; SQL:
one conditional UPDATE); this one serves the others (memory://, etcd, ZooKeeper). A key's
counter is the cell `quorum/{key}`, its value the decimal counter.
"""

from __future__ import annotations

from ..._errors import StoreUnavailable
from ..base import CasStore, StoreIdentity

QUORUM_PREFIX = "quorum/"

#: Swaps lost to other writers of the same cell before a claim gives up: each loss means
#: another caller moved the counter, which for a quorum key is a lost round anyway.
MAX_LOST_SWAPS = 20


class CasQuorumNode:
    """QuorumNode on a CasStore. A claim reads the cell and swaps it if the counter is below
    `start`: the swap applies only on the version it read, so the check and the write are
    one atomic step, as in the engines' own scripts."""

    def __init__(self, cas: CasStore, *, durability: str | None = None) -> None:
        self.cas = cas
        self.display_url = cas.display_url
        self._durability = durability

    def read(self, key: str) -> int:
        got = self.cas.read(QUORUM_PREFIX + key)
        return 0 if got is None else int(got[0])

    def claim(self, key: str, start: int, end: int) -> tuple[bool, int]:
        cell = QUORUM_PREFIX + key
        for _ in range(MAX_LOST_SWAPS):
            got = self.cas.read(cell)
            if got is None:
                if self.cas.create(cell, str(end)):
                    return True, end
                continue
            current = int(got[0])
            if current >= start:
                return False, current
            if self.cas.swap(cell, got[1], str(end)):
                return True, end
        raise StoreUnavailable(
            f"store {self.display_url}: key {key!r} changed under {MAX_LOST_SWAPS} swaps in a row"
        )

    def durability(self) -> str | None:
        return self._durability

    def identity(self) -> StoreIdentity | None:
        return self.cas.identity()

    def close(self) -> None:
        self.cas.close()
