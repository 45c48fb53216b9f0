"""An in-process store: for strategy unit tests and trying idmint out.

Its compare-and-set cells (and the ranges built on them, see over_cas/ranges.py) meet the same
contracts as the real stores (the contract suites run on it), but they live and die with the
process. `memory://NAME` stores are shared within a process by name; `memory://` is a new,
private store each time.
"""

from __future__ import annotations

import threading
import uuid

from ..base import StoreIdentity
from ..over_cas.loop import Backoff
from ..over_cas.ranges import CasRangeStore

_named: dict[str, MemoryCasStore] = {}
_identities: dict[str, StoreIdentity] = {}  # of named stores: their cells' and leases'
_named_lock = threading.Lock()


class MemoryCasStore:
    """A CasStore in a dict, every operation under one lock."""

    def __init__(
        self, display_url: str = "memory://", *, identity: StoreIdentity | None = None
    ) -> None:
        self.display_url = display_url
        self._cells: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._versions = 0
        self._identity = identity or StoreIdentity(uuid.uuid4().hex, None)

    def init(self) -> None:
        pass

    def identity(self) -> StoreIdentity | None:
        return self._identity

    def read(self, key: str) -> tuple[str, int] | None:
        with self._lock:
            return self._cells.get(key)

    def _put(self, key: str, value: str) -> None:
        self._versions += 1
        self._cells[key] = (value, self._versions)

    def create(self, key: str, value: str) -> bool:
        with self._lock:
            if key in self._cells:
                return False
            self._put(key, value)
            return True

    def swap(self, key: str, version: int, value: str) -> bool:
        with self._lock:
            cell = self._cells.get(key)
            if cell is None or cell[1] != version:
                return False
            self._put(key, value)
            return True

    def scan(self, prefix: str) -> list[tuple[str, str]]:
        with self._lock:
            return sorted((k, v) for k, (v, _) in self._cells.items() if k.startswith(prefix))

    def close(self) -> None:
        pass


class MemoryRangeStore(CasRangeStore):
    """Segment keys over a private MemoryCasStore: the generic ranges-over-CAS code, in tests."""

    def __init__(self, display_url: str = "memory://", *, backoff: Backoff | None = None) -> None:
        super().__init__(MemoryCasStore(display_url), backoff=backoff)


def named_identity(name: str) -> StoreIdentity:
    """The identity of the memory store `memory://NAME`: one for its cells and its leases."""
    with _named_lock:
        return _identities.setdefault(name, StoreIdentity(uuid.uuid4().hex, None))


def open_memory_cas(url: str, identity: StoreIdentity | None = None) -> MemoryCasStore:
    """`memory://NAME` stores are shared within a process by name; `memory://` is new each time
    (with `identity`, the one its engine's leases have)."""
    name = url[len("memory://") :]
    if not name:
        return MemoryCasStore(url, identity=identity)
    identity = named_identity(name)
    with _named_lock:
        store = _named.get(name)
        if store is None:
            store = _named[name] = MemoryCasStore(url, identity=identity)
        return store
