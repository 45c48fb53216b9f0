"""The in-process engine, for strategy unit tests and trying idmint out: compare-and-set cells
in a dict (hence segment keys over them, see over_cas/ranges.py) and worker leases in a dict,
by the same protocol as the real lease stores (lease_protocol.py).

Both meet the same contracts as the real stores (the contract suites run on them), but they
live and die with the process. `memory://NAME` stores are shared within a process by name;
`memory://` is a new, private store each time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

from ..base import Lease, StoreIdentity, WorkerInfo
from ..engine import Engine
from ..lease_protocol import LOST, FencedLeases, Found, Request, Taken
from ..over_cas.loop import Backoff
from ..over_cas.quorum import CasQuorumNode
from ..over_cas.ranges import CasRangeStore

S = TypeVar("S")

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
        pass  # nothing to create: the dict is the whole schema

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
        pass  # nothing held open: the cells live as long as the object


class MemoryRangeStore(CasRangeStore):
    """Segment keys over a private MemoryCasStore: the generic ranges-over-CAS code, in tests."""

    def __init__(self, display_url: str = "memory://", *, backoff: Backoff | None = None) -> None:
        super().__init__(MemoryCasStore(display_url), backoff=backoff)


@dataclass
class _Slot:
    owner: str = ""
    expires: float = 0.0
    horizon_ms: int = 0
    host: str = ""


class _Acquisition:
    """One acquire, under the store's lock (so its take never loses a race): the table is the
    dict itself."""

    def __init__(self, store: MemoryLeaseStore, request: Request) -> None:
        self._store, self._request = store, request
        self._now = store._clock()

    def _slot(self, worker_id: int) -> _Slot:
        return self._store._slots.setdefault((self._request.namespace, worker_id), _Slot())

    def read(self) -> _Acquisition:
        return self

    def held(self, worker_id: int) -> bool:
        slot = self._slot(worker_id)
        return bool(slot.owner) and slot.expires > self._now

    def reserved(self, worker_id: int) -> bool:
        return (self._request.namespace, worker_id) in self._store._reserved

    def floor_ms(self, worker_id: int) -> int:
        return self._slot(worker_id).horizon_ms

    def holder(self, worker_id: int) -> tuple[str, float | None]:
        slot = self._slot(worker_id)
        return slot.host, slot.expires - self._now

    def take(self, table: _Acquisition, worker_id: int, horizon_ms: int) -> Taken:
        request = self._request
        if request.claim is not None:
            self._store._reserved.add((request.namespace, worker_id))
        taken = self._slot(worker_id)
        floor = taken.horizon_ms
        taken.owner, taken.expires = request.owner, self._now + request.ttl
        taken.horizon_ms = max(floor, horizon_ms)
        taken.host = "memory"
        # The identity's id only: no creation time (see MemoryLeaseStore).
        identity = StoreIdentity(self._store._identity.id, None)
        return Taken(floor, taken.horizon_ms, identity=identity)


class MemoryLeaseStore(FencedLeases):
    """Leases judged by one clock (`clock`, monotonic seconds by default), under one lock."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, identity: StoreIdentity | None = None
    ) -> None:
        self.display_url = "memory://"
        self._clock = clock
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._reserved: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        # No creation time: a store in this process's memory cannot lose its data under a
        # holder that lives on.
        self._identity = identity or StoreIdentity(uuid.uuid4().hex, None)

    @contextmanager
    def _acquiring(self, request: Request) -> Iterator[_Acquisition]:
        with self._lock:
            yield _Acquisition(self, request)

    def _refresh(self, lease: Lease, horizon_ms: int, expected_ms: int) -> Lease | Found:
        with self._lock:
            slot = self._slots.get((lease.namespace, lease.worker_id))
            if slot is None or slot.owner != lease.owner:
                return LOST
            if slot.horizon_ms < lease.horizon_ms:
                return Found(True, slot.horizon_ms)
            slot.expires = self._clock() + lease.ttl
            slot.horizon_ms = max(slot.horizon_ms, horizon_ms)
            return replace(lease, horizon_ms=slot.horizon_ms, store_id=self._identity.id)

    def _free(self, lease: Lease, horizon_ms: int | None) -> None:
        with self._lock:
            slot = self._slots.get((lease.namespace, lease.worker_id))
            if slot is not None and slot.owner == lease.owner:
                slot.owner, slot.expires = "", 0.0
                if horizon_ms is not None:
                    slot.horizon_ms = horizon_ms

    def _rows(self, namespace: str) -> list[WorkerInfo]:
        with self._lock:
            now = self._clock()
            return [
                WorkerInfo(
                    ns,
                    wid,
                    s.owner,
                    s.host,
                    (s.expires - now) if s.owner else None,
                    s.horizon_ms,
                    static=(ns, wid) in self._reserved,
                )
                for (ns, wid), s in sorted(self._slots.items())
                if ns == namespace
            ]

    def unreserve(self, namespace: str, worker_id: int) -> bool:
        with self._lock:
            if (namespace, worker_id) not in self._reserved:
                return False
            self._reserved.discard((namespace, worker_id))
            return True

    def identity(self) -> StoreIdentity | None:
        return self._identity

    def close(self) -> None:
        pass  # nothing held open: the table lives as long as the object


# Named stores, and the identity of each (one for its cells and its leases).
_named_cells: dict[str, MemoryCasStore] = {}
_named_leases: dict[str, MemoryLeaseStore] = {}
_identities: dict[str, StoreIdentity] = {}
_named_lock = threading.Lock()


def _named(stores: dict[str, S], name: str, make: Callable[[StoreIdentity], S]) -> S:
    """The store `memory://NAME` of a kind, made with the name's identity on first ask."""
    with _named_lock:
        identity = _identities.setdefault(name, StoreIdentity(uuid.uuid4().hex, None))
        if name not in stores:
            stores[name] = make(identity)
        return stores[name]


def open_memory_cas(url: str, identity: StoreIdentity | None = None) -> MemoryCasStore:
    """`memory://NAME` stores are shared within a process by name; `memory://` is new each time
    (with `identity`, the one its engine's leases have)."""
    name = url[len("memory://") :]
    if not name:
        return MemoryCasStore(url, identity=identity)
    return _named(_named_cells, name, lambda named: MemoryCasStore(url, identity=named))


def open_memory_leases(url: str, identity: StoreIdentity | None = None) -> MemoryLeaseStore:
    """As `open_memory_cas`, for leases (with `identity`, the one its engine's cells have)."""
    name = url[len("memory://") :]
    if not name:
        return MemoryLeaseStore(identity=identity)
    return _named(_named_leases, name, lambda named: MemoryLeaseStore(identity=named))
